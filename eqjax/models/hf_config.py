"""Hugging Face ``config.json`` dicts to eqjax model configs and back.

:func:`from_hf_config` dispatches on ``model_type`` (else ``architectures``) and checks every field
it does not implement *before* any weight is read: an architecture or feature eqjax does not run
raises :class:`~eqjax.models.config.ConfigError` (an ``InputError``) naming the model_type and the
field. Both the transformers 5 layout (``rope_parameters``) and the older one (``rope_theta`` +
``rope_scaling``) are read. :func:`to_hf_config` writes a dict transformers 4.57 loads as the same model.

Supported: ``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``gemma``, ``phi3`` (all through the one
Llama-family forward, :mod:`eqjax.models.llama`) and ``gpt2``. Per architecture:

* gemma: GeGLU MLP, embeddings times ``sqrt(hidden)``, RMSNorm ``x_hat * (1 + w)`` (eqjax stores the
  effective ``1 + w``), explicit ``head_dim`` (HF default 256), tied embeddings by default. The MLP
  activation is ``hidden_activation`` when set, else ``hidden_act`` (transformers documents
  ``hidden_activation`` as the override and its Flax Gemma uses it; its torch ``GemmaMLP`` 4.57 reads
  ``hidden_act``: when the two differ eqjax warns and follows ``hidden_activation``).
* phi3: fused ``qkv_proj`` / ``gate_up_proj`` (split by the checkpoint loader), ``partial_rotary_factor``
  (RoPE on the first channels of each head), a sliding window on every layer; default RoPE only
  (``rope_scaling`` longrope / su / yarn, i.e. the 128k checkpoints and Phi-4-mini, are refused).
* llama family: ``hidden_act`` silu, gelu, gelu_new, gelu_pytorch_tanh.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Mapping

from eqjax.models.activations import GATED_ACTIVATIONS
from eqjax.models.config import LLAMA_FAMILY, ConfigError, GPT2Config, LlamaConfig, ModelConfig, RopeScaling

__all__ = ["from_hf_config", "to_hf_config", "SUPPORTED", "REFUSED"]

SUPPORTED = LLAMA_FAMILY + ("gpt2",)
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GemmaForCausalLM": "gemma",
    "Phi3ForCausalLM": "phi3",
    "GPT2LMHeadModel": "gpt2",
}
_ARCH_OF = {v: k for k, v in _ARCHITECTURES.items()}
_MOE = "a mixture-of-experts MLP (num_experts / num_local_experts)"
# Known architectures eqjax does not run, with what in them the Llama-family forward lacks.
REFUSED: dict[str, str] = {
    "gemma2": "attention and final-logit soft-capping (attn_logit_softcapping, final_logit_softcapping), "
    "sandwich norms (pre/post_feedforward_layernorm), query_pre_attn_scalar, alternating sliding windows",
    "gemma3": "sandwich norms (pre/post_feedforward_layernorm), q/k norms, local/global RoPE (rope_local_base_freq)",
    "gemma3_text": "sandwich norms (pre/post_feedforward_layernorm), q/k norms, local/global RoPE "
    "(rope_local_base_freq)",
    "falcon": "parallel attention/MLP (parallel_attn), fused multi-query query_key_value, LayerNorm, ALiBi (alibi)",
    "mixtral": _MOE,
    "qwen2_moe": _MOE,
    "qwen3_moe": _MOE,
    "phimoe": _MOE,
    "deepseek_v2": "multi-head latent attention (kv_lora_rank) and " + _MOE,
    "deepseek_v3": "multi-head latent attention (kv_lora_rank) and " + _MOE,
    "phi": "Phi-1/2 blocks: parallel attention/MLP after one LayerNorm, biased dense layers (use phi3 for Phi-3/4)",
    "phi3small": "Phi-3-small's blocksparse attention and gegelu MLP (custom code)",
    "gpt_neox": "parallel residual (use_parallel_residual), LayerNorm, fused query_key_value",
}


def _model_type(d: Mapping[str, Any], source: str) -> str:
    mt = d.get("model_type")
    if mt in SUPPORTED:
        return mt
    archs = d.get("architectures")
    if not mt:
        for arch in archs or ():
            if arch in _ARCHITECTURES:
                return _ARCHITECTURES[arch]
    what = f"model_type {mt!r}" if mt else "no model_type"
    why = f": {REFUSED[mt]} not supported" if mt in REFUSED else ""
    raise ConfigError(
        f"{source}: unsupported architecture ({what}, architectures {archs}){why}; eqjax supports "
        f"{', '.join(SUPPORTED)}"
    )


def _bad_value(source: str, key: str, expected: str, found: Any) -> ConfigError:
    return ConfigError(f"bad config value ({source}: {key}): expected {expected}, found {found!r}")


def _size(d: Mapping[str, Any], key: str, source: str, default: Any = None) -> int:
    """``d[key]`` (or ``default``) as an integer >= 1; a zero, negative, fractional, boolean or string value
    raises naming the key. A missing key without a default is a missing required field."""
    v = d.get(key, default) if d.get(key) is not None else default
    if v is None:
        raise ConfigError(f"{source}: missing required field {key!r}")
    integral = (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())
    if not integral or v < 1:
        raise _bad_value(source, key, "an integer >= 1", v)
    return int(v)


def _real(v: Any, source: str, key: str, *, positive: bool) -> float:
    """``v`` as a finite float, ``> 0`` if ``positive`` else ``>= 0``, or ConfigError naming the key."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not ok or (v <= 0 if positive else v < 0):
        raise _bad_value(source, key, f"a finite number {'> 0' if positive else '>= 0'}", v)
    return float(v)


