"""The result of ``quantize_model`` on a linen module is a ``linen.Module``: ``apply`` like the original,
``jax.jit(qmodel.apply)``, and a submodule of a user's larger module."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqjax
from eqjax.api import QuantizedLinen
from eqjax.core.errors import InputError
from eqjax.core.qarray import QArray

D, H, O, B = 64, 128, 16, 4


class MLP(nn.Module):
    def setup(self) -> None:
        self.up, self.down = nn.Dense(H), nn.Dense(O)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(nn.relu(self.up(x)))

    def first(self, x: jax.Array) -> jax.Array:
        return self.up(x)


class Big(nn.Module):
    """A user's model holding the quantized MLP as a submodule, with a float head of its own."""

    net: nn.Module
    qparams: dict

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(4, name="head")(QuantizedLinen(self.net, qparams=self.qparams, name="q")(x))


@pytest.fixture(scope="module")
def quantized():
    net = MLP()
    x = jax.random.normal(jax.random.key(1), (B, D))
    params = net.init(jax.random.key(0), x)["params"]
    qmodel, qparams = eqjax.quantize_model(net, "w8", params=params, example=(x,))
    return net, params, qmodel, qparams, x


def _close(a: jax.Array, b: jax.Array) -> None:
    """Equal up to float32 reassociation: a few ulps of the magnitudes involved."""
    scale = float(jnp.abs(b).max()) + 1.0
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=64 * np.finfo(np.float32).eps * scale)


def test_the_result_is_a_linen_module(quantized):
    _, _, qmodel, _, _ = quantized
    assert isinstance(qmodel, QuantizedLinen) and isinstance(qmodel, nn.Module)
    assert [p for p, _ in qmodel.report] == ["down/kernel", "up/kernel"]


def test_apply_jit_and_method(quantized):
    net, params, qmodel, qparams, x = quantized
    y = qmodel.apply({"params": qparams}, x)
    _close(jax.jit(qmodel.apply)({"params": qparams}, x), y)
    # int8 per channel: half a step of each weight; bounded loosely by the output's scale times the step
    assert float(jnp.abs(y - net.apply({"params": params}, x)).max()) <= 4 / 127 * float(jnp.abs(y).max())
    first = qmodel.apply({"params": qparams}, x, method=MLP.first)
    _close(first, x @ np.asarray(qparams["up"]["kernel"].values, np.float32) * qparams["up"]["kernel"].scale
           + qparams["up"]["bias"])
    with pytest.raises(InputError, match="mutable"):
        qmodel.apply({"params": qparams}, x, mutable=["intermediates"])


def test_a_submodule_of_a_larger_model(quantized):
    net, _, qmodel, qparams, x = quantized
    big = Big(net, qparams)
    variables = big.init(jax.random.key(2), x)
    assert isinstance(variables["params"]["q"]["up"]["kernel"], QArray)
    assert set(variables["params"]) == {"q", "head"}
    y = jax.jit(big.apply)(variables, x)
    head = variables["params"]["head"]
    _close(y, qmodel.apply({"params": qparams}, x) @ head["kernel"] + head["bias"])
    grads = jax.grad(lambda p: jnp.sum(big.apply({"params": p}, x) ** 2), allow_int=True)(variables["params"])
    assert float(jnp.abs(grads["head"]["kernel"]).max()) > 0
