"""Rules over param paths, recipes (chain, files, registry), the seed's methods."""

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqjax.linear import ActQuantKernel, linear
from eqjax.methods.rtn import RTN, UnusedRuleWarning, absmax, quantize_by_rules, zero_point, zeroquant
from eqjax.numerics import QuantSpec, dequantize
from eqjax.pytree import tree_nbytes
from eqjax.qarray import QArray, per_channel, per_group
from eqjax.recipe import Recipe, RecipeError, load_recipe, quantize
from eqjax.recipes import get_recipe, recipe_names
from eqjax.rules import Rule, assign


def _params():
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    return {
        "embed": {"embedding": jax.random.normal(k[0], (32, 16))},
        "layers_0": {
            "attn": {"q_proj": {"kernel": jax.random.normal(k[1], (16, 16))}},
            "mlp": {"down_proj": {"kernel": jax.random.normal(k[2], (64, 16)), "bias": jnp.zeros(16)}},
            "attn_norm": {"scale": jnp.ones(16)},
        },
        "layers_1": {"attn": {"q_proj": {"kernel": jax.random.normal(k[3], (16, 16))}}},
    }


def test_first_matching_rule_wins_and_unused_reported():
    rules = (
        Rule(r"layers_0/.*/kernel", None),
        Rule(r".*/kernel", QuantSpec(4, True, per_group(0, 8))),
        Rule(r"decoder/.*", QuantSpec()),
    )
    chosen, unused = assign(_params(), rules)
    assert chosen["layers_0/attn/q_proj/kernel"].weight is None
    assert chosen["layers_1/attn/q_proj/kernel"].weight.bits == 4
    assert "embed/embedding" not in chosen
    assert [r.pattern for r in unused] == ["decoder/.*"]
    with pytest.warns(UnusedRuleWarning, match="decoder"):
        q = quantize_by_rules(_params(), rules)
    assert isinstance(q["layers_1"]["attn"]["q_proj"]["kernel"], QArray)
    assert not isinstance(q["layers_0"]["attn"]["q_proj"]["kernel"], QArray)


def test_seed_methods_and_sizes():
    p = _params()
    fp = tree_nbytes(p)
    for fn in (absmax, zero_point):
        q = fn(p)
        assert isinstance(q["layers_0"]["mlp"]["down_proj"]["kernel"], QArray)
        assert tree_nbytes(q) < fp
    qz = zeroquant(p, bits=8, group_size=8)
    k = qz["layers_0"]["mlp"]["down_proj"]["kernel"]
    assert isinstance(k, ActQuantKernel) and k.weight.granularity == per_group(0, 8)
    x = jnp.ones((2, 64))
    np.testing.assert_allclose(
        np.asarray(linear(x, qz["layers_0"]["mlp"]["down_proj"])),
        np.asarray(x @ p["layers_0"]["mlp"]["down_proj"]["kernel"]),
        atol=0.5,
    )


def test_recipe_chain_is_jit_friendly_pytree():
    r = Recipe("two", (RTN((Rule(r"layers_0/.*", QuantSpec(8, True, per_channel(-1))),)),
                       RTN((Rule(r"layers_1/.*/kernel", QuantSpec(4, False, per_group(0, 4))),))))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnusedRuleWarning)
        q = quantize(_params(), r)
    leaves = jax.tree_util.tree_leaves(q)
    assert all(isinstance(x, jax.Array) for x in leaves)
    out = jax.jit(lambda t: jax.tree.map(lambda a: a, t))(q)
    assert out["layers_1"]["attn"]["q_proj"]["kernel"].bits == 4
    np.testing.assert_allclose(
        np.asarray(dequantize(out["layers_0"]["attn"]["q_proj"]["kernel"])),
        np.asarray(_params()["layers_0"]["attn"]["q_proj"]["kernel"]),
        atol=0.05,
    )


def test_recipe_files_toml_and_json(tmp_path):
    toml = tmp_path / "r.toml"
    toml.write_text(
        'name = "mine"\ndescription = "d"\n[[steps]]\nmethod = "rtn"\n[[steps.rules]]\npattern = ".*/kernel"\n'
        'bits = 4\nsymmetric = false\ngranularity = "group"\ngroup_size = 8\nscale_dtype = "float16"\n'
    )
    r = load_recipe(toml)
    assert r.name == "mine" and r.steps[0].rules[0].weight.bits == 4
    js = tmp_path / "r.json"
    js.write_text(json.dumps({"name": "j", "steps": [{"method": "rtn", "rules": [
        {"pattern": ".*/kernel", "bits": 8, "act_bits": 8}]}]}))
    q = quantize(_params(), load_recipe(js))
    assert isinstance(q["layers_0"]["attn"]["q_proj"]["kernel"], ActQuantKernel)
    assert get_recipe(str(js)).name == "j"


def test_recipe_errors(tmp_path):
    bad = tmp_path / "b.toml"
    bad.write_text('name = "x"\n[[steps]]\nmethod = "nope"\n')
    with pytest.raises(RecipeError, match="unknown step method 'nope'"):
        load_recipe(bad)
    bad.write_text('name = "x"\n[[steps]]\nmethod = "rtn"\n[[steps.rules]]\npattern = "(("\n')
    with pytest.raises(Exception, match="does not compile"):
        load_recipe(bad)
    bad.write_text("name = ")
    with pytest.raises(RecipeError, match="does not parse"):
        load_recipe(bad)
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "missing.toml")
    with pytest.raises(RecipeError, match="unknown recipe 'w9'"):
        get_recipe("w9")


def test_named_recipes_present():
    names = recipe_names()
    for n in ("fp", "w8-absmax", "w8", "w8a8-naive", "w4g128-rtn"):
        assert n in names
    assert get_recipe("fp").steps == ()
