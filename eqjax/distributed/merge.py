"""Merging per-slot statistic partials across the mesh, inside a jitted ``shard_map`` step.

Each device computes one batch's partial of a :class:`eqjax.calibration.statistics.Statistic` (the batch it holds
at this step, see :mod:`eqjax.distributed.mesh`); the replicated running state then absorbs the
step's partials with the statistic's named merge:

* ``"ordered"`` (default): the partials are gathered (``all_gather`` over the slot axes) and merged
  into the state one by one in global batch order, exactly as one device merges batch after batch.
  Every merge, float sums included, is then **bitwise identical for every mesh** (1 device, N
  devices, N hosts): GPTQ's ``X^T X``, AWQ's ``sum |x|``, counts, maxima and minima. Cost per step:
  each device receives ``S`` partials (``S * K * K * 4`` bytes for ``X^T X``).
* ``"collective"``: one ``pmax`` / ``pmin`` / ``psum`` per statistic (``K * K`` bytes per device per step
  whatever ``S``). Max and min stay bitwise; float sums are added in the collective's order:
  for ``s`` summed partials the result differs from the ordered sum by at most about
  ``(s - 1) * eps * sum |partials|`` element-wise (``eps = 2**-24`` for float32): the choice for very
  large meshes, where ``S`` gathered ``[K, K]`` partials do not fit.

Invalid slots (padding of a short last step) never enter the state.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax

from eqjax.calibration.statistics import Statistic, merge

__all__ = ["Reduction", "merge_slots", "COLLECTIVES"]

Reduction = Literal["ordered", "collective"]

COLLECTIVES = {"max": lax.pmax, "min": lax.pmin, "sum": lax.psum}
"""Merge name -> the collective that merges one partial per device."""


def merge_slots(stat: Statistic, state: Any, part: Any, valid: jax.Array, identity: Any, axes: tuple[str, ...],
                n_slots: int, how: Reduction = "ordered") -> Any:
    """The replicated ``state`` merged with every valid slot's ``part`` (call inside ``shard_map``).

    Args:
      stat: the statistic (its ``merge`` names the reduction).
      state: the running state, replicated (same on every device).
      part: this device's partial for its batch of the step.
      valid: bool scalar, False for a padding slot.
      identity: ``stat.init(K)`` (the merge's identity), used by ``"collective"`` for invalid slots.
      axes: the mesh axes of the batch slots; ``n_slots`` their total size.
    """
    if how == "collective":
        masked = jax.tree.map(lambda p, e: jnp.where(valid, p, e), part, identity)
        red = jax.tree.map(lambda p: COLLECTIVES[stat.merge](p, axes), masked)
        return merge(stat, state, red)
    if how != "ordered":
        raise ValueError(f"unknown reduction {how!r}: use 'ordered' or 'collective'")
    if n_slots == 1:
        cand = merge(stat, state, part)
        return jax.tree.map(lambda c, o: jnp.where(valid, c, o), cand, state)
    parts = jax.tree.map(lambda p: lax.all_gather(p, axes), part)  # [S, ...] in slot order
    valids = lax.all_gather(valid, axes)
    for s in range(n_slots):
        cand = merge(stat, state, jax.tree.map(lambda a: a[s], parts))
        state = jax.tree.map(lambda c, o: jnp.where(valids[s], c, o), cand, state)
    return state
