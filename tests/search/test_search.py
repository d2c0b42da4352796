"""Bit-width search: exact knapsack vs brute force, budget errors, searched recipes are valid and fit."""

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqjax.core.pytree import tree_nbytes
from eqjax.models import LlamaConfig, Model
from eqjax.recipes.apply import quantize
from eqjax.recipes.registry import recipe_from_dict
from eqjax.search.allocate import search
from eqjax.search.layers import (
    BudgetError,
    Candidate,
    collect_hessians,
    layer_group,
    layer_table,
    rules_for_picks,
    solve_mck,
    uniform_picks,
)


def _brute(sizes, errors, budget):
    best = (np.inf, None)
    for picks in itertools.product(*[range(len(s)) for s in sizes]):
        if sum(s[j] for s, j in zip(sizes, picks)) <= budget:
            e = sum(er[j] for er, j in zip(errors, picks))
            if e < best[0]:
                best = (e, picks)
    return best


@pytest.mark.parametrize("seed", range(25))
def test_knapsack_exact_vs_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 6))
    sizes = [rng.integers(1, 30, size=int(rng.integers(1, 5))).tolist() for _ in range(n)]
    errors = [rng.random(len(s)).tolist() for s in sizes]
    lo, hi = sum(min(s) for s in sizes), sum(max(s) for s in sizes)
    budget = int(rng.integers(lo, hi + 1))
    picks, err = solve_mck(sizes, errors, budget)
    want, _ = _brute(sizes, errors, budget)
    assert sum(s[j] for s, j in zip(sizes, picks)) <= budget
    assert err == pytest.approx(want, abs=1e-12)
    # a coarser unit never breaks the budget and is never better than the optimum
    try:
        picks2, err2 = solve_mck(sizes, errors, budget, unit=4)
    except BudgetError as e:  # rounding up to 4-byte units can make a tight budget infeasible
        assert "resolution" in str(e)
    else:
        assert sum(s[j] for s, j in zip(sizes, picks2)) <= budget and err2 >= want - 1e-12


def test_knapsack_budget_below_minimum():
    with pytest.raises(BudgetError, match="smallest possible total size 3"):
        solve_mck([[1, 5], [2, 3]], [[1.0, 0.0], [1.0, 0.0]], 2)


def test_layer_group_keeps_the_recipes_layout():
    assert layer_group(576, 128) == 128  # SmolLM2 width: 576 = 4 x 128 + a short group of 64, as w4g128-rtn
    assert layer_group(1536, 128) == 128
    assert layer_group(64, 128) == 64
    assert layer_group(576, None) is None


def test_uniform_candidate_is_the_recipe_of_the_same_name():
    """On a 576-wide layer (groups 128 + a short last one) the candidate quantizes as the built-in recipe."""
    from eqjax.core.numerics import dequantize, fake_quantize
    from eqjax.recipes.registry import get_recipe

    w = jax.random.normal(jax.random.key(1), (576, 96))
    q = quantize({"k": {"kernel": w}}, get_recipe("w4g128-rtn"), example=(jnp.ones((1, 576)),),
                 model=lambda p, x: x @ p["k"]["kernel"])
    np.testing.assert_array_equal(np.asarray(dequantize(q["k"]["kernel"])),
                                  np.asarray(fake_quantize(w, Candidate(4, 128).spec(576))))


@pytest.fixture(scope="module")
def tiny():
    model = Model(LlamaConfig(vocab=96, hidden=64, intermediate=128, n_layers=2, n_heads=4, n_kv_heads=2))
    params = model.init_params(jax.random.key(0), std=0.1)
    cal = np.random.default_rng(0).integers(0, 96, (2, 16)).astype(np.int32)
    return model, params, cal, collect_hessians(model, params, cal)


CANDS = (Candidate(2, 32), Candidate(3, 32), Candidate(4, 32), Candidate(4, 64), Candidate(8, None, True))


