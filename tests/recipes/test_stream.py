"""Streamed quantization against the in-memory run of the same recipe on the same params and windows.

Oracle: :func:`eqjax.recipes.apply.quantize` of the whole tree. Round-to-nearest codes must be identical
(each weight's codes depend on that weight alone); calibrated methods see the same block inputs, computed by
separately compiled programs, so their stored codes must agree except where a value lies within float32
rounding of a grid boundary: at most a few codes in a thousand, and the dequantized weights' relative
difference within a code step's share. (On an AVX-512 Xeon the calibrated cases come out identical, codes and
float leaves alike: the bound is for compilers that fuse the unit programs differently from the whole one.)
"""

from __future__ import annotations

import gc
import time
import weakref

import jax
import numpy as np
import pytest

from eqjax.core.errors import RecipeError
from eqjax.core.numerics import codes, dequantize_leaf
from eqjax.core.pytree import flatten_with_paths
from eqjax.core.qarray import ActQuantKernel, is_quantized
from eqjax.models import LlamaConfig, Model
from eqjax.recipes.apply import quantize
from eqjax.recipes.registry import get_recipe
from eqjax.recipes.stream import PHASES, model_units, parse_phase_line, phase_line, stream_cost, stream_quantize


def _model(tied: bool):
    model = Model(LlamaConfig(vocab=96, hidden=64, intermediate=128, n_layers=3, n_heads=4, n_kv_heads=2,
                              tie_word_embeddings=tied))
    params = model.init_params(jax.random.key(0), std=0.1)
    cal = np.random.default_rng(0).integers(0, 96, (4, 16)).astype(np.int32)
    return model, params, cal


def _streamed(model, params, recipe, cal):
    paths, leaves, _ = flatten_with_paths(params)
    flat = dict(zip(paths, leaves))
    loaded, out = [], {}

    def load(ps):
        loaded.append(tuple(ps))
        return {p: flat[p] for p in ps}

    def emit(name, leaves):
        assert not set(leaves) & set(out), name  # every path is emitted once
        out.update(leaves)

    stream_quantize(model, paths, load, recipe, cal, emit)
    assert sorted(out) == sorted(paths) and sorted(p for u in loaded for p in u) == sorted(paths)
    return flat, out, loaded


@pytest.mark.parametrize("recipe, tied", [("w4g128-rtn", False), ("w8a8-naive", True), ("w4g128-rtn+emb-int8", False),
                                          ("w4g128-rtn+emb-int8", True), ("w4g128-rtn+emb-w7a8", True)])
def test_round_to_nearest_is_identical(tied, recipe):
    model, params, cal = _model(tied)
    mem = dict(zip(*flatten_with_paths(quantize(params, get_recipe(recipe), model=model, calibration=cal))[:2]))
    _, out, loaded = _streamed(model, params, get_recipe(recipe), cal)
    assert len(loaded) == 3 + 1 + (0 if tied else 1)
    for p, v in mem.items():
        assert type(out[p]) is type(v), p
        for a, b in zip(jax.tree.leaves(out[p]), jax.tree.leaves(v)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=p)


@pytest.mark.parametrize("recipe, tied", [("w4g128-gptq", False), ("w4g128-awq", True), ("w8a8-smoothquant", False),
                                          ("w4g128-gptq+emb-int8", True)])
def test_calibrated_methods_match_the_in_memory_run(tied, recipe):
    model, params, cal = _model(tied)
    mem = dict(zip(*flatten_with_paths(quantize(params, get_recipe(recipe), model=model, calibration=cal))[:2]))
    _, out, _ = _streamed(model, params, get_recipe(recipe), cal)
    eps = float(np.finfo(np.float32).eps)
    flips = []
    for p, v in mem.items():
        assert is_quantized(out[p]) == is_quantized(v), p
        if not is_quantized(v):  # float leaves (norms, smoothed by folding): float32 rounding of the same ops
            np.testing.assert_allclose(np.asarray(out[p]), np.asarray(v), rtol=64 * eps, atol=0, err_msg=p)
            continue
        codes_a, codes_b = (np.asarray(codes(x.weight if isinstance(x, ActQuantKernel) else x)) for x in (out[p], v))
        assert codes_a.shape == codes_b.shape, p
        flips.append(float(np.mean(codes_a != codes_b)))
        assert flips[-1] <= 5e-3, (p, flips[-1])
        a, b = np.asarray(dequantize_leaf(out[p])), np.asarray(dequantize_leaf(v))
        assert np.linalg.norm(a - b) <= 0.05 * np.linalg.norm(b), p


@pytest.mark.parametrize("recipe", ["w4g128-gptq", "w8a8-smoothquant", "w4g128-rtn"])
def test_nothing_of_a_unit_outlives_it(recipe):
    """When a unit is loaded, every array loaded for the units before it is gone (the largest unit, not the sum
    of two, is what a streamed run holds)."""
    model, params, cal = _model(False)
    paths, leaves, _ = flatten_with_paths(params)
    flat = dict(zip(paths, leaves))
    refs: list[tuple[str, weakref.ref]] = []

    def load(ps):
        gc.collect()
        alive = [p for p, r in refs if r() is not None]
        assert not alive, f"loading {ps[0]}: still alive {alive}"
        out = {p: jax.numpy.array(flat[p], copy=True) for p in ps}  # arrays only this run holds
        refs.extend((p, weakref.ref(v)) for p, v in out.items())
        return out

    kept = {}
    stream_quantize(model, paths, load, recipe, cal,
                    lambda name, ls: kept.update({p: jax.tree.map(np.array, v) for p, v in ls.items()}))
    assert sorted(kept) == sorted(paths)


