"""What the export and search commands read: ``--model`` (a GGUF file or an HF directory, float or
compressed-tensors) and ``--checkpoint`` (eqjax's Orbax checkpoint or a compressed-tensors HF directory),
checked before any work and loaded as :class:`Source` / checkpoint params."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any

import jax

from eqjax.cli.formats import is_hf_quantized, load_hf_quantized
from eqjax.core.errors import CompatibilityError, InputError
from eqjax.io.compressed_tensors import FORMAT as CT_FORMAT
from eqjax.io.gguf import default_model_path
from eqjax.io.gptq import GPTQ_FORMAT, is_gptq
from eqjax.io.hf import CheckpointError
from eqjax.io.load import load_model, stream_model
from eqjax.io.orbax import is_partial_checkpoint, load_quantized, read_manifest

__all__ = ["Source", "CHECKPOINT_KINDS", "check_model_source", "check_checkpoint", "load_source",
           "checkpoint_params", "hf_quantized_kind", "max_context", "whole_model_exceeds_memory"]

CHECKPOINT_KINDS = "an eqjax Orbax checkpoint (eqjax quantize) or an HF quantized directory (compressed-tensors, GPTQ)"


@dataclasses.dataclass
class Source:
    """A loaded ``--model``: eqjax's model, its params (quantized for a compressed-tensors directory), its
    tokenizer and the path it came from (the default model's GGUF file when none was given)."""

    model: Any
    params: Any
    tokenizer: Any
    path: str

    @property
    def is_gguf(self) -> bool:
        return self.path.endswith(".gguf")

    @property
    def quantized(self) -> bool:
        return is_hf_quantized(self.path)


def check_model_source(path: str | None, *, float_only: str | None = None) -> None:
    """Refuse a ``--model`` that is missing, neither a .gguf file nor a directory, an HF directory without
    tokenizer.json, or (``float_only``: the command needing float weights) a compressed-tensors directory."""
    if path is None:
        return
    p = pathlib.Path(path)
    if not p.exists():
        raise InputError(f"model not found (--model {p}): expected a .gguf file or an HF directory, found nothing")
    if not p.is_dir():
        if p.suffix != ".gguf":
            raise InputError(f"unsupported model (--model {p}): expected a .gguf file or an HF directory, found a "
                             f"{p.suffix or 'suffix-less'} file")
        return
    if not (p / "tokenizer.json").is_file():
        raise CompatibilityError(f"no tokenizer (--model {p}): expected {p / 'tokenizer.json'} (an HF directory "
                                 "needs one), found none")
    if float_only and is_hf_quantized(path):
        raise InputError(f"quantized model (--model {p}): expected float weights for {float_only}, found a "
                         "compressed-tensors checkpoint")


def check_checkpoint(path: str, *, kv_refusal: str | None = None) -> dict[str, Any] | None:
    """Pre-flight of ``--checkpoint`` (cheap: no array is read): the Orbax manifest, or None for a
    compressed-tensors directory. Refuses a missing path, a directory that is neither kind, an interrupted or
    corrupt save, and (``kv_refusal``: why the output cannot hold them) KV-cache settings."""
    p = pathlib.Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint not found (--checkpoint {p}): expected {CHECKPOINT_KINDS}, found nothing")
    if not p.is_dir():
        raise CheckpointError(f"not a checkpoint (--checkpoint {p}): expected {CHECKPOINT_KINDS}, found a file")
    if is_hf_quantized(path):
        return None
    if not (p / "eqjax.json").is_file() and not is_partial_checkpoint(p):
        what = "a float HF directory" if (p / "config.json").is_file() else "a directory without eqjax.json"
        raise CheckpointError(f"not a checkpoint (--checkpoint {p}): expected {CHECKPOINT_KINDS}, found {what}")
    manifest = read_manifest(p)
    kv = manifest.get("kv")
    if kv and kv_refusal:
        raise CheckpointError(f"checkpoint quantizes the KV cache (--checkpoint {p}: recipe {manifest.get('recipe')!r}, "
                              f"K{kv.get('key_bits')}V{kv.get('value_bits')}): expected weights only, found KV-cache "
                              f"settings ({kv_refusal})")
    return manifest


def load_source(model_path: str | None, checkpoint: str | None = None) -> Source:
    """The ``--model`` (default: the bundled SmolLM2-135M GGUF); a compressed-tensors ``checkpoint`` is its own
    model when ``model_path`` is None."""
    own = model_path is None and is_hf_quantized(checkpoint)
    path = str(checkpoint if own else model_path or default_model_path())
    model, params, tok = load_model(path)
    if tok is None:
        raise CompatibilityError(f"no tokenizer ({path}): expected {pathlib.Path(path) / 'tokenizer.json'}, found none")
    return Source(model, params, tok, path)


def hf_quantized_kind(checkpoint: str) -> str:
    """The format name of an HF quantized directory: ``gptq`` or ``compressed-tensors``."""
    return GPTQ_FORMAT if is_gptq(checkpoint) else CT_FORMAT


def checkpoint_params(checkpoint: str, manifest: dict[str, Any] | None, source: Source) -> tuple[Any, str]:
    """``(params, recipe name)`` of ``checkpoint`` (its manifest from :func:`check_checkpoint`), checked against
    ``source``'s model: an Orbax checkpoint made for another model or a compressed-tensors directory of other
    shapes is a CompatibilityError naming the key or parameter."""
    if manifest is None:
        kind = hf_quantized_kind(checkpoint)
        if source.path == str(checkpoint):
            return source.params, kind
        return load_hf_quantized(checkpoint, source.model, source.params), kind
    params, manifest = load_quantized(checkpoint, model=source.model)
    return params, str(manifest.get("recipe") or "checkpoint")


def max_context(path: str | None) -> int | None:
    """An HF directory's ``max_position_embeddings`` (config.json), None when unreadable or absent."""
    if path is None or not pathlib.Path(path).is_dir():
        return None
    try:
        value = json.loads((pathlib.Path(path) / "config.json").read_text(encoding="utf-8")).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


def _available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (what can be allocated without swapping), None off Linux."""
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def whole_model_exceeds_memory(directory: str) -> tuple[float, float] | None:
    """``(GiB, GiB available)`` when evaluating the HF directory's model whole would hold more float32 weights than
    the memory available now (XLA dequantizes every block's weights of a whole-model program at once), None when
    they fit, the memory is unknown or there are several devices (block at a time runs on one). Reads the config
    and tensor headers only."""
    if jax.device_count() > 1:
        return None
    model, _, _ = stream_model(directory)
    shapes = jax.tree.leaves(model.param_shapes(), is_leaf=lambda x: isinstance(x, tuple))
    need, avail = 4 * sum(math.prod(s) for s in shapes), _available_bytes()
    return (need / 2**30, avail / 2**30) if avail is not None and need > avail else None
