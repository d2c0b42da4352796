"""The edge package: one directory that ``onnxruntime_genai.Model(dir)`` + ``Tokenizer`` + ``Generator`` run.

:func:`export_package` traces eqjax's own decode step (``model.apply(params, ids, cache=KVCache)``,
the function eqjax runs) with *symbolic* batch, sequence and cache lengths
(``jax.export.symbolic_shape``, constraint ``cache >= seq``), lowers it with the walker and the
fusions, and writes, atomically (a temporary sibling directory renamed into place)::

    model.onnx, model.onnx.data   the graph and its weights (external data)
    genai_config.json             onnxruntime-genai's decoder config (names below, KV cache shared buffer)
    tokenizer.json                the tokenizers JSON of eqjax's tokenizer (from the GGUF metadata), or
                                  an HF source directory's file, copied (:class:`HFPackageTokenizer`)
    tokenizer_config.json         special tokens, add_bos_token, chat_template (when the source has one)
    chat_template.jinja           the same template as a file (when the source has one)
    eqjax_export.json             what was exported: recipe, target, accuracy level, fused ops, check

Graph inputs: ``input_ids`` int64 ``[batch, seq]``, ``attention_mask`` int64 ``[batch, total]``,
``position_ids`` int64 ``[batch, seq]``, ``past_key_values.<i>.key|value`` float32
``[batch, kv_heads, past, head_dim]``; outputs ``logits`` float32 ``[batch, seq, vocab]`` and
``present.<i>.key|value``. The cache length eqjax's step reads is ``total - seq``; fused attention
(``GroupQueryAttention``) takes ``seqlens_k = sum(attention_mask) - 1`` and ``total`` as
onnxruntime-genai's own builder does, and RoPE (``RotaryEmbedding``) reads ``position_ids``. Past and
present may be one buffer of ``max_length`` slots (onnxruntime-genai's ``past_present_share_buffer``)
or a cache that grows by ``seq`` each call (a plain loop feeding ``present`` back as ``past``); the
unfused fallback computes eqjax's own fixed-buffer cache and needs the shared buffer.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Callable, Mapping

import numpy as np
import onnx

from eqjax.core.analysis import analyze
from eqjax.core.hostmem import release_free_memory
from eqjax.core.program import trace
from eqjax.core.pytree import flatten
from eqjax.core.qarray import ActQuantKernel
from eqjax.export.fusions import DecodeContext, find_fusions
from eqjax.export.graph import ExportError, Graph, value_info
from eqjax.export.pack import fuse_packed_attention, pack_siblings
from eqjax.export.qlower import export_params
from eqjax.export.runtime import compare_with_eqjax, eqjax_reference
from eqjax.export.tensors import DATA_FILE, TensorStore
from eqjax.export.walker import Stack, Walker
from eqjax.io.atomic import atomic_directory
from eqjax.models import KVCache

__all__ = ["TARGETS", "build_decoder", "export_package", "check_recipe", "genai_config", "tokenizer_files",
           "HFPackageTokenizer"]

TARGETS = {
    # target -> (MatMulNBits accuracy_level, what it means). The default keeps perplexity within 0.5 % of
    # eqjax's; int8 activations inside MatMulNBits (MLAS CompInt8, level 4) are faster but measured
    # +1.5 % perplexity on SmolLM2 W4 RTN g128 (1 x 256 tokens, tests/export/test_onnx.py slow test)
    "cpu": (0, "float activations in MatMulNBits (the graph computes what eqjax computes)"),
    "cpu-int8": (4, "int8 activations in MatMulNBits (fastest on x86/ARM CPUs; costs perplexity)"),
    "gpu": (0, "float activations (CUDA / DirectML kernels ignore int8 activation levels)"),
}


CHECK_TEXT = "The quick brown fox jumps over the lazy dog, and the history of the city began in 1850 when"
"""The self-check's prompt (natural text: activations as in use, which int8-activation levels depend on)."""


def _steps(steps: Any) -> Any:
    """A recipe's steps, a rotation's ``then`` steps included."""
    for step in steps:
        yield step
        yield from _steps(getattr(step, "then", ()))


