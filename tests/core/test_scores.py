"""Which output columns of a weight feed attention scores, found by data flow on models of several
layouts (separate, fused on a leading axis, fused on the output axis)."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from eqjax.core.analysis import analyze
from eqjax.core.program import trace
from eqjax.core.scores import score_columns
from eqjax.models import GPT2Config, LlamaConfig, Model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import layout_models as lm  # noqa: E402

CFG = LlamaConfig(vocab=48, hidden=64, intermediate=96, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16)
IDS = jnp.zeros((1, 8), jnp.int32)


def _scores(fn, params) -> dict[str, np.ndarray]:
    an = analyze(trace(fn, params, (IDS,)))
    return {u.path: score_columns(an, u) for u in an.uses}


def _expect(got: dict[str, np.ndarray], want: dict[str, tuple[int, int]]) -> None:
    """``want``: path suffix -> (first, stop) of the score columns (an empty range: none)."""
    for suffix, (lo, hi) in want.items():
        (path,) = [p for p in got if p.endswith(suffix)]
        m = got[path]
        assert np.flatnonzero(m).tolist() == list(range(lo, hi)), (path, np.flatnonzero(m))
    assert not any(m.any() for p, m in got.items() if not any(p.endswith(s) for s in want))


def test_separate_projections():
    model = Model(CFG)
    got = _scores(lambda p, i: model.apply(p, i)[0], model.init_params(jax.random.key(0)))
    _expect(got, {"q_proj/kernel": (0, 64), "k_proj/kernel": (0, 32), "v_proj/kernel": (0, 0)})


@pytest.mark.parametrize("style", ["gemma", "linen"])
def test_fused_kv_scores_only_its_key_half(style):
    params = Model(CFG).init_params(jax.random.key(0))
    if style == "gemma":
        gd, state = nnx.split(lm.gemma_style_from_llama(CFG, params))
        got = _scores(lambda s, i: nnx.merge(gd, s)(i), state)
        _expect(got, {"q_einsum/w/value": (0, 64), "kv_einsum/w/value": (0, 32)})
    else:
        mod, variables = lm.einsum_linen_from_llama(CFG, params)
        got = _scores(mod.apply, variables)
        _expect(got, {"q/kernel": (0, 64), "kv/kernel": (0, 32)})


def test_gpt2_fused_qkv_scores_its_query_and_key_thirds():
    model = Model(GPT2Config(vocab=48, hidden=32, n_layers=1, n_heads=4, n_positions=16))
    got = _scores(lambda p, i: model.apply(p, i)[0], model.init_params(jax.random.key(0)))
    _expect(got, {"c_attn/kernel": (0, 64)})
