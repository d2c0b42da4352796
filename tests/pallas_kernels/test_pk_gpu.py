"""The compiled Triton kernels on a real CUDA GPU (skipped elsewhere; run on a GPU machine).

Same contracts as the interpret tests: W8A8 int32 accumulators bit-exact (this also checks that
the in-kernel ``div.rn.f32`` quantization gives the XLA codes), float outputs within the stated
tolerances of the XLA path.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqjax.linear import ActQuantKernel, int_matmul, linear, quantize_activations
from eqjax.numerics import QuantSpec, dequantize, quantize
from eqjax.qarray import per_channel, per_group
from pallas_kernels import quantize_rows, w8a8_matmul


def _has_cuda() -> bool:
    try:
        d = jax.devices()[0]
    except RuntimeError:
        return False
    return d.platform in ("gpu", "cuda") and "rocm" not in str(getattr(d.client, "platform_version", "")).lower()


pytestmark = pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("m", [1, 5, 16, 33, 200])
@pytest.mark.parametrize("k,n", [(160, 96), (4096, 4096)])
@pytest.mark.parametrize("mode", ["fused", "prepass"])
def test_w8a8_accumulator_exact_on_gpu(m, k, n, mode):
    rng = np.random.default_rng(m + k)
    x = jnp.asarray(rng.standard_normal((m, k)) * rng.uniform(0.1, 5, (m, 1)), jnp.bfloat16)
    w = quantize(jnp.asarray(rng.standard_normal((k, n)), jnp.float32), QuantSpec(bits=8, granularity=per_channel(1)))
    acc = jax.jit(lambda x: w8a8_matmul(x, w.values, w.scale, out_dtype=jnp.int32, mode=mode))(x)
    qx, _ = quantize_activations(x)
    np.testing.assert_array_equal(np.asarray(acc), np.asarray(int_matmul(qx, w.values)))


def test_quantize_rows_exact_on_gpu():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((300, 4096)) * 3, jnp.float32)
    q, s = jax.jit(quantize_rows)(x)
    qr, sr = quantize_activations(x)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(qr))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(sr[:, 0]))


@pytest.mark.parametrize("m", [1, 16, 128, 1000])
@pytest.mark.parametrize("act", ["token", "static"])
def test_w8a8_linear_on_gpu(m, act):
    rng = np.random.default_rng(m)
    k, n = 4096, 2048
    w = quantize(jnp.asarray(rng.standard_normal((k, n)), jnp.float32), QuantSpec(bits=8, granularity=per_channel(1)))
    ak = ActQuantKernel(w) if act == "token" else ActQuantKernel(w, act_scale=jnp.float32(0.03))
    layer = {"kernel": ak, "bias": jnp.asarray(rng.standard_normal((n,)), jnp.float32)}
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    got = jax.jit(lambda x: linear(x, layer, backend="pallas"))(x).astype(jnp.float32)
    want = jax.jit(lambda x: linear(x, layer, backend="xla"))(x).astype(jnp.float32)
    scale = np.max(np.abs(np.asarray(want))) + 1.0
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2.0**-7 * scale, rtol=2.0**-7)


@pytest.mark.parametrize("m", [1, 16, 128, 1000])
@pytest.mark.parametrize("g,sym", [(32, False), (128, False), (128, True)])
def test_w4a16_linear_on_gpu(m, g, sym):
    rng = np.random.default_rng(m + g)
    k, n = 4096, 2048
    q = quantize(jnp.asarray(rng.standard_normal((k, n)), jnp.float32),
                 QuantSpec(bits=4, symmetric=sym, granularity=per_group(0, g)))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    got = jax.jit(lambda x: linear(x, {"kernel": q}, backend="pallas"))(x)
    exact = np.asarray(x, np.float64) @ np.asarray(dequantize(q, jnp.float32), np.float64)
    mag = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(dequantize(q, jnp.float32), np.float64))
    err = np.abs(np.asarray(got.astype(jnp.float32), np.float64) - exact)
    np.testing.assert_array_less(err, 2.0**-8 * np.abs(exact) + 1e-4 * mag + 1e-3)

