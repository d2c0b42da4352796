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

from eqjax.pytree import Params

__all__ = ["Context", "Step", "Recipe", "RecipeError", "quantize", "load_recipe", "recipe_from_dict", "STEP_TYPES"]

log = logging.getLogger("eqjax")


class RecipeError(ValueError):
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

    Unknown keys raise naming ``method`` and the allowed keys; ``tuples`` are list-valued fields
    converted to tuples (steps must stay hashable).
    """
    allowed = {f.name for f in dataclasses.fields(cls)} - set(exclude)
    unknown = set(d) - allowed
    if unknown:
        raise ValueError(f"unknown {method!r} key(s): {sorted(unknown)}; allowed: {sorted(allowed)}")
    return {k: (tuple(v) if k in tuples else v) for k, v in d.items()}


def _step_from_dict(d: Mapping[str, Any]) -> Any:
    d = dict(d)
    method = d.pop("method", None)
    if method not in STEP_TYPES:
        raise RecipeError(f"unknown step method {method!r}; known: {sorted(STEP_TYPES)}")
    module, _, cls = STEP_TYPES[method].partition(":")
    step_cls = getattr(importlib.import_module(module), cls)
    try:
        return step_cls.from_config(d)
    except (TypeError, ValueError) as e:
        raise RecipeError(f"step {method!r}: {e}") from None


def recipe_from_dict(d: Mapping[str, Any]) -> Recipe:
    """A recipe from a parsed file: ``{name, description?, steps: [{method, ...}], kv?: {...}}``."""
    if "name" not in d or "steps" not in d:
        raise RecipeError("a recipe needs 'name' and 'steps'")
    steps = tuple(_step_from_dict(s) for s in d["steps"])
    kv = None
    if d.get("kv") is not None:
        from eqjax.methods.kvquant import KVQuant  # noqa: PLC0415 - optional step type

        kv = KVQuant.from_config(dict(d["kv"]))
    return Recipe(str(d["name"]), steps, str(d.get("description", "")), kv)


def load_recipe(path: str | pathlib.Path) -> Recipe:
    """Read a recipe from a ``.toml`` or ``.json`` file."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise RecipeError(f"recipe file {p} does not exist")
    text = p.read_text(encoding="utf-8")
    try:
        if p.suffix == ".toml":
            d = tomllib.loads(text)
        elif p.suffix == ".json":
            d = json.loads(text)
        else:
            raise RecipeError(f"recipe file {p}: use .toml or .json")
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise RecipeError(f"recipe file {p} does not parse: {e}") from None
    try:
        return recipe_from_dict(d)
    except RecipeError as e:
        raise RecipeError(f"recipe file {p}: {e}") from None
