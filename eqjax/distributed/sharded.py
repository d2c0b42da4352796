"""Data-parallel statistics on arrays already sharded over a mesh axis, and per-host batch rows.

Lower-level than the Calibrator (which merges :class:`eqjax.statistics.Statistic` partials per step,
:mod:`eqjax.distributed.merge`): :func:`sharded_statistics` runs a dict of row statistics on a
batch sharded over a mesh axis under ``shard_map`` and returns the merged, replicated result.

* ``max``/``min`` merges are exact in any order: sharded results equal one device bitwise.
* Integer ``sum`` merges (counts) are exact, reduced with ``psum``.
* Float ``sum`` merges (column sums, ``X^T X``) are *defined* blockwise: rows cut into ``num_blocks``
  equal contiguous blocks (fixed, independent of the mesh), one float32 partial per block, added in
  a fixed pairwise tree order; the sharded path ``all_gather``\\ s the partials and adds them in the
  same order, so it equals :func:`compute_statistics` with the same ``num_blocks`` bitwise for every
  mesh whose data size divides ``num_blocks`` (not bitwise equal to one un-blocked ``x.T @ x``).

Multi-host feeding: :func:`host_rows` (this process's contiguous share of the rows) and
:func:`global_batch` (``jax.make_array_from_process_local_data``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "LOCAL_MERGES", "DEFAULT_BLOCKS", "Statistic", "channel_absmax", "channel_max", "channel_min", "channel_sum",
    "row_count", "xtx", "tree_sum", "compute_statistics", "sharded_statistics", "sharded_statistic",
    "host_rows", "global_batch", "AxisNames",
]

Merge = Literal["max", "min", "sum"]
AxisNames = str | tuple[str, ...]

#: merge name -> collective combining per-device partials inside ``shard_map``.
COLLECTIVES: dict[str, Callable[..., jax.Array]] = {"max": lax.pmax, "min": lax.pmin, "sum": lax.psum}
#: merge name -> the same merge of two local partials.
LOCAL_MERGES: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "max": jnp.maximum,
    "min": jnp.minimum,
    "sum": jnp.add,
}
#: default number of row blocks for float sums (must be a multiple of the data-parallel size).
DEFAULT_BLOCKS = 8



@dataclasses.dataclass(frozen=True)
class Statistic:
    """A calibration statistic: ``fn(rows [n, K]) -> partial`` merged associatively by ``merge``.

    Attributes:
      fn: pure function of a 2-D block of rows (features last). Must satisfy
        ``fn(concat(a, b)) == merge(fn(a), fn(b))`` (up to float rounding for float sums).
      merge: ``"max"``, ``"min"`` or ``"sum"`` (see :data:`COLLECTIVES`).
      channel_local: the output's last axis is the feature axis and each output channel only reads
        its own input channel (per-channel absmax/min/max). Such statistics run on a feature-sharded
        batch without gathering it and come back sharded along the features. Only set it for
        ``max``/``min`` merges or integer sums if bitwise equality matters (see :func:`channel_sum`).
    """

    fn: Callable[[jax.Array], jax.Array]
    merge: Merge
    channel_local: bool = False

    def __post_init__(self) -> None:
        if self.merge not in COLLECTIVES:
            raise ValueError(f"unknown merge {self.merge!r}; use one of {sorted(COLLECTIVES)}")


def channel_absmax() -> Statistic:
    """Per-input-channel ``max |x|`` over rows: ``[n, K] -> [K]`` float32 (SmoothQuant's statistic)."""
    return Statistic(lambda x: jnp.max(jnp.abs(x.astype(jnp.float32)), axis=0), "max", channel_local=True)


def channel_max() -> Statistic:
    """Per-channel maximum over rows ``[n, K] -> [K]`` float32."""
    return Statistic(lambda x: jnp.max(x.astype(jnp.float32), axis=0), "max", channel_local=True)


def channel_min() -> Statistic:
    """Per-channel minimum over rows ``[n, K] -> [K]`` float32."""
    return Statistic(lambda x: jnp.min(x.astype(jnp.float32), axis=0), "min", channel_local=True)


def channel_sum() -> Statistic:
    """Per-channel sum over rows ``[n, K] -> [K]`` float32 (blockwise, see the module docs).

    Not ``channel_local``: a float sum over a feature shard ``[n, K/m]`` need not be bitwise the
    matching slice of the ``[n, K]`` sum (kernels differ per shape); the features are gathered first
    so the block shapes match the single-device run.
    """

    def fn(x: jax.Array) -> jax.Array:
        # a matmul, not jnp.sum: XLA emits a reduce differently depending on what it is fused with
        # (seen: 1 ulp after an all_gather), while the dot is one library call per shape.
        ones = jnp.ones((1, x.shape[0]), jnp.float32)
        return jnp.matmul(ones, x.astype(jnp.float32), precision=lax.Precision.HIGHEST)[0]

    return Statistic(fn, "sum")


def row_count() -> Statistic:
    """Number of rows, int32 ``[]`` (exact)."""
    return Statistic(lambda x: jnp.asarray(x.shape[0], jnp.int32), "sum")


def xtx() -> Statistic:
    """``X^T X`` of the rows, float32 ``[K, K]`` (the GPTQ Hessian up to ``2 / n``; blockwise)."""

    def fn(x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        return jnp.matmul(xf.T, xf, precision=lax.Precision.HIGHEST)

    return Statistic(fn, "sum")


def tree_sum(parts: Sequence[jax.Array]) -> jax.Array:
    """Sum in a fixed pairwise order: ``((p0 + p1) + (p2 + p3)) + ...`` (odd tails carried up)."""
    parts = list(parts)
    if not parts:
        raise ValueError("tree_sum of no parts")
    while len(parts) > 1:
        nxt = [parts[i] + parts[i + 1] for i in range(0, len(parts) - 1, 2)]
        if len(parts) % 2:
            nxt.append(parts[-1])
        parts = nxt
    return parts[0]


def _rows(x: jax.Array) -> jax.Array:
    """``[..., K] -> [rows, K]`` (batch-major, so contiguous batch shards are contiguous row blocks)."""
    if x.ndim < 2:
        raise ValueError(f"statistics need activations of rank >= 2 ([rows, K] or [B, T, K]), got {x.shape}")
    return x.reshape(-1, x.shape[-1])


def _is_exact_sum(stat: Statistic, out: jax.ShapeDtypeStruct) -> bool:
    return stat.merge == "sum" and not jnp.issubdtype(out.dtype, jnp.floating)


def compute_statistics(
    stats: Mapping[str, Statistic],
    x: jax.Array,
    *,
    num_blocks: int = DEFAULT_BLOCKS,
    axis_name: AxisNames | None = None,
    axis_size: int = 1,
) -> dict[str, jax.Array]:
    """Evaluate and merge ``stats`` on activations ``x [B, ..., K]`` (rows = all leading axes).

    On one device (``axis_name=None``) this is the reference definition. Inside ``shard_map`` pass the
    data axis name(s) and their total size: ``x`` is then this device's contiguous slice of the global
    batch, holding ``num_blocks / axis_size`` of the ``num_blocks`` global row blocks, and the result is
    the same as the single-device value on the whole batch (bitwise, see the module docs).
    """
    if num_blocks < 1 or num_blocks % axis_size:
        raise ValueError(f"num_blocks={num_blocks} must be a positive multiple of the data-parallel size {axis_size}")
    local_blocks = num_blocks // axis_size
    if x.shape[0] % local_blocks:
        raise ValueError(
            f"the local batch of {x.shape[0]} (leading axis of {tuple(x.shape)}) does not split into "
            f"{local_blocks} equal blocks; use a batch that is a multiple of num_blocks={num_blocks}"
        )
    blocks: jax.Array | None = None
    out: dict[str, jax.Array] = {}
    for name, stat in stats.items():
        if stat.merge in ("max", "min"):
            v = stat.fn(_rows(x))
            out[name] = v if axis_name is None else COLLECTIVES[stat.merge](v, axis_name)
            continue
        shape = jax.eval_shape(stat.fn, jax.ShapeDtypeStruct((1, x.shape[-1]), x.dtype))
        if _is_exact_sum(stat, shape):
            v = stat.fn(_rows(x))
            out[name] = v if axis_name is None else lax.psum(v, axis_name)
            continue
        if blocks is None:
            blocks = _rows(x).reshape(local_blocks, -1, x.shape[-1])  # [local_blocks, rows/block, K]
        # lax.map (a loop) materializes each block's partial: fused into the tree's adds, a partial's
        # last multiply could become an FMA and round differently from the sharded path's gathered
        # partials (seen for 1-row blocks, where XLA rewrites the block matmul as a multiply).
        stacked = lax.map(stat.fn, blocks)
        if axis_name is not None:
            stacked = lax.all_gather(stacked, axis_name, axis=0, tiled=True)  # [num_blocks, ...]
        parts = [stacked[i] for i in range(num_blocks)]
        out[name] = tree_sum(parts)
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
    """A jitted ``x -> {name: statistic}`` for activations sharded over ``mesh``.

    ``x [B, ..., K]`` is sharded ``P(axis, ..., feature_axis)``: the batch over ``axis`` (a name or a
    tuple of names, e.g. ``("data", "model")`` to use a whole 2-D mesh for calibration) and, optionally,
    the features over ``feature_axis`` (tensor-parallel activations). Every result is replicated over
    ``axis``; channel-local statistics come back sharded ``P(feature_axis)`` along their last axis,
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
    return len(jax.eval_shape(stat.fn, jax.ShapeDtypeStruct((1, x.shape[-1]), x.dtype)).shape)


def sharded_statistic(
    stat: Statistic, mesh: Mesh, axis: AxisNames = "data", **kw: Any
) -> Callable[[jax.Array], jax.Array]:
    """:func:`sharded_statistics` for one statistic: a jitted ``x -> merged statistic``."""
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
