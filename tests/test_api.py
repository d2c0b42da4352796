"""quantize_model on models eqjax did not write: linen, NNX, a plain function, Hugging Face's Flax
models; the user's own call signature; a real int8 matmul in the compiled HLO; nothing silent."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqjax
from eqjax.api import QuantizedLinen, QuantizedNNX, UnquantizedWarning
from eqjax.core.errors import InputError
from eqjax.core.qarray import ActQuantKernel, QArray, is_quantized
from tests import zoo

RECIPES = ["w8", "w8a8-smoothquant", "w4g128-rtn", "w4g128-gptq", "w4g128-awq"]


def _rel_err(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _dequantized(tree):
    """Every quantized leaf replaced by its float value (weight-only oracle)."""
    return jax.tree.map(lambda x: eqjax.dequantize(x.weight if isinstance(x, ActQuantKernel) else x)
                        if is_quantized(x) else x, tree, is_leaf=is_quantized)


def _check(out, ref, float_model_on_dequantized, recipe):
    """Weight-only recipes equal the float model on the dequantized weights; W8A8 is close to float."""
    if "a8" in recipe:
        assert _rel_err(out, ref) < 0.1
    else:
        np.testing.assert_allclose(np.asarray(out), np.asarray(float_model_on_dequantized), rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def linen():
    return zoo.make_linen()


@pytest.mark.parametrize("recipe", RECIPES)
def test_linen_module(linen, recipe):
    net, params, batches = linen
    qmodel, qparams = eqjax.quantize_model(net, recipe, params=params, calibration=batches)
    assert isinstance(qmodel, QuantizedLinen)
    out = qmodel.apply({"params": qparams}, *batches[0])  # the user's own call signature
    ref = net.apply({"params": params}, *batches[0])
    assert out.shape == ref.shape
    _check(out, ref, net.apply({"params": _dequantized(qparams)}, *batches[0]), recipe)
    assert is_quantized(qparams["block_0"]["qkv"]["kernel"]) and is_quantized(qparams["head"]["kernel"])
    assert not is_quantized(qparams["embed"]["embedding"]) and not is_quantized(qparams["block_0"]["norm"]["scale"])
    assert any("block_1/out/kernel" == p for p, _ in qmodel.report)


@pytest.mark.parametrize("recipe", RECIPES)
def test_nnx_module(recipe):
    module, batches = zoo.make_nnx()
    ref = module(*batches[0])
    qmodel = eqjax.quantize_model(module, recipe, calibration=batches)
    assert isinstance(qmodel, QuantizedNNX)
    out = qmodel(*batches[0])
    fn, _ = zoo.nnx_function(module)
    _check(out, ref, fn(_dequantized(qmodel.params), *batches[0]), recipe)
    k = qmodel.params["blocks"][0]["qkv"]["kernel"]
    q = k.weight if isinstance(k, ActQuantKernel) else k
    assert isinstance(q, QArray) and q.shape == (3, 32, 4, 8)  # the fused 4-D kernel, in its own layout


def test_w8a8_compiles_to_an_int8_dot():
    module, batches = zoo.make_nnx()
    qmodel = eqjax.quantize_model(module, "w8a8-smoothquant", calibration=batches)
    lowered = jax.jit(lambda *a: qmodel(*a)).lower(*batches[0])
    stablehlo = lowered.as_text()
    assert re.search(r"dot_general.*\(tensor<[0-9x]+xi8>, tensor<[0-9x]+xi8>\) -> tensor<[0-9x]+xi32>", stablehlo)
    hlo = lowered.compile().as_text()
    assert re.search(r"= s32\[[0-9,]+\]\{[0-9,]+\} dot\(", hlo)  # the integer dot survives XLA's optimizer


def test_plain_function_and_hf_model():
    hm = zoo.make_hf_llama()
    batches = zoo.hf_batches()
    qmodel, qparams = eqjax.quantize_model(hm, "w4g128-gptq", calibration=batches)
    out = qmodel.apply({"params": qparams}, *batches[0]).logits  # HF's output dataclass comes back
    deq = hm.module.apply({"params": _dequantized(qparams)}, *batches[0]).logits
    np.testing.assert_allclose(np.asarray(out), np.asarray(deq), rtol=1e-4, atol=1e-4)
    rng = np.random.default_rng(0)
    p = {"w1": jnp.asarray(rng.normal(size=(16, 32)), jnp.float32), "w2": jnp.asarray(rng.normal(size=(32, 8)), jnp.float32)}
    fn = lambda p, x: jax.nn.relu(x @ p["w1"]) @ p["w2"]  # noqa: E731
    xs = [(jnp.asarray(rng.normal(size=(4, 16)), jnp.float32),) for _ in range(2)]
    qf, qp = eqjax.quantize_model(fn, "w8", params=p, example=xs[0])
    assert isinstance(qp["w1"], QArray) and _rel_err(qf(qp, *xs[1]), fn(p, *xs[1])) < 0.02


def test_clear_errors(linen):
    net, params, batches = linen
    with pytest.raises(InputError, match="needs params"):
        eqjax.quantize_model(net, "w8", calibration=batches)
    with pytest.raises(InputError, match="calibration"):
        eqjax.quantize_model(net, "w8", params=params)
    with pytest.raises(InputError, match="KV cache"):
        eqjax.quantize_model(net, "kv4", params=params, calibration=batches)
    with pytest.raises(InputError, match="cannot quantize a int"):
        eqjax.quantize_model(3, "w8")
    with pytest.raises(InputError, match="quantized nothing"):
        eqjax.quantize_model(lambda p, x: x * p["s"], "w8", params={"s": jnp.ones(3)}, example=(jnp.ones(3),))
    qmodel, qparams = eqjax.quantize_model(net, "w8", params=params, calibration=batches)
    with pytest.raises(InputError, match="mutable"):
        qmodel.apply({"params": qparams}, *batches[0], mutable=["intermediates"])


def test_weights_it_cannot_quantize_are_named():
    p = {"w": jnp.eye(4), "v": jnp.ones((4, 4))}

    def fn(p, x):  # w is a matmul weight but also added elementwise; v is read inside a data-dependent loop
        y = x @ p["w"] + p["w"][0]
        return jax.lax.while_loop(lambda c: jnp.sum(c) < 1e3, lambda c: c @ p["v"] + 1.0, y)

    with pytest.warns(UnquantizedWarning) as rec:
        with pytest.raises(InputError, match="quantized nothing"):
            eqjax.quantize_model(fn, "w8", params=p, example=(jnp.ones((1, 4)),))
    msg = " ".join(str(w.message) for w in rec if issubclass(w.category, UnquantizedWarning))
    assert "w: used by a matmul but also read by" in msg and "v: read inside a while" in msg


def test_same_recipe_same_weights_as_eqjax_model():
    """eqjax's own Llama, quantized through quantize_model (a plain function) and through eqjax.quantize,
    gives bit-identical quantized params: one core for both."""
    model, params = zoo.make_eqjax("llama")
    toks = np.asarray(jax.random.randint(jax.random.key(1), (8, 16), 0, 64), np.int32)
    a = eqjax.quantize(params, eqjax.get_recipe("w4g128-gptq"), model=model, calibration=toks)
    _, b = eqjax.quantize_model(lambda p, t: model.apply(p, t)[0], "w4g128-gptq", params=params,
                                calibration=[(toks,)])
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_linen_nn_scan_blocks_are_iterations():
    """nn.scan stacks the block params [L, ...]: the scan is unrolled, each iteration is a block, GPTQ
    quantizes each slice on its own inputs and the stack is one QArray in its own layout."""
    import flax.linen as nn

    from eqjax.calibration.calibrate import Calibrator

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            h = nn.RMSNorm(name="norm")(x)
            return x + nn.Dense(32, name="down")(jax.nn.gelu(nn.Dense(64, name="up")(h))), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, ids):
            x = nn.Embed(64, 32, name="embed")(ids)
            x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)(name="layers")(x, None)
            return nn.Dense(64, name="head")(x)

    net = Net()
    batches = zoo.token_batches()
    params = net.init(jax.random.key(0), batches[0][0])["params"]
    fn = lambda p, ids: net.apply({"params": p}, ids)  # noqa: E731
    assert [b.name for b in Calibrator.from_model(fn, params, batches).blocks] == [
        "layers[0]", "layers[1]", "layers[2]", "head/kernel"]
    qmodel, qparams = eqjax.quantize_model(net, "w4g128-gptq", params=params, calibration=batches)
    q = qparams["layers"]["up"]["kernel"]
    assert isinstance(q, QArray) and q.shape == (3, 32, 64) and q.scale.shape == (3, 1, 64)
    np.testing.assert_allclose(np.asarray(qmodel.apply({"params": qparams}, *batches[0])),
                               np.asarray(fn(_dequantized(qparams), *batches[0])), rtol=1e-4, atol=1e-4)
