"""A resumable training loop: a jitted step over a state pytree, batches in a fixed order, Orbax saves.

:func:`fit` runs ``state, loss = step(state, batch)`` for ``steps`` steps. Batch ``t`` is a function of
``t`` and ``seed`` only (each pass over the batches is a fresh permutation seeded by ``(seed, pass)``),
so a run that is stopped and resumed sees the same batches in the same order as one that never stopped.

With ``checkpoint`` (a directory), the state is saved every ``save_every`` steps and at the end with
Orbax's :class:`~orbax.checkpoint.CheckpointManager` (each save written to a temporary directory and
renamed into place: a kill leaves the previous save whole; only the newest is kept), next to a
``run.json`` describing the run (steps, seed, number and shape of the batches, the state's tree). A
later :func:`fit` with the same directory restores the newest save and continues from its step; a
directory holding another run (a different ``run.json``) or files eqjax did not write is refused before
any step runs. On CPU a resumed run's final state equals an uninterrupted run's bit for bit (the same
compiled step, the same batches).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eqjax.core.errors import InputError

__all__ = ["TrainRun", "fit", "batch_order", "check_run_dir"]

log = logging.getLogger("eqjax")

_RUN_FILE = "run.json"


@dataclasses.dataclass
class TrainRun:
    """What :func:`fit` did. ``losses``: the loss of each step this call ran (not those before a resume);
    ``first_step``: the step it started from (0, or the resumed save's); ``seconds``: wall time of its steps
    (compilation included)."""

    state: Any
    losses: list[float]
    first_step: int
    seconds: float


def batch_order(step: int, n: int, seed: int) -> int:
    """Index of the batch used at ``step`` out of ``n``: pass ``step // n`` is a permutation seeded by
    ``(seed, pass)``."""
    rng = np.random.default_rng([int(seed), step // n])
    return int(rng.permutation(n)[step % n])


def _describe(state: Any, batches: Sequence[tuple[Any, ...]], steps: int, seed: int) -> dict[str, Any]:
    leaves, tree = jax.tree.flatten(state)
    return {
        "format": "eqjax-train-1",
        "steps": int(steps),
        "seed": int(seed),
        "batches": len(batches),
        "batch_shapes": [[list(np.shape(a)) for a in b] for b in batches[:1]],
        "tree": str(tree),
        "leaves": [[list(np.shape(x)), str(np.asarray(x).dtype) if not hasattr(x, "dtype") else str(x.dtype)]
                   for x in leaves],
    }


def _ocp() -> Any:
    import orbax.checkpoint as ocp  # imported where a run saves: importing it costs seconds

    return ocp


def _manager(directory: pathlib.Path) -> Any:
    ocp = _ocp()
    opts = ocp.CheckpointManagerOptions(max_to_keep=1, create=True, enable_async_checkpointing=False)
    return ocp.CheckpointManager(directory.resolve() / "state", options=opts)


def check_run_dir(checkpoint: str | pathlib.Path, flag: str = "training checkpoint") -> pathlib.Path:
    """``checkpoint`` as a path a run may use: new, empty, or one a run wrote (holding ``run.json``); a file or
    a directory of other files is an :class:`InputError` naming ``flag`` (checked before any work)."""
    d = pathlib.Path(checkpoint)
    if d.exists() and not d.is_dir():
        raise InputError(f"{flag} ({d}): expected a directory, found a file")
    if d.is_dir() and any(d.iterdir()) and not (d / _RUN_FILE).is_file():
        raise InputError(f"{flag} ({d}): expected an empty directory or one eqjax's training wrote "
                         f"(with {_RUN_FILE}), found other files; choose another directory")
    if not d.exists() and d.parent.exists() and not os.access(d.parent, os.W_OK):
        raise InputError(f"{flag} ({d}): its parent directory is not writable")
    return d


def _open(checkpoint: str | pathlib.Path, info: dict[str, Any]) -> pathlib.Path:
    """The run directory, created or checked (refused if it holds another run or foreign files)."""
    d = check_run_dir(checkpoint)
    run = d / _RUN_FILE
    if d.is_dir() and any(d.iterdir()):
        try:
            old = json.loads(run.read_text())
        except (OSError, ValueError) as e:
            raise InputError(f"training checkpoint ({run}): unreadable run description ({e})") from None
        diff = [k for k in info if old.get(k) != info[k]]
        if diff:
            raise InputError(f"training checkpoint ({d}): it holds another run (different {', '.join(diff)}); "
                             "resume with the same model, data, steps and seed, or choose another directory")
        return d
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{_RUN_FILE}.tmp"
    tmp.write_text(json.dumps(info, indent=1))
    tmp.replace(run)
    return d


def fit(
    step: Callable[[Any, tuple[Any, ...]], tuple[Any, Any]],
    state: Any,
    batches: Sequence[tuple[Any, ...]],
    *,
    steps: int,
    seed: int = 0,
    checkpoint: str | pathlib.Path | None = None,
    save_every: int = 100,
    log_every: int = 10,
    on_step: Callable[[int, float], None] | None = None,
    consts: tuple[Any, ...] = (),
    describe: dict[str, Any] | None = None,
) -> TrainRun:
    """Run ``step`` (a pure function, jitted here) ``steps`` times from ``state``; see the module docs.

    Args:
      step: ``(state, batch, *consts) -> (state, scalar loss)``; batch is one tuple of ``batches``.
      state: a pytree of arrays (params, optimizer state, counters).
      batches: argument tuples, all of one shape.
      steps: total steps of the run (a resumed run continues up to it).
      checkpoint, save_every: where and how often to save (None: no saves, no resume).
      on_step: called with ``(step, loss)`` after each step (e.g. to stop a test run mid-way).
      consts: further arguments of every step (frozen params, a teacher): neither saved nor donated.
      describe: JSON-able settings of the run (learning rates, ...) recorded in ``run.json``: a resume with
        other settings is refused.
    """
    if not batches:
        raise InputError("training data (batches): expected at least one batch, found none")
    if steps < 0 or save_every < 1:
        raise InputError(f"training (steps={steps}, save_every={save_every}): expected steps >= 0, save_every >= 1")
    jstep = jax.jit(step, donate_argnums=0)
    state = jax.tree.map(lambda x: jnp.array(x, copy=True), state)  # donated below: never a caller's buffer
    mgr, first = None, 0
    if checkpoint is not None:
        d = _open(checkpoint, {**_describe(state, batches, steps, seed), "settings": describe or {}})
        mgr = _manager(d)
        latest = mgr.latest_step()
        if latest is not None:
            abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), state)
            state = mgr.restore(latest, args=_ocp().args.StandardRestore(abstract))
            first = int(latest)
            log.info("training: resumed from step %d of %d (%s)", first, steps, d)
    losses: list[float] = []
    t0 = time.perf_counter()
    for t in range(first, steps):
        state, loss = jstep(state, batches[batch_order(t, len(batches), seed)], *consts)
        value = float(loss)
        if not math.isfinite(value):
            raise InputError(f"training: the loss is {value} at step {t}; lower the learning rate")
        losses.append(value)
        if log_every and (t + 1) % log_every == 0:
            log.info("training: step %d/%d loss %.5g (%.1fs)", t + 1, steps, value, time.perf_counter() - t0)
        if mgr is not None and ((t + 1) % save_every == 0 or t + 1 == steps):
            _save(mgr, t + 1, state)
        if on_step is not None:
            on_step(t + 1, value)
    if mgr is not None:
        mgr.close()
    return TrainRun(state, losses, first, time.perf_counter() - t0)


def _save(mgr: Any, t: int, state: Any) -> None:
    mgr.save(t, args=_ocp().args.StandardSave(state))
    mgr.wait_until_finished()
