"""The quantized linear layer every model calls, and its one dispatch point (XLA or Pallas).

A linear layer's params are a mapping ``{"kernel": K, "bias"?: [N]}`` where ``K`` is one of

* a float array ``[in, out]``: a plain matmul;
* a :class:`~eqjax.core.qarray.QArray` ``[in, out]``: weight-only quantization (dequantized on the fly by
  XLA, or the packed INT4 Pallas kernel);
* a :class:`~eqjax.core.qarray.RotatedKernel` ``[in, out]`` (axis 0): the input is rotated online by a
  randomized Hadamard transform, then multiplied by its inner kernel (any of these kinds);
* a :class:`~eqjax.core.qarray.PermutedKernel` ``[in, out]`` (axis 0): the input's features are gathered in
  its order (activation-ordered GPTQ groups), then multiplied by its inner kernel (any of these kinds);
* a :class:`~eqjax.core.qarray.HalfFloat` ``[in, out]``: a float kernel stored in 16 bits, widened first;
* an :class:`ActQuantKernel`: the weight as a QArray plus dynamic (per-token or per-tensor) or
  static int8 activation quantization: ``int8 x int8 -> int32`` via
  ``lax.dot_general(..., preferred_element_type=int32)``, then rescaled (W8A8).

The backend is chosen per call (``backend=``) or by :func:`use_backend` (a context manager over a
context variable, so nothing global is mutated by call order). ``"xla"`` is always available;
``"pallas"`` uses :mod:`pallas_kernels` for the shapes and layouts a kernel covers
(:func:`pallas_unsupported` says why not) and falls back to eqjax's XLA path otherwise;
``"pallas_interpret"`` runs the same kernels in interpret mode (CPU tests); ``"auto"`` runs a kernel
only on CUDA and only where it was measured faster than XLA (:func:`pallas_kernels.tuning.prefer_kernel`),
eqjax's XLA path everywhere else. :mod:`pallas_kernels`
takes plain arrays: the adapter here hands it a QArray's codes / scales / zero points and group
size, or an ActQuantKernel's int8 codes, per-channel scales and activation-scale settings. Its
entries lower to the Triton kernel for CUDA only and to their XLA reference elsewhere; the W8A8
reference is :func:`act_quant_matmul`'s arithmetic (bit-identical), the W4A16 one applies group
scales to fp32 partial sums (not the dequantize-then-matmul below), so ``"pallas"`` on CPU gives
the kernel's numbers, not the ``"xla"`` backend's.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Iterator, Literal, Mapping

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from eqjax.core.numerics import dequantize, integer_values
from eqjax.core.qarray import ActQuantKernel, HalfFloat, PermutedKernel, QArray, RotatedKernel
from pallas_kernels import tuning

__all__ = [
    "ActQuantKernel",
    "Backend",
    "linear",
    "use_backend",
    "current_backend",
    "quantize_activations",
    "int_matmul",
    "act_quant_matmul",
    "w8a8_k_order",
    "matmul_2d",
    "pallas_unsupported",
    "kernel_shape",
]

Backend = Literal["xla", "pallas", "pallas_interpret", "auto"]
BACKENDS = ("xla", "pallas", "pallas_interpret", "auto")
_BACKEND: contextvars.ContextVar[str] = contextvars.ContextVar("eqjax_backend", default="xla")


@contextlib.contextmanager
def use_backend(backend: Backend) -> Iterator[None]:
    """Within the block, linears with no explicit ``backend`` use this one."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    token = _BACKEND.set(backend)
    try:
        yield
    finally:
        _BACKEND.reset(token)


def current_backend() -> str:
    return _BACKEND.get()


def kernel_shape(kernel: Any) -> tuple[int, ...]:
    """Logical ``[in, out]`` shape of any kernel kind."""
    return tuple(kernel.shape)


