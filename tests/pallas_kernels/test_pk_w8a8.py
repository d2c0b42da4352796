"""W8A8 Pallas kernel under interpret=True against the XLA reference (eqjax.linear).

Tolerances: the int32 accumulator is compared bit for bit; the float epilogue uses the reference's
ops in its order, so without bias the outputs are bitwise equal; with a bias the last add may be
contracted into an FMA by one side and not the other, so float32 outputs agree to 1 ulp of
``|acc * ws * sx| + |bias|`` and bf16 outputs to 1 bf16 ulp of it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqjax.linear import ActQuantKernel, int_matmul, linear, quantize_activations
from eqjax.numerics import QuantSpec, quantize
from eqjax.qarray import per_channel, per_group, per_tensor
from pallas_kernels import dispatch, quantize_rows, tuning, w8a8_matmul, why_not


def _weights(rng, k, n, gran=None, bits=8, scale_dtype="float32"):
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    spec = QuantSpec(bits=bits, symmetric=True, granularity=gran or per_channel(1), scale_dtype=scale_dtype)
    return quantize(w, spec)


def _x(rng, m, k, dtype=jnp.float32, zero_row=True):
    x = rng.standard_normal((m, k)) * rng.uniform(0.1, 5.0, (m, 1))
    if zero_row and m > 2:
        x[1] = 0.0  # a zero row: scale 1, codes 0
    return jnp.asarray(x, dtype)


@pytest.mark.parametrize(
    "m,k,n,mode,blocks",
    [
        (1, 160, 96, "fused", tuning.Blocks(16, 64, 64)),  # M=1; K and N ragged w.r.t. the blocks
        (5, 96, 160, "fused", tuning.Blocks(16, 32, 32, split_k=2)),  # split-K partials
        (33, 160, 96, "prepass", tuning.Blocks(16, 64, 32)),  # ragged M across 3 row blocks
        (33, 256, 160, "auto", None),  # table blocks
    ],
)
def test_int32_accumulator_exact(rng, m, k, n, mode, blocks):
    q = _weights(rng, k, n)
    x = _x(rng, m, k)
    acc = w8a8_matmul(x, q.values, q.scale, out_dtype=jnp.int32, mode=mode, blocks=blocks, interpret=True)
    qx, _ = quantize_activations(x)
    np.testing.assert_array_equal(np.asarray(acc), np.asarray(int_matmul(qx, q.values)))


def test_int32_accumulator_exact_static_scale_clips(rng):
    q = _weights(rng, 160, 96)
    x = _x(rng, 5, 160)
    s = jnp.float32(0.01)  # small: many values clip at +-127
    acc = w8a8_matmul(x, q.values, q.scale, act_scale=s, out_dtype=jnp.int32, mode="fused",
                      blocks=tuning.Blocks(16, 32, 64), interpret=True)
    qx, _ = quantize_activations(x, static_scale=s)
    assert int(jnp.sum(jnp.abs(qx) == 127)) > 50
    np.testing.assert_array_equal(np.asarray(acc), np.asarray(int_matmul(qx, q.values)))


def test_quantize_rows_equals_reference(rng):
    x = _x(rng, 33, 160)
    x = x.at[3, 7].set(0.5 * 127 / 127)  # a few exact ties
    qk, sk = quantize_rows(x, block_m=16, block_k=64, interpret=True)
    qr, sr = quantize_activations(x)
    np.testing.assert_array_equal(np.asarray(qk), np.asarray(qr))
    np.testing.assert_array_equal(np.asarray(sk), np.asarray(sr[:, 0]))
    assert float(sk[1]) == 1.0


def _assert_close_epilogue(got, want, bound, dtype):
    got = np.asarray(got.astype(jnp.float32), np.float64)
    want = np.asarray(want.astype(jnp.float32), np.float64)
    ulp = 2.0**-23 if dtype == jnp.float32 else 2.0**-7
    np.testing.assert_array_less(np.abs(got - want), ulp * np.asarray(bound) + 1e-30)


@pytest.mark.parametrize(
    "m,dtype,act,wgran,use_bias",
    [
        (1, jnp.float32, "token", "channel", False),
        (5, jnp.bfloat16, "token", "channel", True),
        (33, jnp.float32, "token", "tensor", True),
        (5, jnp.float32, "static", "channel", True),
        (33, jnp.bfloat16, "tensor", "channel", False),
    ],
)
def test_linear_pallas_interpret_matches_xla(rng, m, dtype, act, wgran, use_bias):
    k, n = 160, 96
    q = _weights(rng, k, n, per_tensor() if wgran == "tensor" else per_channel(1))
    ak = {
        "token": ActQuantKernel(q),
        "static": ActQuantKernel(q, act_scale=jnp.float32(0.02)),
        "tensor": ActQuantKernel(q, act_granularity="tensor"),
    }[act]
    x = _x(rng, m, k, dtype)
    layer = {"kernel": ak}
    if use_bias:
        layer["bias"] = jnp.asarray(rng.standard_normal((n,)), jnp.float32)
    got = linear(x, layer, backend="pallas_interpret")
    want = linear(x, layer, backend="xla")
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    if not use_bias and dtype == jnp.float32:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        return
    from eqjax.linear import _w8a8_xla

    bound = np.abs(np.asarray(_w8a8_xla(x, ak)))
    if use_bias:
        bound = bound + np.abs(np.asarray(layer["bias"]))[None, :]
    _assert_close_epilogue(got, want, bound, dtype)


def test_3d_input_and_bf16_weight_scale(rng):
    q = _weights(rng, 96, 160, scale_dtype="bfloat16")
    x = _x(rng, 6, 96).reshape(2, 3, 96)
    got = linear(x, {"kernel": ActQuantKernel(q)}, backend="pallas_interpret")
    want = linear(x, {"kernel": ActQuantKernel(q)}, backend="xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_backend_pallas_on_cpu_is_the_xla_path(rng):
    """Without interpret the kernel is chosen at lowering time for CUDA only; on CPU the dispatch
    lowers to the XLA path (same ops; the bias add may or may not be FMA-contracted: 1 ulp)."""
    q = _weights(rng, 160, 96)
    layer = {"kernel": ActQuantKernel(q), "bias": jnp.asarray(rng.standard_normal((96,)), jnp.float32)}
    x = _x(rng, 5, 160)
    got = jax.jit(lambda x: linear(x, layer, backend="pallas"))(x)
    want = jax.jit(lambda x: linear(x, layer, backend="xla"))(x)
    bound = np.abs(np.asarray(want)) + np.abs(np.asarray(layer["bias"]))[None, :]
    _assert_close_epilogue(got, want, bound, jnp.float32)
    assert "pallas" not in jax.jit(lambda x: linear(x, layer, backend="pallas")).lower(x).as_text()


def test_uncovered_layouts_fall_back(rng):
    x = _x(rng, 3, 128)
    w = jnp.asarray(rng.standard_normal((128, 64)), jnp.float32)
    grouped = ActQuantKernel(quantize(w, QuantSpec(bits=8, granularity=per_group(0, 32))))
    asym = ActQuantKernel(quantize(w, QuantSpec(bits=8, symmetric=False, granularity=per_channel(1))))
    packed = ActQuantKernel(quantize(w, QuantSpec(bits=4, granularity=per_channel(1))))
    for k in (grouped, asym, packed):
        assert why_not(x, k) is not None
        assert dispatch(x, k, None, out_dtype=jnp.float32, interpret=True) is None
        np.testing.assert_array_equal(
            np.asarray(linear(x, {"kernel": k}, backend="pallas_interpret")),
            np.asarray(linear(x, {"kernel": k}, backend="xla")),
        )
    # float kernels never reach dispatch; other objects are declined
    assert dispatch(x, w, None, out_dtype=jnp.float32, interpret=True) is None


def test_7bit_weights_are_covered(rng):
    q = _weights(rng, 96, 64, bits=7)
    x = _x(rng, 5, 96)
    assert why_not(x, ActQuantKernel(q)) is None
    got = linear(x, {"kernel": ActQuantKernel(q)}, backend="pallas_interpret")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(linear(x, {"kernel": ActQuantKernel(q)}, backend="xla")))


def test_split_k_float_epilogue_with_bias(rng):
    """Split-K partials are summed and scaled by XLA with the kernel's epilogue ops (dynamic scales
    written by the kernel's first column program)."""
    from eqjax.linear import _w8a8_xla

    q = _weights(rng, 256, 96)
    x = _x(rng, 5, 256)
    bias = jnp.asarray(rng.standard_normal((96,)), jnp.float32)
    got = w8a8_matmul(x, q.values, q.scale, bias=bias, out_dtype=jnp.float32, mode="fused",
                      blocks=tuning.Blocks(16, 64, 32, split_k=3), interpret=True)
    ref = _w8a8_xla(x, ActQuantKernel(q))
    want = ref + bias[None, :]
    _assert_close_epilogue(got, want, np.abs(np.asarray(ref)) + np.abs(np.asarray(bias))[None, :], jnp.float32)
