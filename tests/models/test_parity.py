"""Logit parity with transformers (eager attention, float32) for every supported architecture
(Llama, Mistral, Qwen2, Qwen3, Gemma, Phi-3, GPT-2; silu, gelu and relu MLPs).

Each case builds a tiny random model with transformers, saves it as safetensors, loads it with
:func:`eqjax.io.hf.load_hf_checkpoint` and compares logits (max abs <= 1e-4) for a batched prefill
and for KV-cached decoding one token at a time.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from eqjax.io.hf import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402

pytestmark = pytest.mark.reference

TOL = 1e-4
B, T, PREFIX = 2, 24, 9
V = 128
_COMMON = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)
_LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 5000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # wavelengths fall in all three llama3 bands
}

def _rope(params: dict) -> dict:
    """Both spellings of RoPE scaling: transformers 5 reads ``rope_parameters``, 4.x ``rope_scaling`` +
    ``rope_theta`` (the Flax models need 4.x; the parity tests run on whichever is installed)."""
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return {"rope_parameters": params, "rope_scaling": scaling, "rope_theta": params["rope_theta"]}


CASES = {
    "llama_untied_bias": ("LlamaConfig", dict(_COMMON, tie_word_embeddings=False, attention_bias=True)),
    "llama_tied_llama3_rope": ("LlamaConfig", dict(_COMMON, tie_word_embeddings=True, **_rope(_LLAMA3))),
    "llama_linear_rope": (
        "LlamaConfig",
        dict(_COMMON, **_rope({"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})),
    ),
    "mistral_window": ("MistralConfig", dict(_COMMON, sliding_window=6)),
    "qwen2_bias_tied": ("Qwen2Config", dict(_COMMON, tie_word_embeddings=True)),
    "qwen2_window": (
        "Qwen2Config",
        dict(_COMMON, use_sliding_window=True, sliding_window=5, max_window_layers=1),
    ),
    "qwen3_qknorm": ("Qwen3Config", dict(_COMMON, tie_word_embeddings=False)),
    "gpt2": ("GPT2Config", dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64)),
    # GPT-2-style variants: exact gelu, a non-default MLP width, the per-layer attention scale; relu
    "gpt2_gelu_inner_layer_scale": (
        "GPT2Config",
        dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64, activation_function="gelu", n_inner=80,
             scale_attn_by_inverse_layer_idx=True),
    ),
    "gpt2_relu": ("GPT2Config", dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                     activation_function="relu")),
    # Gemma: GeGLU, sqrt(D) embedding scale, (1 + w) norms, head_dim 24 != hidden / heads, tied.
    "gemma_tied": (
        "GemmaConfig",
        dict(_COMMON, head_dim=24, hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh"),
    ),
    "gemma_untied_bias_linear_rope": (
        "GemmaConfig",
        dict(_COMMON, tie_word_embeddings=False, attention_bias=True, hidden_act="gelu_pytorch_tanh",
             **_rope({"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})),
    ),
    # Phi-3: fused qkv_proj / gate_up_proj, sliding window, partial rotary (pad id inside the tiny vocab).
    "phi3_window": ("Phi3Config", dict(_COMMON, sliding_window=6, pad_token_id=0)),
    "phi3_partial_rotary_tied": (
        "Phi3Config",
        dict(_COMMON, partial_rotary_factor=0.5, tie_word_embeddings=True, pad_token_id=0),
    ),
    # gelu MLPs on Llama-family configs
    "llama_gelu": ("LlamaConfig", dict(_COMMON, hidden_act="gelu")),
    "qwen2_gelu_new": ("Qwen2Config", dict(_COMMON, hidden_act="gelu_new")),
    "mistral_gelu_tanh": ("MistralConfig", dict(_COMMON, hidden_act="gelu_pytorch_tanh")),
}

# Decoding is checked on every architecture; these variants differ from a decoded case only in
# ways the prefill already covers (saves compile time).
PREFILL_ONLY = ("llama_linear_rope", "qwen2_bias_tied", "gemma_untied_bias_linear_rope", "qwen2_gelu_new",
                "mistral_gelu_tanh", "gpt2_relu")


def _randomize(model) -> None:
    """Replace the tiny init (std 0.02, unit norms) by larger values so mapping mistakes show."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and ("norm" in name or ".ln_" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def _build(case: str):
    cls_name, kw = CASES[case]
    torch.manual_seed(0)
    cfg = getattr(transformers, cls_name)(**kw)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    _randomize(model)
    return model.eval()


