"""Block-wise QAT: lowers every block's output error against the float block, stores QArrays of the format it
started from, zero steps change nothing, the teacher is the float model the recipe started from, the suffixes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqjax.core.errors import RecipeError
from eqjax.core.numerics import dequantize
from eqjax.core.qarray import QArray, validate
from eqjax.methods.blockqat import BlockQAT
from eqjax.models import LlamaConfig, Model
from eqjax.recipes.apply import quantize as run_recipe
from eqjax.recipes.registry import get_recipe, recipe_from_dict
from eqjax.recipes.types import Recipe

CFG = LlamaConfig(vocab=64, hidden=32, intermediate=64, n_layers=2, n_heads=4, n_kv_heads=2)


def _setup():
    model = Model(CFG)
    params = model.init_params(jax.random.key(0), std=0.2)
    toks = np.asarray(jax.random.randint(jax.random.key(1), (16, 16), 0, 64, dtype=jnp.int32))
    return model, params, toks


def _qarrays(tree):
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, QArray))[0]
    return {jax.tree_util.keystr(k): v for k, v in flat if isinstance(v, QArray)}


def test_block_qat_lowers_each_blocks_error_and_keeps_the_format():
    model, params, toks = _setup()
    rtn = get_recipe("w3g128-rtn").steps[0]
    base = run_recipe(params, Recipe("r", (rtn,)), model=model)
    step = BlockQAT(iters=40, lr_scale=3e-2, lr_weight=3e-2)
    q = run_recipe(params, Recipe("b", (rtn, step)), model=model, calibration=toks)
    assert {"layers_0", "layers_1"} <= set(step.blocks), step.blocks  # and the untied head, a block of its own
    assert step.report["blocks"] == len(step.blocks) == step.report["kept"] and step.report["mse_ratio_median"] < 0.8
    for name, r in step.blocks.items():
        assert r["iters"] == 40 and r["kept"] and r["mse_trained"] < r["mse_init"], (name, r)
        assert name == "lm_head/kernel" or r["mse_trained"] < 0.8 * r["mse_init"], (name, r)
    qa, qb = _qarrays(q), _qarrays(base)
    assert qa.keys() == qb.keys() and qa
    for k, v in qa.items():
        assert validate(v) is v
        assert (v.bits, v.granularity, v.values.shape, v.values.dtype, v.scale.dtype, v.nbytes) == (
            qb[k].bits, qb[k].granularity, qb[k].values.shape, qb[k].values.dtype, qb[k].scale.dtype, qb[k].nbytes)
    ev = jax.random.randint(jax.random.key(2), (8, 16), 0, 64, dtype=jnp.int32)
    ref = model.apply(params, ev)[0]
    err = lambda p: float(jnp.mean((model.apply(p, ev)[0] - ref) ** 2))  # noqa: E731
    assert err(q) < err(base)


def test_zero_steps_change_nothing():
    model, params, toks = _setup()
    rtn = get_recipe("w3g128-rtn").steps[0]
    base = run_recipe(params, Recipe("r", (rtn,)), model=model)
    q = run_recipe(params, Recipe("b", (rtn, BlockQAT(iters=0))), model=model, calibration=toks)
    for k, v in _qarrays(q).items():
        np.testing.assert_array_equal(np.asarray(dequantize(v)), np.asarray(dequantize(_qarrays(base)[k])))


def test_the_teacher_is_the_float_model_the_recipe_started_from():
    # Started from the float weights themselves as 8-bit QArrays of a near-lossless grid, the block error
    # is already tiny; a wrong teacher (the quantized block) would report exactly 0.
    model, params, toks = _setup()
    w8 = get_recipe("w8").steps[0]
    step = BlockQAT(iters=1)
    run_recipe(params, Recipe("b", (w8, step)), model=model, calibration=toks)
    for r in step.blocks.values():
        assert 0 < r["mse_init"] < 1e-3, r


def test_needs_the_model_and_data_and_suffix_rules():
    model, params, _ = _setup()
    with pytest.raises(RecipeError, match="needs the model and calibration"):
        run_recipe(params, Recipe("t", (get_recipe("w3g128-rtn").steps[0], BlockQAT())), model=model)
    with pytest.raises(ValueError, match="iters"):
        BlockQAT(iters=-1)
    assert [s.name for s in get_recipe("w3g128-gptq+bqat+qat+emb-int8").steps] == ["gptq", "bqat", "qat",
                                                                                   "embedding-int8"]
    assert [s.name for s in get_recipe("w3g128-rtn+bqat").steps] == ["rtn", "bqat"]
    with pytest.raises(RecipeError, match="misordered"):
        get_recipe("w3g128-rtn+qat+bqat")
    with pytest.raises(RecipeError, match="misordered"):
        get_recipe("w3g128-rtn+emb-int8+bqat")
    with pytest.raises(RecipeError, match="weight-only"):
        get_recipe("w8a8-smoothquant+bqat")
    r = recipe_from_dict({"name": "mine", "steps": [{"method": "rtn", "rules": [{"pattern": ".*", "bits": 4}]},
                                                    {"method": "bqat", "iters": 8, "lr_weight": 1e-3}]})
    assert r.steps[1] == BlockQAT(iters=8, lr_weight=1e-3)