def _heads(d: Mapping[str, Any], source: str, hidden: int, head_dim: Any) -> tuple[int, int]:
    """``(num_attention_heads, num_key_value_heads)``, checked against each other and the width."""
    n_heads = _size(d, "num_attention_heads", source)
    n_kv = _size(d, "num_key_value_heads", source, default=n_heads)
    if n_heads % n_kv:
        raise _bad_value(source, "num_key_value_heads", f"a divisor of num_attention_heads {n_heads}", n_kv)
    if head_dim is None and hidden % n_heads:
        raise _bad_value(source, "num_attention_heads", f"a divisor of hidden_size {hidden} (or a head_dim)", n_heads)
    return n_heads, n_kv


def _refuse_fields(d: Mapping[str, Any], mt: str, source: str) -> None:
    """Fields of a supported model_type that ask for something the forward pass does not do."""
    present = lambda k: d.get(k) not in (None, 0, False)  # noqa: E731
    for keys, what in (
        (("attn_logit_softcapping", "final_logit_softcapping"), "soft-capping (a gemma2 feature)"),
        (("query_pre_attn_scalar",), "a query pre-attention scalar (a gemma2 feature)"),
        (("num_local_experts", "num_experts"), "a mixture-of-experts MLP"),
        (("mlp_bias",), "MLP biases"),
    ):
        for k in keys:
            if present(k):
                raise ConfigError(f"{source}: {mt} with {k}={d[k]!r} is not supported: eqjax has no {what}")


