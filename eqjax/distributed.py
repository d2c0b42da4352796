"""Scale synchronization across devices and hosts: data-parallel statistics, tensor-parallel weights.

Three pieces, all pure functions over ``jax.shard_map`` (``from jax.sharding import PartitionSpec``):

1. **Data-parallel calibration statistics.** A :class:`Statistic` is a pure function of a block of
   rows plus the name of its associative ``merge`` ("max", "min" or "sum"). :data:`COLLECTIVES` maps
   each merge to the collective that combines per-device partials (``pmax`` / ``pmin`` / ``psum``).
   :func:`sharded_statistics` runs a dict of statistics on a batch sharded over a mesh axis and
   returns the merged, replicated result.

2. **Tensor-parallel weight quantization.** :func:`quantize_sharded` quantizes a weight sharded along
   one dimension. Scales whose block lies inside one shard stay local (and come back sharded like the
   weight); per-tensor, cross-shard per-channel and cross-shard group ranges are combined with
   ``pmin``/``pmax`` (or ``all_gather`` for group ranges that straddle shards).

3. **Multi-host.** :func:`init_distributed` (``jax.distributed.initialize`` with gloo CPU collectives,
   short failure timeouts, environment variables), :func:`add_distributed_args` /
   :func:`init_from_args` for CLIs, :func:`host_rows` / :func:`global_batch` so each host feeds only
   its own calibration shard, and :func:`is_main_process` / :func:`write_once` so outputs are written
   by process 0 only.

What "identical" means
----------------------
* ``max``/``min`` merges (absmax, min/max ranges, per-channel activation absmax) are exact in any
  order, so sharded results equal single-device results bitwise for any mesh.
* Integer ``sum`` merges (counts) are exact, reduced with ``psum``.
* Float ``sum`` merges (column sums, the GPTQ Hessian ``X^T X``) are *defined* blockwise: the rows are
  cut into ``num_blocks`` equal contiguous blocks (a fixed number, independent of the mesh), each block
  gives a float32 partial, and the partials are added in a fixed pairwise tree order. The sharded path
  computes each block's partial on the device holding it, ``all_gather``\\ s the partials and adds them in
  the same tree order, so its result equals :func:`compute_statistics` on one device with the same
  ``num_blocks`` bitwise, for every mesh whose data size divides ``num_blocks``. It is *not* bitwise
  equal to a single un-blocked ``x.T @ x`` (a different summation order; it agrees to float32
  rounding). The per-block partial relies on XLA computing the same-shaped block matmul the same way
  in both programs (deterministic kernels per shape), which the tests check.
* Tensor-parallel quantization uses only ``max``/``min`` reductions and elementwise rounding, so the
  codes, scales and zero points equal :func:`eqjax.numerics.quantize` on the whole weight bitwise for
  the ``absmax`` and ``minmax`` calibrators. ``percentile`` and ``mse`` ranges are computed on a
  replicated copy of the weight (same values; one full weight per device, transiently). Scales and
  zero points are derived from the synced ranges in a jit, as ``quantize`` does: XLA compiles
  ``x / constant`` as ``x * (1 / constant)``, so eager and jitted scales can differ by 1 ulp.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import math
import os
import pathlib
from typing import Any, Callable, Literal, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from eqjax.ema import EmaState, ema_absmax
from eqjax.numerics import QuantSpec, check_finite, compute_range, quantize_with, range_to_qparams
from eqjax.qarray import QArray, QArrayError, codes_per_word, is_packed, pack_axis_for, per_group, scale_shape
from eqjax.errors import RuntimeFailure

__all__ = [
    "COLLECTIVES",
    "LOCAL_MERGES",
    "DEFAULT_BLOCKS",
    "Statistic",
    "channel_absmax",
    "channel_max",
    "channel_min",
    "channel_sum",
    "row_count",
    "xtx",
    "tree_sum",
    "compute_statistics",
    "sharded_statistics",
    "sharded_statistic",
    "quantize_sharded",
    "qarray_shardings",
    "synced_ema_update",
    "DistributedInfo",
    "DistributedError",
    "init_distributed",
    "add_distributed_args",
    "init_from_args",
    "shutdown_distributed",
    "is_main_process",
    "write_once",
    "barrier",
    "host_rows",
    "global_batch",
]

log = logging.getLogger("eqjax")

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


# --------------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# Tensor-parallel weight quantization
# --------------------------------------------------------------------------------------------------


def _place(x: jax.Array, mesh: Mesh, spec: P) -> jax.Array:
    """``x`` laid out as ``spec`` on ``mesh`` (inside jit); works for Explicit and Auto mesh axes."""
    sharding = NamedSharding(mesh, spec)
    if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return jax.reshard(x, sharding)
    return lax.with_sharding_constraint(x, sharding)


def _spec_at(ndim: int, dim: int, axis: str) -> P:
    return P(*[axis if i == dim else None for i in range(ndim)])


def _tp_plan(shape: tuple[int, ...], spec: QuantSpec, n: int, dim: int) -> tuple[str, Any]:
    """("local" | "sync" | "straddle", normalized granularity) for a weight sharded n-ways on ``dim``."""
    gran = spec.granularity.normalized(len(shape))
    scale_shape(shape, gran)  # validates group sizes
    if shape[dim] % n:
        raise QArrayError(f"dimension {dim} of length {shape[dim]} does not split into {n} shards")
    local_len = shape[dim] // n
    if is_packed(spec.bits) and pack_axis_for(gran) == dim and local_len % codes_per_word(spec.bits):
        raise QArrayError(
            f"{spec.bits}-bit codes are packed {codes_per_word(spec.bits)} per word along the sharded axis "
            f"{dim}; the shard length {local_len} must be a multiple of that"
        )
    if gran.kind == "tensor":
        return "sync", gran
    if gran.kind == "channel":
        return ("local" if dim in gran.axes else "sync"), gran
    (g,) = gran.axes
    if g != dim or local_len % gran.group_size == 0:
        return "local", gran
    return "straddle", gran


def _local_scale_sharded(mode: str, shape: tuple[int, ...], gran: Any, dim: int) -> bool:
    return mode == "local" and scale_shape(shape, gran)[dim] > 1


@functools.partial(jax.jit, static_argnames="spec")
def _jit_range(w: jax.Array, spec: QuantSpec) -> tuple[jax.Array, jax.Array]:
    return compute_range(w, spec)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _jit_qparams(lo: jax.Array, hi: jax.Array, bits: int, symmetric: bool, scale_dtype: str):
    return range_to_qparams(lo, hi, bits, symmetric, scale_dtype)


def qarray_shardings(
    shape: tuple[int, ...], spec: QuantSpec, mesh: Mesh, axis: str = "model", shard_dim: int = 0
) -> tuple[NamedSharding, NamedSharding]:
    """(values sharding, scale/zero-point sharding) of a weight of ``shape`` sharded on ``shard_dim``.

    Values are sharded like the weight; scales are sharded the same way when each shard owns whole
    scale blocks along ``shard_dim`` (e.g. per-output-channel scales of a column-parallel weight),
    else replicated.
    """
    nd = len(shape)
    dim = shard_dim % nd
    mode, gran = _tp_plan(tuple(shape), spec, mesh.shape[axis], dim)
    vals = NamedSharding(mesh, _spec_at(nd, dim, axis))
    sc = NamedSharding(mesh, _spec_at(nd, dim, axis) if _local_scale_sharded(mode, shape, gran, dim) else P())
    return vals, sc


def quantize_sharded(
    w: jax.Array,
    spec: QuantSpec,
    mesh: Mesh,
    axis: str = "model",
    shard_dim: int = 0,
    *,
    name: str = "tensor",
) -> QArray:
    """Quantize ``w`` sharded along ``shard_dim`` over mesh axis ``axis``; bitwise equal to ``quantize``.

    Args:
      w: float weight, e.g. ``[in, out]``; any sharding (it is resharded to ``P(axis)`` on ``shard_dim``).
      spec: the quantization spec (any granularity). ``absmax``/``minmax`` ranges are computed per
        shard and synced exactly with ``pmax``/``pmin``/``all_gather``; ``percentile``/``mse`` ranges
        are computed on a replicated copy of the weight (one full weight per device, transiently).
      shard_dim: 1 for a column-parallel ``[in, out]`` kernel (output channels split), 0 for row-parallel.
    Returns:
      a QArray whose ``values`` are sharded like ``w`` and whose ``scale``/``zero_point`` are sharded the
      same way where every shard owns whole scale blocks, else replicated (see :func:`qarray_shardings`).
    """
    if not jnp.issubdtype(jnp.dtype(w.dtype), jnp.floating):
        raise TypeError(f"{name}: can only quantize floating-point arrays, got dtype {w.dtype}")
    check_finite(w, name)
    shape = tuple(w.shape)
    nd = len(shape)
    dim = shard_dim % nd
    n = mesh.shape[axis]
    try:
        mode, gran = _tp_plan(shape, spec, n, dim)
    except QArrayError as e:
        raise QArrayError(f"{name}: {e}") from None
    spec = dataclasses.replace(spec, granularity=gran)
    exact = spec.calibrator in ("absmax", "minmax")  # max/min ranges: reduce partial ranges exactly
    local_len = shape[dim] // n
    scale_sharded = _local_scale_sharded(mode, shape, gran, dim)

    G = gran.group_size
    sub = math.gcd(local_len, G) if mode == "straddle" else 0

    def ranges(wl: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Per-block (lo, hi) of the *global* weight: local blocks, or ranges synced over ``axis``."""
        if mode == "local":
            return compute_range(wl, spec)
        if mode == "sync":
            lo, hi = compute_range(wl, spec)
            return lax.pmin(lo, axis), lax.pmax(hi, axis)
        # straddle: groups of G along the sharded axis cross shard boundaries; reduce sub-blocks of
        # gcd(local_len, G) rows (each inside one shard and one group), gather them, then per group.
        lo_s, hi_s = compute_range(wl, dataclasses.replace(spec, granularity=per_group(dim, sub)))
        lo_s = lax.all_gather(lo_s, axis, axis=dim, tiled=True)  # [len / sub] along dim
        hi_s = lax.all_gather(hi_s, axis, axis=dim, tiled=True)
        k = G // sub
        n_groups = -(-shape[dim] // G)  # a ragged last group has fewer sub-blocks: pad with its own edge

        def grouped(a: jax.Array) -> jax.Array:
            pad = n_groups * k - a.shape[dim]
            a = jnp.pad(a, [(0, pad) if i == dim else (0, 0) for i in range(a.ndim)], mode="edge")
            return a.reshape(a.shape[:dim] + (n_groups, k) + a.shape[dim + 1 :])

        return jnp.min(grouped(lo_s), axis=dim + 1), jnp.max(grouped(hi_s), axis=dim + 1)

    def codes(wl: jax.Array, scale: jax.Array, zp: jax.Array | None) -> jax.Array:
        if mode != "straddle":
            return quantize_with(wl, scale, zp, bits=spec.bits, granularity=gran, name=name).values
        first = lax.axis_index(axis) * (local_len // sub)
        group_of_sub = (first + jnp.arange(local_len // sub)) * sub // G
        s_loc = jnp.take(scale, group_of_sub, axis=dim)
        z_loc = None if zp is None else jnp.take(zp, group_of_sub, axis=dim)
        return quantize_with(wl, s_loc, z_loc, bits=spec.bits, granularity=per_group(dim, sub), name=name).values

    w_spec = _spec_at(nd, dim, axis)
    s_spec = w_spec if scale_sharded else P()
    if exact:
        f_ranges = jax.shard_map(ranges, mesh=mesh, in_specs=(w_spec,), out_specs=(s_spec, s_spec), check_vma=False)
        lo, hi = jax.jit(lambda w_: f_ranges(_place(w_, mesh, w_spec)))(w)
    else:
        # percentile / mse: no exact merge of partial ranges; computed on a replicated copy.
        lo, hi = _jit_range(jax.device_put(w, NamedSharding(mesh, P())), spec)
        lo, hi = (jax.device_put(a, NamedSharding(mesh, s_spec)) for a in (lo, hi))
    # Jitted like eqjax.numerics.quantize: XLA turns `/ qmax` into `* (1 / qmax)` when qmax is a
    # compile-time constant, so eager and jitted qparams can differ by 1 ulp.
    scale, zp = _jit_qparams(lo, hi, spec.bits, spec.symmetric, spec.scale_dtype)
    if not bool(jnp.all(jnp.isfinite(scale))):
        raise QArrayError(f"{name}: the range of shape {shape} overflows a {spec.scale_dtype} scale; use float32 scales")
    zp_spec = None if zp is None else s_spec
    f_codes = jax.shard_map(codes, mesh=mesh, in_specs=(w_spec, s_spec, zp_spec), out_specs=w_spec, check_vma=False)
    values = jax.jit(lambda w_, s_, z_: f_codes(_place(w_, mesh, w_spec), s_, z_))(w, scale, zp)
    zp = None if zp is None else zp.astype(jnp.uint8)
    return QArray(values, scale, zp, spec.bits, spec.symmetric, gran, shape, jnp.dtype(w.dtype))


# --------------------------------------------------------------------------------------------------
# Online activation scales
# --------------------------------------------------------------------------------------------------


def synced_ema_update(
    mesh: Mesh, axis: AxisNames = "data", decay: float = 0.99
) -> Callable[[EmaState, jax.Array], EmaState]:
    """A jitted ``(state, x) -> state`` EMA-absmax step on a batch sharded over ``axis``.

    Each replica's step absmax is ``pmax``-reduced (:func:`eqjax.ema.ema_absmax` with ``axis_name``),
    so the replicated state equals the single-device tracker fed the whole batch, bitwise.
    """
    axes = _axes_tuple(axis)
    batch_axis = axes if len(axes) > 1 else axes[0]
    tracker = ema_absmax(decay, axis_name=batch_axis)

    def run(state: EmaState, x: jax.Array) -> EmaState:
        f = jax.shard_map(
            tracker.update,
            mesh=mesh,
            in_specs=(P(), P(batch_axis)),
            out_specs=P(),
            check_vma=False,
        )
        return f(state, _place(x, mesh, P(batch_axis)))

    return jax.jit(run)


# --------------------------------------------------------------------------------------------------
# Multi-host
# --------------------------------------------------------------------------------------------------


class DistributedError(RuntimeFailure):
    """Multi-process setup failed (bad arguments, unreachable coordinator, a peer died)."""


@dataclasses.dataclass(frozen=True)
class DistributedInfo:
    """Where this process stands: ``process_id`` of ``num_processes``; ``initialized`` is False when
    running single-process (nothing was initialized)."""

    process_id: int
    num_processes: int
    local_device_count: int
    device_count: int
    initialized: bool


_ENV = {
    "coordinator": ("EQJAX_COORDINATOR", "JAX_COORDINATOR_ADDRESS"),
    "num_processes": ("EQJAX_NUM_PROCESSES", "JAX_NUM_PROCESSES"),
    "process_id": ("EQJAX_PROCESS_ID", "JAX_PROCESS_ID"),
    "timeout": ("EQJAX_DIST_TIMEOUT",),
}


def _env(key: str) -> str | None:
    for var in _ENV[key]:
        v = os.environ.get(var)
        if v not in (None, ""):
            return v
    return None


def _int_env(key: str) -> int | None:
    v = _env(key)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise DistributedError(f"{'/'.join(_ENV[key])} must be an integer, got {v!r}") from None


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge  # noqa: PLC0415 - private, best effort

        return bool(xla_bridge._backends)
    except Exception:  # pragma: no cover - internals moved
        return False


def init_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: Sequence[int] | None = None,
    cpu_collectives: str = "gloo",
    timeout_s: int | None = None,
    initialization_timeout: int | None = None,
) -> DistributedInfo:
    """Join a multi-process JAX job (``jax.distributed.initialize``) or stay single-process.

    Missing arguments come from ``EQJAX_COORDINATOR`` / ``EQJAX_NUM_PROCESSES`` / ``EQJAX_PROCESS_ID``,
    else JAX's ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``. With none of
    them set (or ``num_processes == 1``) nothing is initialized and a single-process
    :class:`DistributedInfo` is returned. Must run before any JAX computation.

    CPU cross-process collectives are set to ``cpu_collectives`` (``jax_cpu_collectives_implementation``:
    "gloo" or "mpi"). ``timeout_s`` (default ``EQJAX_DIST_TIMEOUT`` or 30) bounds the heartbeat and the
    shutdown barrier, so a dead peer makes the survivors fail within about that time instead of the
    JAX defaults (100 s heartbeat, 300 s shutdown).
    """
    coordinator_address = coordinator_address or _env("coordinator")
    num_processes = num_processes if num_processes is not None else _int_env("num_processes")
    process_id = process_id if process_id is not None else _int_env("process_id")
    if coordinator_address is None and num_processes in (None, 1) and process_id in (None, 0):
        return DistributedInfo(0, 1, jax.local_device_count(), jax.device_count(), False)
    missing = [k for k, v in (("coordinator address", coordinator_address), ("number of processes",
               num_processes), ("process id", process_id)) if v is None]
    if missing:
        raise DistributedError(
            "multi-process run needs " + ", ".join(missing) + " (arguments, --coordinator/--num-processes/"
            "--process-id, or EQJAX_COORDINATOR/EQJAX_NUM_PROCESSES/EQJAX_PROCESS_ID)"
        )
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise DistributedError(f"need 0 <= process_id < num_processes, got {process_id} of {num_processes}")
    if ":" not in coordinator_address:
        raise DistributedError(f"coordinator address must be host:port, got {coordinator_address!r}")
    if jax.distributed.is_initialized():
        raise DistributedError("jax.distributed is already initialized in this process")
    if _backend_started():
        raise DistributedError("init_distributed must run before any JAX computation (the backend is already up)")
    if timeout_s is None:
        timeout_s = _int_env("timeout") or 30
    if cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    kw: dict[str, Any] = dict(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        heartbeat_timeout_seconds=max(int(timeout_s), 2),
        shutdown_timeout_seconds=max(int(timeout_s), 2),
        initialization_timeout=int(initialization_timeout or max(timeout_s, 10)),
    )
    if local_device_ids is not None:
        kw["local_device_ids"] = list(local_device_ids)
    try:
        jax.distributed.initialize(**kw)
    except Exception as e:  # noqa: BLE001 - surface every failure with context
        raise DistributedError(
            f"process {process_id}/{num_processes}: cannot join the job at {coordinator_address}: {e}"
        ) from e
    info = DistributedInfo(jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count(), True)
    log.info("distributed: process %d of %d, %d local / %d global devices", *dataclasses.astuple(info)[:4])
    return info


def add_distributed_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--coordinator``, ``--num-processes``, ``--process-id``, ``--dist-timeout`` to a CLI parser."""
    g = parser.add_argument_group("multi-process (jax.distributed)")
    g.add_argument("--coordinator", default=None, help="host:port of process 0 (env EQJAX_COORDINATOR)")
    g.add_argument("--num-processes", type=int, default=None, help="number of processes (env EQJAX_NUM_PROCESSES)")
    g.add_argument("--process-id", type=int, default=None, help="this process's id (env EQJAX_PROCESS_ID)")
    g.add_argument(
        "--dist-timeout", type=int, default=None, help="seconds before a dead peer fails the job (default 30)"
    )
    return parser


def init_from_args(args: argparse.Namespace) -> DistributedInfo:
    """:func:`init_distributed` from the flags :func:`add_distributed_args` added."""
    return init_distributed(
        getattr(args, "coordinator", None),
        getattr(args, "num_processes", None),
        getattr(args, "process_id", None),
        timeout_s=getattr(args, "dist_timeout", None),
    )


def shutdown_distributed() -> None:
    """``jax.distributed.shutdown()`` if initialized (a no-op otherwise)."""
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()


def is_main_process() -> bool:
    """True on process 0 (the one that writes outputs)."""
    return jax.process_index() == 0


def write_once(path: str | os.PathLike, write: Callable[[pathlib.Path], Any], *, sync: bool = True) -> Any:
    """Call ``write(path)`` on process 0 only; with ``sync`` every process waits until it is done."""
    p = pathlib.Path(path)
    result = write(p) if is_main_process() else None
    if sync and jax.process_count() > 1:
        barrier(f"eqjax_write_once:{p}")
    return result


def barrier(name: str) -> None:
    """Block until every process reaches ``name`` (no-op single-process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils  # noqa: PLC0415

        multihost_utils.sync_global_devices(name)


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
