"""The compiled Triton kernels on a real CUDA GPU (skipped elsewhere; run on a GPU machine).

Same contracts as the interpret tests. W8A8 is checked against the host numpy oracle of the
documented arithmetic (pk_oracle), with no GPU compiler in between: on an H200 (jax 0.11.2) the
GPU-compiled XLA reference itself rounded bfloat16 ties differently until it took its reciprocal
with ``exact_reciprocal`` (XLA:GPU's float32 division was one ulp off; all pass since, second H200
session). int32 accumulators and
quantize_rows' codes/scales bit-exact (this also checks the in-kernel ``div.rn`` / ``mul.rn``
arithmetic and the floor-based rounding); float outputs within the stated tolerances. W4A16 within
the summation-order bound of the float64 product. The eqjax adapter (``linear(..., backend=
"pallas")``) is checked against ``backend="xla"`` loosely (float epilogues may differ by contraction).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pk_oracle import np_quantize

from pallas_kernels import (
    quantize_rows,
    quantize_rows_xla,
    tuning,
    w4a16_matmul,
    w4a16_matmul_xla,
    w8a8_matmul,
    w8a8_matmul_pallas,
)


def _has_cuda() -> bool:
    try:
        d = jax.devices()[0]
    except RuntimeError:
        return False
    return d.platform in ("gpu", "cuda") and "rocm" not in str(getattr(d.client, "platform_version", "")).lower()


pytestmark = pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU")


def _w8(rng, k, n):
    w = jnp.asarray(rng.integers(-127, 128, (k, n)), jnp.int8)
    return w, jnp.asarray(rng.uniform(1e-3, 5e-2, (n,)), jnp.float32)


@pytest.mark.parametrize("m", [1, 5, 16, 33, 200])
@pytest.mark.parametrize("k,n", [(160, 96), (4096, 4096)])
@pytest.mark.parametrize("mode", ["fused", "prepass"])
def test_w8a8_accumulator_exact_on_gpu(m, k, n, mode):
    rng = np.random.default_rng(m + k)
    x = jnp.asarray(rng.standard_normal((m, k)) * rng.uniform(0.1, 5, (m, 1)), jnp.bfloat16)
    w, ws = _w8(rng, k, n)
    acc = jax.jit(lambda x: w8a8_matmul_pallas(x, w, ws, out_dtype=jnp.int32, mode=mode))(x)
    qn, _ = np_quantize(x)  # host oracle: no GPU compiler between the documented arithmetic and the check
    want = qn.astype(np.float64) @ np.asarray(w, np.float64)  # exact: |sum| < 2**53
    np.testing.assert_array_equal(np.asarray(acc, np.int64), want.astype(np.int64))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantize_rows_exact_on_gpu(dtype):
    # bfloat16 rows put many products x * fl(1/s) on or next to a rounding tie (x = amax / 2 gives
    # 63.499996): on an H200 the XLA reference gave 64 there while its reciprocal came from XLA:GPU's
    # division (one ulp off; 264 of 1,228,800 codes), and matches since exact_reciprocal
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((300, 4096)) * 3, dtype)
    qn, sn = np_quantize(x)
    for name, fn in (("kernel", quantize_rows), ("XLA reference", quantize_rows_xla)):
        q, s = jax.jit(fn)(x)
        np.testing.assert_array_equal(np.asarray(s), sn, err_msg=f"{name} scales")
        np.testing.assert_array_equal(np.asarray(q, np.int64), qn, err_msg=f"{name} codes")


@pytest.mark.parametrize("m", [1, 16, 128, 1000])
@pytest.mark.parametrize("act", ["token", "static", "tensor"])
def test_w8a8_entry_on_gpu(m, act):
    rng = np.random.default_rng(m)
    k, n = 4096, 2048
    w, ws = _w8(rng, k, n)
    kw = {"act_scale": jnp.float32(0.03)} if act == "static" else {"act_granularity": act}
    bias = jnp.asarray(rng.standard_normal((n,)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    got = jax.jit(lambda x: w8a8_matmul(x, w, ws, bias=bias, out_dtype=jnp.float32, **kw))(x)
    if act == "tensor":
        scale = np.float32(np.max(np.abs(np.asarray(x, np.float32)))) * (np.float32(1) / np.float32(127))
    else:
        scale = kw.get("act_scale")
    qn, sn = np_quantize(x, scale=scale)
    acc = (qn.astype(np.float64) @ np.asarray(w, np.float64)).astype(np.float32)
    y = (acc * np.asarray(ws)[None, :]) * sn[:, None]  # the documented epilogue, float32 ops on the host
    want = y + np.asarray(bias)[None, :]
    bound = np.abs(y) + np.abs(np.asarray(bias))[None, :]
    diff = np.abs(np.asarray(got, np.float64) - want.astype(np.float64))
    np.testing.assert_array_less(diff, 2.0**-22 * bound + 1e-30)


@pytest.mark.parametrize("m", [1, 16, 128, 1000])
@pytest.mark.parametrize("g,sym", [(32, False), (128, False), (128, True)])
def test_w4a16_entry_on_gpu(m, g, sym):
    _check_w4a16_on_gpu(m, g, sym, None)


@pytest.mark.parametrize("m,split,stages,once", [(1, 1, 3, False), (1, 4, 3, False), (3, 2, 3, False),
                                                 (1, 4, 1, False), (1, 4, 1, True), (3, 1, 1, True)])
@pytest.mark.parametrize("sym", [False, True])
def test_w4a16_gemv_blocks_on_gpu(m, split, stages, once, sym):
    _check_w4a16_on_gpu(m, 128, sym, tuning.Blocks(1, 128, 64, split, 4, stages, gemv=True, reduce_once=once))


@pytest.mark.parametrize("m,dtype", [(1, jnp.float16), (16, jnp.float16), (1, jnp.float32)])
def test_w4a16_other_activation_dtypes_on_gpu(m, dtype):
    """The codes' exact bit-trick conversion per dtype (float16 MMA, float32 GEMV; float32 MMA is
    TF32 by default and outside this bound)."""
    _check_w4a16_on_gpu(m, 128, False, None, dtype)


def _check_w4a16_on_gpu(m, g, sym, blocks, dtype=jnp.bfloat16):
    rng = np.random.default_rng(m + g)
    k, n = 4096, 2048
    codes = rng.integers(1 if sym else 0, 16, (k, n))
    packed = jnp.asarray(codes[0::2] | (codes[1::2] << 4), jnp.uint8)
    scale = jnp.asarray(rng.uniform(0.005, 0.05, (k // g, n)), jnp.bfloat16)
    zp = None if sym else jnp.asarray(rng.integers(0, 16, (k // g, n)), jnp.uint8)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    got = jax.jit(lambda x: w4a16_matmul(x, packed, scale, zp, group_size=g, out_dtype=jnp.float32, blocks=blocks))(x)
    ref = jax.jit(lambda x: w4a16_matmul_xla(x, packed, scale, zp, group_size=g, out_dtype=jnp.float32))(x)
    zpv = 8 if zp is None else np.repeat(np.asarray(zp, np.int64), g, axis=0)
    w_hat = (codes - zpv) * np.repeat(np.asarray(scale.astype(jnp.float32), np.float64), g, axis=0)
    xd = np.asarray(x.astype(jnp.float32), np.float64)
    exact, mag = xd @ w_hat, np.abs(xd) @ np.abs(w_hat)
    bound = (k + 4) * 2.0**-24 * mag + 1e-30
    np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - exact), bound)
    np.testing.assert_array_less(np.abs(np.asarray(ref, np.float64) - exact), bound)


@pytest.mark.parametrize("m", [1, 128])
def test_eqjax_linear_pallas_on_gpu(m):
    from eqjax.core.linear import ActQuantKernel, linear
    from eqjax.core.numerics import QuantSpec, quantize
    from eqjax.core.qarray import per_channel, per_group

    rng = np.random.default_rng(m)
    k, n = 4096, 2048
    wf = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    for kernel in (ActQuantKernel(quantize(wf, QuantSpec(8, True, per_channel(1)))),
                   quantize(wf, QuantSpec(4, False, per_group(0, 128), scale_dtype="bfloat16"))):
        got = jax.jit(lambda x: linear(x, {"kernel": kernel}, backend="pallas"))(x).astype(jnp.float32)
        want = jax.jit(lambda x: linear(x, {"kernel": kernel}, backend="xla"))(x).astype(jnp.float32)
        scale = np.max(np.abs(np.asarray(want))) + 1.0
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2.0**-6 * scale, rtol=2.0**-6)
