"""Online activation scales kept identical on every data-parallel replica.

:func:`synced_ema_update` is :func:`eqjax.calibration.ema.ema_absmax` on a batch sharded over mesh axes: each
replica's step absmax is ``pmax``-reduced (a max: exact in any order), so the replicated state
equals the single-device tracker fed the whole batch, bitwise.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from eqjax.calibration.ema import EmaState, ema_absmax
from eqjax.distributed.sharded import AxisNames, _axes_tuple, _place

__all__ = ["synced_ema_update"]


def synced_ema_update(mesh: Mesh, axis: AxisNames | None = None,
                      decay: float = 0.99) -> Callable[[EmaState, jax.Array], EmaState]:
    """A jitted ``(state, x) -> state`` EMA-absmax step; ``x``'s leading axis is split over ``axis``
    (a mesh axis name or tuple of names; default: every axis of ``mesh``)."""
    axes = tuple(mesh.axis_names) if axis is None else _axes_tuple(axis)
    batch_axis = axes if len(axes) > 1 else axes[0]
    tracker = ema_absmax(decay, axis_name=batch_axis)
    step = jax.shard_map(tracker.update, mesh=mesh, in_specs=(P(), P(batch_axis)), out_specs=P(), check_vma=False)

    def run(state: EmaState, x: jax.Array) -> EmaState:
        return step(state, _place(x, mesh, P(batch_axis)))

    return jax.jit(run)
