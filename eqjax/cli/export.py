"""The export commands: ``eqjax export-onnx`` (an onnxruntime-genai package directory) and ``eqjax export-gguf``
(a llama.cpp GGUF file). Each quantizes ``--model`` with ``--recipe``, or exports a saved ``--checkpoint`` (eqjax's
Orbax checkpoint or a compressed-tensors HF directory) as it is, without quantizing again. Both take a GGUF file or
an HF directory (float or compressed-tensors) as ``--model``; export-gguf copies a GGUF source's metadata and
tokenizer, or makes them from an HF directory's config.json and tokenizer (:mod:`eqjax.io.gguf_meta`)."""

from __future__ import annotations

import pathlib
import sys
from typing import Any

from eqjax.cli.flags import add_calibration_args
from eqjax.cli.formats import is_hf_quantized
from eqjax.cli.sources import (
    CHECKPOINT_KINDS,
    Source,
    check_checkpoint,
    check_model_source,
    checkpoint_params,
    hf_quantized_kind,
    load_source,
    max_context,
    whole_model_exceeds_memory,
)
from eqjax.core.errors import CompatibilityError, InputError
from eqjax.core.hostmem import release_free_memory
from eqjax.data import calibration_windows, wikipedia_tokens
from eqjax.export.graph import ExportError
from eqjax.export.package import TARGETS, HFPackageTokenizer, check_recipe, export_package
from eqjax.export.qlower import check_exportable, export_params
from eqjax.io.gguf import GGUFError, default_model_path, read_metadata
from eqjax.io.gguf_write import BLOCK, check_gguf_recipe, export_gguf, source_metadata
from eqjax.io.load import stream_model
from eqjax.recipes.apply import quantize
from eqjax.recipes.registry import EMBEDDINGS, get_recipe, with_embedding

EMBEDDING_CHOICES = ("recipe", *EMBEDDINGS)


def add_export_args(p: Any) -> Any:
    """Arguments of ``eqjax export-onnx``."""

    g = p.add_mutually_exclusive_group()
    g.add_argument("--recipe", default="fp", help="built-in recipe name or a .toml/.json recipe file (default fp)")
    g.add_argument("--checkpoint", default=None, help=f"export this checkpoint as saved, without quantizing: "
                   f"{CHECKPOINT_KINDS} (made for --model; a compressed-tensors one is its own model without --model)")
    p.add_argument("--out", required=True, help="output package directory (model.onnx, genai_config.json, tokenizer)")
    p.add_argument("--model", default=None, help="a .gguf file or an HF directory (float or compressed-tensors; its "
                   "tokenizer files are copied) (default: the bundled SmolLM2-135M)")
    p.add_argument("--target", default="cpu", choices=sorted(TARGETS),
                   help="runtime target: picks the MatMulNBits accuracy level (cpu: float activations, within 0.5 %% of "
                        "eqjax's perplexity; cpu-int8: int8 activations, faster, costs perplexity)")
    p.add_argument("--accuracy-level", type=int, default=None, choices=(0, 1, 2, 3, 4),
                   help="override the MatMulNBits accuracy_level of --target")
    p.add_argument("--embedding", default="recipe", choices=EMBEDDING_CHOICES,
                   help="quantize the embedding table (and a tied LM head): int8 per row, int4 groups of 32, or w7a8 "
                        "(7-bit rows; a tied head's activations int8 per token); 'recipe' keeps what the recipe does")
    p.add_argument("--context-length", type=int, default=None, help="max sequence length (default: the model's)")
    p.add_argument("--no-check", action="store_true", help="skip the onnxruntime vs eqjax logits check")
    add_calibration_args(p)
    return p


def recipe_for_export(name: str, embedding: str = "recipe") -> Any:
    """The recipe ``name``, checked for exportability, with the ``--embedding`` step appended."""

    recipe = get_recipe(name)
    check_recipe(recipe)
    if embedding == "recipe":
        return recipe
    if any(str(getattr(s, "name", "")).startswith("embedding-") for s in recipe.steps):
        raise ExportError(f"conflicting embedding options (--embedding {embedding} vs --recipe {name}): expected the "
                          "embedding set once, found it in the recipe as well (drop --embedding or the +emb- suffix)")
    return with_embedding(recipe, embedding)


def check_context_length(model_path: str | None, context_length: int | None) -> None:
    """Refuse ``--context-length`` above the model's trained context (a GGUF header's ``llama.context_length``,
    read without loading the weights, or an HF directory's ``max_position_embeddings``), naming the flag and the
    model's value."""
    if context_length is None:
        return

    src = model_path or default_model_path()
    if pathlib.Path(src).is_dir():
        mx = max_context(src)
        if mx is None:
            return
    else:
        meta = read_metadata(src, tokenizer=False)
        mx = int(meta.get(f"{meta.get('general.architecture', 'llama')}.context_length") or 2048)
    if context_length > mx:
        raise CompatibilityError(f"context length above the model's (--context-length vs {src}: context_length): "
                                 f"expected <= {mx}, found {context_length}")


