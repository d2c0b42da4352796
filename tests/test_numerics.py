"""Property tests of quantize / dequantize / pack for every quantizer and granularity."""

import dataclasses

import hypothesis.extra.numpy as hnp
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from eqjax.numerics import (
    QuantSpec, codes, compute_range, dequantize, expand_scale, fake_quantize, pack, quantize, quantize_with,
    round_half_even, unpack,
)
from eqjax.qarray import QArrayError, per_channel, per_group, per_tensor, validate

FLOATS = st.floats(-1e4, 1e4, width=32, allow_nan=False, allow_infinity=False)


@st.composite
def tensor_and_spec(draw, calibrators=("absmax", "minmax")):
    rows = draw(st.sampled_from([2, 6]))  # few shapes: each new shape costs a compile
    cols = draw(st.sampled_from([4, 12]))
    x = draw(hnp.arrays(np.float32, (rows, cols), elements=FLOATS))
    kind = draw(st.sampled_from(["tensor", "channel0", "channel1", "group0", "group1", "group_ragged"]))
    gran = {
        "tensor": per_tensor(),
        "channel0": per_channel(0),
        "channel1": per_channel(1),
        "group0": per_group(0, 2),
        "group1": per_group(1, 4),
        "group_ragged": per_group(1, 5),
    }[kind]
    bits = draw(st.integers(2, 8))
    symmetric = draw(st.booleans())
    calibrator = draw(st.sampled_from(calibrators))
    scale_dtype = draw(st.sampled_from(["float32", "float16", "bfloat16"])) if calibrator != "mse" else "float32"
    spec = QuantSpec(bits, symmetric, gran, calibrator, scale_dtype=scale_dtype)
    return x, spec


def _err_bound(q, x):
    """Delta/2 plus float32 rounding of x_hat = q * scale (a few ulps of |x|)."""
    s = np.asarray(expand_scale(q), np.float64)
    return s / 2 * (1 + 1e-6) + 4 * np.finfo(np.float32).eps * np.abs(x.astype(np.float64)) + 1e-30, s


@given(tensor_and_spec())
def test_roundtrip_error_within_half_step(case):
    x, spec = case
    try:
        q = quantize(jnp.asarray(x), spec)
    except QArrayError as e:  # float16 scale overflow is a documented, clear error
        assert "overflows" in str(e)
        return
    validate(q)
    xh = np.asarray(dequantize(q), np.float64)
    bound, _ = _err_bound(q, x)
    assert np.all(np.abs(x.astype(np.float64) - xh) <= bound)


@given(tensor_and_spec(calibrators=("percentile", "mse")))
def test_roundtrip_error_with_clipping(case):
    """Clipping calibrators: error <= step/2 plus the distance to the clipped range."""
    x, spec = case
    q = quantize(jnp.asarray(x), spec)
    validate(q)
    xh = np.asarray(dequantize(q), np.float64)
    bound, s = _err_bound(q, x)
    lo_grid, hi_grid = _grid_limits(q)
    clip = np.maximum(0, x - hi_grid) + np.maximum(0, lo_grid - x)
    assert np.all(np.abs(x - xh) <= bound + clip)


def _grid_limits(q):
    """Smallest and largest value each element's block can represent."""
    s = np.asarray(expand_scale(q), np.float64)
    if q.symmetric:
        m = 2 ** (q.bits - 1) - 1
        return -m * s, m * s
    # the code of 0.0 is the zero point of the element's block
    z = np.asarray(codes(quantize_with(jnp.zeros(q.shape), q.scale, q.zero_point, bits=q.bits,
                                       granularity=q.granularity)), np.float64)
    return -z * s, (2**q.bits - 1 - z) * s


@given(tensor_and_spec())
def test_asymmetric_represents_zero_exactly(case):
    x, spec = case
    spec = dataclasses.replace(spec, symmetric=False)
    x = x.copy()
    x.flat[0] = 0.0
    q = quantize(jnp.asarray(x), spec)
    assert float(np.asarray(dequantize(q)).flat[0]) == 0.0
    # zero point is an integer code that dequantizes to 0.0 in every block
    zq = quantize_with(jnp.zeros(q.shape), q.scale, q.zero_point, bits=q.bits, granularity=q.granularity)
    assert np.all(np.asarray(dequantize(zq)) == 0.0)


