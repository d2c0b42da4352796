"""Greedy decoding with a KV cache: one jitted prefill, then one jitted single-token step per token."""

from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from eqjax.core.linear import current_backend, use_backend
from eqjax.models.cache import KVCache

__all__ = ["generate", "greedy_step"]


def greedy_step(
    model: Any, params: Mapping[str, Any], tokens: jax.Array, cache: KVCache, kv_quant: Any = None
) -> tuple[jax.Array, KVCache]:
    """Run ``tokens [B, T]`` through ``model`` with ``cache``; return (argmax of the last logits ``[B]``, cache).

    Jitted per model, KV quantizer and :func:`eqjax.core.linear.use_backend` backend: the backend is part of
    the compiled step's key, so switching backends recompiles instead of reusing the other's program.
    """
    return _greedy_step(model, params, tokens, cache, kv_quant, current_backend())


@functools.partial(jax.jit, static_argnames=("model", "kv_quant", "backend"))
def _greedy_step(model: Any, params: Mapping[str, Any], tokens: jax.Array, cache: KVCache, kv_quant: Any,
                 backend: str) -> tuple[jax.Array, KVCache]:
    with use_backend(backend):
        logits, cache = model.apply(params, tokens, cache=cache, kv_quant=kv_quant)
    return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache


def generate(
    model: Any,
    params: Mapping[str, Any],
    prompt: jax.Array,
    max_new_tokens: int,
    *,
    max_len: int | None = None,
    kv_quant: Any = None,
    cache_dtype: Any = jnp.float32,
) -> jax.Array:
    """Greedy continuation of ``prompt [B, T0]`` (int32): returns ``[B, T0 + max_new_tokens]``.

    ``model`` is an :class:`eqjax.models.Model`; ``max_len`` sizes the cache (default exactly
    ``T0 + max_new_tokens``). Raises ValueError when the cache or the model's positions are too short.
    """
    prompt = jnp.asarray(prompt, jnp.int32)
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must be [batch, length >= 1] token ids, got shape {prompt.shape}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    B, T0 = prompt.shape
    need = T0 + max_new_tokens
    max_len = need if max_len is None else max_len
    if max_len < need:
        raise ValueError(f"max_len {max_len} < prompt length {T0} + max_new_tokens {max_new_tokens}")
    limit = getattr(model.config, "n_positions", None)
    if limit is not None and need > limit:
        raise ValueError(f"{need} tokens exceed the model's {limit} learned positions")
    if max_new_tokens == 0:
        return prompt
    cache = model.init_cache(B, max_len, cache_dtype)
    tok, cache = greedy_step(model, params, prompt, cache, kv_quant)
    out = [tok]
    for _ in range(max_new_tokens - 1):
        tok, cache = greedy_step(model, params, tok[:, None], cache, kv_quant)
        out.append(tok)
    return jnp.concatenate([prompt, jnp.stack(out, axis=1)], axis=1)
