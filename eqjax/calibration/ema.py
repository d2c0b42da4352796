"""Online activation scales: an exponential moving average of the per-step absmax (seed eq. 2 / 9).

Optax-style: :func:`ema_absmax` returns a :class:`Tracker` of pure ``init`` / ``update`` functions over
a NamedTuple state, so it can live inside ``jax.jit`` and ``shard_map``. With ``axis_name`` the
step's absmax is first reduced with ``lax.pmax`` over that mesh axis, so every data-parallel replica
holds the identical scale.

``absmax_t = m_t`` at the first step, then ``decay * absmax_{t-1} + (1 - decay) * m_t`` with
``m_t = max|A_t|``; the scale is ``max(absmax_t, floor) / (2**(bits-1) - 1)``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["EmaState", "Tracker", "ema_absmax", "scale_from_state"]


class EmaState(NamedTuple):
    absmax: jax.Array  # float32 [], the smoothed absmax
    count: jax.Array  # int32 [], steps seen


class Tracker(NamedTuple):
    init: Callable[[], EmaState]
    update: Callable[[EmaState, jax.Array], EmaState]


def ema_absmax(decay: float = 0.99, axis_name: str | None = None) -> Tracker:
    """Track an EMA of ``max|x|`` over steps; ``axis_name`` synchronizes replicas with ``pmax``."""
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"decay must be in [0, 1), got {decay}")

    def init() -> EmaState:
        return EmaState(jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))

    def update(state: EmaState, x: jax.Array) -> EmaState:
        m = jnp.max(jnp.abs(x.astype(jnp.float32)))
        if axis_name is not None:
            m = jax.lax.pmax(m, axis_name)
        new = jnp.where(state.count == 0, m, decay * state.absmax + (1.0 - decay) * m)
        return EmaState(new, state.count + 1)

    return Tracker(init, update)


def scale_from_state(state: EmaState, bits: int = 8, floor: float = 1e-8) -> jax.Array:
    """Static symmetric activation scale from a tracker state (never 0)."""
    return jnp.maximum(state.absmax, floor) / (2 ** (bits - 1) - 1)
