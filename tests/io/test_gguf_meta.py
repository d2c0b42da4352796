"""GGUF metadata made from an HF directory (``eqjax.io.gguf_meta``), against llama.cpp's own converter: the bundled
SmolLM2-135M GGUF was written by llama.cpp from the Hugging Face model; eqjax writes that model's config.json and
tokenizer files from it (as ``eqjax quantize --format compressed-tensors`` does), and the metadata made from those
files must be the converter's, key for key. Refusals name the file."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import gguf
import numpy as np
import pytest

from eqjax.export.package import tokenizer_files
from eqjax.io.gguf import GGUFError, config_from_metadata, default_model_path, load_tokenizer, read_metadata
from eqjax.io.gguf_meta import hf_gguf_metadata
from eqjax.io.hf import hf_config_dict, read_config

# general.* keys llama.cpp takes from the model card (eqjax names the file after the directory), and keys of the
# tokenizer_config eqjax writes that the original one lacked
_CARD = {"general.name", "general.organization", "general.finetune", "general.basename", "general.size_label",
         "general.license", "general.languages"}
_EXTRA = {"general.name", "tokenizer.ggml.add_eos_token"}
_WRITER = {"general.architecture", "general.file_type"}  # set by the GGUF writer, not by the metadata


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory) -> pathlib.Path:
    """SmolLM2-135M's config.json and tokenizer files (no weights) as eqjax writes them."""
    d = tmp_path_factory.mktemp("smollm2")
    meta = read_metadata(default_model_path())
    cfg = config_from_metadata(meta)
    (d / "config.json").write_text(json.dumps(hf_config_dict(cfg, "bfloat16")))
    files = tokenizer_files(load_tokenizer(), chat_template=meta["tokenizer.chat_template"],
                            context_length=cfg.max_position_embeddings)
    for name, text in files.items():
        (d / name).write_text(text)
    return d


def test_smollm2_metadata_is_llama_cpps(smollm2_dir):
    """Every llama.* and tokenizer.* key of llama.cpp's SmolLM2 GGUF, with its value and value type: the
    hyper-parameters, 49,152 tokens and their types (17 special tokens CONTROL), 48,900 merges, the special
    token ids, the pre-tokenizer name ('smollm') and the chat template."""
    reader = gguf.GGUFReader(default_model_path())
    want = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.") and k not in _CARD | _WRITER}
    cfg, _ = read_config(smollm2_dir)
    got = {k: (v, t, s) for k, v, t, s in hf_gguf_metadata(smollm2_dir, cfg)}
    assert set(got) - set(want) <= _EXTRA, set(got) - set(want)
    assert set(want) <= set(got), set(want) - set(got)
    for key, field in want.items():
        value, kind, sub = got[key]
        assert field.types[0] == kind and (sub is None or field.types[-1] == sub), key
        expected = field.contents()
        if isinstance(expected, float):  # stored as float32
            assert np.float32(value) == np.float32(expected), key
        else:
            assert value == expected, key


def _copy(src: pathlib.Path, dst: pathlib.Path, **changes) -> pathlib.Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    for name, edit in changes.items():
        path = dst / name.replace("_", ".", 1)
        path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    return dst


@pytest.mark.parametrize("changes, match", [
    ({"tokenizer_json": lambda d: {**d, "pre_tokenizer": {"type": "Metaspace", "replacement": "_"}}},
     r"tokenizer\.json: pre_tokenizer .*not one eqjax can name for llama\.cpp"),
    ({"tokenizer_json": lambda d: {**d, "model": {**d["model"], "type": "Unigram"}}},
     r"tokenizer\.json: a 'Unigram' tokenizer; export-gguf writes byte-level BPE"),
    ({"tokenizer_json": lambda d: {**d, "model": {**d["model"], "merges": []}}}, r"tokenizer\.json: no merges"),
    ({"config_json": lambda d: {**d, "vocab_size": 1000}}, r"tokenizer\.json: token id 49151 is beyond .*vocab_size 1000"),
])
def test_refusals_name_the_file(smollm2_dir, tmp_path, changes, match):
    d = _copy(smollm2_dir, tmp_path / "m", **changes)
    try:
        cfg, _ = read_config(d)
    except Exception as e:  # a config eqjax cannot read at all is the loader's refusal, naming config.json
        assert "config.json" in str(e)
        return
    with pytest.raises(GGUFError, match=match):
        hf_gguf_metadata(d, cfg)


