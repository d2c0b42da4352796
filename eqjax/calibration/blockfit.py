"""What the methods that train one block at a time share: one compile per program, and a time budget.

* :class:`shared_jit` compiles a training step once for every block that traces to the same program
  (a transformer's blocks differ only in their arrays), instead of once per block.
* :class:`StepBudget` turns a wall-time budget (seconds) into an iteration count: the first step
  (which compiles) is excluded, the next two are timed, and the count is fixed from their mean. In a
  multi-process job every process takes process 0's block budget and count (their steps are
  collective programs and must run the same number of times).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["shared_jit", "StepBudget", "share_budget"]

_COMPILED: OrderedDict[tuple, Callable] = OrderedDict()  # least recently used first
_COMPILED_MAX = 32


class shared_jit:  # noqa: N801 - used like jax.jit
    """``jax.jit`` that compiles once per traced program: functions (closures over different blocks)
    whose jaxprs print identically share one executable (the closed-over arrays become arguments).
    Traced once per argument signature; ``shared_jit(fn)(*args)``."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self._traced: dict[tuple, tuple] = {}

    def __call__(self, *args: Any) -> Any:
        leaves, tree = jax.tree_util.tree_flatten(args)
        sig = (tree, tuple((tuple(np.shape(x)), str(jnp.result_type(x))) for x in leaves))
        hit = self._traced.get(sig)
        if hit is None:
            closed, out_shape = jax.make_jaxpr(self.fn, return_shape=True)(*args)
            key = (str(closed.jaxpr), tuple((tuple(np.shape(c)), str(jnp.result_type(c))) for c in closed.consts))
            fn = _COMPILED.get(key)
            if fn is None:
                jaxpr = closed.jaxpr
                fn = jax.jit(lambda consts, xs: jax.core.eval_jaxpr(jaxpr, consts, *xs))
            hit = (key, fn, list(closed.consts), jax.tree_util.tree_structure(out_shape))
            self._traced[sig] = hit
        key, fn, consts, out_tree = hit
        _remember(key, fn)
        return jax.tree_util.tree_unflatten(out_tree, fn(consts, leaves))

    def executables(self) -> list[Callable]:
        """The jitted programs this function runs, one per argument signature traced, in tracing order."""
        return [hit[1] for hit in self._traced.values()]


def _remember(key: tuple, fn: Callable) -> None:
    """Mark ``fn`` as the most recently used program; a full cache drops its least recently used one
    (never all of them: the blocks of a running job keep sharing their program)."""
    if key in _COMPILED:
        _COMPILED.move_to_end(key)
        return
    while len(_COMPILED) >= _COMPILED_MAX:
        _COMPILED.popitem(last=False)
    _COMPILED[key] = fn


def share_budget(total: float | None, t_start: float, blocks_left: int) -> float | None:
    """Seconds for the next block: what is left of ``total`` (seconds since ``t_start``, a
    ``time.perf_counter()`` value) split evenly over ``blocks_left``; None = no limit."""
    if total is None:
        return None
    return _from_process_0(max(0.0, (total - (time.perf_counter() - t_start)) / max(1, blocks_left)))


def _from_process_0(x: float) -> float:
    """Process 0's value in a multi-process job (every process must take the same decisions)."""
    if jax.process_count() == 1:
        return x
    from jax.experimental import multihost_utils

    return float(multihost_utils.broadcast_one_to_all(np.float64(x)))


class StepBudget:
    """Iterations of one block's training loop under ``seconds`` of wall time (None: ``iters``).

    Call :meth:`after` with the step count done and the step's output (a ``jax.Array``) after every
    step; it returns the (possibly lowered, never below the steps done) total step count."""

    def __init__(self, iters: int, seconds: float | None):
        self.iters, self.seconds = iters, seconds
        self.t0 = time.perf_counter()
        self._t_first: float | None = None

    @property
    def exhausted(self) -> bool:
        """No time at all for this block (train nothing)."""
        return self.seconds is not None and self.seconds <= 0

    def after(self, done: int, out: Any) -> int:
        if self.seconds is None:
            return self.iters
        if done == 1:
            jax.block_until_ready(out)
            self._t_first = time.perf_counter()  # after the compile
        elif done == 3 and self._t_first is not None:
            jax.block_until_ready(out)
            now = time.perf_counter()
            per = (now - self._t_first) / 2
            left = self.seconds - (now - self.t0)
            self.iters = int(_from_process_0(max(done, min(self.iters, done + int(left / max(per, 1e-6))))))
        return self.iters
