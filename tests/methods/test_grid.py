"""Searched grids: brute-force oracle over the candidate set, never worse than round to nearest, the
weighted error it reports, the RTN step and GPTQ on searched grids."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqjax.core.numerics import QuantSpec, dequantize, quantize, quantize_with
from eqjax.core.qarray import QArray, per_group, validate
from eqjax.methods.gptq import GPTQ, gptq_matrix
from eqjax.methods.grid import SearchedRTN, group_ids, search_grid
from eqjax.methods.rtn import RTN
from eqjax.models import LlamaConfig, Model
from eqjax.recipes.apply import quantize as run_recipe
from eqjax.recipes.registry import recipe_from_dict, weight_rule
from eqjax.recipes.types import Recipe


def _layer(k=32, n=6, t=256, seed=0):
    rng = np.random.default_rng(seed)
    mix = rng.normal(size=(k, k)) * 0.3 + np.eye(k)
    x = (rng.normal(size=(t, k)) * np.exp(rng.normal(size=k))) @ mix
    w = rng.standard_t(4, size=(k, n)) * 0.1
    return x.astype(np.float64), w.astype(np.float32)


def _np_codes(w, s, z, bits, sym):
    if sym:
        return np.clip(np.round(w / s), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return np.clip(np.round(w / s) + z, 0, 2**bits - 1) - z


def _brute_force(w, h, G, bits, sym, full, ratios_sym, ratios_asym):
    """Independent oracle: every candidate of the documented candidate set, per (group, output); scales
    and codes in float32 as stored (ties of x / scale at k + 1/2 then round the same way), errors in float64."""
    f = np.float32
    k, n = w.shape
    best = np.full((-(-k // G), n), np.inf)
    for g in range(best.shape[0]):
        rows = slice(g * G, min(k, (g + 1) * G))
        wb, hb = w[rows].astype(f), h[rows, rows]
        for j in range(n):
            col = wb[:, j]
            lo, hi = col.min(), col.max()
            cands = [(r, r) for r in ratios_sym] if sym else list(itertools.product(ratios_asym, ratios_asym))
            for a, b in cands:
                l, u = min(lo * f(a), f(0)), max(hi * f(b), f(0))
                if sym:
                    amax = max(abs(l), abs(u))
                    s = amax / f(2 ** (bits - 1) - (0.5 if full else 1.0)) if amax > 0 else f(1)
                    z = f(0)
                else:
                    s = (u - l) / f(2**bits - 1) if u > l else f(1)
                    z = np.clip(np.round(-l / s), 0, 2**bits - 1)
                e = col.astype(np.float64) - _np_codes(col, f(s), z, bits, sym).astype(np.float64) * float(s)
                best[g, j] = min(best[g, j], e @ hb @ e)
    return best


@pytest.mark.parametrize("sym,full", [(True, True), (True, False), (False, False)])
def test_grid_search_matches_brute_force_over_candidates(sym, full):
    x, w = _layer()
    h = x.T @ x / len(x)
    gid, ng = group_ids((32,), 8)
    n_grid = 16
    s, z, err = search_grid(w, h, gid, ng, bits=3, symmetric=sym, full_range=full, scale_dtype="float32",
                            n_grid=n_grid, min_ratio=0.5, refine=0, damp=0.0)
    ratios = np.linspace(1.0, 0.5, n_grid)
    rs = list(ratios) + ([3.5 / 3.0] if sym and full else [])
    m = int(round(np.sqrt(n_grid)))
    oracle = _brute_force(w, h / np.mean(np.diag(h)), 8, 3, sym, full, rs, np.linspace(1.0, 0.5, m))
    np.testing.assert_allclose(np.asarray(err), oracle, rtol=2e-3, atol=1e-7)
    # the returned grid reproduces that error
    q = quantize_with(jnp.asarray(w), s, z, bits=3, granularity=per_group(0, 8))
    e = w.astype(np.float64) - np.asarray(dequantize(q), np.float64)
    hn = h / np.mean(np.diag(h))
    per = np.stack([np.einsum("in,ij,jn->n", e[g * 8:(g + 1) * 8], hn[g * 8:(g + 1) * 8, g * 8:(g + 1) * 8],
                              e[g * 8:(g + 1) * 8]) for g in range(4)])
    np.testing.assert_allclose(per, np.asarray(err), rtol=2e-3, atol=1e-7)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("weighting", ["hessian", "diagonal", "none"])
def test_searched_grid_never_worse_than_round_to_nearest(sym, weighting):
    """Per (group, output) block, under the weighting searched for (refinement included)."""
    for seed in range(3):
        x, w = _layer(k=40, n=8, seed=seed)  # 40 = 4 x 8 + 8: groups of 12 leave a short last group of 4
        h = x.T @ x / len(x)
        gid, ng = group_ids((40,), 12)
        spec = QuantSpec(4, sym, per_group(0, 12), scale_dtype="float16", full_range=sym)
        e0 = w.astype(np.float64) - np.asarray(dequantize(quantize(jnp.asarray(w), spec)), np.float64)
        s, z, err = search_grid(w, h, gid, ng, bits=4, symmetric=sym, full_range=sym, weighting=weighting, damp=0.0)
        hn = h / np.mean(np.diag(h))
        wmat = {"hessian": hn, "diagonal": np.diag(np.diag(hn)), "none": np.eye(40)}[weighting]
        starts = [0, 12, 24, 36]
        for g, a in enumerate(starts):
            b = min(a + 12, 40)
            base = np.einsum("in,ij,jn->n", e0[a:b], wmat[a:b, a:b], e0[a:b])
            assert np.all(np.asarray(err)[g] <= base * (1 + 1e-5) + 1e-9), (seed, g)
        assert s.dtype == jnp.float16 and (z is None) == sym


def test_search_lowers_layer_output_error():
    """The point of the weighting: the layer's output error ||X (W - Q)||^2 (all of H, not just its
    diagonal blocks) drops well below round to nearest's."""
    x, w = _layer(k=64, n=16, t=512, seed=3)
    h = x.T @ x
    gid, ng = group_ids((64,), 16)
    for sym in (True, False):
        spec = QuantSpec(3, sym, per_group(0, 16), scale_dtype="float16", full_range=sym)
        q0 = dequantize(quantize(jnp.asarray(w), spec))
        s, z, _ = search_grid(w, h, gid, ng, bits=3, symmetric=sym, full_range=sym)
        q1 = dequantize(quantize_with(jnp.asarray(w), s, z, bits=3, granularity=per_group(0, 16)))
        err = lambda q: float(np.sum((x @ (w - np.asarray(q, np.float64))) ** 2))  # noqa: E731
        assert err(q1) < 0.8 * err(q0), (sym, err(q1), err(q0))


