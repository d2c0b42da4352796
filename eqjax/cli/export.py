"""The export commands: ``eqjax export-onnx`` (an onnxruntime-genai package directory) and ``eqjax export-gguf``
(a llama.cpp GGUF file), each quantizing a GGUF model with ``--recipe`` first."""

from __future__ import annotations

import pathlib
import sys
from typing import Any

from eqjax.cli.flags import add_calibration_args
from eqjax.core.errors import CompatibilityError
from eqjax.data import calibration_windows, wikipedia_tokens
from eqjax.export.graph import ExportError
from eqjax.export.package import TARGETS, check_recipe, export_package
from eqjax.io.gguf import GGUFError, config_from_metadata, default_model_path, load_gguf, read_metadata
from eqjax.io.gguf_write import BLOCK, check_gguf_recipe, export_gguf
from eqjax.models import Model
from eqjax.recipes.apply import quantize
from eqjax.recipes.registry import EMBEDDINGS, get_recipe, with_embedding

EMBEDDING_CHOICES = ("recipe", *EMBEDDINGS)


def add_export_args(p: Any) -> Any:
    """Arguments of ``eqjax export-onnx``."""

    p.add_argument("--recipe", default="fp", help="built-in recipe name or a .toml/.json recipe file")
    p.add_argument("--out", required=True, help="output package directory (model.onnx, genai_config.json, tokenizer)")
    p.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2-135M)")
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
    """Refuse ``--context-length`` above the model's trained context (the GGUF header's
    ``llama.context_length``, read without loading the weights), naming the flag and the model's value."""
    if context_length is None:
        return

    src = model_path or default_model_path()
    meta = read_metadata(src, tokenizer=False)
    mx = int(meta.get(f"{meta.get('general.architecture', 'llama')}.context_length") or 2048)
    if context_length > mx:
        raise CompatibilityError(f"context length above the model's (--context-length vs {src}: context_length): "
                                 f"expected <= {mx}, found {context_length}")


def export_main(args: Any) -> int:
    """``eqjax export-onnx``: quantize with ``--recipe`` and write the package ``--out``."""

    recipe = recipe_for_export(args.recipe, getattr(args, "embedding", "recipe"))
    src = args.model or default_model_path()
    cfg, params, tok = load_gguf(src)
    model = Model(cfg)
    cal = None
    if recipe.needs_calibration:

        cal = calibration_windows(wikipedia_tokens(tok)[0], args.calib_windows, args.calib_len, 0)
    qparams = quantize(params, recipe, model=model, calibration=cal, seed=0)
    template = read_metadata(src).get("tokenizer.chat_template")
    man = export_package(model, qparams, args.out, tokenizer=tok, chat_template=template, target=args.target,
                         accuracy_level=args.accuracy_level, context_length=args.context_length, recipe=recipe.name,
                         overwrite=getattr(args, "overwrite", False), check=not args.no_check)
    out = pathlib.Path(args.out)
    print(f"wrote {out}/ (recipe {recipe.name}, target {args.target}, MatMulNBits accuracy_level "
          f"{man['accuracy_level']}):")
    for name, size in man["files"].items():
        print(f"  {name:24s} {size / 2**20:9.2f} MiB")
    print(f"  total {man['bytes'] / 2**20:.1f} MiB; fused ops: " + ", ".join(f"{k} x{v}" for k, v in man["fused"].items()))
    if "check" in man:
        c = man["check"]
        print(f"  check: onnxruntime vs eqjax logits max diff {c['max_rel_diff']:.2e} of their range "
              f"(tolerance {c['tolerance']}), top-1 agreement {c['top1_agreement']:.2f}")
    print(f"chat with it:\n  {sys.executable} -m eqjax.export.chat {out}")
    return 0


def add_gguf_args(p: Any) -> Any:
    """Arguments of ``eqjax export-gguf``."""
    p.add_argument("--recipe", required=True, help="a weight-only 4/8-bit recipe (e.g. w4g128-gptq, w4g128-rtn-sym, w8)")
    p.add_argument("--out", required=True, help="output .gguf file")
    p.add_argument("--model", default=None, help="source GGUF file (default: the bundled SmolLM2-135M); its "
                   "metadata and tokenizer are copied")
    add_calibration_args(p)
    return p


def gguf_main(args: Any) -> int:
    """``eqjax export-gguf``: quantize with ``--recipe``, write ``--out``, read it back and report."""


    recipe = get_recipe(args.recipe)
    check_gguf_recipe(recipe)
    src = args.model or default_model_path()
    c = config_from_metadata(read_metadata(src), source=str(src))
    widths = {"hidden": c.hidden, "intermediate": c.intermediate, "heads x head_dim": c.n_heads * c.head_dim}
    bad = {k: v for k, v in widths.items() if v % BLOCK}
    if bad and recipe.steps:
        raise GGUFError(f"{src}: {', '.join(f'{k} {v}' for k, v in bad.items())} not a multiple of {BLOCK}: GGUF "
                        "blocks cannot hold its quantized weights")
    cfg, params, tok = load_gguf(src)
    cal = None
    if recipe.needs_calibration:

        cal = calibration_windows(wikipedia_tokens(tok)[0], args.calib_windows, args.calib_len, 0)
    qparams = quantize(params, recipe, model=Model(cfg), calibration=cal, seed=0)
    info = export_gguf(qparams, args.out, source=src, overwrite=getattr(args, "overwrite", False))
    types = ", ".join(f"{k} x{v}" for k, v in info["tensor_types"].items())
    print(f"wrote {info['path']} ({info['bytes'] / 2**20:.1f} MiB, recipe {recipe.name}, file type {info['file_type']}; "
          f"tensors: {types})")
    print("  read back: max |file - eqjax| per type: " + ", ".join(f"{k} {v:.2e}" for k, v in info["check"].items()))
    return 0
