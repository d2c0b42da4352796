"""Quantize, dequantize, pack and unpack; range calibrators (absmax, min-max, percentile, MSE clip).

Conventions (see :mod:`eqjax.core.qarray` for the storage format):

* Symmetric: ``scale = absmax / (2**(b-1) - 1)`` and ``q = round(x / scale)``. Using ``2**(b-1) - 1``
  (127 for int8, not the seed's 127.5) means ``+absmax`` maps to 127 and ``-absmax`` to -127: nothing
  overflows and the grid is symmetric. The integers a symmetric array can hold (:func:`symmetric_bounds`):
  ``[-(2**(b-1) - 1), 2**(b-1) - 1]`` for 5..8 bits (stored as int8: W8A8 multiplies int8 activations
  by int8 weights in ``[-127, 127]``), and all ``2**b`` codes ``[-2**(b-1), 2**(b-1) - 1]`` for the packed
  2..4 bits (codes ``q + 2**(b-1)`` in ``[0, 2**b - 1]``).
* Full-range symmetric (``QuantSpec(full_range=True)``, 2..4 bits): ``scale = absmax / (2**(b-1) - 1/2)``
  (``2 absmax / 15`` at 4 bits, GPTQ's and AutoRound's grid): both ``+-absmax`` lie half a step
  outside the grid (``+absmax`` -> 7, ``-absmax`` -> -8 at 4 bits), so every value in the range is within
  half a step of a code and all 16 codes are used. Measured on SmolLM2 (W4 g128 RTN, bench/quality.py
  protocol): 29.26 (15 codes) -> 25.89 (16 codes). Quantizing ``dequantize(q)`` afresh is *not* the
  identity for these grids (the new absmax is ``7`` or ``8`` steps, not ``7.5``); on ``q``'s own grid it is.
* Asymmetric: the range ``[lo, hi]`` is first widened to contain 0, ``scale = (hi - lo) / Q`` with
  ``Q = 2**b - 1``, ``zp = round(-lo / scale)`` (an integer, so 0.0 is represented exactly),
  ``code = round(x / scale) + zp`` clipped to ``[0, Q]``. Rounding the zero point moves *both* ends of
  the range by the same ``d = zp + lo / scale`` codes, ``|d| <= 1/2``: one end may lie up to half a step
  outside the grid and is clipped onto the end code. So every value in ``[lo, hi]`` is within half a
  step of its code: the grid covers the range to within half a step, not exactly. A grid that covers
  ``[lo, hi]`` exactly needs a step up to ``Q / (Q - 1)`` times larger (1.5x at 2 bits, 1.07x at 4
  bits); on Gaussian weights that costs +6 % MSE at 4 bits (group 128) and +60..76 % at 2 bits, so eqjax
  keeps the ``(hi - lo) / Q`` step.
* Re-calibration (tested in ``tests/core/test_numerics.py``): quantizing ``dequantize(q)`` again on ``q``'s
  own grid always gives ``q``. Calibrating it afresh gives ``q`` for (not full-range) symmetric grids, and for asymmetric
  min/max grids whenever the range ends quantize to the end codes ``0`` and ``Q`` (they do unless ``d``
  is exactly ``-1/2``, when half-to-even rounding moves ``hi`` one code inward). It does not hold for
  ``absmax`` with an asymmetric grid: ``[-a, a]`` has ``d = +-1/2`` (``Q`` is odd), so ``+a`` and ``-a``
  both dequantize half a step off in the same direction and the next ``absmax`` differs (a constant
  block of ones at 2 bits: codes 3, then 2).
* A zero range (all-zero block) gets ``scale = 1``: codes are then exactly the zero point, no NaN. A
  constant block ``c`` calibrates to ``[min(c, 0), max(c, 0)]`` under min/max (``c`` is then a grid end,
  exact) and to ``[-|c|, |c|]`` under ``absmax`` (within half a step, as above). A range wider than the
  largest float32 (finite values of both signs) still gets a finite scale.
* Scales are clamped below at the smallest normal float32, so ``x / scale`` never divides by zero.
* Rounding is round-half-to-even (``jnp.round``); :func:`round_half_even` is the same function built
  from ``floor`` for kernels whose backend lacks a round primitive.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from eqjax.core.hadamard import hadamard_transform
from eqjax.core.qarray import (
    SUPPORTED_BITS,
    ActQuantKernel,
    Granularity,
    HalfFloat,
    PermutedKernel,
    QArray,
    QArrayError,
    RotatedKernel,
    codes_per_word,
    implicit_zero_point,
    is_packed,
    pack_axis_for,
    per_channel,
    scale_shape,
    storage_dtype,
)

__all__ = [
    "QuantSpec",
    "quantize",
    "quantize_with",
    "dequantize",
    "dequantize_leaf",
    "widen_halves",
    "fake_quantize",
    "compute_range",
    "range_to_qparams",
    "pack",
    "unpack",
    "codes",
    "expand_grid",
    "expand_scale",
    "integer_values",
    "round_half_even",
    "check_finite",
    "symmetric_bounds",
    "symmetric_divisor",
    "fake_quantize_grid",
    "round_ste",
]

Calibrator = Literal["absmax", "minmax", "percentile", "mse"]
_TINY = float(np.finfo(np.float32).tiny)


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How to quantize one tensor. Hashable static metadata.

    Attributes:
      bits: 2..8.
      symmetric: zero-centred signed grid (True) or min/max grid with an integer zero point (False).
      granularity: which elements share a scale (see :mod:`eqjax.core.qarray`).
      calibrator: how the range is chosen: ``absmax`` (max |x|), ``minmax``, ``percentile`` (the
        ``percentile``-th and ``100 - percentile``-th percentiles; clips the tails) or ``mse`` (shrink
        the min-max range by the factor in ``[mse_min_ratio, 1]`` that minimizes the Lp error,
        ``mse_grid`` steps, ``p = mse_norm``; one factor per scale block).
      scale_dtype: storage dtype of the scale. A float32 scale is rounded *up* to it, so the grid
        never shrinks below the calibrated range (float16 halves the metadata of group-wise weights).
      full_range: symmetric grids at 2..4 bits only: ``scale = absmax / (2**(b-1) - 1/2)`` so all
        ``2**b`` codes are used (``-8..7`` at 4 bits) instead of ``absmax / (2**(b-1) - 1)`` (``-7..7``).
        5..8-bit symmetric grids keep ``+-(2**(b-1) - 1)`` (int8 storage; int8 x int8 W8A8).
    """

    bits: int = 8
    symmetric: bool = True
    granularity: Granularity = dataclasses.field(default_factory=lambda: per_channel(-1))
    calibrator: Calibrator = "minmax"
    percentile: float = 99.9
    mse_grid: int = 40
    mse_min_ratio: float = 0.5
    mse_norm: float = 2.4
    scale_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    full_range: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.bits, (int, np.integer)) or self.bits not in SUPPORTED_BITS:
            raise QArrayError(f"unsupported bit width {self.bits!r}: eqjax quantizes to 2..8 bits")
        if self.calibrator not in ("absmax", "minmax", "percentile", "mse"):
            raise QArrayError(f"unknown calibrator {self.calibrator!r}")
        if not 50.0 < self.percentile <= 100.0:
            raise QArrayError(f"percentile must be in (50, 100], got {self.percentile}")
        if self.scale_dtype not in ("float32", "float16", "bfloat16"):
            raise QArrayError(f"unknown scale dtype {self.scale_dtype!r}")
        if self.mse_grid < 1 or not 0.0 < self.mse_min_ratio <= 1.0:
            raise QArrayError("mse_grid must be >= 1 and mse_min_ratio in (0, 1]")
        if self.full_range and not (self.symmetric and is_packed(self.bits)):
            raise QArrayError(
                f"full_range applies to symmetric 2..4-bit grids (asymmetric grids always use all 2**b codes; "
                f"5..8-bit symmetric codes are int8 in +-(2**(b-1) - 1)); got bits={self.bits}, "
                f"symmetric={self.symmetric}")