def test_hessians_are_input_second_moments(tiny):
    model, params, cal, H = tiny
    assert len(H) == 2 * 7 + 1 and "lm_head/kernel" in H  # untied head is a matmul weight too
    from eqjax.models.llama import rms_norm

    h = model.embed(params, jnp.asarray(cal))
    x = np.asarray(rms_norm(h, params["layers_0"]["attn_norm"]["scale"], model.config.rms_norm_eps)).reshape(-1, 64)
    np.testing.assert_allclose(H["layers_0/attn/q_proj/kernel"], x.T @ x / x.shape[0], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("budget_bits", [3.0, 4.5])
def test_search_recipe_valid_and_within_budget(tiny, budget_bits):
    model, params, cal, H = tiny
    res = search(model, params, cal, budget_bits=budget_bits, candidates=CANDS, hessians=H, pareto_bits=(3.0, 5.0))
    assert res.avg_bits <= budget_bits
    qp = quantize(params, res.recipe)
    numel = sum(L.numel for L in res.layers)
    fixed = tree_nbytes(params) - numel * 4
    assert tree_nbytes(qp) == res.total_bytes == fixed + res.searched_bytes
    # the recipe round-trips through a recipe file dict and gives the same tree
    again = recipe_from_dict(json.loads(json.dumps(res.recipe_dict())))
    assert tree_nbytes(quantize(params, again)) == res.total_bytes
    logits, _ = model.apply(qp, jnp.asarray(cal))
    assert np.isfinite(np.asarray(logits)).all()
    # more bits never increase the optimal proxy error
    errs = [p["proxy_error"] for p in sorted(res.pareto, key=lambda p: p["budget_bits"])]
    assert all(a >= b - 1e-9 for a, b in zip(errs, errs[1:]))


@pytest.mark.parametrize("method", ["gptq", "gptq-search"])
def test_search_mix_applied_by_gptq(tiny, method):
    """The searched formats applied by GPTQ (one pass, each layer in its own format): the same bytes as the
    RTN-applied mix, each kernel with the format the search chose, and a recipe file that reads back."""
    from eqjax.methods.gptq import GPTQ

    model, params, cal, H = tiny
    res = search(model, params, cal, budget_bits=3.5, candidates=CANDS, hessians=H, pareto_bits=(), method=method)
    step = res.recipe.steps[0]
    assert isinstance(step, GPTQ) and step.grid == ("search" if method == "gptq-search" else "minmax")
    qp = quantize(params, res.recipe, model=model, calibration=cal)
    assert tree_nbytes(qp) == res.total_bytes
    from eqjax.core.pytree import flatten

    leaves = dict(flatten(qp))
    for L in res.layers:
        assert L.options[[c.label(L.shape[0]) for c in L.options].index(res.choices[L.path])].bits == leaves[L.path].bits
    again = recipe_from_dict(json.loads(json.dumps(res.recipe_dict())))
    assert again.steps[0] == step


def test_search_beats_uniform_at_equal_size_on_the_proxy(tiny):
    model, params, cal, H = tiny
    res = search(model, params, cal, budget_bits=4.5, candidates=CANDS, hessians=H, proxy="hessian")
    uni = uniform_picks(res.layers, Candidate(4, 64))
    uni_bytes = sum(L.nbytes[j] for L, j in zip(res.layers, uni))
    res2 = search(model, params, cal, budget_bytes=uni_bytes + res.total_bytes - res.searched_bytes,
                  candidates=CANDS, hessians=H, proxy="hessian")
    # the same knapsack table answers other budgets: at the uniform's bytes it is res2's solution
    assert [L.options[j].label(L.shape[0]) for L, j in zip(res.layers, res.picks_within(uni_bytes))] == \
        [res2.choices[L.path] for L in res.layers]
    uni_err = sum(L.errors["hessian"][j] for L, j in zip(res.layers, uni))
    got_err = sum(L.errors["hessian"][res2.layers[i].options.index(c)] for i, L in enumerate(res2.layers)
                  for c in [next(o for o in L.options if o.label(L.shape[0]) == res2.choices[L.path])])
    assert res2.searched_bytes <= uni_bytes and got_err <= uni_err
    assert rules_for_picks(res.layers, uni)[0]["group_size"] == 64


def test_budget_below_smallest_model_says_the_minimum(tiny):
    model, params, cal, H = tiny
    with pytest.raises(BudgetError, match=r"below the smallest possible model: 2\.\d+ bits/weight"):
        search(model, params, cal, budget_bits=1.5, candidates=CANDS, hessians=H)
    with pytest.raises(BudgetError, match=r"below the smallest possible model: \d+ bytes"):
        search(model, params, cal, budget_bytes=1000, candidates=CANDS, hessians=H)
    with pytest.raises(BudgetError, match="exactly one"):
        search(model, params, cal, candidates=CANDS, hessians=H)
    # without statistics the same minimum is refused from the traced shapes alone, before any forward pass,
    # and it is the minimum the full table gives (the embedding search, which can shrink the tables, is off)
    said = []
    with pytest.raises(BudgetError) as early:
        search(model, params, cal, budget_bits=1.5, candidates=CANDS, progress=said.append)
    smallest = sum(min(L.nbytes) for L in layer_table(params, H, CANDS))
    assert said == [] and f"({smallest} bytes for the {len(H)} searched kernels" in str(early.value)


@pytest.mark.slow
def test_smollm2_budget_below_minimum_is_reported():
    from eqjax.data import calibration_windows, wikipedia_tokens
    from eqjax.io.gguf import load_gguf

    cfg, params, tok = load_gguf()
    model = Model(cfg)
    cal = calibration_windows(wikipedia_tokens(tok)[0], 1, 64, 0)
    said = []
    with pytest.raises(BudgetError, match=r"1\.0 bits/weight is below the smallest possible model: 2\.\d+ bits/weight"):
        search(model, params, cal, budget_bits=1.0, progress=said.append)
    assert said == []  # refused before the statistics' forward pass


EPS32 = float(np.finfo(np.float32).eps)
FORWARD_ULPS = 32  # two float32 evaluations of one logit (fused or not, AVX2 or AVX-512) differ by <= this many ulps


def _kl64(model, params, qparams, toks):
    """Mean KL(FP || quantized) per prediction, in float64 NumPy from the two models' float32 logits, and the
    absolute tolerance a float32 measurement of it carries (``pytest.approx(kl, abs=tol)``).

    Derivation: the probe computes the same KL from its own float32 evaluation of the same logits. (1) Its
    logits differ from these by ``e`` with ``|e| <= FORWARD_ULPS * eps32 * max|z|`` per logit (summation order
    and SIMD width); the KL's first-order change is ``E_p[d e]`` for the centred logit difference ``d``, so by
    Cauchy-Schwarz ``<= 2 * sqrt(E_p d^2) * max|e|`` (two evaluations, FP and quantized). (2) Its float32
    reduction adds ``<= (V + 8) * eps32 * E_p|d|``: recursive summation of ``V`` terms of size ``p|d|``
    (Higham's ``gamma_V``), plus a few ulps each for the softmax, the centring and ``expm1``.
    """
    def logits(p):
        return np.asarray(model.apply(p, jnp.asarray(toks))[0][:, :-1], np.float64)

    za, zb = logits(params), logits(qparams)

    def logp(z):
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    a, b = logp(za), logp(zb)
    p = np.exp(a)
    kl = float(np.mean(np.sum(p * (a - b), -1)))
    d = (zb - za) - np.sum(p * (zb - za), -1, keepdims=True)
    e = FORWARD_ULPS * EPS32 * max(np.abs(za).max(), np.abs(zb).max())
    forward = 2 * np.sqrt(np.mean(np.sum(p * d * d, -1))) * e
    reduction = (za.shape[-1] + 8) * EPS32 * np.mean(np.sum(p * np.abs(d), -1))
    return kl, float(forward + reduction)


def _close_to_kl64(got, model, params, qparams, toks):
    want, tol = _kl64(model, params, qparams, toks)
    assert got == pytest.approx(want, rel=0, abs=tol), (got, want, tol)


def test_kl_from_logits_against_float64():
    """The probe's float32 KL on given logits against float64, for KLs from 1e-11 to 1: the error is bounded by
    the float32 summation of ``V`` terms of size ``p|d|`` (``(V + 8) * eps32 * E_p|d|``, see :func:`_kl64`)
    plus a few ulps of the KL, far below the ``ulp(log V)`` of a difference of log-probabilities."""
    from eqjax.search.sensitivity import kl_from_logits

    rng = np.random.default_rng(1)
    ref = rng.normal(0, 3, (64, 97)).astype(np.float32)
    for scale in (1e-5, 1e-3, 1e-1, 1.0):
        q = (ref + rng.normal(0, scale, ref.shape)).astype(np.float32)
        a = ref.astype(np.float64)
        b = q.astype(np.float64)
        a = a - a.max(-1, keepdims=True)
        a -= np.log(np.exp(a).sum(-1, keepdims=True))
        b = b - b.max(-1, keepdims=True)
        b -= np.log(np.exp(b).sum(-1, keepdims=True))
        p = np.exp(a)
        want = np.sum(p * (a - b), -1)
        d = (q - ref).astype(np.float64)
        d -= np.sum(p * d, -1, keepdims=True)
        tol = (97 + 8) * EPS32 * np.sum(p * np.abs(d), -1) + 4 * EPS32 * want
        got = np.asarray(kl_from_logits(jnp.asarray(ref), jnp.asarray(q)), np.float64)
        assert np.all(np.abs(got - want) <= tol), (scale, np.max(np.abs(got - want) / tol))


def test_embedding_is_one_more_knapsack_item(tiny):
    """Embedding options: bytes as the +emb recipes store them, KL measured directly (float64 oracle), the
    searched recipe puts the table in its own RTN step and round-trips through a recipe file."""
    from eqjax.recipes.registry import embedding_step
    from eqjax.recipes.types import Recipe

    model, params, cal, H = tiny
    res = search(model, params, cal, budget_bits=3.5, candidates=CANDS, hessians=H, embedding=("int8", "int4"),
                 pareto_bits=(3.0, 16.0))
    emb = [L for L in res.layers if L.is_embedding]
    assert len(emb) == 1 and [o.kind for o in emb[0].options] == ["float", "int8", "int4"]
    (L,) = emb
    assert L.nbytes[0] == params["embed"]["embedding"].nbytes
    for j, kind in ((1, "int8"), (2, "int4")):
        qp = quantize(params, Recipe(kind, (embedding_step(kind),)), model=model)
        assert L.nbytes[j] == tree_nbytes(qp) - tree_nbytes(params) + L.nbytes[0]
        _close_to_kl64(L.errors["kl"][j], model, params, qp, cal)
    # the budget counts the tables: linears at 3.5 bits on average with the table float, spent as found best
    linear_numel = sum(x.numel for x in res.layers if not x.is_embedding)
    fixed = tree_nbytes(params) - linear_numel * 4 - L.nbytes[0]
    assert res.searched_bytes <= int(3.5 * linear_numel / 8) + L.nbytes[0]
    qp = quantize(params, res.recipe, model=model)
    assert tree_nbytes(qp) == res.total_bytes == fixed + res.searched_bytes
    d = res.recipe_dict()
    table = res.choices[L.path]
    assert [s["method"] for s in d["steps"]] == (["rtn"] if table == "emb-float" else ["rtn", "rtn"])
    assert tree_nbytes(quantize(params, recipe_from_dict(json.loads(json.dumps(d))), model=model)) == res.total_bytes
    # with room for everything the float table (no error) is kept; uniform baselines keep it float
    top = max(res.pareto, key=lambda p: p["budget_bits"])
    assert top["choice_counts"].get("emb-float") == 1
    assert uniform_picks(res.layers, Candidate(4, 64))[res.layers.index(L)] == 0


def test_a_16_bit_table_is_an_option_and_its_own_last_step(tiny):
    """``f16`` / ``bf16`` table options: half the float bytes, KL measured directly (float64 oracle against
    the table rounded to 16 bits), a ``half`` step after every other in the searched recipe, which
    round-trips through a recipe file; with the freed bytes worth more than its KL, the search takes it."""
    from eqjax.core.qarray import HalfFloat
    from eqjax.methods.halffloat import HalfFloats
    from eqjax.recipes.types import Recipe

    model, params, cal, H = tiny
    res = search(model, params, cal, budget_bits=3.0, candidates=CANDS, hessians=H, embedding=("f16", "bf16"),
                 pareto_bits=(3.0,))
    (L,) = [x for x in res.layers if x.is_embedding]
    assert [o.kind for o in L.options] == ["float", "f16", "bf16"]
    assert L.nbytes[1] == L.nbytes[2] == L.nbytes[0] // 2
    for j, dtype in ((1, "float16"), (2, "bfloat16")):
        qp = quantize(params, Recipe(dtype, (HalfFloats(dtype, "embed/embedding"),)), model=model)
        assert L.errors["kl"][j] > 0
        _close_to_kl64(L.errors["kl"][j], model, params, qp, cal)
    assert L.errors["kl"][1] < L.errors["kl"][2]  # float16 keeps 3 more mantissa bits
    assert res.choices[L.path] == "emb-f16"
    d = res.recipe_dict()
    assert d["steps"][-1] == {"method": "half", "dtype": "float16", "pattern": "embed/embedding"}
    for recipe in (res.recipe, recipe_from_dict(json.loads(json.dumps(d)))):
        qp = quantize(params, recipe, model=model)
        assert isinstance(qp["embed"]["embedding"], HalfFloat) and tree_nbytes(qp) == res.total_bytes


def test_embedding_options_need_the_kl_proxy(tiny):
    model, params, cal, H = tiny
    with pytest.raises(ValueError, match="kl proxy only"):
        search(model, params, cal, budget_bits=4.0, candidates=CANDS, hessians=H, proxy="hessian", embedding=("int8",))
