"""Checkpoint I/O: Hugging Face safetensors directories (:mod:`~eqjax.io.hf`), GGUF files (:mod:`~eqjax.io.gguf`,
:mod:`~eqjax.io.gguf_write`), Orbax checkpoints of qparams (:mod:`~eqjax.io.orbax`), atomic writes and output
ownership (:mod:`~eqjax.io.atomic`); :func:`load_model` loads any of them by path."""

from eqjax.io.load import HFTokenizer, load_model, stream_model

__all__ = ["load_model", "stream_model", "HFTokenizer"]
