"""Property tests over recipe dictionaries: any dict is either a RecipeError-family error naming a key,
or a valid recipe whose values are exactly those given (never coerced), and never another exception."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from eqjax.core.errors import InputError, RecipeError, RuleError
from eqjax.recipes.registry import recipe_from_dict
from eqjax.recipes.rules import rule_from_dict
from eqjax.recipes.schema import RULE_KEYS, SchemaError
from eqjax.recipes.types import Recipe

VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**20), 10**20), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6), st.sampled_from([".*/kernel", "group", "channel", "tensor", "float16", "minmax", "percentile",
                                          "token", "rtn", "((", "false", "4"]),
    st.lists(st.integers(-3, 300), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
RULES = st.dictionaries(st.sampled_from([*sorted(RULE_KEYS), "bitz", "", "Bits"]), VALUES, max_size=6)
STEP_KEYS = st.sampled_from(["bits", "group_size", "symmetric", "alpha", "alphas", "no_clip", "percdamp", "steps",
                             "lr", "name", "pattern", "batch_size", "nope"])
STEPS = st.one_of(
    st.fixed_dictionaries({"method": st.just("rtn")}, optional={"rules": st.one_of(st.lists(RULES, max_size=3), VALUES)}),
    st.builds(lambda m, extra: {"method": m, **extra},
              st.sampled_from(["gptq", "awq", "smoothquant", "zeroquant_lkd", "nope", ""]),
              st.dictionaries(STEP_KEYS, VALUES, max_size=4)),
    VALUES,
)
RECIPES = st.fixed_dictionaries(
    {}, optional={
        "name": st.one_of(st.just("r"), VALUES),
        "steps": st.one_of(st.lists(STEPS, max_size=3), VALUES),
        "kv": st.one_of(st.dictionaries(st.sampled_from(["bits", "key_bits", "value_bits", "outlier_fraction",
                                                         "sink_tokens", "key_group", "key_levels", "value_levels",
                                                         "recent_float", "x"]), VALUES, max_size=3), VALUES),
        "description": VALUES,
        "extra": VALUES,
    })


@settings(max_examples=300, deadline=None)
@given(RECIPES)
def test_any_recipe_dict_is_a_recipe_or_a_recipe_error(d):
    try:
        r = recipe_from_dict(d, source="fuzz.toml")
    except RecipeError as e:
        msg = str(e)
        assert "\n" not in msg and isinstance(e, InputError)
        if isinstance(e, SchemaError):
            assert "fuzz.toml" in msg and "expected" in msg and "found" in msg
        return
    assert isinstance(r, Recipe) and r.name == d["name"] and isinstance(d["name"], str)


@settings(max_examples=300, deadline=None)
@given(RULES)
def test_any_rule_dict_is_a_rule_or_a_rule_error(d):
    try:
        rule = rule_from_dict(d)
    except RuleError as e:
        assert "\n" not in str(e)
        return
    assert isinstance(d["pattern"], str)
    if rule.weight is not None:
        assert rule.weight.bits == d.get("bits", 8) and type(d.get("bits", 8)) is int
        assert rule.weight.symmetric is d.get("symmetric", True)


GOOD_RULES = st.builds(
    lambda bits, sym, gran, gs, dtype: {"pattern": ".*/kernel", "bits": bits, "symmetric": sym, "granularity": gran,
                                        **({"group_size": gs} if gran == "group" else {}), "scale_dtype": dtype},
    st.integers(2, 8), st.booleans(), st.sampled_from(["tensor", "channel", "group"]), st.integers(1, 65536),
    st.sampled_from(["float32", "float16", "bfloat16"]),
)


@settings(max_examples=100, deadline=None)
@given(GOOD_RULES)
def test_valid_rules_keep_their_exact_values(d):
    r = recipe_from_dict({"name": "g", "steps": [{"method": "rtn", "rules": [d]}]})
    spec = r.steps[0].rules[0].weight
    assert spec.bits == d["bits"] and spec.symmetric is d["symmetric"] and spec.scale_dtype == d["scale_dtype"]
    # without an axis, channel / group are role-relative (per output channel / groups along the input)
    expected = {"channel": ("channel", "output"), "group": ("group", "input_group"), "tensor": ("tensor",)}
    assert spec.granularity.kind in expected[d["granularity"]]
    if d["granularity"] == "group":
        assert spec.granularity.group_size == d["group_size"]


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["bits", "symmetric", "group_size", "act_bits"]),
       st.one_of(st.floats(allow_nan=True), st.text(max_size=4), st.lists(st.integers(), max_size=2)))
def test_wrong_types_are_refused_not_coerced(key, value):
    d = {"pattern": ".*", "granularity": "group", "group_size": 8, key: value}
    if key == "symmetric" and isinstance(value, bool):
        return
    try:
        rule_from_dict(d)
    except RuleError as e:
        assert key in str(e)
        return
    raise AssertionError(f"{key} = {value!r} was accepted")


def test_float_fields_accept_ints_but_not_bools():
    r = recipe_from_dict({"name": "s", "steps": [{"method": "smoothquant", "alpha": 1}]})
    assert r.steps[0].alpha == 1 and not math.isnan(r.steps[0].alpha)
    for bad in (True, "0.5", float("nan")):
        try:
            recipe_from_dict({"name": "s", "steps": [{"method": "smoothquant", "alpha": bad}]})
        except SchemaError as e:
            assert "steps[0].alpha" in str(e)
        else:
            raise AssertionError(f"alpha = {bad!r} accepted")


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["w8", "fp", "w4g128-rtn", "kv4", "w9", ""]),
       st.lists(st.sampled_from(["f16", "bf16", "emb-int8", "emb-int4", "emb-w7a8", "emb-int3", "f17", "", "F16"]),
                max_size=4))
def test_any_suffix_combination_is_one_recipe_or_a_recipe_error(base, suffixes):
    """A recipe name with suffixes is the recipe with each suffix applied once (at most one ``+emb-*``, then at
    most one ``+f16`` / ``+bf16``), or a one-line RecipeError; never a silently ignored suffix."""
    from eqjax.methods.halffloat import HalfFloats
    from eqjax.recipes.registry import get_recipe

    name = "+".join([base, *suffixes])
    try:
        r = get_recipe(name)
    except RecipeError as e:
        assert "\n" not in str(e)
        return
    emb = [s for s in suffixes if s.startswith("emb-")]
    half = [s for s in suffixes if s in ("f16", "bf16")]
    assert r.name == name and len(emb) <= 1 and len(half) <= 1 and len(emb) + len(half) == len(suffixes)
    assert sum(isinstance(s, HalfFloats) for s in r.steps) == len(half)
    assert sum(str(s.name).startswith("embedding-") for s in r.steps) == len(emb)
    if half:
        assert isinstance(r.steps[-1], HalfFloats) and suffixes[-1] in ("f16", "bf16")
