"""Rules select params by role and name; recipes chain steps, load from files, refuse bad input."""

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqjax.core.errors import InputError, RecipeError, RuleError
from eqjax.core.linear import linear
from eqjax.core.numerics import QuantSpec, dequantize
from eqjax.core.pytree import tree_nbytes
from eqjax.core.qarray import ActQuantKernel, QArray, per_channel, per_group
from eqjax.methods.rtn import RTN, UnusedRuleWarning, absmax_rule, quantize_by_rules, zero_point_rule, zeroquant_rule
from eqjax.recipes.apply import quantize
from eqjax.recipes.registry import get_recipe, load_recipe, recipe_from_dict, recipe_names
from eqjax.recipes.rules import Rule, assign, rule_from_dict
from eqjax.recipes.schema import SchemaError
from eqjax.recipes.types import Recipe
from tests import zoo


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


def _flat(tree):
    from eqjax.core.pytree import flatten_with_paths

    paths, leaves, _ = flatten_with_paths(tree)
    return dict(zip(paths, leaves))


@pytest.fixture(scope="module")
def tiny():
    model, params = zoo.make_eqjax("llama")
    return model, params


def test_first_matching_rule_wins_and_unused_reported():
    rules = (
        Rule(r"layers_0/.*/kernel", None),
        Rule(r".*/kernel", QuantSpec(4, True, per_group(0, 8))),
        Rule(r"decoder/.*", QuantSpec()),
    )
    flat = _flat(_params())
    chosen, unused = assign(flat, rules)
    assert chosen["layers_0/attn/q_proj/kernel"].weight is None
    assert chosen["layers_1/attn/q_proj/kernel"].weight.bits == 4
    assert "embed/embedding" not in chosen
    assert [r.pattern for r in unused] == ["decoder/.*"]
    with pytest.warns(UnusedRuleWarning, match="decoder"):
        q = quantize_by_rules(flat, rules)
    assert isinstance(q["layers_1/attn/q_proj/kernel"], QArray)
    assert not isinstance(q["layers_0/attn/q_proj/kernel"], QArray)


def test_role_rules_need_the_model_and_skip_norms(tiny):
    model, params = tiny
    with pytest.raises(InputError, match="needs the model"):
        quantize(params, get_recipe("w8"))
    q = quantize(params, get_recipe("w8"), model=model)
    assert isinstance(q["layers_0"]["attn"]["q_proj"]["kernel"], QArray)
    assert not isinstance(q["layers_0"]["attn_norm"]["scale"], QArray)
    assert not isinstance(q["embed"]["embedding"], QArray)  # the tied table (embedding role) stays float
    assert q["layers_0"]["mlp"]["down_proj"]["kernel"].granularity == per_channel(1)  # output channels


def test_name_rule_matching_a_norm_is_a_clear_error(tiny):
    model, params = tiny
    r = Recipe("bad", (RTN((Rule(r".*scale", QuantSpec(8, True, per_channel(0))),)),))
    with pytest.raises(InputError, match=r"_norm/scale: rule .* not a matmul weight"):
        quantize(params, r, model=model)


def test_second_rtn_over_quantized_weights_is_an_error(tiny):
    model, params = tiny
    r = Recipe("twice", get_recipe("w8").steps + get_recipe("w4g128-rtn").steps)
    with pytest.raises(InputError, match="already quantized"):
        quantize(params, r, model=model)


def test_seed_methods_and_sizes(tiny):
    model, params = tiny
    fp = tree_nbytes(params)
    for rule in (absmax_rule(), zero_point_rule()):
        q = quantize(params, Recipe("s", (RTN((rule,)),)), model=model)
        assert isinstance(q["layers_0"]["mlp"]["down_proj"]["kernel"], QArray)
        assert tree_nbytes(q) < fp
    qz = quantize(params, Recipe("zq", (RTN((zeroquant_rule(8, 16),)),)), model=model)
    k = qz["layers_0"]["mlp"]["down_proj"]["kernel"]
    assert isinstance(k, ActQuantKernel) and k.weight.granularity == per_group(0, 16)
    x = jax.random.normal(jax.random.key(3), (2, 64))
    np.testing.assert_allclose(np.asarray(linear(x, qz["layers_0"]["mlp"]["down_proj"])),
                               np.asarray(x @ params["layers_0"]["mlp"]["down_proj"]["kernel"]), atol=0.05)