def _asymmetric_w8a8(step: Any, act: bool = False) -> bool:
    """Whether ``step`` (or a rotation's ``then`` step under its ``act_bits``) makes asymmetric weights
    with quantized activations, which the MatMulInteger lowering cannot take."""
    act = act or getattr(step, "act_bits", None) is not None
    if act and getattr(step, "symmetric", True) is False:
        return True
    for r in getattr(step, "rules", ()):
        w = getattr(r, "weight", None)
        if w is not None and (act or getattr(r, "act_bits", None) is not None) and not w.symmetric:
            return True
    return any(_asymmetric_w8a8(t, act) for t in getattr(step, "then", ()))


def check_recipe(recipe: Any) -> None:
    """Refuse, before any work, recipes the export cannot represent (KV-cache quantization, 3-bit,
    quantized activations with asymmetric weights)."""
    if any(_asymmetric_w8a8(s) for s in getattr(recipe, "steps", ())):
        raise ExportError(f"recipe {recipe.name!r} quantizes activations with asymmetric weights; the W8A8 lowering "
                          "(MatMulInteger) needs symmetric weights: export a symmetric recipe")
    if getattr(recipe, "kv", None) is not None:
        kv = recipe.kv
        raise ExportError(f"recipe {recipe.name!r} quantizes the KV cache (K{kv.key_bits}V{kv.value_bits}); the "
                          "exported graph keeps a float KV cache: export a recipe without 'kv'")
    for step in _steps(getattr(recipe, "steps", ())):
        bits = {getattr(step, "bits", None)} | {getattr(r.weight, "bits", None) for r in getattr(step, "rules", ())
                                                if getattr(r, "weight", None) is not None}
        if 3 in bits:
            raise ExportError(f"recipe {recipe.name!r} makes 3-bit weights, which onnxruntime has no kernel for "
                              "(MatMulNBits takes 2, 4 or 8 bits)")


def _decode_step(model: Any) -> Any:

    def step(params: Any, ids: Any, k: Any, v: Any, length: Any) -> Any:
        logits, c = model.apply(params, ids, cache=KVCache(k, v, length))
        return logits, c.k, c.v
    return step


