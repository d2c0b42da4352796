"""Calibration driver and statistics: capture equals the model's own computation, statistics merge
associatively, the sink-token weighting, clear errors for bad windows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqjax import calibrate as C
from eqjax.models import GPT2Config, LlamaConfig, Model
from eqjax.models import gpt2 as gpt2_mod
from eqjax.models import llama as llama_mod

STATS = {"absmax": C.absmax(), "min": C.minimum(), "max": C.maximum(), "abs_mean": C.abs_sum(), "xtx": C.xtx(),
         "n": C.count()}


@pytest.fixture(scope="module")
def tiny():
    model = Model(LlamaConfig(vocab=64, hidden=32, intermediate=48, n_layers=2, n_heads=4, n_kv_heads=2))
    params = model.init_params(jax.random.key(0), std=0.1)
    toks = np.asarray(jax.random.randint(jax.random.key(1), (3, 10), 0, 64), np.int32)
    return model, params, toks


def test_statistics_merge_associatively():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(40, 6)), jnp.float32)
    w = jnp.asarray(rng.uniform(size=40) * (rng.uniform(size=40) > 0.2), jnp.float32)
    for name, st in STATS.items():
        whole = st.update(st.init(6), x, w)
        a = st.update(st.init(6), x[:17], w[:17])
        b = st.update(st.init(6), x[17:], w[17:])
        merged = C.merge(st, a, b)
        assert st.merge in ("max", "min", "sum")
        for u, v in zip(jax.tree.leaves(merged), jax.tree.leaves(whole)):
            np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-5, err_msg=name)
    xs = np.asarray(x)[np.asarray(w) > 0]
    np.testing.assert_allclose(C.absmax().update(C.absmax().init(6), x, w), np.abs(xs).max(0), rtol=1e-6)
    wn = np.asarray(w)
    xtx = C.xtx().finalize(C.xtx().update(C.xtx().init(6), x, w))
    np.testing.assert_allclose(xtx, (np.asarray(x) * wn[:, None]).T @ np.asarray(x) / wn.sum(), rtol=1e-4)


def test_capture_matches_model_sub_functions(tiny):
    model, params, toks = tiny
    lp = params["layers_1"]
    h = jax.random.normal(jax.random.key(2), (3, 10, 32))
    pos = model.positions(3, 10)
    out, rec = jax.jit(lambda lp, h: C.capture_linear_inputs(model, lp, h, pos, layer_index=1))(lp, h)
    ref, _ = model.block(lp, h, pos, layer_index=1)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6)  # jit vs eager
    eps = model.config.rms_norm_eps
    x1 = llama_mod.rms_norm(h, lp["attn_norm"]["scale"], eps)
    for p in ("attn/q_proj", "attn/k_proj", "attn/v_proj"):
        np.testing.assert_allclose(rec[p], x1, rtol=1e-6, atol=1e-6)
    # o_proj's input reproduces the attention output; down_proj's is silu(gate) * up of the mlp norm
    a = jnp.matmul(rec["attn/o_proj"], lp["attn"]["o_proj"]["kernel"])
    h2 = h + a
    x2 = llama_mod.rms_norm(h2, lp["mlp_norm"]["scale"], eps)
    np.testing.assert_allclose(rec["mlp/gate_proj"], x2, rtol=1e-5, atol=1e-5)
    m = lp["mlp"]
    act = jax.nn.silu(x2 @ m["gate_proj"]["kernel"]) * (x2 @ m["up_proj"]["kernel"])
    np.testing.assert_allclose(rec["mlp/down_proj"], act, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(h2 + rec["mlp/down_proj"] @ m["down_proj"]["kernel"], out, rtol=1e-4, atol=1e-5)
    # the model's module is restored after tracing
    assert llama_mod.linear is __import__("sys").modules["eqjax.linear"].linear


def test_capture_gpt2():
    model = Model(GPT2Config(vocab=32, hidden=16, intermediate=32, n_layers=1, n_heads=2, n_positions=16))
    params = model.init_params(jax.random.key(0))
    h = model.embed(params, jnp.zeros((1, 5), jnp.int32))
    pos = model.positions(1, 5)
    _, rec = jax.jit(lambda lp, h: C.capture_linear_inputs(model, lp, h, pos, layer_index=0))(params["layers_0"], h)
    assert set(rec) == {"attn/c_attn", "attn/c_proj", "mlp/c_fc", "mlp/c_proj"}
    np.testing.assert_allclose(rec["attn/c_attn"], gpt2_mod.layer_norm(h, params["layers_0"]["ln_1"], 1e-5), atol=1e-5)


def test_layerwise_statistics_and_sink_weighting(tiny):
    model, params, toks = tiny
    seen = {}

    def per_layer(name, lp, cal):
        seen[name] = (cal.inputs, cal.statistics({"xtx": C.xtx(), "n": C.count(), "absmax": C.absmax()}, lp))
        return lp

    out = C.run_layerwise(model, params, toks, per_layer, batch_size=2, sink_tokens=1)
    assert out["layers_0"] is params["layers_0"]
    # layer 1's inputs are layer 0's outputs on the embedded windows
    h0 = model.embed(params, jnp.asarray(toks))
    h1, _ = model.block(params["layers_0"], h0, model.positions(3, 10), layer_index=0)
    np.testing.assert_allclose(seen["layers_1"][0], h1, rtol=1e-5, atol=1e-5)
    st = seen["layers_0"][1]["attn/q_proj"]
    x = np.asarray(llama_mod.rms_norm(h0, params["layers_0"]["attn_norm"]["scale"], model.config.rms_norm_eps))[:, 1:].reshape(-1, 32)
    assert float(st["n"]) == 3 * 9  # first position of every window excluded
    np.testing.assert_allclose(st["xtx"], x.T @ x / len(x), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(st["absmax"], np.abs(x).max(0), rtol=1e-5)
    # shared inputs share statistics
    np.testing.assert_array_equal(seen["layers_0"][1]["attn/k_proj"]["xtx"], st["xtx"])


def test_bad_windows_are_clear_errors(tiny):
    model, params, toks = tiny
    ident = lambda name, lp, cal: lp  # noqa: E731
    with pytest.raises(C.CalibrationError, match="non-empty"):
        C.run_layerwise(model, params, np.zeros((0, 10), np.int32), ident)
    with pytest.raises(C.CalibrationError, match="no calibration windows"):
        C.run_layerwise(model, params, None, ident)
    with pytest.raises(C.CalibrationError, match="too short"):
        C.run_layerwise(model, params, toks[:, :1], ident, sink_tokens=1)
    with pytest.raises(C.CalibrationError, match="integer"):
        C.run_layerwise(model, params, toks.astype(np.float32), ident)
