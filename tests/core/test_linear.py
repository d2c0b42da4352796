"""The quantized linear: exact integer path, W8A8 rescale, weight-only, dispatch (XLA and the
Pallas backends through eqjax's adapter to pallas_kernels' array API)."""

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pallas_kernels as pk
from eqjax.core.linear import (
    ActQuantKernel,
    act_quant_matmul,
    current_backend,
    int_matmul,
    linear,
    matmul_2d,
    pallas_unsupported,
    quantize_activations,
    use_backend,
)
from eqjax.core.numerics import QuantSpec, codes, dequantize, quantize
from eqjax.core.qarray import QArray, per_channel, per_group, per_tensor
from pallas_kernels._common import TRITON_CUSTOM_CALL, export_for_cuda


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


@given(st.data())
def test_full_range_activation_grid_is_the_packages_rule(data):
    """``full_range``: ``s = fl(absmax / 127.5)`` (1 for a zero row), codes ``clip(round(fl(x / s)), -128, 127)``
    in IEEE float32 (numpy as the oracle), per token, per tensor and with a static scale; every value within
    the range is within half a step of its code, and both ends of the grid are used."""
    m, k = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 40))
    x = data.draw(hnp.arrays(np.float32, (m, k), elements=st.floats(-1e4, 1e4, width=32)))
    gran = data.draw(st.sampled_from(["token", "tensor", "static"]))
    static = np.float32(data.draw(st.floats(0.125, 10.0, width=32))) if gran == "static" else None
    qx, s = quantize_activations(jnp.asarray(x), 8, "tensor" if gran == "tensor" else "token", static, True)
    qx, s = np.asarray(qx), np.asarray(s)
    if static is not None:
        want_s = np.full((m, 1), static, np.float32)
    else:
        amax = np.abs(x).max(axis=1, keepdims=True) if gran == "token" else np.full((m, 1), np.abs(x).max())
        want_s = np.where(amax > 0, (amax / np.float32(127.5)).astype(np.float32), np.float32(1))
    np.testing.assert_array_equal(s, want_s)
    np.testing.assert_array_equal(qx, np.clip(np.round(x / want_s), -128, 127))
    inside = np.abs(x / want_s.astype(np.float64)) <= 127.5
    err = np.abs(x.astype(np.float64) - qx.astype(np.float64) * want_s)
    assert np.all(err[inside] <= want_s.astype(np.float64).repeat(k, 1)[inside] * (0.5 + 130 * 2.0**-24))


def test_full_range_reaches_minus_128():
    """``-127.5`` with absmax 127.5: scale 1 and code -128 on the full-range grid (half to even), -127 on
    eqjax's (scale ``127.5 / 127``); the W8A8 product carries the code: ``-128 * 1`` times scale 1."""
    x = jnp.asarray([[-127.5, 64.0, 0.5], [0.0, 0.0, 0.0]])
    q_full, s_full = quantize_activations(x, full_range=True)
    q_own, _ = quantize_activations(x)
    np.testing.assert_array_equal(np.asarray(q_full), [[-128, 64, 0], [0, 0, 0]])
    assert int(q_own[0, 0]) == -127 and np.asarray(s_full).tolist() == [[1.0], [1.0]]
    w = quantize(jnp.ones((3, 1)), QuantSpec(8, True, per_channel(1)))
    y = np.asarray(act_quant_matmul(x[:1], ActQuantKernel(w, act_full_range=True)))
    np.testing.assert_array_equal(y, [[-128.0 + 64.0]])


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


# --------------------------------------------------------------------------------------------------
# The Pallas backend: eqjax's adapter from QArray / ActQuantKernel to pallas_kernels' array API.


def _x(rng, m, k, dtype=jnp.float32):
    x = rng.standard_normal((m, k)) * rng.uniform(0.1, 5.0, (m, 1))
    if m > 2:
        x[1] = 0.0  # a zero row
    return jnp.asarray(x, dtype)


def _w8(rng, k, n, gran=None, bits=8, scale_dtype="float32"):
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    return quantize(w, QuantSpec(bits, True, gran or per_channel(1), scale_dtype=scale_dtype))


