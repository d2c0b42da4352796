"""Bad input: clear errors (or documented behaviour), never a silent NaN."""

import jax.numpy as jnp
import numpy as np
import pytest

from eqjax.core.errors import RuleError
from eqjax.core.numerics import QuantSpec, dequantize, quantize
from eqjax.core.qarray import QArrayError, per_channel, per_group, per_tensor, validate
from eqjax.recipes.rules import Rule, rule_from_dict


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_named(bad):
    x = np.ones((4, 4), np.float32)
    x[2, 1] = bad
    with pytest.raises(ValueError, match=r"layers_0/q_proj/kernel.*non-finite.*\(2, 1\)"):
        quantize(jnp.asarray(x), QuantSpec(), name="layers_0/q_proj/kernel")


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("gran", [per_tensor(), per_channel(1), per_group(0, 2)])
def test_all_zero_tensor_is_exact(sym, gran):
    q = quantize(jnp.zeros((4, 6)), QuantSpec(4, sym, gran))
    validate(q)
    out = np.asarray(dequantize(q))
    assert np.all(out == 0.0) and np.all(np.isfinite(np.asarray(q.scale)))


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("c", [3.5, -2.0, 1e-30])
def test_constant_tensor(sym, c):
    q = quantize(jnp.full((4, 6), c, jnp.float32), QuantSpec(8, sym, per_channel(1)))
    out = np.asarray(dequantize(q))
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, c, rtol=1e-2)


@pytest.mark.parametrize("bits", [0, 1, 9, 16, 4.5])
def test_unsupported_bits(bits):
    with pytest.raises(QArrayError, match="bit width"):
        QuantSpec(bits=bits)


@pytest.mark.parametrize("sym", [True, False])
def test_group_size_not_dividing_axis_gives_a_short_last_group(sym):
    """Documented behaviour: 12 = 5 + 5 + 2; the last group has its own scale, as if quantized alone."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((12, 3)), jnp.float32)
    q = quantize(x, QuantSpec(4, sym, per_group(0, 5)), name="w")
    validate(q)
    assert q.scale.shape == (3, 3)
    tail = quantize(x[10:], QuantSpec(4, sym, per_group(0, 2)))
    np.testing.assert_array_equal(np.asarray(q.scale)[2], np.asarray(tail.scale)[0])
    np.testing.assert_array_equal(np.asarray(dequantize(q))[10:], np.asarray(dequantize(tail)))
    assert np.all(np.abs(np.asarray(dequantize(q)) - np.asarray(x)) <= np.asarray(q.scale).max() / 2 + 1e-6)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.complex64, jnp.bool_])
def test_non_float_input_rejected(dtype):
    with pytest.raises(TypeError, match="floating-point"):
        quantize(jnp.ones((4, 4), dtype), QuantSpec())


def test_bad_regex_rule():
    with pytest.raises(RuleError, match="does not compile"):
        Rule("layers_(0/kernel", QuantSpec())
    with pytest.raises(RuleError, match="unknown rule key"):
        rule_from_dict({"pattern": ".*", "bitz": 4})
    with pytest.raises(RuleError, match="group_size"):
        rule_from_dict({"pattern": ".*", "granularity": "group"})


def test_axis_out_of_range():
    with pytest.raises(QArrayError, match="out of range"):
        quantize(jnp.ones((4, 4)), QuantSpec(8, True, per_channel(3)))


def test_float16_scale_overflow_is_an_error():
    with pytest.raises(QArrayError, match="overflows a float16 scale"):
        quantize(jnp.asarray([[1e9, -1e9]], jnp.float32), QuantSpec(8, True, per_tensor(), scale_dtype="float16"))


def test_validator_catches_broken_arrays():
    q = quantize(jnp.ones((8, 4)), QuantSpec(4, False, per_group(0, 4)))
    import dataclasses

    with pytest.raises(QArrayError, match="scale shape"):
        validate(dataclasses.replace(q, scale=jnp.ones((1, 4), jnp.float32)))
    with pytest.raises(QArrayError, match="zero_point must be None exactly when symmetric"):
        validate(dataclasses.replace(q, symmetric=True))
    with pytest.raises(QArrayError, match="values shape"):
        validate(dataclasses.replace(q, values=jnp.zeros((8, 4), jnp.uint8)))
    with pytest.raises(QArrayError, match="scale must be finite and > 0"):
        validate(dataclasses.replace(q, scale=jnp.zeros_like(q.scale)))
    q8 = quantize(jnp.ones((8, 4)), QuantSpec(8, True, per_channel(1)))
    with pytest.raises(QArrayError, match="codes outside"):
        validate(dataclasses.replace(q8, values=jnp.full((8, 4), -128, jnp.int8)))


# ------------------------------------------------------------------------------------ recipes, params, results
@pytest.mark.parametrize("key, value, found", [
    ("bits", 4.7, "float 4.7"), ("symmetric", "false", "str 'false'"), ("bits", True, "bool True"),
    ("group_size", 100000, "int 100000"),
])
def test_recipe_values_are_checked_not_coerced(key, value, found):
    from eqjax.core.errors import RecipeError
    from eqjax.recipes.registry import recipe_from_dict

    rule = {"pattern": ".*/kernel", "granularity": "group", "group_size": 32, key: value}
    with pytest.raises(RecipeError, match=rf"mine\.toml: steps\[0\]\.rules\[0\]\.{key}\): expected .*, found {found}"):
        recipe_from_dict({"name": "r", "steps": [{"method": "rtn", "rules": [rule]}]}, source="mine.toml")


def test_conflicting_rule_keys():
    with pytest.raises(RuleError, match="skip"):
        rule_from_dict({"pattern": ".*", "skip": True, "bits": 4})
    with pytest.raises(RuleError, match="granularity"):
        rule_from_dict({"pattern": ".*", "group_size": 64})
    with pytest.raises(RuleError, match="act_bits"):
        rule_from_dict({"pattern": ".*", "act_granularity": "tensor"})


def test_quantize_names_a_non_finite_param():
    import eqjax
    from eqjax.core.errors import NonFiniteError

    params = {"layers_0": {"attn_norm": {"scale": jnp.asarray([1.0, np.nan, 1.0])},
                           "mlp": {"up": {"kernel": jnp.ones((4, 4))}}}}
    with pytest.raises(NonFiniteError, match=r"layers_0/attn_norm/scale.*index \(1,\)"):
        eqjax.quantize(params, eqjax.get_recipe("w8"))


class _FakeModel:
    """Logits that put +1000 on token 0: every other target costs ~1000 nats, exp(1000) overflows."""

    class config:  # noqa: N801
        vocab = 8

    def apply(self, params, tokens, kv_quant=None):
        logits = jnp.zeros((*tokens.shape, 8), jnp.float32).at[..., 0].set(1000.0)
        return logits, None


def test_perplexity_never_returns_infinity():
    from eqjax.core.errors import NonFiniteResult
    from eqjax.evaluate import perplexity

    windows = np.full((1, 8), 3, np.int32)
    with pytest.raises(NonFiniteResult, match="perplexity overflows"):
        perplexity(_FakeModel(), {}, windows)


def test_token_ids_outside_the_vocabulary():
    from eqjax.core.errors import CompatibilityError
    from eqjax.evaluate import perplexity

    with pytest.raises(CompatibilityError, match=r"expected ids in \[0, 8\), found 9"):
        perplexity(_FakeModel(), {}, np.full((1, 8), 9, np.int32))
