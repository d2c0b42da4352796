"""GGUF metadata of a Hugging Face Llama directory, as llama.cpp's converter writes it.

``hf_gguf_metadata(directory)`` returns the ``(key, value, type, item type)`` entries a GGUF file made from
``directory`` carries besides its tensors: the ``llama.*`` hyper-parameters from ``config.json`` and the
``tokenizer.*`` keys from ``tokenizer.json`` / ``tokenizer_config.json`` (``chat_template.jinja``):

* tokens in id order, ``[PAD<id>]`` for an id the tokenizer does not use (llama.cpp's convention); token
  types: added tokens marked special ``CONTROL``, other added tokens ``USER_DEFINED``, the rest ``NORMAL``;
* merges, special token ids, ``add_bos_token`` / ``add_eos_token`` and the chat template through gguf-py's
  :class:`gguf.SpecialVocab` (the package llama.cpp's converter uses);
* ``tokenizer.ggml.pre``, the name llama.cpp gives the pre-tokenizer: recognised from the ``pre_tokenizer``
  of ``tokenizer.json`` in :data:`PRE_TOKENIZERS`. llama.cpp's converter names it by hashing the tokens of a
  probe text; eqjax compares the declared pre-tokenizer instead, so a tokenizer it does not list is refused
  (naming the file) rather than written with a guessed name.

Only byte-level BPE tokenizers (``tokenizer.ggml.model = "gpt2"``) are written; a SentencePiece
``tokenizer.model`` is refused.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from eqjax.io.gguf import GGUFError
from eqjax.io.tokenizer import LLAMA3_SPLIT
from eqjax.models.config import LlamaConfig

__all__ = ["hf_gguf_metadata", "PRE_TOKENIZERS"]

_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
PRE_TOKENIZERS: dict[str, Any] = {
    "smollm": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]},
    "gpt-2": _BYTE_LEVEL,
    "llama-bpe": {"type": "Sequence", "pretokenizers": [  # Llama 3 / 3.1 / 3.2: its split regex, then bytes
        {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False},
        {**_BYTE_LEVEL, "use_regex": False}]},
}
"""llama.cpp's pre-tokenizer name -> the ``pre_tokenizer`` of ``tokenizer.json`` it stands for (``trim_offsets``
ignored: it moves offsets, not tokens)."""


def _canonical(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _canonical(v) for k, v in node.items() if k != "trim_offsets"}
    if isinstance(node, list):
        return [_canonical(v) for v in node]
    return node


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GGUFError(f"{path}: not readable JSON ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(data, dict):
        raise GGUFError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _tokens(tj: dict[str, Any], n_vocab: int, where: Path) -> tuple[list[str], list[int]]:
    """Token texts and llama.cpp token types in id order, ``n_vocab`` of them."""
    import gguf  # imported where used, as eqjax.io.gguf does: the CLI starts without it

    model = tj.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise GGUFError(f"{where}: a {model.get('type')!r} tokenizer; export-gguf writes byte-level BPE tokenizers only")
    texts: dict[int, str] = {int(i): str(t) for t, i in model["vocab"].items()}
    types: dict[int, int] = dict.fromkeys(texts, int(gguf.TokenType.NORMAL))
    for a in tj.get("added_tokens") or []:
        i = int(a["id"])
        texts[i] = str(a["content"])
        types[i] = int(gguf.TokenType.CONTROL if a.get("special") else gguf.TokenType.USER_DEFINED)
    if texts and max(texts) >= n_vocab:
        raise GGUFError(f"{where}: token id {max(texts)} is beyond config.json's vocab_size {n_vocab}")
    tokens = [texts.get(i, f"[PAD{i}]") for i in range(n_vocab)]
    kinds = [types.get(i, int(gguf.TokenType.USER_DEFINED)) for i in range(n_vocab)]
    return tokens, kinds


def _pre(tj: dict[str, Any], where: Path) -> str:
    """llama.cpp's name of the pre-tokenizer (every listed one adds no space before the text)."""
    declared = _canonical(tj.get("pre_tokenizer"))
    for name, form in PRE_TOKENIZERS.items():
        if declared == form:
            return name
    raise GGUFError(f"{where}: pre_tokenizer {json.dumps(declared)[:160]} is not one eqjax can name for llama.cpp "
                    f"(it knows {', '.join(PRE_TOKENIZERS)}); export the model's own GGUF file instead")


