"""Hostile HF checkpoint inputs: every weight file is read, conflicts among files, index problems, cut
or inconsistent safetensors headers, and config values that cannot work all end in a CheckpointError
naming the file (and tensor or key)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from eqjax.io.hf import INDEX_FILE, CheckpointError, load_hf_checkpoint, save_hf_checkpoint
from eqjax.io.safetensors_file import read_tensors
from eqjax.models import LlamaConfig, Model
from eqjax.models.config import ConfigError, GPT2Config
from eqjax.models.hf_config import from_hf_config

LLAMA = LlamaConfig(vocab=32, hidden=16, intermediate=24, n_layers=2, n_heads=2, n_kv_heads=1, model_type="llama")


def _saved(d: Path) -> dict[str, np.ndarray]:
    model = Model(LLAMA)
    save_hf_checkpoint(d, model, model.init_params(jax.random.key(0)))
    return load_file(str(d / "model.safetensors"))


def _split(d: Path, tensors: dict[str, np.ndarray]) -> list[str]:
    """Replace model.safetensors by two shards (no index); returns the shard names."""
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, ns in shards.items():
        save_file({n: tensors[n] for n in ns}, str(d / f))
    return list(shards)


def _raw_safetensors(path: Path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


# ------------------------------------------------------------------------------------ weight files
def test_two_shards_without_index_are_both_read(tmp_path: Path) -> None:
    tensors = _saved(tmp_path)
    _split(tmp_path, tensors)
    _, params = load_hf_checkpoint(tmp_path)
    np.testing.assert_array_equal(np.asarray(params["layers_1"]["mlp_norm"]["scale"]),
                                  tensors["model.layers.1.post_attention_layernorm.weight"])
    np.testing.assert_array_equal(np.asarray(params["embed"]["embedding"]), tensors["model.embed_tokens.weight"])


def test_second_complete_weight_file_is_a_conflict(tmp_path: Path) -> None:
    tensors = _saved(tmp_path)
    save_file(tensors, str(tmp_path / "other.safetensors"))
    with pytest.raises(CheckpointError, match=r"duplicate tensor \(.*model\.safetensors, .*other\.safetensors\): "
                                              r"expected each tensor in one weight file"):
        load_hf_checkpoint(tmp_path)


def test_same_tensor_in_two_shards_names_both(tmp_path: Path) -> None:
    tensors = _saved(tmp_path)
    _split(tmp_path, tensors)
    save_file({"model.norm.weight": tensors["model.norm.weight"]}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(CheckpointError, match=r"extra\.safetensors.*model-0000\d-of-00002\.safetensors.*"
                                              r"model\.norm\.weight in both"):
        load_hf_checkpoint(tmp_path)


def test_a_weight_file_that_is_a_directory(tmp_path: Path) -> None:
    _saved(tmp_path)
    (tmp_path / "extra.safetensors").mkdir()
    with pytest.raises(CheckpointError, match=r"extra\.safetensors\): expected a regular file, found a directory"):
        load_hf_checkpoint(tmp_path)


# ------------------------------------------------------------------------------------ index
def _indexed(d: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    tensors = _saved(d)
    shards = _split(d, tensors)
    weight_map = {n: shards[i % 2] for i, n in enumerate(sorted(tensors))}
    (d / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors, weight_map


def test_index_names_a_missing_shard(tmp_path: Path) -> None:
    _, weight_map = _indexed(tmp_path)
    weight_map["model.norm.weight"] = "model-00003-of-00003.safetensors"
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"lists shard model-00003-of-00003\.safetensors, which is missing"):
        load_hf_checkpoint(tmp_path)


def test_shard_not_named_by_the_index_warns(tmp_path: Path) -> None:
    tensors, _ = _indexed(tmp_path)
    save_file({"x": tensors["model.norm.weight"]}, str(tmp_path / "stray.safetensors"))
    with pytest.warns(UserWarning, match=r"ignoring stray\.safetensors: not a shard listed in model\.safetensors"):
        _, params = load_hf_checkpoint(tmp_path)
    assert params["final_norm"]["scale"].shape == (16,)


def test_index_maps_a_tensor_to_the_wrong_shard(tmp_path: Path) -> None:
    _, weight_map = _indexed(tmp_path)
    name = "model.norm.weight"
    weight_map[name] = next(f for f in set(weight_map.values()) if f != weight_map[name])
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=rf"tensor {name} \(.*index\.json\): expected in model-0000\d.*found it in"):
        load_hf_checkpoint(tmp_path)


@pytest.mark.parametrize("body, found", [
    ("[1, 2]", r"found list"),
    ('{"weight_map": []}', r"found \[\]"),
    ('{"weight_map": {}}', r"found \{\}"),
    ('{"weight_map": {"model.norm.weight": "../x.safetensors"}}', r"'\.\./x\.safetensors'"),
    ('{"weight_map": {"model.norm.weight": "pytorch_model.bin"}}', r"'pytorch_model\.bin'"),
    ('{"weight_map": {"a": "m.safetensors", "a": "n.safetensors"}}', r"expected each tensor once, found a twice"),
    ("{nope", r"not valid JSON"),
], ids=["list", "map-list", "map-empty", "path-escape", "pickle-shard", "duplicate-key", "not-json"])
def test_malformed_index(tmp_path: Path, body: str, found: str) -> None:
    _indexed(tmp_path)
    (tmp_path / INDEX_FILE).write_text(body)
    with pytest.raises(CheckpointError, match=rf"bad safetensors index \(.*index\.json\).*{found}"):
        load_hf_checkpoint(tmp_path)


# ------------------------------------------------------------------------------------ safetensors headers
def test_truncated_mid_tensor_names_the_tensor(tmp_path: Path) -> None:
    _saved(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a valid safetensors file \(truncated: "
                                              r"tensor (model|lm_head)\.\S+ needs data bytes"):
        load_hf_checkpoint(tmp_path)


@pytest.mark.parametrize("entries, found", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}, r"tensor a: expected data_offsets"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, r"tensor b at data bytes \[4, 12\) overlaps tensor a"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, r"tensor a: shape \(3,\) of F32 needs 12 bytes"),
    ({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, r"tensor a: expected a dtype"),
    ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, r"tensor a: expected a shape"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, r"12 data bytes after the last tensor"),
], ids=["negative-offset", "overlap", "size", "dtype", "shape", "trailing"])
def test_inconsistent_header(tmp_path: Path, entries: dict, found: str) -> None:
    p = tmp_path / "w.safetensors"
    _raw_safetensors(p, entries, bytes(16) if "overlap" in found or "after" in found else bytes(8))
    with pytest.raises(CheckpointError, match=rf"w\.safetensors: not a valid safetensors file .*{found}"):
        read_tensors(p)


def test_duplicate_tensor_in_one_header(tmp_path: Path) -> None:
    p = tmp_path / "w.safetensors"
    blob = b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, ' \
           b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}'
    p.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(8))
    with pytest.raises(CheckpointError, match=r"tensor a listed twice"):
        read_tensors(p)


def test_header_reader_matches_safetensors(tmp_path: Path) -> None:
    import ml_dtypes

    rng = np.random.default_rng(0)
    t = {"f32": rng.standard_normal((3, 4)).astype(np.float32), "f16": rng.standard_normal(5).astype(np.float16),
         "i8": np.arange(6, dtype=np.int8).reshape(2, 3), "empty": np.zeros((0, 2), np.float32)}
    save_file(t, str(tmp_path / "w.safetensors"))
    for lazy in (False, True):
        got = read_tensors(tmp_path / "w.safetensors", lazy=lazy)
        assert set(got) == set(t)
        for k in t:
            assert got[k].dtype == t[k].dtype and got[k].shape == t[k].shape
            np.testing.assert_array_equal(got[k], t[k])
    mapped = read_tensors(tmp_path / "w.safetensors", lazy=True)["f32"]
    assert isinstance(mapped, np.memmap) and not mapped.flags.writeable
    bf = np.arange(4, dtype=np.float32).astype(ml_dtypes.bfloat16)
    _raw_safetensors(tmp_path / "b.safetensors", {"b": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}},
                     bf.tobytes())
    np.testing.assert_array_equal(read_tensors(tmp_path / "b.safetensors")["b"], bf)


# ------------------------------------------------------------------------------------ config values
_BASE = {"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}


@pytest.mark.parametrize("change, found", [
    ({"hidden_size": 0}, r"hidden_size\): expected an integer >= 1, found 0"),
    ({"num_attention_heads": 0}, r"num_attention_heads\): expected an integer >= 1, found 0"),
    ({"num_key_value_heads": 0}, r"num_key_value_heads\): expected an integer >= 1, found 0"),
    ({"num_hidden_layers": -1}, r"num_hidden_layers\): expected an integer >= 1, found -1"),
    ({"intermediate_size": 0}, r"intermediate_size\): expected an integer >= 1, found 0"),
    ({"vocab_size": 0}, r"vocab_size\): expected an integer >= 1, found 0"),
    ({"hidden_size": 16.5}, r"hidden_size\): expected an integer >= 1, found 16\.5"),
    ({"rope_theta": 0}, r"rope_theta\): expected a finite number > 0, found 0"),
    ({"rope_theta": -10000.0}, r"rope_theta\): expected a finite number > 0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0.0}},
     r"rope_parameters\.rope_theta\): expected a finite number > 0"),
    ({"rope_theta": 500.0, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
     r"rope_theta\): expected the same value as rope_parameters\.rope_theta 10000\.0, found 500\.0"),
    ({"rms_norm_eps": -1e-6}, r"rms_norm_eps\): expected a finite number >= 0"),
    ({"num_attention_heads": 3}, r"num_attention_heads\): expected a divisor of hidden_size 16"),
    ({"num_attention_heads": 4, "num_key_value_heads": 3}, r"num_key_value_heads\): expected a divisor of "
                                                           r"num_attention_heads 4, found 3"),
    ({"head_dim": 7}, r"head_dim\): expected an even number"),
    ({"head_dim": 0}, r"head_dim\): expected an integer >= 1"),
    ({"rope_scaling": {"rope_type": "linear", "factor": float("nan")}}, r"rope scaling factor"),
], ids=lambda v: str(v)[:40])
def test_config_values_that_cannot_work(change: dict, found: str) -> None:
    with pytest.raises(ConfigError, match=rf"cfg\.json.*{found}"):
        from_hf_config({**_BASE, **change}, source="cfg.json")


@pytest.mark.parametrize("change, found", [
    ({"n_head": 0}, r"n_head\): expected an integer >= 1, found 0"),
    ({"n_embd": 16, "n_head": 3}, r"n_head\): expected a divisor of n_embd 16"),
    ({"n_layer": 0}, r"n_layer\): expected an integer >= 1"),
    ({"layer_norm_epsilon": float("inf")}, r"layer_norm_epsilon\): expected a finite number"),
])
def test_gpt2_config_values_that_cannot_work(change: dict, found: str) -> None:
    d = {"model_type": "gpt2", "vocab_size": 32, "n_embd": 16, "n_layer": 1, "n_head": 2, **change}
    with pytest.raises(ConfigError, match=rf"cfg\.json.*{found}"):
        from_hf_config(d, source="cfg.json")


@pytest.mark.parametrize("kw, found", [
    (dict(n_heads=0), r"n_heads must be an integer >= 1, got 0"),
    (dict(rope_theta=0.0), r"rope_theta must be a finite number > 0, got 0\.0"),
    (dict(rope_theta=float("nan")), r"rope_theta must be a finite number > 0"),
    (dict(rms_norm_eps=-1.0), r"rms_norm_eps must be a finite number >= 0"),
    (dict(sliding_window=4, sliding_layers=(5,)), r"sliding_layers must be layer indices in \[0, 2\)"),
])
def test_llama_config_refuses_values_that_cannot_work(kw: dict, found: str) -> None:
    base = dict(vocab=32, hidden=16, intermediate=24, n_layers=2, n_heads=2)
    with pytest.raises(ConfigError, match=found):
        LlamaConfig(**{**base, **kw})


def test_gpt2_config_refuses_zero_heads() -> None:
    with pytest.raises(ConfigError, match=r"GPT2Config\.n_heads must be an integer >= 1, got 0"):
        GPT2Config(vocab=32, hidden=16, n_layers=1, n_heads=0)


def test_zero_heads_in_config_json_is_a_checkpoint_error(tmp_path: Path) -> None:
    _saved(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_attention_heads"] = 0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: num_attention_heads\): expected an integer >= 1"):
        load_hf_checkpoint(tmp_path)
