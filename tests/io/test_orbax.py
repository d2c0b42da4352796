"""Orbax save/restore of quantized params: identical logits after a reload, clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqjax.io.orbax import load_quantized, save_quantized
from eqjax.models import LlamaConfig, Model
from eqjax.recipe import quantize
from eqjax.recipes import get_recipe


@pytest.mark.parametrize("name", ["w4g128-rtn", "w8a8-naive", "w3g128-rtn", "w8-absmax"])
def test_reload_gives_identical_logits(tmp_path, name):
    model = Model(LlamaConfig(vocab=64, hidden=64, intermediate=96, n_layers=1, n_heads=2, n_kv_heads=1))
    params = model.init_params(jax.random.PRNGKey(1))
    q = quantize(params, get_recipe(name), model=model)
    save_quantized(tmp_path / "ck", q, recipe=name)
    q2, manifest = load_quantized(tmp_path / "ck")
    assert manifest["recipe"] == name
    assert jax.tree_util.tree_structure(q) == jax.tree_util.tree_structure(q2)
    toks = jnp.arange(12, dtype=jnp.int32).reshape(1, 12) % 64
    a, _ = model.apply(q, toks)
    b, _ = model.apply(q2, toks)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not an eqjax checkpoint"):
        load_quantized(tmp_path)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_text("")
    with pytest.raises(FileExistsError, match="not empty"):
        save_quantized(tmp_path / "x", {"a": jnp.ones(2)})