def round_half_even(x: jax.Array) -> jax.Array:
    """Round half to even using only floor/compare/select (equal to ``jnp.round`` for |x| < 2**23)."""
    f = jnp.floor(x)
    d = x - f
    odd = (f - 2.0 * jnp.floor(f * 0.5)) != 0
    up = (d > 0.5) | ((d == 0.5) & odd)
    return jnp.where(up, f + 1.0, f)


def check_finite(x: jax.Array, name: str = "tensor") -> None:
    """Raise ``ValueError`` naming ``name`` if a concrete ``x`` holds NaN or Inf (no-op under tracing)."""
    if isinstance(x, jax.core.Tracer):
        return
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating) and bool(_all_finite(x)):
        return  # one compiled pass: no float32 or boolean copy of the array
    a = np.asarray(x)
    if a.dtype.kind == "f" or a.dtype == jnp.bfloat16:
        bad = ~np.isfinite(a.astype(np.float32))
        if bad.any():
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(
                f"{name}: {int(bad.sum())} non-finite value(s) (NaN/Inf), first at index {idx} of shape {a.shape}"
            )


@jax.jit
def _all_finite(x: jax.Array) -> jax.Array:
    return jnp.all(jnp.isfinite(x))


def _check_input(x: jax.Array, name: str) -> None:
    dt = jnp.dtype(x.dtype)
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"{name}: can only quantize floating-point arrays, got dtype {dt}")
    check_finite(x, name)


