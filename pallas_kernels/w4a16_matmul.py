"""W4A16 matmul: packed int4 weights with group scales / zero points, float activations.

Array API (nothing here knows eqjax's types; :mod:`eqjax.core.linear` adapts its ``QArray``):

* :func:`w4a16_matmul` -- the entry: the Pallas Triton kernel when lowered for CUDA, the XLA
  reference on every other platform (``lax.platform_dependent``, at lowering time);
  ``interpret=True`` always runs the kernel, interpreted.
* :func:`w4a16_matmul_pallas` -- the kernel; :func:`w4a16_matmul_xla` -- the pure-jnp reference
  with the same arithmetic; :func:`supports` -- None when the kernel covers the operands, else why.

Storage (eqjax's layout): ``packed`` uint8 ``[K/2, N]`` with byte ``[i, n] = code[2i, n] |
code[2i+1, n] << 4`` (two codes per byte, even index in the low nibble); ``scale`` ``[K/G, N]``;
``zero_point`` uint8 ``[K/G, N]`` or None (symmetric: implicit 8); ``w_hat = (code - zp) * scale``.

Arithmetic (kernel and reference): the *activations* are de-interleaved (``x_even = x[:, 0::2]``,
``x_odd = x[:, 1::2]``, a cheap [M, K] copy) so the weight bytes are used exactly as stored. The
low and high nibbles minus the zero point are integers in [-15, 15], exact in the activation dtype
(bf16/f16/f32); per K block inside one group::

    part = dot(x_even[:, blk], lo - zp) + dot(x_odd[:, blk], hi - zp)      # [M, N], fp32 accumulation
    acc += part * float32(scale[group, :])
    y    = acc (+ float32(bias)) -> out_dtype

The group scale is applied once per block to the fp32 partial, not to every weight element (fewer
ALU ops per byte, and more accurate than dequantizing the weight to bf16 first, which eqjax's XLA
path does). The reference takes one block per group (the kernel ``BKp`` divides ``G/2``) and adds
the groups in order, so kernel and reference differ only by float32 summation order (inside the
MMA, across blocks of a group, and across split-K partials): ``|diff| <= K * 2**-24 * (|x| @ |w_hat|)``
to first order, far below one bf16 output ulp. Groups need ``G % 32 == 0`` (``G/2`` a multiple of
16, the smallest Triton MMA K).

Decode (M <= 16): BM = 16 (Triton's smallest MMA M; padded rows are masked), split-K over the K
loop so that ~2 programs per SM stream the weights; partial fp32 sums are added by XLA.

GEMV blocks (``Blocks(gemv=True)``, ``bm = 1``): one activation row per program and no MMA; each
K block is ``sum_k x_even[k] * (lo[k, :] - zp) + x_odd[k] * (hi[k, :] - zp)`` in float32 (the
products are exact: a bf16/f16 value times an integer in [-15, 15]), then times the group scale, as
above. It avoids padding one row to Triton's 16-row MMA and the weight tile's trip through shared
memory that an MMA operand takes; whether it is faster is a measurement (bench/kernel_tune.py).

``Blocks(gemv=True, reduce_once=True)`` keeps a ``[bk, bn]`` float32 partial per program, each
element ``sum over groups of scale * (x_even * lo + x_odd * hi)`` for its K row, and sums it over K
once after the loop: no cross-warp reduction per step, one more multiply per weight byte (another
summation order, same bound). A candidate for bench/kernel_tune.py, not yet measured on a GPU.

GEMV blocks read the activation row as given and gather its even / odd elements in the kernel (one
XLA op fewer per call at decode); MMA blocks take the de-interleaved copies.

Codes become floats without an integer -> float conversion (``_common.small_int_diff``: the code is
OR-ed into the mantissa of a power of two and the biased zero point subtracted, both exact): Hopper
converts int32 -> float at an eighth of its float32 add rate, and a weight byte holds two codes.
Whether either change pays is a measurement (docs/results, the GPU kernel tables).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import tuning
from pallas_kernels._common import (
    cdiv,
    compiler_params,
    load_row,
    load_tile,
    load_vec,
    on_cuda_else,
    small_int_diff,
    store_tile,
)

__all__ = ["supports", "w4a16_matmul", "w4a16_matmul_pallas", "w4a16_matmul_xla"]

_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
IMPLICIT_ZERO_POINT = 8


# --------------------------------------------------------------------------------------------------
# What the kernel covers.


def supports(
    x_shape: Sequence[int],
    x_dtype: Any,
    packed_shape: Sequence[int],
    packed_dtype: Any,
    scale_shape: Sequence[int],
    zero_point_shape: Sequence[int] | None,
    *,
    group_size: int,
    zero_point_dtype: Any = jnp.uint8,
) -> str | None:
    """None when :func:`w4a16_matmul` covers these operands, else the reason (one line).
    ``zero_point_shape`` is None for symmetric weights (implicit zero point 8)."""
    if len(x_shape) != 2:
        return f"activations are not 2-D (shape {tuple(x_shape)})"
    if not jnp.issubdtype(x_dtype, jnp.floating):
        return f"activation dtype {jnp.dtype(x_dtype).name}"
    M, K = x_shape
    G = group_size
    if G < 1 or K % G or G % 32:
        return f"group size {G} (need a multiple of 32 dividing K={K})"
    if len(packed_shape) != 2 or packed_shape[0] * 2 != K:
        return f"packed codes of shape {tuple(packed_shape)} (need [K/2, N] = [{K // 2}, N])"
    if jnp.dtype(packed_dtype) != jnp.uint8:
        return f"packed codes are {jnp.dtype(packed_dtype).name} (need uint8)"
    N = packed_shape[1]
    if tuple(scale_shape) != (K // G, N):
        return f"scales of shape {tuple(scale_shape)} (need [K/G, N] = {(K // G, N)})"
    if zero_point_shape is not None:
        if tuple(zero_point_shape) != (K // G, N):
            return f"zero points of shape {tuple(zero_point_shape)} (need {(K // G, N)})"
        if jnp.dtype(zero_point_dtype) != jnp.uint8:
            return f"zero points are {jnp.dtype(zero_point_dtype).name} (need uint8)"
    return None


def _check(x, packed, scale, zero_point, group_size, who: str) -> None:
    reason = supports(
        x.shape, x.dtype, packed.shape, packed.dtype, scale.shape,
        None if zero_point is None else zero_point.shape, group_size=group_size,
        zero_point_dtype=jnp.uint8 if zero_point is None else zero_point.dtype,
    )
    if reason is not None:
        raise ValueError(f"{who}: {reason}")


def _compute_dtype(x: jax.Array) -> jnp.dtype:
    """The MMA operand dtype: the activations' (bf16/f16/f32), float32 for any other float."""
    return jnp.dtype(x.dtype) if jnp.dtype(x.dtype) in _FLOATS else jnp.dtype(jnp.float32)


