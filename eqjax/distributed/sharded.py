"""Data-parallel statistics on arrays already sharded over a mesh axis, and per-host batch rows.

Lower-level than the Calibrator (which merges partials per step, :mod:`eqjax.distributed.merge`):
:func:`sharded_statistics` runs a dict of :class:`eqjax.calibration.statistics.Statistic` (``absmax()``,
``xtx()``, ``count()``, ...) on activations ``x [B, ..., K]`` sharded over a mesh axis under
``shard_map`` and returns the finalized, replicated values. Every row has weight 1.

* ``max``/``min`` merges are exact in any order: sharded results equal one device bitwise.
* ``sum`` merges (``X^T X``, ``sum |x|``, counts) are *defined* blockwise: rows cut into ``num_blocks``
  equal contiguous blocks (fixed, independent of the mesh), one float32 partial per block, added in
  a fixed pairwise tree order (:func:`tree_sum`); the sharded path ``all_gather``\\ s the partials and
  adds them in the same order, so it equals :func:`compute_statistics` with the same ``num_blocks``
  bitwise for every mesh whose data size divides ``num_blocks`` (not bitwise equal to one un-blocked
  ``x.T @ x``).

Multi-host feeding: :func:`host_rows` (this process's contiguous share of the rows) and
:func:`global_batch` (``jax.make_array_from_process_local_data``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from eqjax.calibration.statistics import MERGE_FNS, Statistic
from eqjax.distributed.merge import COLLECTIVES

__all__ = [
    "DEFAULT_BLOCKS", "tree_sum", "compute_statistics", "sharded_statistics", "sharded_statistic", "host_rows",
    "global_batch", "AxisNames",
]

AxisNames = str | tuple[str, ...]

#: default number of row blocks for float sums (must be a multiple of the data-parallel size).
DEFAULT_BLOCKS = 8


def tree_sum(parts: Sequence[Any]) -> Any:
    """Leaf-wise sum of pytrees in a fixed pairwise order: ``((p0 + p1) + (p2 + p3)) + ...`` (odd tails
    carried up)."""
    parts = list(parts)
    if not parts:
        raise ValueError("tree_sum of no parts")
    while len(parts) > 1:
        nxt = [jax.tree.map(jnp.add, parts[i], parts[i + 1]) for i in range(0, len(parts) - 1, 2)]
        if len(parts) % 2:
            nxt.append(parts[-1])
        parts = nxt
    return parts[0]


def _rows(x: jax.Array) -> jax.Array:
    """``[..., K] -> [rows, K]`` (batch-major, so contiguous batch shards are contiguous row blocks)."""
    if x.ndim < 2:
        raise ValueError(f"statistics need activations of rank >= 2 ([rows, K] or [B, T, K]), got {x.shape}")
    return x.reshape(-1, x.shape[-1])


def _value(stat: Statistic, rows: jax.Array) -> Any:
    """The statistic's state of ``rows [n, K]``, every row weighted 1."""
    return stat.partial(rows, jnp.ones((rows.shape[0],), jnp.float32))


def compute_statistics(
    stats: Mapping[str, Statistic],
    x: jax.Array,
    *,
    num_blocks: int = DEFAULT_BLOCKS,
    axis_name: AxisNames | None = None,
    axis_size: int = 1,
) -> dict[str, Any]:
    """``{name: stat.finalize(state)}`` of ``stats`` on activations ``x [B, ..., K]`` (rows = all leading axes).

    On one device (``axis_name=None``) this is the reference definition. Inside ``shard_map`` pass the
    data axis name(s) and their total size: ``x`` is then this device's contiguous slice of the global
    batch, holding ``num_blocks / axis_size`` of the ``num_blocks`` global row blocks, and the result is
    the same as the single-device value on the whole batch (bitwise, see the module docs).
    """
    for name, stat in stats.items():
        if stat.merge not in MERGE_FNS:
            raise ValueError(f"statistic {name!r}: unknown merge {stat.merge!r}; use one of {sorted(MERGE_FNS)}")
    if num_blocks < 1 or num_blocks % axis_size:
        raise ValueError(f"num_blocks={num_blocks} must be a positive multiple of the data-parallel size {axis_size}")
    local_blocks = num_blocks // axis_size
    if x.shape[0] % local_blocks:
        raise ValueError(
            f"the local batch of {x.shape[0]} (leading axis of {tuple(x.shape)}) does not split into "
            f"{local_blocks} equal blocks; use a batch that is a multiple of num_blocks={num_blocks}"
        )
    blocks: jax.Array | None = None
    out: dict[str, Any] = {}
    for name, stat in stats.items():
        if stat.merge in ("max", "min"):
            state = _value(stat, _rows(x))
            if axis_name is not None:
                state = jax.tree.map(lambda v: COLLECTIVES[stat.merge](v, axis_name), state)
        else:
            if blocks is None:
                blocks = _rows(x).reshape(local_blocks, -1, x.shape[-1])  # [local_blocks, rows/block, K]
            # lax.map (a loop) materializes each block's partial: fused into the tree's adds, a partial's
            # last multiply could become an FMA and round differently from the sharded path's gathered
            # partials (seen for 1-row blocks, where XLA rewrites the block matmul as a multiply).
            stacked = lax.map(lambda b: _value(stat, b), blocks)  # leaves [local_blocks, ...]
            if axis_name is not None:
                stacked = jax.tree.map(lambda v: lax.all_gather(v, axis_name, axis=0, tiled=True), stacked)
            state = tree_sum([jax.tree.map(lambda v: v[i], stacked) for i in range(num_blocks)])
        out[name] = stat.finalize(state)
    return out


