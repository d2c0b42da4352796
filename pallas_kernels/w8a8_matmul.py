"""W8A8 matmul: int8 activations x int8 weights -> exact int32 sums, scaled float epilogue.

Array API (nothing here knows eqjax's types; :mod:`eqjax.core.linear` adapts its ``ActQuantKernel``):

* :func:`w8a8_matmul` -- the entry: the Pallas Triton kernel when lowered for CUDA, the XLA
  reference on every other platform (chosen at lowering time by ``lax.platform_dependent``);
  ``interpret=True`` always runs the kernel, interpreted.
* :func:`w8a8_matmul_pallas` -- the kernel; :func:`quantize_rows` -- its activation quantization
  kernel (prefill pre-pass).
* :func:`w8a8_matmul_xla` / :func:`quantize_rows_xla` -- the pure-jnp reference, same arithmetic.
* :func:`supports` -- None when the kernel covers the shapes/dtypes/params, else the reason.

Operands: ``x [M, K]`` float (or int8 codes already quantized, with their scales), ``w [K, N]`` int8
symmetric weight codes, ``w_scale [N]`` per-output-channel float scales (``[1]``/scalar: per
tensor), activation scales dynamic per token (``act_scale=None``), dynamic per tensor
(``act_granularity="tensor"``) or given (``act_scale`` scalar or ``[M]``), optional ``bias [N]``,
``qmax = 2**(act_bits-1) - 1``.

Arithmetic (kernel and reference, in this order)::

    s[m]    = where(amax[m] > 0, amax[m] * fl(1 / qmax), 1)   (dynamic; amax over the row / tensor)
    q[m, k] = clip(round_half_even(x[m, k] * fl(1 / s[m])), -qmax, qmax)    as int8
    acc     = q @ w                                           exact int32
    y       = (float32(acc) * w_scale[n]) * s[m] (+ float32(bias[n]))  -> out_dtype

all in float32, ``fl(1 / v)`` an IEEE-rounded reciprocal. Multiplying by reciprocals (rather than
dividing, which differs at some ties) is what XLA:CPU computes for ``x / s`` anyway, but not what
XLA:GPU computed (an H200 run, jax 0.11.2), so nothing is left to a compiler: the reference
takes the reciprocal with :func:`pallas_kernels._common.exact_reciprocal` (XLA:GPU's float32 division
was one ulp off) and materializes it behind an optimization barrier, and :func:`eqjax.core.linear.quantize_activations`
is this reference. The kernel takes the reciprocals with ``div.rn.f32`` (Triton's default f32
division is approximate), multiplies by them with ``mul.rn.f32`` (never contracted into an FMA,
which would skip the product's rounding) and rounds with floor/compare/select (Triton cannot lower
``jnp.round``), so its int32 sums equal the reference's exactly on any platform; its float epilogue
may differ on GPU only by FMA contraction of the bias add (float32: within
``2**-22 * (|y| + |bias|)`` before the final cast).

Where the kernel computes the per-token absmax (the row absmax needs all of K before the first
code):

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

Given activation scales and dynamic per-tensor scales skip the absmax pass (per-tensor dynamic: one
XLA reduction first, :func:`tensor_scale`).
"""

from __future__ import annotations

import functools
from typing import Any, Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import tuning
from pallas_kernels._common import (
    cdiv,
    compiler_params,
    div_rn,
    exact_reciprocal,
    load_tile,
    load_vec,
    mul_rn,
    on_cuda_else,
    round_half_even,
    store_tile,
    store_vec,
)

__all__ = [
    "supports",
    "w8a8_matmul",
    "w8a8_matmul_pallas",
    "w8a8_matmul_xla",
    "quantize_rows",
    "quantize_rows_xla",
    "tensor_scale",
    "inv_qmax",
]

Mode = Literal["auto", "fused", "prepass"]
ActGranularity = Literal["token", "tensor"]


# --------------------------------------------------------------------------------------------------
# What the kernel covers, and the operands both implementations take.


