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

import functools
import logging
import warnings
from typing import Any, Callable, Iterable, Mapping, Sequence

import flax.linen as nn
import jax
from flax import nnx

from eqjax.core.analysis import analyze
from eqjax.core.errors import InputError
from eqjax.core.interpret import evaluate
from eqjax.core.program import trace, trace_key
from eqjax.core.pytree import flatten_with_paths
from eqjax.core.qarray import is_quantized
from eqjax.recipes.apply import model_context, quantize
from eqjax.recipes.checks import check_model_arg, check_params_arg
from eqjax.recipes.registry import resolve_recipe
from eqjax.recipes.types import Recipe

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


def _linen_call(module: nn.Module) -> Callable[..., Any]:
    """``module.apply`` as ``fn(params, others, *args, method=None, **kwargs)`` (``others``: non-param collections)."""

    def call(params: Any, others: Mapping[str, Any], *args: Any, method: Any = None, **kwargs: Any) -> Any:
        kw = {} if method is None else {"method": method}
        return module.apply({"params": params, **others}, *args, **kw, **kwargs)

    return call


@functools.lru_cache(maxsize=64)
def _cached_runner(module: nn.Module) -> QuantizedFunction:
    return QuantizedFunction(_linen_call(module))


def _linen_runner(module: nn.Module) -> QuantizedFunction:
    """One :class:`QuantizedFunction` (its traces and compiled programs) per module value: linen rebuilds
    submodules at every ``apply``, so the module, not the wrapper instance, carries the cache."""
    try:
        return _cached_runner(module)
    except TypeError:  # a module with unhashable fields: traced at every call
        return QuantizedFunction(_linen_call(module))


class QuantizedLinen(nn.Module):
    """A linen module with quantized params: ``apply({"params": qparams, ...}, *args, **kwargs)`` like the
    original (``method=`` selects the original module's method), ``jax.jit(qmodel.apply)``, and a submodule
    of a larger module, where ``qparams`` creates its quantized params at the parent's
    ``init``, and the parent's ``apply`` takes them from its own ``params``:
    ``QuantizedLinen(module, qparams=qparams, name="q")(x)`` in the parent's ``__call__`` (or ``setup``).

    Attributes:
      module: the original module; qparams: the quantized params ``init`` creates (None: ``apply`` only);
      report: ``(param path, what was done)`` lines of the quantization.
    """

    module: nn.Module
    qparams: Any = None
    report: tuple[tuple[str, str], ...] = ()

    @nn.compact
    def __call__(self, *args: Any, method: Any = None, **kwargs: Any) -> Any:
        if self.qparams is not None:  # as a submodule: declared (and created at init) like any param
            params = {k: self.param(k, lambda rng, v=v: v) for k, v in self.qparams.items()}
        else:
            params = dict(self.variables.get("params", {}))
        others = {k: v for k, v in self.variables.items() if k != "params"}
        return _linen_runner(self.module)(params, others, *args, method=method, **kwargs)

    def apply(self, variables: Mapping[str, Any], *args: Any, method: Any = None, mutable: Any = False,
              **kwargs: Any) -> Any:
        """``apply`` of the original module with quantized params (no mutable collections: a pure function)."""
        if mutable:
            raise InputError("QuantizedLinen.apply: mutable collections are not supported (the quantized model "
                             "is a pure function of its variables)")
        if not isinstance(variables, Mapping) or "params" not in variables:
            raise InputError("QuantizedLinen.apply: pass the variables dict {'params': qparams, ...}")
        call = (lambda m, *a, **k: m(*a, method=method, **k)) if method is not None else None
        return super().apply(variables, *args, method=call, **kwargs)


class QuantizedParam(nnx.Variable):
    """An NNX variable holding a quantized param (a :class:`~eqjax.core.qarray.QArray` or another quantized
    leaf): not an ``nnx.Param``, so ``nnx.state(qmodel, nnx.Param)`` and ``nnx.Optimizer(..., wrt=nnx.Param)``
    see only the float leaves."""


