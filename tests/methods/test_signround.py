"""SignRound (learned rounding): lowers the block output error, stores ordinary QArrays, iters=0 is RTN,
the time budget caps the iterations, the differentiable fake quantizer agrees with the stored grid."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqjax.core.errors import RecipeError
from eqjax.core.numerics import QuantSpec, dequantize, fake_quantize_grid, quantize, quantize_with
from eqjax.core.qarray import QArray, per_group, validate
from eqjax.methods.rtn import RTN
from eqjax.methods.signround import SignRound
from eqjax.models import LlamaConfig, Model
from eqjax.recipes.apply import quantize as run_recipe
from eqjax.recipes.registry import recipe_from_dict, weight_rule
from eqjax.recipes.types import Recipe

CFG = LlamaConfig(vocab=64, hidden=32, intermediate=64, n_layers=2, n_heads=4, n_kv_heads=2)


def _setup():
    model = Model(CFG)
    params = model.init_params(jax.random.key(0), std=0.2)
    toks = jax.random.randint(jax.random.key(1), (16, 16), 0, 64, dtype=jnp.int32)
    return model, params, toks


def _kernels(q):
    return {f"{n}/{m}": q[n][b][m]["kernel"] for n in ("layers_0", "layers_1")
            for b, ms in (("attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")))
            for m in ms}


def test_signround_lowers_block_error_and_stores_rtn_layout():
    model, params, toks = _setup()
    rtn = run_recipe(params, Recipe("r", (RTN((weight_rule(3, symmetric=False, group=16),)),)), model=model)
    step = SignRound(bits=3, group_size=16, iters=60, keep_better=False)
    q = run_recipe(params, Recipe("s", (step,)), model=model, calibration=toks)
    for name in ("layers_0", "layers_1"):
        r = step.report[name]
        assert r["iters"] == 60 and r["mse_trained"] < 0.8 * r["mse_init"], r
    for path, k in _kernels(q).items():
        k0 = _kernels(rtn)[path]
        assert isinstance(k, QArray) and validate(k) is k
        assert (k.nbytes, k.granularity, k.values.shape, k.values.dtype) == (k0.nbytes, k0.granularity, k0.values.shape,
                                                                             k0.values.dtype)
    ev = jax.random.randint(jax.random.key(2), (8, 16), 0, 64, dtype=jnp.int32)
    ref = model.apply(params, ev)[0]
    e = lambda p: float(jnp.mean((model.apply(p, ev)[0] - ref) ** 2))  # noqa: E731
    assert e(q) < e(rtn)


@pytest.mark.parametrize("sym", [False, True])
def test_zero_iterations_is_round_to_nearest(sym):
    model, params, toks = _setup()
    q = run_recipe(params, Recipe("s", (SignRound(bits=4, group_size=16, symmetric=sym, iters=0, init="minmax"),)),
                   model=model, calibration=toks)
    rtn = run_recipe(params, Recipe("r", (RTN((weight_rule(4, symmetric=sym, group=16),)),)), model=model)
    for path, k in _kernels(q).items():
        np.testing.assert_array_equal(np.asarray(dequantize(k)), np.asarray(dequantize(_kernels(rtn)[path])), path)


def test_time_budget_caps_iterations(monkeypatch):
    """Injected clock (no wall time): each iteration costs a fixed time, the first of a block (its
    compile) 1/4 s, the others 1/16 s (binary fractions, exact); nothing else costs any. Three blocks
    (two layers and the lm_head), each given (budget - spent) / blocks left, its count fixed after
    iteration 3 from iterations 2-3. 1.5 s: 1/2 s each, 3 + (1/2 - 1/4 - 2/16) / (1/16) = 5 iterations,
    the budget spent exactly. 0.75 s: the first block's 1/4 s is gone after its three iterations (3/8 s;
    a block always takes three), the second gets (3/4 - 3/8) / 2 and takes three too, the third gets
    nothing and keeps round to nearest (0 iterations)."""
    import eqjax.methods.signround as sr_module
    from eqjax.calibration import blockfit

    clock = type("Clock", (), {"now": 0.0, "perf_counter": lambda self: self.now})()
    monkeypatch.setattr(blockfit, "time", clock)
    monkeypatch.setattr(sr_module, "time", clock)
    after = blockfit.StepBudget.after

    def timed_after(self, done, out):
        clock.now += 0.25 if done == 1 else 1 / 16
        return after(self, done, out)

    monkeypatch.setattr(blockfit.StepBudget, "after", timed_after)
    model, params, toks = _setup()
    for budget, expected in ((1.5, [5, 5, 5]), (0.75, [3, 3, 0])):
        clock.now = 0.0
        step = SignRound(bits=3, group_size=16, iters=100_000, time_budget=budget)
        run_recipe(params, Recipe("s", (step,)), model=model, calibration=toks)
        assert [r["iters"] for r in step.report.values()] == expected, step.report
        assert clock.now == budget


def test_fake_quantize_grid_matches_stored_grid_and_has_gradients():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(40, 6)), jnp.float32)  # groups of 16: a short last group of 8
    gran = per_group(0, 16)
    for sym in (True, False):
        q = quantize(w, QuantSpec(3, sym, gran, scale_dtype="float16", full_range=sym))
        s = q.scale.astype(jnp.float32)
        z = None if sym else q.zero_point.astype(jnp.float32)
        np.testing.assert_array_equal(np.asarray(fake_quantize_grid(w, s, z, bits=3, granularity=gran)),
                                      np.asarray(dequantize(q)))
        v = jnp.asarray(rng.uniform(-0.5, 0.5, size=w.shape), jnp.float32)
        # an offset moves codes exactly as quantizing w + v * scale on the same grid
        expand = jnp.repeat(s, 16, axis=0)[:40]
        q2 = quantize_with(w + v * expand, q.scale, q.zero_point, bits=3, granularity=gran)
        np.testing.assert_allclose(np.asarray(fake_quantize_grid(w, s, z, bits=3, granularity=gran, offset=v)),
                                   np.asarray(dequantize(q2)), rtol=1e-6, atol=1e-7)
        g = jax.grad(lambda o: jnp.sum(fake_quantize_grid(w, s, z, bits=3, granularity=gran, offset=o) ** 2))(v)
        assert float(jnp.max(jnp.abs(g))) > 0


def test_config_keys_and_errors():
    r = recipe_from_dict({"name": "x", "steps": [{"method": "signround", "bits": 3, "iters": 50, "optimizer": "adam",
                                                  "lr": 0.001, "init": "search", "time_budget": 600}]})
    assert r.steps[0] == SignRound(bits=3, iters=50, optimizer="adam", lr=0.001, init="search", time_budget=600.0)
    with pytest.raises(RecipeError, match="optimizer"):
        recipe_from_dict({"name": "x", "steps": [{"method": "signround", "optimizer": "sgd"}]})
    with pytest.raises(RecipeError, match="iters"):
        recipe_from_dict({"name": "x", "steps": [{"method": "signround", "iters": 2.5}]})
    model, params, _ = _setup()
    with pytest.raises(RecipeError, match="calibration"):
        run_recipe(params, Recipe("x", (SignRound(),)), model=model)
