"""Recipes: an ordered chain of quantization steps, run by :func:`quantize`.

A step is any object with a ``name`` and ``__call__(params, ctx) -> params``: a pure function of the
param tree (plus, for calibrated methods, the model and calibration tokens carried by the
:class:`Context`). Steps compose like optax transforms: ``Recipe("mine", (SmoothQuant(...),
RTN(rules)))``. Recipes are frozen and hashable enough to be named in files and on the CLI.

Recipe files (TOML or JSON)::

    name = "w4g128-asym"
    description = "4-bit asymmetric, groups of 128 along the input"
    [[steps]]
    method = "rtn"
    [[steps.rules]]
    pattern = ".*/kernel"
    bits = 4
    symmetric = false
    granularity = "group"
    group_size = 128

Each ``method`` names a step type in :data:`STEP_TYPES`; the remaining keys go to its
``from_config``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import logging
import pathlib
import time
import tomllib
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

import numpy as np

from eqjax.errors import InputError
from eqjax.pytree import Params

__all__ = [
    "Context", "Step", "Recipe", "RecipeError", "quantize", "load_recipe", "recipe_from_dict", "STEP_TYPES",
    "model_context", "window_batches", "with_paths",
]

log = logging.getLogger("eqjax")


class RecipeError(InputError):
    """A recipe (file) is malformed or cannot run on the given model."""


@dataclasses.dataclass
class Context:
    """What steps may use: the model's call, calibration batches, and what eqjax learned by tracing it.

    Attributes:
      fn: the model's call ``fn(params, *args)`` (None: params only, name rules only).
      batches: calibration batches (positional-argument tuples of ``fn``, one shape), or None.
      example: arguments to trace ``fn`` with when there are no batches.
      template: the param tree (tracing needs its shapes).
      blocks: a regex naming the model's blocks (default: found from the param paths).
      model: eqjax's own :class:`~eqjax.models.Model` when that is what is quantized (KV cache).
      seed, progress: randomness and progress bars.
      report: ``(path, what was done)`` lines appended by the steps.
    """

    fn: Callable[..., Any] | None = None
    batches: list[tuple[Any, ...]] | None = None
    example: tuple[Any, ...] | None = None
    template: Any = None
    blocks: str | None = None
    model: Any = None
    seed: int = 0
    progress: bool = False
    report: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    _program: Any = dataclasses.field(default=None, repr=False)
    _analysis: Any = dataclasses.field(default=None, repr=False)
    _calibrator: Any = dataclasses.field(default=None, repr=False)

    def _trace(self) -> None:
        from eqjax.core.analysis import analyze  # noqa: PLC0415
        from eqjax.core.program import trace  # noqa: PLC0415

        args = self.batches[0] if self.batches else self.example
        if args is None:
            raise RecipeError("eqjax needs example inputs of the model to see how it uses its params "
                              "(calibration= or example=)")
        self._program = trace(self.fn, self.template, args)
        self._analysis = analyze(self._program)

    @property
    def analysis(self) -> Any:
        """The :class:`~eqjax.core.analysis.Analysis` of the model (None without a model)."""
        if self.fn is None:
            return None
        if self._analysis is None:
            self._trace()
        return self._analysis

    def calibrator(self, step: str) -> Any:
        """The :class:`~eqjax.calibrate.Calibrator` over the calibration batches (raises without them)."""
        if self.fn is None:
            raise RecipeError(f"step {step!r} needs the model for calibration; pass model=")
        if not self.batches:
            raise RecipeError(f"step {step!r} needs calibration data; pass calibration=")
        if self._calibrator is None:
            from eqjax.calibrate import Calibrator  # noqa: PLC0415

            if self._program is None:
                self._trace()
            self._calibrator = Calibrator(self._program, self.batches, analysis=self._analysis, blocks=self.blocks)
        return self._calibrator

    def require_calibration(self, step: str) -> Any:
        return self.calibrator(step)


@runtime_checkable
class Step(Protocol):
    """A recipe step: ``step(params by path, ctx) -> params by path``."""

    name: str

    def __call__(self, params: dict[str, Any], ctx: Context) -> dict[str, Any]: ...


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A named chain of steps; ``kv`` optionally quantizes the KV cache at evaluation/decoding time."""

    name: str
    steps: tuple[Any, ...]
    description: str = ""
    kv: Any = None

    @property
    def needs_calibration(self) -> bool:
        return any(getattr(s, "needs_calibration", False) for s in self.steps)


