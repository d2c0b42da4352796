"""Shared compilation and the wall-time budget of block-training methods (SignRound, LKD)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from eqjax.calibration import blockfit
from eqjax.calibration.blockfit import StepBudget, share_budget, shared_jit


def test_shared_jit_reuses_one_executable_for_identical_programs():
    def make(c):
        return lambda x: jnp.sin(x) * c  # the closed-over array becomes an argument

    x = jnp.ones((3,))
    f1, f2 = shared_jit(make(jnp.full((3,), 2.0))), shared_jit(make(jnp.full((3,), 3.0)))
    np.testing.assert_allclose(np.asarray(f1(x)), np.sin(1.0) * 2.0, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(f2(x)), np.sin(1.0) * 3.0, rtol=1e-6)
    (e1,), (e2,) = (f.executables() for f in (f1, f2))
    assert e1 is e2


def test_shared_jit_keeps_the_program_in_use_when_the_cache_is_full():
    """A cache full of other programs (other tests, other methods in the same process) evicts the least
    recently used one, never the program the blocks of a running job are sharing (this used to clear the
    whole cache and compile that program again between two blocks)."""
    def make(c, k):
        return lambda x: jnp.sin(x) * c + k * jnp.cos(x)  # one program per k (a traced literal)

    x = jnp.ones((3,))
    shared = [shared_jit(make(jnp.full((3,), float(i)), 0.5)) for i in range(2)]
    shared[0](x)
    for k in range(2 * blockfit._COMPILED_MAX):  # a full cache's worth of other programs, twice over,
        shared_jit(make(jnp.ones((3,)), float(k) + 1.0))(x)  # the shared one used between each
        shared[0](x)
    shared[1](x)
    (e0,), (e1,) = (f.executables() for f in shared)
    assert e0 is e1
    assert len(blockfit._COMPILED) == blockfit._COMPILED_MAX


def test_step_budget_without_limit_keeps_the_count():
    b = StepBudget(7, None)
    assert not b.exhausted
    assert [b.after(i, jnp.zeros(())) for i in range(1, 8)] == [7] * 7


class FakeClock:
    """Stands in for the ``time`` module: ``perf_counter`` returns ``now``, which the test advances."""

    def __init__(self, now=0.0):
        self.now = now

    def perf_counter(self):
        return self.now


def test_step_budget_fixes_the_count_from_timed_steps(monkeypatch):
    """Injected clock: the first step (the compile) takes 1/4 s, the others 1/16 s (binary fractions:
    exact). The count is fixed after step 3 from steps 2-3 alone: 3 + (1 - 1/4 - 2/16) / (1/16) = 13
    steps in a 1 s budget, which spend it exactly. Timing the compile too (3/8 s over 3 steps) would
    give 3 + (5/8) / (1/8) = 8."""
    clock = FakeClock()
    monkeypatch.setattr(blockfit, "time", clock)
    b = StepBudget(10_000, 1.0)
    out, done, total = jnp.zeros(()), 0, 10_000
    while done < total:
        clock.now += 0.25 if done == 0 else 1 / 16
        done += 1
        total = b.after(done, out)
    assert total == done == 13
    assert clock.now == 1.0  # the count spends the budget exactly


def test_step_budget_never_below_steps_done_and_exhausted_at_zero():
    b = StepBudget(100, 1e-9)
    for i in (1, 2, 3):
        n = b.after(i, jnp.zeros(()))
    assert n == 3
    assert StepBudget(100, 0.0).exhausted


def test_share_budget_splits_what_is_left(monkeypatch):
    assert share_budget(None, 0.0, 3) is None
    clock = FakeClock(10.0)
    monkeypatch.setattr(blockfit, "time", clock)
    assert share_budget(9.0, 10.0, 3) == 3.0  # nothing spent: a third each
    clock.now = 13.0
    assert share_budget(9.0, 10.0, 2) == 3.0  # 3 s spent, 6 s over the 2 blocks left
    clock.now = 16.5
    assert share_budget(9.0, 10.0, 1) == 2.5
    assert share_budget(9.0, 10.0, 0) == 2.5  # no block left counts as one
    clock.now = 20.0
    assert share_budget(9.0, 10.0, 2) == 0.0  # overspent: nothing, never negative
