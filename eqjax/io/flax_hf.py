"""eqjax params -> a Hugging Face Flax model (``FlaxLlamaForCausalLM`` / ``FlaxGPT2LMHeadModel``).

For running third-party Flax code on the weights eqjax loads (e.g. SmolLM2 from its GGUF, which no
machine here can download from a hub): ``hf_model, hf_params = to_hf_flax(model, params)``, then
``hf_model.module.apply({"params": hf_params}, input_ids, attention_mask, position_ids)``. Needs
``transformers`` 4.x (its Flax models were removed in 5.0).

Llama family: HF's Flax Llama has no tied head, so a tied embedding is copied into ``lm_head``
(quantizing it is then a choice of the recipe; eqjax's own tied model keeps it in float); biases and
QK norms (Qwen2/3) are not in HF's Flax Llama and are refused. GPT-2: Conv1D kernels are stored
``[out, in]`` by HF's Flax code (transposed here).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from eqjax.core.errors import InputError
from eqjax.models import GPT2Config, LlamaConfig, to_hf_config

__all__ = ["to_hf_flax"]


def _a(x: Any) -> np.ndarray:
    return np.asarray(x, np.float32)


def _llama(cfg: LlamaConfig, p: dict[str, Any]) -> dict[str, Any]:
    if cfg.attention_bias or cfg.qk_norm or cfg.sliding_window is not None or cfg.rope_scaling is not None:
        raise InputError("to_hf_flax: HF's FlaxLlama has no attention bias, QK norm, sliding window or RoPE scaling")
    layers = {}
    for i in range(cfg.n_layers):
        lp = p[f"layers_{i}"]
        layers[str(i)] = {
            "input_layernorm": {"weight": _a(lp["attn_norm"]["scale"])},
            "self_attn": {k: {"kernel": _a(lp["attn"][k]["kernel"])} for k in ("q_proj", "k_proj", "v_proj", "o_proj")},
            "post_attention_layernorm": {"weight": _a(lp["mlp_norm"]["scale"])},
            "mlp": {k: {"kernel": _a(lp["mlp"][k]["kernel"])} for k in ("gate_proj", "up_proj", "down_proj")},
        }
    emb = _a(p["embed"]["embedding"])
    head = emb.T.copy() if "lm_head" not in p else _a(p["lm_head"]["kernel"])
    return {"model": {"embed_tokens": {"embedding": emb}, "layers": layers, "norm": {"weight": _a(p["final_norm"]["scale"])}},
            "lm_head": {"kernel": head}}


def _gpt2(cfg: GPT2Config, p: dict[str, Any]) -> dict[str, Any]:
    h = {}
    for i in range(cfg.n_layers):
        lp = p[f"layers_{i}"]
        conv = lambda d: {"kernel": _a(d["kernel"]).T.copy(), "bias": _a(d["bias"])}  # noqa: E731
        h[str(i)] = {
            "ln_1": {"scale": _a(lp["ln_1"]["scale"]), "bias": _a(lp["ln_1"]["bias"])},
            "attn": {"c_attn": conv(lp["attn"]["c_attn"]), "c_proj": conv(lp["attn"]["c_proj"])},
            "ln_2": {"scale": _a(lp["ln_2"]["scale"]), "bias": _a(lp["ln_2"]["bias"])},
            "mlp": {"c_fc": conv(lp["mlp"]["c_fc"]), "c_proj": conv(lp["mlp"]["c_proj"])},
        }
    return {"transformer": {"wte": {"embedding": _a(p["wte"]["embedding"])}, "wpe": {"embedding": _a(p["wpe"]["embedding"])},
                            "h": h, "ln_f": {"scale": _a(p["ln_f"]["scale"]), "bias": _a(p["ln_f"]["bias"])}}}


def to_hf_flax(model: Any, params: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``(HF Flax model, its params)`` holding the same weights as eqjax's ``model``/``params``."""
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - a test/bench extra
        raise InputError("to_hf_flax needs transformers 4.x (pip install 'transformers<5')") from e
    cfg = model.config
    hf = dict(to_hf_config(cfg))
    if isinstance(cfg, GPT2Config):
        cls, conf, tree = "FlaxGPT2LMHeadModel", transformers.GPT2Config, _gpt2(cfg, params)
    elif isinstance(cfg, LlamaConfig) and cfg.model_type in ("llama", "mistral"):
        cls, conf, tree = "FlaxLlamaForCausalLM", transformers.LlamaConfig, _llama(cfg, params)
        hf["tie_word_embeddings"] = False
    else:
        raise InputError(f"to_hf_flax: no Hugging Face Flax class for {getattr(cfg, 'model_type', type(cfg).__name__)}")
    if not hasattr(transformers, cls):
        raise InputError(f"to_hf_flax: transformers {transformers.__version__} has no {cls} (Flax models need 4.x)")
    hf_model = getattr(transformers, cls)(conf(**hf), _do_init=False)
    return hf_model, tree