def with_paths(template: Any, flat: Mapping[str, Any]) -> Any:
    """``template`` with the leaf at each path of ``flat`` replaced; paths it lacks are added as new
    leaves of nested dicts (a step may add a param, e.g. :class:`~eqjax.methods.rotation.Rotation`
    unties a tied LM head). Adding under a non-dict node is a :class:`RecipeError`."""
    from eqjax.pytree import flatten_with_paths, unflatten_paths  # noqa: PLC0415

    tree = unflatten_paths(flat, template)
    known = set(flatten_with_paths(template)[0])
    for path in (p for p in flat if p not in known):
        node, parts = tree, path.split("/")
        for part in parts[:-1]:
            node = node.setdefault(part, {}) if isinstance(node, dict) else None
            if node is None or not isinstance(node, dict):
                raise RecipeError(f"a step added the param {path!r} under a node that is not a dict")
        node[parts[-1]] = flat[path]
    return tree


def window_batches(windows: Any, batch_size: int = 8) -> list[tuple[Any, ...]]:
    """Token windows ``[n, T]`` as batches of equal size (the largest divisor of ``n`` <= ``batch_size``)."""
    try:
        w = np.asarray(windows)
    except ValueError:  # a ragged list: numpy refuses it
        raise RecipeError("calibration token windows (calibration): expected a non-empty [n, T] integer array, "
                          "found windows of different lengths") from None
    if w.ndim != 2 or w.shape[0] == 0 or w.shape[1] == 0:
        raise RecipeError(f"calibration token windows must be a non-empty [n, T] array, got shape {w.shape}")
    if not np.issubdtype(w.dtype, np.integer):
        raise RecipeError(f"calibration token windows must hold integer token ids, got dtype {w.dtype}")
    n = w.shape[0]
    b = max(d for d in range(1, min(batch_size, n) + 1) if n % d == 0)
    return [(w[i:i + b].astype(np.int32),) for i in range(0, n, b)]


_FOREIGN = {"torch": "a PyTorch module", "tensorflow": "a TensorFlow object", "keras": "a Keras model"}


def check_model_arg(model: Any, where: str) -> None:
    """Refuse a model of another framework (a ``torch.nn.Module``, a Keras model) with an
    :class:`InputError` naming ``where``: eqjax traces JAX functions and Flax modules only."""
    for cls in type(model).__mro__:
        root = (getattr(cls, "__module__", "") or "").split(".")[0]
        if root in _FOREIGN:
            raise InputError(f"unsupported model ({where}): expected an eqjax Model, a Flax linen/NNX module, a "
                             f"Hugging Face Flax model or a JAX function fn(params, *args), found "
                             f"{_FOREIGN[root]} ({type(model).__module__}.{type(model).__name__}); convert it to "
                             "Flax/JAX first")


def check_params_arg(params: Any, where: str) -> None:
    """``params`` must be a non-empty param tree (a dict of arrays): an :class:`InputError` naming ``where``
    otherwise (e.g. the arguments given in the wrong order)."""
    if isinstance(params, Mapping) and params:
        return
    found = "an empty dict" if isinstance(params, Mapping) else f"{type(params).__name__} {repr(params)[:60]}"
    raise InputError(f"bad params ({where}): expected the model's param tree (a non-empty dict of arrays), found "
                     f"{found}")


def resolve_recipe(recipe: Any, where: str = "recipe") -> "Recipe":
    """A :class:`Recipe` from ``recipe``: a Recipe, a built-in recipe name or a recipe file path; any other
    type is a :class:`RecipeError` naming ``where``."""
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, (str, pathlib.PurePath)):
        from eqjax.recipes import get_recipe  # noqa: PLC0415 - recipes imports this module

        return get_recipe(str(recipe))
    raise RecipeError(f"bad recipe ({where}): expected an eqjax Recipe, a built-in recipe name or a .toml/.json "
                      f"file path, found {type(recipe).__name__} {repr(recipe)[:60]}")


_QUANTIZING_STEPS = frozenset({"RTN", "GPTQ", "SearchedRTN", "SignRound", "ZeroQuantLKD"})
"""Step classes that quantize weights (a rotation quantizes through its ``then`` steps)."""


def _quantizing_step(step: Any) -> bool:
    then = getattr(step, "then", None)
    if then is not None:
        return any(_quantizing_step(t) for t in then)
    return type(step).__name__ in _QUANTIZING_STEPS


def check_quantized_something(recipe: "Recipe", before: Mapping[str, Any], after: Mapping[str, Any]) -> None:
    """A recipe with a quantizing step must have quantized at least one param (``after`` vs ``before``, by
    path); else a :class:`RecipeError` naming the recipe and its steps."""
    from eqjax.qarray import is_quantized  # noqa: PLC0415

    if not any(_quantizing_step(s) for s in recipe.steps):
        return
    if any(is_quantized(v) and not is_quantized(before.get(p)) for p, v in after.items()):
        return
    names = [getattr(s, "name", type(s).__name__) for s in recipe.steps]
    raise RecipeError(f"recipe quantized nothing (recipe {recipe.name!r}, steps {names}): expected at least one param "
                      "quantized, found every param left as it was (its rules select no param of the role they name, "
                      "or only skip = true)")


