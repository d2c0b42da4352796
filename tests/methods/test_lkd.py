"""ZeroQuant + layer-by-layer distillation: lowers block-output MSE vs plain ZeroQuant."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqjax.qarray import ActQuantKernel
from eqjax.methods.lkd import ZeroQuantLKD
from eqjax.models import LlamaConfig, Model
from eqjax.recipe import Recipe, RecipeError, quantize, recipe_from_dict

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


def test_time_budget_caps_steps():
    model = Model(dataclasses.replace(CFG, n_layers=2))
    params = model.init_params(jax.random.key(0), std=0.2)
    toks = jax.random.randint(jax.random.key(1), (8, 16), 0, 64, dtype=jnp.int32)
    step = ZeroQuantLKD(bits=4, group_size=16, steps=1_000_000, time_budget=20.0)
    t0 = time.perf_counter()
    quantize(params, Recipe("lkd", (step,)), model=model, calibration=toks)
    steps = [r["steps"] for r in step.report.values()]  # two layers and the lm_head
    assert len(steps) == 3 and all(s < 1_000_000 for s in steps), step.report
    assert steps[0] >= 3, step.report  # the first block times three steps before it stops
    assert time.perf_counter() - t0 < 120


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