def supports(
    x_shape: Sequence[int],
    x_dtype: Any,
    w_shape: Sequence[int],
    w_dtype: Any,
    w_scale_shape: Sequence[int] = (),
    *,
    act_scale_shape: Sequence[int] | None = None,
    act_granularity: str = "token",
    qmax: int = 127,
) -> str | None:
    """None when :func:`w8a8_matmul` covers these operands, else the reason (one line).

    ``act_scale_shape`` is None for dynamic activation scales, else the given scales' shape.
    """
    if len(x_shape) != 2:
        return f"activations are not 2-D (shape {tuple(x_shape)})"
    if len(w_shape) != 2:
        return f"weight is not 2-D (shape {tuple(w_shape)})"
    (m, k), (k2, n) = x_shape, w_shape
    if k2 != k:
        return f"activations have K={k}, the weight {k2}"
    if jnp.dtype(w_dtype) != jnp.int8:
        return f"weight codes are {jnp.dtype(w_dtype).name} (need int8)"
    if jnp.dtype(x_dtype) == jnp.int8:
        if act_scale_shape is None:
            return "int8 activations need their scales"
    elif not jnp.issubdtype(x_dtype, jnp.floating):
        return f"activation dtype {jnp.dtype(x_dtype).name}"
    if not 1 <= qmax <= 127:
        return f"qmax={qmax} (int8 activations: 1..127)"
    if int(np.prod(w_scale_shape)) not in (1, n):
        return f"weight scales of shape {tuple(w_scale_shape)} (need [N] or one per tensor)"
    if act_scale_shape is not None and int(np.prod(act_scale_shape)) not in (1, m):
        return f"activation scales of shape {tuple(act_scale_shape)} (need [M] or one per tensor)"
    if act_granularity not in ("token", "tensor"):
        return f"activation granularity {act_granularity!r}"
    return None


def _check(x, w, w_scale, act_scale, act_granularity, qmax, who: str) -> None:
    reason = supports(
        x.shape, x.dtype, w.shape, w.dtype, jnp.shape(w_scale),
        act_scale_shape=None if act_scale is None else jnp.shape(act_scale),
        act_granularity=act_granularity, qmax=qmax,
    )
    if reason is not None:
        raise ValueError(f"{who}: {reason}")


def _out_dtype(x: jax.Array, out_dtype: Any) -> jnp.dtype:
    if out_dtype is not None:
        return jnp.dtype(out_dtype)
    return jnp.dtype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.dtype(jnp.float32)


def _vec(v: jax.Array | None, n: int) -> jax.Array | None:
    """float32 ``[n]`` from a scalar, ``[1]`` or ``[n]`` array (None stays None)."""
    if v is None:
        return None
    return jnp.broadcast_to(jnp.asarray(v, jnp.float32).reshape(-1), (n,))


def _epilogue(acc, ws, sx, bias, out_dtype):
    """``(float32(acc) * ws[n]) * sx[m] (+ bias[n])`` in ``out_dtype`` (int32: ``acc`` itself).
    The kernel's epilogue does the same ops in the same order."""
    if jnp.dtype(out_dtype) == jnp.int32:
        return acc
    y = acc.astype(jnp.float32) * ws[None, :]
    y = y * sx[:, None]
    if bias is not None:
        y = y + bias[None, :]
    return y.astype(out_dtype)


# --------------------------------------------------------------------------------------------------
# XLA reference.


def inv_qmax(qmax: int) -> np.float32:
    """``fl(1 / qmax)`` in float32 (IEEE-rounded; the constant XLA folds ``amax / qmax`` into)."""
    return np.float32(1.0) / np.float32(qmax)


def _scale_from_absmax(amax: jax.Array, qmax: int) -> jax.Array:
    return jnp.where(amax > 0, amax * inv_qmax(qmax), jnp.float32(1.0))


def tensor_scale(x: jax.Array, qmax: int) -> jax.Array:
    """Dynamic per-tensor activation scale, float32 ``[1]``: ``absmax * fl(1/qmax)`` (1 for zeros)."""
    return _scale_from_absmax(jnp.max(jnp.abs(x.astype(jnp.float32))), qmax).reshape(1)