def check_rule_patterns(recipe: "Recipe", paths: list[str]) -> None:
    """Before any step runs: every rule pattern (and step ``pattern``) of the steps up to the first one that
    may add params (a rotation) must match at least one param path, else a :class:`RecipeError` naming the
    pattern and the step."""
    import re  # noqa: PLC0415

    for i, step in enumerate(recipe.steps):
        if getattr(step, "then", None) is not None:
            return  # a rotation adds params (an untied LM head): later patterns may name them
        name = getattr(step, "name", type(step).__name__)
        patterns = [getattr(r, "pattern", None) for r in getattr(step, "rules", None) or ()]
        patterns.append(getattr(step, "pattern", None))
        for pat in (p for p in patterns if isinstance(p, str)):
            if not any(re.fullmatch(pat, p) for p in paths):
                raise RecipeError(f"rule matches no parameter (recipe {recipe.name!r}, step {i} {name!r}, pattern "
                                  f"{pat!r}): expected a pattern matching at least one param path (e.g. "
                                  f"{paths[0]!r}), found none")


def model_context(model: Any, params: Params, calibration: Any = None, *, example: Any = None,
                  blocks: str | None = None, seed: int = 0, progress: bool = False) -> Context:
    """A :class:`Context` for eqjax's own :class:`~eqjax.models.Model` (token windows as calibration)
    or for any callable ``fn(params, *args)`` (calibration: an iterable of argument tuples)."""
    from eqjax.calibrate import as_batches  # noqa: PLC0415

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


@functools.lru_cache(maxsize=16)
def _model_logits(model: Any) -> Callable[..., Any]:
    return lambda p, tokens: model.apply(p, tokens)[0]


# method name -> "module:Class"; each class has ``from_config(dict) -> step``.
STEP_TYPES: dict[str, str] = {
    "rtn": "eqjax.methods.rtn:RTN",
    "rotation": "eqjax.methods.rotation:Rotation",
    "gptq": "eqjax.methods.gptq:GPTQ",
    "awq": "eqjax.methods.awq:AWQ",
    "smoothquant": "eqjax.methods.smoothquant:SmoothQuant",
    "zeroquant_lkd": "eqjax.methods.lkd:ZeroQuantLKD",
    "rtn_search": "eqjax.methods.grid:SearchedRTN",
    "signround": "eqjax.methods.signround:SignRound",
    "half": "eqjax.methods.halffloat:HalfFloats",
}


def step_kwargs(
    cls: type, d: Mapping[str, Any], method: str, *, exclude: tuple[str, ...] = ("name",),
    tuples: tuple[str, ...] = (),
) -> dict[str, Any]:
    """A step dataclass's keyword arguments from a recipe-file table, checked against its fields.

    Unknown keys, values of the wrong type (no coercion: ``bits = 4.7`` or ``symmetric = "false"`` is
    refused) and out-of-range values raise :class:`~eqjax.schema.SchemaError` naming the key;
    ``tuples`` are list-valued fields converted to tuples (steps must stay hashable).
    """
    from eqjax.schema import check_step_fields  # noqa: PLC0415

    check_step_fields(cls, d, method, exclude=exclude)
    return {k: (tuple(v) if k in tuples else v) for k, v in d.items()}


def _step_from_dict(d: Mapping[str, Any], where: str = "step") -> Any:
    d = dict(d)
    method = d.pop("method", None)
    if method not in STEP_TYPES:
        raise RecipeError(f"unknown step method ({where}.method): expected one of {sorted(STEP_TYPES)}, found {method!r}")
    module, _, cls = STEP_TYPES[method].partition(":")
    step_cls = getattr(importlib.import_module(module), cls)
    try:
        return step_cls.from_config(d)
    except RecipeError as e:
        if getattr(e, "where", None) is not None:  # a SchemaError: put the step's position in front
            from eqjax.schema import SchemaError  # noqa: PLC0415

            raise SchemaError(f"{where}.{e.where}".rstrip("."), e.expected, e.found) from None
        raise
    except (TypeError, ValueError) as e:
        raise RecipeError(f"invalid {method!r} step ({where}): {e}") from None