def _rope(d: Mapping[str, Any], mt: str, source: str) -> tuple[float, RopeScaling | None, float]:
    """(theta, scaling, partial_rotary_factor) from either RoPE layout."""
    params = d.get("rope_parameters") or {}
    legacy = d.get("rope_scaling") or {}
    top = d.get("rope_theta")
    theta = 10000.0 if top is None else _real(top, source, "rope_theta", positive=True)
    if params.get("rope_theta") is not None:
        nested = _real(params["rope_theta"], source, "rope_parameters.rope_theta", positive=True)
        if top is not None and nested != theta:  # transformers 4 reads one, 5 the other
            raise _bad_value(source, "rope_theta", f"the same value as rope_parameters.rope_theta {nested}", theta)
        theta = nested
    partial = float(params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
    if not 0 < partial <= 1:
        raise _bad_value(source, "partial_rotary_factor", "a number in (0, 1]", partial)
    if partial != 1.0 and mt != "phi3":
        raise ConfigError(f"{source}: {mt} with partial_rotary_factor={partial} is not supported (only phi3's)")
    use_params = params.get("rope_type", params.get("type")) not in (None, "default")
    src, field = (params, "rope_parameters") if use_params else (legacy, "rope_scaling")
    kind = src.get("rope_type", src.get("type", "default"))
    if mt == "phi3" and kind not in (None, "default"):
        raise ConfigError(
            f"{source}: phi3 {field} of type {kind!r} is not supported (long-context RoPE, e.g. Phi-3 128k, "
            "Phi-4-mini); eqjax runs phi3 with the default RoPE only"
        )
    try:
        scaling = RopeScaling.from_dict(src, max_position_embeddings=int(d.get("max_position_embeddings", 8192)))
    except ConfigError as e:
        raise ConfigError(f"{source}: {mt} {field}: {e}") from None
    return theta, scaling, partial


def _activation(d: Mapping[str, Any], mt: str, source: str) -> str:
    legacy = d.get("hidden_act", "gelu_pytorch_tanh" if mt == "gemma" else "silu")
    field, act = "hidden_act", legacy
    if mt == "gemma" and d.get("hidden_activation") is not None:
        field, act = "hidden_activation", d["hidden_activation"]
    if act not in GATED_ACTIVATIONS:
        raise ConfigError(f"{source}: {mt} {field} {act!r} is not supported (eqjax: {', '.join(GATED_ACTIVATIONS)})")
    if act != legacy:
        warnings.warn(
            f"{source}: gemma hidden_activation {act!r} differs from hidden_act {legacy!r}; eqjax uses "
            "hidden_activation (transformers' torch GemmaMLP 4.57 uses hidden_act)",
            stacklevel=4,
        )
    return act


def _llama_from_hf(d: Mapping[str, Any], mt: str, source: str) -> LlamaConfig:
    _refuse_fields(d, mt, source)
    act = _activation(d, mt, source)
    theta, scaling, partial = _rope(d, mt, source)
    n_layers = _size(d, "num_hidden_layers", source)
    window = d.get("sliding_window")
    if mt in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
        window = None
    if mt == "gemma" and window is not None:
        raise ConfigError(f"{source}: gemma with sliding_window={window} is not supported (a gemma2 feature)")
    layers: tuple[int, ...] | None = None
    types = d.get("layer_types")
    if window is not None and mt in ("qwen2", "qwen3"):
        if types is None:
            start = int(d.get("max_window_layers", 0))
            types = ["sliding_attention" if i >= start else "full_attention" for i in range(n_layers)]
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        if not layers:
            window, layers = None, None
    hidden = _size(d, "hidden_size", source)
    head_dim = d.get("head_dim", 256 if mt == "gemma" else None)  # GemmaConfig's default head_dim is 256
    if head_dim is not None:
        head_dim = _size(d, "head_dim", source, default=head_dim)
        if head_dim % 2:
            raise _bad_value(source, "head_dim", "an even number (RoPE rotates pairs)", head_dim)
    n_heads, n_kv = _heads(d, source, hidden, head_dim)
    hd = head_dim if head_dim is not None else hidden // n_heads
    rotary = int(hd * partial)  # transformers: int(head_dim * partial_rotary_factor)
    if rotary % 2 or rotary < 2:
        raise ConfigError(
            f"{source}: {mt} partial_rotary_factor={partial} gives {rotary} rotary channels of head_dim {hd} "
            "(need an even number >= 2)"
        )
    gemma = mt == "gemma"
    if window is not None:
        window = _size(d, "sliding_window", source)
    return LlamaConfig(
        vocab=_size(d, "vocab_size", source),
        hidden=hidden,
        intermediate=_size(d, "intermediate_size", source),
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=_real(d.get("rms_norm_eps", 1e-5 if mt == "phi3" else 1e-6), source, "rms_norm_eps",
                           positive=False),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),
        attention_bias=True if mt == "qwen2" else bool(d.get("attention_bias", False)),
        qk_norm=mt == "qwen3",
        sliding_window=None if window is None else int(window),
        sliding_layers=layers,
        max_position_embeddings=_size(d, "max_position_embeddings", source, default=2048),
        model_type=mt,
        hidden_act=act,
        embed_scale=gemma,
        norm_style="gemma" if gemma else "llama",
        rotary_dim=rotary,
    )


