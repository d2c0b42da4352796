"""Streamed quantization: a recipe run over eqjax's own decoder model one unit at a time, with only that
unit's float weights in memory, for models larger than the machine's memory.

Units, in order: ``outer`` (the token table, which turns the calibration tokens into the first block's
inputs; with a tied LM head also the final norm, so that the table is seen as both lookup and head), each
decoder block, and ``head`` (final norm and untied LM head). :func:`stream_quantize` asks ``load`` for a
unit's float params, runs every step of the recipe on that unit (each step traced on the unit alone, its
calibration inputs those the in-memory run gives it), hands the result to ``emit`` and drops it before the
next unit is loaded.

The same quantization as :func:`eqjax.recipes.apply.quantize`: a calibrated step sees, at block ``i``, the
outputs of blocks ``0..i-1`` after the steps before it (its ``advance`` is ``"original"``) or after itself
too (``"new"``): the block inputs the in-memory run gives it. So the wavefront order (every step on block
``i`` before block ``i + 1``) changes only what is resident. Each calibrated step keeps its own stream of
activations (float32 ``[windows, T, D]``), the other resident cost (:func:`stream_cost`). The unit programs
are compiled apart, so float rounding may differ from the whole-model program's in the last bits:
round-to-nearest codes are identical; methods that amplify such differences (GPTQ) can move as they do
between CPUs. A calibrated step is not run on a tied head (the built-in recipes select nothing there).

Refused before any work (:func:`check_streamable`): steps that need the whole model at once (rotations,
KV-cache quantization) and calibrated steps that do not declare how their block inputs advance.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eqjax.core.errors import NonFiniteError, NonFiniteResult, RecipeError
from eqjax.core.pytree import nest_paths
from eqjax.core.qarray import is_quantized
from eqjax.core.validate import NonFiniteParamsError, check_params
from eqjax.recipes.checks import check_quantized_something, check_rule_patterns
from eqjax.recipes.registry import resolve_recipe
from eqjax.recipes.types import Context, Recipe, window_batches

__all__ = ["Unit", "model_units", "check_streamable", "stream_cost", "stream_quantize", "PHASES", "phase_line",
           "parse_phase_line"]

Loader = Callable[[Sequence[str]], Mapping[str, Any]]
"""``load(paths) -> {path: float array}`` for one unit's param paths."""
Emitter = Callable[[str, dict[str, Any]], None]
"""``emit(unit name, {path: leaf})``: called once per unit with its final (quantized or float) leaves."""


class Unit:
    """One streamed piece of the model: ``name``, its param ``paths`` and ``fn(params, x) -> y`` (``x``:
    token ids ``[B, T]`` for ``outer``, hidden states ``[B, T, D]`` otherwise); ``calibrated``: whether
    calibrated steps run on it."""

    def __init__(self, name: str, paths: tuple[str, ...], fn: Callable[[Any, Any], Any], calibrated: bool):
        self.name, self.paths, self.fn, self.calibrated = name, paths, fn, calibrated


def model_units(model: Any, paths: Sequence[str]) -> list[Unit]:
    """The units of eqjax's ``model`` (a :class:`~eqjax.models.Model`) over its param ``paths``."""
    layers = list(model.layer_names)
    top = lambda p: p.split("/")[0]  # noqa: E731
    outer = [p for p in paths if top(p) not in layers]
    tied = "lm_head" not in {top(p) for p in outer}
    head = tuple(p for p in outer if top(p) in ("final_norm", "lm_head", "ln_f"))  # Llama family, GPT-2
    lookup = tuple(p for p in outer if p not in head)

    def block_fn(name: str, i: int) -> Callable[[Any, Any], Any]:
        return lambda p, h: model.block(p[name], h, model.positions(*h.shape[:2]), layer_index=i)[0]

    if tied:
        units = [Unit("outer", lookup + head, lambda p, t: model.head(p, model.embed(p, t)), False)]
    else:
        units = [Unit("outer", lookup, lambda p, t: model.embed(p, t), False)]
    units += [Unit(name, tuple(p for p in paths if top(p) == name), block_fn(name, i), True)
              for i, name in enumerate(layers)]
    if not tied:
        units.append(Unit("head", head, lambda p, h: model.head(p, h), True))
    return units


def check_streamable(recipe: Recipe) -> None:
    """A :class:`RecipeError` naming the recipe and step when the recipe cannot run unit by unit."""
    if recipe.kv is not None:
        raise RecipeError(f"recipe {recipe.name!r}: KV-cache quantization is not streamed (it needs the whole "
                          "model's decode); quantize in memory")
    for step in recipe.steps:
        if getattr(step, "then", None) is not None:
            raise RecipeError(f"recipe {recipe.name!r}, step {step.name!r}: a rotation spans the whole model and is "
                              "not streamed; quantize in memory")
        if getattr(step, "end_to_end", False):
            raise RecipeError(f"recipe {recipe.name!r}, step {step.name!r}: it trains the whole model end to end and "
                              "is not streamed; quantize in memory")
        if getattr(step, "needs_calibration", False) and getattr(step, "advance", None) not in ("new", "original"):
            raise RecipeError(f"recipe {recipe.name!r}, step {getattr(step, 'name', type(step).__name__)!r}: a "
                              "calibrated step must declare advance = 'new' or 'original' to be streamed")


def stream_cost(recipe: Recipe, windows: Any, hidden: int) -> int:
    """Bytes of the activation streams :func:`stream_quantize` keeps: one float32 ``[n, T, hidden]`` per
    calibrated step (0 without calibration)."""
    n_cal = sum(1 for s in recipe.steps if getattr(s, "needs_calibration", False))
    return 0 if windows is None or not n_cal else n_cal * int(np.prod(np.shape(windows))) * int(hidden) * 4


