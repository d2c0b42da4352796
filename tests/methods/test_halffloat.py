"""Float params stored in 16 bits (``+f16`` / ``+bf16``, :mod:`eqjax.methods.halffloat`).

Oracle: the same model run on float params rounded to 16 bits and widened back (a plain ``astype``
round trip), which is what a HalfFloat stands for; bytes against the leaves' own sizes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqjax
from eqjax.core.errors import InputError, RecipeError
from eqjax.core.pytree import flatten, tree_nbytes
from eqjax.core.qarray import HalfFloat, QArray, QArrayError, validate_half
from eqjax.methods.halffloat import HalfFloats
from eqjax.models import LlamaConfig, Model
from eqjax.recipes.apply import quantize
from eqjax.recipes.registry import get_recipe, recipe_from_dict, with_embedding
from eqjax.recipes.types import Recipe
from tests import zoo

TOKENS = np.random.default_rng(3).integers(0, 64, (2, 10)).astype(np.int32)


def _rounded(tree, dtype=jnp.float16):
    """The oracle: every float32 leaf rounded to ``dtype`` and widened back."""
    return jax.tree.map(lambda x: x.astype(dtype).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


@pytest.fixture(scope="module")
def tiny():
    model = Model(LlamaConfig(vocab=64, hidden=64, intermediate=96, n_layers=2, n_heads=4, n_kv_heads=2))
    return model, model.init_params(jax.random.PRNGKey(0))


@pytest.mark.parametrize("kind, dtype", [("f16", jnp.float16), ("bf16", jnp.bfloat16)])
def test_float_model_in_16_bits_is_the_rounded_model(tiny, kind, dtype):
    model, params = tiny
    q = quantize(params, get_recipe(f"fp+{kind}"), model=model)
    leaves = dict(flatten(q))
    assert all(isinstance(v, HalfFloat) and v.values.dtype == dtype and v.dtype == jnp.float32 for v in leaves.values())
    assert tree_nbytes(q) * 2 == tree_nbytes(params)
    got = np.asarray(jax.jit(lambda p: model.apply(p, jnp.asarray(TOKENS))[0])(q))
    want = np.asarray(jax.jit(lambda p: model.apply(p, jnp.asarray(TOKENS))[0])(_rounded(params, dtype)))
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.float32


def test_after_quantization_only_the_float_params_change(tiny):
    model, params = tiny
    base = quantize(params, get_recipe("w4g128-rtn"), model=model)
    q = quantize(params, get_recipe("w4g128-rtn+f16"), model=model)
    for (path, a), (_, b) in zip(flatten(base), flatten(q)):
        if isinstance(a, QArray):
            assert isinstance(b, QArray) and np.array_equal(np.asarray(a.values), np.asarray(b.values)), path
        else:
            assert isinstance(b, HalfFloat) and b.nbytes * 2 == a.nbytes, path
    got = model.apply(q, jnp.asarray(TOKENS))[0]
    want = model.apply(_rounded(base), jnp.asarray(TOKENS))[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)


def test_values_beyond_float16_stay_float32_and_are_reported(tiny):
    model, params = tiny
    params = jax.tree.map(lambda x: x, params)
    params["layers_0"]["attn_norm"]["scale"] = params["layers_0"]["attn_norm"]["scale"].at[3].set(1e5)
    q = quantize(params, Recipe("t", (HalfFloats(),)), model=model)
    assert not isinstance(q["layers_0"]["attn_norm"]["scale"], HalfFloat)  # would be Inf in float16
    assert isinstance(q["layers_1"]["attn_norm"]["scale"], HalfFloat)
    assert np.isfinite(np.asarray(model.apply(q, jnp.asarray(TOKENS))[0])).all()
    qb = quantize(params, Recipe("t", (HalfFloats("bfloat16"),)), model=model)  # bfloat16 has the range
    assert isinstance(qb["layers_0"]["attn_norm"]["scale"], HalfFloat)
    from eqjax.recipes.types import Context

    ctx = Context()
    HalfFloats()({"a": params["layers_0"]["attn_norm"]["scale"]}, ctx)
    assert ctx.report and "kept float32" in ctx.report[0][1] and "65504" in ctx.report[0][1]


def test_linen_and_nnx_models_run_on_half_params():
    net, params, batches = zoo.make_linen()
    qmodel, qparams = eqjax.quantize_model(net, "fp+f16", params=params, calibration=batches)
    assert tree_nbytes(qparams) * 2 == tree_nbytes(params)
    out = qmodel.apply({"params": qparams}, *batches[0])
    np.testing.assert_allclose(out, net.apply({"params": _rounded(params)}, *batches[0]), rtol=0, atol=1e-5)
    module, batches = zoo.make_nnx()
    fn, pd = zoo.nnx_function(module)
    qmod = eqjax.quantize_model(module, "w4g128-rtn+f16", calibration=batches)
    assert np.isfinite(np.asarray(qmod(*batches[0]))).all()
    qmod = eqjax.quantize_model(module, "fp+f16", calibration=batches)
    np.testing.assert_allclose(qmod(*batches[0]), fn(_rounded(pd), *batches[0]), rtol=0, atol=1e-5)


def test_recipe_names_files_and_errors():
    r = get_recipe("w4g128-rtn+emb-int8+f16")
    assert r.name == "w4g128-rtn+emb-int8+f16" and isinstance(r.steps[-1], HalfFloats)
    assert get_recipe("fp+bf16").steps[-1].dtype == "bfloat16"
    with pytest.raises(RecipeError, match=r"\+f16 / \+bf16"):
        get_recipe("fp+f8")
    step = recipe_from_dict({"name": "x", "steps": [{"method": "half", "dtype": "bfloat16", "pattern": "embed/.*"}]}).steps[0]
    assert step == HalfFloats("bfloat16", "embed/.*")
    with pytest.raises(RecipeError, match="dtype"):
        recipe_from_dict({"name": "x", "steps": [{"method": "half", "dtype": "float8"}]})
    with pytest.raises(InputError, match="pattern"):
        HalfFloats(pattern="(")
    # `export-onnx --embedding int8` on a +f16 recipe: the table step goes before the 16-bit step
    r = with_embedding(get_recipe("w4g128-rtn+f16"), "int8")
    assert r.name == "w4g128-rtn+emb-int8+f16" and [type(s).__name__ for s in r.steps] == ["RTN", "RTN", "HalfFloats"]


def test_embedding_option_after_f16_quantizes_the_table(tiny):
    model, params = tiny
    q = quantize(params, with_embedding(get_recipe("w4g128-rtn+f16"), "int8"), model=model)
    assert isinstance(q["embed"]["embedding"], QArray) and isinstance(q["final_norm"]["scale"], HalfFloat)


def test_validator():
    validate_half(HalfFloat(jnp.ones(3, jnp.float16)))
    with pytest.raises(QArrayError, match="float16 or bfloat16"):
        validate_half(HalfFloat(jnp.ones(3, jnp.float32)))
    with pytest.raises(QArrayError, match="wider"):
        validate_half(HalfFloat(jnp.ones(3, jnp.float16), jnp.float16))
    with pytest.raises(QArrayError, match="finite"):
        validate_half(HalfFloat(jnp.array([1.0, np.inf], jnp.float16)), name="p")
