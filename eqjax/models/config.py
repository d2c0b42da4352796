"""Model configurations: frozen, hashable dataclasses (usable as ``jax.jit`` static arguments).

:class:`LlamaConfig` covers the Llama family (Llama, Mistral, Qwen2, Qwen3, Gemma, Phi-3) by its
fields; :class:`GPT2Config` covers GPT-2. Hugging Face ``config.json`` dicts are read and written by
:mod:`eqjax.models.hf_config` (``from_hf_config`` / ``to_hf_config``; also exported by :mod:`eqjax.models`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Literal, Mapping

from eqjax.core.errors import InputError
from eqjax.models.activations import ACTIVATIONS, GATED_ACTIVATIONS

__all__ = [
    "ConfigError",
    "RopeScaling",
    "LlamaConfig",
    "GPT2Config",
    "ModelConfig",
    "LLAMA_FAMILY",
]

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3")
NORM_STYLES = ("llama", "gemma")
_ROPE_TYPES = ("linear", "llama3")


class ConfigError(InputError):
    """A model configuration is invalid or describes an architecture eqjax does not support."""


def _check_sizes(cls: str, config: Any, names: tuple[str, ...]) -> None:
    """Raise ConfigError unless each field in ``names`` is None or an integer >= 1 (sizes, counts)."""
    for name in names:
        v = getattr(config, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1):
            raise ConfigError(f"{cls}.{name} must be an integer >= 1, got {v!r}")


def _check_float(what: str, value: Any, *, positive: bool) -> None:
    """Raise ConfigError unless ``value`` is a finite number, ``> 0`` if ``positive`` else ``>= 0``."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value <= 0 if positive else value < 0):
        raise ConfigError(f"{what} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")


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
        _check_float("rope scaling factor", self.factor, positive=True)
        if self.type == "llama3":
            for name in ("low_freq_factor", "high_freq_factor"):
                _check_float(f"llama3 rope scaling {name}", getattr(self, name), positive=True)
            _check_sizes("RopeScaling", self, ("original_max_position_embeddings",))
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
    """Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Gemma, Phi-3). Hashable; build with keyword args.

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
      model_type: one of :data:`LLAMA_FAMILY` (used when saving an HF checkpoint: it picks the tensor
        names, e.g. Phi-3's fused ``qkv_proj`` / ``gate_up_proj``).
      hidden_act: the gated MLP's activation, ``act(gate) * up`` (:data:`GATED_ACTIVATIONS`: ``silu``,
        ``gelu`` exact, ``gelu_new`` / ``gelu_pytorch_tanh`` tanh approximation; Gemma: GeGLU).
      embed_scale: multiply the token embeddings by ``sqrt(hidden)``, rounded to the compute dtype (Gemma).
      norm_style: ``"llama"``: RMSNorm output cast to the compute dtype, then times the scale;
        ``"gemma"``: times the scale in float32, then cast (and HF checkpoints store ``scale - 1``).
        Either way eqjax's param tree holds the *effective* scale, so a norm is ``x_hat * scale``.
      rotary_dim: RoPE rotates the first ``rotary_dim`` channels of each head and passes the rest
        (Phi-3's ``partial_rotary_factor``); None = ``head_dim``.
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
    hidden_act: str = "silu"
    embed_scale: bool = False
    norm_style: Literal["llama", "gemma"] = "llama"
    rotary_dim: int | None = None

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass normalization
        _check_sizes("LlamaConfig", self, ("vocab", "hidden", "intermediate", "n_layers", "n_heads", "n_kv_heads",
                                           "head_dim", "max_position_embeddings"))
        _check_float("LlamaConfig.rope_theta", self.rope_theta, positive=True)
        _check_float("LlamaConfig.rms_norm_eps", self.rms_norm_eps, positive=False)
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
        if self.sliding_layers is not None and not all(0 <= i < self.n_layers for i in self.sliding_layers):
            raise ConfigError(f"LlamaConfig.sliding_layers must be layer indices in [0, {self.n_layers}), "
                              f"got {self.sliding_layers}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.model_type not in LLAMA_FAMILY:
            raise ConfigError(f"LlamaConfig.model_type must be one of {LLAMA_FAMILY}, got {self.model_type!r}")
        if self.hidden_act not in GATED_ACTIVATIONS:
            raise ConfigError(f"LlamaConfig.hidden_act must be one of {GATED_ACTIVATIONS}, got {self.hidden_act!r}")
        if self.norm_style not in NORM_STYLES:
            raise ConfigError(f"LlamaConfig.norm_style must be one of {NORM_STYLES}, got {self.norm_style!r}")
        if self.rotary_dim is None:
            set_("rotary_dim", self.head_dim)
        if not (2 <= self.rotary_dim <= self.head_dim) or self.rotary_dim % 2:
            raise ConfigError(f"rotary_dim must be even and in [2, head_dim={self.head_dim}], got {self.rotary_dim}")

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
        _check_sizes("GPT2Config", self, ("vocab", "hidden", "n_layers", "n_heads", "n_positions", "intermediate"))
        _check_float("GPT2Config.layer_norm_eps", self.layer_norm_eps, positive=False)
        if self.intermediate is None:
            object.__setattr__(self, "intermediate", 4 * self.hidden)
        if self.hidden % self.n_heads:
            raise ConfigError(f"GPT-2 hidden {self.hidden} is not a multiple of n_heads {self.n_heads}")
        if self.activation not in ACTIVATIONS or self.activation == "silu":
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

