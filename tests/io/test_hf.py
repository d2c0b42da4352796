"""Hugging Face checkpoint loader/saver without torch: round trips, shards, dtypes and every bad input."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from eqjax.core.numerics import QuantSpec, dequantize, quantize
from eqjax.core.qarray import per_channel
from eqjax.io.hf import CheckpointError, hf_name, load_hf_checkpoint, save_hf_checkpoint
from eqjax.models import GPT2Config, LlamaConfig, Model

LLAMA = LlamaConfig(vocab=32, hidden=16, intermediate=24, n_layers=2, n_heads=2, n_kv_heads=1, model_type="llama")
GPT2 = GPT2Config(vocab=32, hidden=16, n_layers=1, n_heads=2, n_positions=8)


def _saved(tmp_path, config=LLAMA, **kw):
    model = Model(config)
    params = model.init_params(jax.random.key(0))
    save_hf_checkpoint(tmp_path, model, params, **kw)
    return model, params


def _assert_trees_close(a, b, atol=0.0):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), atol=atol)


@pytest.mark.parametrize("config", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_roundtrip(tmp_path, config):
    model, params = _saved(tmp_path, config)
    loaded_model, loaded = load_hf_checkpoint(tmp_path)
    assert loaded_model == model
    _assert_trees_close(loaded, params)


def test_hf_names_and_layout(tmp_path):
    _saved(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (8, 16)  # [out, in]
    assert "lm_head.weight" in tensors and "model.norm.weight" in tensors
    assert hf_name(LLAMA, ("layers_1", "mlp_norm", "scale")) == "model.layers.1.post_attention_layernorm.weight"
    assert hf_name(GPT2, ("layers_0", "attn", "c_attn", "kernel")) == "transformer.h.0.attn.c_attn.weight"
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_key_value_heads"] == 1


def test_quantized_params_saved_dequantized(tmp_path):
    model = Model(LLAMA)
    params = model.init_params(jax.random.key(0))
    spec = QuantSpec(bits=4, symmetric=True, granularity=per_channel(1))
    q = quantize(params["layers_0"]["mlp"]["up_proj"]["kernel"], spec)
    params["layers_0"]["mlp"]["up_proj"]["kernel"] = q
    save_hf_checkpoint(tmp_path, model, params)
    _, loaded = load_hf_checkpoint(tmp_path)
    np.testing.assert_allclose(loaded["layers_0"]["mlp"]["up_proj"]["kernel"], dequantize(q), atol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision(tmp_path, dtype):
    _, params = _saved(tmp_path, dtype=dtype)
    _, loaded = load_hf_checkpoint(tmp_path)
    _assert_trees_close(loaded, params, atol=1e-2)
    _, kept = load_hf_checkpoint(tmp_path, dtype=None)
    assert {x.dtype.name for x in jax.tree.leaves(kept)} == {dtype}


def test_manual_shards(tmp_path):
    _saved(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, ns in halves.items():
        save_file({n: tensors[n] for n in ns}, str(tmp_path / f))
    weight_map = {n: f for f, ns in halves.items() for n in ns}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _, params = load_hf_checkpoint(tmp_path)
    assert params["lm_head"]["kernel"].shape == (16, 32)
    # a shard listed in the index but absent
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors.*missing"):
        load_hf_checkpoint(tmp_path)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_checkpoint(tmp_path / "nope")


def test_missing_config(tmp_path):
    _saved(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_hf_checkpoint(tmp_path)


def test_invalid_config_json(tmp_path):
    _saved(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        load_hf_checkpoint(tmp_path)


def test_truncated_safetensors(tmp_path):
    _saved(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a valid safetensors file"):
        load_hf_checkpoint(tmp_path)


def test_shape_mismatch_names_tensor(tmp_path):
    _saved(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 20
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    want = (
        r"model.safetensors: tensor model.layers.0.mlp.down_proj.weight "
        r"has shape \(16, 24\) but config.json implies \(16, 20\)"
    )
    with pytest.raises(CheckpointError, match=want):
        load_hf_checkpoint(tmp_path)


def test_unsupported_architecture(tmp_path):
    _saved(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "falcon", "architectures": ["FalconForCausalLM"]}))
    with pytest.raises(CheckpointError, match=r"config.json: unsupported architecture.*falcon.*FalconForCausalLM"):
        load_hf_checkpoint(tmp_path)


def test_unsupported_rope_scaling(tmp_path):
    _saved(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config.json: llama rope_parameters: unsupported rope scaling type 'yarn'"):
        load_hf_checkpoint(tmp_path)


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.pth"])
def test_pickle_checkpoints_refused(tmp_path, name):
    _saved(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / name).write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError, match="never unpickles.*safetensors"):
        load_hf_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="never unpickles"):
        load_hf_checkpoint(tmp_path / name)


def test_no_weights(tmp_path):
    _saved(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_hf_checkpoint(tmp_path)


def test_missing_and_unexpected_tensors(tmp_path):
    _saved(tmp_path)
    f = str(tmp_path / "model.safetensors")
    tensors = load_file(f)
    missing = dict(tensors)
    del missing["model.layers.1.self_attn.o_proj.weight"]
    save_file(missing, f)
    with pytest.raises(CheckpointError, match="model.layers.1.self_attn.o_proj.weight is missing"):
        load_hf_checkpoint(tmp_path)
    save_file({**tensors, "model.layers.0.extra.weight": np.zeros(3, np.float32)}, f)
    with pytest.raises(CheckpointError, match="unexpected.*model.layers.0.extra.weight"):
        load_hf_checkpoint(tmp_path)


def test_save_rejects_incomplete_params(tmp_path):
    model = Model(LLAMA)
    params = model.init_params(jax.random.key(0))
    del params["final_norm"]
    with pytest.raises(CheckpointError, match="final_norm/scale"):
        save_hf_checkpoint(tmp_path, model, params)
    assert not (tmp_path / "config.json").exists()


def test_tied_checkpoint_ignores_stray_lm_head(tmp_path):
    cfg = LlamaConfig(vocab=32, hidden=16, intermediate=24, n_layers=1, n_heads=2, tie_word_embeddings=True)
    _, params = _saved(tmp_path, cfg)
    f = str(tmp_path / "model.safetensors")
    tensors = load_file(f)
    assert "lm_head.weight" not in tensors
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]}, f)
    _, loaded = load_hf_checkpoint(tmp_path)
    assert "lm_head" not in loaded
    logits, _ = Model(cfg).apply(loaded, jnp.zeros((1, 3), jnp.int32))
    assert logits.shape == (1, 3, 32)


def test_rotated_model_saved_float_and_untied(tmp_path):
    """A QuaRot model (tied embedding untied by the rotation, down_proj rotated online) is written as
    the float model it stands for: untied, rotations folded in; reloaded, same logits."""
    from eqjax.recipes.apply import quantize as run_recipe
    from eqjax.recipes.registry import get_recipe

    cfg = LlamaConfig(vocab=32, hidden=16, intermediate=24, n_layers=2, n_heads=2, n_kv_heads=1,
                      tie_word_embeddings=True)
    model = Model(cfg)
    params = model.init_params(jax.random.key(0), std=0.2)
    toks = jax.random.randint(jax.random.key(1), (2, 8), 0, 32, dtype=jnp.int32)
    q = run_recipe(params, get_recipe("w4g128-rot-rtn"), model=model, calibration=toks)
    save_hf_checkpoint(tmp_path, model, q)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is False
    loaded_model, loaded = load_hf_checkpoint(tmp_path)
    assert "lm_head" in loaded
    np.testing.assert_allclose(np.asarray(loaded_model.apply(loaded, toks)[0]), np.asarray(model.apply(q, toks)[0]),
                               rtol=1e-4, atol=1e-4)