def _place(x: jax.Array, mesh: Mesh, spec: P) -> jax.Array:
    """``x`` laid out as ``spec`` on ``mesh`` (inside jit); works for Explicit and Auto mesh axes."""
    sharding = NamedSharding(mesh, spec)
    if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return jax.reshard(x, sharding)
    return lax.with_sharding_constraint(x, sharding)


def _axes_tuple(axis: AxisNames) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis)


def _axis_size(mesh: Mesh, axis: AxisNames) -> int:
    return int(np.prod([mesh.shape[a] for a in _axes_tuple(axis)], dtype=np.int64))


def sharded_statistics(
    stats: Mapping[str, Statistic],
    mesh: Mesh,
    axis: AxisNames = "data",
    *,
    feature_axis: str | None = None,
    num_blocks: int = DEFAULT_BLOCKS,
) -> Callable[[jax.Array], dict[str, jax.Array]]:
    """A jitted ``x -> {name: finalized value}`` of ``stats`` for activations sharded over ``mesh``.

    ``x [B, ..., K]`` is sharded ``P(axis, ..., feature_axis)``: the batch over ``axis`` (a name or a
    tuple of names, e.g. ``("data", "model")`` to use a whole 2-D mesh for calibration) and, optionally,
    the features over ``feature_axis`` (tensor-parallel activations). Every result is replicated over
    ``axis``; ``channel_local`` statistics come back sharded ``P(feature_axis)`` along their last axis,
    the others are replicated (the features are all-gathered for them first).
    """
    axes = _axes_tuple(axis)
    for a in axes + ((feature_axis,) if feature_axis else ()):
        if a not in mesh.shape:
            raise ValueError(f"mesh has no axis {a!r} (axes: {tuple(mesh.shape)})")
    if feature_axis in axes:
        raise ValueError("feature_axis must differ from the batch axis")
    n = _axis_size(mesh, axes)
    if num_blocks % n:
        raise ValueError(f"num_blocks={num_blocks} must be a multiple of the data-parallel size {n}")
    names = tuple(stats)
    local = {k: s for k, s in stats.items() if s.channel_local}
    glob = {k: s for k, s in stats.items() if not s.channel_local}
    batch_axis = axes if len(axes) > 1 else axes[0]

    def body(x: jax.Array) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
        a = compute_statistics(local, x, num_blocks=num_blocks, axis_name=batch_axis, axis_size=n)
        if glob and feature_axis is not None:
            x = lax.all_gather(x, feature_axis, axis=x.ndim - 1, tiled=True)
        b = compute_statistics(glob, x, num_blocks=num_blocks, axis_name=batch_axis, axis_size=n)
        return a, b

    def run(x: jax.Array) -> dict[str, jax.Array]:
        in_spec = P(batch_axis, *([None] * (x.ndim - 2)), feature_axis)
        out_a = {k: P(*([None] * (_out_ndim(s, x) - 1)), feature_axis) for k, s in local.items()}
        out_b = {k: P() for k in glob}
        f = jax.shard_map(body, mesh=mesh, in_specs=(in_spec,), out_specs=(out_a, out_b), check_vma=False)
        a, b = f(_place(x, mesh, in_spec))
        return {k: (a[k] if k in a else b[k]) for k in names}

    return jax.jit(run)


def _out_ndim(stat: Statistic, x: jax.Array) -> int:
    """Rank of ``stat``'s value (channel-local values have ``K`` last)."""
    probe = jax.ShapeDtypeStruct((1, x.shape[-1]), x.dtype)
    return len(jax.eval_shape(lambda r: stat.finalize(_value(stat, r)), probe).shape)


def sharded_statistic(
    stat: Statistic, mesh: Mesh, axis: AxisNames = "data", **kw: Any
) -> Callable[[jax.Array], jax.Array]:
    """:func:`sharded_statistics` for one statistic: a jitted ``x -> finalized value``."""
    f = sharded_statistics({"s": stat}, mesh, axis, **kw)
    return lambda x: f(x)["s"]


def host_rows(n: int, process_id: int | None = None, num_processes: int | None = None) -> slice:
    """This host's contiguous share of ``n`` calibration rows (``n`` must divide evenly)."""
    pid = jax.process_index() if process_id is None else process_id
    nproc = jax.process_count() if num_processes is None else num_processes
    if n % nproc:
        raise ValueError(f"{n} calibration rows do not split evenly over {nproc} processes")
    k = n // nproc
    return slice(pid * k, (pid + 1) * k)


def global_batch(local: np.ndarray | jax.Array, mesh: Mesh, axis: AxisNames = "data") -> jax.Array:
    """A global array sharded ``P(axis)`` on its leading dim from each host's own rows.

    Every process passes its contiguous block of the global batch (in process order, see
    :func:`host_rows`); the result has leading dim ``num_processes * local.shape[0]``.
    """
    axes = _axes_tuple(axis)
    sharding = NamedSharding(mesh, P(axes if len(axes) > 1 else axes[0]))
    return jax.make_array_from_process_local_data(sharding, np.asarray(local))
