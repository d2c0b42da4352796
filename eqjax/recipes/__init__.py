"""Recipes: step chains (:mod:`~eqjax.recipes.types`), weight rules (:mod:`~eqjax.recipes.rules`), typed
validation of recipe files (:mod:`~eqjax.recipes.schema`), the registry of step types and named recipes
(:mod:`~eqjax.recipes.registry`), argument checks (:mod:`~eqjax.recipes.checks`) and running a recipe
(:mod:`~eqjax.recipes.apply`)."""
