"""AWQ: scale folding keeps the float function; the searched scales/clips beat plain RTN."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eqjax.core.analysis import MatrixLayout
from eqjax.core.errors import RecipeError
from eqjax.core.numerics import QuantSpec, fake_quantize
from eqjax.core.qarray import per_group, per_input_group, per_tensor
from eqjax.methods.awq import AWQ, gram_factor, search_clip, search_scale
from eqjax.methods.rtn import RTN
from eqjax.models import LlamaConfig, Model
from eqjax.recipes.apply import quantize
from eqjax.recipes.rules import Rule
from eqjax.recipes.types import Recipe
from tests.methods.ref_awq import awq_losses, awq_scale


@pytest.fixture(scope="module")
def tiny():
    # GQA (4 query heads, 2 kv heads): exercises the v_proj -> o_proj fold with shared scales.
    model = Model(LlamaConfig(vocab=64, hidden=32, intermediate=64, n_layers=1, n_heads=4, n_kv_heads=2))
    params = model.init_params(jax.random.key(0), std=0.2)
    # outlier input channels, as in real LLMs
    lp = params["layers_0"]
    params["layers_0"] = {**lp, "attn_norm": {"scale": lp["attn_norm"]["scale"].at[:3].set(20.0)},
                          "mlp_norm": {"scale": lp["mlp_norm"]["scale"].at[5].set(15.0)}}
    toks = np.asarray(jax.random.randint(jax.random.key(1), (4, 16), 0, 64), np.int32)
    return model, params, toks


def test_scale_folding_preserves_function(tiny):
    model, params, toks = tiny
    out = quantize(params, Recipe("a", (AWQ(bits=3, group_size=16, clip=False),)), model=model, calibration=toks)
    a, _ = model.apply(params, jnp.asarray(toks))
    b, _ = model.apply(out, jnp.asarray(toks))
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-4)
    assert not np.allclose(out["layers_0"]["attn_norm"]["scale"], params["layers_0"]["attn_norm"]["scale"])


def test_awq_then_rtn_beats_rtn(tiny):
    model, params, toks = tiny
    rtn_step = RTN((Rule(r".*", QuantSpec(3, False, per_input_group(16), "minmax", scale_dtype="float16"),
                         role="matmul"),))
    ref, _ = model.apply(params, jnp.asarray(toks))
    rtn, _ = model.apply(quantize(params, Recipe("r", (rtn_step,)), model=model), jnp.asarray(toks))
    awq_q = quantize(params, Recipe("a", (AWQ(bits=3, group_size=16), rtn_step)), model=model, calibration=toks)
    awq, _ = model.apply(awq_q, jnp.asarray(toks))
    e_rtn = float(jnp.mean((rtn - ref) ** 2))
    e_awq = float(jnp.mean((awq - ref) ** 2))
    assert e_awq < e_rtn, (e_awq, e_rtn)


def _check_scale_search_against_reference(x, w, s, r, losses, n_grid=20, factor_rank=None):
    """The search against the float64 reference (:mod:`tests.methods.ref_awq`): every grid point's loss
    within the derived float32 bound (:func:`tests.methods.ref_awq.loss_bound`) except where a code or
    a stored scale sits within float32 rounding of a boundary (counted: none on these layers), the chosen
    ``r`` the reference's argmin (or within the bound of its minimum), and the scale ``s`` of that ``r``
    elementwise within ``(max |r ln x_mean| + 6) u`` relative (``x**r`` and its normalization in float32)."""
    ref, near, bound = awq_losses(w, x, bits=3, group=16, symmetric=False, full_range=False,
                                  scale_dtype="float16", n_grid=n_grid, factor_rank=factor_rank)
    assert losses.shape == (n_grid,)
    assert int(near.sum()) == 0, np.flatnonzero(near)  # no tie on these layers: every point is checked
    assert np.all(np.abs(losses - ref) <= bound), (losses, ref, bound)
    best = int(np.argmin(ref))
    got = round(r * n_grid)  # eqjax's r is exactly one of k / n_grid
    assert got == best or ref[got] - ref[best] <= bound[best] + bound[got], (r, best / n_grid)
    assert ref[best] < ref[0] - bound[0] - bound[best]  # the search really moves off plain RTN here
    x_mean = np.abs(x.astype(np.float64)).mean(0)
    rho = (np.max(r * np.abs(np.log(x_mean))) + 6) * 2.0**-24
    np.testing.assert_allclose(np.asarray(s, np.float64), awq_scale(x_mean, r), rtol=2 * rho, atol=0)


@pytest.mark.parametrize("n_in", [32, 40])
def test_search_scale_and_clip_reduce_layer_error(n_in):
    """n_in 40 with groups of 16: a short last group of 8 (as SmolLM2's 576 with 128)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, n_in)).astype(np.float32) * np.where(np.arange(n_in) < 2, 30.0, 1.0)
    w = rng.normal(size=(n_in, 16)).astype(np.float32)
    h = x.astype(np.float64).T @ x / len(x)  # float64, as the reference's
    spec = QuantSpec(3, False, per_group(0, 16), "minmax", scale_dtype="float16")
    lay = MatrixLayout((n_in, 16), (0,), (1,))
    s, r, losses = search_scale([w], [lay], [spec], np.abs(x).mean(0), h, np.arange(n_in))
    _check_scale_search_against_reference(x, w, s, r, losses)
    err = lambda wq: float(np.sum((x @ (w - np.asarray(wq))) ** 2))  # noqa: E731
    e_rtn = err(fake_quantize(jnp.asarray(w), spec))
    se = np.asarray(s)[:, None]
    e_awq = err(np.asarray(fake_quantize(jnp.asarray(w * se), spec)) / se)
    assert e_awq <= e_rtn
    wc = search_clip(jnp.asarray(w * se), h / (se * se.T), lay, spec)
    assert wc.shape == w.shape
    e_clip = err(np.asarray(fake_quantize(wc, spec)) / se)
    assert e_clip <= e_awq * (1 + 1e-5)


def test_scale_search_through_a_low_rank_factor():
    """Fewer tokens than half the inputs (12 tokens, 40 inputs): the second moment has rank 12, the search prices
    its losses through the pivoted-Cholesky factor, and every loss lies within that route's float32 bound of
    the float64 reference, with the reference's choice of ratio."""
    rng = np.random.default_rng(3)
    n_in, t = 40, 12
    x = rng.normal(size=(t, n_in)).astype(np.float32) * np.where(np.arange(n_in) < 2, 30.0, 1.0)
    w = rng.normal(size=(n_in, 16)).astype(np.float32)
    h = x.astype(np.float64).T @ x / t
    factor = gram_factor(h)
    assert factor is not None and factor.shape == (n_in, t)
    spec = QuantSpec(3, False, per_group(0, 16), "minmax", scale_dtype="float16")
    lay = MatrixLayout((n_in, 16), (0,), (1,))
    s, r, losses = search_scale([w], [lay], [spec], np.abs(x).mean(0), h, np.arange(n_in))
    _check_scale_search_against_reference(x, w, s, r, losses, factor_rank=t)


@settings(max_examples=40, deadline=None)
@given(t=st.integers(1, 96), k=st.integers(2, 64), seed=st.integers(0, 2**31 - 1))
def test_gram_factor_leaves_out_at_most_its_bound(t, k, seed):
    """``gram_factor`` of a float32 second moment of ``t`` tokens over ``k`` channels (channel scales spread over
    orders of magnitude), against float64 eigenvalues: with a factor ``L`` (at most ``0.8 k`` columns),
    ``H - L L^T`` has spectral norm <= 3 u tr(H) (at most ``u tr(H)`` left out by the stopping rule, ``2 u`` of
    ``|L| |L|^T`` from storing ``L`` in float32); ``t >= 2 k`` tokens of such data have full rank: no factor."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, k)) * np.exp(rng.standard_normal(k))
    h = (x.T @ x / t).astype(np.float32)
    f = gram_factor(h)
    if f is None:
        return
    assert f.dtype == np.float32 and f.shape[0] == k and f.shape[1] <= 0.8 * k
    h64 = h.astype(np.float64)
    resid = h64 - f.astype(np.float64) @ f.astype(np.float64).T
    assert np.max(np.abs(np.linalg.eigvalsh(resid))) <= 3 * 2.0**-24 * np.trace(h64) * (1 + 1e-9)
    if t >= 2 * k:
        raise AssertionError(f"a factor of rank {f.shape[1]} for {t} tokens over {k} channels")


@pytest.mark.parametrize("layout,gran,pieces", [
    (MatrixLayout((48, 40), (0,), (1,)), per_group(0, 16), 10),  # [K, N]: pieces of 4 output columns
    (MatrixLayout((48, 5, 8), (0,), (1, 2)), per_group(0, 16), 5),  # two free axes: pieces along the first
    (MatrixLayout((48, 40), (0,), (1,)), per_tensor(), 1),  # one scale for everything: never cut
])
def test_wide_weights_searched_in_column_pieces_as_whole(layout, gran, pieces, monkeypatch):
    """A weight wider than the piece size is searched one column piece at a time (an LM head of 128k outputs
    would need several float32 copies of itself at once): the scale losses add up to the whole weight's to
    float32 rounding, the same ratio wins, and every column gets the clip it gets when searched whole (written
    into a new array, or into the input in place)."""
    import eqjax.methods.awq as awq

    rng = np.random.default_rng(1)
    K, N = layout.k, layout.n
    x = rng.normal(size=(128, K)).astype(np.float32) * np.where(np.arange(K) < 3, 25.0, 1.0)
    w = rng.normal(size=(K, N)).astype(np.float32)
    h = x.T @ x / len(x)
    spec = QuantSpec(4, False, gran, "minmax")
    whole = search_scale([w], [layout], [spec], np.abs(x).mean(0), h, np.arange(K))
    clip_whole = np.asarray(search_clip(jnp.asarray(w), h, layout, spec))
    monkeypatch.setattr(awq, "_PIECE", K * 4)  # four columns a piece
    assert len(awq._pieces(layout, spec)) == pieces
    cut = search_scale([w], [layout], [spec], np.abs(x).mean(0), h, np.arange(K))
    np.testing.assert_allclose(cut[2], whole[2], rtol=8 * N * np.finfo(np.float32).eps)
    assert cut[1] == whole[1]
    np.testing.assert_array_equal(np.asarray(search_clip(jnp.asarray(w), h, layout, spec)), clip_whole)
    own = jnp.array(w, copy=True)  # in place: the pieces written into the input itself, which is consumed
    np.testing.assert_array_equal(np.asarray(search_clip(own, h, layout, spec, in_place=True)), clip_whole)


def test_awq_needs_calibration(tiny):
    model, params, _ = tiny
    with pytest.raises(RecipeError, match="calibration"):
        quantize(params, Recipe("a", (AWQ(),)), model=model)


def test_recipes_and_config():
    from eqjax.methods.gptq import GPTQ
    from eqjax.recipes.registry import get_recipe, recipe_from_dict

    r = recipe_from_dict({"name": "x", "steps": [{"method": "awq", "bits": 3, "clip": False},
                                                 {"method": "gptq", "bits": 3, "act_order": True}]})
    assert isinstance(r.steps[0], AWQ) and r.steps[0].bits == 3 and isinstance(r.steps[1], GPTQ)
    with pytest.raises(RecipeError, match="unknown 'gptq' key"):
        recipe_from_dict({"name": "x", "steps": [{"method": "gptq", "bitz": 3}]})
    for name in ("w4g128-gptq", "w4g128-gptq-sym", "w3g128-gptq", "w4g128-awq", "w4g128-awq-gptq", "w3g128-awq"):
        assert get_recipe(name).needs_calibration
    # AWQ's assumed quantizer is exactly the RTN step that follows it in the recipe.
    assert AWQ(bits=4).spec() == get_recipe("w4g128-awq").steps[1].rules[0].weight