class QuantizedNNX(nnx.Module):
    """An NNX module with quantized params, called like the module: ``qmodel(*args, **kwargs)``.

    ``model`` is the user's module with each quantized param held in a :class:`QuantizedParam`; the call runs
    the module's traced program through eqjax's interpreter (integer matmuls at the quantized weights). It is
    an ``nnx.Module``: ``nnx.jit`` / ``nnx.grad`` over it, ``nnx.split`` / ``nnx.merge``, ``nnx.state`` (saved
    and restored with Orbax), ``nnx.display`` and ``nnx.Optimizer(qmodel, tx, wrt=nnx.Param)`` work.

    Attributes:
      model: the quantized module; report: ``(param path, what was done)`` lines of the quantization.
    """

    def __init__(self, model: nnx.Module, report: Sequence[tuple[str, str]]):
        self.model = model
        self.report = tuple(tuple(r) for r in report)
        self._run = QuantizedFunction(self._call, list(report))

    @property
    def params(self) -> dict[str, Any]:
        """The params as a pure dict (QArray leaves where quantized), e.g. for :func:`eqjax.io.orbax.save_quantized`."""
        return nnx.to_pure_dict(nnx.state(self.model, (nnx.Param, QuantizedParam)))

    @staticmethod
    def _call(state: Mapping[str, Any], structure: "_Structure", *args: Any, **kwargs: Any) -> Any:
        graphdef, pstate, rest = structure.value
        pstate, rest = jax.tree.map(lambda x: x, pstate), jax.tree.map(lambda x: x, rest)
        nnx.replace_by_pure_dict(pstate, state["params"])
        nnx.replace_by_pure_dict(rest, _unwrap_keys(state["rest"], structure.key_impls))
        return nnx.merge(graphdef, pstate, rest)(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        graphdef, pstate, rest = nnx.split(self.model, (nnx.Param, QuantizedParam), ...)
        rest_pd = nnx.to_pure_dict(rest)
        impls = jax.tree.map(lambda x: str(jax.random.key_impl(x)) if _is_key(x) else None, rest_pd)
        rest_pd = jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, rest_pd)
        state = {"params": nnx.to_pure_dict(pstate), "rest": rest_pd}
        return self._run(state, _Structure((graphdef, pstate, rest), impls), *args, **kwargs)


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _unwrap_keys(rest: Any, impls: Any) -> Any:
    """``rest`` with each RNG key (passed as its key data: the interpreter takes numeric arrays) re-wrapped."""
    return jax.tree.map(lambda x, impl: x if impl is None else jax.random.wrap_key_data(x, impl=impl), rest, impls,
                        is_leaf=lambda v: v is None)


class _Structure:
    """The module's structure as a static argument of a :class:`QuantizedFunction` call: equal (and hashed)
    by its graph definition and RNG key kinds, so calls reuse one trace; its states are only templates (every
    value is passed as an array)."""

    def __init__(self, value: tuple[Any, Any, Any], key_impls: Any) -> None:
        self.value, self.key_impls = value, key_impls
        leaves, tree = jax.tree.flatten(key_impls, is_leaf=lambda v: v is None)
        self._key = (value[0], tuple(leaves), tree)

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Structure) and self._key == other._key


def _nnx_call(graphdef: Any, state: Any, rest: Any) -> Callable[..., Any]:
    def call(pd: Any, *args: Any, **kwargs: Any) -> Any:
        st = jax.tree.map(lambda x: x, state)
        nnx.replace_by_pure_dict(st, pd)
        return nnx.merge(graphdef, st, rest)(*args, **kwargs)

    return call


def _quantized_module(model: nnx.Module, qparams: Mapping[str, Any]) -> nnx.Module:
    """A copy of ``model`` whose params are ``qparams`` (a pure dict), quantized leaves in :class:`QuantizedParam`."""
    graphdef, state = nnx.split(model)
    flat = dict(zip(*flatten_with_paths(qparams)[:2]))
    swapped = []
    for path, var in nnx.to_flat_state(state):
        leaf = flat.get("/".join(map(str, path)))
        if isinstance(var, nnx.Param) and leaf is not None:
            var = QuantizedParam(leaf) if is_quantized(leaf) or not hasattr(leaf, "dtype") else var.replace(leaf)
        swapped.append((path, var))
    return nnx.merge(graphdef, nnx.from_flat_state(swapped))


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


_WHERE = "eqjax.quantize_model(model, recipe, ...)"


def _as_example(example: Any) -> tuple[Any, ...] | None:
    """``example`` as an argument tuple: a single array (or any non-sequence) is one argument."""
    if example is None or isinstance(example, tuple):
        return example
    if isinstance(example, list):
        return tuple(example)
    return (example,)


def _as_calibration(calibration: Any) -> list[Any] | None:
    """The calibration batches as a list; a non-iterable (or a single array, whose rows would be taken as
    batches) is an :class:`InputError` naming the argument."""
    if calibration is None:
        return None
    if hasattr(calibration, "shape") or isinstance(calibration, (str, bytes)) or not isinstance(calibration, Iterable):
        raise InputError(f"bad calibration ({_WHERE}): expected an iterable of argument tuples of the model's call, "
                         f"e.g. [(tokens,), ...], found {type(calibration).__name__}")
    return list(calibration)


