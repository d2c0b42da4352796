"""Checkpoint formats of ``eqjax quantize --format`` and ``eqjax eval --checkpoint``: eqjax's Orbax checkpoint, a
compressed-tensors HF directory (:mod:`eqjax.io.compressed_tensors`) that vLLM and transformers load, or a GPTQ
HF directory (:mod:`eqjax.io.gptq`)."""

from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Any

import jax
import numpy as np

from eqjax.core.errors import CompatibilityError, InputError
from eqjax.core.hostmem import release_free_memory
from eqjax.export.package import tokenizer_files
from eqjax.io.compressed_tensors import (
    FORMAT,
    TOKENIZER_FILES,
    check_recipe,
    is_compressed_tensors,
    load_compressed_tensors,
    save_compressed_tensors,
    save_compressed_tensors_streamed,
)
from eqjax.io.gguf import default_model_path, read_metadata
from eqjax.io.gptq import GPTQ_FORMAT, is_gptq, load_gptq, save_gptq, save_gptq_streamed
from eqjax.io.gptq import check_recipe as check_gptq_recipe
from eqjax.io.hf import FILE_DTYPES
from eqjax.io.orbax import CHECKPOINT_ENTRIES
from eqjax.recipes.stream import check_streamable, stream_quantize

__all__ = ["FORMATS", "add_format_args", "check_format", "replaceable", "save_in_format", "stream_to_format", "is_hf_quantized",
           "load_hf_quantized"]

FORMATS = ("orbax", FORMAT, GPTQ_FORMAT)


def add_format_args(p: Any) -> None:
    """``--format`` and ``--dtype`` of ``eqjax quantize``."""
    p.add_argument("--format", choices=FORMATS, default="orbax",
                   help="orbax: eqjax's checkpoint (every recipe; 'eqjax eval --checkpoint' reads it); compressed-tensors: "
                        "an HF directory vLLM, SGLang and transformers load (4/8-bit weights, int8 W8A8); gptq: the "
                        "GPTQ layout (qweight / qzeros / scales / g_idx; 4/8-bit weight-only groups)")
    p.add_argument("--dtype", choices=FILE_DTYPES, default="bfloat16",
                   help="compressed-tensors: the dtype of float tensors and scales in the files (default bfloat16)")
    p.add_argument("--stream", action="store_true",
                   help="for models larger than memory: read the weights on demand and quantize and write one "
                        "decoder block at a time (--model: an HF safetensors directory; --format compressed-tensors or gptq)")
    p.add_argument("--resume", action="store_true",
                   help="with --stream: go on from the last finished block of a killed run of the same command "
                        "(its progress is kept in .<out name>.partial beside --out)")


def check_format(fmt: str, recipe: Any, *, stream: bool = False, model: str | None = None) -> None:
    """Refuse, before any work, a recipe the output format cannot hold (naming recipe, format and why), and a
    ``--stream`` run the format or the recipe cannot take."""
    if fmt == FORMAT:
        check_recipe(recipe)
    elif fmt == GPTQ_FORMAT:
        check_gptq_recipe(recipe)
    if not stream:
        return
    if fmt not in (FORMAT, GPTQ_FORMAT):
        raise InputError(f"--stream writes --format {FORMAT} or {GPTQ_FORMAT} (one shard per block); found --format {fmt}")
    if model is None or not pathlib.Path(model).is_dir():
        raise InputError(f"--stream reads an HF safetensors directory (--model DIR); found --model "
                         f"{model or '(the default GGUF model)'}")
    check_streamable(recipe)


def stream_to_format(fmt: str, out: str, setup: Any, recipe: Any, *, model_path: str, dtype: str, overwrite: bool,
                     seed: int, say: Any, resume: bool = False) -> str:
    """Quantize ``setup``'s streamed params (:class:`eqjax.io.hf.StreamedParams`) unit by unit into a
    compressed-tensors or GPTQ (``fmt``) directory, one shard per unit, its progress kept after each unit
    (``resume``: go on from a killed run's); returns a one-line summary."""
    files, copy_from, ids = _tokenizer(model_path, setup.tokenizer, setup.model.config)
    sp, model = setup.params, setup.model
    cal = setup.calib_windows if recipe.needs_calibration else None
    digest = hashlib.sha256(np.ascontiguousarray(np.asarray(cal, np.int64)).tobytes()).hexdigest() if cal is not None else None
    src = pathlib.Path(model_path).absolute()
    files_seen = {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(src.iterdir())
                  if f.suffix in (".safetensors", ".json") and f.is_file()}  # cheap: not a hash of the weights
    run = {"model": str(src), "model files": files_seen, "recipe": repr(recipe), "seed": seed, "dtype": dtype,
           "calibration": digest}

    def unit_done(line: str) -> None:  # called once each unit's leaves are dropped
        release_free_memory()
        say(line)

    def produce(emit: Any, ledger: Any) -> None:
        stream_quantize(model, sp.paths, sp.load, recipe, cal, emit, seed=seed, progress=unit_done, ledger=ledger)

    kw = dict(files=files, copy_from=copy_from, extra_config=ids, overwrite=overwrite, run=run, resume=resume)
    if fmt == GPTQ_FORMAT:
        return _gptq_line(save_gptq_streamed(out, model, produce, **kw))
    return _ct_line(save_compressed_tensors_streamed(out, model, produce, dtype=dtype, **kw))