def build_decoder(model: Any, params: Mapping[str, Any], *, accuracy_level: int | None = 4,
                  context_length: int | None = None, fuse: bool = True,
                  store: TensorStore | None = None) -> tuple[onnx.ModelProto, dict]:
    """The decoder graph of an eqjax :class:`~eqjax.models.Model` with ``params`` (float or quantized).

    Returns ``(model_proto, info)``; ``info`` counts the fused and quantized ops and lists params that
    had to be dequantized to float. ``store``: where the initializers go as they are made (default: inside
    the ``ModelProto``; a spilling :class:`~eqjax.export.tensors.TensorStore` keeps them out of memory).
    """
    import jax
    from jax import export as jexport


    c = model.config
    L, Hkv, hd = c.n_layers, c.n_kv_heads, c.head_dim
    max_pos = int(getattr(c, "max_position_embeddings", 0) or getattr(c, "n_positions", 0) or 0)
    if context_length is not None and max_pos and context_length > max_pos:
        raise ExportError(f"context length above the model's (context_length vs max_position_embeddings): expected "
                          f"<= {max_pos}, found {context_length}")
    context_length = int(context_length or max_pos or 2048)
    b, t, s = jexport.symbolic_shape("batch, seq, cache", constraints=["cache >= seq"])
    args = (jax.ShapeDtypeStruct((b, t), np.int32), jax.ShapeDtypeStruct((L, b, Hkv, s, hd), np.float32),
            jax.ShapeDtypeStruct((L, b, Hkv, s, hd), np.float32), jax.ShapeDtypeStruct((), np.int32))
    traced, by_path = export_params(params)
    prog = trace(_decode_step(model), traced, args, what="decoder step")
    if prog.opaque:
        raise ExportError(f"the decoder step has {len(prog.opaque)} loop/cond nodes over params; unroll them to export")
    an = analyze(prog)

    g = Graph({"batch": ("input_ids", 0), "seq": ("input_ids", 1), "cache": ("past_key_values.0.key", 2)}, store=store)
    g.inputs += [value_info("input_ids", np.int64, ["batch_size", "sequence_length"]),
                 value_info("attention_mask", np.int64, ["batch_size", "total_sequence_length"]),
                 value_info("position_ids", np.int64, ["batch_size", "sequence_length"])]
    pk, pv = [f"past_key_values.{i}.key" for i in range(L)], [f"past_key_values.{i}.value" for i in range(L)]
    for i in range(L):
        g.inputs += [value_info(n, np.float32, ["batch_size", Hkv, "past_sequence_length", hd]) for n in (pk[i], pv[i])]
    ids = g.op("Cast", ["input_ids"], to=onnx.TensorProto.INT32, hint="ids")
    total = g.op("Slice", [g.op("Shape", ["attention_mask"]), g.const([1], np.int64), g.const([2], np.int64)])
    length = g.op("Cast", [g.op("Squeeze", [g.op("Sub", [total, g.dim(t)]), g.const([0], np.int64)])],
                  to=onnx.TensorProto.INT32, hint="past_length")
    mask_sum = g.op("ReduceSum", ["attention_mask", g.const([1], np.int64)], keepdims=0)
    seqlens = g.op("Cast", [g.op("Sub", [mask_sum, g.const(1, np.int64)])], to=onnx.TensorProto.INT32, hint="seqlens_k")
    total32 = g.op("Cast", [g.op("Squeeze", [total, g.const([0], np.int64)])], to=onnx.TensorProto.INT32,
                   hint="total_sequence_length")
    ctx = DecodeContext("position_ids", seqlens, total32, prog.args[3], context_length)
    fused = find_fusions(prog, ctx if fuse else None, norms=fuse)
    w = Walker(prog, an, by_path, g, accuracy_level=accuracy_level, fused=fused)
    logits, kout, vout = w.run({prog.args[0]: ids, prog.args[1]: Stack(pk), prog.args[2]: Stack(pv), prog.args[3]: length})
    g.op("Identity", [w.name(logits)], outputs=["logits"])
    g.outputs.append(value_info("logits", np.float32, ["batch_size", "sequence_length", c.vocab]))
    for i in range(L):
        for kind, st in (("key", kout), ("value", vout)):
            item = st.items[i] if isinstance(st, Stack) else None
            if item is None:
                raise ExportError("internal: the cache output is not per-layer")
            g.op("Identity", [w.name(item)], outputs=[f"present.{i}.{kind}"])
            g.outputs.append(value_info(f"present.{i}.{kind}", np.float32,
                                        ["batch_size", Hkv, "present_sequence_length", hd]))
    used = {x for n in g.nodes for x in n.input}
    if "position_ids" not in used:  # no RoPE fused: keep the input (genai feeds it), read it harmlessly
        g.op("Identity", ["position_ids"], hint="position_ids_unused")
    info = {"fused": dict(w.counts), "dequantized_to_float": sorted(set(w.dequantized)),
            "gqa": w.counts.get("GroupQueryAttention", 0) == L, "context_length": context_length}
    proto = g.finish(f"eqjax_{getattr(c, 'model_type', 'decoder')}")
    if fuse:

        info["packed_matmuls"] = pack_siblings(proto, g.store)
        info["packed_attention"] = fuse_packed_attention(proto)
    return proto, info


def genai_config(model: Any, tok: Any, *, context_length: int, share_buffer: bool = True) -> dict:
    """onnxruntime-genai's ``genai_config.json`` for the package (see the module docs for the names)."""
    c = model.config
    eos = getattr(tok, "eos_id", None)
    return {
        "model": {
            "bos_token_id": getattr(tok, "bos_id", None) if getattr(tok, "bos_id", None) is not None else 0,
            "context_length": context_length,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": "model.onnx", "head_size": c.head_dim, "hidden_size": c.hidden,
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids",
                           "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
                "num_attention_heads": c.n_heads, "num_hidden_layers": c.n_layers, "num_key_value_heads": c.n_kv_heads,
            },
            "eos_token_id": eos if eos is not None else 0,
            "pad_token_id": getattr(tok, "pad_id", None) if getattr(tok, "pad_id", None) is not None else (eos or 0),
            "type": "llama" if getattr(c, "model_type", "llama") in ("llama", "mistral", "qwen2", "qwen3") else "gpt2",
            "vocab_size": c.vocab,
        },
        "search": {"diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
                   "max_length": context_length, "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
                   "num_return_sequences": 1, "past_present_share_buffer": share_buffer, "repetition_penalty": 1.0,
                   "temperature": 1.0, "top_k": 1, "top_p": 1.0},
    }


