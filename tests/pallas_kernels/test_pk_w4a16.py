"""W4A16 on arrays: the Pallas kernel (interpret=True) against its XLA reference, and both against
a float64 numpy oracle that unpacks the nibbles itself. No eqjax here (tests/core/test_linear.py checks
eqjax's adapter and its packing).

Kernel and reference multiply the activations by the exact integers ``code - zp`` (exact products
in float32 for bf16/f16 activations) and add float32 partial sums; they differ only in summation
order, so with ``mag = |x| @ |w_hat|`` and ``u = 2**-24``:

* float32 outputs: ``|kernel - reference| <= (K + 4) * u * mag`` and the same bound against the
  float64 oracle (first-order float32 summation error of K terms, plus the scale multiply);
* bf16 / f16 outputs: that plus one output ulp, ``2**-7 * |y|`` (bf16) / ``2**-10 * |y|`` (f16).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import tuning, w4a16_matmul, w4a16_matmul_pallas, w4a16_matmul_xla, w4a16_supports

U = 2.0**-24
OUT_ULP = {jnp.dtype(jnp.float32): 0.0, jnp.dtype(jnp.bfloat16): 2.0**-7, jnp.dtype(jnp.float16): 2.0**-10}


def _weights(rng, k, n, g, sym, scale_dtype=jnp.float32):
    """(codes int64 [K, N] in 0..15, packed uint8 [K/2, N], scale [K/G, N], zero point or None)."""
    codes = rng.integers(0 if not sym else 1, 16, (k, n))
    packed = jnp.asarray(codes[0::2] | (codes[1::2] << 4), jnp.uint8)  # even index: low nibble
    scale = jnp.asarray(rng.uniform(0.005, 0.05, (k // g, n)), scale_dtype)
    zp = None if sym else jnp.asarray(rng.integers(0, 16, (k // g, n)), jnp.uint8)
    return codes, packed, scale, zp


def _oracle(x, codes, scale, zp, g):
    """float64 ``x @ w_hat`` and ``|x| @ |w_hat|`` from the unpacked codes."""
    zpv = 8 if zp is None else np.repeat(np.asarray(zp, np.int64), g, axis=0)
    w_hat = (codes - zpv) * np.repeat(np.asarray(jnp.asarray(scale, jnp.float32), np.float64), g, axis=0)
    xd = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    return xd @ w_hat, np.abs(xd) @ np.abs(w_hat)


def _assert_close(got, want, mag, k, dtype):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want, jnp.float32), np.float64) if not isinstance(want, np.ndarray) else want
    bound = (k + 4) * U * mag + OUT_ULP[jnp.dtype(dtype)] * np.abs(want) + 1e-30
    np.testing.assert_array_less(np.abs(got - want), bound)


def test_reference_unpacks_eqjax_layout_and_matches_oracle(rng):
    """The layout: byte [i, n] = code[2i, n] | code[2i+1, n] << 4; a one-hot x reads one code row."""
    k, n, g = 64, 8, 32
    codes, packed, scale, zp = _weights(rng, k, n, g, sym=False)
    x = jnp.eye(k, dtype=jnp.float32)
    y = np.asarray(w4a16_matmul_xla(x, packed, scale, zp, group_size=g), np.float64)
    want, _ = _oracle(x, codes, scale, zp, g)
    np.testing.assert_allclose(y, want, rtol=2 * U, atol=0)


@pytest.mark.parametrize(
    "m,k,n,g,sym,dtype,blocks",
    [
        (1, 256, 96, 64, True, jnp.float32, tuning.Blocks(16, 64, 16, split_k=3)),  # decode, split-K, ragged N
        (5, 160, 160, 32, False, jnp.bfloat16, tuning.Blocks(16, 64, 16)),  # K = 5 groups, N ragged
        (33, 256, 96, 128, False, jnp.float32, None),  # ragged M, table blocks
        (16, 192, 64, 96, True, jnp.bfloat16, tuning.Blocks(16, 32, 16, split_k=2)),  # G/2 = 48 -> bk 16
        (1, 4096, 40, 128, False, jnp.bfloat16, None),  # decode table blocks (split-K), N < BN
        (7, 128, 64, 32, False, jnp.float16, None),
        (1, 256, 96, 64, True, jnp.float32, tuning.Blocks(1, 64, 16, split_k=3, gemv=True)),  # GEMV, split-K, ragged N
        (3, 160, 160, 32, False, jnp.bfloat16, tuning.Blocks(1, 64, 16, gemv=True)),  # GEMV: one program per row
        (2, 4096, 40, 128, False, jnp.bfloat16, tuning.Blocks(1, 64, 64, split_k=4, gemv=True)),
        # GEMV with one pipeline stage (the table's GEMV row) and two K blocks per split
        (1, 512, 96, 64, False, jnp.bfloat16, tuning.Blocks(1, 64, 16, split_k=8, num_stages=1, gemv=True)),
        (1, 512, 96, 64, True, jnp.float16, tuning.Blocks(1, 64, 16, split_k=8, gemv=True)),
        # GEMV summing its [bk, bn] partial over K once per program: split-K, ragged N, two rows
        (1, 256, 96, 64, False, jnp.float32, tuning.Blocks(1, 64, 16, split_k=3, gemv=True, reduce_once=True)),
        (2, 4096, 40, 128, True, jnp.bfloat16, tuning.Blocks(1, 64, 64, gemv=True, reduce_once=True)),
    ],
)
@pytest.mark.parametrize("use_bias", [False, True])
def test_kernel_equals_reference_and_oracle(rng, m, k, n, g, sym, dtype, blocks, use_bias):
    codes, packed, scale, zp = _weights(rng, k, n, g, sym, jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    bias = jnp.asarray(rng.standard_normal((n,)), dtype) if use_bias else None
    got = w4a16_matmul_pallas(x, packed, scale, zp, group_size=g, bias=bias, blocks=blocks, interpret=True)
    ref = w4a16_matmul_xla(x, packed, scale, zp, group_size=g, bias=bias)
    assert got.shape == ref.shape == (m, n) and got.dtype == ref.dtype == dtype
    exact, mag = _oracle(x, codes, scale, zp, g)
    if use_bias:
        exact = exact + np.asarray(jnp.asarray(bias, jnp.float32), np.float64)[None, :]
        mag = mag + np.abs(np.asarray(jnp.asarray(bias, jnp.float32), np.float64))[None, :]
    _assert_close(got, ref, mag, k, dtype)
    # against float64: both roundings to the output dtype count (half an ulp each way)
    _assert_close(ref, exact, mag, k, dtype)
    _assert_close(got, exact, mag, k, dtype)


def test_float32_out_of_bf16_activations(rng):
    codes, packed, scale, zp = _weights(rng, 128, 64, 32, sym=False)
    x = jnp.asarray(rng.standard_normal((3, 128)), jnp.bfloat16)
    got = w4a16_matmul_pallas(x, packed, scale, zp, group_size=32, out_dtype=jnp.float32, interpret=True)
    ref = w4a16_matmul_xla(x, packed, scale, zp, group_size=32, out_dtype=jnp.float32)
    assert got.dtype == ref.dtype == jnp.float32
    exact, mag = _oracle(x, codes, scale, zp, 32)
    _assert_close(got, ref, mag, 128, jnp.float32)
    _assert_close(ref, exact, mag, 128, jnp.float32)


def test_entry_interpret_runs_the_kernel_and_plain_runs_the_reference_on_cpu(rng):
    _, packed, scale, zp = _weights(rng, 256, 96, 64, sym=False)
    x = jnp.asarray(rng.standard_normal((5, 256)), jnp.bfloat16)
    f = jax.jit(lambda x: w4a16_matmul(x, packed, scale, zp, group_size=64))
    assert "pallas" not in f.lower(x).as_text()
    ref = jax.jit(lambda x: w4a16_matmul_xla(x, packed, scale, zp, group_size=64))(x)
    np.testing.assert_array_equal(np.asarray(f(x), np.float32), np.asarray(ref, np.float32))
    got = w4a16_matmul(x, packed, scale, zp, group_size=64, interpret=True)
    want = w4a16_matmul_pallas(x, packed, scale, zp, group_size=64, interpret=True)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize(
    "args,kw,match",
    [
        (((4, 64), jnp.bfloat16, (32, 8), jnp.uint8, (2, 8), None), {"group_size": 32}, None),
        (((4, 64), jnp.float32, (32, 8), jnp.uint8, (1, 8), (1, 8)), {"group_size": 64}, None),
        (((4, 64), jnp.int8, (32, 8), jnp.uint8, (2, 8), None), {"group_size": 32}, "int8"),
        (((2, 4, 64), jnp.float32, (32, 8), jnp.uint8, (2, 8), None), {"group_size": 32}, "not 2-D"),
        (((4, 64), jnp.float32, (32, 8), jnp.uint8, (4, 8), None), {"group_size": 16}, "group size 16"),
        (((4, 96), jnp.float32, (48, 8), jnp.uint8, (2, 8), None), {"group_size": 64}, "group size 64"),
        (((4, 64), jnp.float32, (64, 8), jnp.uint8, (2, 8), None), {"group_size": 32}, "packed codes"),
        (((4, 64), jnp.float32, (32, 8), jnp.int8, (2, 8), None), {"group_size": 32}, "int8"),
        (((4, 64), jnp.float32, (32, 8), jnp.uint8, (2, 1), None), {"group_size": 32}, "scales"),
        (((4, 64), jnp.float32, (32, 8), jnp.uint8, (2, 8), (1, 8)), {"group_size": 32}, "zero points"),
        (((4, 64), jnp.float32, (32, 8), jnp.uint8, (2, 8), (2, 8)),
         {"group_size": 32, "zero_point_dtype": jnp.int32}, "zero points are int32"),
    ],
)
def test_supports(args, kw, match):
    reason = w4a16_supports(*args, **kw)
    if match is None:
        assert reason is None
    else:
        assert reason is not None and match in reason


def test_unsupported_operands_raise(rng):
    _, packed, scale, zp = _weights(rng, 64, 16, 16, sym=False)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    for fn in (w4a16_matmul, w4a16_matmul_xla, w4a16_matmul_pallas):
        with pytest.raises(ValueError, match="group size 16"):
            fn(x, packed, scale, zp, group_size=16)
