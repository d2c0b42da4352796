"""The W8A8 ONNX lowering computes eqjax's exact int8 x int8 -> int32 sums on every CPU.

onnxruntime (MLAS) runs a u8 x s8 ``MatMulInteger`` on x86-64 CPUs without VNNI with ``vpmaddubsw``,
which adds the products of two adjacent K positions into a saturating int16. The exporter used to feed
``q + 128`` (uint8) x int8 weights; activation codes near +127 (uint8 ~255) against weight pairs near
+-127 then saturate (``2 * 255 * 127 = 64770 > 32767``) and the sums are wrong, on AVX2-only CPUs only.
It now feeds uint8 x uint8 (``q + 128`` and ``w + 128``, zero points 128; ``MatMulInteger`` or
``MatMulIntegerToFloat``, the same MLAS kernels), which MLAS widens to 16 bits (``vpmaddwd``, 32-bit pair
sums): exact everywhere. Weights whose integers lie within +-64 (the ``w7a8`` recipes) keep the fast
u8 x s8 kernel: ``2 * 255 * 64 = 32640`` cannot saturate the int16 pair sums.

* ``test_exporter_int32_sums_are_exact_at_the_int16_pair_limit``: operands at the pair limit through the
  real exporter and onnxruntime, int32 sums checked against numpy's exact integers. It fails with the old
  lowering on a CPU without VNNI (checked under ``qemu-x86_64 -cpu Haswell``, see the opt-in test at the
  end) and passes with the new one on any CPU.
* ``test_saturation_model_*``: a numpy model of both MLAS kernels shows, on any machine, that the old
  operands *would* be wrong there and that the new operand ranges cannot saturate.
"""

import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from eqjax.core.linear import ActQuantKernel, int_matmul, linear
from eqjax.core.numerics import QuantSpec, integer_values, quantize
from eqjax.core.qarray import per_channel, per_group
from eqjax.export.onnx import W8A8_ZERO_POINT, build_model, linear_graph, make_session, w8a8_weight_codes
from eqjax.export.qlower import S8_WEIGHT_LIMIT
from eqjax.models import LlamaConfig, Model
from eqjax.recipes.registry import weight_rule

K, N, GROUP = 256, 24, 64
INT16_MAX = 2**15 - 1


