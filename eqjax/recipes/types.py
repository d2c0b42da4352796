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
import logging
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

import numpy as np

from eqjax.calibration.calibrate import Calibrator
from eqjax.core.analysis import analyze
from eqjax.core.errors import RecipeError
from eqjax.core.program import trace
from eqjax.core.pytree import flatten_with_paths, unflatten_paths

__all__ = ["Context", "Step", "Recipe", "window_batches", "with_paths"]

log = logging.getLogger("eqjax")


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
      partial: the params are one unit of a model quantized unit by unit (:mod:`eqjax.recipes.stream`): a
        step or rule that selects nothing here is not an error (the caller checks rules over the whole model).
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
    partial: bool = False
    _program: Any = dataclasses.field(default=None, repr=False)
    _analysis: Any = dataclasses.field(default=None, repr=False)
    _calibrator: Any = dataclasses.field(default=None, repr=False)

    def _trace(self) -> None:

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
        """The :class:`~eqjax.calibration.calibrate.Calibrator` over the calibration batches (raises without them)."""
        if self.fn is None:
            raise RecipeError(f"step {step!r} needs the model for calibration; pass model=")
        if not self.batches:
            raise RecipeError(f"step {step!r} needs calibration data; pass calibration=")
        if self._calibrator is None:

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


"""Step classes that quantize weights (a rotation quantizes through its ``then`` steps)."""


"""Step methods that only transform float params (quantizing nothing themselves)."""


