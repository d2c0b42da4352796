"""eqjax.evaluate's rounding band: ulp bumps, the band of perplexities, the widened-band check."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from eqjax.core.qarray import ActQuantKernel
from eqjax.evaluate import perplexity, rounding_band, ulp_bumped, within_band
from eqjax.methods.rtn import RTN
from eqjax.models import LlamaConfig, Model
from eqjax.recipes.apply import quantize
from eqjax.recipes.registry import weight_rule
from eqjax.recipes.types import Recipe

finite32 = st.floats(min_value=-2.0**100, max_value=2.0**100, allow_nan=False, width=32).filter(lambda v: abs(v) > 1e-30)


@given(finite32, st.integers(1, 4))
def test_ulp_bumped_moves_a_float32_by_k_to_2k_ulps(v, k):
    """``x * (1 + k eps)`` adds ``k m`` ulps for a mantissa ``m`` in [1, 2) (rounded; fewer past a binade)."""
    x = np.float32(v)
    y = np.float32(ulp_bumped({"w": jnp.float32(x)}, k)["w"])
    # the distance in ulps of x, counted by stepping with nextafter (an independent oracle)
    steps, z = 0, x
    while z != y and steps < 10:
        z, steps = np.nextafter(z, np.float32(np.inf) * np.sign(x), dtype=np.float32), steps + 1
    assert z == y and max(1, k // 2) <= steps <= 2 * k, (x, y, steps)


def test_ulp_bumped_leaves_integers_and_structure():
    p = {"a": jnp.arange(4), "b": jnp.ones(3, jnp.bfloat16), "c": {"d": jnp.float32(2.0)}}
    q = ulp_bumped(p, 1)
    assert jax.tree.structure(q) == jax.tree.structure(p)
    np.testing.assert_array_equal(q["a"], p["a"])
    assert q["b"].dtype == jnp.bfloat16 and float(q["b"][0]) == 1 + 2.0**-7  # one bfloat16 ulp of 1
    assert ulp_bumped(p, 0)["c"]["d"] == 2.0


def test_within_band_brute_force():
    band = [10.0, 10.2, 10.1]
    width = 0.2
    for v in np.linspace(9.0, 11.0, 201):
        inside = 10.0 * 0.99 - width <= v <= 10.2 * 1.01 + width
        assert within_band(float(v), band, 0.01) == inside, v
    assert within_band(10.0, [10.0], 0.0) and not within_band(10.001, [10.0], 0.0)


def _tiny():
    model = Model(LlamaConfig(vocab=128, hidden=64, intermediate=128, n_layers=2, n_heads=4, n_kv_heads=2))
    params = model.init_params(jax.random.key(1), std=0.1)
    windows = np.random.default_rng(0).integers(0, 128, (2, 32)).astype(np.int32)
    return model, params, windows


def test_rounding_band_first_entry_is_the_plain_perplexity_and_float_models_barely_move():
    model, params, windows = _tiny()
    band = rounding_band(model, params, windows)
    assert len(band) == 4
    assert band[0] == perplexity(model, params, windows).ppl
    assert max(band) / min(band) - 1 < 1e-5  # float32 everywhere: ulps stay ulps


def test_rounding_band_of_a_w8a8_model_is_measured_on_it():
    model, params, windows = _tiny()
    qp = quantize(params, Recipe("t", (RTN((weight_rule(8, act_bits=8),)),)), model=model)
    assert any(isinstance(x, ActQuantKernel) for x in jax.tree.leaves(qp, is_leaf=lambda x: isinstance(x, ActQuantKernel)))
    band = rounding_band(model, qp, windows, bumps=(1, 2))
    assert len(band) == 3 and all(np.isfinite(band))
    assert max(band) / min(band) - 1 < 0.05



def test_perplexity_reuses_its_traced_function_per_model_and_backend(monkeypatch):
    """Params of the same structure and shapes (an ulp-bumped copy) reuse the first call's traced function;
    another linear backend (:func:`eqjax.core.linear.use_backend`) traces anew, under that backend. Traces
    are counted by the model's linears asking for the current backend, which they do only while tracing."""
    import dataclasses

    import eqjax.core.linear as linear_mod
    from eqjax.core.linear import use_backend

    model, params, windows = _tiny()
    model = Model(dataclasses.replace(model.config, rope_theta=12345.0))  # a model no other test scores
    seen: list[str] = []
    backend = linear_mod.current_backend
    monkeypatch.setattr(linear_mod, "current_backend", lambda: seen.append(backend()) or backend())
    a = perplexity(model, params, windows).ppl
    traced = len(seen)
    assert traced > 0 and set(seen) == {"xla"}
    b = perplexity(model, ulp_bumped(params, 1), windows).ppl
    assert len(seen) == traced and np.isfinite(b) and abs(b / a - 1) < 1e-5  # float32: ulps stay ulps
    with use_backend("pallas_interpret"):
        c = perplexity(model, params, windows).ppl
    assert len(seen) > traced and set(seen[traced:]) == {"pallas_interpret"}
    assert c == a  # float kernels: every backend runs the same XLA matmuls
