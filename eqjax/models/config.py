"""Model configurations: frozen, hashable dataclasses (usable as ``jax.jit`` static arguments).

:class:`LlamaConfig` covers the Llama family (Llama, Mistral, Qwen2, Qwen3) by its fields;
:class:`GPT2Config` covers GPT-2. :func:`from_hf_config` turns a Hugging Face ``config.json`` dict into
one of them and :func:`to_hf_config` goes back. Both the transformers 5 layout (``rope_parameters``)
and the older one (``rope_theta`` + ``rope_scaling``) are read.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping
from eqjax.errors import InputError

__all__ = [
    "ConfigError",
    "RopeScaling",
    "LlamaConfig",
    "GPT2Config",
    "ModelConfig",
    "LLAMA_FAMILY",
    "from_hf_config",
    "to_hf_config",
]

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GPT2LMHeadModel": "gpt2",
}
_ARCH_OF = {v: k for k, v in _ARCHITECTURES.items()}
_ROPE_TYPES = ("linear", "llama3")


class ConfigError(InputError):
    """A model configuration is invalid or describes an architecture eqjax does not support."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, applied as transformers does.

    Attributes:
      type: ``"linear"`` (all inverse frequencies divided by ``factor``) or ``"llama3"`` (Llama 3.1:
        long wavelengths divided by ``factor``, short ones kept, a smooth blend in between).
      factor: the scaling factor.
      low_freq_factor, high_freq_factor, original_max_position_embeddings: llama3 only.
    """

    type: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.type not in _ROPE_TYPES:
            raise ConfigError(
                f"unsupported rope scaling type {self.type!r}: eqjax supports {', '.join(_ROPE_TYPES)}"
            )
        if self.factor <= 0:
            raise ConfigError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError("llama3 rope scaling needs high_freq_factor > low_freq_factor")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, max_position_embeddings: int = 8192) -> "RopeScaling | None":
        """From an HF ``rope_scaling``/``rope_parameters`` dict; None for the default (unscaled) RoPE."""
        kind = d.get("rope_type", d.get("type", "default"))
        if kind in (None, "default"):
            return None
        if kind not in _ROPE_TYPES:
            raise ConfigError(
                f"unsupported rope scaling type {kind!r}: eqjax supports {', '.join(_ROPE_TYPES)}"
            )
        if "factor" not in d:
            raise ConfigError(f"rope scaling of type {kind!r} needs a 'factor'")
        kw: dict[str, Any] = {"type": kind, "factor": float(d["factor"])}
        if kind == "llama3":
            kw["low_freq_factor"] = float(d.get("low_freq_factor", 1.0))
            kw["high_freq_factor"] = float(d.get("high_freq_factor", 4.0))
            kw["original_max_position_embeddings"] = int(
                d.get("original_max_position_embeddings", max_position_embeddings)
            )
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        """HF-style dict (``rope_type`` key)."""
        d: dict[str, Any] = {"rope_type": self.type, "factor": self.factor}
        if self.type == "llama3":
            d.update(
                low_freq_factor=self.low_freq_factor,
                high_freq_factor=self.high_freq_factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
            )
        return d


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Llama-family decoder (Llama, Mistral, Qwen2, Qwen3). Hashable; build with keyword args.

    Attributes:
      vocab: vocabulary size V.
      hidden: model width D.
      intermediate: MLP width F.
      n_layers, n_heads, n_kv_heads: depth, query heads Hq, key/value heads Hkv (GQA; Hq % Hkv == 0).
      head_dim: per-head width hd (default ``hidden // n_heads``).
      rope_theta: RoPE base.
      rope_scaling: None, a :class:`RopeScaling`, or an HF-style dict (converted).
      rms_norm_eps: RMSNorm epsilon.
      tie_word_embeddings: the LM head is ``embed^T`` (no ``lm_head`` param).
      attention_bias: q/k/v projections have a bias (Qwen2).
      qk_norm: RMSNorm over ``head_dim`` on queries and keys before RoPE (Qwen3).
      sliding_window: attend only to the last ``sliding_window`` positions (Mistral); None = off.
      sliding_layers: layer indices that use the window (None = every layer; Qwen2/3 ``layer_types``).
      max_position_embeddings: the model's trained context length (informational).
      model_type: ``llama``, ``mistral``, ``qwen2`` or ``qwen3`` (used when saving an HF checkpoint).
    """

    vocab: int
    hidden: int
    intermediate: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] | None = None
    max_position_embeddings: int = 2048
    model_type: str = "llama"

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass normalization
        if self.n_kv_heads is None:
            set_("n_kv_heads", self.n_heads)
        if self.head_dim is None:
            if self.hidden % self.n_heads:
                raise ConfigError(f"hidden {self.hidden} is not a multiple of n_heads {self.n_heads}; set head_dim")
            set_("head_dim", self.hidden // self.n_heads)
        if isinstance(self.rope_scaling, Mapping):
            set_(
                "rope_scaling",
                RopeScaling.from_dict(self.rope_scaling, max_position_embeddings=self.max_position_embeddings),
            )
        if self.sliding_layers is not None:
            set_("sliding_layers", tuple(int(i) for i in self.sliding_layers))
        for name in ("vocab", "hidden", "intermediate", "n_layers", "n_heads", "n_kv_heads", "head_dim"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"LlamaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.model_type not in LLAMA_FAMILY:
            raise ConfigError(f"LlamaConfig.model_type must be one of {LLAMA_FAMILY}, got {self.model_type!r}")

    def window_for(self, layer_index: int) -> int | None:
        """The sliding window of layer ``layer_index`` (None = full causal attention)."""
        if self.sliding_window is None:
            return None
        if self.sliding_layers is not None and layer_index not in self.sliding_layers:
            return None
        return self.sliding_window


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """GPT-2 decoder. Hashable; build with keyword args.

    Attributes:
      vocab: vocabulary size V.
      hidden: width D (``n_embd``).
      n_layers, n_heads: depth and heads (``head_dim = hidden // n_heads``).
      n_positions: learned position table length P.
      intermediate: MLP width (default ``4 * hidden``).
      layer_norm_eps: LayerNorm epsilon.
      activation: ``gelu_new`` (tanh approximation, GPT-2's), ``gelu`` (exact) or ``relu``.
      scale_attn_by_inverse_layer_idx: extra ``1 / (layer + 1)`` attention scale.
    """

    vocab: int
    hidden: int
    n_layers: int
    n_heads: int
    n_positions: int = 1024
    intermediate: int | None = None
    layer_norm_eps: float = 1e-5
    activation: str = "gelu_new"
    scale_attn_by_inverse_layer_idx: bool = False
    model_type: str = "gpt2"

    def __post_init__(self) -> None:
        if self.intermediate is None:
            object.__setattr__(self, "intermediate", 4 * self.hidden)
        if self.hidden % self.n_heads:
            raise ConfigError(f"GPT-2 hidden {self.hidden} is not a multiple of n_heads {self.n_heads}")
        if self.activation not in ("gelu_new", "gelu_pytorch_tanh", "gelu", "relu"):
            raise ConfigError(f"unsupported GPT-2 activation {self.activation!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    @property
    def n_kv_heads(self) -> int:
        return self.n_heads

    @property
    def tie_word_embeddings(self) -> bool:
        return True


ModelConfig = LlamaConfig | GPT2Config


def _model_type(d: Mapping[str, Any], source: str) -> str:
    mt = d.get("model_type")
    if mt in LLAMA_FAMILY or mt == "gpt2":
        return mt
    for arch in d.get("architectures") or ():
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    what = f"model_type {mt!r}" if mt else "no model_type"
    archs = d.get("architectures")
    raise ConfigError(
        f"{source}: unsupported architecture ({what}, architectures {archs}); eqjax supports "
        f"{', '.join(LLAMA_FAMILY + ('gpt2',))}"
    )


def _require(d: Mapping[str, Any], key: str, source: str) -> Any:
    if d.get(key) is None:
        raise ConfigError(f"{source}: missing required field {key!r}")
    return d[key]


def _rope(d: Mapping[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    params = d.get("rope_parameters") or {}
    legacy = d.get("rope_scaling") or {}
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    if params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError(f"{source}: partial_rotary_factor != 1 is not supported")
    src = params if params.get("rope_type", params.get("type")) not in (None, "default") else legacy
    try:
        scaling = RopeScaling.from_dict(src, max_position_embeddings=int(d.get("max_position_embeddings", 8192)))
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return float(theta), scaling


def _llama_from_hf(d: Mapping[str, Any], mt: str, source: str) -> LlamaConfig:
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: hidden_act {d['hidden_act']!r} is not supported (only silu)")
    if d.get("mlp_bias"):
        raise ConfigError(f"{source}: mlp_bias=true is not supported")
    theta, scaling = _rope(d, source)
    n_layers = int(_require(d, "num_hidden_layers", source))
    window = d.get("sliding_window")
    if mt in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
        window = None
    layers: tuple[int, ...] | None = None
    types = d.get("layer_types")
    if window is not None and mt in ("qwen2", "qwen3"):
        if types is None:
            start = int(d.get("max_window_layers", 0))
            types = ["sliding_attention" if i >= start else "full_attention" for i in range(n_layers)]
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        if not layers:
            window, layers = None, None
    n_heads = int(_require(d, "num_attention_heads", source))
    return LlamaConfig(
        vocab=int(_require(d, "vocab_size", source)),
        hidden=int(_require(d, "hidden_size", source)),
        intermediate=int(_require(d, "intermediate_size", source)),
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(d.get("num_key_value_heads") or n_heads),
        head_dim=d.get("head_dim"),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=True if mt == "qwen2" else bool(d.get("attention_bias", False)),
        qk_norm=mt == "qwen3",
        sliding_window=None if window is None else int(window),
        sliding_layers=layers,
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
        model_type=mt,
    )


def _gpt2_from_hf(d: Mapping[str, Any], source: str) -> GPT2Config:
    if d.get("tie_word_embeddings", True) is False:
        raise ConfigError(f"{source}: GPT-2 with untied embeddings is not supported")
    return GPT2Config(
        vocab=int(_require(d, "vocab_size", source)),
        hidden=int(d.get("n_embd", d.get("hidden_size", 768))),
        n_layers=int(d.get("n_layer", d.get("num_hidden_layers", 12))),
        n_heads=int(d.get("n_head", d.get("num_attention_heads", 12))),
        n_positions=int(d.get("n_positions", 1024)),
        intermediate=d.get("n_inner"),
        layer_norm_eps=float(d.get("layer_norm_epsilon", 1e-5)),
        activation=d.get("activation_function", "gelu_new"),
        scale_attn_by_inverse_layer_idx=bool(d.get("scale_attn_by_inverse_layer_idx", False)),
    )


def from_hf_config(d: Mapping[str, Any], *, source: str = "config.json") -> ModelConfig:
    """A config from a Hugging Face ``config.json`` dict; errors name ``source``.

    Dispatches on ``model_type`` (else ``architectures``). Raises :class:`ConfigError` for an
    unsupported architecture, a missing field or an unsupported RoPE scaling.
    """
    mt = _model_type(d, source)
    try:
        if mt == "gpt2":
            return _gpt2_from_hf(d, source)
        return _llama_from_hf(d, mt, source)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: invalid {mt} config: {e}") from None


def to_hf_config(config: ModelConfig) -> dict[str, Any]:
    """A ``config.json`` dict that transformers loads as the same model (float32 weights)."""
    if isinstance(config, GPT2Config):
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
    c = config
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
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": c.tie_word_embeddings,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": c.rope_theta,
        "rope_parameters": {**rope, "rope_theta": c.rope_theta},  # transformers 5
        "rope_scaling": None if c.rope_scaling is None else c.rope_scaling.to_dict(),  # transformers 4
        "dtype": "float32",
    }
    if c.model_type in ("llama", "qwen3"):
        d["attention_bias"] = c.attention_bias
    elif c.model_type == "qwen2" and not c.attention_bias:
        raise ConfigError("qwen2 always has q/k/v biases; attention_bias=False cannot be saved as qwen2")
    if c.model_type == "mistral":
        if c.sliding_layers is not None:
            raise ConfigError("mistral applies its sliding window to every layer; sliding_layers must be None")
        d["sliding_window"] = c.sliding_window
    elif c.model_type in ("qwen2", "qwen3"):
        d["use_sliding_window"] = c.sliding_window is not None
        d["sliding_window"] = c.sliding_window
        d["max_window_layers"] = c.n_layers
        d["layer_types"] = [
            "sliding_attention" if c.window_for(i) is not None else "full_attention" for i in range(c.n_layers)
        ]
    elif c.sliding_window is not None:
        raise ConfigError("a llama config cannot carry a sliding window; use model_type='mistral'")
    return d
