"""Misused public API calls end as one InputError naming the argument, before any tracing or calibration:
arguments swapped or of the wrong type, models of another framework, linen params that do not fit the module,
calibration that is not a list of argument tuples. A recipe name is accepted wherever a Recipe is."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqjax
from eqjax.core.errors import InputError
from eqjax.core.qarray import QArray
from eqjax.models import LlamaConfig, Model


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="out")(nn.relu(nn.Dense(16, name="hidden")(x)))


@pytest.fixture(scope="module")
def tiny():
    model = Model(LlamaConfig(vocab=64, hidden=32, intermediate=64, n_layers=1, n_heads=4, n_kv_heads=2))
    return model, model.init_params(jax.random.key(0))


@pytest.fixture(scope="module")
def mlp():
    x = jnp.ones((2, 8))
    return Mlp(), Mlp().init(jax.random.key(0), x), x


def _no_trace(monkeypatch):
    """Fail the test if eqjax starts tracing the model (the error must come first)."""
    import eqjax.recipes.types as recipe_mod

    monkeypatch.setattr(recipe_mod.Context, "_trace", lambda self: pytest.fail("traced before refusing"))


def test_quantize_accepts_a_recipe_name(tiny):
    model, params = tiny
    q = eqjax.quantize(params, "w8", model=model)
    assert isinstance(q["layers_0"]["attn"]["q_proj"]["kernel"], QArray)


@pytest.mark.parametrize("args, match", [
    (lambda p: ("w8", p), r"bad params \(params of eqjax\.quantize.*found str 'w8'"),
    (lambda p: ({}, "w8"), r"bad params.*found an empty dict"),
    (lambda p: (p, {"name": "w8"}), r"bad recipe \(recipe of eqjax\.quantize.*found dict"),
    (lambda p: (p, 8), r"bad recipe.*found int 8"),
    (lambda p: (p, None), r"bad recipe.*found NoneType"),
    (lambda p: (p, "w8+f16+bf16"), r"conflicting recipe suffixes.*'\+f16' and '\+bf16'"),
    (lambda p: (p, ""), r"empty recipe name"),
])
def test_quantize_wrong_arguments(tiny, monkeypatch, args, match):
    model, params = tiny
    _no_trace(monkeypatch)
    with pytest.raises(InputError, match=match):
        eqjax.quantize(*args(params), model=model)


def test_quantize_rule_matching_no_param_names_pattern_and_step(tiny, monkeypatch):
    from eqjax.methods.rtn import RTN
    from eqjax.recipes.registry import weight_rule

    model, params = tiny
    _no_trace(monkeypatch)
    r = eqjax.Recipe("mine", (RTN((weight_rule(4, pattern="decoder/.*"),), name="my-rtn"),))
    with pytest.raises(InputError, match=r"rule matches no parameter \(recipe 'mine', step 0 'my-rtn', pattern "
                                         r"'decoder/\.\*'\)"):
        eqjax.quantize(params, r, model=model)


def test_quantize_ragged_calibration_windows(tiny):
    model, params = tiny
    cal = [np.zeros((1, 16), np.int32), np.zeros((1, 8), np.int32)]
    with pytest.raises(InputError, match="calibration.*different lengths"):
        eqjax.quantize(params, "w4g128-gptq", model=model, calibration=cal)


def test_torch_module_is_refused(tiny, monkeypatch):
    torch = pytest.importorskip("torch")
    _no_trace(monkeypatch)
    lin = torch.nn.Linear(8, 4)
    with pytest.raises(InputError, match=r"unsupported model \(model of eqjax\.quantize_model.*PyTorch module "
                                         r"\(torch\.nn\.modules\.linear\.Linear\)"):
        eqjax.quantize_model(lin, "w8", example=(np.ones((1, 8), np.float32),))
    with pytest.raises(InputError, match=r"unsupported model \(model= of eqjax\.quantize.*PyTorch module"):
        eqjax.quantize(tiny[1], "w8", model=lin)

    class Sub(torch.nn.Module):  # a user's subclass is refused by its base class
        def forward(self, x):
            return x

    with pytest.raises(InputError, match="PyTorch module"):
        eqjax.quantize_model(Sub(), "w8", params={"w": jnp.ones((2, 2))}, example=(jnp.ones((1, 2)),))


@pytest.mark.parametrize("drop, match", [
    (lambda v: {"hidden": v["params"]["hidden"]}, r"params do not fit the module .*out/(bias|kernel)\): expected a "
                                                  r"param of shape .* found it missing"),
    (lambda v: {"hidden": v["params"]["hidden"], "out": {"kernel": jnp.ones((3, 4)), "bias": jnp.ones(4)}},
     r"out/kernel\): expected shape \(16, 4\), found \(3, 4\)"),
])
def test_linen_params_that_do_not_fit_the_module(mlp, monkeypatch, drop, match):
    net, variables, x = mlp
    _no_trace(monkeypatch)
    with pytest.raises(InputError, match=match):
        eqjax.quantize_model(net, "w8", params=drop(variables), calibration=[(x,)])


def test_quantize_model_argument_checks(mlp, monkeypatch):
    net, variables, x = mlp
    _no_trace(monkeypatch)
    with pytest.raises(InputError, match=r"bad recipe \(recipe of eqjax\.quantize_model.*found int 8"):
        eqjax.quantize_model(net, 8, params=variables, calibration=[(x,)])
    with pytest.raises(InputError, match=r"needs params \(params= of eqjax\.quantize_model"):
        eqjax.quantize_model(net, "w8")
    with pytest.raises(InputError, match=r"bad calibration.*iterable of argument tuples.*found ArrayImpl"):
        eqjax.quantize_model(net, "w8", params=variables, calibration=x)
    with pytest.raises(InputError, match=r"bad params \(params of eqjax\.quantize_model.*found str"):
        eqjax.quantize_model(lambda p, a: a, "w8", params="w8", example=(x,))
    with pytest.raises(InputError, match="batch 1 has shapes"):
        eqjax.quantize_model(net, "w8", params=variables, calibration=[(x,), (jnp.ones((3, 8)),)])


def test_a_single_array_example_is_one_argument(mlp):
    net, variables, x = mlp
    qnet, q = eqjax.quantize_model(net, "w8", params=variables, example=x)
    assert isinstance(q["out"]["kernel"], QArray)
    ref = net.apply(variables, x)
    np.testing.assert_allclose(np.asarray(qnet.apply({"params": q}, x)), np.asarray(ref), atol=0.05)