def _precision_for(dtype):
    """f32 activations: full-precision dot when jax's default matmul precision asks for it
    (otherwise Triton uses TF32, as XLA does on GPU by default). bf16/f16: native MMA."""
    if jnp.dtype(dtype) != jnp.float32:
        return None
    p = jax.config.jax_default_matmul_precision
    if p is not None and str(p).lower() in ("highest", "float32", "precision.highest"):
        return jax.lax.Precision.HIGHEST
    return None


# --------------------------------------------------------------------------------------------------
# XLA reference.


def w4a16_matmul_xla(
    x: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    zero_point: jax.Array | None,
    *,
    group_size: int,
    bias: jax.Array | None = None,
    out_dtype: Any = None,
) -> jax.Array:
    """The pure-jnp reference of :func:`w4a16_matmul_pallas` (arguments as there): one block per
    group, groups accumulated in order by a ``lax.scan`` (an ``[M, N]`` float32 carry; the weight is
    unpacked to two ``[K/2, N]`` integer-valued arrays in the activation dtype)."""
    _check(x, packed, scale, zero_point, group_size, "w4a16_matmul_xla")
    M, K = x.shape
    N = packed.shape[1]
    G = group_size
    ng, hg = K // G, G // 2
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    cdt = _compute_dtype(x)
    x = x.astype(cdt)
    xe = x[:, 0::2].reshape(M, ng, hg).transpose(1, 0, 2)  # [ng, M, G/2]
    xo = x[:, 1::2].reshape(M, ng, hg).transpose(1, 0, 2)
    p = packed.astype(jnp.int32).reshape(ng, hg, N)
    zp = IMPLICIT_ZERO_POINT if zero_point is None else zero_point.astype(jnp.int32)[:, None, :]
    lo = ((p & 0xF) - zp).astype(cdt)
    hi = ((p >> 4) - zp).astype(cdt)
    precision = _precision_for(cdt)

    def group(acc, blk):
        xe_g, xo_g, lo_g, hi_g, s_g = blk
        part = jnp.dot(xe_g, lo_g, preferred_element_type=jnp.float32, precision=precision)
        part = part + jnp.dot(xo_g, hi_g, preferred_element_type=jnp.float32, precision=precision)
        return acc + part * s_g[None, :], None

    acc, _ = jax.lax.scan(group, jnp.zeros((M, N), jnp.float32), (xe, xo, lo, hi, scale.astype(jnp.float32)))
    if bias is not None:
        acc = acc + bias.astype(jnp.float32).reshape(N)[None, :]
    return acc.astype(out_dtype)


