"""Pallas Triton kernels for eqjax's quantized linear layers, and their one dispatch point.

``dispatch(x2, kernel, bias, *, out_dtype, interpret)`` is what :func:`eqjax.linear.linear` calls
for ``backend="pallas"`` / ``"pallas_interpret"``; it returns ``[M, N]`` (bias added, in
``out_dtype``) or None when no kernel covers the layer, and the caller then runs XLA.

* :class:`eqjax.linear.ActQuantKernel` with symmetric unpacked (5..8-bit, int8 codes) per-channel
  or per-tensor weights, dynamic per-token / per-tensor or static activation scales:
  :func:`w8a8_matmul` (int8 x int8 -> int32 MMA, scaled epilogue).
* 4-bit :class:`eqjax.qarray.QArray` with groups along the input axis (G a multiple of 32),
  symmetric or asymmetric: :func:`w4a16_matmul` (packed int4 unpacked in registers, bf16 MMA, fp32
  accumulation).
* Everything else (other bit widths, per-channel 4-bit, group-wise W8A8, float kernels): None.

With ``interpret=False`` the kernels are chosen at lowering time for CUDA only
(``lax.platform_dependent``); on CPU/TPU/ROCm the same call lowers to the XLA path, so a global
``use_backend("pallas")`` is safe anywhere. ``interpret=True`` always runs the kernels (interpreted).
"""

from __future__ import annotations

from typing import Any

import jax

from pallas_kernels import tuning
from pallas_kernels.w4a16_matmul import supports as _w4a16_supports
from pallas_kernels.w4a16_matmul import w4a16_dispatch, w4a16_matmul
from pallas_kernels.w8a8_matmul import supports as _w8a8_supports
from pallas_kernels.w8a8_matmul import quantize_rows, w8a8_dispatch, w8a8_matmul

__all__ = ["dispatch", "why_not", "w8a8_matmul", "w4a16_matmul", "quantize_rows", "tuning"]


def _kind(kernel: Any) -> str | None:
    from eqjax.linear import ActQuantKernel
    from eqjax.qarray import QArray

    if isinstance(kernel, ActQuantKernel):
        return "w8a8"
    if isinstance(kernel, QArray):
        return "w4a16"
    return None


def why_not(x2: jax.Array, kernel: Any) -> str | None:
    """None if :func:`dispatch` has a kernel for this layer, else the reason it falls back to XLA."""
    kind = _kind(kernel)
    if x2.ndim != 2:
        return "activations are not 2-D"
    if kind == "w8a8":
        return _w8a8_supports(kernel, x2)
    if kind == "w4a16":
        return _w4a16_supports(kernel, x2)
    return f"no kernel for {type(kernel).__name__}"


def dispatch(x2: jax.Array, kernel: Any, bias: jax.Array | None, *, out_dtype: Any, interpret: bool = False):
    """``x2 [M, K] @ kernel (+ bias)`` by a Pallas kernel as ``[M, N]`` ``out_dtype``, or None."""
    if why_not(x2, kernel) is not None:
        return None
    if _kind(kernel) == "w8a8":
        return w8a8_dispatch(x2, kernel, bias, out_dtype=out_dtype, interpret=interpret)
    return w4a16_dispatch(x2, kernel, bias, out_dtype=out_dtype, interpret=interpret)
