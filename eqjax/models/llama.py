"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Gemma, Phi-3) as pure functions over a param pytree.

Param tree (Flax naming; every ``{"kernel", "bias"?}`` goes through :func:`eqjax.core.linear.linear`, so a
kernel may be a float array, a QArray or an ActQuantKernel)::

    {"embed": {"embedding": [V, D]},
     "layers_<i>": {"attn_norm": {"scale": [D]},
                    "attn": {"q_proj": {"kernel": [D, Hq*hd], "bias"?: [Hq*hd]},
                             "k_proj": {"kernel": [D, Hkv*hd], "bias"?}, "v_proj": {...},
                             "o_proj": {"kernel": [Hq*hd, D], "bias"?},
                             "q_norm"?: {"scale": [hd]}, "k_norm"?: {"scale": [hd]}},
                    "mlp_norm": {"scale": [D]},
                    "mlp": {"gate_proj": {"kernel": [D, F]}, "up_proj": {"kernel": [D, F]},
                            "down_proj": {"kernel": [F, D]}}},
     "final_norm": {"scale": [D]},
     "lm_head"?: {"kernel": [D, V]}}          # absent when embeddings are tied

Numerics follow transformers' eager implementation: RMSNorm in float32, RoPE with the
``rotate_half`` convention (first/second half of each head paired), softmax in float32.

The architectures differ only by config fields (:class:`~eqjax.models.config.LlamaConfig`): the MLP
activation (``hidden_act``: SwiGLU, GeGLU), Gemma's ``embed_scale`` (embeddings times ``sqrt(D)``) and
``norm_style`` (where the scale multiplies), partial RoPE (``rotary_dim``, Phi-3), biases, q/k norms,
sliding windows. Norm scales in the tree are always the effective ones (Gemma's ``1 + w``), so every
norm is ``x_hat * scale`` and scale folds (SmoothQuant, AWQ) find it. Phi-3's fused ``qkv_proj`` /
``gate_up_proj`` are split into the projections above by the checkpoint loader.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from eqjax.core.linear import act_quant_matmul, linear
from eqjax.core.numerics import dequantize
from eqjax.core.qarray import ActQuantKernel, QArray
from eqjax.models.activations import activation
from eqjax.models.cache import LayerCache, update_layer
from eqjax.models.config import LlamaConfig

__all__ = [
    "KVQuantizer",
    "param_shapes",
    "rms_norm",
    "rope_inv_freq",
    "apply_rope",
    "attend",
    "quantize_kv",
    "float16_round",
    "as_float",
    "tied_head",
    "embed",
    "block",
    "head",
]

Params = Mapping[str, Any]


class KVQuantizer(Protocol):
    """The ``kv_quant`` hook: static (hashable) fake quantizers for keys and values.

    ``keys(k)`` gets pre-RoPE keys ``[B, T, Hkv, hd]`` (after Qwen3's ``k_norm``; GPT-2: right after the
    ``c_attn`` split); ``values(v)`` gets values ``[B, T, Hkv, hd]``.
    Both return arrays of the same shape and dtype. An optional ``float_block`` attribute (int, 0 = off)
    makes each query read the keys / values of its own block of that many positions unquantized (in
    float16), as a cache that quantizes only complete blocks would hold them (see :func:`attend`).
    """

    def keys(self, k: jax.Array) -> jax.Array: ...

    def values(self, v: jax.Array) -> jax.Array: ...


def param_shapes(config: LlamaConfig) -> dict[str, Any]:
    """Nested dict of the param tree's shapes (tuples), biases included only where the config has them.

    ``attention_bias`` gives q/k/v biases (and an o_proj bias for ``llama``/``qwen3``/``gemma``, as transformers).
    """
    c = config
    D, F, hd, V = c.hidden, c.intermediate, c.head_dim, c.vocab
    q, kv = c.n_heads * hd, c.n_kv_heads * hd

    def lin(i: int, o: int, bias: bool = False) -> dict[str, tuple[int, ...]]:
        return {"kernel": (i, o), "bias": (o,)} if bias else {"kernel": (i, o)}

    attn: dict[str, Any] = {
        "q_proj": lin(D, q, c.attention_bias),
        "k_proj": lin(D, kv, c.attention_bias),
        "v_proj": lin(D, kv, c.attention_bias),
        "o_proj": lin(q, D, c.attention_bias and c.model_type in ("llama", "qwen3", "gemma")),
    }
    if c.qk_norm:
        attn["q_norm"] = {"scale": (hd,)}
        attn["k_norm"] = {"scale": (hd,)}
    layer = {
        "attn_norm": {"scale": (D,)},
        "attn": attn,
        "mlp_norm": {"scale": (D,)},
        "mlp": {"gate_proj": lin(D, F), "up_proj": lin(D, F), "down_proj": lin(F, D)},
    }
    tree: dict[str, Any] = {"embed": {"embedding": (V, D)}}
    tree.update({f"layers_{i}": layer for i in range(c.n_layers)})
    tree["final_norm"] = {"scale": (D,)}
    if not c.tie_word_embeddings:
        tree["lm_head"] = {"kernel": (D, V)}
    return tree


def as_float(x: Any, dtype: Any = jnp.float32) -> jax.Array:
    """A float array from a float array, a QArray (dequantized) or an ActQuantKernel (its weight, dequantized)."""
    if isinstance(x, ActQuantKernel):
        x = x.weight
    if isinstance(x, QArray):
        return dequantize(x, dtype)
    return jnp.asarray(x).astype(dtype)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, style: str = "llama") -> jax.Array:
    """``x / rms(x) * scale`` over the last axis, normalized in float32; returns ``x``'s dtype.

    ``style="llama"`` casts the normalized ``x`` to ``x``'s dtype before the product (transformers'
    LlamaRMSNorm); ``"gemma"`` multiplies in float32 and casts after (GemmaRMSNorm). ``scale [D]`` is
    the effective scale either way (Gemma's ``1 + w``). Identical in float32.
    """
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if style == "gemma":
        return (y * scale.astype(jnp.float32)).astype(x.dtype)
    return scale.astype(x.dtype) * y.astype(x.dtype)


