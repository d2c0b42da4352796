"""W8A8 on arrays: the Pallas kernel (interpret=True) against its XLA reference, and the reference
against an independent numpy oracle. No eqjax here (tests/core/test_linear.py checks eqjax's adapter and
that the reference is bit-identical to ``eqjax.core.linear.act_quant_matmul``).

Tolerances: int32 accumulators and int8 codes / float32 scales are compared bit for bit; the float
epilogue runs the reference's ops in its order, so without bias float32 outputs are bitwise equal;
with a bias the last add may be FMA-contracted by one side and not the other: float32 outputs agree
to ``2**-22 * (|acc * ws * sx| + |bias|)`` (half an ulp of the product one side skips rounding,
plus one rounding of each sum), bf16 / f16 outputs to one output ulp (2**-7 / 2**-10) of it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pk_oracle import np_quantize as _np_quantize

from pallas_kernels import (
    quantize_rows,
    quantize_rows_xla,
    tensor_scale,
    tuning,
    w8a8_matmul,
    w8a8_matmul_pallas,
    w8a8_matmul_xla,
    w8a8_supports,
)
from pallas_kernels._common import round_half_even


def _weights(rng, k, n, per_tensor=False):
    """int8 codes in [-127, 127] and positive float32 scales ``[N]`` (or ``[1]``)."""
    w = jnp.asarray(rng.integers(-127, 128, (k, n)), jnp.int8)
    s = jnp.asarray(rng.uniform(0.001, 0.05, (1 if per_tensor else n,)), jnp.float32)
    return w, s


def _x(rng, m, k, dtype=jnp.float32, zero_row=True):
    x = rng.standard_normal((m, k)) * rng.uniform(0.1, 5.0, (m, 1))
    if zero_row and m > 2:
        x[1] = 0.0  # a zero row: scale 1, codes 0
    return jnp.asarray(x, dtype)


def _assert_within_ulp(got, want, bound, dtype):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    ulp = {jnp.dtype(jnp.float32): 2.0**-22, jnp.dtype(jnp.bfloat16): 2.0**-7, jnp.dtype(jnp.float16): 2.0**-10}
    ulp = ulp[jnp.dtype(dtype)]
    np.testing.assert_array_less(np.abs(got - want), ulp * np.asarray(bound) + 1e-30)


def test_round_half_even_equals_jnp_round():
    ties = np.arange(-8, 8) + 0.5
    big = np.array([2.0**23 + 1, -(2.0**23) - 1, 2.0**30, 1e38, np.inf, -np.inf])
    near = np.nextafter(np.float32(0.5), np.float32(0)), np.nextafter(np.float32(2.5), np.float32(3))
    x = jnp.asarray(np.concatenate([ties, big, np.asarray(near, np.float64), np.linspace(-3, 3, 97)]), jnp.float32)
    np.testing.assert_array_equal(np.asarray(round_half_even(x)), np.asarray(jnp.round(x)))
    np.testing.assert_array_equal(np.asarray(round_half_even(x)), np.round(np.asarray(x)))


def test_a_product_just_below_a_tie_rounds_down():
    """The case an H200 run found: a bfloat16 row with absmax 11.3125 and an element half of it.
    ``x * fl(1/s)`` is 63.499996 (code 63); ``x / s`` would be exactly 63.5 (code 64). Reference,
    interpreted kernel and oracle all take the documented product."""
    row = np.zeros(64, np.float32)
    row[:3] = [11.3125, 5.65625, -5.65625]
    x = jnp.asarray(row[None, :], jnp.bfloat16)
    qn, _ = _np_quantize(x)
    assert list(qn[0, :3]) == [127, 63, -63]
    for q, _ in (jax.jit(quantize_rows_xla)(x), quantize_rows(x, block_m=16, block_k=64, interpret=True)):
        np.testing.assert_array_equal(np.asarray(q, np.int64), qn)


@pytest.mark.parametrize("given", [False, True])
def test_quantize_rows_reference_equals_numpy(rng, given):
    x = _x(rng, 33, 160)
    x = x.at[3, :4].set(jnp.asarray([0.5, 1.5, -2.5, 127.0]))  # ties once scaled to the row's grid
    scale = jnp.float32(0.02) if given else None
    q, s = quantize_rows_xla(x, scale=scale)
    qn, sn = _np_quantize(x, scale=scale)
    np.testing.assert_array_equal(np.asarray(q, np.int64), qn)
    np.testing.assert_array_equal(np.asarray(s), sn)
    assert q.dtype == jnp.int8 and float(s[1]) == np.float32(0.02 if given else 1.0)


@pytest.mark.parametrize("m,k,dtype,given", [(1, 96, jnp.float32, False), (33, 160, jnp.bfloat16, False),
                                             (5, 300, jnp.float32, True)])
def test_quantize_rows_kernel_equals_reference(rng, m, k, dtype, given):
    x = _x(rng, m, k, dtype)
    scale = jnp.asarray(rng.uniform(0.005, 0.05, (m,)), jnp.float32) if given else None
    qk, sk = quantize_rows(x, scale=scale, block_m=16, block_k=64, interpret=True)
    qr, sr = quantize_rows_xla(x, scale=scale)
    np.testing.assert_array_equal(np.asarray(qk), np.asarray(qr))
    np.testing.assert_array_equal(np.asarray(sk), np.asarray(sr))


def test_reference_equals_numpy_oracle(rng):
    """int32 sums = int64 numpy products of the oracle's codes; float = the same float32 ops."""
    w, ws = _weights(rng, 160, 96)
    x = _x(rng, 7, 160)
    qn, sn = _np_quantize(x)
    acc = np.asarray(w8a8_matmul_xla(x, w, ws, out_dtype=jnp.int32))
    np.testing.assert_array_equal(acc, qn @ np.asarray(w, np.int64))
    y = np.asarray(w8a8_matmul_xla(x, w, ws, out_dtype=jnp.float32))
    want = (acc.astype(np.float32) * np.asarray(ws)[None, :]) * sn[:, None]
    np.testing.assert_array_equal(y, want)


