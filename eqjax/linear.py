"""The quantized linear layer every model calls, and its one dispatch point (XLA or Pallas).

A linear layer's params are a mapping ``{"kernel": K, "bias"?: [N]}`` where ``K`` is one of

* a float array ``[in, out]``: a plain matmul;
* a :class:`~eqjax.qarray.QArray` ``[in, out]``: weight-only quantization (dequantized on the fly by
  XLA, or the packed INT4 Pallas kernel);
* an :class:`ActQuantKernel`: the weight as a QArray plus dynamic (per-token or per-tensor) or
  static int8 activation quantization: ``int8 x int8 -> int32`` via
  ``lax.dot_general(..., preferred_element_type=int32)``, then rescaled (W8A8).

The backend is chosen per call (``backend=``) or by :func:`use_backend` (a context manager over a
context variable, so nothing global is mutated by call order). ``"xla"`` is always available;
``"pallas"`` uses :mod:`pallas_kernels` for the shapes and layouts a kernel covers and falls back to
XLA otherwise; ``"pallas_interpret"`` runs the same kernels in interpret mode (CPU tests).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator, Literal, Mapping

import jax
import jax.numpy as jnp

from eqjax.numerics import integer_values, dequantize
from eqjax.qarray import QArray

__all__ = [
    "ActQuantKernel",
    "Backend",
    "linear",
    "use_backend",
    "current_backend",
    "quantize_activations",
    "int_matmul",
    "kernel_shape",
]

Backend = Literal["xla", "pallas", "pallas_interpret"]
_BACKEND: contextvars.ContextVar[str] = contextvars.ContextVar("eqjax_backend", default="xla")


@contextlib.contextmanager
def use_backend(backend: Backend) -> Iterator[None]:
    """Within the block, linears with no explicit ``backend`` use this one."""
    if backend not in ("xla", "pallas", "pallas_interpret"):
        raise ValueError(f"unknown backend {backend!r}: use 'xla', 'pallas' or 'pallas_interpret'")
    token = _BACKEND.set(backend)
    try:
        yield
    finally:
        _BACKEND.reset(token)


def current_backend() -> str:
    return _BACKEND.get()


@dataclasses.dataclass(frozen=True)
class ActQuantKernel:
    """A quantized weight whose input activations are quantized too (W8A8 and friends).

    Attributes:
      weight: QArray ``[in, out]``; symmetric per-channel/per-tensor, or group-wise along ``in``
        (ZeroQuant), any 2..8 bits.
      act_scale: None for dynamic scales, else a static float32 scale of shape ``()`` (per-tensor),
        e.g. calibrated by SmoothQuant or tracked by :mod:`eqjax.ema`.
      act_bits: activation bits (8).
      act_granularity: ``"token"`` (one scale per row of the flattened input) or ``"tensor"``.
    """

    weight: QArray
    act_scale: jax.Array | None = None
    act_bits: int = 8
    act_granularity: Literal["token", "tensor"] = "token"

    def __post_init__(self) -> None:
        if not 2 <= self.act_bits <= 8:
            raise ValueError(f"activation bits must be in 2..8, got {self.act_bits}")
        if self.act_granularity not in ("token", "tensor"):
            raise ValueError(f"act_granularity must be 'token' or 'tensor', got {self.act_granularity!r}")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        extra = 0 if self.act_scale is None else self.act_scale.size * self.act_scale.dtype.itemsize
        return self.weight.nbytes + extra


jax.tree_util.register_dataclass(
    ActQuantKernel,
    data_fields=["weight", "act_scale"],
    meta_fields=["act_bits", "act_granularity"],
)


def kernel_shape(kernel: Any) -> tuple[int, ...]:
    """Logical ``[in, out]`` shape of any kernel kind."""
    return tuple(kernel.shape)


def quantize_activations(
    x2: jax.Array, bits: int = 8, granularity: str = "token", static_scale: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Symmetric activation quantization of ``x2 [M, K]``: (int8 ``[M, K]``, float32 scale ``[M, 1]``).

    ``scale = absmax / (2**(bits-1) - 1)`` per row (``token``) or over the tensor; a zero row gets
    scale 1. With ``static_scale`` values beyond the calibrated range are clipped.
    """
    qmax = 2 ** (bits - 1) - 1
    xf = x2.astype(jnp.float32)
    if static_scale is not None:
        s = jnp.broadcast_to(jnp.asarray(static_scale, jnp.float32).reshape(-1)[:1], (x2.shape[0], 1))
    else:
        axis = 1 if granularity == "token" else None
        amax = jnp.max(jnp.abs(xf), axis=axis, keepdims=True)
        amax = jnp.broadcast_to(amax, (x2.shape[0], 1))
        s = jnp.where(amax > 0, amax / qmax, 1.0)
    q = jnp.clip(jnp.round(xf / s), -qmax, qmax).astype(jnp.int8)
    return q, s


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