def check_export_args(args: Any) -> None:
    """Pre-flight of ``eqjax export-onnx`` (before any loading): the model, the checkpoint or the recipe."""
    model, ck = getattr(args, "model", None), getattr(args, "checkpoint", None)
    check_model_source(model)
    if ck is not None:
        check_checkpoint(ck, kv_refusal="the exported graph keeps a float KV cache")
        if getattr(args, "embedding", "recipe") != "recipe":
            raise InputError(f"--embedding with a checkpoint (--embedding {args.embedding} vs --checkpoint {ck}): "
                             "expected the checkpoint exported as saved, found a request to quantize its table "
                             "(quantize it with eqjax quantize --recipe ...+emb-...)")
        check_context_length(model or (ck if is_hf_quantized(ck) else None), getattr(args, "context_length", None))
        return
    recipe = recipe_for_export(args.recipe, getattr(args, "embedding", "recipe"))
    if recipe.steps and is_hf_quantized(model):
        raise InputError(f"quantized model (--model {model}): expected float weights for --recipe {recipe.name}, found "
                         f"a compressed-tensors checkpoint (export it as saved with --checkpoint {model})")
    check_context_length(model, getattr(args, "context_length", None))


def _check_onnx_params(params: Any, checkpoint: str) -> None:
    """Refuse checkpoint params the ONNX lowering cannot hold (3-bit, W8A8 with asymmetric weights), naming one."""
    for path, leaf in export_params(params)[1].items():
        try:
            check_exportable(path, leaf)
        except ExportError as e:
            raise ExportError(f"checkpoint params the export cannot hold (--checkpoint {checkpoint}): {e}") from None


def _params(args: Any, src: Source, recipe: Any) -> Any:
    """``--recipe``'s quantized params of ``src`` (calibrated on the Wikipedia split when it needs it)."""
    if src.quantized:
        return src.params
    cal = None
    if recipe.needs_calibration:

        cal = calibration_windows(wikipedia_tokens(src.tokenizer)[0], args.calib_windows, args.calib_len, 0)
    return quantize(src.params, recipe, model=src.model, calibration=cal, seed=0)


def export_main(args: Any) -> int:
    """``eqjax export-onnx``: quantize with ``--recipe`` (or load ``--checkpoint``) and write the package ``--out``."""

    ck = getattr(args, "checkpoint", None)
    check_export_args(args)
    manifest = check_checkpoint(ck) if ck else None
    src = load_source(args.model, ck)
    if ck:
        qparams, name = checkpoint_params(ck, manifest, src)
        _check_onnx_params(qparams, ck)
        what = f"checkpoint {ck}, recipe {name}"
    else:
        recipe = recipe_for_export(args.recipe, getattr(args, "embedding", "recipe"))
        qparams, name = _params(args, src, recipe), recipe.name
        what = f"recipe {name}"
    if src.is_gguf:
        tok, template = src.tokenizer, read_metadata(src.path).get("tokenizer.chat_template")
    else:
        tok, template = HFPackageTokenizer(src.path, src.tokenizer), None
    # hand the params over: the writer drops them before onnxruntime loads the package (a model near the
    # memory's size cannot be held twice)
    held, model = [qparams], src.model
    del qparams, src
    release_free_memory()  # the load's temporaries
    # an HF quantized checkpoint that is its own model: the check's reference reads it again block by block, after
    # the params are dropped
    own = ck is not None and is_hf_quantized(ck) and args.model is None and not args.no_check
    man = export_package(model, held.pop, args.out, tokenizer=tok, chat_template=template, target=args.target,
                         accuracy_level=args.accuracy_level, context_length=args.context_length, recipe=name,
                         overwrite=getattr(args, "overwrite", False), check=not args.no_check,
                         reference_params=stream_model(ck)[1] if own else None)
    out = pathlib.Path(args.out)
    print(f"wrote {out}/ ({what}, target {args.target}, MatMulNBits accuracy_level {man['accuracy_level']}):")
    for fname, size in man["files"].items():
        print(f"  {fname:24s} {size / 2**20:9.2f} MiB")
    print(f"  total {man['bytes'] / 2**20:.1f} MiB; fused ops: " + ", ".join(f"{k} x{v}" for k, v in man["fused"].items()))
    if "check" in man:
        c = man["check"]
        print(f"  check: onnxruntime vs eqjax logits max diff {c['max_rel_diff']:.2e} of their range "
              f"(tolerance {c['tolerance']}), top-1 agreement {c['top1_agreement']:.2f}")
    print(f"chat with it:\n  {sys.executable} -m eqjax.export.chat {out}")
    return 0


