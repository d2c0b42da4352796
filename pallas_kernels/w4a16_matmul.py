"""W4A16 matmul (Pallas Triton): packed int4 weights with group scales/zero points, float activations.

Storage (eqjax.qarray): ``values`` uint8 ``[K/2, N]`` with byte ``[i, n] = code[2i, n] | code[2i+1, n] << 4``;
``scale`` ``[K/G, N]``; ``zero_point`` uint8 ``[K/G, N]`` or None (implicit 8);
``w_hat = (code - zp) * scale``.

Kernel: the wrapper de-interleaves the *activations* (``x_even = x[:, 0::2]``, ``x_odd = x[:, 1::2]``,
a cheap [M, K] copy) so the weight bytes are used exactly as stored. Each K step loads a
``[BKp, BN]`` byte tile (``2 * BKp`` logical rows), splits it in registers into the low and high
nibbles, subtracts the zero point and converts to the activation dtype (integers in [-15, 15]: exact
in bf16/f16), and does two MMAs with fp32 accumulation::

    part = dot(x_even[:, blk], lo - zp) + dot(x_odd[:, blk], hi - zp)      # [BM, BN] fp32
    acc += part * scale[group, :]

``BKp`` divides ``G / 2``, so a step lies inside one group and the group scale is applied once per
step to the fp32 partial instead of to every weight element (fewer ALU ops per byte; and more
accurate than dequantizing to bf16 first, which the XLA path does). Groups need ``G % 32 == 0``
(``G/2`` a multiple of 16, the smallest Triton MMA K); other layouts go to XLA.

Decode (M <= 16): BM = 16 (Triton's smallest MMA M; padded rows are masked), split-K over the K
loop so that ~2 programs per SM stream the weights; partial fp32 sums are added by XLA.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import tuning
from pallas_kernels._common import cdiv, compiler_params, load_row, load_tile, load_vec, on_cuda_else, store_tile

__all__ = ["w4a16_matmul", "w4a16_dispatch", "supports"]


def _kernel(*refs, has_zp, has_bias, M, N, Kp, G, bm, bn, bkp, split_k, kb_per_split, precision):
    refs = list(refs)
    xe_ref, xo_ref, w_ref, s_ref = refs[:4]
    refs = refs[4:]
    z_ref = refs.pop(0) if has_zp else None
    b_ref = refs.pop(0) if has_bias else None
    (o_ref,) = refs

    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m0 = pl.multiple_of(i * bm, bm)
    n0 = pl.multiple_of(j * bn, bn)
    cdt = xe_ref.dtype
    half_g = G // 2
    nkb = Kp // bkp
    kb_lo = s * kb_per_split
    kb_hi = jnp.minimum(kb_lo + kb_per_split, nkb)

    def body(kb, acc):
        k0 = pl.multiple_of(kb * bkp, bkp)
        g = k0 // half_g
        xe = load_tile(xe_ref, m0, bm, k0, bkp, M, Kp)
        xo = load_tile(xo_ref, m0, bm, k0, bkp, M, Kp)
        p = load_tile(w_ref, k0, bkp, n0, bn, Kp, N).astype(jnp.int32)
        if has_zp:
            zp = load_row(z_ref, g, n0, bn, N, other=0).astype(jnp.int32)[None, :]
        else:
            zp = 8
        lo = ((p & 0xF) - zp).astype(cdt)
        hi = ((p >> 4) - zp).astype(cdt)
        part = jnp.dot(xe, lo, preferred_element_type=jnp.float32, precision=precision)
        part = part + jnp.dot(xo, hi, preferred_element_type=jnp.float32, precision=precision)
        sc = load_row(s_ref, g, n0, bn, N, other=0).astype(jnp.float32)
        return acc + part * sc[None, :]

    acc = jax.lax.fori_loop(kb_lo, kb_hi, body, jnp.zeros((bm, bn), jnp.float32))
    if split_k > 1:
        store_tile(o_ref, m0, bm, n0, bn, M, N, acc, base=s * M)
        return
    if has_bias:
        acc = acc + load_vec(b_ref, n0, bn, N, other=0.0).astype(jnp.float32)[None, :]
    store_tile(o_ref, m0, bm, n0, bn, M, N, acc.astype(o_ref.dtype))


def _precision_for(dtype):
    """f32 activations: full-precision dot when jax's default matmul precision asks for it
    (otherwise Triton uses TF32, as XLA does on GPU by default). bf16/f16: native MMA."""
    if jnp.dtype(dtype) != jnp.float32:
        return None
    p = jax.config.jax_default_matmul_precision
    if p is not None and str(p).lower() in ("highest", "float32", "precision.highest"):
        return jax.lax.Precision.HIGHEST
    return None


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
    """``x [M, K] @ w_hat [K, N]`` with ``w_hat`` packed int4 (see module docs) -> ``[M, N]``.

    Args:
      x: bf16/f16/f32 activations (the MMA runs in this dtype, accumulates in fp32).
      packed: uint8 ``[K/2, N]``.
      scale: ``[K/G, N]`` (any float dtype).
      zero_point: uint8 ``[K/G, N]`` or None (symmetric, zero point 8).
      group_size: G, a multiple of 32 dividing K.
      bias: optional ``[N]``, added in fp32 before the cast.
      out_dtype: default ``x.dtype``.
      blocks: override the tuning table (``bk`` counts packed rows and must divide G/2).
    """
    M, K = x.shape
    Kp, N = packed.shape
    G = group_size
    if K % 2 or Kp * 2 != K or K % G:
        raise ValueError(f"w4a16_matmul: K={K}, packed rows {Kp}, group {G} do not fit")
    if tuple(scale.shape) != (K // G, N):
        raise ValueError(f"w4a16_matmul: scale shape {scale.shape} != {(K // G, N)}")
    blocks = blocks or tuning.w4a16_blocks(M, N, K, G)
    if blocks is None or (G // 2) % blocks.bk:
        raise ValueError(f"w4a16_matmul: no packed K block dividing G/2 = {G // 2}")
    bm, bn, bkp = blocks.bm, blocks.bn, blocks.bk
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        x = x.astype(jnp.float32)
    xe, xo = x[:, 0::2], x[:, 1::2]

    nkb = Kp // bkp
    split_k = max(1, min(blocks.split_k, nkb))
    kb_per_split = cdiv(nkb, split_k)
    split_k = cdiv(nkb, kb_per_split)
    has_zp = zero_point is not None
    has_bias = bias is not None and split_k == 1
    args = [xe, xo, packed, scale] + ([zero_point] if has_zp else [])
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


def supports(q: Any, x2: jax.Array) -> str | None:
    """None when the kernel covers this QArray, else the reason (XLA then runs)."""
    if q.bits != 4:
        return f"{q.bits}-bit weights"
    gran = q.granularity
    if gran.kind != "group" or gran.axes != (0,):
        return f"granularity {gran} (need groups along the input axis)"
    K, N = q.shape
    G = gran.group_size
    if K % G or G % 32:
        return f"group size {G} (need a multiple of 32 dividing K={K})"
    if tuple(q.values.shape) != (K // 2, N):
        return f"values shape {q.values.shape}"
    if not jnp.issubdtype(x2.dtype, jnp.floating):
        return f"activation dtype {x2.dtype}"
    return None


def w4a16_dispatch(x2, q, bias, *, out_dtype, interpret: bool):
    """The W4A16 kernel for a 4-bit group-wise :class:`eqjax.qarray.QArray`, or None."""
    if supports(q, x2) is not None:
        return None
    G = q.granularity.group_size

    def run_kernel(x2, values, scale, zp, bias):
        return w4a16_matmul(
            x2, values, scale, zp, group_size=G, bias=bias, out_dtype=out_dtype, interpret=interpret
        )

    def run_xla(x2, values, scale, zp, bias):
        from eqjax.numerics import dequantize

        qq = jax.tree.unflatten(jax.tree.structure(q), [values, scale] + ([] if zp is None else [zp]))
        y = jnp.matmul(x2, dequantize(qq, x2.dtype))
        if bias is not None:
            y = y + bias.astype(y.dtype)
        return y.astype(out_dtype)

    args = (x2, q.values, q.scale, q.zero_point, bias)
    if interpret:
        return run_kernel(*args)
    return on_cuda_else(run_kernel, run_xla, *args)
