"""Running a recipe: :func:`quantize` checks the params and the recipe, builds the :class:`Context`
(tracing the model, calibration batches) and runs the steps in order, refusing a non-finite result.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from eqjax.calibration.calibrate import as_batches
from eqjax.core.errors import NonFiniteError, NonFiniteResult, RecipeError
from eqjax.core.pytree import Params, flatten_with_paths
from eqjax.core.validate import NonFiniteParamsError, check_params
from eqjax.recipes.checks import check_model_arg, check_params_arg, check_quantized_something, check_recipe_fits, check_rule_patterns
from eqjax.recipes.registry import resolve_recipe
from eqjax.recipes.types import Context, Recipe, window_batches, with_paths

log = logging.getLogger("eqjax")

def model_context(model: Any, params: Params, calibration: Any = None, *, example: Any = None,
                  blocks: str | None = None, seed: int = 0, progress: bool = False) -> Context:
    """A :class:`Context` for eqjax's own :class:`~eqjax.models.Model` (token windows as calibration)
    or for any callable ``fn(params, *args)`` (calibration: an iterable of argument tuples)."""

    if model is None:
        return Context(template=params, seed=seed, progress=progress)
    check_model_arg(model, "model= of eqjax.quantize(params, recipe, model=...)")
    if hasattr(model, "apply") and hasattr(model, "config") and hasattr(model, "layer_names"):
        fn = _model_logits(model)
        batches = None if calibration is None else window_batches(calibration)
        if example is None:
            cfg = model.config
            max_pos = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", 8)
            example = (np.zeros((1, min(8, int(max_pos))), np.int32),)
        return Context(fn, batches, example, params, blocks, model, seed, progress)
    if not callable(model):
        raise RecipeError(f"model= must be an eqjax Model or a callable fn(params, *args), got {type(model).__name__}")
    batches = None if calibration is None else as_batches(calibration)
    return Context(model, batches, example, params, blocks, None, seed, progress)

log = logging.getLogger("eqjax")


@functools.lru_cache(maxsize=16)
def _model_logits(model: Any) -> Callable[..., Any]:
    return lambda p, tokens: model.apply(p, tokens)[0]


# ------------------------------------------------------------------------------------ the entry point
def quantize(
    params: Params,
    recipe: Recipe | str,
    *,
    model: Any = None,
    calibration: Any = None,
    example: Any = None,
    blocks: str | None = None,
    seed: int = 0,
    progress: bool = False,
    context: Context | None = None,
    require_quantized: bool = True,
) -> Params:
    """Run ``recipe``'s steps in order on ``params``; returns the quantized param tree.

    ``recipe``: a :class:`Recipe`, a built-in recipe name or a recipe file path. Wrong argument types
    (params not a dict of arrays, a recipe of another type, a PyTorch model) and rule patterns matching
    no param are :class:`~eqjax.core.errors.InputError` s naming the argument, raised before any step runs.

    ``model``: eqjax's own ``Model`` (``calibration``: token windows ``[n, T]``) or the model's call
    ``fn(params, *args)`` (``calibration``: an iterable of argument tuples; ``example``: one argument
    tuple to trace with when there is no calibration). Without a model only name rules with
    explicit axes can run.

    ``require_quantized``: a recipe with a quantizing step (RTN, GPTQ, grid search, SignRound, LKD) that
    leaves every param as it was (its rules select no param of their role, or only skip) is a
    :class:`RecipeError` (a float model must not pass under the recipe's name).

    Checked around the steps (:mod:`eqjax.recipes.schema`): a NaN/Inf or integer parameter going in is a
    :class:`~eqjax.core.validate.NonFiniteParamsError` / CompatibilityError naming the parameter path and the
    first bad index; one coming out (the recipe made it) is a :class:`~eqjax.core.errors.NonFiniteResult`.
    """

    check_params_arg(params, "params of eqjax.quantize(params, recipe, ...)")
    recipe = resolve_recipe(recipe, "recipe of eqjax.quantize(params, recipe, ...)")
    check_params(params, "params given to quantize", nonfinite=NonFiniteParamsError)
    check_recipe_fits(recipe, params)
    paths, leaves, _ = flatten_with_paths(params)
    check_rule_patterns(recipe, paths)
    ctx = context or model_context(model, params, calibration, example=example, blocks=blocks, seed=seed,
                                   progress=progress)
    flat = dict(zip(paths, leaves))
    for step in recipe.steps:
        t0 = time.perf_counter()
        flat = step(flat, ctx)
        log.info("recipe %s: step %s took %.2fs", recipe.name, step.name, time.perf_counter() - t0)
    if require_quantized:
        check_quantized_something(recipe, dict(zip(paths, leaves)), flat)
    out = with_paths(params, flat)
    if recipe.steps:
        try:
            check_params(out, f"output of recipe {recipe.name!r}", allow_int=True)
        except NonFiniteError as e:
            raise NonFiniteResult(str(e)) from None
    return out
