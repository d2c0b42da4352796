"""The quantized linear: exact integer path, W8A8 rescale, weight-only, dispatch."""

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from eqjax.linear import ActQuantKernel, current_backend, int_matmul, linear, quantize_activations, use_backend
from eqjax.numerics import QuantSpec, codes, dequantize, quantize
from eqjax.qarray import per_channel, per_group, per_tensor


@given(st.data())
def test_int8_matmul_equals_int64_numpy(data):
    m, k, n = data.draw(st.integers(1, 9)), data.draw(st.integers(1, 64)), data.draw(st.integers(1, 9))
    a = data.draw(hnp.arrays(np.int8, (m, k), elements=st.integers(-127, 127)))
    b = data.draw(hnp.arrays(np.int8, (k, n), elements=st.integers(-127, 127)))
    got = np.asarray(int_matmul(jnp.asarray(a), jnp.asarray(b)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, a.astype(np.int64) @ b.astype(np.int64))


def test_int8_matmul_worst_case_accumulation():
    k = 4096
    a = np.full((2, k), -127, np.int8)
    b = np.full((k, 3), -127, np.int8)
    np.testing.assert_array_equal(np.asarray(int_matmul(jnp.asarray(a), jnp.asarray(b))), np.full((2, 3), 127 * 127 * k))


def _w8a8_reference(x, w_q):
    """float64 reference of the W8A8 path from the integer pieces."""
    qx, sx = quantize_activations(jnp.asarray(x))
    qw = np.asarray(codes(w_q), np.int64)
    acc = np.asarray(qx, np.int64) @ qw
    return acc * np.asarray(w_q.scale, np.float64).reshape(1, -1) * np.asarray(sx, np.float64)


@pytest.mark.parametrize("gran", [per_channel(1), per_tensor()])
def test_w8a8_matches_integer_reference(gran):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 48)).astype(np.float32)
    w = rng.standard_normal((48, 24)).astype(np.float32)
    wq = quantize(jnp.asarray(w), QuantSpec(8, True, gran, "absmax"))
    y = np.asarray(linear(jnp.asarray(x), {"kernel": ActQuantKernel(wq)}))
    np.testing.assert_allclose(y, _w8a8_reference(x, wq), rtol=1e-5, atol=1e-5)
    # and it approximates the float matmul
    np.testing.assert_allclose(y, x @ w, atol=0.4)


def test_w8a8_grouped_weights_zeroquant():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 5, 128)).astype(np.float32)
    w = rng.standard_normal((128, 16)).astype(np.float32)
    wq = quantize(jnp.asarray(w), QuantSpec(8, True, per_group(0, 32)))
    y = np.asarray(linear(jnp.asarray(x), {"kernel": ActQuantKernel(wq), "bias": jnp.ones(16)}))
    assert y.shape == (3, 5, 16)
    # exact per-group integer reference, rescaled in float64
    qx, sx = quantize_activations(jnp.asarray(x.reshape(15, 128)))
    qx = np.asarray(qx, np.int64).reshape(15, 4, 32)
    qw = np.asarray(codes(wq), np.int64).reshape(4, 32, 16)
    acc = np.einsum("mgk,gkn->mgn", qx, qw)
    ref = np.einsum("mgn,gn->mn", acc, np.asarray(wq.scale, np.float64)) * np.asarray(sx, np.float64) + 1
    np.testing.assert_allclose(y.reshape(15, 16), ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(y, x @ w + 1, atol=0.6)


def test_static_activation_scale_clips():
    w = quantize(jnp.eye(4), QuantSpec(8, True, per_channel(1)))
    k = ActQuantKernel(w, act_scale=jnp.asarray(1.0 / 127))
    y = np.asarray(linear(jnp.asarray([[0.5, 2.0, -3.0, 0.0]]), {"kernel": k}))
    np.testing.assert_allclose(y, [[0.5, 1.0, -1.0, 0.0]], atol=1e-2)


@pytest.mark.parametrize("bits,sym", [(4, True), (4, False), (3, False), (8, False)])
def test_weight_only_equals_dequantized_matmul(bits, sym):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    wq = quantize(jnp.asarray(rng.standard_normal((64, 8)), jnp.float32), QuantSpec(bits, sym, per_group(0, 16)))
    y = linear(jnp.asarray(x), {"kernel": wq})
    np.testing.assert_allclose(np.asarray(y), x @ np.asarray(dequantize(wq)), rtol=1e-5, atol=1e-5)


def test_linear_is_jittable_and_shape_checked():
    wq = quantize(jnp.ones((8, 4)), QuantSpec(4, True, per_group(0, 4)))
    f = jax.jit(lambda x, p: linear(x, p))
    assert f(jnp.ones((2, 8)), {"kernel": wq}).shape == (2, 4)
    with pytest.raises(ValueError, match="input has 5 features"):
        linear(jnp.ones((2, 5)), {"kernel": wq})


def test_backend_context_is_scoped():
    assert current_backend() == "xla"
    with use_backend("pallas_interpret"):
        assert current_backend() == "pallas_interpret"
    assert current_backend() == "xla"
    with pytest.raises(ValueError, match="unknown backend"):
        with use_backend("cuda"):
            pass


def test_zero_activation_row_is_finite():
    w = quantize(jnp.ones((4, 2)), QuantSpec(8, True, per_channel(1)))
    y = linear(jnp.zeros((3, 4)), {"kernel": ActQuantKernel(w)})
    assert np.all(np.asarray(y) == 0.0)