def _tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, V, size=(B, T), dtype=np.int64)


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.float().numpy()


@pytest.fixture(scope="module", params=sorted(CASES))
def hf_case(request, tmp_path_factory):
    """(case, HF model, directory it was saved to, reference logits)."""
    model = _build(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    tokens = _tokens()
    return request.param, model, path, _hf_logits(model, tokens)


def test_prefill_and_cached_decode(hf_case):
    case, _, path, ref = hf_case
    model, params = load_hf_checkpoint(path)
    tokens = jnp.asarray(_tokens(), jnp.int32)
    apply = jax.jit(model.apply)

    logits, _ = apply(params, tokens)
    np.testing.assert_allclose(np.asarray(logits), ref, atol=TOL, rtol=0, err_msg=f"{case}: prefill")

    if case in PREFILL_ONLY:
        return
    cache = model.init_cache(B, T + 3)
    out, cache = apply(params, tokens[:, :PREFIX], cache=cache)
    steps = [out]
    for t in range(PREFIX, T):
        out, cache = apply(params, tokens[:, t : t + 1], cache=cache)
        steps.append(out)
    assert int(cache.length) == T
    np.testing.assert_allclose(np.concatenate(steps, axis=1), ref, atol=TOL, rtol=0, err_msg=f"{case}: decode")


def test_save_roundtrip_loads_in_transformers(hf_case, tmp_path):
    case, hf_model, path, ref = hf_case
    model, params = load_hf_checkpoint(path)
    save_hf_checkpoint(tmp_path, model, params)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(back) is type(hf_model)
    np.testing.assert_allclose(_hf_logits(back, _tokens()), ref, atol=TOL, rtol=0, err_msg=case)


def test_sharded_checkpoint(tmp_path):
    hf = _build("qwen3_qknorm")
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model, params = load_hf_checkpoint(tmp_path)
    logits, _ = jax.jit(model.apply)(params, jnp.asarray(_tokens(), jnp.int32))
    np.testing.assert_allclose(np.asarray(logits), _hf_logits(hf, _tokens()), atol=TOL, rtol=0)


@pytest.mark.parametrize(
    "case, changed",
    [
        ("mistral_window", {"sliding_window": None}),
        ("llama_tied_llama3_rope", {"rope_scaling": None}),
        ("gemma_tied", {"embed_scale": False}),
        ("gemma_tied", {"hidden_act": "silu"}),
        ("phi3_partial_rotary_tied", {"rotary_dim": 16}),
        ("phi3_window", {"sliding_window": None}),
        ("llama_gelu", {"hidden_act": "gelu_pytorch_tanh"}),
        ("gpt2_gelu_inner_layer_scale", {"scale_attn_by_inverse_layer_idx": False}),
    ],
)
def test_features_matter(tmp_path, case, changed):
    """Control: without the window / the RoPE scaling / Gemma's embedding scale / partial RoPE, or with
    another activation (even exact vs tanh GELU), the logits differ by well over the parity tolerance."""
    hf = _build(case)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model, params = load_hf_checkpoint(tmp_path)
    plain = dataclasses.replace(model, config=dataclasses.replace(model.config, **changed))
    logits, _ = jax.jit(plain.apply)(params, jnp.asarray(_tokens(), jnp.int32))
    assert np.abs(np.asarray(logits) - _hf_logits(hf, _tokens())).max() > 10 * TOL


def test_tied_and_untied_trees(tmp_path):
    for case, tied in (("llama_tied_llama3_rope", True), ("llama_untied_bias", False)):
        _build(case).save_pretrained(tmp_path / case, safe_serialization=True)
        model, params = load_hf_checkpoint(tmp_path / case)
        assert model.config.tie_word_embeddings is tied
        assert ("lm_head" in params) is not tied


def test_greedy_generate_matches_transformers(tmp_path):
    hf = _build("llama_tied_llama3_rope")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model, params = load_hf_checkpoint(tmp_path)
    prompt = _tokens()[:, :5]
    with torch.no_grad():
        ref = hf.generate(torch.from_numpy(prompt), max_new_tokens=6, do_sample=False, pad_token_id=0).numpy()
    np.testing.assert_array_equal(np.asarray(model.generate(params, jnp.asarray(prompt), 6)), ref)
