"""eqjax's Llama weights in two third-party Flax layouts, with converters and a logits check.

    python examples/layout_models.py [--layers 2] [--recipe w4g128-rtn]

:class:`GemmaStyleLM` (``flax.nnx``) is written the way the gemma library writes models (no ``kernel``
names; ``nnx.Param`` leaves ``input_embedding`` / ``w`` / ``scale``; ``jnp.einsum`` projections).
:class:`EinsumLinenLM` (``flax.linen``) uses ``nn.DenseGeneral`` / ``nn.Einsum`` / ``nn.Dense``. Both fuse
k/v (index 0 = keys, 1 = values) and gate/up (gemma: index 0 = gate; linen: gate = first F columns), hold
the same weights as eqjax's own Llama and compute its float32 logits (RMSNorm in float32, rotate_half
RoPE, causal grouped-query attention, softmax in float32). Norm ``scale`` params are effective scales
(``x_hat * scale``, not gemma's ``1 + scale``). Plain Llama configs only (SiLU gate, no biases, q/k norms,
sliding window or partial RoPE; linear / llama3 RoPE scaling are supported); others raise ValueError.
:func:`weight_correspondence` and :func:`to_llama_kernel` map the models' weights back to eqjax's own.

Layouts (N query heads, K kv heads, H head_dim, D hidden, F intermediate; layer i)::

    eqjax layers_i/...          GemmaStyleLM layers/i/...           EinsumLinenLM layers_i/...
    attn/q_proj [D, N*H]        attn/q_einsum/w [N, D, H]           q/kernel [D, N, H]
    attn/{k,v}_proj [D, K*H]    attn/kv_einsum/w [2, K, D, H]       kv/kernel [2, D, K, H]
    attn/o_proj [N*H, D]        attn/attn_vec_einsum/w [N, H, D]    o/kernel [N, H, D]
    mlp/{gate,up}_proj [D, F]   mlp/gating_einsum [2, F, D]         gate_up/kernel [D, 2F]
    mlp/down_proj [F, D]        mlp/linear [F, D]                   down/kernel [F, D]
    embed/embedding [V, D]      embedder/input_embedding [V, D]     embed/embedding [V, D]
    lm_head/kernel [D, V]       unembed/w [D, V]                    lm_head/kernel [D, V]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Sizes in the gemma library's names. ``rope_scaling``: None or the sorted items of an HF-style dict
    (``rope_type`` ``"linear"`` or ``"llama3"``, ``factor``, and llama3's frequency factors)."""

    num_layers: int
    num_embed: int  # V
    embed_dim: int  # D
    hidden_dim: int  # F
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    rope_scaling: tuple | None = None


def transformer_config(config: Any) -> TransformerConfig:
    """A :class:`TransformerConfig` from an eqjax ``LlamaConfig``; ValueError for what these models lack."""
    c = config
    bad = [name for name, on in (
        ("hidden_act != 'silu'", c.hidden_act != "silu"), ("attention_bias", c.attention_bias), ("qk_norm", c.qk_norm),
        ("sliding_window", c.sliding_window is not None), ("embed_scale", c.embed_scale),
        ("norm_style != 'llama'", c.norm_style != "llama"), ("partial rotary_dim", c.rotary_dim != c.head_dim)) if on]
    if bad:
        raise ValueError(f"layout_models supports plain Llama configs only; unsupported: {', '.join(bad)}")
    scaling = None if c.rope_scaling is None else tuple(sorted(c.rope_scaling.to_dict().items()))
    return TransformerConfig(
        num_layers=c.n_layers, num_embed=c.vocab, embed_dim=c.hidden, hidden_dim=c.intermediate,
        num_heads=c.n_heads, num_kv_heads=c.n_kv_heads, head_dim=c.head_dim, rope_base=float(c.rope_theta),
        norm_eps=float(c.rms_norm_eps), tie_embeddings=bool(c.tie_word_embeddings), rope_scaling=scaling)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale.astype(x.dtype) * y.astype(x.dtype)


