"""Every kernel entry lowers for CUDA through Triton on this CPU machine (jax.export, platforms=("cuda",)),
on plain arrays (tests/core/test_linear.py exports eqjax's linear with backend="pallas" the same way).

A primitive the Pallas Triton lowering lacks (e.g. ``jnp.round``), a non-power-of-two tile or a
dtype the Triton dot rejects fails here, in CI, instead of on a GPU. Shapes include the tuning
table's decode (split-K) and prefill configurations at LLM sizes: lowering does not depend on the
data, only on shapes, so these cost milliseconds.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import quantize_rows, tuning, w4a16_matmul, w4a16_matmul_pallas, w8a8_matmul, w8a8_matmul_pallas
from pallas_kernels._common import TRITON_CUSTOM_CALL, compiler_params, export_for_cuda

S = jax.ShapeDtypeStruct


def _n_triton_calls(exported) -> int:
    return exported.mlir_module().count(TRITON_CUSTOM_CALL)


@pytest.mark.parametrize("m,k,n", [(1, 4096, 4096), (16, 4096, 11008), (33, 160, 96), (4096, 4096, 4096)])
@pytest.mark.parametrize("act", ["token", "static", "tensor"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_w8a8_entry_lowers_for_cuda(m, k, n, act, dtype):
    kw = {"act_granularity": "tensor"} if act == "tensor" else {}

    def f(x, w, ws, b, *a):
        return w8a8_matmul(x, w, ws, bias=b, act_scale=a[0] if a else None, **kw)

    specs = [S((m, k), dtype), S((k, n), jnp.int8), S((n,), jnp.float32), S((n,), dtype)]
    if act == "static":
        specs.append(S((), jnp.float32))
    e = export_for_cuda(f, *specs)
    prepass = m >= tuning.W8A8_FUSED_MAX_M
    assert _n_triton_calls(e) == (2 if prepass else 1)
    assert e.out_avals[0].shape == (m, n) and e.out_avals[0].dtype == dtype


def test_w8a8_per_tensor_weights_and_split_k_lower():
    blocks = tuning.w8a8_blocks(1, 4096, 4096)
    assert blocks.split_k > 1  # decode uses split-K with these shapes
    e = export_for_cuda(lambda x, w, s: w8a8_matmul(x, w, s), S((1, 4096), jnp.bfloat16),
                        S((4096, 4096), jnp.int8), S((1,), jnp.float32))
    assert _n_triton_calls(e) == 1


def test_w8a8_int8_activations_lower():
    f = lambda q, w, ws, s: w8a8_matmul(q, w, ws, act_scale=s)
    e = export_for_cuda(f, S((8, 512), jnp.int8), S((512, 256), jnp.int8), S((256,), jnp.float32), S((8,), jnp.float32))
    assert _n_triton_calls(e) == 1 and e.out_avals[0].dtype == jnp.float32


@pytest.mark.parametrize("mode", ["fused", "prepass"])
def test_w8a8_int32_output_lowers(mode):
    f = lambda x, w, s: w8a8_matmul_pallas(x, w, s, out_dtype=jnp.int32, mode=mode)
    e = export_for_cuda(f, S((128, 512), jnp.bfloat16), S((512, 256), jnp.int8), S((256,), jnp.float32))
    assert _n_triton_calls(e) >= 1


def test_quantize_rows_lowers():
    e = export_for_cuda(lambda x: quantize_rows(x), S((300, 4096), jnp.bfloat16))
    assert _n_triton_calls(e) == 1
    e = export_for_cuda(lambda x, s: quantize_rows(x, scale=s), S((300, 4096), jnp.float16), S((300,), jnp.float32))
    assert _n_triton_calls(e) == 1


@pytest.mark.parametrize(
    "m,k,n", [(1, 4096, 4096), (16, 4096, 4096), (128, 4096, 11008), (4096, 8192, 8192), (5, 256, 96)]
)
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("g", [32, 128])
def test_w4a16_entry_lowers_for_cuda(m, k, n, sym, g):
    if k % g:
        pytest.skip("group does not divide K")
    specs = [S((m, k), jnp.bfloat16), S((k // 2, n), jnp.uint8), S((k // g, n), jnp.bfloat16), S((n,), jnp.bfloat16)]
    if sym:
        f = lambda x, p, s, b: w4a16_matmul(x, p, s, None, group_size=g, bias=b)
    else:
        f = lambda x, p, s, b, z: w4a16_matmul(x, p, s, z, group_size=g, bias=b)
        specs.append(S((k // g, n), jnp.uint8))
    e = export_for_cuda(f, *specs)
    assert _n_triton_calls(e) == 1
    assert e.out_avals[0].shape == (m, n) and e.out_avals[0].dtype == jnp.bfloat16


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])
def test_w4a16_other_activation_dtypes_lower(dtype):
    f = lambda x, p, s, z: w4a16_matmul(x, p, s, z, group_size=64)
    e = export_for_cuda(f, S((16, 512), dtype), S((256, 256), jnp.uint8), S((8, 256), jnp.float32),
                        S((8, 256), jnp.uint8))
    assert _n_triton_calls(e) == 1 and e.out_avals[0].dtype == dtype


def test_w4a16_explicit_blocks_lower():
    f = lambda x, w, s, z: w4a16_matmul_pallas(x, w, s, z, group_size=128, blocks=tuning.Blocks(64, 64, 64, 2, 4, 3))
    e = export_for_cuda(
        f, S((64, 1024), jnp.bfloat16), S((512, 256), jnp.uint8), S((8, 256), jnp.float32), S((8, 256), jnp.uint8)
    )
    assert _n_triton_calls(e) == 1


@pytest.mark.parametrize("reduce_once", [False, True])
def test_w4a16_gemv_blocks_lower(reduce_once):
    blocks = tuning.Blocks(1, 128, 64, 4, 4, 3, gemv=True, reduce_once=reduce_once)
    f = lambda x, w, s, z: w4a16_matmul_pallas(x, w, s, z, group_size=128, blocks=blocks)
    e = export_for_cuda(
        f, S((1, 1024), jnp.bfloat16), S((512, 256), jnp.uint8), S((8, 256), jnp.bfloat16), S((8, 256), jnp.uint8)
    )
    assert _n_triton_calls(e) == 1 and e.out_avals[0].shape == (1, 256)


def test_gemv_blocks_take_one_row():
    with pytest.raises(ValueError, match="bm=16"):
        tuning.Blocks(16, 64, 64, gemv=True)
    with pytest.raises(ValueError, match="bm=1 "):
        tuning.Blocks(1, 64, 64)
    with pytest.raises(ValueError, match="GEMV blocks only"):
        tuning.Blocks(16, 64, 64, reduce_once=True)


def test_lowering_check_catches_a_missing_primitive():
    """The guard works: jnp.round has no Triton lowering (hence _common.round_half_even)."""

    def kern(x_ref, o_ref):
        o_ref[...] = jnp.round(x_ref[...])

    f = lambda x: pl.pallas_call(kern, out_shape=S((16, 16), jnp.float32), compiler_params=compiler_params(4, 1))(x)
    with pytest.raises(NotImplementedError, match="round"):
        export_for_cuda(f, S((16, 16), jnp.float32))


def test_cpu_lowering_has_no_kernel():
    x = jnp.asarray(np.ones((4, 256)), jnp.bfloat16)
    p, sc = jnp.zeros((128, 128), jnp.uint8), jnp.ones((4, 128), jnp.bfloat16)
    text = jax.jit(lambda x: w4a16_matmul(x, p, sc, None, group_size=64)).lower(x).as_text()
    assert TRITON_CUSTOM_CALL not in text
    w, ws = jnp.zeros((256, 128), jnp.int8), jnp.ones((128,), jnp.float32)
    text = jax.jit(lambda x: w8a8_matmul(x, w, ws)).lower(x).as_text()
    assert TRITON_CUSTOM_CALL not in text


def test_tuning_table_blocks_are_valid():
    for m in (1, 16, 64, 128, 1024, 4096):
        for k in (4096, 8192):
            assert tuning.w8a8_blocks(m, k, k).bk >= 32
            for g in (32, 64, 128):
                assert (g // 2) % tuning.w4a16_blocks(m, k, k, g).bk == 0
