"""Fused W8A8 matmul (Pallas Triton): int8 activations x int8 weights -> int32, scaled epilogue.

``y[m, n] = (acc[m, n] * w_scale[n]) * x_scale[m] (+ bias[n])`` with
``acc = q(x) @ w`` accumulated exactly in int32 (int8 x int8 tensor-core MMA), and
``q(x) = clip(round_half_even(x / x_scale), -qmax, qmax)`` -- the arithmetic of
:func:`eqjax.linear.quantize_activations` and :func:`eqjax.linear._w8a8_xla`, in the same order,
so the int32 accumulator equals the XLA one exactly and the float output matches it to the bit on
CPU/interpret (on GPU up to FMA contraction in the epilogue, i.e. <= 1 ulp of float32 before the
final cast).

Where the per-token absmax is computed (the row absmax needs all of K before the first code):

* ``mode="fused"`` (decode, M < ``tuning.W8A8_FUSED_MAX_M``): a *first pass of the same kernel*.
  Each program reads its ``BM`` rows of ``x`` over all of K for the absmax, then runs the main K
  loop quantizing each ``[BM, BK]`` tile in registers just before the MMA. At decode ``x`` is a few
  KiB and L2-resident, the weight stream dominates the bytes, and one launch instead of two is what
  matters (a launch costs about as much as streaming a 4096x4096 int8 weight at 3 TB/s).
  The quantization is repeated by each of the ``N / BN`` column programs -- negligible for small M.
* ``mode="prepass"`` (prefill): a *separate quantization kernel* (two passes over each row block,
  the second from L2) writes int8 ``x`` and the scales once; the GEMM then streams int8 ``A`` tiles
  (half the bytes of bf16) and its main loop is pure MMA. Fusing here would redo the quantization
  ``N / BN`` times (32x for N = 4096) on the matmul's critical path.

Static activation scales (SmoothQuant, ``ActQuantKernel.act_scale``) and dynamic per-tensor scales
skip the absmax pass: the scale is given (per-tensor dynamic: one XLA reduction first).
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from eqjax.numerics import round_half_even
from pallas_kernels import tuning
from pallas_kernels._common import (
    cdiv,
    compiler_params,
    div_rn,
    load_tile,
    load_vec,
    on_cuda_else,
    store_tile,
    store_vec,
)

__all__ = ["quantize_rows", "w8a8_matmul", "w8a8_dispatch", "supports"]

Mode = Literal["auto", "fused", "prepass"]


def _quantize_tile(xf, s, qmax: int, interpret: bool):
    """int8 codes of a float32 tile with row scales ``s [BM]`` (exactly the XLA reference)."""
    q = round_half_even(div_rn(xf, s[:, None], interpret=interpret))
    return jnp.clip(q, -qmax, qmax).astype(jnp.int8)


def _row_absmax_scale(x_ref, m0, bm, K, bk, M, qmax: int, interpret: bool):
    """``where(amax > 0, amax / qmax, 1)`` over all of K for rows ``m0 .. m0 + bm``."""

    def body(kb, amax):
        t = load_tile(x_ref, m0, bm, kb * bk, bk, M, K).astype(jnp.float32)
        return jnp.maximum(amax, jnp.max(jnp.abs(t), axis=1))

    amax = jax.lax.fori_loop(0, cdiv(K, bk), body, jnp.zeros((bm,), jnp.float32))
    return jnp.where(amax > 0, div_rn(amax, jnp.float32(qmax), interpret=interpret), 1.0)


# --------------------------------------------------------------------------------------------------
# Pre-pass: per-row quantization kernel.


def _quant_kernel(*refs, M, K, bm, bk, qmax, given, interpret):
    if given:
        x_ref, s_in_ref, q_ref, s_ref = refs
    else:
        x_ref, q_ref, s_ref = refs
    m0 = pl.multiple_of(pl.program_id(0) * bm, bm)
    if given:
        s = load_vec(s_in_ref, m0, bm, M, other=1.0)
    else:
        s = _row_absmax_scale(x_ref, m0, bm, K, bk, M, qmax, interpret)

    @pl.loop(0, cdiv(K, bk))
    def _(kb):
        k0 = kb * bk
        t = load_tile(x_ref, m0, bm, k0, bk, M, K).astype(jnp.float32)
        store_tile(q_ref, m0, bm, k0, bk, M, K, _quantize_tile(t, s, qmax, interpret))

    store_vec(s_ref, m0, bm, M, s)


def quantize_rows(
    x: jax.Array,
    *,
    qmax: int = 127,
    scale: jax.Array | None = None,
    block_m: int = 16,
    block_k: int = 256,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Per-row symmetric int8 quantization of ``x [M, K]`` -> (int8 ``[M, K]``, float32 ``[M]``).

    ``scale`` (float32 ``[M]``) skips the absmax and quantizes with the given scales.
    """
    M, K = x.shape
    bk = min(block_k, max(32, 1 << (K - 1).bit_length()))
    kern = functools.partial(
        _quant_kernel, M=M, K=K, bm=block_m, bk=bk, qmax=qmax, given=scale is not None, interpret=interpret
    )
    args = (x,) if scale is None else (x, scale.astype(jnp.float32))
    return pl.pallas_call(
        kern,
        out_shape=(jax.ShapeDtypeStruct((M, K), jnp.int8), jax.ShapeDtypeStruct((M,), jnp.float32)),
        grid=(cdiv(M, block_m),),
        compiler_params=compiler_params(4, 2),
        interpret=interpret,
        name="eqjax_quantize_rows",
    )(*args)