def inv_frequencies(cfg: TransformerConfig) -> np.ndarray:
    h = cfg.head_dim
    inv = (1.0 / (np.float32(cfg.rope_base) ** (np.arange(0, h, 2, dtype=np.float32) / h))).astype(np.float32)
    if cfg.rope_scaling is None:
        return inv
    s = dict(cfg.rope_scaling)
    if s["rope_type"] == "linear":
        return (inv / np.float32(s["factor"])).astype(np.float32)
    factor, low, high, old = (s[k] for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"))
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, blended, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """``x [B, T, heads, H]`` rotated at ``positions [B, T]`` (first half of each head paired with the second)."""
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    ang = jnp.concatenate([ang, ang], axis=-1)[:, :, None, :]
    x1, x2 = jnp.split(x, 2, axis=-1)
    rot = jnp.concatenate([-x2, x1], axis=-1)
    return x * jnp.cos(ang).astype(x.dtype) + rot * jnp.sin(ang).astype(x.dtype)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array) -> jax.Array:
    """``q [B, T, N, H]``, ``k, v [B, S, K, H]`` (query head ``n`` reads kv head ``n // (N / K)``) -> ``[B, T, N, H]``."""
    (B, T, N, H), K = q.shape, k.shape[2]
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", q.reshape(B, T, K, N // K, H), k, preferred_element_type=jnp.float32)
    logits = logits * H**-0.5
    mask = positions[:, None, :] <= positions[:, :, None]  # [B, T, S]
    logits = jnp.where(mask[:, None, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("BKGTS,BSKH->BTKGH", probs, v).reshape(B, T, N, H)


_init = jax.nn.initializers.normal(0.02)


class Einsum(nnx.Module):
    def __init__(self, einsum_str: str, shape: tuple[int, ...], *, rngs: nnx.Rngs):
        self.einsum_str = einsum_str
        self.w = nnx.Param(_init(rngs.params(), shape))

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.einsum(self.einsum_str, x, self.w[...])


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)


class Embedder(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, rngs: nnx.Rngs):
        self.input_embedding = nnx.Param(_init(rngs.params(), (vocab, dim)))

    def encode(self, ids: jax.Array) -> jax.Array:
        return self.input_embedding[...][(ids,)]

    def decode(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("BTD,VD->BTV", x, self.input_embedding[...], preferred_element_type=jnp.float32)


class Attention(nnx.Module):
    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        N, K, D, H = cfg.num_heads, cfg.num_kv_heads, cfg.embed_dim, cfg.head_dim
        self.config = cfg
        self.q_einsum = Einsum("BTD,NDH->BTNH", (N, D, H), rngs=rngs)
        self.kv_einsum = Einsum("BSD,CKDH->CBSKH", (2, K, D, H), rngs=rngs)
        self.attn_vec_einsum = Einsum("BTNH,NHD->BTD", (N, H, D), rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        inv_freq = inv_frequencies(self.config)
        (k, v), q = self.kv_einsum(x), self.q_einsum(x)
        o = causal_attention(apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v, positions)
        return self.attn_vec_einsum(o)


class FeedForward(nnx.Module):
    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        F, D = cfg.hidden_dim, cfg.embed_dim
        self.gating_einsum = nnx.Param(_init(rngs.params(), (2, F, D)))
        self.linear = nnx.Param(_init(rngs.params(), (F, D)))

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = jnp.einsum("BTD,CFD->CBTF", x, self.gating_einsum[...])
        return jnp.einsum("BTF,FD->BTD", jax.nn.silu(gate[0]) * gate[1], self.linear[...])


class Block(nnx.Module):
    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        self.pre_attention_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
        self.attn = Attention(cfg, rngs=rngs)
        self.pre_ffw_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
        self.mlp = FeedForward(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        x = x + self.attn(self.pre_attention_norm(x), positions)
        return x + self.mlp(self.pre_ffw_norm(x))


class GemmaStyleLM(nnx.Module):
    """Token ids ``[B, T]`` (int32) -> float32 logits ``[B, T, V]`` (positions ``0..T-1``)."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embedder = Embedder(cfg.num_embed, cfg.embed_dim, rngs=rngs)
        self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.unembed = Einsum("BTD,DV->BTV", (cfg.embed_dim, cfg.num_embed), rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
        x = self.embedder.encode(ids)
        for layer in self.layers:
            x = layer(x, positions)
        x = self.final_norm(x)
        return self.embedder.decode(x) if self.config.tie_embeddings else self.unembed(x).astype(jnp.float32)


class LinenRMSNorm(nn.Module):
    eps: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.param("scale", nn.initializers.ones, (x.shape[-1],)), self.eps)


class LinenBlock(nn.Module):
    cfg: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        c = self.cfg
        N, K, D, H, F = c.num_heads, c.num_kv_heads, c.embed_dim, c.head_dim, c.hidden_dim
        inv_freq = inv_frequencies(c)
        h = LinenRMSNorm(c.norm_eps, name="attn_norm")(x)
        q = nn.DenseGeneral(features=(N, H), use_bias=False, name="q")(h)
        k, v = nn.Einsum(shape=(2, D, K, H), einsum_str="btd,cdkh->cbtkh", use_bias=False, name="kv")(h)
        o = causal_attention(apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v, positions)
        x = x + nn.DenseGeneral(features=D, axis=(-2, -1), use_bias=False, name="o")(o)
        h = LinenRMSNorm(c.norm_eps, name="mlp_norm")(x)
        gate_up = nn.Dense(2 * F, use_bias=False, name="gate_up")(h)
        return x + nn.Dense(D, use_bias=False, name="down")(jax.nn.silu(gate_up[..., :F]) * gate_up[..., F:])


class EinsumLinenLM(nn.Module):
    """Token ids ``[B, T]`` (int32) -> float32 logits ``[B, T, V]`` (positions ``0..T-1``)."""

    cfg: TransformerConfig

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        c = self.cfg
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
        embed = nn.Embed(c.num_embed, c.embed_dim, name="embed")
        x = embed(ids)
        for i in range(c.num_layers):
            x = LinenBlock(c, name=f"layers_{i}")(x, positions)
        x = LinenRMSNorm(c.norm_eps, name="final_norm")(x)
        if c.tie_embeddings:
            return jnp.einsum("btd,vd->btv", x, embed.embedding, preferred_element_type=jnp.float32)
        return nn.Dense(c.num_embed, use_bias=False, name="lm_head")(x).astype(jnp.float32)


def _f32(x: Any) -> jax.Array:
    return jnp.asarray(x, jnp.float32)


def gemma_style_from_llama(config: Any, params: dict) -> GemmaStyleLM:
    """A :class:`GemmaStyleLM` holding eqjax's float Llama ``params`` (``config``: eqjax ``LlamaConfig``)."""
    cfg = transformer_config(config)
    N, K, D, H = cfg.num_heads, cfg.num_kv_heads, cfg.embed_dim, cfg.head_dim
    model = nnx.eval_shape(lambda: GemmaStyleLM(cfg, rngs=nnx.Rngs(0)))  # abstract; every Param is set below

    def put(param: nnx.Param, value: Any) -> None:
        if (value := _f32(value)).shape != param.get_value().shape:
            raise ValueError(f"shape {value.shape} != {param.get_value().shape}")
        param.set_value(value)

    put(model.embedder.input_embedding, params["embed"]["embedding"])
    for i, layer in enumerate(model.layers):
        p = params[f"layers_{i}"]
        a, m = p["attn"], p["mlp"]
        put(layer.pre_attention_norm.scale, p["attn_norm"]["scale"])
        put(layer.pre_ffw_norm.scale, p["mlp_norm"]["scale"])
        put(layer.attn.q_einsum.w, _f32(a["q_proj"]["kernel"]).reshape(D, N, H).transpose(1, 0, 2))
        put(layer.attn.kv_einsum.w, jnp.stack([_f32(a[n]["kernel"]).reshape(D, K, H).transpose(1, 0, 2) for n in ("k_proj", "v_proj")]))
        put(layer.attn.attn_vec_einsum.w, _f32(a["o_proj"]["kernel"]).reshape(N, H, D))
        put(layer.mlp.gating_einsum, jnp.stack([_f32(m["gate_proj"]["kernel"]).T, _f32(m["up_proj"]["kernel"]).T]))
        put(layer.mlp.linear, m["down_proj"]["kernel"])
    put(model.final_norm.scale, params["final_norm"]["scale"])
    if not cfg.tie_embeddings:
        put(model.unembed.w, params["lm_head"]["kernel"])
    return model


def einsum_linen_from_llama(config: Any, params: dict) -> tuple[EinsumLinenLM, dict]:
    """``(module, variables)``: call ``module.apply(variables, ids)``. ``variables`` is the full linen
    variables dict ``{"params": {...}}`` (same tree as ``module.init(key, ids)``)."""
    cfg = transformer_config(config)
    N, K, D, H = cfg.num_heads, cfg.num_kv_heads, cfg.embed_dim, cfg.head_dim
    out: dict[str, Any] = {"embed": {"embedding": _f32(params["embed"]["embedding"])}}
    for i in range(cfg.num_layers):
        p = params[f"layers_{i}"]
        a, m = p["attn"], p["mlp"]
        out[f"layers_{i}"] = {
            "attn_norm": {"scale": _f32(p["attn_norm"]["scale"])},
            "q": {"kernel": _f32(a["q_proj"]["kernel"]).reshape(D, N, H)},
            "kv": {"kernel": jnp.stack([_f32(a[n]["kernel"]).reshape(D, K, H) for n in ("k_proj", "v_proj")])},
            "o": {"kernel": _f32(a["o_proj"]["kernel"]).reshape(N, H, D)},
            "mlp_norm": {"scale": _f32(p["mlp_norm"]["scale"])},
            "gate_up": {"kernel": jnp.concatenate([_f32(m["gate_proj"]["kernel"]), _f32(m["up_proj"]["kernel"])], 1)},
            "down": {"kernel": _f32(m["down_proj"]["kernel"])},
        }
    out["final_norm"] = {"scale": _f32(params["final_norm"]["scale"])}
    if not cfg.tie_embeddings:
        out["lm_head"] = {"kernel": _f32(params["lm_head"]["kernel"])}
    return EinsumLinenLM(cfg), {"params": out}


def to_llama_kernel(kind: str, w: Any) -> jax.Array:
    """eqjax's own kernel ``[in, out]`` rebuilt from a model weight ``w`` of ``kind`` (exact reshapes,
    transposes and slices; ``kind`` as in :func:`weight_correspondence`; ``/0``, ``/1`` pick a fused part)."""
    w, (name, _, part) = jnp.asarray(w), kind.partition("/")
    c = int(part) if part else None
    if name in ("q_einsum", "kv_einsum"):  # [N, D, H] / [2, K, D, H] -> [D, N*H] / [D, K*H]
        w = w if c is None else w[c]
        return w.transpose(1, 0, 2).reshape(w.shape[1], -1)
    if name == "gating_einsum":  # [2, F, D] -> [D, F]
        return w[c].T
    if name in ("attn_vec_einsum", "o"):  # [N, H, D] -> [N*H, D]
        return w.reshape(-1, w.shape[-1])
    if name in ("q", "kv"):  # [D, N, H] / [2, D, K, H] -> [D, N*H] / [D, K*H]
        w = w if c is None else w[c]
        return w.reshape(w.shape[0], -1)
    if name == "gate_up":  # [D, 2F] -> [D, F]
        return jnp.split(w, 2, axis=1)[c]
    if name in ("linear", "unembed", "down", "lm_head", "embedding"):  # already eqjax's layout
        return w
    raise ValueError(f"unknown weight kind {kind!r}")


_CORRESPONDENCE = (  # own path in a layer, gemma (path, kind), linen (path, kind)
    ("attn/q_proj", "attn/q_einsum/w", "q_einsum", "q/kernel", "q"),
    ("attn/k_proj", "attn/kv_einsum/w", "kv_einsum/0", "kv/kernel", "kv/0"),
    ("attn/v_proj", "attn/kv_einsum/w", "kv_einsum/1", "kv/kernel", "kv/1"),
    ("attn/o_proj", "attn/attn_vec_einsum/w", "attn_vec_einsum", "o/kernel", "o"),
    ("mlp/gate_proj", "mlp/gating_einsum", "gating_einsum/0", "gate_up/kernel", "gate_up/0"),
    ("mlp/up_proj", "mlp/gating_einsum", "gating_einsum/1", "gate_up/kernel", "gate_up/1"),
    ("mlp/down_proj", "mlp/linear", "linear", "down/kernel", "down"),
)


def weight_correspondence(config: Any, style: str) -> dict[str, tuple[str, str]]:
    """``{own path: (model weight path, kind)}`` for every own kernel and ``embed/embedding``; "/"-joined paths,
    ``style`` ``"gemma"`` (``nnx.state`` paths, list indices as parts) or ``"linen"`` (inside ``variables["params"]``).
    ``to_llama_kernel(kind, weight_at(model_tree, model path))`` equals ``weight_at(own_params, own path)``."""
    if style not in ("gemma", "linen"):
        raise ValueError(f"style must be 'gemma' or 'linen', got {style!r}")
    cfg, col = transformer_config(config), (1, 2) if style == "gemma" else (3, 4)
    out = {}
    for i in range(cfg.num_layers):
        prefix = f"layers/{i}/" if style == "gemma" else f"layers_{i}/"
        for row in _CORRESPONDENCE:
            out[f"layers_{i}/{row[0]}/kernel"] = (prefix + row[col[0]], row[col[1]])
    rows = (("embed/embedding", "embedder/input_embedding", "embedding", "embed/embedding", "embedding"),)
    rows += () if cfg.tie_embeddings else (("lm_head/kernel", "unembed/w", "unembed", "lm_head/kernel", "lm_head"),)
    return {**out, **{row[0]: (row[col[0]], row[col[1]]) for row in rows}}


def weight_at(tree: Any, path: str) -> Any:
    """The leaf at a "/"-joined ``path`` of a nested dict / ``nnx.State`` (numeric parts index lists)."""
    for part in path.split("/"):
        tree = tree[int(part)] if part.isdigit() and not isinstance(tree, dict) else tree[part]
    return tree.get_value() if isinstance(tree, nnx.Variable) else tree


def main() -> None:
    import eqjax
    from eqjax.models import LlamaConfig, Model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--recipe", default="w4g128-rtn", help="a built-in recipe name")
    args = ap.parse_args()
    ids = jax.random.randint(jax.random.key(1), (2, 24), 0, 96, dtype=jnp.int32)
    calib = np.asarray(jax.random.randint(jax.random.key(2), (8, 32), 0, 96, dtype=jnp.int32))
    # GQA with head_dim 64: the attention output [3, 64, 192] is grouped along its flattened 192 inputs
    config = LlamaConfig(vocab=96, hidden=192, intermediate=256, n_layers=args.layers, n_heads=3, n_kv_heads=1,
                         head_dim=64, tie_word_embeddings=True)
    own = Model(config)
    params = own.init_params(jax.random.key(0), std=0.1)
    run_own = jax.jit(lambda p, t: own.apply(p, t)[0])
    gemma = gemma_style_from_llama(config, params)
    linen, variables = einsum_linen_from_llama(config, params)
    shapes = jax.tree.map(lambda x: x.shape, jax.eval_shape(linen.init, jax.random.key(0), ids))
    if shapes != jax.tree.map(lambda x: x.shape, variables):
        raise AssertionError(f"linen init shapes differ from the converter's:\n{shapes}")
    ref = np.asarray(run_own(params, ids))
    float_gap = max(float(np.abs(np.asarray(gemma(ids)) - ref).max()),
                    float(np.abs(np.asarray(linen.apply(variables, ids)) - ref).max()))
    print(f"float logits, both layouts vs eqjax's Llama: max abs difference {float_gap:.2e} (|logits| <= "
          f"{np.abs(ref).max():.2f})")

    batches = [(jnp.asarray(calib[i:i + 4]),) for i in range(0, len(calib), 4)]
    qref = np.asarray(run_own(eqjax.quantize(params, args.recipe, model=own, calibration=calib), ids))
    qgemma = eqjax.quantize_model(gemma, args.recipe, calibration=batches)
    qlinen, qparams = eqjax.quantize_model(linen, args.recipe, params=variables, calibration=batches)
    for path, what in qgemma.report:
        print(f"  {path:36s} {what}")
    gaps = {"gemma_nnx": float(np.abs(np.asarray(qgemma(ids)) - qref).max()),
            "einsum_linen": float(np.abs(np.asarray(qlinen.apply({"params": qparams}, ids)) - qref).max())}
    print(f"{args.recipe} logits vs eqjax's Llama quantized alike: max abs difference "
          + ", ".join(f"{k} {v:.2e}" for k, v in gaps.items()))
    print(json.dumps({"recipe": args.recipe, "float_max_abs": float_gap, **{f"{k}_max_abs": v for k, v in gaps.items()},
                      "logit_max_abs": float(np.abs(qref).max())}))


if __name__ == "__main__":
    main()
