"""Pallas Triton kernels for quantized matmuls, on plain arrays (this package imports nothing from eqjax).

One file per kernel family, each with the Pallas kernel, a pure-jnp XLA reference of the same
arithmetic, ``supports(...)`` (None, or why the kernel does not cover the operands) and a
platform-dispatching entry:

* :mod:`pallas_kernels.w8a8_matmul`: ``x [M, K]`` float, int8 weight codes ``[K, N]``, per-output-
  channel scales ``[N]``; activations quantized to int8 per token / per tensor (dynamic) or with a
  given scale; ``int8 x int8 -> int32`` MMA, scaled float epilogue. :func:`w8a8_matmul` (entry),
  :func:`w8a8_matmul_pallas`, :func:`w8a8_matmul_xla`, :func:`quantize_rows` (+ ``_xla``).
* :mod:`pallas_kernels.w4a16_matmul`: ``x [M, K]`` float, packed uint8 int4 codes ``[K/2, N]`` (two
  per byte, even index in the low nibble), group scales ``[K/G, N]``, optional zero points
  (symmetric: 8); nibbles unpacked in registers, MMA in the activation dtype, fp32 accumulation.
  :func:`w4a16_matmul` (entry), :func:`w4a16_matmul_pallas`, :func:`w4a16_matmul_xla`.

The entries choose at lowering time (``lax.platform_dependent``): the Triton kernel for CUDA, the
reference on CPU/TPU/ROCm, so they are safe anywhere; ``interpret=True`` always runs the kernel
(interpreted, any platform). :mod:`pallas_kernels.tuning` holds the block sizes per shape.
:mod:`eqjax.core.linear` turns its quantized types into these arrays (``backend="pallas"``).
"""

from __future__ import annotations

from pallas_kernels import tuning
from pallas_kernels.w4a16_matmul import supports as w4a16_supports
from pallas_kernels.w4a16_matmul import w4a16_matmul, w4a16_matmul_pallas, w4a16_matmul_xla
from pallas_kernels.w8a8_matmul import (
    quantize_rows,
    quantize_rows_xla,
    tensor_scale,
    w8a8_matmul,
    w8a8_matmul_pallas,
    w8a8_matmul_xla,
)
from pallas_kernels.w8a8_matmul import supports as w8a8_supports

__all__ = [
    "tuning",
    "w8a8_supports",
    "w8a8_matmul",
    "w8a8_matmul_pallas",
    "w8a8_matmul_xla",
    "quantize_rows",
    "quantize_rows_xla",
    "tensor_scale",
    "w4a16_supports",
    "w4a16_matmul",
    "w4a16_matmul_pallas",
    "w4a16_matmul_xla",
]