# --------------------------------------------------------------------------------------------------
# GEMM.


def _gemm_kernel(*refs, a_mode, has_bias, M, N, K, bm, bn, bk, split_k, kb_per_split, qmax, interpret):
    refs = list(refs)
    x_ref, w_ref = refs.pop(0), refs.pop(0)
    sx_ref = refs.pop(0) if a_mode != "dynamic" else None
    ws_ref = refs.pop(0)
    b_ref = refs.pop(0) if has_bias else None
    o_ref = refs.pop(0)
    sx_out_ref = refs.pop(0) if refs else None

    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m0 = pl.multiple_of(i * bm, bm)
    n0 = pl.multiple_of(j * bn, bn)

    if a_mode == "dynamic":
        sx = _row_absmax_scale(x_ref, m0, bm, K, bk, M, qmax, interpret)
    else:
        sx = load_vec(sx_ref, m0, bm, M, other=1.0)

    nkb = cdiv(K, bk)
    kb_lo = s * kb_per_split
    kb_hi = jnp.minimum(kb_lo + kb_per_split, nkb)

    def body(kb, acc):
        k0 = pl.multiple_of(kb * bk, bk)
        a = load_tile(x_ref, m0, bm, k0, bk, M, K)
        if a_mode != "int8":
            a = _quantize_tile(a.astype(jnp.float32), sx, qmax, interpret)
        w = load_tile(w_ref, k0, bk, n0, bn, K, N)
        return acc + jnp.dot(a, w, preferred_element_type=jnp.int32)

    acc = jax.lax.fori_loop(kb_lo, kb_hi, body, jnp.zeros((bm, bn), jnp.int32))

    if split_k > 1:  # partial int32 sums; the XLA epilogue adds them and scales
        store_tile(o_ref, m0, bm, n0, bn, M, N, acc, base=s * M)
        if sx_out_ref is not None:

            @pl.when((j == 0) & (s == 0))
            def _():
                store_vec(sx_out_ref, m0, bm, M, sx)

        return
    if o_ref.dtype == jnp.int32:  # raw accumulator (tests)
        store_tile(o_ref, m0, bm, n0, bn, M, N, acc)
        return
    ws = load_vec(ws_ref, n0, bn, N, other=0.0)
    y = acc.astype(jnp.float32) * ws[None, :]
    y = y * sx[:, None]
    if has_bias:
        y = y + load_vec(b_ref, n0, bn, N, other=0.0)[None, :]
    store_tile(o_ref, m0, bm, n0, bn, M, N, y.astype(o_ref.dtype))