def recipe_from_dict(d: Mapping[str, Any], *, source: str | None = None) -> Recipe:
    """A recipe from a parsed file: ``{name, description?, steps: [{method, ...}], kv?: {...}}``.

    The dict is checked first (:func:`eqjax.schema.validate_recipe_dict`: types without coercion,
    unknown and conflicting keys refused); every error is a :class:`RecipeError` naming the key path
    (and ``source``, the file, when given).
    """
    from eqjax.schema import validate_recipe_dict  # noqa: PLC0415

    validate_recipe_dict(d, source)
    prefix = f"{source}: " if source else ""
    steps = tuple(_step_from_dict(s, f"{prefix}steps[{i}]") for i, s in enumerate(d["steps"]))
    kv = None
    if d.get("kv") is not None:
        from eqjax.methods.kvquant import KVQuant  # noqa: PLC0415 - optional step type

        try:
            kv = KVQuant.from_config(dict(d["kv"]))
        except (TypeError, ValueError) as e:
            raise RecipeError(f"invalid kv table ({prefix}kv): {e}") from None
    return Recipe(d["name"], steps, d.get("description", ""), kv)


def _no_duplicate_keys(source: str) -> Any:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise RecipeError(f"duplicate key in a recipe file ({source}: {k!r}): expected each key once, found it twice")
            out[k] = v
        return out

    return hook


def load_recipe(path: str | pathlib.Path) -> Recipe:
    """Read a recipe from a ``.toml`` or ``.json`` UTF-8 file, checked (see :func:`recipe_from_dict`).

    Every problem (missing file, not UTF-8, does not parse, duplicate JSON key, schema violation) is a
    :class:`RecipeError` naming the file.
    """
    p = pathlib.Path(path)
    if not p.exists():
        raise RecipeError(f"recipe file does not exist ({p}): expected a .toml or .json file, found nothing")
    if not p.is_file():
        raise RecipeError(f"recipe path is not a file ({p}): expected a .toml or .json file, found a directory")
    if p.suffix not in (".toml", ".json"):
        raise RecipeError(f"unknown recipe file type ({p}): expected a .toml or .json suffix, found {p.suffix!r}")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise RecipeError(f"cannot read the recipe file ({p}): {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise RecipeError(
            f"recipe file is not UTF-8 ({p}): expected UTF-8 text, found byte 0x{raw[e.start]:02x} at offset {e.start}"
        ) from None
    try:
        if p.suffix == ".toml":
            d = tomllib.loads(text)
        else:
            d = json.loads(text, object_pairs_hook=_no_duplicate_keys(str(p)))
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise RecipeError(f"recipe file does not parse ({p}): {e}") from None
    except RecursionError:
        raise RecipeError(f"recipe file does not parse ({p}): nested too deeply") from None
    recipe = recipe_from_dict(d, source=str(p))
    check_quantizes(d, str(p))
    return recipe


_TRANSFORM_METHODS = frozenset({"smoothquant", "awq"})
"""Step methods that only transform float params (quantizing nothing themselves)."""


def _quantizing(step: Mapping[str, Any]) -> bool:
    if step.get("method") == "rotation":
        return any(isinstance(t, Mapping) and _quantizing(t) for t in step.get("then") or ())
    return step.get("method") not in _TRANSFORM_METHODS


def check_quantizes(d: Mapping[str, Any], source: str) -> None:
    """A recipe file must quantize something: a step that quantizes (not only ``smoothquant`` / ``awq`` /
    a rotation without ``then``) or a ``kv`` table; else a :class:`RecipeError` naming the file."""
    steps = [s for s in d.get("steps") or () if isinstance(s, Mapping)]
    if d.get("kv") is None and not any(_quantizing(s) for s in steps):
        found = ", ".join(str(s.get("method")) for s in steps) or "no steps"
        raise RecipeError(f"recipe quantizes nothing ({source}: steps): expected a quantizing step (rtn, gptq, "
                          f"rtn_search, signround, zeroquant_lkd, half, rotation with then) or a [kv] table, found "
                          f"{found}")


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
    no param are :class:`~eqjax.errors.InputError` s naming the argument, raised before any step runs.

    ``model``: eqjax's own ``Model`` (``calibration``: token windows ``[n, T]``) or the model's call
    ``fn(params, *args)`` (``calibration``: an iterable of argument tuples; ``example``: one argument
    tuple to trace with when there is no calibration). Without a model only name rules with
    explicit axes can run.

    ``require_quantized``: a recipe with a quantizing step (RTN, GPTQ, grid search, SignRound, LKD) that
    leaves every param as it was (its rules select no param of their role, or only skip) is a
    :class:`RecipeError` (a float model must not pass under the recipe's name).

    Checked around the steps (:mod:`eqjax.schema`): a NaN/Inf or integer parameter going in is a
    :class:`~eqjax.schema.NonFiniteParamsError` / CompatibilityError naming the parameter path and the
    first bad index; one coming out (the recipe made it) is a :class:`~eqjax.errors.NonFiniteResult`.
    """
    from eqjax.errors import NonFiniteError, NonFiniteResult  # noqa: PLC0415
    from eqjax.pytree import flatten_with_paths  # noqa: PLC0415
    from eqjax.schema import NonFiniteParamsError, check_params, check_recipe_fits  # noqa: PLC0415

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
