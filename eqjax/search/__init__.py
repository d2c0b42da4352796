"""Mixed-precision search: per-layer candidates and errors (:mod:`~eqjax.search.layers`), the
multiple-choice knapsack (:mod:`~eqjax.search.knapsack`), KL sensitivity probes
(:mod:`~eqjax.search.sensitivity`), the search itself (:mod:`~eqjax.search.allocate`) and the
size/perplexity front (:mod:`~eqjax.search.pareto`)."""