def hf_gguf_metadata(directory: str | os.PathLike[str], config: LlamaConfig) -> list[tuple[str, Any, Any, Any]]:
    """``[(key, value, GGUFValueType, item type or None)]`` of a llama GGUF file made from the HF directory
    ``directory`` (``config``: its :class:`~eqjax.models.config.LlamaConfig`); ``general.file_type`` is the
    writer's. Raises :class:`~eqjax.io.gguf.GGUFError` naming the file for what llama.cpp's llama
    architecture or eqjax's writer cannot hold."""
    import gguf

    _T = gguf.GGUFValueType
    root = Path(directory)
    if getattr(config, "model_type", "llama") != "llama":
        raise GGUFError(f"{root / 'config.json'}: model_type {config.model_type!r}; export-gguf writes Llama models")
    scaling = config.rope_scaling  # linear: two keys; llama3: the writer's rope_freqs.weight tensor
    if scaling is not None and scaling.type not in ("linear", "llama3"):
        raise GGUFError(f"{root / 'config.json'}: RoPE scaling {scaling.type!r}; export-gguf writes linear and llama3 "
                        "scaling only")
    tj_path = root / "tokenizer.json"
    if not tj_path.is_file():
        raise GGUFError(f"{root}: no tokenizer.json (export-gguf copies the tokenizer into the file)")
    tj = _read_json(tj_path)
    tokens, kinds = _tokens(tj, int(config.vocab), tj_path)
    pre = _pre(tj, tj_path)
    special = gguf.SpecialVocab(root, load_merges=True, n_vocab=int(config.vocab))
    if not special.merges:  # llama.cpp's loader requires the key, and GGUF cannot hold an empty array
        raise GGUFError(f"{tj_path}: no merges; a GGUF byte-level BPE tokenizer needs at least one")
    u32, f32 = _T.UINT32, _T.FLOAT32
    out: list[tuple[str, Any, Any, Any]] = [
        ("general.type", "model", _T.STRING, None),
        ("general.name", root.resolve().name, _T.STRING, None),
        ("llama.block_count", int(config.n_layers), u32, None),
        ("llama.context_length", int(config.max_position_embeddings), u32, None),
        ("llama.embedding_length", int(config.hidden), u32, None),
        ("llama.feed_forward_length", int(config.intermediate), u32, None),
        ("llama.attention.head_count", int(config.n_heads), u32, None),
        ("llama.attention.head_count_kv", int(config.n_kv_heads), u32, None),
        ("llama.rope.freq_base", float(config.rope_theta), f32, None),
        ("llama.attention.layer_norm_rms_epsilon", float(config.rms_norm_eps), f32, None),
        ("llama.vocab_size", int(config.vocab), u32, None),
        ("llama.rope.dimension_count", int(config.head_dim), u32, None),
    ]
    if config.head_dim * config.n_heads != config.hidden:
        out += [("llama.attention.key_length", int(config.head_dim), u32, None),
                ("llama.attention.value_length", int(config.head_dim), u32, None)]
    if scaling is not None and scaling.type == "linear":
        out += [("llama.rope.scaling.type", "linear", _T.STRING, None),
                ("llama.rope.scaling.factor", float(scaling.factor), f32, None)]
    out += [
        ("tokenizer.ggml.add_space_prefix", False, _T.BOOL, None),
        ("tokenizer.ggml.model", "gpt2", _T.STRING, None),
        ("tokenizer.ggml.pre", pre, _T.STRING, None),
        ("tokenizer.ggml.tokens", tokens, _T.ARRAY, _T.STRING),
        ("tokenizer.ggml.token_type", kinds, _T.ARRAY, _T.INT32),
        ("tokenizer.ggml.merges", list(special.merges), _T.ARRAY, _T.STRING),
    ]
    ids = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "sep": "seperator_token_id",
           "pad": "padding_token_id"}
    out += [(f"tokenizer.ggml.{ids[k]}", int(v), u32, None) for k, v in special.special_token_ids.items() if k in ids]
    out += [(f"tokenizer.ggml.add_{k}_token", bool(v), _T.BOOL, None)
            for k, v in special.add_special_token.items() if k in ("bos", "eos")]
    if isinstance(special.chat_template, str):
        out.append(("tokenizer.chat_template", special.chat_template, _T.STRING, None))
    out.append(("general.quantization_version", gguf.GGML_QUANT_VERSION, u32, None))
    return out