def replaceable(fmt: str) -> tuple[str, ...]:
    """Entries of an existing output directory that a new checkpoint of ``fmt`` replaces by name."""
    return (*TOKENIZER_FILES, "config.json", "model.safetensors") if fmt != "orbax" else CHECKPOINT_ENTRIES


def _tokenizer(model_path: str | None, tok: Any, config: Any) -> tuple[dict[str, str], pathlib.Path | None, dict]:
    """``(files to write, directory to copy the tokenizer from, token ids for config.json)``."""
    src = pathlib.Path(model_path) if model_path else None
    ids = {k: v for k, v in (("bos_token_id", getattr(tok, "bos_id", None)), ("eos_token_id", getattr(tok, "eos_id", None)))
           if v is not None}
    if src is not None and src.is_dir():
        return {}, src, ids
    if tok is None or not hasattr(tok, "backend"):
        return {}, None, ids
    template = read_metadata(src or default_model_path()).get("tokenizer.chat_template")
    ctx = int(getattr(config, "max_position_embeddings", 0) or 2048)
    files = tokenizer_files(tok, chat_template=template, context_length=ctx)
    files["generation_config.json"] = json.dumps({**ids, "_from_model_config": True}, indent=2)
    return files, None, ids


def save_in_format(fmt: str, out: str, setup: Any, qparams: Any, *, model_path: str | None, dtype: str,
                   overwrite: bool) -> str:
    """Write ``qparams`` as a ``fmt`` checkpoint (non-Orbax formats only); returns a one-line summary."""
    files, copy_from, ids = _tokenizer(model_path, setup.tokenizer, setup.model.config)
    if fmt == GPTQ_FORMAT:
        return _gptq_line(save_gptq(out, setup.model, qparams, files=files, copy_from=copy_from, extra_config=ids,
                                    overwrite=overwrite))
    info = save_compressed_tensors(out, setup.model, qparams, dtype=dtype, files=files, copy_from=copy_from,
                                   extra_config=ids, overwrite=overwrite)
    return _ct_line(info)


def _gptq_line(info: dict[str, Any]) -> str:
    kind = "sym" if info["sym"] else "asym"
    return f"saved {info['path']} ({GPTQ_FORMAT}: int{info['bits']} g{info['group_size']} {kind}, {info['bytes'] / 2**20:.1f} MiB)"


def _ct_line(info: dict[str, Any]) -> str:
    fmts = sorted({s["format"] for s in info["schemes"].values()})
    note = (f"; {len(info['regrouped'])} weight(s) with a shorter last group written as smaller groups (same values)"
            if info["regrouped"] else "")
    return f"saved {info['path']} ({FORMAT}: {', '.join(fmts)}, {info['bytes'] / 2**20:.1f} MiB{note})"


def is_hf_quantized(path: str | None) -> bool:
    """Whether ``path`` is an HF directory holding a compressed-tensors or GPTQ checkpoint."""
    return path is not None and pathlib.Path(path).is_dir() and (is_compressed_tensors(path) or is_gptq(path))


def load_hf_quantized(path: str, model: Any, params: Any) -> Any:
    """The quantized params of the compressed-tensors or GPTQ directory ``path``, checked against ``model``'s params."""
    loaded_model, qparams = load_gptq(path) if is_gptq(path) else load_compressed_tensors(path)
    def shapes(tree: Any) -> Any:
        return jax.tree.map(lambda x: tuple(x.shape), tree, is_leaf=lambda x: hasattr(x, "shape"))

    if shapes(params) != shapes(qparams):
        raise CompatibilityError(f"checkpoint made for another model (--checkpoint {path} vs --model): expected the "
                                 f"architecture and shapes of --model, found {type(loaded_model.config).__name__} "
                                 f"{loaded_model.config.hidden} hidden x {loaded_model.config.n_layers} layers")
    return qparams
