"""The result of ``quantize_model`` on an NNX module is an ``nnx.Module``: NNX's transforms, graph functions,
Orbax and optimizers take it like any other module."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import eqjax
from eqjax.api import QuantizedNNX, QuantizedParam
from eqjax.core.qarray import QArray

D, H, O, B = 64, 128, 16, 4


class Net(nnx.Module):
    """Linear layers in an ``nnx.List``, a norm, and a dropout holding an RNG stream (non-param state)."""

    def __init__(self, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(D, H, rngs=rngs), nnx.Linear(H, O, rngs=rngs)])
        self.norm = nnx.LayerNorm(H, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.relu(self.layers[0](x))
        return self.layers[1](self.drop(self.norm(h), deterministic=True))


@pytest.fixture(scope="module")
def pair():
    model = Net(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (B, D))
    return model, eqjax.quantize_model(model, "w8", example=(x,)), x


def _close(a: jax.Array, b: jax.Array) -> None:
    """Equal up to float32 reassociation: a few ulps of the magnitudes involved."""
    scale = float(jnp.abs(b).max()) + 1.0
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=64 * np.finfo(np.float32).eps * scale)


def test_the_result_is_a_module_with_quantized_variables(pair):
    model, qm, x = pair
    assert isinstance(qm, QuantizedNNX) and isinstance(qm, nnx.Module)
    for layer in qm.model.layers:
        assert isinstance(layer.kernel, QuantizedParam) and isinstance(layer.kernel.get_value(), QArray)
    assert all(isinstance(layer.kernel, nnx.Param) for layer in model.layers)  # the caller's module is untouched
    float_paths = {"/".join(map(str, k)) for k, _ in nnx.to_flat_state(nnx.state(qm, nnx.Param))}
    assert float_paths == {"model/layers/0/bias", "model/layers/1/bias", "model/norm/bias", "model/norm/scale"}
    assert [p for p, _ in qm.report] == ["layers/0/kernel", "layers/1/kernel"]


def test_int8_output_is_within_its_rounding_of_the_float_model(pair):
    """Per-channel int8: each weight moves by at most half a step (absmax / 127 / 2); the output error is
    bounded by the sum over the contraction of |x| times that step, layer by layer (bounded loosely here by
    the float output's scale times the relative step, with the two layers' errors compounding)."""
    model, qm, x = pair
    y, yq = model(x), qm(x)
    rel_step = 1.0 / 127
    assert float(jnp.abs(yq - y).max()) <= 4 * rel_step * float(jnp.abs(y).max()) + 1e-6


def test_nnx_jit_split_merge_and_display(pair):
    _, qm, x = pair
    y = qm(x)
    _close(nnx.jit(lambda m, v: m(v))(qm, x), y)
    graphdef, state = nnx.split(qm)
    _close(nnx.merge(graphdef, state)(x), y)
    nnx.display(qm)


def test_state_saved_and_restored_with_orbax(pair, tmp_path):
    _, qm, x = pair
    ck = ocp.StandardCheckpointer()
    ck.save(tmp_path / "state", nnx.state(qm))
    ck.wait_until_finished()
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: qm))
    restored = nnx.merge(graphdef, ck.restore(tmp_path / "state", abstract))
    assert isinstance(restored.model.layers[0].kernel.get_value(), QArray)
    _close(restored(x), qm(x))


def test_an_optimizer_over_the_float_leaves_trains_them_and_leaves_the_codes(pair):
    model, _, x = pair
    qm = eqjax.quantize_model(model, "w8", example=(x,))
    codes = np.asarray(qm.model.layers[0].kernel.get_value().values)
    opt = nnx.Optimizer(qm, optax.adam(1e-2), wrt=nnx.Param)

    def loss(m: QuantizedNNX) -> jax.Array:
        return jnp.mean(m(x) ** 2)

    before = float(loss(qm))
    for _ in range(3):
        opt.update(qm, nnx.grad(loss, argnums=nnx.DiffState(0, nnx.Param))(qm))
    assert float(loss(qm)) < before
    np.testing.assert_array_equal(np.asarray(qm.model.layers[0].kernel.get_value().values), codes)


def test_params_is_the_pure_dict_for_save_quantized(pair):
    _, qm, _ = pair
    assert isinstance(qm.params["layers"][0]["kernel"], QArray)
    assert set(qm.params) == {"layers", "norm"}