def _blocked(x: jax.Array, gran: Granularity) -> tuple[jax.Array, tuple[int, ...]]:
    """View of ``x`` in which each scale block is reduced over the returned axes (keepdims).

    A group layout flattens its axes ``a..b`` into one (row-major) and cuts it into ``[n, size]``.
    A ragged last group is padded by repeating the flattened axis' last element, which leaves its
    absmax and min/max unchanged (the percentile and MSE searches see the repeats).
    """
    if gran.kind == "group":
        a, b = gran.axes[0], gran.axes[-1]
        size = gran.group_size
        length = int(np.prod(x.shape[a : b + 1], dtype=np.int64))
        x = x.reshape(x.shape[:a] + (length,) + x.shape[b + 1 :])
        n = -(-length // size)
        pad = n * size - length
        if pad:
            x = jnp.pad(x, [(0, pad) if i == a else (0, 0) for i in range(x.ndim)], mode="edge")
        view = x.reshape(x.shape[:a] + (n, size) + x.shape[a + 1 :])
        return view, (a + 1,)
    if gran.kind == "channel":
        return x, tuple(i for i in range(x.ndim) if i not in gran.axes)
    return x, tuple(range(x.ndim))


def _unblock(view: jax.Array, gran: Granularity, shape: tuple[int, ...]) -> jax.Array:
    """Inverse of :func:`_blocked` (drops the padding of a ragged last group)."""
    if gran.kind != "group":
        return view.reshape(shape)
    a, b = gran.axes[0], gran.axes[-1]
    length = int(np.prod(shape[a : b + 1], dtype=np.int64))
    flat = view.reshape(view.shape[:a] + (view.shape[a] * view.shape[a + 1],) + view.shape[a + 2 :])
    return jax.lax.slice_in_dim(flat, 0, length, axis=a).reshape(shape)


def _to_view(s: jax.Array, gran: Granularity) -> jax.Array:
    """Scale (scale_shape) -> broadcastable against the blocked view."""
    if gran.kind != "group":
        return s
    a, b = gran.axes[0], gran.axes[-1]
    return jnp.expand_dims(s.reshape(s.shape[:a] + (s.shape[b],) + s.shape[b + 1 :]), a + 1)


def _from_view(s: jax.Array, gran: Granularity) -> jax.Array:
    if gran.kind != "group":
        return s
    a, b = gran.axes[0], gran.axes[-1]
    s = jnp.squeeze(s, a + 1)
    return s.reshape(s.shape[:a] + (1,) * (b - a) + s.shape[a:])


def _round_up_to(scale: jax.Array, dtype: str) -> jax.Array:
    """Cast a positive float32 scale to ``dtype``, rounding up (so the range is never clipped)."""
    if dtype == "float32":
        return scale
    dt = jnp.dtype(dtype)
    s = scale.astype(dt)
    s = jnp.where(s.astype(jnp.float32) < scale, jnp.nextafter(s, jnp.asarray(jnp.inf, dt)), s)
    return jnp.maximum(s, jnp.asarray(jnp.finfo(dt).smallest_subnormal, dt))


def nearest_scale(s: jax.Array, dtype: Any) -> jax.Array:
    """The nearest ``dtype`` value of a positive scale, kept > 0 (a learned scale as a QArray stores it)."""
    dt = jnp.dtype(dtype)
    r = s.astype(dt)
    return jnp.where(r > 0, r, jnp.asarray(jnp.finfo(dt).smallest_subnormal, dt))


def symmetric_bounds(bits: int) -> tuple[int, int]:
    """The integers ``(lo, hi)`` a symmetric array of ``bits`` holds: all ``2**b`` codes when packed
    (2..4 bits), ``+-(2**(b-1) - 1)`` for the int8-stored 5..8 bits (see the module docs)."""
    m = 2 ** (bits - 1)
    return (-m, m - 1) if is_packed(bits) else (-(m - 1), m - 1)


def symmetric_divisor(bits: int, full_range: bool = False) -> float:
    """``absmax / scale`` of a symmetric grid: ``2**(b-1) - 1``, or ``2**(b-1) - 1/2`` with ``full_range``."""
    return 2 ** (bits - 1) - (0.5 if full_range else 1.0)


def range_to_qparams(
    lo: jax.Array, hi: jax.Array, bits: int, symmetric: bool, scale_dtype: str = "float32", full_range: bool = False
) -> tuple[jax.Array, jax.Array | None]:
    """(scale of ``scale_dtype``, zero point int32 or None) from a per-block range.

    Every value in the range is within half a step of the grid (see the module docs for the asymmetric
    zero point and the ``full_range`` symmetric grid); a ``scale_dtype`` cast rounds the scale up,
    which keeps that.
    """
    lo = lo.astype(jnp.float32)
    hi = hi.astype(jnp.float32)
    if symmetric:
        amax = jnp.maximum(jnp.abs(lo), jnp.abs(hi))
        scale = amax / symmetric_divisor(bits, full_range)
        scale = jnp.where(amax > 0, jnp.maximum(scale, _TINY), 1.0)
        return _round_up_to(scale, scale_dtype), None
    lo = jnp.minimum(lo, 0.0)
    hi = jnp.maximum(hi, 0.0)
    qmax = 2**bits - 1
    span = hi - lo
    # hi - lo overflows float32 for finite ranges wider than its largest value: halve first (exact)
    scale = jnp.where(jnp.isfinite(span), span / qmax, (0.5 * hi - 0.5 * lo) / qmax * 2.0)
    scale = jnp.where(hi > lo, jnp.maximum(scale, _TINY), 1.0)
    scale = _round_up_to(scale, scale_dtype)
    zp = jnp.clip(jnp.round(-lo / scale.astype(jnp.float32)), 0, qmax).astype(jnp.int32)
    return scale, zp


def _quantize_view(view, scale_v, zp_v, bits, symmetric):
    """Signed integer values q (int32) such that x_hat = q * scale."""
    if symmetric:
        lo, hi = symmetric_bounds(bits)
        return jnp.clip(jnp.round(view / scale_v), lo, hi).astype(jnp.int32)
    qmax = 2**bits - 1
    code = jnp.clip(jnp.round(view / scale_v) + zp_v, 0, qmax).astype(jnp.int32)
    return code - zp_v


def compute_range(x: jax.Array, spec: QuantSpec) -> tuple[jax.Array, jax.Array]:
    """Per-block (lo, hi) in scale_shape, float32, chosen by ``spec.calibrator``."""
    gran = spec.granularity.normalized(x.ndim)
    scale_shape(x.shape, gran)  # validates the group size
    view, red = _blocked(x.astype(jnp.float32), gran)
    if spec.calibrator == "absmax" or (spec.symmetric and spec.calibrator == "minmax"):
        hi = jnp.max(jnp.abs(view), axis=red, keepdims=True)
        lo = -hi
    elif spec.calibrator == "minmax":
        lo = jnp.min(view, axis=red, keepdims=True)
        hi = jnp.max(view, axis=red, keepdims=True)
    elif spec.calibrator == "percentile":
        p = spec.percentile
        if spec.symmetric:
            hi = jnp.percentile(jnp.abs(view), p, axis=red, keepdims=True)
            lo = -hi
        else:
            lo = jnp.percentile(view, 100.0 - p, axis=red, keepdims=True)
            hi = jnp.percentile(view, p, axis=red, keepdims=True)
    else:
        lo, hi = _mse_range(view, red, spec)
    return _from_view(lo, gran), _from_view(hi, gran)


def _mse_range(view, red, spec):
    if spec.symmetric:
        hi0 = jnp.max(jnp.abs(view), axis=red, keepdims=True)
        lo0 = -hi0
    else:
        lo0 = jnp.min(view, axis=red, keepdims=True)
        hi0 = jnp.max(view, axis=red, keepdims=True)
    ratios = jnp.linspace(1.0, spec.mse_min_ratio, spec.mse_grid, dtype=jnp.float32)

    def err_for(r):
        s, z = range_to_qparams(lo0 * r, hi0 * r, spec.bits, spec.symmetric, spec.scale_dtype, spec.full_range)
        s = s.astype(jnp.float32)
        zz = 0 if z is None else z
        q = _quantize_view(view, s, zz, spec.bits, spec.symmetric)
        return jnp.sum(jnp.abs(q * s - view) ** spec.mse_norm, axis=red, keepdims=True)

    def body(carry, r):
        best_err, best_r = carry
        e = err_for(r)
        better = e < best_err
        return (jnp.where(better, e, best_err), jnp.where(better, r, best_r)), None

    init = (err_for(ratios[0]), jnp.ones_like(hi0))
    (_, best), _ = jax.lax.scan(body, init, ratios[1:])
    return lo0 * best, hi0 * best


def pack(codes_: jax.Array, bits: int, axis: int) -> jax.Array:
    """Pack unsigned codes (< 2**bits, any int dtype) densely along ``axis`` into uint8.

    ``n = 8 / gcd(bits, 8)`` consecutive codes form ``bits * n / 8`` bytes, first code in the lowest
    bits; the axis is zero-padded to a multiple of ``n``.
    """
    if not is_packed(bits):
        raise QArrayError(f"only 2..4-bit codes are packed, got {bits}")
    n = codes_per_word(bits)
    nbytes = bits * n // 8
    c = jnp.moveaxis(codes_.astype(jnp.uint32), axis, -1)
    length = c.shape[-1]
    pad = (-length) % n
    if pad:
        c = jnp.pad(c, [(0, 0)] * (c.ndim - 1) + [(0, pad)])
    c = c.reshape(c.shape[:-1] + (c.shape[-1] // n, n))
    shifts = jnp.arange(n, dtype=jnp.uint32) * bits
    word = jnp.sum(c << shifts, axis=-1, dtype=jnp.uint32)
    out = jnp.stack([(word >> (8 * j)) & 0xFF for j in range(nbytes)], axis=-1).astype(jnp.uint8)
    out = out.reshape(out.shape[:-2] + (out.shape[-2] * nbytes,))
    return jnp.moveaxis(out, -1, axis)


def unpack(packed: jax.Array, bits: int, axis: int, length: int) -> jax.Array:
    """Inverse of :func:`pack`: uint8 codes of ``length`` along ``axis``. One compiled program per shape:
    op by op, each step would hold a uint32 copy of every code (8 GiB for a 128k-row LM head at 4 bits)."""
    if not is_packed(bits):
        raise QArrayError(f"only 2..4-bit codes are packed, got {bits}")
    return _unpack(packed, int(bits), int(axis) % max(jnp.ndim(packed), 1), int(length))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _unpack(packed: jax.Array, bits: int, axis: int, length: int) -> jax.Array:
    n = codes_per_word(bits)
    nbytes = bits * n // 8
    p = jnp.moveaxis(packed, axis, -1).astype(jnp.uint32)
    p = p.reshape(p.shape[:-1] + (p.shape[-1] // nbytes, nbytes))
    word = jnp.sum(p << (jnp.arange(nbytes, dtype=jnp.uint32) * 8), axis=-1, dtype=jnp.uint32)
    shifts = jnp.arange(n, dtype=jnp.uint32) * bits
    c = (word[..., None] >> shifts) & (2**bits - 1)
    c = c.reshape(c.shape[:-2] + (c.shape[-2] * n,))[..., :length]
    return jnp.moveaxis(c.astype(jnp.uint8), -1, axis)


def quantize(x: jax.Array, spec: QuantSpec, *, name: str = "tensor") -> QArray:
    """Quantize ``x`` (float, any rank) as ``spec`` says. Errors name ``name``."""
    _check_input(x, name)
    try:
        spec = dataclasses.replace(spec, granularity=spec.granularity.normalized(x.ndim))
    except QArrayError as e:
        raise QArrayError(f"{name}: {e}") from None
    q = _quantize_traced(x, spec)
    if not isinstance(q.scale, jax.core.Tracer) and not bool(jnp.all(jnp.isfinite(q.scale))):
        raise QArrayError(
            f"{name}: the range of shape {tuple(x.shape)} overflows a {spec.scale_dtype} scale; use float32 scales"
        )
    return q


@functools.partial(jax.jit, static_argnames="spec")
def _quantize_traced(x: jax.Array, spec: QuantSpec) -> QArray:
    """The traceable part of :func:`quantize` (input checks done by the caller), compiled per shape/spec."""
    lo, hi = compute_range(x, spec)
    scale, zp = range_to_qparams(lo, hi, spec.bits, spec.symmetric, spec.scale_dtype, spec.full_range)
    return quantize_with(x, scale, zp, bits=spec.bits, granularity=spec.granularity)


def quantize_with(
    x: jax.Array,
    scale: jax.Array,
    zero_point: jax.Array | None,
    *,
    bits: int,
    granularity: Granularity,
    name: str = "tensor",
) -> QArray:
    """Quantize ``x`` on a given grid (``scale``/``zero_point`` of ``scale_shape``; None = symmetric).

    Codes are clipped to what the array can hold: ``[0, 2**b - 1]`` (asymmetric), :func:`symmetric_bounds`
    (symmetric), so any grid a QArray stores (narrow or full-range) re-quantizes to itself exactly."""
    _check_input(x, name)
    if bits not in SUPPORTED_BITS:
        raise QArrayError(f"{name}: unsupported bit width {bits!r}: eqjax quantizes to 2..8 bits")
    gran = granularity.normalized(x.ndim)
    want = scale_shape(x.shape, gran)
    scale = jnp.asarray(scale).reshape(want)
    if jnp.dtype(scale.dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        scale = scale.astype(jnp.float32)
    symmetric = zero_point is None
    view, _ = _blocked(x.astype(jnp.float32), gran)
    zp_v = 0 if symmetric else _to_view(jnp.asarray(zero_point, jnp.int32).reshape(want), gran)
    q = _unblock(_quantize_view(view, _to_view(scale.astype(jnp.float32), gran), zp_v, bits, symmetric), gran, x.shape)
    if symmetric:
        code = q + implicit_zero_point(bits)
        zp_out = None
    else:
        code = q + _unblock(jnp.broadcast_to(zp_v, view.shape), gran, x.shape)
        zp_out = jnp.asarray(zero_point).reshape(want).astype(jnp.uint8)
    if is_packed(bits):
        values = pack(code, bits, pack_axis_for(gran))
    else:
        values = code.astype(storage_dtype(bits, symmetric))
    return QArray(values, scale, zp_out, bits, symmetric, gran, tuple(x.shape), jnp.dtype(x.dtype))


def expand_grid(scale: jax.Array, granularity: Granularity, shape: tuple[int, ...]) -> jax.Array:
    """A scale-shaped array (:func:`scale_shape` of ``granularity``) repeated over its block: ``shape``."""
    gran = granularity.normalized(len(shape))
    view_shape = _blocked(jnp.zeros(shape, jnp.int8), gran)[0].shape
    s = jnp.broadcast_to(_to_view(jnp.asarray(scale), gran), view_shape)
    return _unblock(s, gran, tuple(shape))


def expand_scale(q: QArray) -> jax.Array:
    """The float32 scale of every element, shape ``q.shape``."""
    return expand_grid(q.scale.astype(jnp.float32), q.granularity, q.shape)


def codes(q: QArray) -> jax.Array:
    """Stored codes, unpacked to the logical shape (uint8 or int8)."""
    if q.packed:
        return unpack(q.values, q.bits, q.pack_axis, q.shape[q.pack_axis])
    return q.values


def integer_values(q: QArray) -> jax.Array:
    """int32 ``code - zero_point`` in the logical shape: ``x_hat = integer_values * scale``."""
    c = codes(q).astype(jnp.int32)
    if q.symmetric and not q.packed:
        return c
    view, _ = _blocked(c, q.granularity)
    zp = _to_view(q.effective_zero_point, q.granularity)
    return _unblock(view - zp, q.granularity, q.shape)


def dequantize(q: QArray, dtype=None) -> jax.Array:
    """Float array of ``q.shape`` (``dtype`` defaults to ``q.dtype``)."""
    iv = integer_values(q).astype(jnp.float32)
    view, _ = _blocked(iv, q.granularity)
    x = _unblock(view * _to_view(q.scale.astype(jnp.float32), q.granularity), q.granularity, q.shape)
    return x.astype(dtype or q.dtype)


def dequantize_leaf(w: QArray | ActQuantKernel | RotatedKernel | PermutedKernel | HalfFloat | jax.Array,
                    dtype=None) -> jax.Array:
    """The float weight a param leaf stands for, in the leaf's own layout and shape (``dtype`` defaults
    to the leaf's): a QArray dequantized, an ActQuantKernel's weight, a RotatedKernel's ``Q`` applied to
    its (dequantized) kernel along its ``axis``, a PermutedKernel's (dequantized) kernel put back in input
    order, a HalfFloat widened; a float array as is."""
    if isinstance(w, PermutedKernel):
        return w.unpermute(dequantize_leaf(w.kernel, dtype))
    if isinstance(w, HalfFloat):
        return w.widen() if dtype is None else w.widen().astype(dtype)
    if isinstance(w, RotatedKernel):
        return hadamard_transform(dequantize_leaf(w.kernel, dtype), w.signs(), axis=w.axis, inverse=True)
    if isinstance(w, ActQuantKernel):
        w = w.weight
    return dequantize(w, dtype) if isinstance(w, QArray) else jnp.asarray(w, dtype)


def widen_halves(tree):
    """``tree`` with every :class:`~eqjax.core.qarray.HalfFloat` leaf replaced by the float array it stands for."""
    return jax.tree.map(lambda x: x.widen() if isinstance(x, HalfFloat) else x, tree,
                        is_leaf=lambda x: isinstance(x, HalfFloat))


def fake_quantize(x: jax.Array, spec: QuantSpec, *, straight_through: bool = False) -> jax.Array:
    """``dequantize(quantize(x))`` (traceable). With ``straight_through`` the gradient is identity."""
    gran = spec.granularity.normalized(x.ndim)
    lo, hi = compute_range(x, dataclasses.replace(spec, granularity=gran))
    scale, zp = range_to_qparams(lo, hi, spec.bits, spec.symmetric, spec.scale_dtype, spec.full_range)
    scale = jax.lax.stop_gradient(scale.astype(jnp.float32))
    view, _ = _blocked(x.astype(jnp.float32), gran)
    zz = 0 if zp is None else _to_view(jax.lax.stop_gradient(zp), gran)
    q = _quantize_view(view, _to_view(scale, gran), zz, spec.bits, spec.symmetric)
    xh = _unblock(q * _to_view(scale, gran), gran, x.shape).astype(x.dtype)
    if straight_through:
        return x + jax.lax.stop_gradient(xh - x)
    return xh


def round_ste(x: jax.Array) -> jax.Array:
    """``round(x)`` forward, identity gradient (straight-through estimator)."""
    return x + jax.lax.stop_gradient(jnp.round(x) - x)


def fake_quantize_grid(x: jax.Array, scale: jax.Array, zero_point: jax.Array | None, *, bits: int,
                       granularity: Granularity, offset: jax.Array | None = None) -> jax.Array:
    """Differentiable ``(clip(round(x / scale + offset) + zp) - zp) * scale`` on a given grid.

    ``scale`` (float, > 0) and ``zero_point`` (float or int; None = symmetric) have :func:`scale_shape`;
    ``offset`` (``x``'s shape, e.g. learned rounding offsets in ``[-1/2, 1/2]``) is added before rounding.
    Rounding passes gradients straight through, so ``x``, ``scale``, ``zero_point`` and ``offset`` all
    get gradients. With ``offset`` 0 the value equals ``dequantize(quantize_with(x, scale, zero_point))``.
    """
    gran = granularity.normalized(x.ndim)
    view, _ = _blocked(x.astype(jnp.float32), gran)
    s = _to_view(jnp.asarray(scale, jnp.float32), gran)
    t = view / s
    if offset is not None:
        t = t + _blocked(jnp.asarray(offset, jnp.float32), gran)[0]
    if zero_point is None:
        lo, hi = symmetric_bounds(bits)
        q = jnp.clip(round_ste(t), lo, hi)
    else:
        z = _to_view(jnp.asarray(zero_point, jnp.float32), gran)
        q = jnp.clip(round_ste(t) + z, 0, 2**bits - 1) - z
    return _unblock(q * s, gran, x.shape).astype(x.dtype)