def quantize_rows_xla(
    x: jax.Array, *, qmax: int = 127, scale: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Reference of :func:`quantize_rows`: int8 ``[M, K]`` codes and float32 ``[M]`` row scales
    (``absmax * fl(1/qmax)`` per row, 1 for a zero row; or the given ``scale``, scalar or ``[M]``);
    codes ``clip(round_half_even(x * fl(1/s)), -qmax, qmax)``."""
    xf = x.astype(jnp.float32)
    s = _scale_from_absmax(jnp.max(jnp.abs(xf), axis=1), qmax) if scale is None else _vec(scale, x.shape[0])
    # fl(1/s) correctly rounded (XLA:GPU's division is not: on an H200 it gave a reciprocal one ulp
    # off, so x * inv moved from 63.499996 to 63.5 and rounded to 64), and materialized behind an
    # optimization barrier so that no compiler folds ``x * fl(1/s)`` back into ``x / s``.
    inv = jax.lax.optimization_barrier(exact_reciprocal(s))
    q = jnp.clip(jnp.round(xf * inv[:, None]), -qmax, qmax).astype(jnp.int8)
    return q, s


def w8a8_matmul_xla(
    x: jax.Array,
    w: jax.Array,
    w_scale: jax.Array,
    *,
    act_scale: jax.Array | None = None,
    act_granularity: ActGranularity = "token",
    bias: jax.Array | None = None,
    out_dtype: Any = None,
    qmax: int = 127,
) -> jax.Array:
    """The pure-jnp reference of :func:`w8a8_matmul_pallas` (arguments as there): XLA's int8 x int8
    -> int32 ``dot_general`` and the same float epilogue."""
    _check(x, w, w_scale, act_scale, act_granularity, qmax, "w8a8_matmul_xla")
    M, N = x.shape[0], w.shape[1]
    out_dtype = _out_dtype(x, out_dtype)
    if x.dtype == jnp.int8:
        q, sx = x, _vec(act_scale, M)
    else:
        if act_scale is None and act_granularity == "tensor":
            act_scale = tensor_scale(x, qmax)
        q, sx = quantize_rows_xla(x, qmax=qmax, scale=act_scale)
    acc = jax.lax.dot_general(q, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
    bias = None if bias is None else bias.astype(jnp.float32).reshape(N)
    return _epilogue(acc, _vec(w_scale, N), sx, bias, out_dtype)


# --------------------------------------------------------------------------------------------------
# Pallas kernels.


def _reciprocal(s, interpret: bool):
    """``fl(1 / s)`` of the row scales ``s [BM]`` (IEEE division, as XLA's ``1 / s``)."""
    return div_rn(jnp.ones_like(s, jnp.float32), s, interpret=interpret)


def _quantize_tile(xf, inv_s, qmax: int, interpret: bool):
    """int8 codes of a float32 tile with row reciprocals ``inv_s [BM]`` (= :func:`quantize_rows_xla`);
    the product is rounded before the rounding to codes looks at it (:func:`mul_rn`)."""
    q = round_half_even(mul_rn(xf, inv_s[:, None], interpret=interpret))
    return jnp.clip(q, -qmax, qmax).astype(jnp.int8)


def _row_absmax_scale(x_ref, m0, bm, K, bk, M, qmax: int):
    """``where(amax > 0, amax * fl(1/qmax), 1)`` over all of K for rows ``m0 .. m0 + bm``."""

    def body(kb, amax):
        t = load_tile(x_ref, m0, bm, kb * bk, bk, M, K).astype(jnp.float32)
        return jnp.maximum(amax, jnp.max(jnp.abs(t), axis=1))

    amax = jax.lax.fori_loop(0, cdiv(K, bk), body, jnp.zeros((bm,), jnp.float32))
    return _scale_from_absmax(amax, qmax)


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
        s = _row_absmax_scale(x_ref, m0, bm, K, bk, M, qmax)
    inv_s = _reciprocal(s, interpret)

    @pl.loop(0, cdiv(K, bk))
    def _(kb):
        k0 = kb * bk
        t = load_tile(x_ref, m0, bm, k0, bk, M, K).astype(jnp.float32)
        store_tile(q_ref, m0, bm, k0, bk, M, K, _quantize_tile(t, inv_s, qmax, interpret))

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
    """Per-row symmetric int8 quantization of ``x [M, K]`` -> (int8 ``[M, K]``, float32 ``[M]``), a
    Pallas kernel; reference :func:`quantize_rows_xla` (bit-identical codes and scales).

    ``scale`` (float32 ``[M]`` or scalar) skips the absmax and quantizes with the given scales.
    """
    M, K = x.shape
    bk = min(block_k, max(32, 1 << (K - 1).bit_length()))
    kern = functools.partial(
        _quant_kernel, M=M, K=K, bm=block_m, bk=bk, qmax=qmax, given=scale is not None, interpret=interpret
    )
    args = (x,) if scale is None else (x, _vec(scale, M))
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
        sx = _row_absmax_scale(x_ref, m0, bm, K, bk, M, qmax)
    else:
        sx = load_vec(sx_ref, m0, bm, M, other=1.0)
    inv_sx = _reciprocal(sx, interpret) if a_mode != "int8" else None

    nkb = cdiv(K, bk)
    kb_lo = s * kb_per_split
    kb_hi = jnp.minimum(kb_lo + kb_per_split, nkb)

    def body(kb, acc):
        k0 = pl.multiple_of(kb * bk, bk)
        a = load_tile(x_ref, m0, bm, k0, bk, M, K)
        if a_mode != "int8":
            a = _quantize_tile(a.astype(jnp.float32), inv_sx, qmax, interpret)
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


def w8a8_matmul_pallas(
    x: jax.Array,
    w: jax.Array,
    w_scale: jax.Array,
    *,
    act_scale: jax.Array | None = None,
    act_granularity: ActGranularity = "token",
    bias: jax.Array | None = None,
    out_dtype: Any = None,
    qmax: int = 127,
    mode: Mode = "auto",
    blocks: tuning.Blocks | None = None,
    interpret: bool = False,
) -> jax.Array:
    """The Pallas kernel: ``x [M, K]`` (float, or int8 codes) ``@ w [K, N]`` (int8) -> ``[M, N]``.

    Args:
      x: float activations; or int8 codes, then ``act_scale`` is required.
      w: int8 weight codes ``[K, N]``.
      w_scale: per-output-channel scales ``[N]`` (or one per tensor: scalar / ``[1]``).
      act_scale: None for dynamic scales; else float32 ``[M]`` (or scalar) given scales.
      act_granularity: dynamic scales per ``"token"`` (row) or per ``"tensor"``.
      bias: optional ``[N]``, added in float32.
      out_dtype: default ``x``'s dtype (float32 for int8 ``x``); ``jnp.int32`` returns the raw
        accumulator (exactness tests).
      qmax: ``2**(act_bits-1) - 1``.
      mode: ``"fused"`` (absmax/quantization in the GEMM), ``"prepass"`` (quantization kernel
        first) or ``"auto"`` (by M, see ``tuning.W8A8_FUSED_MAX_M``).
      blocks: override the tuning table.
      interpret: run under the Pallas interpreter (CPU).
    """
    _check(x, w, w_scale, act_scale, act_granularity, qmax, "w8a8_matmul_pallas")
    M, K = x.shape
    N = w.shape[1]
    out_dtype = _out_dtype(x, out_dtype)
    if act_scale is None and act_granularity == "tensor" and x.dtype != jnp.int8:
        act_scale = tensor_scale(x, qmax)  # one XLA reduction; the kernel then uses a given scale
    blocks = blocks or tuning.w8a8_blocks(M, N, K)
    bm, bn, bk, split_k = blocks.bm, blocks.bn, blocks.bk, blocks.split_k
    if bk < 32:
        raise ValueError(f"w8a8_matmul_pallas: bk={bk}; int8 MMA needs a K block >= 32")
    w_scale = _vec(w_scale, N)
    act_scale = _vec(act_scale, M)
    if bias is not None:
        bias = bias.astype(jnp.float32).reshape(N)

    if x.dtype == jnp.int8:
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
    return _epilogue(acc, w_scale, sx, bias, out_dtype)


# --------------------------------------------------------------------------------------------------
# Entry.


def w8a8_matmul(
    x: jax.Array,
    w: jax.Array,
    w_scale: jax.Array,
    *,
    act_scale: jax.Array | None = None,
    act_granularity: ActGranularity = "token",
    bias: jax.Array | None = None,
    out_dtype: Any = None,
    qmax: int = 127,
    mode: Mode = "auto",
    blocks: tuning.Blocks | None = None,
    interpret: bool = False,
) -> jax.Array:
    """W8A8 ``x @ w`` (arguments as :func:`w8a8_matmul_pallas`): the kernel when lowered for CUDA,
    :func:`w8a8_matmul_xla` elsewhere; ``interpret=True`` runs the kernel interpreted anywhere.
    Raises ValueError with :func:`supports`' reason for operands it does not cover."""
    _check(x, w, w_scale, act_scale, act_granularity, qmax, "w8a8_matmul")
    static = dict(act_granularity=act_granularity, out_dtype=out_dtype, qmax=qmax)

    def kernel(x, w, w_scale, act_scale, bias):
        return w8a8_matmul_pallas(
            x, w, w_scale, act_scale=act_scale, bias=bias, mode=mode, blocks=blocks, interpret=interpret, **static
        )

    def reference(x, w, w_scale, act_scale, bias):
        return w8a8_matmul_xla(x, w, w_scale, act_scale=act_scale, bias=bias, **static)

    args = (x, w, w_scale, act_scale, bias)
    if interpret:
        return kernel(*args)
    return on_cuda_else(kernel, reference, *args)