def _w8a8_arrays(k: ActQuantKernel):
    """The arrays the adapter hands pallas_kernels (written out here independently of it)."""
    kw = {"act_granularity": k.act_granularity, "qmax": 2 ** (k.act_bits - 1) - 1}
    if k.act_scale is not None:
        kw["act_scale"] = k.act_scale
    return k.weight.values, k.weight.scale.reshape(-1), kw


@pytest.mark.parametrize("m,k,n", [(1, 160, 96), (33, 96, 40), (7, 4100, 24)])
@pytest.mark.parametrize("gran", ["channel", "tensor"])
@pytest.mark.parametrize("act", ["token", "tensor", "static", "token6"])
@pytest.mark.parametrize("jit", [False, True])
def test_pallas_w8a8_reference_is_act_quant_matmul_bit_for_bit(m, k, n, gran, act, jit):
    """pallas_kernels' W8A8 XLA reference = eqjax.core.linear.act_quant_matmul: the int32 sums and the
    float32 results, bit for bit (per-channel and per-tensor weight scales, bf16 scales too)."""
    rng = np.random.default_rng(m + k)
    q = _w8(rng, k, n, per_tensor() if gran == "tensor" else per_channel(1), bits=7 if act == "token6" else 8,
            scale_dtype="bfloat16" if m == 33 else "float32")
    ak = {"token": ActQuantKernel(q), "tensor": ActQuantKernel(q, act_granularity="tensor"),
          "static": ActQuantKernel(q, act_scale=jnp.float32(0.013)), "token6": ActQuantKernel(q, act_bits=6)}[act]
    x = _x(rng, m, k, jnp.bfloat16 if n == 40 else jnp.float32)
    w, ws, kw = _w8a8_arrays(ak)
    wrap = jax.jit if jit else (lambda f: f)
    acc = wrap(lambda x: pk.w8a8_matmul_xla(x, w, ws, out_dtype=jnp.int32, **kw))(x)
    qx, _ = quantize_activations(x, ak.act_bits, ak.act_granularity, ak.act_scale)
    np.testing.assert_array_equal(np.asarray(acc), np.asarray(int_matmul(qx, w)))
    got = wrap(lambda x: pk.w8a8_matmul_xla(x, w, ws, out_dtype=jnp.float32, **kw))(x)
    want = wrap(lambda x: act_quant_matmul(x, ak))(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_activation_codes_use_the_rounded_reciprocal():
    """quantize_activations computes ``amax * fl(1/qmax)`` and ``x * fl(1/s)`` (the Pallas kernels'
    arithmetic), which differ from IEEE division for some inputs; spelled out with the reciprocal
    materialized, so no platform's compiler turns it back into ``x / s``."""
    rng = np.random.default_rng(3)
    x = _x(rng, 256, 512)
    qx, s = quantize_activations(x)
    xf = np.asarray(x)
    amax = np.abs(xf).max(axis=1, keepdims=True)
    one = np.float32(1)
    recip = np.where(amax > 0, amax * (one / np.float32(127)), one).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(s), recip)
    assert np.any(recip != np.where(amax > 0, amax / np.float32(127), one))  # IEEE division differs
    np.testing.assert_array_equal(np.asarray(qx), np.clip(np.round(xf * (one / recip)), -127, 127))