def test_unused_ids_are_pad_tokens(smollm2_dir, tmp_path):
    """Ids the tokenizer does not use up to config.json's vocab_size become ``[PAD<id>]`` USER_DEFINED tokens
    (llama.cpp's convention for an embedding table larger than the vocabulary)."""
    d = _copy(smollm2_dir, tmp_path / "m", config_json=lambda c: {**c, "vocab_size": 49160})
    cfg, _ = read_config(d)
    got = {k: v for k, v, _, _ in hf_gguf_metadata(d, cfg)}
    assert got["tokenizer.ggml.tokens"][-8:] == [f"[PAD{i}]" for i in range(49152, 49160)]
    assert got["tokenizer.ggml.token_type"][-8:] == [int(gguf.TokenType.USER_DEFINED)] * 8
    assert got["llama.vocab_size"] == 49160


@pytest.mark.parametrize("changes", [{}, {"config_json": lambda c: {**c, "rope_scaling": {"rope_type": "linear",
                                                                                          "factor": 2.0}}},
                                     {"config_json": lambda c: {**c, "head_dim": 32}}])
def test_gguf_loader_reads_the_config_back(smollm2_dir, tmp_path, changes):
    """eqjax's GGUF loader reads the written hyper-parameters as the directory's config (linear RoPE scaling and a
    head size other than hidden / heads included); the tied table is the writer's tensors' business."""
    d = _copy(smollm2_dir, tmp_path / "m", **changes)
    cfg, _ = read_config(d)
    back = config_from_metadata({k: v for k, v, _, _ in hf_gguf_metadata(d, cfg)} | {"general.architecture": "llama"})
    assert dataclasses.replace(back, tie_word_embeddings=cfg.tie_word_embeddings) == cfg


# Llama 3's split regex as its tokenizer.json holds it (written out here, not taken from eqjax)
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _llama3_pre(smollm2_dir: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """SmolLM2's vocabulary and merges behind Llama 3's pre-tokenizer, as the ``tokenizers`` library writes it."""
    from tokenizers import Regex
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import pre_tokenizers as pt

    d = _copy(smollm2_dir, dst)
    tok = HFTokenizer.from_file(str(d / "tokenizer.json"))
    tok.pre_tokenizer = pt.Sequence([pt.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
                                     pt.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.save(str(d / "tokenizer.json"))
    return d


@pytest.mark.parametrize("pre", ["smollm", "llama-bpe"])
def test_a_file_of_the_metadata_tokenizes_as_tokenizer_json(smollm2_dir, tmp_path, pre):
    """The metadata written to a GGUF file (by the ``gguf`` package's writer, no tensors) and read back by eqjax's
    GGUF tokenizer encodes Wikipedia text to the ids the ``tokenizers`` library gives from tokenizer.json, special
    tokens in the text included: SmolLM2's own pre-tokenizer, and Llama 3's (named ``llama-bpe``, as llama.cpp's
    converter names Llama 3's) in front of the same vocabulary (digits go in threes there, one by one in SmolLM2's)."""
    from tokenizers import Tokenizer as HFTokenizer

    from eqjax.data import wikipedia_articles

    src = smollm2_dir
    if pre == "llama-bpe":
        smollm2_dir = _llama3_pre(src, tmp_path / "llama3")
    cfg, _ = read_config(smollm2_dir)
    meta = hf_gguf_metadata(smollm2_dir, cfg)
    assert {k: v for k, v, _, _ in meta}["tokenizer.ggml.pre"] == pre
    path = tmp_path / "meta.gguf"
    w = gguf.GGUFWriter(path, "llama")
    for key, value, kind, sub in meta:
        w.add_key_value(key, value, kind, sub_type=sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = load_tokenizer(path)
    ref = HFTokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    text = "<|im_start|>user\n" + "\n\n".join(wikipedia_articles()[:3])[:20000] + " 12345 x<|im_end|>"
    assert ours.encode(text) == ref.encode(text, add_special_tokens=False).ids
    if pre == "llama-bpe":  # the two pre-tokenizers give other ids on this text: the check tells them apart
        smollm = HFTokenizer.from_file(str(src / "tokenizer.json"))
        assert smollm.encode(text, add_special_tokens=False).ids != ours.encode(text)
