"""export_function: any traced function (here a user's linen module) as an ONNX graph."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqjax


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8)(nn.gelu(nn.Dense(32)(x)))


@pytest.mark.parametrize("recipe", ["fp", "w8"])
def test_user_linen_model_exports_and_matches(tmp_path, recipe):
    """A user's own linen module, quantized by quantize_model, exported through its own ``apply``: the graph
    stores the int8 weights, keeps the batch dimension dynamic and gives the quantized model's outputs."""
    from jax import export as jexport

    from eqjax.export.onnx import export_function, make_session

    net = MLP()
    x = jax.random.normal(jax.random.key(0), (5, 16))
    params = net.init(jax.random.key(1), x)["params"]
    if recipe == "fp":
        qparams, want = params, net.apply({"params": params}, x)
    else:
        qnet, qparams = eqjax.quantize_model(net, recipe, params=params, calibration=[(x,)])
        want = qnet.apply({"params": qparams}, x)
    (b,) = jexport.symbolic_shape("b")
    path = export_function(lambda p, x: net.apply({"params": p}, x), qparams,
                           (jax.ShapeDtypeStruct((b, 16), jnp.float32),), tmp_path / "mlp", input_names=["x"])
    import onnx

    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert bool(ops & {"DequantizeLinear", "MatMulInteger", "MatMulNBits"}) == (recipe != "fp"), ops  # int8 weights
    sess = make_session(path)
    for rows in (5, 2):
        got = sess.run(None, {"x": np.asarray(x[:rows])})[0]
        np.testing.assert_allclose(got, np.asarray(want[:rows]), rtol=0, atol=2e-5)


@pytest.mark.parametrize("rank", [2, 3])
def test_transposed_weight_product_lowers_to_gemm(tmp_path, rank):
    """``x . W^T`` with ``W [N, K]`` as stored (a tied embedding read as the LM head) is one Gemm(transB=1)
    reading W as it is (no Einsum, no transposed copy), with dynamic leading dimensions."""
    import onnx
    from jax import export as jexport

    from eqjax.export.onnx import export_function, make_session

    E = jax.random.normal(jax.random.key(2), (40, 16))
    lead = jexport.symbolic_shape("b, t")[: rank - 1]
    path = export_function(lambda p, x: jnp.einsum("...k,nk->...n", x, p["E"]), {"E": E},
                           (jax.ShapeDtypeStruct((*lead, 16), jnp.float32),), tmp_path / "head", input_names=["x"])
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert "Gemm" in ops and "Einsum" not in ops and "Transpose" not in ops, ops
    sess = make_session(path)
    for shape in ([(3, 16), (1, 16)] if rank == 2 else [(2, 3, 16), (1, 5, 16)]):
        x = np.asarray(jax.random.normal(jax.random.key(len(shape) + shape[0]), shape))
        want = np.einsum("...k,nk->...n", x.astype(np.float64), np.asarray(E, np.float64))
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=0, atol=1e-5)


def test_einsum_layout_model_with_flattened_groups_exports(tmp_path):
    """An einsum linen model (examples/layout_models.py: fused kv, an ``[N, H, D]`` attention output grouped
    along its flattened 192 inputs) quantized with ``w4g128-rtn`` exports through its own ``apply``; the
    graph stores 4-bit blocks and gives the quantized model's logits."""
    import sys
    from pathlib import Path

    import onnx

    from eqjax.export.onnx import export_function, make_session
    from eqjax.models import LlamaConfig, Model

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import layout_models as lm

    cfg = LlamaConfig(vocab=96, hidden=192, intermediate=256, n_layers=1, n_heads=3, n_kv_heads=1, head_dim=64,
                      tie_word_embeddings=True)
    mod, variables = lm.einsum_linen_from_llama(cfg, Model(cfg).init_params(jax.random.key(0), std=0.1))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 16)), jnp.int32)
    qmod, qparams = eqjax.quantize_model(mod, "w4g128-rtn", params=variables, calibration=[(ids,)])
    want = np.asarray(qmod.apply({"params": qparams}, ids))
    path = export_function(lambda p, t: mod.apply({"params": p}, t), qparams, (jax.ShapeDtypeStruct((2, 16), jnp.int32),),
                           tmp_path / "lm", input_names=["ids"])
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count("MatMulNBits") >= 4, sorted(set(ops))
    got = make_session(path).run(None, {"ids": np.asarray(ids)})[0]
    # float32 sums over at most 256 inputs, in another order than XLA's: a few ulps of the largest logit
    np.testing.assert_allclose(got, want, rtol=0, atol=256 * np.finfo(np.float32).eps * np.abs(want).max())