# --------------------------------------------------------------------------------------------------
# Pallas kernel.


def _kernel(*refs, has_zp, has_bias, M, N, Kp, G, bm, bn, bkp, split_k, kb_per_split, precision, gemv,
            reduce_once):
    refs = list(refs)
    if gemv:  # the activations as given: even / odd K are gathered in the kernel (index loads)
        x_ref, w_ref, s_ref = refs[:3]
        refs = refs[3:]
    else:
        xe_ref, xo_ref, w_ref, s_ref = refs[:4]
        refs = refs[4:]
    z_ref = refs.pop(0) if has_zp else None
    b_ref = refs.pop(0) if has_bias else None
    (o_ref,) = refs

    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m0 = pl.multiple_of(i * bm, bm)
    n0 = pl.multiple_of(j * bn, bn)
    half_g = G // 2
    nkb = Kp // bkp
    kb_lo = s * kb_per_split
    kb_hi = jnp.minimum(kb_lo + kb_per_split, nkb)

    def body(kb, acc):
        k0 = pl.multiple_of(kb * bkp, bkp)
        g = k0 // half_g
        p = load_tile(w_ref, k0, bkp, n0, bn, Kp, N).astype(jnp.int32)
        if has_zp:
            zp = load_row(z_ref, g, n0, bn, N, other=0).astype(jnp.int32)[None, :]
        else:
            zp = IMPLICIT_ZERO_POINT
        if gemv:  # one row (m0 = i < M): float32 products, reduced over the block's K
            even = 2 * k0 + 2 * jnp.arange(bkp)  # index arrays: interpret mode has no strided slices
            xe = plgpu.load(x_ref.at[m0, even]).astype(jnp.float32)
            xo = plgpu.load(x_ref.at[m0, even + 1]).astype(jnp.float32)
            lo = small_int_diff(p & 0xF, zp, jnp.float32)
            hi = small_int_diff(p >> 4, zp, jnp.float32)
            part = xe[:, None] * lo + xo[:, None] * hi  # [bkp, bn]
            if not reduce_once:
                part = jnp.sum(part, axis=0)[None, :]
        else:
            xe = load_tile(xe_ref, m0, bm, k0, bkp, M, Kp)
            xo = load_tile(xo_ref, m0, bm, k0, bkp, M, Kp)
            lo = small_int_diff(p & 0xF, zp, xe_ref.dtype)
            hi = small_int_diff(p >> 4, zp, xe_ref.dtype)
            part = jnp.dot(xe, lo, preferred_element_type=jnp.float32, precision=precision)
            part = part + jnp.dot(xo, hi, preferred_element_type=jnp.float32, precision=precision)
        sc = load_row(s_ref, g, n0, bn, N, other=0).astype(jnp.float32)
        return acc + part * sc[None, :]

    acc = jax.lax.fori_loop(kb_lo, kb_hi, body, jnp.zeros((bkp if reduce_once else bm, bn), jnp.float32))
    if reduce_once:  # the [bkp, bn] per-row partials, summed over K once
        acc = jnp.sum(acc, axis=0)[None, :]
    if split_k > 1:
        store_tile(o_ref, m0, bm, n0, bn, M, N, acc, base=s * M)
        return
    if has_bias:
        acc = acc + load_vec(b_ref, n0, bn, N, other=0.0).astype(jnp.float32)[None, :]
    store_tile(o_ref, m0, bm, n0, bn, M, N, acc.astype(o_ref.dtype))


