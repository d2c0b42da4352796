"""eqjax.evaluate's rounding band: ulp bumps, the band of perplexities, the widened-band check."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
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


def _sliding_llama(n_layers: int = 3, hidden: int = 32, intermediate: int = 64) -> Model:
    return Model(LlamaConfig(vocab=64, hidden=hidden, intermediate=intermediate, n_layers=n_layers, n_heads=4,
                             n_kv_heads=2, sliding_window=4, sliding_layers=(1,)))


def test_by_block_perplexity_equals_the_whole_models():
    """Block at a time runs the same float32 operations as the whole-model program (a sliding-window layer
    and a KV quantizer included): the perplexities agree to float32 rounding of the window sums."""
    from eqjax.methods.kvquant import KVQuant

    model = _sliding_llama()
    q = quantize(model.init_params(jax.random.key(0), std=0.2), "w4g128-rtn", model=model)
    win = np.asarray(jax.random.randint(jax.random.key(1), (5, 16), 0, 64), np.int32)  # a padded last batch
    for kv in (None, KVQuant(4, 4)):
        a, b = perplexity(model, q, win, kv_quant=kv), perplexity(model, q, win, kv_quant=kv, by_block=True)
        assert abs(b.ppl / a.ppl - 1) < 16 * np.finfo(np.float32).eps, (kv, a.ppl, b.ppl)
        assert (b.windows, b.predictions) == (a.windows, a.predictions)


def test_by_block_logits_equal_the_whole_models():
    """The export check's reference: block at a time, the logits of every position equal ``model.apply``'s to
    float32 rounding of the logit range (the same operations, other program boundaries)."""
    from eqjax.evaluate import by_block_logits

    model = _sliding_llama()
    q = quantize(model.init_params(jax.random.key(0), std=0.2), "w4g128-rtn", model=model)
    toks = np.asarray(jax.random.randint(jax.random.key(2), (2, 11), 0, 64), np.int32)
    a = np.asarray(model.apply(q, jnp.asarray(toks))[0])
    b = by_block_logits(model, q, toks)
    assert b.shape == a.shape == (2, 11, 64) and b.dtype == np.float32
    np.testing.assert_allclose(b, a, rtol=0, atol=64 * np.finfo(np.float32).eps * float(np.abs(a).max()))


def test_by_block_holds_one_blocks_float_weights():
    """Compiled only: the whole model's temporary bytes grow with its blocks' float32 weights; block at a
    time, the largest program's stay at about one block's, whatever the number of blocks."""
    from eqjax.evaluate import by_block_scorer

    hidden, inter = 256, 1024
    per_block = (4 * hidden**2 + 3 * hidden * inter) * 4  # q, k, v, o (n_kv_heads = n_heads / 2: less) + MLP
    temps = {}
    for n in (2, 4):
        model = _sliding_llama(n, hidden, inter)
        q = quantize(model.init_params(jax.random.key(0), std=0.02), "w4g128-rtn", model=model)
        whole = jax.jit(lambda p, x, m=model: m.apply(p, x)[0]).lower(q, jnp.zeros((1, 8), jnp.int32)).compile()
        score = by_block_scorer(model, q, (1, 8))
        temps[n] = (whole.memory_analysis().temp_size_in_bytes,
                    max(c.memory_analysis().temp_size_in_bytes for c in score.programs))
    assert temps[4][0] > 1.5 * per_block * 2  # the whole program holds (nearly) every block's floats
    assert temps[2][1] == temps[4][1] < 1.25 * per_block, (temps, per_block)


def test_by_block_needs_eqjaxs_own_model_on_one_device():
    from jax.sharding import Mesh

    from eqjax.core.errors import InputError

    with pytest.raises(InputError, match="by_block"):
        perplexity(lambda p, t: t, {}, np.zeros((1, 4), np.int32), by_block=True)
    two = Mesh(np.array([jax.devices()[0]] * 2), ("data",))  # a mesh of two slots (the device repeated)
    with pytest.raises(InputError, match="one device"):
        perplexity(_sliding_llama(), {}, np.zeros((1, 4), np.int32), by_block=True, mesh=two)


def test_streamed_params_are_read_one_block_at_a_time():
    """Params read on demand give the tree's block-at-a-time perplexity bit for bit, each decoder block read
    once (not once per batch) and alone, the embedding, norm and head once together."""
    from eqjax.core.errors import InputError
    from eqjax.core.pytree import flatten
    from eqjax.io.hf import StreamedParams

    model = _sliding_llama()
    q = quantize(model.init_params(jax.random.key(0), std=0.2), "w4g128-rtn", model=model)
    flat = dict(flatten(q))
    reads: list[set[str]] = []

    def load(paths):
        reads.append({p.split("/", 1)[0] for p in paths})
        return {p: flat[p] for p in paths}

    streamed = StreamedParams(tuple(flat), load)
    win = np.asarray(jax.random.randint(jax.random.key(1), (5, 16), 0, 64), np.int32)  # three batches of two
    a = perplexity(model, q, win, by_block=True)
    b = perplexity(model, streamed, win, by_block=True)
    assert a.ppl == b.ppl and a.nll == b.nll
    layers = list(model.layer_names)
    assert reads == [{p.split("/", 1)[0] for p in flat} - set(layers), *({name} for name in layers)]
    with pytest.raises(InputError, match="by_block"):
        perplexity(model, streamed, win)