def _w8a8_xla(x2: jax.Array, k: ActQuantKernel) -> jax.Array:
    w = k.weight
    qx, sx = quantize_activations(x2, k.act_bits, k.act_granularity, k.act_scale)
    qw = _weight_int(w)
    gran = w.granularity
    wscale = w.scale.astype(jnp.float32)
    if gran.kind == "group":
        if gran.axes[0] != 0:
            raise ValueError(f"W8A8 with groups needs groups along the input axis, got {gran}")
        G = gran.group_size
        M, K = qx.shape
        ng = -(-K // G)
        if ng * G != K:  # short last group: zero-pad K (zeros add nothing to the integer sums)
            qx = jnp.pad(qx, ((0, 0), (0, ng * G - K)))
            qw = jnp.pad(qw, ((0, ng * G - K), (0, 0)))
        # Each group's sum of G integer products is < 2**24 when G * 127 * wmax < 2**24, so float32
        # accumulates it exactly (and XLA:CPU runs float batched dots far faster than int32 ones).
        wmax = 2 ** (w.bits - 1) - 1 if w.symmetric else 2**w.bits - 1
        exact_f32 = G * (2 ** (k.act_bits - 1) - 1) * wmax < 2**24
        acc_dtype = jnp.float32 if exact_f32 else jnp.int32
        acc = jnp.einsum(
            "mgk,gkn->mgn",
            qx.reshape(M, ng, G).astype(acc_dtype),
            qw.reshape(ng, G, -1).astype(acc_dtype),
            preferred_element_type=acc_dtype,
            precision=jax.lax.Precision.HIGHEST,
        )
        y = jnp.einsum("mgn,gn->mn", acc.astype(jnp.float32), wscale, precision=jax.lax.Precision.HIGHEST)
    else:
        if gran.kind == "channel" and gran.axes != (1,):
            raise ValueError(f"W8A8 needs per-output-channel or per-tensor weight scales, got {gran}")
        y = int_matmul(qx, qw).astype(jnp.float32) * wscale.reshape(1, -1)
    return y * sx


def _dispatch_pallas(x2: jax.Array, kernel: Any, bias: jax.Array | None, out_dtype, interpret: bool):
    """The Pallas kernel for this layer, or None when no kernel covers it (XLA then runs)."""
    try:
        import pallas_kernels
    except ImportError:  # pragma: no cover - the package ships both
        return None
    return pallas_kernels.dispatch(x2, kernel, bias, out_dtype=out_dtype, interpret=interpret)


def linear(x: jax.Array, layer: Mapping[str, Any], *, backend: Backend | None = None) -> jax.Array:
    """``x [..., in] @ kernel [in, out] (+ bias)`` for any kernel kind; returns ``x``'s dtype.

    Args:
      x: activations ``[..., in]``.
      layer: ``{"kernel": ..., "bias"?: [out]}``.
      backend: ``"xla"``, ``"pallas"`` or ``"pallas_interpret"``; default :func:`current_backend`.
    """
    kernel = layer["kernel"]
    bias = layer.get("bias")
    backend = backend or current_backend()
    lead, k_in = x.shape[:-1], x.shape[-1]
    shape = kernel_shape(kernel)
    if len(shape) != 2 or shape[0] != k_in:
        raise ValueError(f"linear: input has {k_in} features but the kernel's shape is {shape}")
    if not isinstance(kernel, (QArray, ActQuantKernel)):
        y = jnp.matmul(x, kernel.astype(x.dtype))
        return y if bias is None else y + bias.astype(y.dtype)
    x2 = x.reshape(-1, k_in)
    y = None
    if backend != "xla":
        y = _dispatch_pallas(x2, kernel, bias, x.dtype, interpret=backend == "pallas_interpret")
    if y is None:
        if isinstance(kernel, ActQuantKernel):
            y = _w8a8_xla(x2, kernel)
        else:
            y = jnp.matmul(x2, dequantize(kernel, x.dtype))
        if bias is not None:
            y = y + bias.astype(y.dtype)
    return y.astype(x.dtype).reshape(lead + (shape[1],))
