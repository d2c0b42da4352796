"""The block-by-block driver on any model: blocks found from param paths, captured statistics equal
independent oracles (Flax's own method interception, eqjax's model sub-functions), sink weighting,
sequential semantics, clear errors."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqjax.calibration.calibrate import CalibrationError, Calibrator, as_batches
from eqjax.calibration.statistics import absmax, count, xtx
from eqjax.core.pytree import flatten_with_paths
from eqjax.models import llama as llama_mod
from tests import zoo


def _flat(params):
    paths, leaves, _ = flatten_with_paths(params)
    return dict(zip(paths, leaves))


@pytest.mark.parametrize("name, blocks", [
    ("hf-llama", ["model/layers/0", "model/layers/1", "lm_head/kernel"]),
    ("linen", ["block_0", "block_1", "head/kernel"]),
    ("nnx", ["blocks/0", "blocks/1", "head/kernel"]),
    ("eqjax-llama", ["layers_0", "layers_1", "lm_head/kernel"]),
])
def test_blocks_found_from_param_paths(name, blocks):
    fn, params, batches = zoo.all_models()[name]
    cal = Calibrator.from_model(fn, params, batches)
    assert [b.name for b in cal.blocks] == blocks
    stops = [b.stop for b in cal.blocks]
    assert stops == sorted(stops) and cal.blocks[0].start == 0


def test_statistics_equal_flax_interception_oracle():
    """Inputs of q_proj in layer 1 of HF's FlaxLlama, captured by nn.intercept_methods (an independent path)."""
    hm = zoo.make_hf_llama(layers=3)
    batches = zoo.hf_batches()
    cal = Calibrator.from_model(zoo.hf_fn(hm), hm.params, batches)
    got = {}

    def per_block(bc, p):
        got.update(bc.statistics({"xtx": xtx(), "absmax": absmax(), "n": count()}))
        return p

    cal.run_blocks(_flat(hm.params), per_block)
    xs = []

    def icp(next_fun, args, kwargs, context):
        m = context.module
        if isinstance(m, nn.Dense) and m.name == "q_proj" and m.scope.path[-3] == "1":
            xs.append(np.asarray(args[0]))
        return next_fun(*args, **kwargs)

    for b in batches:
        with nn.intercept_methods(icp):
            hm.module.apply({"params": hm.params}, *b)
    x = np.concatenate(xs).reshape(-1, 32).astype(np.float64)
    st = got["model/layers/1/self_attn/q_proj/kernel"]
    np.testing.assert_allclose(st["xtx"], x.T @ x / len(x), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(st["absmax"], np.abs(x).max(0), rtol=1e-6)
    assert float(st["n"]) == len(x)
    # q/k/v read one input: their statistics are computed once and shared
    assert got["model/layers/1/self_attn/k_proj/kernel"] is st


def _layer0_stats(key: int, shape: tuple[int, int], stats: dict, **kw):
    """Statistics of layers_0's q_proj input through the Calibrator, and that input [B, T, 32] (float64)."""
    model, params = zoo.make_eqjax("llama")
    toks = np.asarray(jax.random.randint(jax.random.key(key), shape, 0, 64), np.int32)
    cal = Calibrator.from_model(lambda p, t: model.apply(p, t)[0], params, [(toks,)])
    seen = {}

    def per_block(bc, p):
        seen[bc.name] = bc.statistics(stats, **kw)
        return p

    cal.run_blocks(_flat(params), per_block)
    h0 = model.embed(params, jnp.asarray(toks))
    x = np.asarray(llama_mod.rms_norm(h0, params["layers_0"]["attn_norm"]["scale"], model.config.rms_norm_eps))
    return seen["layers_0"]["layers_0/attn/q_proj/kernel"], x.astype(np.float64)


def test_sink_weighting_and_eqjax_oracle():
    st, x = _layer0_stats(1, (3, 10), {"xtx": xtx(), "n": count(), "absmax": absmax()}, sink_tokens=1)
    x = x[:, 1:].reshape(-1, 32)  # first position of every window excluded
    assert float(st["n"]) == 3 * 9
    np.testing.assert_allclose(st["xtx"], x.T @ x / len(x), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(st["absmax"], np.abs(x).max(0), rtol=1e-5)


def test_sink_upweighting_oracle():
    """sink_weight > 1 (GPTQ's default) up-weights the first position: a float64 weighted X^T W X / sum(w)."""
    st, x = _layer0_stats(2, (2, 6), {"xtx": xtx(), "n": count()}, sink_tokens=1, sink_weight=8.0)
    w = np.where(np.arange(6) == 0, 8.0, 1.0)[None, :].repeat(2, 0).reshape(-1)
    x = x.reshape(-1, 32)
    assert float(st["n"]) == w.sum()
    np.testing.assert_allclose(st["xtx"], (x * w[:, None]).T @ x / w.sum(), rtol=1e-4, atol=1e-6)


def test_identical_blocks_share_one_compiled_step():
    """Decoder layers 1 and 2 of 4 trace to the same step programs (statistics pass, advance pass), so they
    run the same executables (compiled once); layer 0 (which also embeds), the last layer (fewer live
    outputs) and the head have their own. The shared executables still compute each block's own
    statistics (oracle: eqjax's model functions)."""
    from eqjax.models import LlamaConfig, Model

    model = Model(LlamaConfig(vocab=zoo.V, hidden=32, intermediate=64, n_layers=4, n_heads=4, n_kv_heads=2))
    params = model.init_params(jax.random.key(0), std=0.1)
    toks = np.asarray(jax.random.randint(jax.random.key(1), (2, 8), 0, 64), np.int32)
    cal = Calibrator.from_model(lambda p, t: model.apply(p, t)[0], params, [(toks,)])
    seen, start = {}, {}

    def per_block(bc, p):
        seen[bc.name], start[bc.name] = bc.statistics({"absmax": absmax()}), bc.block.start
        return p

    cal.run_blocks(_flat(params), per_block)
    execs = {}  # block start -> the executables of its steps, in the order they were made
    for key, f in cal._cache.items():
        execs.setdefault(key[0], []).extend(f.executables())
    e0, e1, e2 = (execs[start[f"layers_{i}"]] for i in range(3))
    assert len(e1) == 2 and e1 == e2  # one statistics step and one advance step, shared
    assert not set(e0) & set(e1)
    h = model.embed(params, jnp.asarray(toks))
    for i in range(2):
        h, _ = model.block(params[f"layers_{i}"], h, model.positions(2, 8), layer_index=i)
    x = llama_mod.rms_norm(h, params["layers_2"]["attn_norm"]["scale"], model.config.rms_norm_eps)
    np.testing.assert_allclose(seen["layers_2"]["layers_2/attn/q_proj/kernel"]["absmax"],
                               np.abs(np.asarray(x)).reshape(-1, 32).max(0), rtol=1e-5)


@pytest.mark.parametrize("advance", ["new", "original"])
def test_sequential_semantics(advance):
    """Block 1 sees block 0's outputs computed with the new params ('new') or the old ones ('original')."""
    model, params = zoo.make_eqjax("llama")
    toks = np.asarray(jax.random.randint(jax.random.key(1), (2, 8), 0, 64), np.int32)
    cal = Calibrator.from_model(lambda p, t: model.apply(p, t)[0], params, [(toks,)])
    seen = {}

    def per_block(bc, p):
        seen[bc.name] = bc.statistics({"absmax": absmax()})
        if bc.name == "layers_0":  # zero the MLP output of block 0
            p["layers_0/mlp/down_proj/kernel"] = jnp.zeros_like(p["layers_0/mlp/down_proj/kernel"])
        return p

    cal.run_blocks(_flat(params), per_block, advance=advance)
    zeroed = dict(params, layers_0=dict(params["layers_0"], mlp=dict(params["layers_0"]["mlp"],
                  down_proj={"kernel": jnp.zeros_like(params["layers_0"]["mlp"]["down_proj"]["kernel"])})))
    use = zeroed if advance == "new" else params
    h = model.embed(use, jnp.asarray(toks))
    h, _ = model.block(use["layers_0"], h, model.positions(2, 8), layer_index=0)
    x = llama_mod.rms_norm(h, params["layers_1"]["attn_norm"]["scale"], model.config.rms_norm_eps)
    np.testing.assert_allclose(seen["layers_1"]["layers_1/attn/q_proj/kernel"]["absmax"],
                               np.abs(np.asarray(x)).reshape(-1, 32).max(0), rtol=1e-5)


def test_bad_batches_are_clear_errors():
    model, params = zoo.make_eqjax("llama")
    fn = lambda p, t: model.apply(p, t)[0]  # noqa: E731
    with pytest.raises(CalibrationError, match="empty"):
        as_batches([])
    with pytest.raises(CalibrationError, match="no calibration"):
        as_batches(None)
    with pytest.raises(CalibrationError, match="batch 1 has shapes"):
        as_batches([(np.zeros((2, 8), np.int32),), (np.zeros((2, 7), np.int32),)])
    cal = Calibrator.from_model(fn, params, [(np.zeros((2, 8), np.int32),)])
    with pytest.raises(CalibrationError, match="advance"):
        cal.run_blocks(_flat(params), lambda bc, p: p, advance="sideways")
