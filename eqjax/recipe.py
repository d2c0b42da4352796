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
import importlib
import json
import logging
import pathlib
import time
import tomllib
from typing import Any, Mapping, Protocol, runtime_checkable

from eqjax.errors import InputError
from eqjax.pytree import Params

__all__ = ["Context", "Step", "Recipe", "RecipeError", "quantize", "load_recipe", "recipe_from_dict", "STEP_TYPES"]

log = logging.getLogger("eqjax")


class RecipeError(InputError):
    """A recipe (file) is malformed or cannot run on the given model."""


@dataclasses.dataclass(frozen=True)
class Context:
    """What calibrated steps may use. Uncalibrated steps ignore it.

    Attributes:
      model: the model facade (``eqjax.models.Model``) or None.
      calibration: int32 token windows ``[n, T]`` from the calibration split, or None.
      seed: random seed for anything stochastic.
      progress: show progress bars.
    """

    model: Any = None
    calibration: Any = None
    seed: int = 0
    progress: bool = False

    def require_calibration(self, step: str) -> None:
        """Raise a clear error unless a model and non-empty calibration windows are present."""
        if self.model is None:
            raise RecipeError(f"step {step!r} needs a model for calibration; pass model=")
        cal = self.calibration
        if cal is None or getattr(cal, "size", 0) == 0 or len(getattr(cal, "shape", ())) != 2 or cal.shape[0] == 0:
            raise RecipeError(
                f"step {step!r} needs calibration token windows [n, T] with n >= 1; got "
                f"{None if cal is None else getattr(cal, 'shape', type(cal))}"
            )


@runtime_checkable
class Step(Protocol):
    name: str

    def __call__(self, params: Params, ctx: Context) -> Params: ...


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


def quantize(
    params: Params,
    recipe: Recipe,
    *,
    model: Any = None,
    calibration: Any = None,
    seed: int = 0,
    progress: bool = False,
) -> Params:
    """Run ``recipe``'s steps in order on ``params``; returns the quantized param tree."""
    ctx = Context(model=model, calibration=calibration, seed=seed, progress=progress)
    for step in recipe.steps:
        t0 = time.perf_counter()
        params = step(params, ctx)
        log.info("recipe %s: step %s took %.2fs", recipe.name, step.name, time.perf_counter() - t0)
    return params


# method name -> "module:Class"; each class has ``from_config(dict) -> step``.
STEP_TYPES: dict[str, str] = {
    "rtn": "eqjax.methods.rtn:RTN",
    "gptq": "eqjax.methods.gptq:GPTQ",
    "awq": "eqjax.methods.awq:AWQ",
    "smoothquant": "eqjax.methods.smoothquant:SmoothQuant",
    "zeroquant_lkd": "eqjax.methods.lkd:ZeroQuantLKD",
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
    return recipe_from_dict(d, source=str(p))


# ------------------------------------------------------------------------------------ checked entry point
_quantize_unchecked = quantize


def quantize(params: Params, recipe: Recipe, **kwargs: Any) -> Params:  # noqa: F811 - the checked public entry
    """Run ``recipe``'s steps in order on ``params``; returns the quantized param tree.

    Keyword arguments are those of the unchecked runner (``model``, ``calibration``, ``seed``,
    ``progress``, ...). Checked around it (:mod:`eqjax.schema`): a NaN/Inf or integer parameter going in
    is a :class:`~eqjax.schema.NonFiniteParamsError` (a RecipeError and a NonFiniteError) or a
    CompatibilityError naming the parameter path and the first bad index; one coming out (the recipe
    made it) is a :class:`~eqjax.errors.NonFiniteResult`.
    """
    from eqjax.errors import NonFiniteError, NonFiniteResult  # noqa: PLC0415
    from eqjax.schema import NonFiniteParamsError, check_params, check_recipe_fits  # noqa: PLC0415

    check_params(params, "params given to quantize", nonfinite=NonFiniteParamsError)
    check_recipe_fits(recipe, params)
    out = _quantize_unchecked(params, recipe, **kwargs)
    if recipe.steps:
        try:
            check_params(out, f"output of recipe {recipe.name!r}", allow_int=True)
        except NonFiniteError as e:
            raise NonFiniteResult(str(e)) from None
    return out