def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
    """Inverse frequencies ``[rotary_dim / 2]`` (float32), with the config's RoPE scaling applied."""
    hd = config.rotary_dim
    inv = (1.0 / (np.float32(config.rope_theta) ** (np.arange(0, hd, 2, dtype=np.float32) / hd))).astype(np.float32)
    s = config.rope_scaling
    if s is None:
        return inv
    if s.type == "linear":
        return (inv / np.float32(s.factor)).astype(np.float32)
    # llama3: keep high frequencies, divide low ones by factor, blend in between.
    old = s.original_max_position_embeddings
    low_wl, high_wl = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wl, inv / s.factor, inv)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return np.where(medium, blended, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate ``x [B, T, H, hd]`` at ``positions [B, T]`` (rotate_half convention, float32 angles).

    Only the first ``rd = 2 * len(inv_freq)`` channels of each head rotate (partial RoPE, Phi-3);
    the other ``hd - rd`` pass unchanged.
    """
    rd = 2 * len(inv_freq)
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, rd/2]
    ang = jnp.concatenate([ang, ang], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(ang).astype(x.dtype), jnp.sin(ang).astype(x.dtype)
    xr = x[..., :rd] if rd < x.shape[-1] else x
    half = rd // 2
    rot = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    out = xr * cos + rot * sin
    return jnp.concatenate([out, x[..., rd:]], axis=-1) if rd < x.shape[-1] else out


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_pos: jax.Array,
    k_pos: jax.Array,
    *,
    scale: float,
    window: int | None = None,
    recent: tuple[jax.Array, jax.Array, int] | None = None,
) -> jax.Array:
    """Causal (optionally sliding-window) grouped-query attention.

    Args:
      q: ``[B, Hq, T, hd]``; k, v: ``[B, Hkv, S, hd]`` (query head ``h`` uses kv head ``h // (Hq/Hkv)``).
      q_pos: ``[B, T]`` positions of the queries; k_pos: ``[B, S]`` or ``[S]`` positions of the keys.
      scale: multiplies the scores; window: key ``j`` is visible to query ``i`` iff
        ``i - window < j <= i`` (``None``: ``j <= i``).
      recent: ``(k_f, v_f, block)``: query ``i`` reads key / value ``j`` from ``k_f`` / ``v_f`` (same shapes
        as ``k`` / ``v``) where ``j // block == i // block`` (its own still-filling block), from ``k`` /
        ``v`` elsewhere.

    Returns ``[B, T, Hq * hd]`` in ``q``'s dtype (scores and softmax in float32).
    """
    B, Hq, T, hd = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(B, Hkv, Hq // Hkv, T, hd)
    s = jnp.einsum("bhgtd,bhsd->bhgts", qg, k, preferred_element_type=jnp.float32) * scale
    k_pos = jnp.broadcast_to(k_pos, (B, k.shape[2]))
    qp, kp = q_pos[:, :, None], k_pos[:, None, :]
    mask = kp <= qp
    if window is not None:
        mask = mask & (kp > qp - window)
    if recent is not None:
        k_f, v_f, blk = recent
        same = (kp // blk == qp // blk)[:, None, None]
        s = jnp.where(same, jnp.einsum("bhgtd,bhsd->bhgts", qg, k_f, preferred_element_type=jnp.float32) * scale, s)
    s = jnp.where(mask[:, None, None], s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    if recent is None:
        o = jnp.einsum("bhgts,bhsd->bthgd", p, v)
    else:
        zero = jnp.zeros((), p.dtype)
        o = (jnp.einsum("bhgts,bhsd->bthgd", jnp.where(same, zero, p), v)
             + jnp.einsum("bhgts,bhsd->bthgd", jnp.where(same, p, zero), v_f))
    return o.reshape(B, T, Hq * hd)


def quantize_kv(kv_quant: KVQuantizer | None, k: jax.Array, v: jax.Array, cache: Any) -> tuple[jax.Array, jax.Array, int]:
    """``(k, v)`` through the ``kv_quant`` hook, and its ``float_block`` (0 if none). A float block is
    defined for whole-window evaluation; with a decode cache it is 0 (the cache holds each call's
    fake-quantized entries, as for every dynamic quantizer: see :mod:`eqjax.methods.kvquant`)."""
    if kv_quant is None:
        return k, v, 0
    block = 0 if cache is not None else int(getattr(kv_quant, "float_block", 0) or 0)
    return kv_quant.keys(k), kv_quant.values(v), block


def float16_round(x: jax.Array) -> jax.Array:
    """``x`` rounded to float16 and back to its dtype (what a float16 cache holds)."""
    return x.astype(jnp.float16).astype(x.dtype)


def _attention(
    config: LlamaConfig,
    p: Params,
    x: jax.Array,
    positions: jax.Array,
    layer_index: int,
    cache: LayerCache | None,
    kv_quant: KVQuantizer | None,
) -> tuple[jax.Array, LayerCache | None]:
    c = config
    B, T, _ = x.shape
    q = linear(x, p["q_proj"]).reshape(B, T, c.n_heads, c.head_dim)
    k = linear(x, p["k_proj"]).reshape(B, T, c.n_kv_heads, c.head_dim)
    v = linear(x, p["v_proj"]).reshape(B, T, c.n_kv_heads, c.head_dim)
    if c.qk_norm:
        q = rms_norm(q, p["q_norm"]["scale"], c.rms_norm_eps)
        k = rms_norm(k, p["k_norm"]["scale"], c.rms_norm_eps)
    k_f, v_f = k, v
    k, v, block = quantize_kv(kv_quant, k, v, cache)
    inv_freq = rope_inv_freq(c)
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    q, k, v = (jnp.swapaxes(t, 1, 2) for t in (q, k, v))  # [B, H, T, hd]
    recent = None
    if block:
        k_f = apply_rope(k_f, positions, inv_freq)
        recent = (float16_round(jnp.swapaxes(k_f, 1, 2)), float16_round(jnp.swapaxes(v_f, 1, 2)), block)
    if cache is None:
        keys, vals, k_pos, q_pos = k, v, positions, positions
    else:
        cache = update_layer(cache, k, v)
        keys, vals = cache.k.astype(q.dtype), cache.v.astype(q.dtype)
        k_pos = jnp.arange(cache.max_len, dtype=jnp.int32)
        q_pos = jnp.broadcast_to(cache.length + jnp.arange(T, dtype=jnp.int32), (B, T))
    o = attend(q, keys, vals, q_pos, k_pos, scale=c.head_dim**-0.5, window=c.window_for(layer_index), recent=recent)
    return linear(o, p["o_proj"]), cache


def embed(config: LlamaConfig, params: Params, tokens: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
    """Token embeddings ``[B, T, D]`` in ``dtype`` for ``tokens [B, T]``.

    With ``config.embed_scale`` (Gemma) they are multiplied by ``sqrt(D)`` rounded to ``dtype``, as
    transformers does.
    """
    table = params["embed"]["embedding"]
    if isinstance(table, (QArray, ActQuantKernel)):
        table = as_float(table, dtype)
    h = jnp.take(table, tokens, axis=0).astype(dtype)
    if config.embed_scale:
        h = h * jnp.asarray(config.hidden**0.5, dtype)
    return h


def block(
    config: LlamaConfig,
    p: Params,
    h: jax.Array,
    positions: jax.Array,
    *,
    layer_index: int,
    cache: LayerCache | None = None,
    kv_quant: KVQuantizer | None = None,
) -> tuple[jax.Array, LayerCache | None]:
    """One decoder layer on ``h [B, T, D]`` at ``positions [B, T]``; returns ``(h, cache)``.

    With a cache the new keys/values are written at slots ``[cache.length, cache.length + T)`` and the
    queries attend to every filled slot (the returned cache keeps ``length``; the caller advances it).
    """
    eps, style = config.rms_norm_eps, config.norm_style
    a, cache = _attention(
        config, p["attn"], rms_norm(h, p["attn_norm"]["scale"], eps, style), positions, layer_index, cache, kv_quant
    )
    h = h + a
    x = rms_norm(h, p["mlp_norm"]["scale"], eps, style)
    m = p["mlp"]
    y = linear(activation(config.hidden_act, linear(x, m["gate_proj"])) * linear(x, m["up_proj"]), m["down_proj"])
    return h + y, cache


def head(config: LlamaConfig, params: Params, h: jax.Array) -> jax.Array:
    """Final RMSNorm and LM head: float32 logits ``[B, T, V]``."""
    x = rms_norm(h, params["final_norm"]["scale"], config.rms_norm_eps, config.norm_style)
    if "lm_head" in params:
        return linear(x, params["lm_head"]).astype(jnp.float32)
    return tied_head(x, params["embed"]["embedding"])


def tied_head(x: jax.Array, table: Any) -> jax.Array:
    """``x [B, T, D]`` times the embedding table ``[V, D]``: float32 logits ``[B, T, V]``. A table that is an
    :class:`~eqjax.core.qarray.ActQuantKernel` (``+emb-w7a8``) quantizes ``x`` per token and multiplies in integers."""
    if isinstance(table, ActQuantKernel):
        y = act_quant_matmul(x.reshape(-1, x.shape[-1]), table, (1,), (0,))
        return y.reshape(x.shape[:-1] + (y.shape[-1],))
    return jnp.einsum("btd,vd->btv", x, as_float(table, x.dtype), preferred_element_type=jnp.float32)
