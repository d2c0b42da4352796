"""Quantize any Flax model (linen, NNX, a Hugging Face Flax model) or plain JAX function, and run it.

::

    qmodel, qparams = eqjax.quantize_model(module, recipe, params=params, calibration=batches)  # linen
    logits = qmodel.apply({"params": qparams}, *inputs)        # the model's own call signature
    qmodel = eqjax.quantize_model(nnx_module, recipe, calibration=batches)                      # NNX
    logits = qmodel(*inputs)
    qfn, qparams = eqjax.quantize_model(fn, recipe, params=params, calibration=batches)         # fn(params, *args)
    y = qfn(qparams, *inputs)

``batches`` is an iterable of positional-argument tuples of the model's call (token ids, images,
float features: anything it takes), all of one shape. Nothing in the model is rewritten: the call is
traced to a program (:mod:`eqjax.core.program`), weights are found by what the model does with them,
and the quantized model runs the same program through eqjax's interpreter, jitted, with eqjax's
quantized matmuls at the weight uses. Non-array arguments (``deterministic=True``, ``method=``) are
static; each new argument shape or static value traces once more.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Iterable, Mapping

import jax

from eqjax.core.analysis import analyze
from eqjax.core.interpret import evaluate
from eqjax.core.program import trace, trace_key
from eqjax.errors import InputError
from eqjax.pytree import flatten_with_paths
from eqjax.recipe import Recipe, model_context, quantize

__all__ = ["quantize_model", "QuantizedFunction", "QuantizedLinen", "QuantizedNNX", "UnquantizedWarning"]

log = logging.getLogger("eqjax")


class UnquantizedWarning(UserWarning):
    """Some matmul weights could not be quantized (the warning says which and why)."""


class QuantizedFunction:
    """``fn(params, *args, **kwargs)`` run with quantized params through eqjax's interpreter.

    Attributes:
      fn: the original function; report: ``(param path, what was done)`` lines of the quantization.
    """

    def __init__(self, fn: Callable[..., Any], report: list[tuple[str, str]] | None = None):
        self.fn = fn
        self.report = list(report or [])
        self._cache: dict[Any, tuple[Any, Callable]] = {}

    def _compiled(self, params: Any, args: tuple, kwargs: Mapping[str, Any]) -> tuple[Any, Callable]:
        key = trace_key(params, args, kwargs)
        hit = self._cache.get(key)
        if hit is None:
            prog = trace(self.fn, params, args, kwargs)
            an = analyze(prog)
            hit = (prog, jax.jit(lambda pm, dyn: evaluate(prog, an, pm, dyn)))
            self._cache[key] = hit
        return hit

    def __call__(self, params: Any, *args: Any, **kwargs: Any) -> Any:
        prog, fn = self._compiled(params, args, kwargs)
        paths, leaves, _ = flatten_with_paths(params)
        dyn = [x for x in jax.tree_util.tree_leaves((tuple(args), dict(kwargs))) if hasattr(x, "shape") and hasattr(x, "dtype")]
        return fn(dict(zip(paths, leaves)), dyn)


class QuantizedLinen:
    """A linen module's ``apply`` with quantized params: ``apply({"params": qparams, ...}, *args, **kwargs)``."""

    def __init__(self, module: Any, report: list[tuple[str, str]] | None = None):
        self.module = module
        self.report = list(report or [])
        self._run = QuantizedFunction(self._call, report)

    def _call(self, params: Any, others: Mapping[str, Any], *args: Any, method: Any = None, **kwargs: Any) -> Any:
        kw = {} if method is None else {"method": method}
        return self.module.apply({"params": params, **others}, *args, **kw, **kwargs)

    def apply(self, variables: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        if "mutable" in kwargs and kwargs["mutable"]:
            raise InputError("QuantizedLinen.apply: mutable collections are not supported (the quantized model "
                             "is a pure function of its variables)")
        kwargs.pop("mutable", None)
        if not isinstance(variables, Mapping) or "params" not in variables:
            raise InputError("QuantizedLinen.apply: pass the variables dict {'params': qparams, ...}")
        others = {k: v for k, v in variables.items() if k != "params"}
        return self._run(variables["params"], others, *args, **kwargs)


class QuantizedNNX:
    """An NNX module with quantized params, called like the module: ``qmodel(*args, **kwargs)``.

    Attributes:
      params: the quantized params as a pure dict (QArray leaves), e.g. for saving.
      report: what was quantized.
    """

    def __init__(self, graphdef: Any, param_state: Any, rest: Any, params: Any, report: list[tuple[str, str]]):
        self.graphdef, self._state, self._rest, self.params = graphdef, param_state, rest, params
        self.report = list(report)
        self._run = QuantizedFunction(self._call, report)

    def _call(self, params: Any, *args: Any, **kwargs: Any) -> Any:
        return _nnx_call(self.graphdef, self._state, self._rest)(params, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(self.params, *args, **kwargs)


def _nnx_call(graphdef: Any, state: Any, rest: Any) -> Callable[..., Any]:
    from flax import nnx  # noqa: PLC0415

    def call(pd: Any, *args: Any, **kwargs: Any) -> Any:
        st = jax.tree.map(lambda x: x, state)
        nnx.replace_by_pure_dict(st, pd)
        return nnx.merge(graphdef, st, rest)(*args, **kwargs)

    return call


def _unquantized(ctx: Any, qparams_by_path: Mapping[str, Any]) -> list[str]:
    """Matmul weights left in float that a model-wide recipe could not take, with the reason."""
    an = ctx.analysis
    out = []
    for path, role in an.roles.items():
        if an.uses_of(path) and role.kind == "other":
            out.append(f"{path}: used by a matmul but also {role.why}")
    for i in an.program.opaque:
        node = an.program.nodes[i]
        for r in node.ins:
            if isinstance(r, int) and r in an.program.param_of:
                out.append(f"{an.program.param_of[r]}: read inside a {node.name} loop / branch eqjax cannot look into")
    return out


def _run_recipe(fn: Callable, params: Any, recipe: Recipe | str, calibration: Any, example: Any, blocks: Any,
                seed: int, progress: bool) -> tuple[Any, list[tuple[str, str]]]:
    if isinstance(recipe, str):
        from eqjax.recipes import get_recipe  # noqa: PLC0415

        recipe = get_recipe(recipe)
    if recipe.kv is not None:
        raise InputError(f"recipe {recipe.name!r} quantizes the KV cache, which quantize_model does not support yet "
                         "(only eqjax's own models); use a weight recipe")
    if calibration is None and example is None:
        raise InputError("quantize_model needs calibration= batches (or example= inputs for recipes without "
                         "calibration) to see how the model uses its params")
    ctx = model_context(fn, params, calibration, example=None if example is None else tuple(example),
                        blocks=blocks, seed=seed, progress=progress)
    qparams = quantize(params, recipe, context=ctx)
    missing = _unquantized(ctx, {})
    if missing:
        warnings.warn("not quantized: " + "; ".join(missing), UnquantizedWarning, stacklevel=3)
        ctx.report.extend((m.split(":")[0], "not quantized: " + m.split(": ", 1)[1]) for m in missing)
    if not any(not r.startswith("not quantized") for _, r in ctx.report) and recipe.steps:
        raise InputError(f"recipe {recipe.name!r} quantized nothing in this model: no param matched its rules")
    return qparams, ctx.report


def quantize_model(
    model: Any,
    recipe: Recipe | str,
    *,
    params: Any = None,
    calibration: Iterable[Any] | None = None,
    example: tuple[Any, ...] | None = None,
    blocks: str | None = None,
    seed: int = 0,
    progress: bool = False,
) -> Any:
    """Quantize a model eqjax did not write (see the module docs).

    Args:
      model: a ``flax.linen.Module`` (needs ``params``), an ``nnx.Module``, a Hugging Face Flax model
        (``.module`` + ``.params``), or a function ``fn(params, *args)`` (needs ``params``).
      recipe: a :class:`~eqjax.recipe.Recipe`, a built-in recipe name or a recipe file.
      params: the float params (linen: the ``"params"`` collection, or the variables dict holding it).
      calibration: an iterable of positional-argument tuples of the model's call (one shape).
      example: one argument tuple to trace with, for recipes that need no calibration.
      blocks: a regex naming the model's repeated blocks (default: found from the param paths).

    Returns ``(QuantizedLinen, qparams)`` for linen / HF models, ``(QuantizedFunction, qparams)`` for a
    function, and a :class:`QuantizedNNX` for an NNX module.
    """
    calib = None if calibration is None else list(calibration)
    try:
        from flax import nnx  # noqa: PLC0415
        import flax.linen as nn  # noqa: PLC0415
    except ImportError:  # pragma: no cover - flax is a dependency
        nnx = nn = None
    if nnx is not None and isinstance(model, nnx.Module):
        graphdef, pstate, rest = nnx.split(model, nnx.Param, ...)
        pd = nnx.to_pure_dict(pstate)
        q, report = _run_recipe(_nnx_call(graphdef, pstate, rest), pd, recipe, calib, example, blocks, seed, progress)
        return QuantizedNNX(graphdef, pstate, rest, q, report)
    if nn is not None and not isinstance(model, nn.Module) and isinstance(getattr(model, "module", None), nn.Module):
        params = model.params if params is None else params  # a Hugging Face Flax model (.module + .params)
        model = model.module
    if nn is not None and isinstance(model, nn.Module):
        if params is None:
            raise InputError("quantize_model: a linen module needs params= (its 'params' collection)")
        others: dict[str, Any] = {}
        if isinstance(params, Mapping) and "params" in params:
            others = {k: v for k, v in params.items() if k != "params"}
            params = params["params"]
        qlinen = QuantizedLinen(model)
        fn = lambda p, *a, **k: qlinen._call(p, others, *a, **k)  # noqa: E731
        q, report = _run_recipe(fn, params, recipe, calib, example, blocks, seed, progress)
        qlinen.report = report
        return qlinen, q
    if callable(model):
        if params is None:
            raise InputError("quantize_model: a function model needs params=")
        q, report = _run_recipe(model, params, recipe, calib, example, blocks, seed, progress)
        return QuantizedFunction(model, report), q
    raise InputError(f"quantize_model: cannot quantize a {type(model).__name__}: pass a linen or NNX module, a "
                     "Hugging Face Flax model or a function fn(params, *args)")