@given(tensor_and_spec())
def test_requantize_is_identity(case):
    """quantize(dequantize(q)) == q: on q's own grid, and with a fresh min/max calibration."""
    x, spec = case
    try:
        q = quantize(jnp.asarray(x), spec)
    except QArrayError:
        return
    xh = dequantize(q)
    q2 = quantize_with(xh, q.scale, q.zero_point, bits=q.bits, granularity=q.granularity)
    np.testing.assert_array_equal(np.asarray(q2.values), np.asarray(q.values))
    if spec.scale_dtype == "float32":
        q3 = quantize(xh, spec)
        np.testing.assert_array_equal(np.asarray(codes(q3)), np.asarray(codes(q)))


@given(
    st.integers(2, 4),
    hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=11),
    st.data(),
)
def test_pack_unpack_identity(bits, shape, data):
    axis = data.draw(st.integers(0, len(shape) - 1))
    c = data.draw(hnp.arrays(np.uint8, shape, elements=st.integers(0, 2**bits - 1)))
    p = pack(jnp.asarray(c), bits, axis)
    n = {2: 4, 3: 8, 4: 2}[bits]
    assert p.shape[axis] == -(-shape[axis] // n) * n * bits // 8
    np.testing.assert_array_equal(np.asarray(unpack(p, bits, axis, shape[axis])), c)


def test_pack_layout_int4_low_nibble_first():
    c = jnp.asarray([[1], [2], [3], [4]], jnp.uint8)
    p = np.asarray(pack(c, 4, 0))
    assert p.tolist() == [[0x21], [0x43]]


def test_symmetric_extremes_never_overflow():
    for bits in range(2, 9):
        m = 2 ** (bits - 1) - 1
        x = jnp.asarray([[-3.0, 3.0, 1.5, -1.5, 0.0, 2.999999]], jnp.float32).T
        q = quantize(x, QuantSpec(bits, True, per_tensor(), "absmax"))
        iv = np.asarray(codes(q)).astype(int) - (2 ** (bits - 1) if bits <= 4 else 0)
        assert iv.max() == m and iv.min() == -m
        np.testing.assert_allclose(np.asarray(dequantize(q))[[0, 1]].ravel(), [-3.0, 3.0], rtol=1e-6)
    # int8: +absmax -> 127, never 128 (the seed's /127.5 scale would round 127.5 up to 128)
    q = quantize(jnp.asarray([[-1.0], [1.0]]), QuantSpec(8, True, per_tensor()))
    assert np.asarray(q.values).ravel().tolist() == [-127, 127]


def test_int4_group128_size_4096():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4096, 4096), np.float32))
    for sym in (True, False):
        q = quantize(x, QuantSpec(4, sym, per_group(0, 128), scale_dtype="float16"))
        assert q.values.dtype == jnp.uint8 and q.values.shape == (2048, 4096)
        assert q.nbytes <= 8.6 * 2**20, q.nbytes


@given(hnp.arrays(np.float32, 64, elements=st.floats(-1e6, 1e6, width=32)))
def test_round_half_even_matches_jnp_round(x):
    x = np.concatenate([x, np.arange(-5, 5, 0.5, dtype=np.float32)])
    np.testing.assert_array_equal(np.asarray(round_half_even(jnp.asarray(x))), np.asarray(jnp.round(x)))


def test_mse_clip_reduces_error_on_heavy_tails():
    rng = np.random.default_rng(0)
    x = rng.standard_t(2, size=(512, 8)).astype(np.float32)
    base = QuantSpec(3, True, per_channel(1), "minmax")
    mse = dataclasses.replace(base, calibrator="mse")
    e_base = float(np.mean((np.asarray(fake_quantize(jnp.asarray(x), base)) - x) ** 2))
    e_mse = float(np.mean((np.asarray(fake_quantize(jnp.asarray(x), mse)) - x) ** 2))
    assert e_mse < e_base


def test_percentile_range_inside_minmax():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1000, 3)), jnp.float32)
    lo, hi = compute_range(x, QuantSpec(8, False, per_channel(1), "percentile", percentile=99.0))
    lo2, hi2 = compute_range(x, QuantSpec(8, False, per_channel(1), "minmax"))
    assert np.all(np.asarray(hi) < np.asarray(hi2)) and np.all(np.asarray(lo) > np.asarray(lo2))


def test_fake_quantize_straight_through_gradient():
    import jax

    spec = QuantSpec(4, True, per_channel(1))
    x = jnp.asarray(np.random.default_rng(2).standard_normal((8, 4)), jnp.float32)
    g = jax.grad(lambda v: jnp.sum(fake_quantize(v, spec, straight_through=True) * 3.0))(x)
    np.testing.assert_allclose(np.asarray(g), 3.0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_inputs(dtype):
    x = jnp.asarray(np.random.default_rng(3).standard_normal((16, 8)), dtype)
    q = quantize(x, QuantSpec(8, True, per_channel(1)))
    assert dequantize(q).dtype == dtype