def add_gguf_args(p: Any) -> Any:
    """Arguments of ``eqjax export-gguf``."""
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--recipe", help="a weight-only 4/8-bit recipe (e.g. w4g128-gptq, w4g128-rtn-sym, w8)")
    g.add_argument("--checkpoint", help=f"export this checkpoint as saved, without quantizing: {CHECKPOINT_KINDS} "
                   "made for --model (4/8-bit weight-only; a compressed-tensors one is its own model without --model)")
    p.add_argument("--out", required=True, help="output .gguf file")
    p.add_argument("--model", default=None, help="a .gguf file (its metadata and tokenizer are copied) or an HF Llama "
                   "directory with a byte-level BPE tokenizer.json (default: the bundled SmolLM2-135M)")
    add_calibration_args(p)
    return p


def check_gguf_model(path: str | None) -> None:
    """Refuse a ``--model`` export-gguf cannot read (:func:`check_model_source`)."""
    if path is not None:
        check_model_source(path)


def _gguf_source(args: Any) -> str:
    """The model whose metadata the GGUF file carries: ``--model``, else a compressed-tensors / GPTQ
    ``--checkpoint`` (its own model), else the bundled SmolLM2-135M."""
    ck = getattr(args, "checkpoint", None)
    if args.model is None and ck is not None and is_hf_quantized(ck):
        return str(ck)
    return str(args.model or default_model_path())


def check_gguf_args(args: Any) -> Any:
    """Pre-flight of ``eqjax export-gguf`` (before any loading); returns the recipe, or the checkpoint's manifest
    (None for a compressed-tensors one)."""
    check_gguf_model(getattr(args, "model", None))
    ck = getattr(args, "checkpoint", None)
    if ck is not None:
        return check_checkpoint(ck, kv_refusal="a GGUF file holds weights only")
    recipe = get_recipe(args.recipe)
    check_gguf_recipe(recipe)
    return recipe


def gguf_main(args: Any) -> int:
    """``eqjax export-gguf``: quantize with ``--recipe`` (or load ``--checkpoint``), write ``--out``, read it back
    and report."""

    ck = getattr(args, "checkpoint", None)
    recipe = check_gguf_args(args)
    src_path = _gguf_source(args)
    meta = source_metadata(src_path)  # the metadata made (and any refusal) before weights are read
    c = meta[0]
    widths = {"hidden": c.hidden, "intermediate": c.intermediate, "heads x head_dim": c.n_heads * c.head_dim}
    bad = {k: v for k, v in widths.items() if v % BLOCK}
    if ck:
        quantized = recipe is None or any(m.get("kind") not in ("array", "half") for m in recipe["leaves"].values())
    else:
        quantized = bool(recipe.steps)
    if bad and quantized:
        raise GGUFError(f"{src_path}: {', '.join(f'{k} {v}' for k, v in bad.items())} not a multiple of {BLOCK}: GGUF "
                        "blocks cannot hold its quantized weights")
    own = bool(ck) and src_path == str(ck)  # a compressed-tensors / GPTQ directory as its own model: read a unit (table, head, block) at a time
    big = whole_model_exceeds_memory(src_path) if pathlib.Path(src_path).is_dir() and not own else None
    if big is not None:
        raise CompatibilityError(f"model too large for export-gguf (--model {src_path}): it loads the float32 weights "
                                 f"({big[0]:.1f} GiB) whole, {big[1]:.1f} GiB of memory is available (a compressed-"
                                 "tensors or GPTQ --checkpoint without --model is exported a block at a time)")
    if own:
        qparams, what = stream_model(ck)[1], f"checkpoint {ck}, recipe {hf_quantized_kind(ck)}"
    elif ck:
        qparams, name = checkpoint_params(ck, recipe, load_source(src_path))
        what = f"checkpoint {ck}, recipe {name}"
    else:
        src = load_source(src_path)
        qparams, what = _params(args, src, recipe), f"recipe {recipe.name}"
    try:
        info = export_gguf(qparams, args.out, source=src_path, overwrite=getattr(args, "overwrite", False),
                           metadata=meta)
    except GGUFError as e:
        if not ck:
            raise
        raise GGUFError(f"checkpoint params a GGUF file cannot hold (--checkpoint {ck}): {e}") from None
    types = ", ".join(f"{k} x{v}" for k, v in info["tensor_types"].items())
    print(f"wrote {info['path']} ({info['bytes'] / 2**20:.1f} MiB, {what}, file type {info['file_type']}; "
          f"tensors: {types})")
    print("  read back: max |file - eqjax| per type: " + ", ".join(f"{k} {v:.2e}" for k, v in info["check"].items()))
    return 0
