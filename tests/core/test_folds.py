"""Folds found from the graph, and the property that makes them folds: dividing the targets by any
per-channel scale and multiplying the weights' input rows by it leaves the model's output unchanged."""

import jax.numpy as jnp
import numpy as np
import pytest

from eqjax.core.analysis import analyze, from_weight_matrix, group_uses_by_input, weight_matrix
from eqjax.core.folds import find_fold
from eqjax.core.program import trace
from eqjax.core.pytree import flatten_with_paths, unflatten_paths
from eqjax.methods.awq import apply_fold
from tests import zoo


@pytest.fixture(scope="module")
def models():
    return zoo.all_models()


def _folds(models, name):
    fn, params, batches = models[name]
    an = analyze(trace(fn, params, batches[0]))
    return fn, params, batches, an, [(g, *find_fold(an, g)) for g in group_uses_by_input(an.uses)]


def _last(path):
    return path.split("/")[-2]


EXPECTED = {
    # group (last path component before the leaf) -> fold kind, or None (not foldable)
    "hf-llama": {"q_proj": "norm", "o_proj": "linear", "gate_proj": "norm", "down_proj": "linear", "lm_head": "norm"},
    "eqjax-llama": {"q_proj": "norm", "o_proj": "linear", "gate_proj": "norm", "down_proj": "linear"},
    "eqjax-gpt2": {"c_attn": "norm", "c_fc": "norm"},
    "hf-gpt2": {"c_attn": "norm", "c_fc": "norm"},
    "linen": {"qkv": "norm", "out": "linear", "gate": "norm", "down": "linear", "head": "norm"},
    "nnx": {"qkv": "norm", "out": "linear", "up": "norm", "down": None, "head": None},
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_folds_found_where_expected(models, name):
    *_, folds = _folds(models, name)
    got = {}
    for g, fold, why in folds:
        for u in g:
            key = _last(u.path)
            if key in EXPECTED[name]:
                got[key] = None if fold is None else fold.kind
                if fold is None:
                    assert why  # every refusal says why
    for k, v in EXPECTED[name].items():
        assert got.get(k, "missing") == v, (k, got)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_fold_preserves_the_function(models, name):
    fn, params, batches, an, folds = _folds(models, name)
    paths, leaves, _ = flatten_with_paths(params)
    flat = {p: jnp.asarray(x, jnp.float32) for p, x in zip(paths, leaves)}
    rng = np.random.default_rng(0)
    n = 0
    for g, fold, _ in folds:
        if fold is None:
            continue
        tie = fold.tie
        s = rng.uniform(0.5, 2.0, size=int(tie.max()) + 1)
        new = apply_fold(dict(flat), fold, s, tie)
        se = jnp.asarray(s[tie], jnp.float32)
        for u in g:
            new[u.path] = from_weight_matrix(weight_matrix(flat[u.path], u) * se[:, None], u, flat[u.path])
        for b in batches[:1]:
            ref = np.asarray(fn(params, *b))
            got = np.asarray(fn(unflatten_paths(new, params), *b))
            np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4, err_msg=g[0].path)
        n += 1
    assert n >= 2


def test_gqa_channels_tie(models):
    *_, folds = _folds(models, "hf-llama")
    fold = next(f for g, f, _ in folds if _last(g[0].path) == "o_proj")
    # 4 query heads share 2 kv heads: o_proj's 32 input channels come from v_proj's 16 outputs
    assert fold.targets[0].index.shape == (32, 1) and len(np.unique(fold.tie)) == 16
