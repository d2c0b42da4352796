"""pallas_kernels._common: the correctly rounded reciprocal that the XLA references use, and the
exact code -> float conversion of the W4A16 kernel.

Oracles: numpy's float32 division (IEEE round-to-nearest) and, for a sample, exact rational
arithmetic (fractions) choosing the nearest float32 by brute force over the neighbours.
"""

from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels._common import (
    _repaired_reciprocal,
    correct_reciprocal,
    exact_reciprocal,
    export_for_cuda,
    small_int_diff,
)


def _ulp_steps(r: np.ndarray, k: int) -> np.ndarray:
    out = r.copy()
    for _ in range(abs(k)):
        out = np.nextafter(out, np.float32(np.inf) if k > 0 else np.float32(0))
    return out.astype(np.float32)


def _positive_normals(rng, n: int) -> np.ndarray:
    mant = rng.uniform(1.0, 2.0, n)
    exp = rng.integers(-120, 120, n)
    return (mant * 2.0**exp).astype(np.float32)


@pytest.mark.parametrize("k", [-2, -1, 0, 1, 2])
def test_correct_reciprocal_repairs_an_approximation_up_to_two_ulp(rng, k):
    s = _positive_normals(rng, 20000)
    want = np.float32(1) / s  # numpy: correctly rounded
    r = _ulp_steps(want, k)
    got = np.asarray(correct_reciprocal(jnp.asarray(s), jnp.asarray(r)))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("fn", [exact_reciprocal, _repaired_reciprocal], ids=["as-lowered-here", "repaired"])
def test_exact_reciprocal_against_exact_rationals(rng, fn):
    """Both branches: what this CPU lowers (plain division) and the repair other platforms get."""
    s = _positive_normals(rng, 300)
    got = np.asarray(fn(jnp.asarray(s)))
    for si, gi in zip(s, got):
        exact = 1 / Fraction(float(si))
        cands = [_ulp_steps(np.array([gi], np.float32), k)[0] for k in (-1, 0, 1)]
        best = min(cands, key=lambda c: abs(Fraction(float(c)) - exact))
        assert gi == best, (si, gi, best)


def test_bfloat16_tie_row_from_the_h200():
    """The row that exposed XLA:GPU's reciprocal: absmax 11.3125, element 5.65625 -> 63.499996."""
    s = np.float32(11.3125) * (np.float32(1) / np.float32(127))
    inv = np.asarray(exact_reciprocal(jnp.asarray([s])))[0]
    assert inv == np.float32(1) / s
    assert np.float32(5.65625) * inv < np.float32(63.5)


def test_non_normal_inputs_pass_through():
    s = jnp.asarray([0.0, 1e-45, np.inf, 1.0], jnp.float32)
    r = jnp.asarray([np.inf, np.inf, 0.0, 1.0], jnp.float32)
    np.testing.assert_array_equal(np.asarray(correct_reciprocal(s, r)), np.asarray(r))


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=float(np.finfo(np.float32).tiny * np.float32(4)), max_value=float(np.float32(1e37)), width=32), st.integers(-2, 2))
def test_property_any_positive_normal(s, k):
    s32 = np.float32(s)
    want = np.float32(1) / s32
    r = _ulp_steps(np.array([want], np.float32), k)
    got = np.asarray(correct_reciprocal(jnp.asarray([s32]), jnp.asarray(r)))[0]
    assert got == want


def _mask_ops(exported) -> int:
    return exported.mlir_module().count("stablehlo.and")


def test_repair_lowered_for_cuda_not_for_cpu():
    """The repair's 12-bit masks are in the CUDA module and not in the CPU one (on CPU they made a W8A8
    SmolLM2 forward compile 9x slower for an unchanged result: XLA:CPU's division is IEEE-rounded)."""
    spec = jax.ShapeDtypeStruct((8,), jnp.float32)
    cpu = jax.export.export(jax.jit(exact_reciprocal), platforms=("cpu",))(spec)
    assert _mask_ops(cpu) == 0
    assert _mask_ops(export_for_cuda(exact_reciprocal, spec)) > 0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_small_int_diff_every_code_and_zero_point(dtype):
    """Brute force over all 16 x 16 (code, zero point) pairs, array and Python-int zero points."""
    q = jnp.arange(16, dtype=jnp.int32)[:, None]
    z = jnp.arange(16, dtype=jnp.int32)[None, :]
    want = np.arange(16)[:, None] - np.arange(16)[None, :]
    got = small_int_diff(q, z, dtype)
    assert got.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want)
    for zp in (0, 8, 15):
        np.testing.assert_array_equal(np.asarray(small_int_diff(q, zp, dtype).astype(jnp.float32)), want[:, zp:zp + 1])