@pytest.mark.parametrize(
    "m,dtype,act,gran,use_bias",
    [
        (1, jnp.float32, "token", "channel", False),
        (5, jnp.bfloat16, "token", "channel", True),
        (33, jnp.float32, "token", "tensor", True),
        (5, jnp.float32, "static", "channel", True),
        (70, jnp.bfloat16, "tensor", "channel", False),
    ],
)
def test_linear_w8a8_pallas_backends_match_xla(m, dtype, act, gran, use_bias):
    """backend="pallas" on CPU runs the reference: identical to "xla". "pallas_interpret" runs the
    kernel: identical without bias in float32; with a bias the add may be FMA-contracted on one side
    only: within ``2**-22 * (|y| + |bias|)`` in float32 (the product's rounding plus one rounding of
    each sum), one bf16 ulp ``2**-7 * (|y| + |bias|)`` in bf16."""
    rng = np.random.default_rng(m)
    k, n = 160, 96
    q = _w8(rng, k, n, per_tensor() if gran == "tensor" else per_channel(1))
    ak = {"token": ActQuantKernel(q), "static": ActQuantKernel(q, act_scale=jnp.float32(0.02)),
          "tensor": ActQuantKernel(q, act_granularity="tensor")}[act]
    assert pallas_unsupported(jnp.zeros((m, k), dtype), ak) is None
    layer = {"kernel": ak}
    if use_bias:
        layer["bias"] = jnp.asarray(rng.standard_normal((n,)), jnp.float32)
    x = _x(rng, m, k, dtype)
    want = jax.jit(lambda x: linear(x, layer, backend="xla"))(x)
    on_cpu = jax.jit(lambda x: linear(x, layer, backend="pallas"))
    assert "pallas" not in on_cpu.lower(x).as_text()
    np.testing.assert_array_equal(np.asarray(on_cpu(x), np.float32), np.asarray(want, np.float32))
    got = linear(x, layer, backend="pallas_interpret")
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    if not use_bias and dtype == jnp.float32:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        return
    bound = np.abs(np.asarray(act_quant_matmul(x, ak), np.float64))
    if use_bias:
        bound = bound + np.abs(np.asarray(layer["bias"], np.float64))[None, :]
    ulp = 2.0**-22 if dtype == jnp.float32 else 2.0**-7
    diff = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    np.testing.assert_array_less(diff, ulp * bound + 1e-30)


def test_linear_pallas_interpret_really_runs_the_kernel():
    rng = np.random.default_rng(0)
    ak = ActQuantKernel(_w8(rng, 64, 32))
    q4 = quantize(jnp.asarray(rng.standard_normal((64, 32)), jnp.float32), QuantSpec(4, False, per_group(0, 32)))
    x = _x(rng, 3, 64)
    for kernel in (ak, q4):
        for backend, runs in (("pallas_interpret", True), ("xla", False)):
            jaxpr = jax.make_jaxpr(lambda x: linear(x, {"kernel": kernel}, backend=backend))(x)
            assert ("pallas_call" in str(jaxpr)) == runs, backend


@pytest.mark.parametrize(
    "m,g,sym,dtype,use_bias",
    [(1, 64, False, jnp.bfloat16, True), (33, 32, True, jnp.bfloat16, False), (5, 128, False, jnp.float32, True)],
)
def test_linear_w4a16_pallas_backends(m, g, sym, dtype, use_bias):
    """W4A16: "pallas" on CPU = pallas_kernels' reference on the QArray's own arrays (bit for bit);
    "pallas_interpret" and "xla" (dequantize, then matmul) both within the kernel's stated bounds of
    the float64 product: ``(K + 4) * 2**-24 * (|x| @ |w_hat|)`` plus one output ulp (bf16 2**-7);
    XLA's bf16 path also rounds the weights to bf16: ``2**-8 * (|x| @ |w_hat|)`` more."""
    rng = np.random.default_rng(m + g)
    k, n = 256, 160
    q = quantize(jnp.asarray(rng.standard_normal((k, n)) + (0.0 if sym else 0.3), jnp.float32),
                 QuantSpec(4, sym, per_group(0, g), scale_dtype="bfloat16" if dtype == jnp.bfloat16 else "float32"))
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    layer = {"kernel": q}
    if use_bias:
        layer["bias"] = jnp.asarray(rng.standard_normal((n,)), dtype)
    assert pallas_unsupported(x, q) is None
    on_cpu = np.asarray(jax.jit(lambda x: linear(x, layer, backend="pallas"))(x), np.float32)
    ref = pk.w4a16_matmul_xla(x, q.values, q.scale, q.zero_point, group_size=g, bias=layer.get("bias"))
    np.testing.assert_array_equal(on_cpu, np.asarray(ref, np.float32))
    xd = np.asarray(x.astype(jnp.float32), np.float64)
    wd = np.asarray(dequantize(q, jnp.float32), np.float64)
    exact, mag = xd @ wd, np.abs(xd) @ np.abs(wd)
    if use_bias:
        b = np.asarray(layer["bias"].astype(jnp.float32), np.float64)
        exact, mag = exact + b[None, :], mag + np.abs(b)[None, :]
    out_ulp = 2.0**-7 if dtype == jnp.bfloat16 else 0.0
    bound = (k + 4) * 2.0**-24 * mag + out_ulp * np.abs(exact)
    got = linear(x, layer, backend="pallas_interpret")
    assert got.dtype == dtype and got.shape == (m, n)
    np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - exact), bound + 1e-30)
    xla = np.asarray(linear(x, layer, backend="xla"), np.float64)
    np.testing.assert_array_less(np.abs(xla - exact), bound + (2.0**-8 if dtype == jnp.bfloat16 else 0.0) * mag + 1e-30)