@pytest.mark.parametrize(
    "m,k,n,mode,blocks",
    [
        (1, 160, 96, "fused", tuning.Blocks(16, 64, 64)),  # M=1; K and N ragged w.r.t. the blocks
        (5, 96, 160, "fused", tuning.Blocks(16, 32, 32, split_k=2)),  # split-K partials
        (33, 160, 96, "prepass", tuning.Blocks(16, 64, 32)),  # ragged M across 3 row blocks
        (33, 256, 160, "auto", None),  # table blocks
        (1, 4100, 72, "auto", None),  # decode table blocks with split-K, K not a block multiple
    ],
)
@pytest.mark.parametrize("act", ["token", "tensor", "static"])
def test_kernel_int32_equals_reference(rng, m, k, n, mode, blocks, act):
    w, ws = _weights(rng, k, n)
    x = _x(rng, m, k)
    kw = {"act_granularity": "tensor"} if act == "tensor" else {}
    if act == "static":
        kw["act_scale"] = jnp.float32(0.002)  # small: many codes clip at +-127
    acc = w8a8_matmul_pallas(x, w, ws, out_dtype=jnp.int32, mode=mode, blocks=blocks, interpret=True, **kw)
    want = w8a8_matmul_xla(x, w, ws, out_dtype=jnp.int32, **kw)
    assert acc.dtype == jnp.int32 and acc.shape == (m, n)
    np.testing.assert_array_equal(np.asarray(acc), np.asarray(want))
    if act == "static":
        q, _ = quantize_rows_xla(x, scale=kw["act_scale"])
        assert int(jnp.sum(jnp.abs(q) == 127)) > 10