def quantize_activations(
    x2: jax.Array, bits: int = 8, granularity: str = "token", static_scale: jax.Array | None = None,
    full_range: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Symmetric activation quantization of ``x2 [M, K]``: (int8 ``[M, K]``, float32 scale ``[M, 1]``).

    ``scale = absmax * fl(1/qmax)`` per row (``token``) or over the tensor, ``qmax = 2**(bits-1) - 1``;
    a zero row gets scale 1. Codes ``clip(round_half_even(x * fl(1/scale)), -qmax, qmax)``: exactly
    :func:`pallas_kernels.quantize_rows_xla`, the Pallas kernels' arithmetic, on every platform. With
    ``static_scale`` values beyond the calibrated range are clipped.

    ``full_range``: the compressed-tensors package's grid and arithmetic instead: ``scale = fl(absmax /
    (qmax + 1/2))`` and codes ``clip(round_half_even(fl(x / scale)), -qmax - 1, qmax)``
    (:class:`~eqjax.core.qarray.ActQuantKernel`).
    """

    qmax = 2 ** (bits - 1) - 1
    if full_range:
        return _quantize_full_range(x2, qmax, granularity, static_scale)
    if static_scale is not None:
        scale = jnp.asarray(static_scale, jnp.float32).reshape(-1)[:1]
    elif granularity == "token":
        scale = None
    else:
        scale = pk.tensor_scale(x2, qmax)
    q, s = pk.quantize_rows_xla(x2, qmax=qmax, scale=scale)
    return q, s.reshape(-1, 1)


def _quantize_full_range(x2: jax.Array, qmax: int, granularity: str,
                         static_scale: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """:func:`quantize_activations` with ``full_range``: codes in ``[-qmax - 1, qmax]``, IEEE divisions."""
    xf = x2.astype(jnp.float32)
    if static_scale is not None:
        s = jnp.broadcast_to(jnp.asarray(static_scale, jnp.float32).reshape(-1)[:1], (xf.shape[0],))
    else:
        amax = jnp.max(jnp.abs(xf), axis=1) if granularity == "token" else jnp.broadcast_to(
            jnp.max(jnp.abs(xf)), (xf.shape[0],))
        s = jnp.where(amax > 0, _ieee_div(amax, jnp.float32(qmax + 0.5)), jnp.float32(1.0))
    q = jnp.clip(jnp.round(_ieee_div(xf, s[:, None])), -qmax - 1, qmax).astype(jnp.int8)
    return q, s.reshape(-1, 1)


def _ieee_div(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a / b`` correctly rounded: XLA turns a division by a broadcast (a scalar or a row's scale) into a
    product with the rounded reciprocal, so the divisor is given in ``a``'s shape behind a barrier."""
    return a / jax.lax.optimization_barrier(jnp.broadcast_to(b, a.shape))


