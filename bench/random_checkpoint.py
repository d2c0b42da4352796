"""Random-weight Hugging Face Llama checkpoints of real model shapes, for time and memory measurements.

The weights are random: figures measured on these checkpoints are time and memory only (a perplexity,
accuracy or quantization error of random weights says nothing about the real model).

Shapes (:data:`SHAPES`): Llama-3.2-1B, Llama-3.2-3B (tied embeddings, llama3 RoPE scaling, 131072 positions),
Llama-3-8B (untied ``lm_head``, no RoPE scaling, 8192 positions) and ``tiny`` for tests. Each directory holds
``config.json`` (model_type llama), bfloat16 ``model-0000i-of-0000N.safetensors`` shards with
``model.safetensors.index.json``, SmolLM2's tokenizer files (from eqjax's default GGUF model; its 49152 ids
address the first rows of the embedding), ``generation_config.json`` and :data:`MARKER`.

Values: linear weights normal with std ``1/sqrt(fan_in)`` (every projection keeps unit variance, so the
residual stream grows like ``sqrt(2 * layers)`` and the logits have std about 1: finite and not
degenerate through 32 RMSNorm layers), embeddings normal with std 0.02, norm weights 1. Tensor ``i`` (in
file order) comes from ``numpy.random.default_rng([seed, i])``, so a seed gives the same bytes whatever
``--shard-mb``.

Memory: each shard's header is written first (every shape is known), then each tensor is generated and
written in row chunks (float32 temporaries of at most :data:`CHUNK_ELEMENTS` * 4 bytes); no tensor or shard
is held whole. The directory is written into a temporary sibling and renamed into place at the end.

Usage: python bench/random_checkpoint.py --shape 8b --out DIR [--shard-mb 2000] [--seed 0] [--overwrite]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import pathlib
import resource
import shutil
import sys
import time
from typing import IO, Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
# bench/ (the script's directory) holds an onnx.py that would shadow the onnx package eqjax.export imports
sys.path[:] = [str(ROOT)] + [x for x in sys.path if pathlib.Path(x or ".").resolve() != ROOT / "bench"]

import ml_dtypes  # noqa: E402

from eqjax.core.errors import InputError, OutputError  # noqa: E402
from eqjax.io.atomic import atomic_directory  # noqa: E402

MARKER = "random_checkpoint.json"
NOTE = "random weights: figures from this checkpoint are time and memory only"
INDEX = "model.safetensors.index.json"
CHUNK_ELEMENTS = 8 * 2**20
"""Largest float32 temporary, in elements (32 MiB)."""
EMBED_STD = 0.02
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
_V3 = 128256

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 49152, "tie_word_embeddings": False,
             "max_position_embeddings": 8192, "rope_scaling": _LLAMA3_ROPE},
    "1b": {"hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 64, "vocab_size": _V3, "tie_word_embeddings": True,
           "max_position_embeddings": 131072, "rope_scaling": _LLAMA3_ROPE},
    "3b": {"hidden_size": 3072, "num_hidden_layers": 28, "intermediate_size": 8192, "num_attention_heads": 24,
           "num_key_value_heads": 8, "head_dim": 128, "vocab_size": _V3, "tie_word_embeddings": True,
           "max_position_embeddings": 131072, "rope_scaling": _LLAMA3_ROPE},
    "8b": {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "vocab_size": _V3, "tie_word_embeddings": False,
           "max_position_embeddings": 8192, "rope_scaling": None},
}
SHAPES["8b1"] = {**SHAPES["8b"], "num_hidden_layers": 1}  # one 8B block with the 8B table and head: a probe
"""The shape fields of each checkpoint's ``config.json`` (Llama-3.2-1B, Llama-3.2-3B, Llama-3-8B, the 8B shape's
first block alone, a test model)."""


def hf_config(shape: str, bos_token_id: int | None = None, eos_token_id: int | None = None) -> dict[str, Any]:
    """The ``config.json`` dict of ``shape`` (bfloat16 weights; token ids as given)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
            "attention_dropout": 0.0, "mlp_bias": False, "hidden_act": "silu", "initializer_range": 0.02,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "use_cache": True, "torch_dtype": "bfloat16",
            "dtype": "bfloat16", "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, **SHAPES[shape]}


