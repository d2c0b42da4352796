"""Float64 oracle of eqjax's min/max quantization grids, written from the definitions alone (no eqjax code).

Definitions (the module docs of ``eqjax.core.numerics``):

* symmetric: ``scale = absmax / D`` with ``D = 2**(b-1) - 1``, or ``2**(b-1) - 1/2`` for a full-range
  grid; integer values clipped to ``[-(2**(b-1) - 1), 2**(b-1) - 1]`` (5..8 bits) or
  ``[-2**(b-1), 2**(b-1) - 1]`` (2..4 bits);
* asymmetric: the range ``[lo, hi]`` widened to contain 0, ``scale = (hi - lo) / (2**b - 1)``,
  ``zp = round(-lo / scale)`` clipped to ``[0, 2**b - 1]``, codes ``round(x / scale) + zp`` clipped to
  ``[0, 2**b - 1]``;
* a zero range has scale 1; a scale is at least the smallest normal float32; a float16 / bfloat16 scale
  is the smallest value of that format at or above the float32 one (rounded *up*), and at least the
  format's smallest subnormal;
* rounding is half to even.
"""

from __future__ import annotations

import numpy as np

U32 = 2.0**-24  # unit roundoff of float32 (half its eps)
TINY32 = float(np.finfo(np.float32).tiny)

# significand bits (implicit one included), smallest subnormal, largest finite value
FORMATS = {
    "float16": (11, 2.0**-24, 65504.0),
    "bfloat16": (8, 2.0**-133, (2.0 - 2.0**-7) * 2.0**127),
}


def sym_divisor(bits: int, full_range: bool) -> float:
    return 2.0 ** (bits - 1) - (0.5 if full_range else 1.0)


def sym_bounds(bits: int) -> tuple[int, int]:
    m = 2 ** (bits - 1)
    return (-m, m - 1) if bits <= 4 else (-(m - 1), m - 1)


def round_up_to(s: np.ndarray, fmt: str) -> np.ndarray:
    """The smallest value of ``fmt`` (float16 / bfloat16) at or above each positive float64 ``s``
    (``inf`` above the largest finite one); ``float32``: ``s`` unchanged."""
    s = np.asarray(s, np.float64)
    if fmt == "float32":
        return s
    p, sub, big = FORMATS[fmt]
    _, k = np.frexp(s)  # s = m 2**k, m in [1/2, 1): spacing of the format there is 2**(k - p)
    ulp = np.maximum(np.ldexp(1.0, k - p), sub)
    r = np.ceil(s / ulp) * ulp  # exact: division and product by a power of two
    r = np.where(r > big, np.inf, r)
    return np.maximum(r, sub)


def raw_scale(lo: np.ndarray, hi: np.ndarray, bits: int, symmetric: bool, full_range: bool = False) -> np.ndarray:
    """Float64 scale of each range before the storage cast (lo <= hi not required for symmetric)."""
    lo = np.asarray(lo, np.float64)
    hi = np.asarray(hi, np.float64)
    if symmetric:
        a = np.maximum(np.abs(lo), np.abs(hi))
        return np.where(a > 0, np.maximum(a / sym_divisor(bits, full_range), TINY32), 1.0)
    lo, hi = np.minimum(lo, 0.0), np.maximum(hi, 0.0)
    return np.where(hi > lo, np.maximum((hi - lo) / (2**bits - 1), TINY32), 1.0)


def scale_interval(raw: np.ndarray, fmt: str, rel: float) -> tuple[np.ndarray, np.ndarray]:
    """``[lowest, highest]`` stored scale an implementation may produce when its float32 arithmetic moves
    the raw scale by at most ``rel`` relative (the storage cast rounds each end up)."""
    raw = np.asarray(raw, np.float64)
    lo, hi = raw * (1 - rel), raw * (1 + rel)
    if fmt == "float32":
        lo = np.where(raw == 1.0, 1.0, lo)  # the zero-range scale 1 is exact
        hi = np.where(raw == 1.0, 1.0, hi)
        return np.maximum(lo, TINY32 * (1 - 2 * U32)), hi
    return round_up_to(lo, fmt), round_up_to(hi, fmt)


def zero_point(lo: np.ndarray, scale: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """``(zp, tie)``: float64 zero point of each range on the given ``scale`` and whether ``-lo / scale``
    lies within float32 rounding (two units, relative) of a half-integer, where either neighbour is right."""
    t = -np.minimum(np.asarray(lo, np.float64), 0.0) / np.asarray(scale, np.float64)
    zp = np.clip(np.round(t), 0, 2**bits - 1)
    tie = np.abs(np.abs(t - np.floor(t)) - 0.5) <= 2 * U32 * np.abs(t)
    return zp, tie


def integer_values(x: np.ndarray, scale: np.ndarray, zp: np.ndarray | None, bits: int) -> np.ndarray:
    """``code - zp`` (float64 integers) of ``x`` on a grid (``zp`` None: symmetric); half to even."""
    t = np.asarray(x, np.float64) / np.asarray(scale, np.float64)
    if zp is None:
        lo, hi = sym_bounds(bits)
        return np.clip(np.round(t), lo, hi)
    return np.clip(np.round(t) + zp, 0, 2**bits - 1) - zp


def distance_to_boundary(t: np.ndarray) -> np.ndarray:
    """Distance of each ``t`` (in steps) to the nearest rounding boundary (a half-integer)."""
    t = np.asarray(t, np.float64)
    return np.abs(np.abs(t - np.floor(t)) - 0.5)
