"""The same linen and NNX models through qwix (the peer) and through eqjax: both quantize W8A8 with a real
int8 x int8 dot; the README counts the user lines of each (this test is the code it counts)."""

import re

import jax
import jax.numpy as jnp
import pytest

import eqjax
from tests import zoo

qwix = pytest.importorskip("qwix")
I8_DOT = r"dot_general.*\(tensor<[0-9x]+xi8>, tensor<[0-9x]+xi8>\)"


def _rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def test_linen_side_by_side():
    net, params, batches = zoo.make_linen()
    x = batches[0][0]
    ref = net.apply({"params": params}, x)
    # qwix (4 lines)
    rules = [qwix.QtRule(module_path=".*", weight_qtype="int8", act_qtype="int8")]
    qnet = qwix.quantize_model(net, qwix.PtqProvider(rules))
    qw_params = qwix.quantize_params(params, jax.eval_shape(qnet.init, jax.random.key(0), x)["params"])
    y_qwix = qnet.apply({"params": qw_params}, x)
    # eqjax (1 line; SmoothQuant needs the calibration batches)
    qmodel, qparams = eqjax.quantize_model(net, "w8a8-smoothquant", params=params, calibration=batches)
    y_eqjax = qmodel.apply({"params": qparams}, x)
    assert _rel(y_qwix, ref) < 0.1 and _rel(y_eqjax, ref) < 0.1
    for f, p in ((lambda p, x: qnet.apply({"params": p}, x), qw_params),
                 (lambda p, x: qmodel.apply({"params": p}, x), qparams)):
        assert re.search(I8_DOT, jax.jit(f).lower(p, x).as_text())


def test_nnx_side_by_side():
    module, batches = zoo.make_nnx()
    ref = module(*batches[0])
    qw = qwix.quantize_model(module, qwix.PtqProvider([qwix.QtRule(module_path=".*", weight_qtype="int8",
                                                                    act_qtype="int8")]), *batches[0])
    qe = eqjax.quantize_model(module, "w8a8-smoothquant", calibration=batches)
    assert _rel(qw(*batches[0]), ref) < 0.1 and _rel(qe(*batches[0]), ref) < 0.1
    assert re.search(I8_DOT, jax.jit(lambda *a: qe(*a)).lower(*batches[0]).as_text())