@pytest.mark.parametrize(
    "m,dtype,act,per_tensor,use_bias,blocks",
    [
        (1, jnp.float32, "token", False, False, tuning.Blocks(16, 64, 64)),
        (5, jnp.bfloat16, "token", False, True, None),
        (33, jnp.float32, "token", True, True, tuning.Blocks(16, 32, 64)),
        (5, jnp.float32, "static", False, True, None),
        (33, jnp.bfloat16, "tensor", False, False, None),
        (5, jnp.float32, "token", False, True, tuning.Blocks(16, 64, 32, split_k=3)),  # XLA epilogue
        (70, jnp.float16, "token", False, True, None),  # prepass by the table
    ],
)
def test_kernel_float_equals_reference(rng, m, dtype, act, per_tensor, use_bias, blocks):
    k, n = 160, 96
    w, ws = _weights(rng, k, n, per_tensor)
    x = _x(rng, m, k, dtype)
    kw = {"act_granularity": "tensor"} if act == "tensor" else {}
    if act == "static":
        kw["act_scale"] = jnp.float32(0.02)
    bias = jnp.asarray(rng.standard_normal((n,)), jnp.float32) if use_bias else None
    got = w8a8_matmul_pallas(x, w, ws, bias=bias, blocks=blocks, interpret=True, **kw)
    want = w8a8_matmul_xla(x, w, ws, bias=bias, **kw)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape == (m, n)
    if not use_bias and dtype == jnp.float32:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        return
    bound = np.abs(np.asarray(w8a8_matmul_xla(x, w, ws, out_dtype=jnp.float32, **kw)))
    if use_bias:
        bound = bound + np.abs(np.asarray(bias))[None, :]
    _assert_within_ulp(got, want, bound, dtype)


def test_int8_activations_with_given_scales(rng):
    w, ws = _weights(rng, 96, 64)
    x = _x(rng, 5, 96)
    q, s = quantize_rows_xla(x)
    got = w8a8_matmul_pallas(q, w, ws, act_scale=s, blocks=tuning.Blocks(16, 32, 32), interpret=True)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(w8a8_matmul_xla(q, w, ws, act_scale=s)))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(w8a8_matmul_xla(x, w, ws)))


def test_entry_interpret_runs_the_kernel_and_plain_runs_the_reference_on_cpu(rng):
    w, ws = _weights(rng, 160, 96)
    x = _x(rng, 5, 160)
    bias = jnp.asarray(rng.standard_normal((96,)), jnp.float32)
    f = jax.jit(lambda x: w8a8_matmul(x, w, ws, bias=bias))
    assert "pallas" not in f.lower(x).as_text()
    want = jax.jit(lambda x: w8a8_matmul_xla(x, w, ws, bias=bias))(x)
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(want))
    got = w8a8_matmul(x, w, ws, bias=bias, interpret=True)
    want = w8a8_matmul_pallas(x, w, ws, bias=bias, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_tensor_scale_is_one_for_zeros():
    assert float(tensor_scale(jnp.zeros((3, 4)), 127)[0]) == 1.0
    np.testing.assert_array_equal(np.asarray(tensor_scale(jnp.asarray([[0.0, -254.0]]), 127)), [2.0])


@pytest.mark.parametrize(
    "args,kw,match",
    [
        (((4, 8), jnp.float32, (8, 3), jnp.int8, (3,)), {}, None),
        (((4, 8), jnp.bfloat16, (8, 3), jnp.int8, (1,)), {"act_scale_shape": ()}, None),
        (((2, 4, 8), jnp.float32, (8, 3), jnp.int8, (3,)), {}, "not 2-D"),
        (((4, 8), jnp.float32, (9, 3), jnp.int8, (3,)), {}, "K=8"),
        (((4, 8), jnp.float32, (8, 3), jnp.uint8, (3,)), {}, "uint8"),
        (((4, 8), jnp.int32, (8, 3), jnp.int8, (3,)), {}, "int32"),
        (((4, 8), jnp.int8, (8, 3), jnp.int8, (3,)), {}, "need their scales"),
        (((4, 8), jnp.float32, (8, 3), jnp.int8, (2,)), {}, "weight scales"),
        (((4, 8), jnp.float32, (8, 3), jnp.int8, (3,)), {"act_scale_shape": (3,)}, "activation scales"),
        (((4, 8), jnp.float32, (8, 3), jnp.int8, (3,)), {"qmax": 32767}, "qmax"),
        (((4, 8), jnp.float32, (8, 3), jnp.int8, (3,)), {"act_granularity": "channel"}, "granularity"),
    ],
)
def test_supports(args, kw, match):
    reason = w8a8_supports(*args, **kw)
    if match is None:
        assert reason is None
    else:
        assert reason is not None and match in reason


def test_unsupported_operands_raise(rng):
    w, ws = _weights(rng, 32, 16)
    x = _x(rng, 3, 32)
    for fn in (w8a8_matmul, w8a8_matmul_xla, w8a8_matmul_pallas):
        with pytest.raises(ValueError, match="uint8"):
            fn(x, w.astype(jnp.uint8), ws)