def test_pallas_uncovered_layouts_fall_back_to_xla():
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((128, 64)), jnp.float32)
    x = _x(rng, 3, 128)
    cases = {
        "group-wise W8A8": (ActQuantKernel(quantize(w, QuantSpec(8, True, per_group(0, 32)))), "weight scales"),
        "asymmetric W8A8": (ActQuantKernel(quantize(w, QuantSpec(8, False, per_channel(1)))), "asymmetric"),
        "full-range activations": (ActQuantKernel(quantize(w, QuantSpec(8, True, per_channel(1))),
                                                   act_full_range=True), "full-range"),
        "W4A8": (ActQuantKernel(quantize(w, QuantSpec(4, True, per_channel(1)))), "packed"),
        "per-channel 4-bit": (quantize(w, QuantSpec(4, True, per_channel(1))), "weight scales"),
        "3-bit": (quantize(w, QuantSpec(3, False, per_group(0, 32))), "3-bit"),
        "8-bit weight-only": (quantize(w, QuantSpec(8, False, per_group(0, 32))), "8-bit"),
        "G/2 < MMA K": (quantize(w, QuantSpec(4, False, per_group(0, 16))), "group size 16"),
        "groups along N": (quantize(w, QuantSpec(4, False, per_group(1, 32))), "input axis"),
        "short last group": (quantize(jnp.asarray(rng.standard_normal((96, 64)), jnp.float32),
                                      QuantSpec(4, False, per_group(0, 64))), "group size 64"),
    }
    for name, (kernel, why) in cases.items():
        xk = x if kernel.shape[0] == 128 else _x(rng, 3, kernel.shape[0])
        reason = pallas_unsupported(xk, kernel)
        assert reason is not None and why in reason, (name, reason)
        for backend in ("pallas_interpret", "pallas"):
            np.testing.assert_array_equal(np.asarray(matmul_2d(xk, kernel, backend=backend)),
                                          np.asarray(matmul_2d(xk, kernel, backend="xla")), err_msg=name)
    assert "no kernel" in pallas_unsupported(x, w)
    assert "2-D" in pallas_unsupported(x.reshape(1, 3, 128), cases["W4A8"][0])