def _gpt2_from_hf(d: Mapping[str, Any], source: str) -> GPT2Config:
    if d.get("tie_word_embeddings", True) is False:
        raise ConfigError(f"{source}: GPT-2 with untied embeddings is not supported")
    if d.get("scale_attn_weights", True) is False:
        raise ConfigError(f"{source}: gpt2 with scale_attn_weights=False is not supported (eqjax always scales "
                          "attention scores by 1/sqrt(head_dim))")
    if d.get("add_cross_attention"):
        raise ConfigError(f"{source}: gpt2 with add_cross_attention=True is not supported (decoder-only models)")
    key = lambda k, alt: k if k in d or alt not in d else alt  # noqa: E731 - the spelling the file uses
    hidden = _size(d, key("n_embd", "hidden_size"), source, default=768)
    n_heads = _size(d, key("n_head", "num_attention_heads"), source, default=12)
    if hidden % n_heads:
        raise _bad_value(source, key("n_head", "num_attention_heads"), f"a divisor of n_embd {hidden}", n_heads)
    return GPT2Config(
        vocab=_size(d, "vocab_size", source),
        hidden=hidden,
        n_layers=_size(d, key("n_layer", "num_hidden_layers"), source, default=12),
        n_heads=n_heads,
        n_positions=_size(d, "n_positions", source, default=1024),
        intermediate=None if d.get("n_inner") is None else _size(d, "n_inner", source),
        layer_norm_eps=_real(d.get("layer_norm_epsilon", 1e-5), source, "layer_norm_epsilon", positive=False),
        activation=d.get("activation_function", "gelu_new"),
        scale_attn_by_inverse_layer_idx=bool(d.get("scale_attn_by_inverse_layer_idx", False)),
    )


def from_hf_config(d: Mapping[str, Any], *, source: str = "config.json") -> ModelConfig:
    """A config from a Hugging Face ``config.json`` dict; errors name ``source``.

    Raises :class:`ConfigError` for an unsupported architecture or feature (naming the model_type and
    the field), a missing field or an unsupported RoPE scaling.
    """
    mt = _model_type(d, source)
    try:
        if mt == "gpt2":
            return _gpt2_from_hf(d, source)
        return _llama_from_hf(d, mt, source)
    except ConfigError as e:
        msg = str(e)
        raise (e if source in msg else ConfigError(f"{source}: {msg}")) from None
    except (TypeError, ValueError, ArithmeticError) as e:
        raise ConfigError(f"{source}: invalid {mt} config: {e}") from None


def _gpt2_to_hf(config: GPT2Config) -> dict[str, Any]:
    return {
        "model_type": "gpt2",
        "architectures": [_ARCH_OF["gpt2"]],
        "vocab_size": config.vocab,
        "n_embd": config.hidden,
        "n_layer": config.n_layers,
        "n_head": config.n_heads,
        "n_positions": config.n_positions,
        "n_inner": config.intermediate,
        "layer_norm_epsilon": config.layer_norm_eps,
        "activation_function": config.activation,
        "scale_attn_by_inverse_layer_idx": config.scale_attn_by_inverse_layer_idx,
        "tie_word_embeddings": True,
        "dtype": "float32",
    }


