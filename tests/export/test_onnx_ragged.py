"""A short last group (input width not a multiple of the group size) in the ONNX exporter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqjax.export.onnx import ExportError, build_model, make_session, onnx_logits
from eqjax.models import LlamaConfig, Model
from eqjax.recipes.apply import quantize
from eqjax.recipes.registry import get_recipe


@pytest.fixture(scope="module")
def tiny():
    m = Model(LlamaConfig(vocab=64, hidden=96, intermediate=160, n_layers=1, n_heads=2, n_kv_heads=1))
    return m, m.init_params(jax.random.PRNGKey(0), std=0.2)


@pytest.mark.parametrize("name", ["w4g128-rtn", "w4g128-rtn-sym"])
def test_int4_short_last_block_matches(tiny, name):
    m, p = tiny
    q = quantize(p, get_recipe(name), model=m)  # 96 = 0 x 128 + 96 and 160 = 128 + 32: short last groups
    toks = np.arange(10, dtype=np.int32).reshape(1, 10)
    a = onnx_logits(make_session(build_model(m, q)), toks)
    b, _ = m.apply(q, jnp.asarray(toks))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-5)


def test_w8a8_short_group_runs_in_eqjax_and_is_refused_by_exporter(tiny):
    m, p = tiny
    q = quantize(p, get_recipe("w8a8-zeroquant"), model=m)  # group 64 on width 96
    b, _ = m.apply(q, jnp.arange(10, dtype=jnp.int32).reshape(1, 10))
    assert np.all(np.isfinite(np.asarray(b)))
    with pytest.raises(ExportError, match="group size 64 must divide the input width 96"):
        build_model(m, q)