def tensors(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """``(HF name, HF shape)`` of every tensor of ``shape``, in file order; linears are ``[out, in]``."""
    c = SHAPES[shape]
    d, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = c.get("head_dim") or d // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, d))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (d,)), (p + "self_attn.q_proj.weight", (q, d)),
                (p + "self_attn.k_proj.weight", (kv, d)), (p + "self_attn.v_proj.weight", (kv, d)),
                (p + "self_attn.o_proj.weight", (d, q)), (p + "post_attention_layernorm.weight", (d,)),
                (p + "mlp.gate_proj.weight", (f, d)), (p + "mlp.up_proj.weight", (f, d)),
                (p + "mlp.down_proj.weight", (d, f))]
    out.append(("model.norm.weight", (d,)))
    if not c["tie_word_embeddings"]:
        out.append(("lm_head.weight", (v, d)))
    return out


def n_params(shape: str) -> int:
    """The number of weights the files of ``shape`` hold (a tied ``lm_head`` counted once)."""
    return sum(math.prod(s) for _, s in tensors(shape))


def n_bytes(shape: str) -> int:
    """Bytes of tensor data of ``shape`` (bfloat16: 2 per weight; headers not counted)."""
    return 2 * n_params(shape)


def plan_shards(shape: str, shard_mb: float) -> list[list[tuple[int, str, tuple[int, ...]]]]:
    """``(tensor index, name, shape)`` per shard: a new shard starts when a tensor would take the current
    one past ``shard_mb`` (10**6 bytes) of data; a tensor larger than that gets a shard of its own."""
    limit, shards, size = shard_mb * 1e6, [[]], 0
    for i, (name, s) in enumerate(tensors(shape)):
        nb = 2 * math.prod(s)
        if shards[-1] and size + nb > limit:
            shards.append([])
            size = 0
        shards[-1].append((i, name, s))
        size += nb
    return shards