def test_pallas_3d_input_and_bf16_weight_scales():
    rng = np.random.default_rng(2)
    q = _w8(rng, 96, 160, scale_dtype="bfloat16")
    x = _x(rng, 6, 96).reshape(2, 3, 96)
    got = linear(x, {"kernel": ActQuantKernel(q)}, backend="pallas_interpret")
    want = linear(x, {"kernel": ActQuantKernel(q)}, backend="xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("m", [1, 128])
def test_linear_pallas_lowers_to_triton_for_cuda(m):
    """eqjax's adapter inside jax.export(platforms=("cuda",)): the Triton kernels are what lowers."""
    k, n = 512, 256
    q8 = QArray(jnp.zeros((k, n), jnp.int8), jnp.ones((1, n), jnp.float32), None, 8, True, per_channel(1), (k, n))
    q4 = QArray(jnp.zeros((k // 2, n), jnp.uint8), jnp.ones((k // 128, n), jnp.bfloat16),
                jnp.zeros((k // 128, n), jnp.uint8), 4, False, per_group(0, 128), (k, n), jnp.bfloat16)
    bias = jnp.zeros((n,), jnp.bfloat16)
    for kernel, calls in ((ActQuantKernel(q8), 1 if m < pk.tuning.W8A8_FUSED_MAX_M else 2),
                          (ActQuantKernel(q8, act_scale=jnp.float32(0.1)), 1 if m < pk.tuning.W8A8_FUSED_MAX_M else 2),
                          (q4, 1)):
        e = export_for_cuda(lambda x: linear(x, {"kernel": kernel, "bias": bias}, backend="pallas"),
                            S((m, k), jnp.bfloat16))
        assert e.mlir_module().count(TRITON_CUSTOM_CALL) == calls
        assert e.out_avals[0].shape == (m, n) and e.out_avals[0].dtype == jnp.bfloat16


def _zero_w4(k, n):
    g = -(-k // 128)  # a ragged last group where 128 does not divide k (SmolLM2's 576)
    return QArray(jnp.zeros((k // 2, n), jnp.uint8), jnp.ones((g, n), jnp.bfloat16),
                  jnp.zeros((g, n), jnp.uint8), 4, False, per_group(0, 128), (k, n), jnp.bfloat16)


@pytest.mark.parametrize("m,k,n,calls", [(1, 4096, 4096, 1), (128, 4096, 4096, 1), (129, 4096, 4096, 0),
                                         (1024, 4096, 4096, 0), (1, 2048, 8192, 1),
                                         (1, 2048, 2048, 0)])
def test_auto_backend_runs_the_w4a16_kernel_only_where_it_was_measured_faster(m, k, n, calls):
    """backend="auto" lowered for CUDA: the Triton kernel only inside tuning.prefer_kernel's region
    (decode-sized M on >= 4096 x 4096 weights' worth); prefill and smaller matrices stay on XLA."""
    e = export_for_cuda(lambda x: linear(x, {"kernel": _zero_w4(k, n)}, backend="auto"), S((m, k), jnp.bfloat16))
    assert e.mlir_module().count(TRITON_CUSTOM_CALL) == calls


def test_auto_backend_keeps_w8a8_on_xla_and_equals_xla_off_cuda():
    rng = np.random.default_rng(5)
    q8 = _w8(rng, 4096, 256)
    e = export_for_cuda(lambda x: linear(x, {"kernel": ActQuantKernel(q8)}, backend="auto"), S((1, 4096), jnp.bfloat16))
    assert e.mlir_module().count(TRITON_CUSTOM_CALL) == 0  # slower or tied everywhere measured
    x = _x(rng, 3, 4096)
    w4 = quantize(jnp.asarray(rng.standard_normal((4096, 4096)), jnp.float32) * 0.02,
                  QuantSpec(4, False, per_group(0, 128)))
    for kernel in (ActQuantKernel(q8), w4):
        with use_backend("auto"):
            got = jax.jit(lambda x: linear(x, {"kernel": kernel}))(x)
        want = jax.jit(lambda x: linear(x, {"kernel": kernel}, backend="xla"))(x)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_prefer_kernel_table():
    assert pk.tuning.prefer_kernel("w4a16", 16, 8192, 8192)
    assert not pk.tuning.prefer_kernel("w4a16", 16, 2048, 2048)
    assert not pk.tuning.prefer_kernel("w8a8", 1, 4096, 4096)
    with pytest.raises(ValueError, match="kernel kind"):
        pk.tuning.prefer_kernel("w2", 1, 1, 1)


def test_quantized_model_logits_pallas_interpret_equal_xla():
    """A model run by eqjax's evaluator with 4-bit group-32 weights (the W4A16 kernel for every
    plain [in, out] weight): logits with backend pallas_interpret equal backend xla to float32
    rounding, and the kernels did run."""
    from eqjax.core.analysis import analyze
    from eqjax.core.interpret import evaluate
    from eqjax.core.program import trace
    from eqjax.core.pytree import flatten_with_paths
    from eqjax.core.qarray import per_input_group
    from eqjax.core.roles import resolve_granularity, weight_layout
    from tests import zoo

    model, params = zoo.make_eqjax("llama")
    fn = lambda p, t: model.apply(p, t)[0]  # noqa: E731
    (tokens,) = zoo.token_batches(1)[0]
    prog = trace(fn, params, (tokens,))
    an = analyze(prog)
    paths, leaves, _ = flatten_with_paths(params)
    q = dict(zip(paths, leaves))
    spec = QuantSpec(4, False, per_input_group(32))
    n_quantized = 0
    for path, role in an.roles.items():
        if role.kind == "matmul":
            shape = tuple(q[path].shape)
            gran = resolve_granularity(spec.granularity, weight_layout(an, path, shape), shape, path)
            q[path] = quantize(q[path], QuantSpec(4, False, gran), name=path)
            n_quantized += 1
    assert n_quantized >= 4
    run = lambda: jax.jit(lambda pm, t: evaluate(prog, an, pm, [t]))  # noqa: E731
    ref = np.asarray(run()(q, tokens))
    with use_backend("pallas_interpret"):
        jaxpr = str(jax.make_jaxpr(lambda pm, t: evaluate(prog, an, pm, [t]))(q, tokens))
        got = np.asarray(run()(q, tokens))
    assert jaxpr.count("pallas_call") >= n_quantized - 1  # a tied / non-plain head may take XLA
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group", [128, 64, 48])
def test_w8a8_groups_along_flattened_input_axes_equal_the_matrix(group):
    """A weight ``[3, 64, 20]`` contracted over its first two axes, grouped along their flattened 192
    inputs: the integer path gives exactly what the ``[192, 20]`` matrix with groups along axis 0 gives."""
    w = jax.random.normal(jax.random.key(0), (3, 64, 20))
    x2 = jax.random.normal(jax.random.key(1), (5, 192)) * 4.0
    axes = (1,) if 64 % group == 0 else (0, 1)
    k3 = ActQuantKernel(quantize(w, QuantSpec(8, True, per_group(axes, group))), None, 8, "token")
    k2 = ActQuantKernel(quantize(w.reshape(192, 20), QuantSpec(8, True, per_group(0, group))), None, 8, "token")
    np.testing.assert_array_equal(np.asarray(act_quant_matmul(x2, k3, (0, 1), (2,))),
                                  np.asarray(act_quant_matmul(x2, k2, (0,), (1,))))


@given(st.data())
def test_permuted_kernel_is_the_weight_with_its_rows_put_back(data):
    """``PermutedKernel(q, perm)`` stands for ``W[perm[j]] = dequantize(q)[j]``: its linear equals a float64
    matmul with that weight, within float32 rounding of the K-term sums."""
    from eqjax.core.numerics import dequantize_leaf
    from eqjax.core.qarray import PermutedKernel, QArrayError, validate_permuted

    k = data.draw(st.sampled_from([16, 48, 40]), label="k")
    n, m = data.draw(st.integers(1, 9), label="n"), data.draw(st.integers(1, 5), label="m")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    rng = np.random.default_rng(seed)
    q = quantize(jnp.asarray(rng.standard_normal((k, n)), jnp.float32), QuantSpec(4, False, per_group(0, 16)))
    perm = rng.permutation(k)
    pk = validate_permuted(PermutedKernel(q, jnp.asarray(perm, jnp.int32)))
    w = np.zeros((k, n))
    w[perm] = np.asarray(dequantize(q), np.float64)
    np.testing.assert_array_equal(np.asarray(dequantize_leaf(pk), np.float64), w)
    x = rng.standard_normal((m, k))
    want = x @ w
    bound = k * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(w)) + 1e-30
    for y in (linear(jnp.asarray(x, jnp.float32), {"kernel": pk}),
              jax.jit(lambda a, p: linear(a, {"kernel": p}))(jnp.asarray(x, jnp.float32), pk)):
        assert (np.abs(np.asarray(y, np.float64) - want) <= bound).all()
    with pytest.raises(QArrayError, match="not a permutation"):
        validate_permuted(PermutedKernel(q, jnp.asarray(np.r_[perm[1:], perm[1]], jnp.int32)))