def _json_object(f: pathlib.Path) -> dict:
    """The JSON object in ``f`` ({} when absent); ExportError naming the file when it is not one."""
    if not f.is_file():
        return {}
    try:
        obj = json.loads(f.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ExportError(f"unreadable tokenizer file ({f}): expected a JSON object, found {type(e).__name__}: "
                          f"{str(e)[:120]}") from None
    if not isinstance(obj, dict):
        raise ExportError(f"unreadable tokenizer file ({f}): expected a JSON object, found {type(obj).__name__}")
    return obj


class HFPackageTokenizer:
    """An HF directory's tokenizer as the package takes it: ``encode`` (the self-check's prompt), the
    bos / eos / pad ids of genai_config.json (``config.json``, overridden by ``generation_config.json``) and
    its files, copied: tokenizer.json, tokenizer_config.json, and the chat template (tokenizer_config.json's
    ``chat_template`` or ``chat_template.jinja``) as ``chat_template.jinja``."""

    def __init__(self, directory: str | os.PathLike[str], tokenizer: Any) -> None:
        self.directory = pathlib.Path(directory)
        self.tokenizer = tokenizer
        ids: dict[str, Any] = {}
        for name in ("config.json", "generation_config.json"):
            cfg = _json_object(self.directory / name)
            ids.update({k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None})
        eos = ids.get("eos_token_id")
        first_eos = eos[0] if isinstance(eos, list) and eos else eos
        self.bos_id: int | None = ids.get("bos_token_id")
        self.eos_id: int | list[int] | None = eos
        self.pad_id: int | None = ids.get("pad_token_id", first_eos)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def chat_template(self) -> str | None:
        """The directory's chat template: tokenizer_config.json's (a string), else chat_template.jinja's."""
        template = _json_object(self.directory / "tokenizer_config.json").get("chat_template")
        jinja = self.directory / "chat_template.jinja"
        if not isinstance(template, str) and jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        return template if isinstance(template, str) else None

    def files(self, *, context_length: int) -> dict[str, str]:
        """``{file name: text}`` of the package's tokenizer (tokenizer_config.json made when the directory has none)."""
        files = {"tokenizer.json": (self.directory / "tokenizer.json").read_text(encoding="utf-8")}
        f = self.directory / "tokenizer_config.json"
        if f.is_file():
            files["tokenizer_config.json"] = f.read_text(encoding="utf-8")
        else:
            files["tokenizer_config.json"] = json.dumps({"model_max_length": context_length,
                                                         "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2)
        template = self.chat_template()
        if template:
            files["chat_template.jinja"] = template
        return files


def tokenizer_files(tok: Any, *, chat_template: str | None, context_length: int) -> dict[str, str]:
    """``{file name: text}``: tokenizer.json, tokenizer_config.json (and chat_template.jinja); an
    :class:`HFPackageTokenizer`'s own files (its directory's template, not ``chat_template``)."""
    if isinstance(tok, HFPackageTokenizer):
        return tok.files(context_length=context_length)
    def spell(i: Any) -> str | None:
        return None if i is None else tok.id_to_token(i)
    cfg = {"add_bos_token": bool(getattr(tok, "add_bos", False)), "add_eos_token": False,
           "bos_token": spell(tok.bos_id), "eos_token": spell(tok.eos_id), "unk_token": spell(tok.unk_id),
           "pad_token": spell(tok.pad_id if tok.pad_id is not None else tok.eos_id),
           "clean_up_tokenization_spaces": False, "model_max_length": context_length,
           "tokenizer_class": "PreTrainedTokenizerFast"}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    if chat_template:
        cfg["chat_template"] = chat_template
    files = {"tokenizer.json": tok.backend.to_str(pretty=False), "tokenizer_config.json": json.dumps(cfg, indent=2)}
    if chat_template:
        files["chat_template.jinja"] = chat_template
    return files


def export_package(model: Any, params: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
                   out: str | os.PathLike[str], *, tokenizer: Any, chat_template: str | None = None,
                   target: str = "cpu", accuracy_level: int | None = None, context_length: int | None = None,
                   recipe: str = "", overwrite: bool = False, check: bool = True, fuse: bool = True,
                   reference_params: Any = None) -> dict:
    """Write the package directory ``out`` (atomically); returns the manifest (also eqjax_export.json).

    ``params``: the (quantized) params, or a zero-argument function returning them: then the writer holds the
    only reference and drops it before onnxruntime loads the package, so the params and onnxruntime's copy of
    the weights are never in memory together (what a model near the memory's size needs). The weights are
    written to ``model.onnx.data`` as the graph is built (:class:`~eqjax.export.tensors.TensorStore`).
    ``target`` picks the MatMulNBits accuracy level (:data:`TARGETS`) unless ``accuracy_level`` is given.
    ``check`` runs ``onnx.checker`` and compares onnxruntime's logits with eqjax's on a short prompt and one
    decode step (tolerances in :func:`eqjax.export.runtime.check_against_eqjax`; eqjax's logits computed one
    decoder block at a time). ``reference_params``: the same params read on demand
    (:class:`~eqjax.io.hf.StreamedParams`, e.g. of the checkpoint ``params`` were loaded from): eqjax's logits
    are then computed from them after ``params`` are dropped, one block resident at a time.
    """

    if target not in TARGETS:
        raise ExportError(f"unknown target {target!r}; choose one of {sorted(TARGETS)}")
    level = TARGETS[target][0] if accuracy_level is None else int(accuracy_level)
    params = params() if callable(params) else params
    with atomic_directory(out, overwrite=overwrite) as tmp:
        tmp = pathlib.Path(tmp)
        # initializers go to disk as they are made: the graph of a model holds no second copy of its weights
        store = TensorStore(tmp / "model.onnx.spill")
        try:
            proto, info = build_decoder(model, params, accuracy_level=level, context_length=context_length,
                                        fuse=fuse, store=store)
            store.save(proto, tmp / "model.onnx", location=DATA_FILE)
        finally:
            store.close()
        del proto
        release_free_memory()  # the build's temporaries: freed heap pages go back before the check's programs
        ctx_len = info["context_length"]
        manifest = {"recipe": recipe, "target": target, "accuracy_level": level, **info}
        reference = None
        if check:

            ids = tokenizer.encode(CHECK_TEXT)[:16] if tokenizer is not None else None
            # int8 activations (W8A8, or accuracy level 4) round differently once float sums differ in the
            # last bit, and a flipped code propagates: those get the loose tolerance, the rest the tight one
            act_q = level != 0 or any(isinstance(v, ActQuantKernel) for _, v in flatten(params))
            if reference_params is None:
                reference = eqjax_reference(model, params, accuracy_level=4 if act_q else 0, tokens=ids)
        del params  # the caller's loader left this the only reference: onnxruntime gets the memory
        release_free_memory()
        if check and reference_params is not None:
            reference = eqjax_reference(model, reference_params, accuracy_level=4 if act_q else 0, tokens=ids)
        if check:
            onnx.checker.check_model(str(tmp / "model.onnx"))
        files = {"genai_config.json": json.dumps(genai_config(model, tokenizer, context_length=ctx_len), indent=4)}
        files.update(tokenizer_files(tokenizer, chat_template=chat_template, context_length=ctx_len))
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        if reference is not None:
            manifest["check"] = compare_with_eqjax(tmp, reference)
        manifest["files"] = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        manifest["bytes"] = sum(manifest["files"].values())
        (tmp / "eqjax_export.json").write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    return manifest