def _epilogue_xla(acc, ws, sx, bias, out_dtype):
    """Same float ops, same order, as the kernel epilogue (used after split-K)."""
    if jnp.dtype(out_dtype) == jnp.int32:
        return acc
    y = acc.astype(jnp.float32) * ws[None, :]
    y = y * sx[:, None]
    if bias is not None:
        y = y + bias[None, :]
    return y.astype(out_dtype)


def w8a8_matmul(
    x: jax.Array,
    w: jax.Array,
    w_scale: jax.Array,
    *,
    act_scale: jax.Array | None = None,
    bias: jax.Array | None = None,
    out_dtype: Any = jnp.bfloat16,
    qmax: int = 127,
    mode: Mode = "auto",
    blocks: tuning.Blocks | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``x [M, K]`` (float, or int8 already quantized) ``@ w [K, N]`` (int8, symmetric) -> ``[M, N]``.

    Args:
      x: float activations; or int8 codes, then ``act_scale`` is required.
      w: int8 weight codes ``[K, N]``.
      w_scale: per-output-channel scale ``[N]`` (broadcast a per-tensor scale before calling).
      act_scale: None for dynamic per-token scales; else float32 ``[M]`` (or scalar) given scales.
      bias: optional ``[N]``.
      out_dtype: output dtype; ``jnp.int32`` returns the raw accumulator (exactness tests).
      qmax: ``2**(act_bits-1) - 1``.
      mode: ``"fused"`` (absmax/quantization in the GEMM), ``"prepass"`` (quantization kernel
        first) or ``"auto"`` (by M, see ``tuning.W8A8_FUSED_MAX_M``).
      blocks: override the tuning table.
      interpret: run under the Pallas interpreter (CPU).
    """
    M, K = x.shape
    K2, N = w.shape
    if K2 != K:
        raise ValueError(f"w8a8_matmul: x has K={K}, w has {K2}")
    if w.dtype != jnp.int8:
        raise ValueError(f"w8a8_matmul: weights must be int8, got {w.dtype}")
    blocks = blocks or tuning.w8a8_blocks(M, N, K)
    bm, bn, bk, split_k = blocks.bm, blocks.bn, blocks.bk, blocks.split_k
    if bk < 32:
        raise ValueError(f"w8a8_matmul: bk={bk}; int8 MMA needs a K block >= 32")
    w_scale = jnp.broadcast_to(jnp.asarray(w_scale, jnp.float32).reshape(-1), (N,))
    if act_scale is not None:
        act_scale = jnp.broadcast_to(jnp.asarray(act_scale, jnp.float32).reshape(-1), (M,))
    if bias is not None:
        bias = bias.astype(jnp.float32).reshape(N)

    if x.dtype == jnp.int8:
        if act_scale is None:
            raise ValueError("w8a8_matmul: int8 activations need act_scale")
        a_mode, a, sx = "int8", x, act_scale
    else:
        if mode == "auto":
            mode = "fused" if M < tuning.W8A8_FUSED_MAX_M else "prepass"
        if mode == "prepass":
            a, sx = quantize_rows(x, qmax=qmax, scale=act_scale, interpret=interpret)
            a_mode = "int8"
        elif mode == "fused":
            a, sx = x, act_scale
            a_mode = "dynamic" if act_scale is None else "given"
        else:
            raise ValueError(f"unknown mode {mode!r}")

    nkb = cdiv(K, bk)
    split_k = max(1, min(split_k, nkb))
    kb_per_split = cdiv(nkb, split_k)
    split_k = cdiv(nkb, kb_per_split)  # no empty splits
    has_bias = bias is not None and split_k == 1
    out_dtype = jnp.dtype(out_dtype)

    args = [a, w] + ([sx] if a_mode != "dynamic" else []) + [w_scale] + ([bias] if has_bias else [])
    if split_k > 1:
        out_shape = [jax.ShapeDtypeStruct((split_k * M, N), jnp.int32)]
        if a_mode == "dynamic":
            out_shape.append(jax.ShapeDtypeStruct((M,), jnp.float32))
    else:
        out_shape = [jax.ShapeDtypeStruct((M, N), out_dtype)]

    kern = functools.partial(
        _gemm_kernel,
        a_mode=a_mode,
        has_bias=has_bias,
        M=M,
        N=N,
        K=K,
        bm=bm,
        bn=bn,
        bk=bk,
        split_k=split_k,
        kb_per_split=kb_per_split,
        qmax=qmax,
        interpret=interpret,
    )
    outs = pl.pallas_call(
        kern,
        out_shape=tuple(out_shape),
        grid=(cdiv(M, bm), cdiv(N, bn), split_k),
        compiler_params=compiler_params(blocks.num_warps, blocks.num_stages),
        interpret=interpret,
        name=f"eqjax_w8a8_{a_mode}",
    )(*args)
    if split_k == 1:
        return outs[0]
    acc = outs[0].reshape(split_k, M, N).sum(axis=0, dtype=jnp.int32)
    if a_mode == "dynamic":
        sx = outs[1]
    return _epilogue_xla(acc, w_scale, sx, bias, out_dtype)


# --------------------------------------------------------------------------------------------------
# Dispatch from an ActQuantKernel.


def supports(kernel: Any, x2: jax.Array) -> str | None:
    """None when the kernel covers this layer, else the reason it does not (XLA then runs)."""
    w = kernel.weight
    gran = w.granularity
    if not w.symmetric:
        return "asymmetric weights"
    if w.packed or w.values.dtype != jnp.int8:
        return f"{w.bits}-bit packed weights (only unpacked 5..8-bit int8 codes)"
    if gran.kind == "group":
        return "group-wise weight scales"
    if gran.kind == "channel" and gran.axes != (1,):
        return f"weight scales {gran} (need per-output-channel)"
    if kernel.act_bits > 8:
        return "activation bits > 8"
    if not jnp.issubdtype(x2.dtype, jnp.floating):
        return f"activation dtype {x2.dtype}"
    if len(w.shape) != 2:
        return "weight is not 2-D"
    return None


def w8a8_dispatch(x2, kernel, bias, *, out_dtype, interpret: bool, mode: Mode = "auto"):
    """The W8A8 kernel for an :class:`eqjax.linear.ActQuantKernel`, or None."""
    if supports(kernel, x2) is not None:
        return None
    w = kernel.weight
    qmax = 2 ** (kernel.act_bits - 1) - 1

    def run_kernel(x2, values, scale, act_scale, bias):
        sx = None
        if act_scale is not None:
            sx = jnp.asarray(act_scale, jnp.float32).reshape(-1)[:1]
        elif kernel.act_granularity == "tensor":  # dynamic per-tensor: one XLA reduction
            amax = jnp.max(jnp.abs(x2.astype(jnp.float32)))
            sx = jnp.where(amax > 0, amax / qmax, 1.0).reshape(1)
        return w8a8_matmul(
            x2,
            values,
            scale,
            act_scale=sx,
            bias=bias,
            out_dtype=out_dtype,
            qmax=qmax,
            mode=mode,
            interpret=interpret,
        )

    def run_xla(x2, values, scale, act_scale, bias):
        from eqjax.linear import _w8a8_xla  # lazy: eqjax.linear imports this package lazily too

        k = type(kernel)(
            weight=jax.tree.unflatten(jax.tree.structure(w), [values, scale]),
            act_scale=act_scale,
            act_bits=kernel.act_bits,
            act_granularity=kernel.act_granularity,
        )
        y = _w8a8_xla(x2, k)
        if bias is not None:
            y = y + bias.astype(y.dtype)
        return y.astype(out_dtype)

    args = (x2, w.values, w.scale, kernel.act_scale, bias)
    if interpret:
        return run_kernel(*args)
    return on_cuda_else(run_kernel, run_xla, *args)
