"""bench/random_checkpoint.py: random-weight HF Llama checkpoints of real shapes (time and memory figures only)."""

import json
import math
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from eqjax.io.hf import hf_layout, load_hf_checkpoint
from eqjax.models.hf_config import from_hf_config, to_hf_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import random_checkpoint as rc  # noqa: E402

SHARD_MB = 2.0  # tiny: the embedding, the layers and lm_head land in three shards


def _headers(d: Path) -> dict[str, dict[str, tuple[str, list[int]]]]:
    """``{shard file: {tensor: (dtype, shape)}}`` as the safetensors package reads them."""
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "np") as g:
            assert g.metadata() == {"format": "pt"}
            out[f.name] = {k: (g.get_slice(k).get_dtype(), g.get_slice(k).get_shape()) for k in g.keys()}
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("rc") / "tiny"
    assert rc.main(["--shape", "tiny", "--out", str(out), "--shard-mb", str(SHARD_MB), "--seed", "3"]) == 0
    return out


def test_index_lists_every_tensor_in_its_shard(ckpt):
    index = json.loads((ckpt / rc.INDEX).read_text())
    headers = _headers(ckpt)
    assert len(headers) >= 2
    assert sorted(headers) == [f"model-{k:05d}-of-{len(headers):05d}.safetensors" for k in range(1, len(headers) + 1)]
    names = [n for n, _ in rc.tensors("tiny")]
    assert sorted(index["weight_map"]) == sorted(names)
    for name, file in index["weight_map"].items():
        assert name in headers[file]
    assert sum(len(h) for h in headers.values()) == len(names)
    assert index["metadata"]["total_size"] == rc.n_bytes("tiny") == 2 * rc.n_params("tiny")
    for h in headers.values():  # only a tensor bigger than the limit makes a shard pass it
        data = sum(2 * math.prod(s) for _, s in h.values())
        assert data <= SHARD_MB * 1e6 or len(h) == 1


def test_headers_agree_with_the_config(ckpt):
    config = from_hf_config(json.loads((ckpt / "config.json").read_text()))
    expected = {t.name: list(t.hf_shape) for t in hf_layout(config)}
    found = {name: entry for h in _headers(ckpt).values() for name, entry in h.items()}
    assert found == {name: ("BF16", shape) for name, shape in expected.items()}


def test_eqjax_loads_it_and_the_forward_is_finite(ckpt):
    model, params = load_hf_checkpoint(ckpt)
    c = model.config
    assert (c.vocab, c.hidden, c.n_layers, c.tie_word_embeddings, c.rope_scaling.type) == (49152, 64, 2, False, "llama3")
    assert params["lm_head"]["kernel"].shape == (64, 49152)
    logits, _ = model.apply(params, jnp.asarray([[1, 200, 3000, 49151]], jnp.int32))
    logits = np.asarray(logits)
    assert logits.shape == (1, 4, 49152) and np.isfinite(logits).all()
    assert 0.1 < logits.std() < 10  # neither vanishing nor exploding
    emb = np.asarray(params["embed"]["embedding"])
    assert abs(emb.std() - rc.EMBED_STD) < 1e-3
    assert np.all(np.asarray(params["final_norm"]["scale"]) == 1)


def test_tokenizer_and_side_files(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    assert len(tok["model"]["vocab"]) + len(tok.get("added_tokens", [])) >= 49152 - 100
    marker = json.loads((ckpt / rc.MARKER).read_text())
    assert (marker["shape"], marker["seed"], marker["note"]) == ("tiny", 3, rc.NOTE)


def test_same_seed_same_bytes(ckpt, tmp_path):
    again = rc.write_checkpoint("tiny", tmp_path / "a", shard_mb=SHARD_MB, seed=3)
    assert again["shards"] == len(_headers(ckpt))
    for f in sorted(ckpt.glob("*.safetensors")):
        assert (tmp_path / "a" / f.name).read_bytes() == f.read_bytes(), f.name
    rc.write_checkpoint("tiny", tmp_path / "b", shard_mb=SHARD_MB, seed=4)
    first = sorted(ckpt.glob("*.safetensors"))[0].name
    assert (tmp_path / "b" / first).read_bytes() != (ckpt / first).read_bytes()


def test_refuses_an_existing_directory_without_overwrite(ckpt, capsys):
    before = {f.name: f.stat().st_mtime_ns for f in ckpt.iterdir()}
    assert rc.main(["--shape", "tiny", "--out", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--overwrite" in err and "Traceback" not in err
    assert {f.name: f.stat().st_mtime_ns for f in ckpt.iterdir()} == before


def test_overwrite_replaces_only_its_own_directories(tmp_path, capsys):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")  # a name the new directory would also hold
    assert rc.main(["--shape", "tiny", "--out", str(foreign), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and rc.MARKER in err and "Traceback" not in err
    assert [f.name for f in foreign.iterdir()] == ["config.json"] and (foreign / "config.json").read_text() == "{}"
    ours = tmp_path / "ours"
    rc.write_checkpoint("tiny", ours, shard_mb=100, seed=0)
    assert rc.main(["--shape", "tiny", "--out", str(ours), "--seed", "5", "--overwrite"]) == 0
    assert json.loads((ours / rc.MARKER).read_text())["seed"] == 5
    assert len(list(ours.glob("*.safetensors"))) == 1
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporaries left


@pytest.mark.parametrize("shape, count", [("1b", 1_235_814_400), ("3b", 3_212_749_824), ("8b", 8_030_261_248)])
def test_parameter_counts_and_layout_of_the_real_shapes(shape, count):
    assert rc.n_params(shape) == count
    config = from_hf_config(rc.hf_config(shape, 1, 2))
    assert dict(rc.tensors(shape)) == {t.name: t.hf_shape for t in hf_layout(config)}
    assert len(rc.tensors(shape)) == len(hf_layout(config))


def test_1b_config_round_trips_through_eqjax():
    d = rc.hf_config("1b", 1, 2)
    c = from_hf_config(d)
    assert (c.vocab, c.hidden, c.intermediate, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim) == (
        128256, 2048, 8192, 16, 32, 8, 64)
    assert (c.rope_theta, c.rms_norm_eps, c.tie_word_embeddings, c.hidden_act) == (500000.0, 1e-5, True, "silu")
    assert c.rope_scaling.to_dict() == d["rope_scaling"]
    back = to_hf_config(c)
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "rope_theta",
              "max_position_embeddings", "rope_scaling", "hidden_act", "model_type", "architectures"):
        assert back[k] == d[k], k
    assert from_hf_config(back) == c