def stream_quantize(model: Any, paths: Sequence[str], load: Loader, recipe: Recipe | str, calibration: Any,
                    emit: Emitter, *, batch_size: int = 8, seed: int = 0,
                    progress: Callable[[str], None] | None = None, ledger: Any = None) -> list[tuple[str, str]]:
    """Run ``recipe`` on eqjax's ``model`` unit by unit (see the module docs); returns the steps' report lines.

    Args:
      model: an :class:`~eqjax.models.Model`; paths: every param path of its tree.
      load: ``load(paths)`` -> that unit's float params by path (read on demand).
      recipe: a :class:`Recipe` or a built-in name; calibration: token windows ``[n, T]`` (or None).
      emit: receives each unit's final leaves; nothing of a unit is kept after it returns.
      batch_size: windows per calibration batch (as :func:`eqjax.recipes.apply.quantize`).
      progress: called with one line per finished unit, once nothing of that unit is referenced any more,
        and last with where the time went (:func:`phase_line`: seconds reading, quantizing, running the
        calibration forward and writing, summed over the units).
      ledger: a :class:`~eqjax.io.stream_ledger.StreamLedger` (or None): the units it has on record are
        skipped, their activations and report restored, and each unit is committed to it after ``emit``.
    """
    recipe = resolve_recipe(recipe, "recipe of eqjax.recipes.stream.stream_quantize")
    check_streamable(recipe)
    check_rule_patterns(recipe, list(paths))
    steps = list(recipe.steps)
    cal_steps = [i for i, s in enumerate(steps) if getattr(s, "needs_calibration", False)]
    if cal_steps and calibration is None:
        raise RecipeError(f"recipe {recipe.name!r} needs calibration windows (calibration=)")
    batches = [b[0] for b in window_batches(calibration, batch_size)] if calibration is not None else []
    say = progress or (lambda s: None)
    units = model_units(model, paths)
    max_pos = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", 8)
    tokens_example = np.zeros((1, min(8, int(max_pos))), np.int32)
    report: list[tuple[str, str]] = []
    streams: dict[int, list[Any]] = {}
    changed = False
    done = set(ledger.finished()) if ledger is not None else set()
    if done:
        streams, report, changed = ledger.restored()
        say(f"resuming after {len(done)} of {len(units)} units")
    phases = dict.fromkeys(PHASES, 0.0)

    def timed(phase: str, t: float, value: Any = None) -> float:
        """Add the seconds since ``t`` to ``phase`` once ``value`` is computed; returns the time now."""
        jax.block_until_ready(value)
        now = time.perf_counter()
        phases[phase] += now - t
        return now

    hidden_example = jnp.zeros((1, tokens_example.shape[1], int(model.config.hidden)), jnp.float32)
    embed = jax.jit(lambda p, t: model.embed(p, t))
    for unit in units:
        if unit.name in done:
            continue
        t0 = t = time.perf_counter()
        cur = dict(load(unit.paths))
        check_params(nest_paths(cur), f"params of {unit.name}", nonfinite=NonFiniteParamsError)
        t = timed("read", t, cur)
        fn = jax.jit(unit.fn)
        ctx = None
        for i, step in enumerate(steps):
            calibrated = i in cal_steps
            if unit.name == "outer" and calibrated:  # its input stream starts at the embeddings, so far
                streams[i] = [embed(nest_paths(cur), b) for b in batches]
                t = timed("forward", t, streams[i])
            if calibrated and not unit.calibrated:
                continue
            example = tokens_example if unit.name == "outer" else hidden_example
            ctx = Context(unit.fn, [(x,) for x in streams[i]] if calibrated else None, (example,), nest_paths(cur),
                          seed=seed, partial=True)
            new = dict(step(cur, ctx))
            report += ctx.report
            t = timed("quantize", t, new)
            if calibrated and unit is not units[-1]:  # nothing reads the last unit's outputs (the logits)
                after = new if step.advance == "new" else cur
                streams[i] = [fn(nest_paths(after), x) for x in streams[i]]
                del after
                t = timed("forward", t, streams[i])
            changed |= any(is_quantized(v) and not is_quantized(cur.get(p)) for p, v in new.items())
            cur = new
            del new
        try:
            check_params(nest_paths(cur), f"output of recipe {recipe.name!r} ({unit.name})", allow_int=True)
        except NonFiniteError as e:
            raise NonFiniteResult(str(e)) from None
        t = timed("quantize", t)
        emit(unit.name, cur)
        if ledger is not None:
            ledger.commit(unit.name, streams, report, changed)
        timed("write", t)
        del cur, ctx  # the context holds the unit's params too: nothing of the unit outlives it
        say(f"{unit.name}: {time.perf_counter() - t0:.1f}s")
    if not changed:
        check_quantized_something(recipe, {}, {})
    say(phase_line(phases))
    return report


PHASES = ("read", "quantize", "forward", "write")
"""The phases :func:`stream_quantize` times: reading a unit's float weights (and checking them), the recipe's
steps on it, the calibration forward through it, and handing its leaves to ``emit`` (encoding and writing)."""


def phase_line(phases: Mapping[str, float]) -> str:
    """``"time: read 1.0 s, quantize 2.0 s, forward 3.0 s, write 4.0 s"`` for seconds by phase."""
    return "time: " + ", ".join(f"{k} {phases.get(k, 0.0):.1f} s" for k in PHASES)


def parse_phase_line(text: str) -> dict[str, float] | None:
    """The seconds by phase of the last :func:`phase_line` in ``text`` (None when there is none)."""
    found = re.findall(r"time: read ([\d.]+) s, quantize ([\d.]+) s, forward ([\d.]+) s, write ([\d.]+) s", text)
    return None if not found else dict(zip(PHASES, map(float, found[-1])))