def _extreme_operands(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Activation codes ``q [M, K]`` and weight integers ``w [K, N]`` in [-127, 127] that reach the int16
    pair limit: rows and columns of +-127 (all equal, equal in adjacent pairs, random signs), mixed with
    random values. Every row of ``q`` and every (group, column) block of ``w`` holds a +-127, so the
    float tensors ``q`` and ``w`` quantize to exactly these integers with scale 1."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-127, 128, (10, K))
    q[0], q[1] = 127, -127
    q[2] = np.where(np.arange(K) % 4 < 2, 127, -127)  # adjacent pairs of equal sign
    q[3] = rng.choice([-127, 127], K)
    q[4] = rng.integers(110, 128, K) * rng.choice([-1, 1], K)
    q[5] = np.where(np.arange(K) % 2 == 0, 127, 0)
    w = rng.integers(-127, 128, (K, N))
    w[:, 0], w[:, 1] = 127, -127
    w[:, 2] = np.where(np.arange(K) % 4 < 2, 127, -127)
    w[:, 3] = rng.choice([-127, 127], K)
    w[:, 4] = rng.integers(110, 128, K) * rng.choice([-1, 1], K)
    for r in range(q.shape[0]):
        if np.abs(q[r]).max() < 127:
            q[r, 0] = 127
    for g in range(K // GROUP):
        blk = w[g * GROUP:(g + 1) * GROUP]
        blk[0, np.abs(blk).max(0) < 127] = -127
    return q, w


def _kernels(w: np.ndarray) -> dict:
    wf = jnp.asarray(w, jnp.float32)
    channel = quantize(wf, QuantSpec(8, True, per_channel(-1)))
    group = quantize(wf, QuantSpec(8, True, per_group(0, GROUP)))
    for qa in (channel, group):  # scale 1 everywhere: the weight integers are exactly w
        assert np.all(np.asarray(qa.scale) == 1.0)
        np.testing.assert_array_equal(np.asarray(integer_values(qa)), w)
    return {
        "token": ActQuantKernel(channel, None, 8, "token"),
        "tensor": ActQuantKernel(channel, None, 8, "tensor"),
        "static": ActQuantKernel(channel, jnp.float32(1.0), 8, "token"),
        "zeroquant-group": ActQuantKernel(group, None, 8, "token"),
    }


def _with_int32_sums(m: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """``m`` with every MatMulInteger output added as a graph output (the grouped lowering's int32 sums;
    the others go through MatMulIntegerToFloat, whose float output is checked instead)."""
    names = [n.output[0] for n in m.graph.node if n.op_type == "MatMulInteger"]
    m.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.INT32, None) for n in names)
    return m, names


@pytest.mark.parametrize("kind", ["token", "tensor", "static", "zeroquant-group"])
def test_exporter_int32_sums_are_exact_at_the_int16_pair_limit(kind):
    q, w = _extreme_operands()
    exact = q.astype(np.int64) @ w.astype(np.int64)
    assert np.abs(exact).max() < 2**24  # so a float32 sum equal to it means the integer sum was exact
    # eqjax itself is exact (int32 accumulation)
    np.testing.assert_array_equal(np.asarray(int_matmul(jnp.asarray(q, jnp.int8), jnp.asarray(w, jnp.int8))), exact)
    layer = {"kernel": _kernels(w)[kind]}
    m, names = _with_int32_sums(linear_graph(layer, path=kind))
    x = q.astype(np.float32)  # every row reaches |127|: activation scale 1, codes exactly q
    y, *accs = make_session(m).run(["y", *names], {"x": x})
    if kind == "zeroquant-group":  # [groups, M, N]: one exact sum per group of K
        (acc,) = accs
        ng = K // GROUP
        ref = np.einsum("mgk,gkn->gmn", q.reshape(-1, ng, GROUP).astype(np.int64),
                        w.reshape(ng, GROUP, N).astype(np.int64))
        np.testing.assert_array_equal(acc, ref)
    else:
        assert not accs
    # scales are 1 and every sum is an integer below 2**24: the float output is exact too, and equal
    # to eqjax's W8A8 linear bit for bit
    np.testing.assert_array_equal(y, exact.astype(np.float32))
    np.testing.assert_array_equal(y, np.asarray(linear(jnp.asarray(x), layer)))


def _seven_bit_operands(seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Activation codes as :func:`_extreme_operands` and weight integers in [-63, 63] at the same kind of
    limits (every column holds a +-63, so a 7-bit per-channel quantization has scale 1)."""
    q, w = _extreme_operands(seed)
    w7 = np.clip(w, -63, 63)
    w7[0, np.abs(w7).max(0) < 63] = 63
    return q, w7


@pytest.mark.parametrize("granularity", ["token", "tensor"])
def test_exporter_s8_sums_are_exact_with_7bit_weights(granularity):
    """The u8 x s8 lowering (int8 weights within +-64): exact int32 sums through onnxruntime, on the
    operands that make the int16 pair sums largest (activation codes +127 -> uint8 255)."""
    q, w = _seven_bit_operands()
    wq = quantize(jnp.asarray(w, jnp.float32), QuantSpec(7, True, per_channel(-1)))
    assert np.all(np.asarray(wq.scale) == 1.0)
    np.testing.assert_array_equal(np.asarray(integer_values(wq)), w)
    layer = {"kernel": ActQuantKernel(wq, None, 8, granularity)}
    m = linear_graph(layer, path="w7")
    assert _assert_no_saturating_operands(m) == "s8"
    x = q.astype(np.float32)
    (y,) = make_session(m).run(["y"], {"x": x})
    exact = q.astype(np.int64) @ w.astype(np.int64)
    np.testing.assert_array_equal(y, exact.astype(np.float32))
    np.testing.assert_array_equal(y, np.asarray(linear(jnp.asarray(x), layer)))


@pytest.mark.parametrize("kind", ["token", "tensor"])
def test_exported_zero_rows_give_zeros_not_nan(kind):
    """A zero activation row (per token) or a zero input (per tensor): eqjax scales it by 1, the export by
    the smallest normal float32; both give codes 0 and an output of exactly 0, never NaN."""
    q, w = _extreme_operands()
    layer = {"kernel": _kernels(w)[kind]}
    x = q.astype(np.float32)
    x[1] = 0.0
    if kind == "tensor":
        x[:] = 0.0
    (y,) = make_session(linear_graph(layer, path=kind)).run(["y"], {"x": x})
    ref = np.asarray(linear(jnp.asarray(x), layer))
    assert np.all(np.isfinite(y)) and not np.any(y[1]) and not np.any(ref[1])
    np.testing.assert_array_equal(y, ref)


def _w8a8_matmuls(m: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in m.graph.node if n.op_type in ("MatMulInteger", "MatMulIntegerToFloat")]


def _assert_no_saturating_operands(m: onnx.ModelProto) -> str:
    """Every integer matmul takes a uint8 ``A`` (QuantizeLinear with zero point 128, or a Cast to uint8,
    maybe reshaped) and either a uint8 initializer ``B`` with zero point 128 (u8 x u8: MLAS has no
    saturating kernel for it) or an int8 ``B`` within +-64 with zero point 0 (u8 x s8 whose int16 pair
    sums cannot saturate). Returns ``"u8"`` or ``"s8"``: the weight operand type, one for the whole graph."""
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    producers = {o: n for n in m.graph.node for o in n.output}
    mms = _w8a8_matmuls(m)
    kinds = set()
    assert mms
    for n in mms:
        a, b = n.input[:2]
        azp, bzp = n.input[2:] if n.op_type == "MatMulInteger" else n.input[4:]
        src = producers[a]
        while src.op_type in ("Transpose", "Reshape"):
            src = producers[src.input[0]]
        if src.op_type == "QuantizeLinear":
            zsrc = producers.get(src.input[2])
            z = (numpy_helper.to_array(zsrc.attribute[0].t) if zsrc is not None else inits[src.input[2]])
            assert zsrc is None or zsrc.op_type == "ConstantOfShape"
            assert z.dtype == np.uint8 and np.all(z == W8A8_ZERO_POINT)
        else:
            assert src.op_type == "Cast" and helper.get_attribute_value(src.attribute[0]) == TensorProto.UINT8
        assert inits[azp].dtype == np.uint8 and inits[azp].size == 1
        assert int(inits[azp].reshape(-1)[0]) == W8A8_ZERO_POINT
        kinds.add("u8" if inits[b].dtype == np.uint8 else "s8")
        if inits[b].dtype == np.uint8:
            assert inits[b].min() >= 1  # w + 128 with w in [-127, 127]
            assert inits[bzp].dtype == np.uint8 and int(inits[bzp].reshape(-1)[0]) == W8A8_ZERO_POINT
        else:
            assert inits[b].dtype == np.int8 and np.abs(inits[b].astype(np.int32)).max() <= S8_WEIGHT_LIMIT
            assert inits[bzp].dtype == np.int8 and int(inits[bzp].reshape(-1)[0]) == 0
    assert len(kinds) == 1, kinds
    return kinds.pop()


@pytest.mark.parametrize("bits, kind", [(8, "u8"), (7, "s8")])
def test_exported_graphs_use_no_saturating_operands(bits, kind):
    _, w = _extreme_operands()
    if bits == 8:
        for k in _kernels(w).values():
            assert _assert_no_saturating_operands(linear_graph({"kernel": k})) == "u8"
    model = Model(LlamaConfig(vocab=64, hidden=64, intermediate=128, n_layers=1, n_heads=4, n_kv_heads=2))
    import jax

    from eqjax.methods.rtn import RTN
    from eqjax.recipes.apply import quantize as run_recipe
    from eqjax.recipes.types import Recipe

    params = run_recipe(model.init_params(jax.random.key(0), std=0.1),
                        Recipe("wXa8", (RTN((weight_rule(bits, act_bits=8),)),)), model=model)
    assert _assert_no_saturating_operands(build_model(model, params)) == kind


# ------------------------------------------------------------------ numpy model of the MLAS kernels
def _pairs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``[M, K/2, N]``: a[:, 2j] * b[2j] + a[:, 2j+1] * b[2j+1] (exact, int64)."""
    a = a.astype(np.int64)
    b = b.astype(np.int64)
    return a[:, 0::2, None] * b[None, 0::2] + a[:, 1::2, None] * b[None, 1::2]


def vpmaddubsw_gemm(a_u8: np.ndarray, b_s8: np.ndarray) -> np.ndarray:
    """MLAS u8 x s8 kernel without VNNI: each adjacent K pair summed into a *saturating* int16
    (``vpmaddubsw``), then pairs widened and accumulated in int32 (``vpmaddwd`` by 1, ``vpaddd``)."""
    assert a_u8.dtype == np.uint8 and b_s8.dtype == np.int8
    return np.clip(_pairs(a_u8, b_s8), -(2**15), INT16_MAX).sum(1)


def vpmaddwd_gemm(a_u8: np.ndarray, b_u8: np.ndarray) -> np.ndarray:
    """MLAS u8 x u8 kernel: operands zero-extended to int16 (lossless for 0..255), each adjacent pair of
    products summed into int32 (``vpmaddwd``; at most 2 * 255**2 = 130050), accumulated in int32."""
    assert a_u8.dtype == np.uint8 and b_u8.dtype == np.uint8
    p = _pairs(a_u8, b_u8)
    assert p.max() <= 2 * 255**2 < 2**31
    return p.sum(1)


def mlas_matmul_integer(a, b, a_zp: int, b_zp: int, kernel) -> np.ndarray:
    """``sum((a - a_zp) * (b - b_zp))`` the way MLAS does it: the raw kernel sum, then the zero-point
    terms from row and column sums (exact integers)."""
    k = a.shape[1]
    raw = kernel(a, b)
    return (raw - a_zp * b.astype(np.int64).sum(0)[None] - b_zp * a.astype(np.int64).sum(1)[:, None]
            + k * a_zp * b_zp)


def test_saturation_model_old_lowering_wrong_new_exact():
    q, w = _extreme_operands()
    exact = q.astype(np.int64) @ w.astype(np.int64)
    a = (q + 128).astype(np.uint8)
    old = mlas_matmul_integer(a, w.astype(np.int8), 128, 0, vpmaddubsw_gemm)
    new = mlas_matmul_integer(a, w8a8_weight_codes(_kernels(w)["token"].weight), W8A8_ZERO_POINT,
                              W8A8_ZERO_POINT, vpmaddwd_gemm)
    np.testing.assert_array_equal(new, exact)
    wrong = old != exact
    assert wrong[0, 0] and wrong[0, 2] and wrong.mean() > 0.2, wrong.mean()  # q = +127 rows x +-127 columns
    assert np.abs(old - exact).max() > 10**5
    # the model is right where nothing saturates: codes whose uint8 form is <= 128 (q <= 0)
    qn = -np.abs(q)
    an = (qn + 128).astype(np.uint8)
    np.testing.assert_array_equal(mlas_matmul_integer(an, w.astype(np.int8), 128, 0, vpmaddubsw_gemm),
                                  qn.astype(np.int64) @ w)


def test_saturation_model_s8_weights_within_64_are_exact():
    q, w = _seven_bit_operands()
    a = (q + 128).astype(np.uint8)
    np.testing.assert_array_equal(mlas_matmul_integer(a, w8a8_weight_codes(quantize(
        jnp.asarray(w, jnp.float32), QuantSpec(7, True, per_channel(-1)))), 128, 0, vpmaddubsw_gemm),
        q.astype(np.int64) @ w)
    # the limit itself: full-scale activations against weight pairs of +-64, and one past it saturates
    a = np.full((1, 2), 255, np.uint8)
    for v in (S8_WEIGHT_LIMIT, -S8_WEIGHT_LIMIT):
        b = np.full((2, 1), v, np.int8)
        assert vpmaddubsw_gemm(a, b)[0, 0] == 2 * 255 * v
    assert vpmaddubsw_gemm(a, np.full((2, 1), S8_WEIGHT_LIMIT + 1, np.int8))[0, 0] != 2 * 255 * (S8_WEIGHT_LIMIT + 1)


def test_saturation_model_operand_ranges():
    """Worst cases over the whole operand ranges, not just the test inputs."""
    # old: uint8 activations 1..255 (q + 128) x int8 weights -127..127
    assert 2 * 255 * 127 > INT16_MAX
    # the smallest saturating weight pair for a full-scale activation pair: any |w0 + w1| > 128
    assert 255 * 65 + 255 * 64 > INT16_MAX and 255 * 64 + 255 * 64 <= INT16_MAX
    # new: both operands 0..255, zero-extended to int16 losslessly, pair sums far inside int32; the
    # int32 total of raw products fits for any K below 2**31 / 255**2 (33025; eqjax's sums: 133144)
    assert 255 <= INT16_MAX and 2 * 255**2 < 2**31 - 1
    assert (2**31 - 1) // 255**2 == 33025 and (2**31 - 1) // 127**2 == 133144
    # exhaustively: all 255 x 255 products of one operand pair, and their pair sums, are exact in the model
    a = np.arange(256, dtype=np.uint8)[:, None].repeat(2, 1)
    b = np.arange(256, dtype=np.uint8)[None, :].repeat(2, 0)
    np.testing.assert_array_equal(vpmaddwd_gemm(a, b), 2 * np.outer(np.arange(256), np.arange(256)))


# ------------------------------------------------------------------ opt-in: an emulated AVX2-only CPU
QEMU = shutil.which("qemu-x86_64")


@pytest.mark.skipif(not (QEMU and os.environ.get("EQJAX_QEMU") == "1"),
                    reason="opt-in (EQJAX_QEMU=1): needs qemu-user's qemu-x86_64 (Debian package qemu-user)")
def test_under_qemu_haswell_old_operands_saturate_new_are_exact():
    """Runs onnxruntime on an emulated Haswell (AVX2 + FMA, no AVX-512, no VNNI): first checks the
    emulation really takes the saturating path (u8 x s8 at the pair limit is wrong there), then runs
    this file's exporter tests on it."""
    probe = (
        "import numpy as np, onnxruntime as ort\n"
        "from onnx import helper, TensorProto as T, numpy_helper as nh\n"
        "b = np.full((64, 4), 127, np.int8)\n"
        "g = helper.make_graph([helper.make_node('MatMulInteger', ['a', 'b', 'z'], ['y'])], 'g',\n"
        "    [helper.make_tensor_value_info('a', T.UINT8, [1, 64])], [helper.make_tensor_value_info('y', T.INT32, None)],\n"
        "    initializer=[nh.from_array(b, 'b'), nh.from_array(np.asarray(128, np.uint8), 'z')])\n"
        "m = helper.make_model(g, opset_imports=[helper.make_opsetid('', 21)], ir_version=10)\n"
        "y = ort.InferenceSession(m.SerializeToString(), providers=['CPUExecutionProvider']).run(\n"
        "    None, {'a': np.full((1, 64), 255, np.uint8)})[0]\n"
        "print('SATURATES' if int(y[0, 0]) != 64 * 127 * 127 else 'EXACT')\n"
    )
    run = [QEMU, "-cpu", "Haswell", sys.executable]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run(run + ["-c", probe], capture_output=True, text=True, timeout=600, env=env)
    assert "SATURATES" in out.stdout, out.stdout + out.stderr
    tests = subprocess.run(
        run + ["-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "exporter or exported_graphs"],
        capture_output=True, text=True, timeout=1800, env=env, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-3000:]
