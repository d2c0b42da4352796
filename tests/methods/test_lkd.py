"""ZeroQuant + layer-by-layer distillation: lowers block-output MSE vs plain ZeroQuant."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqjax.core.errors import RecipeError
from eqjax.core.qarray import ActQuantKernel
from eqjax.methods.lkd import ZeroQuantLKD
from eqjax.models import LlamaConfig, Model
from eqjax.recipes.apply import quantize
from eqjax.recipes.registry import recipe_from_dict
from eqjax.recipes.types import Recipe

CFG = LlamaConfig(vocab=64, hidden=32, intermediate=64, n_layers=1, n_heads=4, n_kv_heads=2)


def test_lkd_lowers_block_mse_and_quantizes():
    model = Model(CFG)
    params = model.init_params(jax.random.key(0), std=0.2)
    toks = jax.random.randint(jax.random.key(1), (8, 16), 0, 64, dtype=jnp.int32)
    plain = ZeroQuantLKD(bits=4, group_size=16, steps=0)
    q0 = quantize(params, Recipe("zq", (plain,)), model=model, calibration=toks)
    lkd = ZeroQuantLKD(bits=4, group_size=16, steps=60, lr=1e-4, keep_better=False)
    q1 = quantize(params, Recipe("lkd", (lkd,)), model=model, calibration=toks)
    for name in model.layer_names:
        r = lkd.report[name]
        assert r["mse_rtn"] == pytest.approx(plain.report[name]["mse_rtn"], rel=1e-5)
        assert r["mse_lkd"] < 0.8 * r["mse_rtn"], r
        k = q1[name]["attn"]["q_proj"]["kernel"]
        assert isinstance(k, ActQuantKernel) and k.weight.bits == 4 and k.weight.granularity.group_size == 16
    ref = model.apply(params, toks)[0]
    e0 = float(jnp.mean((model.apply(q0, toks)[0] - ref) ** 2))
    e1 = float(jnp.mean((model.apply(q1, toks)[0] - ref) ** 2))
    assert e1 < e0


def test_config_and_errors():
    r = recipe_from_dict({"name": "x", "steps": [{"method": "zeroquant_lkd", "bits": 4, "group_size": 64, "steps": 10}]})
    assert r.steps[0] == ZeroQuantLKD(bits=4, group_size=64, steps=10) and r.needs_calibration
    with pytest.raises(RecipeError, match="unknown"):
        recipe_from_dict({"name": "x", "steps": [{"method": "zeroquant_lkd", "epochs": 3}]})
    model = Model(CFG)
    params = model.init_params(jax.random.key(0))
    with pytest.raises(RecipeError, match="calibration"):
        quantize(params, Recipe("x", (ZeroQuantLKD(),)), model=model)
    with pytest.raises(ValueError):
        ZeroQuantLKD(steps=-1)
    with pytest.raises(ValueError, match="time_budget"):
        ZeroQuantLKD(time_budget=0)
    r = recipe_from_dict({"name": "x", "steps": [{"method": "zeroquant_lkd", "time_budget": 90}]})
    assert r.steps[0].time_budget == 90


class FakeClock:
    """Stands in for the ``time`` module: each training step costs a fixed time (the first of a block,
    its compile, 1/4 s; the others 1/16 s: binary fractions, exact); nothing else costs any."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def _injected_clock(monkeypatch, module):
    from eqjax.calibration import blockfit

    clock = FakeClock()
    monkeypatch.setattr(blockfit, "time", clock)
    monkeypatch.setattr(module, "time", clock)
    after = blockfit.StepBudget.after

    def timed_after(self, done, out):
        clock.now += 0.25 if done == 1 else 1 / 16
        return after(self, done, out)

    monkeypatch.setattr(blockfit.StepBudget, "after", timed_after)
    return clock


@pytest.mark.parametrize("budget,expected", [(3.0, [13, 13, 13]), (0.75, [3, 3, 0])])
def test_time_budget_caps_steps(monkeypatch, budget, expected):
    """Two layers and the lm_head under an injected clock. 3 s: each block gets (3 - spent) / blocks
    left = 1 s, and its count is fixed after step 3 from steps 2-3 (1/16 s each): 3 + (1 - 1/4 - 2/16) /
    (1/16) = 13 steps, which spend the second exactly. 0.75 s: 1/4 s per block is gone after the first
    three steps (a block always takes three, 3/8 s), the second block gets (0.75 - 3/8) / 2 and also takes
    three, and the third gets nothing: no training, the plain ZeroQuant result."""
    import eqjax.methods.lkd as lkd_module

    clock = _injected_clock(monkeypatch, lkd_module)
    model = Model(dataclasses.replace(CFG, n_layers=2))
    params = model.init_params(jax.random.key(0), std=0.2)
    toks = jax.random.randint(jax.random.key(1), (8, 16), 0, 64, dtype=jnp.int32)
    step = ZeroQuantLKD(bits=4, group_size=16, steps=1_000_000, time_budget=budget)
    quantize(params, Recipe("lkd", (step,)), model=model, calibration=toks)
    assert [r["steps"] for r in step.report.values()] == expected, step.report
    assert clock.now == budget
    if expected[-1] == 0:
        assert "mse_lkd" not in list(step.report.values())[-1]


@pytest.mark.slow
def test_lkd_on_smollm2_first_layers():
    """Real weights (first 3 blocks of SmolLM2-135M), W4 g64 A8: LKD lowers the block-output MSE."""
    import dataclasses

    from eqjax import data
    from eqjax.io.gguf import load_gguf

    cfg, params, tok = load_gguf()
    cfg = dataclasses.replace(cfg, n_layers=3)
    params = {k: v for k, v in params.items() if not k.startswith("layers_") or int(k[7:]) < 3}
    model = Model(cfg)
    cal_ids, _ = data.wikipedia_tokens(tok)
    cal = data.calibration_windows(cal_ids, 4, 256, seed=0)
    step = ZeroQuantLKD(bits=4, group_size=64, steps=30, lr=5e-5)
    quantize(params, Recipe("lkd", (step,)), model=model, calibration=cal)
    rtn = np.mean([r["mse_rtn"] for r in step.report.values()])
    lkd = np.mean([r["mse_lkd"] for r in step.report.values()])
    assert lkd < rtn, step.report