def _check_linen_params(module: Any, params: Any, args: tuple[Any, ...] | None) -> None:
    """Compare ``params`` with the tree ``module.init`` makes for ``args`` (abstractly, ``jax.eval_shape``):
    a missing param or a shape mismatch is an :class:`InputError` naming its path, before any tracing.
    Skipped where ``init`` cannot run abstractly (extra RNG streams, non-array arguments)."""
    if args is None:
        return
    try:
        want = jax.eval_shape(lambda: module.init({"params": jax.random.key(0), "dropout": jax.random.key(1)},
                                                  *args))
    except Exception:  # noqa: BLE001 - the check is best-effort; the trace reports what it finds
        return
    want = want.get("params", {}) if isinstance(want, Mapping) else {}
    wp, wl, _ = flatten_with_paths(want)
    gp, gl, _ = flatten_with_paths(params)
    given = dict(zip(gp, gl))
    for path, leaf in zip(wp, wl):
        if path not in given:
            raise InputError(f"params do not fit the module (params={{...}} of {_WHERE}: {path}): expected a param of "
                             f"shape {tuple(leaf.shape)} as {type(module).__name__}.init makes, found it missing")
        shape = tuple(getattr(given[path], "shape", ()))
        if shape != tuple(leaf.shape):
            raise InputError(f"params do not fit the module (params={{...}} of {_WHERE}: {path}): expected shape "
                             f"{tuple(leaf.shape)}, found {shape}")


def _run_recipe(fn: Callable, params: Any, recipe: Recipe, calibration: Any, example: Any, blocks: Any,
                seed: int, progress: bool) -> tuple[Any, list[tuple[str, str]]]:
    if recipe.kv is not None:
        raise InputError(f"recipe {recipe.name!r} quantizes the KV cache: a model needs a kv_quant hook on its "
                         "keys (pre-RoPE, [B, T, kv_heads, head_dim]) and values, as eqjax's own models have "
                         "(eqjax.models, eqjax.io.load_model); quantize_model takes weight recipes only")
    if calibration is None and example is None:
        raise InputError("quantize_model needs calibration= batches (or example= inputs for recipes without "
                         "calibration) to see how the model uses its params")
    ctx = model_context(fn, params, calibration, example=None if example is None else tuple(example),
                        blocks=blocks, seed=seed, progress=progress)
    qparams = quantize(params, recipe, context=ctx, require_quantized=False)  # checked below, with the reasons
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
      recipe: a :class:`~eqjax.recipes.types.Recipe`, a built-in recipe name or a recipe file.
      params: the float params (linen: the ``"params"`` collection, or the variables dict holding it).
      calibration: an iterable of positional-argument tuples of the model's call (one shape).
      example: one argument tuple to trace with, for recipes that need no calibration.
      blocks: a regex naming the model's repeated blocks (default: found from the param paths).

    Returns ``(QuantizedLinen, qparams)`` for linen / HF models, ``(QuantizedFunction, qparams)`` for a
    function, and a :class:`QuantizedNNX` for an NNX module.
    """
    check_model_arg(model, f"model of {_WHERE}")
    recipe = resolve_recipe(recipe, f"recipe of {_WHERE}")
    calib = _as_calibration(calibration)
    example = _as_example(example)
    if isinstance(model, nnx.Module):
        graphdef, pstate, rest = nnx.split(model, nnx.Param, ...)
        pd = nnx.to_pure_dict(pstate)
        q, report = _run_recipe(_nnx_call(graphdef, pstate, rest), pd, recipe, calib, example, blocks, seed, progress)
        return QuantizedNNX(_quantized_module(model, q), report)
    if not isinstance(model, nn.Module) and isinstance(getattr(model, "module", None), nn.Module):
        params = model.params if params is None else params  # a Hugging Face Flax model (.module + .params)
        model = model.module
    if isinstance(model, nn.Module):
        if params is None:
            raise InputError(f"a linen module needs params (params= of {_WHERE}): expected its 'params' "
                             "collection (or its variables dict), found None")
        others: dict[str, Any] = {}
        if isinstance(params, Mapping) and "params" in params:
            others = {k: v for k, v in params.items() if k != "params"}
            params = params["params"]
        check_params_arg(params, f"params of {_WHERE}")
        first = calib[0] if calib else example
        _check_linen_params(model, params, first if isinstance(first, tuple) or first is None else (first,))
        call = _linen_call(model)
        fn = lambda p, *a, **k: call(p, others, *a, **k)  # noqa: E731
        q, report = _run_recipe(fn, params, recipe, calib, example, blocks, seed, progress)
        return QuantizedLinen(model, report=tuple(tuple(r) for r in report)), q
    if callable(model):
        if params is None:
            raise InputError(f"a function model needs params (params= of {_WHERE}): expected the tree "
                             "fn(params, *args) takes, found None")
        check_params_arg(params, f"params of {_WHERE}")
        q, report = _run_recipe(model, params, recipe, calib, example, blocks, seed, progress)
        return QuantizedFunction(model, report), q
    raise InputError(f"quantize_model: cannot quantize a {type(model).__name__}: pass a linen or NNX module, a "
                     "Hugging Face Flax model or a function fn(params, *args)")
