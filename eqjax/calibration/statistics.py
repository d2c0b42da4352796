"""Calibration statistics: one type, named associative merges.

A :class:`Statistic` reduces the rows of an activation matrix ``x [n, K]`` (one row per token, ``K``
input channels of a weight, in the weight's canonical order) with per-row weights ``w [n] >= 0``:
``partial(x, w)`` is the statistic of these rows, and ``merge`` (``"max"``, ``"min"`` or ``"sum"``)
combines two partials. Calibration accumulates ``state = merge(state, partial(batch))`` over batches;
data-parallel calibration merges per-device partials with the matching collective (``pmax`` /
``pmin`` / ``psum``), so one device and a mesh run the same code. ``finalize`` turns the accumulated
state into the value methods use.

Row weights: ``w = 0`` excludes a row (max/min ignore it, sums do not count it); calibration uses
them to down-weight attention-sink tokens (see :mod:`eqjax.calibration.calibrate`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Literal, NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "Statistic", "MERGE_FNS", "merge", "accumulate", "absmax", "maximum", "minimum", "abs_sum", "abs_mean",
    "xtx", "hessian", "count", "nonfinite",
]

MERGE_FNS: dict[str, Callable[[Any, Any], Any]] = {"max": jnp.maximum, "min": jnp.minimum, "sum": jnp.add}


class Statistic(NamedTuple):
    """An associative reduction over the rows of ``[n, K]``.

    Attributes:
      name: what it is (for messages).
      init: ``K -> state`` (a pytree of float32 arrays: the identity of ``merge``).
      partial: ``(x [n, K], w [n]) -> state`` of these rows.
      merge: ``"max"``, ``"min"`` or ``"sum"``, leaf-wise
        (``partial(concat(a, b)) == merge(partial(a), partial(b))`` up to float rounding of sums).
      finalize: ``state -> value``.
      channel_local: output channel ``k`` (the last axis of the state and value) reads only input
        channel ``k``, so ``partial(x[:, a:b], w) == partial(x, w)[a:b]``: it can run on activations
        sharded along ``K`` without gathering them (:mod:`eqjax.distributed.sharded`).
    """

    name: str
    init: Callable[[int], Any]
    partial: Callable[[jax.Array, jax.Array], Any]
    merge: Literal["max", "min", "sum"]
    finalize: Callable[[Any], Any] = lambda s: s
    channel_local: bool = False


def merge(stat: Statistic, a: Any, b: Any) -> Any:
    """Merge two states of ``stat`` (leaf-wise max/min/sum)."""
    return jax.tree.map(MERGE_FNS[stat.merge], a, b)


def accumulate(stat: Statistic, state: Any, x: jax.Array, w: jax.Array) -> Any:
    """``merge(state, partial(x, w))``."""
    return merge(stat, state, stat.partial(x, w))


def _f32(x: jax.Array) -> jax.Array:
    return x.astype(jnp.float32)


@functools.cache
def absmax() -> Statistic:
    """Per-channel ``max |x|`` over rows with weight > 0 (float32 ``[K]``)."""
    return Statistic(
        "absmax", lambda k: jnp.zeros((k,), jnp.float32),
        lambda x, w: jnp.max(jnp.where(w[:, None] > 0, jnp.abs(_f32(x)), 0.0), axis=0), "max", channel_local=True,
    )


@functools.cache
def maximum() -> Statistic:
    """Per-channel ``max x`` (``-inf`` before any row)."""
    return Statistic(
        "max", lambda k: jnp.full((k,), -jnp.inf, jnp.float32),
        lambda x, w: jnp.max(jnp.where(w[:, None] > 0, _f32(x), -jnp.inf), axis=0), "max", channel_local=True,
    )


@functools.cache
def minimum() -> Statistic:
    """Per-channel ``min x`` (``+inf`` before any row)."""
    return Statistic(
        "min", lambda k: jnp.full((k,), jnp.inf, jnp.float32),
        lambda x, w: jnp.min(jnp.where(w[:, None] > 0, _f32(x), jnp.inf), axis=0), "min", channel_local=True,
    )


@functools.cache
def abs_sum() -> Statistic:
    """Per-channel weighted ``(sum w|x|, sum w)``; finalizes to the weighted mean ``|x|`` (AWQ's)."""
    return Statistic(
        "abs_mean", lambda k: (jnp.zeros((k,), jnp.float32), jnp.zeros((), jnp.float32)),
        lambda x, w: (jnp.einsum("n,nf->f", w, jnp.abs(_f32(x)), precision="highest"), jnp.sum(w)),
        "sum", lambda s: s[0] / jnp.maximum(s[1], 1e-30),
    )


abs_mean = abs_sum


@functools.cache
def xtx() -> Statistic:
    """Weighted second moment ``(X^T W X [K, K], sum w)`` in float32; finalizes to ``X^T W X / sum w``
    (GPTQ's Hessian is twice this)."""
    return Statistic(
        "xtx", lambda k: (jnp.zeros((k, k), jnp.float32), jnp.zeros((), jnp.float32)),
        lambda x, w: (jnp.einsum("nf,ng->fg", _f32(x) * w[:, None], _f32(x), precision="highest"), jnp.sum(w)),
        "sum", lambda s: s[0] / jnp.maximum(s[1], 1e-30),
    )


@functools.cache
def hessian() -> Statistic:
    """GPTQ's Hessian ``2 X^T W X / sum w`` (float32 ``[K, K]``): :func:`xtx` doubled as it is finalized, so no
    K x K copy is made to double it (doubling is exact: the same bits as doubling the finalized ``xtx``)."""
    return Statistic(
        "hessian", xtx().init, xtx().partial, "sum", lambda s: 2.0 * (s[0] / jnp.maximum(s[1], 1e-30)),
    )


@functools.cache
def count() -> Statistic:
    """Weighted row count ``sum w`` (float32 scalar)."""
    return Statistic("count", lambda k: jnp.zeros((), jnp.float32), lambda x, w: jnp.sum(w), "sum")


@functools.cache
def nonfinite() -> Statistic:
    """Number of NaN/Inf entries (XLA's max may drop NaN, so absmax alone cannot tell)."""
    return Statistic(
        "nonfinite", lambda k: jnp.zeros((), jnp.float32),
        lambda x, w: jnp.sum(~jnp.isfinite(_f32(x))).astype(jnp.float32), "sum",
    )
