"""GPT-2 as pure functions over a param pytree.

Param tree (kernels ``[in, out]``, as GPT-2's Conv1D already stores them; the LM head is ``wte^T``)::

    {"wte": {"embedding": [V, D]}, "wpe": {"embedding": [P, D]},
     "layers_<i>": {"ln_1": {"scale": [D], "bias": [D]},
                    "attn": {"c_attn": {"kernel": [D, 3D], "bias": [3D]},
                             "c_proj": {"kernel": [D, D], "bias": [D]}},
                    "ln_2": {"scale": [D], "bias": [D]},
                    "mlp": {"c_fc": {"kernel": [D, F], "bias": [F]}, "c_proj": {"kernel": [F, D], "bias": [D]}}},
     "ln_f": {"scale": [D], "bias": [D]}}
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp

from eqjax.core.linear import linear
from eqjax.core.qarray import ActQuantKernel, QArray
from eqjax.models.activations import activation
from eqjax.models.cache import LayerCache, update_layer
from eqjax.models.config import GPT2Config
from eqjax.models.llama import KVQuantizer, as_float, attend, float16_round, quantize_kv, tied_head

__all__ = ["param_shapes", "layer_norm", "embed", "block", "head"]

Params = Mapping[str, Any]



def param_shapes(config: GPT2Config) -> dict[str, Any]:
    """Nested dict of the param tree's shapes (tuples)."""
    D, F = config.hidden, config.intermediate

    def lin(i: int, o: int) -> dict[str, tuple[int, ...]]:
        return {"kernel": (i, o), "bias": (o,)}

    ln = {"scale": (D,), "bias": (D,)}
    layer = {
        "ln_1": ln,
        "attn": {"c_attn": lin(D, 3 * D), "c_proj": lin(D, D)},
        "ln_2": ln,
        "mlp": {"c_fc": lin(D, F), "c_proj": lin(F, D)},
    }
    tree: dict[str, Any] = {
        "wte": {"embedding": (config.vocab, D)},
        "wpe": {"embedding": (config.n_positions, D)},
    }
    tree.update({f"layers_{i}": layer for i in range(config.n_layers)})
    tree["ln_f"] = ln
    return tree


def layer_norm(x: jax.Array, p: Params, eps: float) -> jax.Array:
    """LayerNorm over the last axis in float32; returns ``x``'s dtype."""
    x32 = x.astype(jnp.float32)
    mu = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mu), axis=-1, keepdims=True)
    y = (x32 - mu) * jax.lax.rsqrt(var + eps) * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)
    return y.astype(x.dtype)


def embed(
    config: GPT2Config, params: Params, tokens: jax.Array, positions: jax.Array, dtype: Any = jnp.float32
) -> jax.Array:
    """``wte[tokens] + wpe[positions]``: ``[B, T, D]`` in ``dtype``."""

    def table(t: Any) -> jax.Array:
        return as_float(t, dtype) if isinstance(t, (QArray, ActQuantKernel)) else t

    wte, wpe = table(params["wte"]["embedding"]), table(params["wpe"]["embedding"])
    pos = jnp.broadcast_to(positions, tokens.shape)
    return (jnp.take(wte, tokens, axis=0).astype(jnp.float32) + jnp.take(wpe, pos, axis=0).astype(jnp.float32)).astype(
        dtype
    )


def block(
    config: GPT2Config,
    p: Params,
    h: jax.Array,
    positions: jax.Array,
    *,
    layer_index: int,
    cache: LayerCache | None = None,
    kv_quant: KVQuantizer | None = None,
) -> tuple[jax.Array, LayerCache | None]:
    """One GPT-2 layer on ``h [B, T, D]``; returns ``(h, cache)`` (see :func:`eqjax.models.llama.block`)."""
    c = config
    B, T, D = h.shape
    H, hd = c.n_heads, c.head_dim
    x = layer_norm(h, p["ln_1"], c.layer_norm_eps)
    qkv = linear(x, p["attn"]["c_attn"])
    q, k, v = (t.reshape(B, T, H, hd) for t in jnp.split(qkv, 3, axis=-1))
    k_f, v_f = k, v
    k, v, block = quantize_kv(kv_quant, k, v, cache)
    q, k, v = (jnp.swapaxes(t, 1, 2) for t in (q, k, v))
    recent = (float16_round(jnp.swapaxes(k_f, 1, 2)), float16_round(jnp.swapaxes(v_f, 1, 2)), block) if block else None
    positions = jnp.broadcast_to(positions, (B, T))
    if cache is None:
        keys, vals, k_pos, q_pos = k, v, positions, positions
    else:
        cache = update_layer(cache, k, v)
        keys, vals = cache.k.astype(q.dtype), cache.v.astype(q.dtype)
        k_pos = jnp.arange(cache.max_len, dtype=jnp.int32)
        q_pos = jnp.broadcast_to(cache.length + jnp.arange(T, dtype=jnp.int32), (B, T))
    scale = hd**-0.5
    if c.scale_attn_by_inverse_layer_idx:
        scale /= float(layer_index + 1)
    o = attend(q, keys, vals, q_pos, k_pos, scale=scale, recent=recent)
    h = h + linear(o, p["attn"]["c_proj"])
    x = layer_norm(h, p["ln_2"], c.layer_norm_eps)
    y = linear(activation(c.activation, linear(x, p["mlp"]["c_fc"])), p["mlp"]["c_proj"])
    return h + y, cache


def head(config: GPT2Config, params: Params, h: jax.Array) -> jax.Array:
    """Final LayerNorm and the tied head ``x @ wte^T``: float32 logits ``[B, T, V]``."""
    x = layer_norm(h, params["ln_f"], config.layer_norm_eps)
    return tied_head(x, params["wte"]["embedding"])
