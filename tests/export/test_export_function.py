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