def int_matmul(qx: jax.Array, qw: jax.Array) -> jax.Array:
    """Exact integer matmul ``[M, K] x [K, N] -> int32`` (int8/int16 operands, int32 accumulation)."""
    return jax.lax.dot_general(
        qx, qw, (((qx.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.int32
    )


def _weight_int(w: QArray) -> jax.Array:
    """``code - zp`` in the narrowest signed type that holds it (int8, else int16)."""
    iv = integer_values(w)
    fits_int8 = w.symmetric or w.bits <= 7
    return iv.astype(jnp.int8 if fits_int8 else jnp.int16)


def w8a8_k_order(w: QArray, contracting: tuple[int, ...]) -> tuple[int, ...]:
    """The order of the weight's contracted axes in the activation rows :func:`act_quant_matmul`
    takes: ascending, with the group axes (for group-wise scales along input axes) last."""
    gran = w.granularity
    if _input_grouped(gran, contracting):
        return tuple(a for a in contracting if a not in gran.axes) + gran.axes
    return tuple(contracting)


def _input_grouped(gran: Any, contracting: tuple[int, ...]) -> bool:
    return gran.kind == "group" and all(a in contracting for a in gran.axes)


def act_quant_matmul(x2: jax.Array, k: ActQuantKernel, contracting: tuple[int, ...] = (0,),
                     free: tuple[int, ...] = (1,)) -> jax.Array:
    """W8A8 (and friends): ``x2 [M, K]`` quantized per token (or tensor) times the integer weight.

    The weight may have any rank: ``contracting`` are its input axes (``x2``'s columns follow
    :func:`w8a8_k_order`), ``free`` its output axes (flattened in order to ``N``). Scales must be per
    output channel / per tensor, or groups along an input axis (ZeroQuant). Returns float32 ``[M, N]``:
    ``int8 x int8 -> int32`` sums (per group: float32 when provably exact) times the weight scales
    times the activation scales.
    """
    w = k.weight
    qx, sx = quantize_activations(x2, k.act_bits, k.act_granularity, k.act_scale, k.act_full_range)
    qw = _weight_int(w)
    gran = w.granularity
    order = w8a8_k_order(w, contracting)
    shape = w.shape
    N = int(np.prod([shape[a] for a in free], dtype=np.int64))
    wscale = w.scale.astype(jnp.float32)
    M = qx.shape[0]
    if _input_grouped(gran, contracting):
        G = gran.group_size
        other = order[: len(order) - len(gran.axes)]
        O = int(np.prod([shape[a] for a in other], dtype=np.int64))
        Dg = int(np.prod([shape[a] for a in gran.axes], dtype=np.int64))
        ng = -(-Dg // G)
        wi = jnp.transpose(qw, order + free).reshape(O, Dg, N)
        xi = qx.reshape(M, O, Dg)
        if ng * G != Dg:  # short last group: zero-pad (zeros add nothing to the integer sums)
            wi = jnp.pad(wi, ((0, 0), (0, ng * G - Dg), (0, 0)))
            xi = jnp.pad(xi, ((0, 0), (0, 0), (0, ng * G - Dg)))
        sc = jnp.transpose(wscale, order + free).reshape(O * ng, N)
        # Each group's sum of G integer products is < 2**24 when G * amax * wmax < 2**24 (amax = 127 for
        # int8 activations, 128 on the full-range grid), so float32 accumulates it exactly (and XLA:CPU
        # runs float batched dots far faster than int32 ones).
        wmax = 2 ** (w.bits - 1) if w.symmetric else 2**w.bits - 1
        amax = 2 ** (k.act_bits - 1) - (0 if k.act_full_range else 1)
        exact_f32 = G * amax * wmax < 2**24
        acc_dtype = jnp.float32 if exact_f32 else jnp.int32
        acc = jnp.einsum(
            "mgk,gkn->mgn",
            xi.reshape(M, O * ng, G).astype(acc_dtype),
            wi.reshape(O * ng, G, N).astype(acc_dtype),
            preferred_element_type=acc_dtype,
            precision=jax.lax.Precision.HIGHEST,
        )
        y = jnp.einsum("mgn,gn->mn", acc.astype(jnp.float32), sc, precision=jax.lax.Precision.HIGHEST)
    else:
        if gran.kind == "group" or any(a not in free for a in gran.axes):
            raise ValueError(f"W8A8 needs per-output-channel, per-tensor or input-group weight scales, got {gran}")
        wi = jnp.transpose(qw, order + free).reshape(-1, N)
        sc = jnp.broadcast_to(jnp.transpose(wscale, order + free)[(0,) * len(order)],
                              tuple(shape[a] for a in free)).reshape(1, N)
        y = int_matmul(qx, wi).astype(jnp.float32) * sc
    return y * sx


def _w8a8_operands(x2: jax.Array, k: ActQuantKernel, pk: Any):
    """The arrays :func:`pallas_kernels.w8a8_matmul` takes for an ActQuantKernel, or why not."""
    w, gran = k.weight, k.weight.granularity
    if not jnp.issubdtype(x2.dtype, jnp.floating):
        return f"activation dtype {jnp.dtype(x2.dtype).name} (eqjax quantizes float activations)"
    if len(w.shape) != 2:
        return "weight is not 2-D"
    if k.act_full_range:
        return "full-range activation codes (the kernel's codes stay within +-qmax)"
    if not w.symmetric:
        return "asymmetric weights"
    if w.packed:
        return f"{w.bits}-bit packed weights (the kernel takes unpacked 5..8-bit int8 codes)"
    if gran.kind == "group" or (gran.kind == "channel" and gran.axes != (1,)):
        return f"weight scales {gran} (need per-output-channel or per-tensor)"
    qmax = 2 ** (k.act_bits - 1) - 1
    ws = w.scale.reshape(-1)  # [N], or [1] per tensor
    act_scale = None if k.act_scale is None else jnp.asarray(k.act_scale).reshape(-1)[:1]
    reason = pk.w8a8_supports(
        x2.shape, x2.dtype, w.values.shape, w.values.dtype, ws.shape,
        act_scale_shape=None if act_scale is None else act_scale.shape,
        act_granularity=k.act_granularity, qmax=qmax,
    )
    if reason is not None:
        return reason
    return functools.partial(
        pk.w8a8_matmul, x2, w.values, ws, act_scale=act_scale, act_granularity=k.act_granularity, qmax=qmax
    )


def _w4a16_operands(x2: jax.Array, q: QArray, pk: Any):
    """The arrays :func:`pallas_kernels.w4a16_matmul` takes for a 4-bit group-wise QArray, or why not."""
    gran = q.granularity
    if q.bits != 4:
        return f"{q.bits}-bit weights (the weight-only kernel takes 4-bit)"
    if len(q.shape) != 2:
        return "weight is not 2-D"
    if gran.kind != "group" or gran.axes != (0,):
        return f"weight scales {gran} (need groups along the input axis)"
    zp = q.zero_point  # None: symmetric, the implicit zero point 8 of packed 4-bit codes
    reason = pk.w4a16_supports(
        x2.shape, x2.dtype, q.values.shape, q.values.dtype, q.scale.shape, None if zp is None else zp.shape,
        group_size=gran.group_size, zero_point_dtype=jnp.uint8 if zp is None else zp.dtype,
    )
    if reason is not None:
        return reason
    return functools.partial(pk.w4a16_matmul, x2, q.values, q.scale, zp, group_size=gran.group_size)


def _pallas_op(x2: jax.Array, kernel: Any):
    """A call ``op(bias=, out_dtype=, interpret=)`` of the :mod:`pallas_kernels` entry covering
    ``x2 [M, K] @ kernel``, or the reason (str) none does."""

    if x2.ndim != 2:
        return "activations are not 2-D"
    if isinstance(kernel, ActQuantKernel):
        return _w8a8_operands(x2, kernel, pk)
    if isinstance(kernel, QArray):
        return _w4a16_operands(x2, kernel, pk)
    return f"no kernel for {type(kernel).__name__}"


def pallas_unsupported(x2: jax.Array, kernel: Any) -> str | None:
    """None when a Pallas kernel covers ``x2 [M, K] @ kernel``, else why eqjax's XLA path runs."""
    op = _pallas_op(x2, kernel)
    return op if isinstance(op, str) else None


def _dispatch_pallas(x2: jax.Array, kernel: Any, bias: jax.Array | None, out_dtype, interpret: bool):
    """``x2 @ kernel (+ bias)`` as ``[M, N]`` ``out_dtype`` by :mod:`pallas_kernels` (the kernel on
    CUDA or with ``interpret``, its XLA reference elsewhere), or None when no kernel covers it."""
    op = _pallas_op(x2, kernel)
    if isinstance(op, str):
        return None
    return op(bias=bias, out_dtype=out_dtype, interpret=interpret)


def _xla_matmul(x2: jax.Array, kernel: Any, bias: jax.Array | None) -> jax.Array:
    if isinstance(kernel, ActQuantKernel):
        y = act_quant_matmul(x2, kernel)
    else:
        y = jnp.matmul(x2, dequantize(kernel, x2.dtype))
    return y if bias is None else y + bias.astype(y.dtype)


def _auto(x2: jax.Array, kernel: Any, bias: jax.Array | None) -> jax.Array | None:
    """``backend="auto"``: the Pallas kernel on CUDA where :func:`pallas_kernels.tuning.prefer_kernel`
    says it was measured faster than XLA for this shape, eqjax's XLA path everywhere else (always off
    CUDA); None when the XLA path is the only choice."""

    if x2.ndim != 2 or not isinstance(kernel, (ActQuantKernel, QArray)):
        return None
    kind = "w8a8" if isinstance(kernel, ActQuantKernel) else "w4a16"
    (m, k), n = x2.shape, kernel_shape(kernel)[1]
    if not tuning.prefer_kernel(kind, m, k, n):  # decided first: no kernel operands built for nothing
        return None
    op = _pallas_op(x2, kernel)
    if isinstance(op, str):
        return None
    return jax.lax.platform_dependent(
        x2, cuda=lambda x: op(bias=bias, out_dtype=x.dtype), default=lambda x: _xla_matmul(x, kernel, bias))


def linear(x: jax.Array, layer: Mapping[str, Any], *, backend: Backend | None = None) -> jax.Array:
    """``x [..., in] @ kernel [in, out] (+ bias)`` for any kernel kind; returns ``x``'s dtype.

    Args:
      x: activations ``[..., in]``.
      layer: ``{"kernel": ..., "bias"?: [out]}``.
      backend: ``"xla"``, ``"pallas"`` or ``"pallas_interpret"``; default :func:`current_backend`.
    """
    kernel = layer["kernel"]
    bias = layer.get("bias")
    if isinstance(kernel, PermutedKernel):  # the input's features in the inner kernel's row order
        x, kernel = kernel.gather_input(x, axis=-1), kernel.kernel
    if isinstance(kernel, RotatedKernel):  # online Hadamard of the input, then the inner kernel
        x, kernel = kernel.rotate_input(x, axis=-1), kernel.kernel
    if isinstance(kernel, HalfFloat):
        kernel = kernel.widen()
    backend = backend or current_backend()
    lead, k_in = x.shape[:-1], x.shape[-1]
    shape = kernel_shape(kernel)
    if len(shape) != 2 or shape[0] != k_in:
        raise ValueError(f"linear: input has {k_in} features but the kernel's shape is {shape}")
    if not isinstance(kernel, (QArray, ActQuantKernel)):
        y = jnp.matmul(x, kernel.astype(x.dtype))
        return y if bias is None else y + bias.astype(y.dtype)
    y = matmul_2d(x.reshape(-1, k_in), kernel, bias, backend=backend)
    return y.astype(x.dtype).reshape(lead + (shape[1],))


def matmul_2d(x2: jax.Array, kernel: Any, bias: jax.Array | None = None, *, backend: Backend | None = None) -> jax.Array:
    """``x2 [M, K] @ kernel [K, N] (+ bias)`` for a QArray / ActQuantKernel ``[K, N]``, in ``x2``'s
    dtype: a Pallas kernel where one covers the layout and the backend asks for it, else XLA."""
    backend = backend or current_backend()
    y = None
    if backend == "auto":
        y = _auto(x2, kernel, bias)
    elif backend != "xla":
        y = _dispatch_pallas(x2, kernel, bias, x2.dtype, interpret=backend == "pallas_interpret")
    if y is None:
        y = _xla_matmul(x2, kernel, bias)
    return y.astype(x2.dtype)