@pytest.mark.parametrize("recipe", ["kv8", "w4g128-rot-rtn"])
def test_refuses_what_spans_the_whole_model(recipe):
    model, params, cal = _model(True)
    with pytest.raises(RecipeError, match="not streamed"):
        stream_quantize(model, flatten_with_paths(params)[0], lambda ps: pytest.fail("loaded"), recipe, cal,
                        lambda *a: pytest.fail("emitted"))


def test_units_and_cost():
    model, params, cal = _model(False)
    paths = flatten_with_paths(params)[0]
    units = model_units(model, paths)
    assert [u.name for u in units] == ["outer", "layers_0", "layers_1", "layers_2", "head"]
    assert units[0].paths == ("embed/embedding",) and set(units[-1].paths) == {"final_norm/scale", "lm_head/kernel"}
    assert stream_cost(get_recipe("w4g128-gptq"), cal, 64) == 4 * 16 * 64 * 4
    assert stream_cost(get_recipe("w4g128-rtn"), cal, 64) == 0


@pytest.mark.parametrize("recipe", ["w4g128-rtn", "w8a8-naive"])
def test_hf_checkpoint_streamed_to_compressed_tensors_is_the_in_memory_file(tmp_path, recipe):
    """An HF float checkpoint read on demand, quantized unit by unit and written shard by shard holds every
    tensor the in-memory path writes, byte for byte (round-to-nearest: identical codes)."""
    from eqjax.io.compressed_tensors import save_compressed_tensors, save_compressed_tensors_streamed
    from eqjax.io.hf import load_hf_checkpoint, read_checkpoint, save_hf_checkpoint, stream_hf_checkpoint

    model, params, cal = _model(False)
    save_hf_checkpoint(tmp_path / "fp", model, params)
    m1, p1 = load_hf_checkpoint(tmp_path / "fp")
    save_compressed_tensors(tmp_path / "mem", m1, quantize(p1, get_recipe(recipe), model=m1))
    m2, sp = stream_hf_checkpoint(tmp_path / "fp")
    assert sp.nbytes == sum(a.nbytes for a in read_checkpoint(tmp_path / "fp")[2].values())
    info = save_compressed_tensors_streamed(
        tmp_path / "st", m2, lambda emit, ledger: stream_quantize(m2, sp.paths, sp.load, recipe, cal, emit, ledger=ledger))
    assert info["path"] == str(tmp_path / "st") and info["schemes"]
    _, cfg_a, a, _ = read_checkpoint(tmp_path / "mem")
    _, cfg_b, b, origin = read_checkpoint(tmp_path / "st")
    assert cfg_a == cfg_b and sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]), err_msg=name)
    assert len(set(origin.values())) == 3 + 2  # one shard per unit


def test_bad_checkpoint_is_refused_before_any_unit(tmp_path):
    """A config whose shapes disagree with a tensor is refused by the on-demand reader itself, naming the
    file and tensor, before anything is loaded or quantized."""
    import json

    from eqjax.io.hf import CheckpointError, save_hf_checkpoint, stream_hf_checkpoint

    model, params, _ = _model(False)
    save_hf_checkpoint(tmp_path / "fp", model, params)
    cfg = json.loads((tmp_path / "fp" / "config.json").read_text())
    cfg["intermediate_size"] = 256
    (tmp_path / "fp" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor model\.layers\.0\.mlp\.\w+_proj\.weight has shape"):
        stream_hf_checkpoint(tmp_path / "fp")


def test_phase_times_land_in_their_phase():
    """A slow reader and a slow writer show up as read and write seconds (each unit's sleep counted once), the
    calibration forward and the steps get the rest, and the sum stays within the run's wall time."""
    model, params, cal = _model(False)
    paths, leaves, _ = flatten_with_paths(params)
    flat = dict(zip(paths, leaves))
    nap = 0.05
    lines: list[str] = []

    def load(ps):
        time.sleep(nap)
        return {p: flat[p] for p in ps}

    t0 = time.perf_counter()
    stream_quantize(model, paths, load, "w4g128-gptq", cal, lambda name, ls: time.sleep(nap), progress=lines.append)
    wall = time.perf_counter() - t0
    n_units = len(model_units(model, paths))
    phases = parse_phase_line("\n".join(lines))
    assert phases is not None and lines[-1].startswith("time: ")
    assert n_units * nap <= phases["read"] < wall and n_units * nap <= phases["write"] < wall
    assert phases["quantize"] > 0 and phases["forward"] > 0
    assert sum(phases.values()) <= wall + 0.1 * len(PHASES)  # each phase rounded to 0.1 s in the line


def test_phase_line_round_trip():
    phases = {"read": 1.25, "quantize": 300.0, "forward": 0.0, "write": 12.5}
    assert parse_phase_line("block 0: 1.0s\n" + phase_line(phases)) == {"read": 1.2, "quantize": 300.0,
                                                                        "forward": 0.0, "write": 12.5}
    assert parse_phase_line("no such line") is None
