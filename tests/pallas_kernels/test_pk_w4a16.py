"""W4A16 Pallas kernel under interpret=True against an exact reference and the XLA path.

The kernel multiplies the activations by the exact integers ``code - zp`` (fp32 accumulation) and
applies the group scale to each fp32 partial; the XLA path first rounds ``w_hat`` to the activation
dtype. Tolerances, against the float64 product ``x @ w_hat``:

* float32 activations: ``|err| <= 1e-5 * (|x| @ |w_hat|)`` (fp32 accumulation only);
* bf16 activations: ``|err| <= 2**-8 * |y| + 1e-5 * (|x| @ |w_hat|)`` (one bf16 output rounding);
  and the XLA bf16 path must be no closer than that bound allows (it is checked loosely, at
  ``2**-6 * (|x| @ |w_hat|)``, since it also rounds the weights to bf16).
"""

import jax.numpy as jnp
import numpy as np
import pytest

from eqjax.linear import linear
from eqjax.numerics import QuantSpec, dequantize, quantize
from eqjax.qarray import per_channel, per_group
from pallas_kernels import dispatch, tuning, w4a16_matmul, why_not


def _q(rng, k, n, g, sym):
    w = jnp.asarray(rng.standard_normal((k, n)) + (0.0 if sym else 0.3), jnp.float32)
    return quantize(w, QuantSpec(bits=4, symmetric=sym, granularity=per_group(0, g)))


def _exact(x, q):
    xd = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    wd = np.asarray(dequantize(q, jnp.float32), np.float64)
    return xd @ wd, np.abs(xd) @ np.abs(wd)


@pytest.mark.parametrize(
    "m,k,n,g,sym,blocks",
    [
        (1, 256, 96, 64, True, tuning.Blocks(16, 64, 16, split_k=3)),  # decode, split-K, ragged N
        (5, 160, 160, 32, False, tuning.Blocks(16, 64, 16)),  # K = 5 groups of 32, N ragged
        (33, 256, 96, 128, False, None),  # ragged M, table blocks
        (16, 192, 64, 96, True, tuning.Blocks(16, 32, 16, split_k=2)),  # G = 96: G/2 = 48 -> bk 16
    ],
)
def test_f32_matches_exact(rng, m, k, n, g, sym, blocks):
    q = _q(rng, k, n, g, sym)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((n,)), jnp.float32)
    y = w4a16_matmul(x, q.values, q.scale, q.zero_point, group_size=g, bias=bias, blocks=blocks, interpret=True)
    assert y.shape == (m, n) and y.dtype == jnp.float32
    ref, mag = _exact(x, q)
    ref = ref + np.asarray(bias)[None, :]
    np.testing.assert_array_less(np.abs(np.asarray(y, np.float64) - ref), 1e-5 * (mag + 1.0))


@pytest.mark.parametrize("m,sym,use_bias", [(1, False, True), (33, True, False)])
def test_bf16_linear_matches_xla(rng, m, sym, use_bias):
    k, n, g = 256, 160, 64
    q = _q(rng, k, n, g, sym)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    layer = {"kernel": q}
    if use_bias:
        layer["bias"] = jnp.asarray(rng.standard_normal((n,)), jnp.bfloat16)
    got = linear(x, layer, backend="pallas_interpret")
    want = linear(x, layer, backend="xla")
    assert got.dtype == want.dtype == jnp.bfloat16 and got.shape == want.shape
    ref, mag = _exact(x, q)
    if use_bias:
        ref = ref + np.asarray(layer["bias"].astype(jnp.float32), np.float64)[None, :]
    g64 = np.asarray(got.astype(jnp.float32), np.float64)
    w64 = np.asarray(want.astype(jnp.float32), np.float64)
    np.testing.assert_array_less(np.abs(g64 - ref), 2.0**-8 * np.abs(ref) + 1e-5 * mag + 1e-3)
    np.testing.assert_array_less(np.abs(g64 - w64), 2.0**-6 * mag + 1e-3)


def test_f16_activations(rng):
    q = _q(rng, 128, 64, 32, False)
    x = jnp.asarray(rng.standard_normal((5, 128)), jnp.float16)
    y = dispatch(x, q, None, out_dtype=jnp.float16, interpret=True)
    assert y.dtype == jnp.float16
    ref, mag = _exact(x, q)
    np.testing.assert_array_less(np.abs(np.asarray(y, np.float64) - ref), 2.0**-10 * np.abs(ref) + 1e-5 * mag + 1e-3)


def test_uncovered_layouts_fall_back(rng):
    w = jnp.asarray(rng.standard_normal((128, 64)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((3, 128)), jnp.float32)
    cases = [
        quantize(w, QuantSpec(bits=4, granularity=per_channel(1))),  # per-channel 4-bit
        quantize(w, QuantSpec(bits=3, granularity=per_group(0, 32))),  # 3-bit
        quantize(w, QuantSpec(bits=8, granularity=per_group(0, 32))),  # 8-bit weight-only
        quantize(w, QuantSpec(bits=4, granularity=per_group(0, 16))),  # G/2 = 8 < MMA K
        quantize(w, QuantSpec(bits=4, granularity=per_group(1, 32))),  # groups along N
    ]
    for q in cases:
        assert why_not(x, q) is not None, q
        assert dispatch(x, q, None, out_dtype=jnp.float32, interpret=True) is None
    np.testing.assert_array_equal(
        np.asarray(linear(x, {"kernel": cases[0]}, backend="pallas_interpret")),
        np.asarray(linear(x, {"kernel": cases[0]}, backend="xla")),
    )
