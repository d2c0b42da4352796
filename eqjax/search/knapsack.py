"""Exact multiple-choice knapsack by dynamic programming over the size axis.

Items are layers, options are (bits, group) candidates with a stored size in bytes and an error; one DP
table answers every capacity at once (the Pareto curve of :mod:`eqjax.search.layers`). Sizes are rounded up
and capacities down to multiples of ``unit`` bytes, so a returned choice always fits.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from eqjax.core.errors import InputError

__all__ = ["BudgetError", "MCKTable", "mck_table", "solve_mck"]


class BudgetError(InputError):
    """The budget is below the smallest model the candidates can make (or is malformed)."""


@dataclasses.dataclass(frozen=True)
class MCKTable:
    """DP table of a multiple-choice knapsack: ``best[c]`` = min error with (rounded) size <= c units."""

    unit: int
    sizes: np.ndarray  # [items, options] rounded-up units (padded with a huge value)
    errors: np.ndarray  # [items, options] (padded with inf)
    best: np.ndarray  # [cap + 1]
    choice: np.ndarray  # [items, cap + 1] int16: option of item i at capacity c

    def backtrack(self, capacity_bytes: int) -> list[int] | None:
        c = min(int(capacity_bytes // self.unit), len(self.best) - 1)
        if c < 0 or not np.isfinite(self.best[c]):
            return None
        picks = []
        for i in range(self.sizes.shape[0] - 1, -1, -1):
            j = int(self.choice[i, c])
            picks.append(j)
            c -= int(self.sizes[i, j])
        return picks[::-1]


def mck_table(sizes: Sequence[Sequence[int]], errors: Sequence[Sequence[float]], cap_bytes: int, unit: int) -> MCKTable:
    n = len(sizes)
    width = max(len(s) for s in sizes)
    S = np.full((n, width), np.iinfo(np.int64).max // 4, np.int64)
    E = np.full((n, width), np.inf)
    for i, (s, e) in enumerate(zip(sizes, errors)):
        if len(s) != len(e) or not len(s):
            raise ValueError(f"item {i}: sizes and errors must be non-empty and of equal length")
        S[i, : len(s)] = -(-np.asarray(s, np.int64) // unit)  # round up
        E[i, : len(e)] = np.asarray(e, np.float64)
    cap = int(cap_bytes // unit)
    dp = np.zeros(cap + 1)  # zero items: error 0 at any capacity
    choice = np.zeros((n, cap + 1), np.int16)
    for i in range(n):
        new = np.full(cap + 1, np.inf)
        arg = np.zeros(cap + 1, np.int16)
        for j in range(width):
            s = S[i, j]
            if not np.isfinite(E[i, j]) or s > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[s:] = dp[: cap + 1 - s] + E[i, j]
            better = cand < new
            new = np.where(better, cand, new)
            arg = np.where(better, j, arg).astype(np.int16)
        dp = new
        choice[i] = arg
    return MCKTable(unit, S, E, dp, choice)


def solve_mck(sizes: Sequence[Sequence[int]], errors: Sequence[Sequence[float]], budget: int, *,
              unit: int = 1) -> tuple[list[int], float]:
    """Exact multiple-choice knapsack: pick one option per item minimizing the summed error with summed
    size <= ``budget``. Sizes are rounded up and the budget down to multiples of ``unit`` (``unit=1``:
    exact). Returns ``(option index per item, total error)``; raises :class:`BudgetError` when even the
    smallest options do not fit."""
    tab = mck_table(sizes, errors, budget, unit)
    picks = tab.backtrack(budget)
    if picks is None:
        smallest = sum(min(s) for s in sizes)
        if smallest <= budget:
            raise BudgetError(f"budget {budget} fits only with exact sizes; it cannot be met at resolution "
                              f"unit={unit} (use a smaller unit)")
        raise BudgetError(f"budget {budget} is below the smallest possible total size {smallest}")
    return picks, float(sum(errors[i][j] for i, j in enumerate(picks)))