def _check_savable(c: LlamaConfig) -> None:
    """Raise when ``c``'s fields have no spelling in its model_type's HF config."""
    gemma, phi3 = c.model_type == "gemma", c.model_type == "phi3"
    if (c.embed_scale, c.norm_style == "gemma") != (gemma, gemma):
        raise ConfigError(
            f"embed_scale={c.embed_scale}, norm_style={c.norm_style!r} cannot be saved as {c.model_type}: "
            "Gemma's embedding scale and norm come together, and only with model_type='gemma'"
        )
    if c.rotary_dim != c.head_dim:
        if not phi3:
            raise ConfigError(f"rotary_dim {c.rotary_dim} < head_dim {c.head_dim} can only be saved as phi3")
        if int(c.head_dim * (c.rotary_dim / c.head_dim)) != c.rotary_dim:
            raise ConfigError(f"rotary_dim {c.rotary_dim} of head_dim {c.head_dim} has no exact partial_rotary_factor")
    if phi3 and (c.attention_bias or c.qk_norm or c.rope_scaling is not None or c.sliding_layers is not None):
        raise ConfigError("phi3 has no attention biases, q/k norms, RoPE scaling or per-layer windows")
    if c.model_type == "qwen2" and not c.attention_bias:
        raise ConfigError("qwen2 always has q/k/v biases; attention_bias=False cannot be saved as qwen2")
    if c.model_type == "mistral" and c.sliding_layers is not None:
        raise ConfigError("mistral applies its sliding window to every layer; sliding_layers must be None")
    if c.model_type in ("llama", "gemma") and c.sliding_window is not None:
        raise ConfigError(f"a {c.model_type} config cannot carry a sliding window; use model_type='mistral'")
    if gemma and c.qk_norm:
        raise ConfigError("gemma has no q/k norms")


def to_hf_config(config: ModelConfig) -> dict[str, Any]:
    """A ``config.json`` dict that transformers loads as the same model (float32 weights).

    Raises :class:`ConfigError` when the config's fields have no spelling in its ``model_type``'s
    HF config (e.g. ``rotary_dim < head_dim`` on a llama, Gemma's norm on a qwen2).
    """
    if isinstance(config, GPT2Config):
        return _gpt2_to_hf(config)
    c = config
    _check_savable(c)
    rope: dict[str, Any] = {"rope_type": "default"} if c.rope_scaling is None else c.rope_scaling.to_dict()
    d: dict[str, Any] = {
        "model_type": c.model_type,
        "architectures": [_ARCH_OF[c.model_type]],
        "vocab_size": c.vocab,
        "hidden_size": c.hidden,
        "intermediate_size": c.intermediate,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": c.tie_word_embeddings,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": c.rope_theta,
        "rope_parameters": {**rope, "rope_theta": c.rope_theta},  # transformers 5
        "rope_scaling": None if c.rope_scaling is None else c.rope_scaling.to_dict(),  # transformers 4
        "dtype": "float32",
    }
    if c.model_type in ("llama", "qwen3", "gemma"):
        d["attention_bias"] = c.attention_bias
    if c.model_type == "gemma":
        d["hidden_activation"] = c.hidden_act
    if c.model_type in ("mistral", "phi3"):
        d["sliding_window"] = c.sliding_window
    if c.model_type == "phi3":
        d["partial_rotary_factor"] = c.rotary_dim / c.head_dim
        d["rope_parameters"]["partial_rotary_factor"] = d["partial_rotary_factor"]
    elif c.model_type in ("qwen2", "qwen3"):
        d["use_sliding_window"] = c.sliding_window is not None
        d["sliding_window"] = c.sliding_window
        d["max_window_layers"] = c.n_layers
        d["layer_types"] = [
            "sliding_attention" if c.window_for(i) is not None else "full_attention" for i in range(c.n_layers)
        ]
    return d