def w4a16_matmul_pallas(
    x: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    zero_point: jax.Array | None,
    *,
    group_size: int,
    bias: jax.Array | None = None,
    out_dtype: Any = None,
    blocks: tuning.Blocks | None = None,
    interpret: bool = False,
) -> jax.Array:
    """The Pallas kernel: ``x [M, K] @ w_hat [K, N]`` with ``w_hat`` packed int4 (module docs) -> ``[M, N]``.

    Args:
      x: bf16/f16/f32 activations (the MMA runs in this dtype, accumulates in fp32).
      packed: uint8 ``[K/2, N]``.
      scale: ``[K/G, N]`` (any float dtype).
      zero_point: uint8 ``[K/G, N]`` or None (symmetric, zero point 8).
      group_size: G, a multiple of 32 dividing K.
      bias: optional ``[N]``, added in fp32 before the cast.
      out_dtype: default ``x.dtype``.
      blocks: override the tuning table (``bk`` counts packed rows and must divide G/2;
        ``gemv=True`` for the MMA-free one-row blocks).
    """
    _check(x, packed, scale, zero_point, group_size, "w4a16_matmul_pallas")
    M, K = x.shape
    Kp, N = packed.shape
    G = group_size
    blocks = blocks or tuning.w4a16_blocks(M, N, K, G)
    if blocks is None or (G // 2) % blocks.bk:
        raise ValueError(f"w4a16_matmul_pallas: no packed K block dividing G/2 = {G // 2}")
    bm, bn, bkp = blocks.bm, blocks.bn, blocks.bk
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    x = x.astype(_compute_dtype(x))

    nkb = Kp // bkp
    split_k = max(1, min(blocks.split_k, nkb))
    kb_per_split = cdiv(nkb, split_k)
    split_k = cdiv(nkb, kb_per_split)
    has_zp = zero_point is not None
    has_bias = bias is not None and split_k == 1
    xs = [x] if blocks.gemv else [x[:, 0::2], x[:, 1::2]]
    args = [*xs, packed, scale] + ([zero_point] if has_zp else [])
    if has_bias:
        args.append(bias.reshape(N))
    out_shape = (
        jax.ShapeDtypeStruct((split_k * M, N), jnp.float32)
        if split_k > 1
        else jax.ShapeDtypeStruct((M, N), out_dtype)
    )
    kern = functools.partial(
        _kernel,
        has_zp=has_zp,
        has_bias=has_bias,
        M=M,
        N=N,
        Kp=Kp,
        G=G,
        bm=bm,
        bn=bn,
        bkp=bkp,
        split_k=split_k,
        kb_per_split=kb_per_split,
        precision=_precision_for(x.dtype),
        gemv=blocks.gemv,
        reduce_once=blocks.reduce_once,
    )
    out = pl.pallas_call(
        kern,
        out_shape=out_shape,
        grid=(cdiv(M, bm), cdiv(N, bn), split_k),
        compiler_params=compiler_params(blocks.num_warps, blocks.num_stages),
        interpret=interpret,
        name="eqjax_w4a16",
    )(*args)
    if split_k == 1:
        return out
    y = out.reshape(split_k, M, N).sum(axis=0)
    if bias is not None:
        y = y + bias.astype(jnp.float32)[None, :]
    return y.astype(out_dtype)


# --------------------------------------------------------------------------------------------------
# Entry.


def w4a16_matmul(
    x: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    zero_point: jax.Array | None,
    *,
    group_size: int,
    bias: jax.Array | None = None,
    out_dtype: Any = None,
    blocks: tuning.Blocks | None = None,
    interpret: bool = False,
) -> jax.Array:
    """W4A16 ``x @ w_hat`` (arguments as :func:`w4a16_matmul_pallas`): the kernel when lowered for
    CUDA, :func:`w4a16_matmul_xla` elsewhere; ``interpret=True`` runs the kernel interpreted anywhere.
    Raises ValueError with :func:`supports`' reason for operands it does not cover."""
    _check(x, packed, scale, zero_point, group_size, "w4a16_matmul")

    def kernel(x, packed, scale, zero_point, bias):
        return w4a16_matmul_pallas(x, packed, scale, zero_point, group_size=group_size, bias=bias,
                                   out_dtype=out_dtype, blocks=blocks, interpret=interpret)

    def reference(x, packed, scale, zero_point, bias):
        return w4a16_matmul_xla(x, packed, scale, zero_point, group_size=group_size, bias=bias, out_dtype=out_dtype)

    args = (x, packed, scale, zero_point, bias)
    if interpret:
        return kernel(*args)
    return on_cuda_else(kernel, reference, *args)