def test_recipe_output_is_a_jit_friendly_pytree():
    r = Recipe("two", (RTN((Rule(r"layers_0/.*/kernel", QuantSpec(8, True, per_channel(-1))),)),
                       RTN((Rule(r"layers_1/.*/kernel", QuantSpec(4, False, per_group(0, 4))),))))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnusedRuleWarning)
        q = quantize(_params(), r)
    assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(q))
    out = jax.jit(lambda t: jax.tree.map(lambda a: a, t))(q)
    assert out["layers_1"]["attn"]["q_proj"]["kernel"].bits == 4
    np.testing.assert_allclose(np.asarray(dequantize(out["layers_0"]["attn"]["q_proj"]["kernel"])),
                               np.asarray(_params()["layers_0"]["attn"]["q_proj"]["kernel"]), atol=0.05)


def test_recipe_files_toml_and_json(tmp_path, tiny):
    model, params = tiny
    toml = tmp_path / "r.toml"
    toml.write_text(
        'name = "mine"\ndescription = "d"\n[[steps]]\nmethod = "rtn"\n[[steps.rules]]\npattern = ".*"\nrole = "matmul"\n'
        'bits = 4\nsymmetric = false\ngranularity = "group"\ngroup_size = 8\nscale_dtype = "float16"\n'
    )
    r = load_recipe(toml)
    assert r.name == "mine" and r.steps[0].rules[0].weight.bits == 4
    js = tmp_path / "r.json"
    js.write_text(json.dumps({"name": "j", "steps": [{"method": "rtn", "rules": [
        {"pattern": ".*/kernel", "bits": 8, "act_bits": 8}]}]}))
    q = quantize(params, load_recipe(js), model=model)
    assert isinstance(q["layers_0"]["attn"]["q_proj"]["kernel"], ActQuantKernel)
    assert get_recipe(str(js)).name == "j"


@pytest.mark.parametrize("entry, match", [
    ({"pattern": ".*", "symmetric": "false"}, r"rule.symmetric\): expected true or false.*found str 'false'"),
    ({"pattern": ".*", "bits": 4.7}, r"rule.bits\): expected an integer in 2..8, found float 4.7"),
    ({"pattern": ".*", "bits": True}, r"rule.bits\): expected an integer in 2..8, found bool True"),
    ({"pattern": ".*", "granularity": "group"}, r"rule.group_size\): expected a group size"),
    ({"pattern": ".*", "granularity": "group", "group_size": 0}, r"rule.group_size\): expected an integer in 1..65536"),
    ({"pattern": ".*", "skip": True, "bits": 4}, "skip"),
    ({"pattern": ".*", "colour": 1}, "colour"),
    ({"pattern": ".*", "role": "norm"}, r"rule.role\): expected one of"),
    ({"pattern": ".*", "granularity": "tensor", "axis": 0}, "no axis with granularity = 'tensor'"),
])
def test_rule_values_are_typed_not_coerced(entry, match):
    with pytest.raises(RuleError, match=match):
        rule_from_dict(entry)


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


@pytest.mark.parametrize("kind", ["int8", "int4", "w7a8"])
def test_embedding_suffix_quantizes_the_table_for_any_recipe(tiny, kind):
    """``<recipe>+emb-int8|int4|w7a8``: the recipe's own steps, then the embedding table (and so a tied
    head) quantized; every other param exactly as the plain recipe leaves it; fewer bytes. ``w7a8``: 7-bit
    integers per row, and the tied head's activations int8 per token (an ActQuantKernel)."""
    model, params = tiny
    plain = quantize(params, get_recipe("w4g128-rtn"), model=model)
    r = get_recipe(f"w4g128-rtn+emb-{kind}")
    assert r.name == f"w4g128-rtn+emb-{kind}" and len(r.steps) == len(get_recipe("w4g128-rtn").steps) + 1
    q = quantize(params, r, model=model)
    fp, fq, fe = _flat(params), _flat(plain), _flat(q)
    emb = [p for p in fp if "embed" in p]
    assert emb
    for p in fp:
        if p in emb:
            assert isinstance(fe[p], QArray) and fe[p].bits == {"int8": 8, "int4": 4, "w7a8": 7}[kind]
            # round to nearest on the table: every element within half a step of the float value, the step
            # from the float table itself (int8: absmax / 127 per row; int4: (max - min) / 15 per 32 columns)
            w = np.asarray(fp[p], np.float64)
            err = np.abs(np.asarray(dequantize(fe[p]), np.float64) - w)
            if kind != "int4":
                step = np.abs(w).max(1, keepdims=True) / (127 if kind == "int8" else 63) + 0 * w
            else:
                g = w.reshape(w.shape[0], -1, 32)
                step = np.repeat((g.max(2) - g.min(2)) / 15, 32, axis=1)
            assert np.all(err <= 0.5 * step * (1 + 2e-3) + 1e-7), (err / step).max()
        else:
            assert type(fe[p]) is type(fq[p])
    assert tree_nbytes(q) < tree_nbytes(plain)
    with pytest.raises(RecipeError, match="int8, int4"):
        get_recipe("w4g128-rtn+emb-int3")