def test_gptq_on_searched_grid_plumbing_is_exact():
    """GPTQ with ``grid="search"`` restricted to the single min/max candidate (``n_grid=1``, no refinement)
    is GPTQ on static min/max grids, bit for bit (the search path changes only which grid is used); with
    the full search, GPTQ's values lie on the searched grid (storing them re-quantizes exactly).

    Not asserted, because it is false: that the searched grid lowers GPTQ's output error. On these
    heavy-tailed layers the RTN-optimal (clipping) grids make GPTQ's error larger (x1.1..x2.2 over
    seeds 4..6 at 3 bits); see the module docs of eqjax.methods.grid."""
    x, w = _layer(k=64, n=16, t=512, seed=4)
    h = 2 * x.T @ x / len(x)
    gid, ng = group_ids((64,), 16)
    for act_order in (False, True):
        q_mm, s_mm, z_mm = gptq_matrix(w, h, gid, ng, bits=3, symmetric=False, blocksize=16, act_order=act_order,
                                       static_groups=True)
        q_1, s_1, z_1 = gptq_matrix(w, h, gid, ng, bits=3, symmetric=False, blocksize=16, act_order=act_order,
                                    grid="search", grid_kwargs=dict(n_grid=1, refine=0))
        np.testing.assert_array_equal(q_1, q_mm)
        np.testing.assert_array_equal(np.asarray(s_1), np.asarray(s_mm))
        np.testing.assert_array_equal(np.asarray(z_1), np.asarray(z_mm))
    for sym in (False, True):
        q_s, scale, zp = gptq_matrix(w, h, gid, ng, bits=3, symmetric=sym, full_range=sym, blocksize=16, grid="search")
        qa = quantize_with(jnp.asarray(q_s), scale, zp, bits=3, granularity=per_group(0, 16))
        np.testing.assert_array_equal(np.asarray(dequantize(qa)), q_s)


CFG = LlamaConfig(vocab=64, hidden=32, intermediate=64, n_layers=2, n_heads=4, n_kv_heads=2)


def test_searched_rtn_step_on_a_model():
    model = Model(CFG)
    params = model.init_params(jax.random.key(0), std=0.2)
    toks = jax.random.randint(jax.random.key(1), (8, 16), 0, 64, dtype=jnp.int32)
    ev = jax.random.randint(jax.random.key(2), (8, 16), 0, 64, dtype=jnp.int32)
    ref = model.apply(params, ev)[0]
    rtn = run_recipe(params, Recipe("r", (RTN((weight_rule(3, symmetric=False, group=16),)),)), model=model)
    srch = run_recipe(params, Recipe("s", (SearchedRTN(bits=3, group_size=16),)), model=model, calibration=toks)
    k0, k1 = rtn["layers_0"]["mlp"]["down_proj"]["kernel"], srch["layers_0"]["mlp"]["down_proj"]["kernel"]
    assert isinstance(k1, QArray) and validate(k1) is k1
    assert (k1.nbytes, k1.granularity, k1.values.shape) == (k0.nbytes, k0.granularity, k0.values.shape)
    e = lambda q: float(jnp.mean((model.apply(q, ev)[0] - ref) ** 2))  # noqa: E731
    assert e(srch) < e(rtn)


def test_config_keys():
    r = recipe_from_dict({"name": "x", "steps": [{"method": "rtn_search", "bits": 3, "weighting": "diagonal"},
                                                 {"method": "gptq", "grid": "search", "grid_n": 16}]})
    assert r.steps[0] == SearchedRTN(bits=3, weighting="diagonal") and r.steps[1] == GPTQ(grid="search", grid_n=16)
    from eqjax.core.errors import RecipeError

    with pytest.raises(RecipeError, match="weighting"):
        recipe_from_dict({"name": "x", "steps": [{"method": "rtn_search", "weighting": "full"}]})
    with pytest.raises(RecipeError, match="grid"):
        recipe_from_dict({"name": "x", "steps": [{"method": "gptq", "grid": "mse"}]})