def _header(entries: list[tuple[int, str, tuple[int, ...]]]) -> bytes:
    """A safetensors header (length prefix + JSON padded with spaces to 8 bytes) for bfloat16 ``entries``."""
    head: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for _, name, s in entries:
        nb = 2 * math.prod(s)
        head[name] = {"dtype": "BF16", "shape": list(s), "data_offsets": [pos, pos + nb]}
        pos += nb
    blob = json.dumps(head, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return len(blob).to_bytes(8, "little") + blob


def _write_tensor(fh: IO[bytes], name: str, shape: tuple[int, ...], rng: np.random.Generator) -> None:
    """Generate tensor ``name`` and append its bfloat16 bytes to ``fh``, ``CHUNK_ELEMENTS`` at a time."""
    if len(shape) == 1:
        fh.write(np.ones(shape, ml_dtypes.bfloat16).view(np.uint16).data)
        return
    rows, cols = shape
    std = EMBED_STD if name == "model.embed_tokens.weight" else 1.0 / math.sqrt(cols)
    step = max(1, CHUNK_ELEMENTS // cols)
    for r in range(0, rows, step):
        x = rng.standard_normal((min(step, rows - r), cols), dtype=np.float32)
        x *= np.float32(std)
        fh.write(x.astype(ml_dtypes.bfloat16).view(np.uint16).data)


def _ours(path: pathlib.Path) -> bool:
    """Whether ``path`` holds a marker this utility wrote."""
    try:
        obj = json.loads((path / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(obj, dict) and obj.get("note") == NOTE


def _check_out(out: pathlib.Path, overwrite: bool, need: int) -> None:
    """Refuse (OutputError) a file at ``out``, a non-empty ``out`` without ``overwrite``, a directory this
    utility did not write, or a disk without ``need`` bytes free."""
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out} is a file: expected a directory path")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise OutputError(f"--out {out} exists and is not empty (pass --overwrite to replace it)")
        if out.is_symlink() or not _ours(out):
            raise OutputError(f"--out {out} was not written by random_checkpoint.py (no {MARKER}): refusing to "
                              "replace it even with --overwrite")
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    free = shutil.disk_usage(parent).free
    if free < need:
        raise OutputError(f"--out {out}: {need / 2**30:.2f} GiB needed, {free / 2**30:.2f} GiB free on its disk")


@functools.cache
def _tokenizer_files(context_length: int) -> tuple[dict[str, str], dict[str, int]]:
    """SmolLM2's HF tokenizer files (from eqjax's default GGUF model) and generation_config.json, and the
    tokenizer's ``{bos,eos}_token_id``."""
    from eqjax.export.package import tokenizer_files
    from eqjax.io.gguf import default_model_path, read_metadata
    from eqjax.io.tokenizer import Tokenizer

    gguf = default_model_path()
    meta = read_metadata(gguf, tokenizer=True)
    tok = Tokenizer.from_metadata(meta, source=str(gguf))
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}
    files = tokenizer_files(tok, chat_template=meta.get("tokenizer.chat_template"), context_length=context_length)
    files["generation_config.json"] = json.dumps({**ids, "_from_model_config": True}, indent=2)
    return files, ids


def write_checkpoint(shape: str, out: str | os.PathLike[str], *, shard_mb: float = 2000.0, seed: int = 0,
                     overwrite: bool = False) -> dict[str, Any]:
    """Write the random ``shape`` checkpoint directory ``out`` (atomically).

    Returns ``{"path", "shards", "parameters", "bytes" (tensor data), "seconds"}``. Raises OutputError for
    an ``out`` it may not write (see :func:`_check_out`), InputError for an unknown shape, ``shard_mb <= 0`` or ``seed < 0``.
    """
    t0 = time.perf_counter()
    if shape not in SHAPES:
        raise InputError(f"unknown shape {shape!r}: expected one of {', '.join(SHAPES)}")
    if not shard_mb > 0:
        raise InputError(f"--shard-mb must be > 0, got {shard_mb}")
    if seed < 0:
        raise InputError(f"--seed must be >= 0, got {seed}")
    path = pathlib.Path(out)
    shards = plan_shards(shape, shard_mb)
    _check_out(path, overwrite, n_bytes(shape) + 2**24 * len(shards))
    cached, ids = _tokenizer_files(SHAPES[shape]["max_position_embeddings"])
    files, config = dict(cached), hf_config(shape, **ids)
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    with atomic_directory(path, overwrite=overwrite, kind="random-checkpoint") as tmp:
        for file, entries in zip(names, shards):
            head = _header(entries)
            with open(tmp / file, "wb") as fh:
                fh.write(head)
                for i, name, s in entries:
                    _write_tensor(fh, name, s, np.random.default_rng([seed, i]))
                expected = len(head) + sum(2 * math.prod(s) for _, _, s in entries)
                if fh.tell() != expected:
                    raise RuntimeError(f"{file}: wrote {fh.tell()} bytes, expected {expected}")
        index = {"metadata": {"total_size": n_bytes(shape)},
                 "weight_map": {name: file for file, entries in zip(names, shards) for _, name, _ in entries}}
        files[INDEX] = json.dumps(index, indent=2)
        files["config.json"] = json.dumps(config, indent=2)
        files[MARKER] = json.dumps({"shape": shape, "seed": seed, "shard_mb": shard_mb, "note": NOTE}, indent=2)
        for name, text in files.items():
            (tmp / name).write_text(text + ("" if text.endswith("\n") else "\n"), encoding="utf-8")
    return {"path": str(path), "shards": len(shards), "parameters": n_params(shape), "bytes": n_bytes(shape),
            "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    """The CLI: one line on success (exit 0); one line on stderr and exit 2 for a refused ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", required=True, choices=list(SHAPES))
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    ap.add_argument("--shard-mb", type=float, default=2000.0, help="tensor data per shard, 10**6 bytes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overwrite", action="store_true", help="replace a directory this utility wrote")
    args = ap.parse_args(argv)
    try:
        info = write_checkpoint(args.shape, args.out, shard_mb=args.shard_mb, seed=args.seed,
                                overwrite=args.overwrite)
    except InputError as e:
        print(f"random_checkpoint: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"random_checkpoint: cannot write {args.out}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{info['path']}: {info['shards']} shards, {info['parameters']:,} parameters, "
          f"{info['bytes'] / 2**30:.2f} GiB, {info['seconds']:.1f} s (peak RSS {rss:.0f} MiB; {NOTE})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