def test_embedding_w7a8_quantizes_a_tied_heads_activations():
    """``+emb-w7a8`` on a tied model: the table is an ActQuantKernel (7-bit rows, int8 per-token
    activations at the head) and the logits equal a float64 oracle of that head: the final normed hidden
    state (the float body over the dequantized table), quantized per token (absmax / 127, half to even),
    times the 7-bit integers, times both scales."""
    from eqjax.core.numerics import integer_values
    from eqjax.models import LlamaConfig, Model
    from eqjax.models.llama import rms_norm

    cfg = LlamaConfig(vocab=64, hidden=32, intermediate=64, n_layers=1, n_heads=4, n_kv_heads=2, tie_word_embeddings=True)
    model = Model(cfg)
    params = model.init_params(jax.random.key(1), std=0.1)
    q = quantize(params, get_recipe("fp+emb-w7a8"), model=model)
    leaf = q["embed"]["embedding"]
    assert isinstance(leaf, ActQuantKernel) and leaf.act_bits == 8 and leaf.weight.bits == 7
    iv = np.asarray(integer_values(leaf.weight), np.float64)  # [V, D]
    assert np.abs(iv).max() <= 63
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 9)))
    p2 = dict(params, embed={"embedding": dequantize(leaf.weight)})
    pos = model.positions(2, 9, 0)
    h = model.embed(p2, ids, pos)
    for i, name in enumerate(model.layer_names):
        h, _ = model.block(p2[name], h, pos, layer_index=i)
    x = np.asarray(rms_norm(h, p2["final_norm"]["scale"], cfg.rms_norm_eps), np.float64)
    sx = np.abs(x).max(-1, keepdims=True) / 127
    ws = np.asarray(leaf.weight.scale, np.float64).reshape(1, 1, -1)
    oracle = (np.round(x / sx) @ iv.T) * sx * ws
    got = np.asarray(model.apply(q, ids)[0], np.float64)
    np.testing.assert_allclose(got, oracle, rtol=1e-5, atol=1e-5 * np.abs(oracle).max())
    # not the weight-only head: the int8 activations move the logits
    assert np.abs(got - x @ (iv * ws[0, 0][:, None]).T).max() > 1e-4 * np.abs(oracle).max()


@pytest.mark.parametrize("name, match", [
    ("w8+f16+bf16", r"conflicting recipe suffixes \(recipe 'w8\+f16\+bf16'\).*'\+f16' and '\+bf16'"),
    ("w8+f16+f16", r"repeated recipe suffix.*'\+f16' twice"),
    ("w8+emb-int8+emb-int4", r"conflicting recipe suffixes.*'\+emb-int8' and '\+emb-int4'"),
    ("w8+emb-int8+emb-int8+f16", r"repeated recipe suffix.*'\+emb-int8' twice"),
    ("w8+f16+emb-int8", r"misordered recipe suffixes.*'\+f16' before '\+emb-int8'"),
    ("w8+f17", r"unknown recipe suffix.*'\+f17'"),
    ("w8+", r"unknown recipe suffix.*'\+'"),
    ("", r"empty recipe name"),
    ("w9+f16", r"unknown recipe 'w9\+f16'"),
])
def test_recipe_suffixes_refused(name, match):
    with pytest.raises(RecipeError, match=match):
        get_recipe(name)


