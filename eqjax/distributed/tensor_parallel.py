"""Tensor-parallel weight quantization: :func:`quantize_sharded` quantizes a weight sharded along one dim.

Scales whose block lies inside one shard stay local (and come back sharded like the weight);
per-tensor, cross-shard per-channel and cross-shard group ranges are combined with ``pmin`` /
``pmax`` (or ``all_gather`` for group ranges that straddle shards). Only ``max``/``min`` reductions
and elementwise rounding are used, so codes, scales and zero points equal
:func:`eqjax.core.numerics.quantize` on the whole weight bitwise for the ``absmax`` and ``minmax``
calibrators. ``percentile`` and ``mse`` ranges are computed on a replicated copy of the weight (one
full weight per device, transiently). Scales and zero points are derived from the synced ranges in a
jit, as ``quantize`` does: XLA compiles ``x / constant`` as ``x * (1 / constant)``, so eager and
jitted scales can differ by 1 ulp.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from eqjax.core.numerics import QuantSpec, check_finite, compute_range, quantize_with, range_to_qparams
from eqjax.core.qarray import QArray, QArrayError, codes_per_word, is_packed, pack_axis_for, per_group, scale_shape
from eqjax.distributed.mesh import put
from eqjax.distributed.sharded import _place

__all__ = ["quantize_sharded", "qarray_shardings"]

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
    if dim not in gran.axes:
        return "local", gran
    if len(gran.axes) > 1:
        raise QArrayError(f"groups along the flattened axes {gran.axes} cannot be split along axis {dim}; "
                          "shard another axis")
    if local_len % gran.group_size == 0:
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
        lo, hi = _jit_range(put(w, NamedSharding(mesh, P())), spec)
        lo, hi = (put(a, NamedSharding(mesh, s_spec)) for a in (lo, hi))
    # Jitted like eqjax.core.numerics.quantize: XLA turns `/ qmax` into `* (1 / qmax)` when qmax is a
    # compile-time constant, so eager and jitted qparams can differ by 1 ulp.
    scale, zp = _jit_qparams(lo, hi, spec.bits, spec.symmetric, spec.scale_dtype)
    if not bool(jnp.all(jnp.isfinite(scale))):
        raise QArrayError(f"{name}: the range of shape {shape} overflows a {spec.scale_dtype} scale; use float32 scales")
    zp_spec = None if zp is None else s_spec
    f_codes = jax.shard_map(codes, mesh=mesh, in_specs=(w_spec, s_spec, zp_spec), out_specs=w_spec, check_vma=False)
    values = jax.jit(lambda w_, s_, z_: f_codes(_place(w_, mesh, w_spec), s_, z_))(w, scale, zp)
    zp = None if zp is None else zp.astype(jnp.uint8)
    return QArray(values, scale, zp, spec.bits, spec.symmetric, gran, shape, jnp.dtype(w.dtype))