def test_recipe_suffixes_accepted_and_applied_once(tmp_path):
    from eqjax.methods.halffloat import HalfFloats

    r = get_recipe("w8+emb-int8+bf16")
    assert r.name == "w8+emb-int8+bf16" and [s.name for s in r.steps] == ["rtn", "embedding-int8", "half-floats"]
    assert sum(isinstance(s, HalfFloats) for s in r.steps) == 1
    f = tmp_path / "a+b" / "r.toml"  # a '+' in a directory name is part of the path, not a suffix
    f.parent.mkdir()
    f.write_text('name = "mine"\n[[steps]]\nmethod = "rtn"\n[[steps.rules]]\npattern = ".*"\nrole = "matmul"\n')
    assert get_recipe(str(f)).name == "mine"
    assert get_recipe(f"{f}+f16").name == "mine+f16"
    with pytest.raises(RecipeError, match="conflicting embedding options"):
        from eqjax.recipes.registry import with_embedding

        with_embedding(get_recipe("w8+emb-int4"), "int8")


def test_rules_that_select_nothing_are_errors_naming_pattern_and_step(tiny):
    model, params = tiny
    spec = QuantSpec(8, True, per_channel(-1))
    typo = Recipe("typo", (RTN((Rule(r"decoder/.*", spec),), name="mine"),))
    with pytest.raises(RecipeError, match=r"rule matches no parameter \(recipe 'typo', step 0 'mine', pattern "
                                          r"'decoder/\.\*'\)"):
        quantize(params, typo, model=model)
    shadowed = Recipe("s", (RTN((Rule(".*", QuantSpec(8, True, per_channel(-1)), role="matmul"),
                                 Rule(r"layers_0/.*", QuantSpec(4, True, per_channel(-1)), role="matmul"))),))
    with pytest.raises(InputError, match=r"rule is shadowed \(step 'rtn', rule 'layers_0/\.\*'\).*earlier rule '\.\*'"):
        quantize(params, shadowed, model=model)
    only_skip = Recipe("skip", (RTN((Rule(".*", None),)),))
    with pytest.raises(RecipeError, match=r"recipe quantized nothing \(recipe 'skip'"):
        quantize(params, only_skip, model=model)
    wrong_role = Recipe("role", (RTN((Rule("embed/.*", spec, role="matmul"),)),))  # the tied table is not a matmul
    with pytest.warns(UnusedRuleWarning), pytest.raises(RecipeError, match="recipe quantized nothing"):
        quantize(params, wrong_role, model=model)


@pytest.mark.parametrize("body, match", [
    ('steps = []\n', r"quantizes nothing \(.*r\.toml: steps\).*found no steps"),
    ('[[steps]]\nmethod = "smoothquant"\n', r"quantizes nothing.*found smoothquant"),
    ('[[steps]]\nmethod = "awq"\n[[steps]]\nmethod = "rotation"\n', r"quantizes nothing.*found awq, rotation"),
])
def test_recipe_file_that_cannot_quantize_is_refused_on_load(tmp_path, body, match):
    p = tmp_path / "r.toml"
    p.write_text('name = "r"\n' + body)
    with pytest.raises(RecipeError, match=match):
        load_recipe(p)
    p.write_text('name = "r"\n' + body.replace("steps = []\n", "steps = []\n") + "[kv]\nbits = 8\n")
    assert load_recipe(p).kv is not None  # a KV-cache table is something to quantize


@pytest.mark.parametrize("method, extra", [
    ("smoothquant", {}), ("zeroquant_lkd", {}), ("gptq", {}), ("awq", {}),
    ("rotation", {"then": [{"method": "rtn", "rules": [{"pattern": ".*", "bits": 4}]}]}),
])
def test_a_step_table_may_name_its_step(method, extra):
    """The schema accepts ``name`` on every dataclass step, and the built step carries it."""
    r = recipe_from_dict({"name": "x", "steps": [{"method": method, "name": "mine", **extra}]})
    assert r.steps[0].name == "mine"


def test_an_integer_too_large_for_a_float_is_a_schema_error():
    """JSON integers are unbounded: one no float holds is refused naming the key, not an OverflowError."""
    d = {"name": "x", "steps": [{"method": "rtn", "rules": [
        {"pattern": ".*", "bits": 4, "calibrator": "percentile", "percentile": 10 ** 400}]}]}
    with pytest.raises(SchemaError, match=r"r\.json: steps\[0\]\.rules\[0\]\.percentile"):
        recipe_from_dict(d, source="r.json")
