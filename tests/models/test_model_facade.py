"""The Model facade without torch: jit, block-by-block, KV cache, kv_quant hook, quantized kernels, configs."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqjax.linear import ActQuantKernel
from eqjax.models import ConfigError, GPT2Config, LlamaConfig, Model, RopeScaling, from_hf_config, to_hf_config
from eqjax.numerics import QuantSpec, quantize
from eqjax.qarray import per_channel

B, T, V = 2, 12, 64
LLAMA = LlamaConfig(
    vocab=V, hidden=32, intermediate=48, n_layers=2, n_heads=4, n_kv_heads=2, sliding_window=5,
    sliding_layers=(1,), qk_norm=True, attention_bias=True, model_type="qwen3",
)
GPT2 = GPT2Config(vocab=V, hidden=32, n_layers=2, n_heads=4, n_positions=32)


@functools.cache
def _setup(kind: str):
    """(model, params, tokens, jitted apply, reference logits), built once per architecture."""
    model = Model(LLAMA if kind == "llama" else GPT2)
    params = model.init_params(jax.random.key(0), std=0.3)
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, V, dtype=jnp.int32)
    apply = jax.jit(model.apply, static_argnames="kv_quant")
    logits, _ = apply(params, tokens)
    return model, params, tokens, apply, np.asarray(logits)


@pytest.fixture(params=["llama", "gpt2"])
def setup(request):
    return _setup(request.param)


def test_shapes_and_tree(setup):
    model, params, _, _, ref = setup
    assert ref.shape == (B, T, V) and ref.dtype == np.float32 and np.isfinite(ref).all()
    shapes = jax.tree.map(lambda a: tuple(a.shape), params)
    assert shapes == model.param_shapes()
    assert model.layer_names == ("layers_0", "layers_1")
    assert hash(model) == hash(dataclasses.replace(model))


def test_block_by_block_equals_apply(setup):
    model, params, tokens, _, ref = setup

    @jax.jit
    def run(params, tokens):
        pos = model.positions(B, T)
        h = model.embed(params, tokens, pos)
        for i, name in enumerate(model.layer_names):
            h, c = model.block(params[name], h, pos, layer_index=i)
            assert c is None and h.shape == (B, T, model.config.hidden)
        return model.head(params, h)

    np.testing.assert_allclose(np.asarray(run(params, tokens)), ref, atol=1e-5)


def test_linear_groups_name_real_layers(setup):
    model, params, *_ = setup
    block = params["layers_0"]
    for prev, names in model.linear_groups:
        for path in names + ((prev,) if prev else ()):
            node = block
            for k in path.split("/"):
                node = node[k]
        for path in names:
            assert "kernel" in _get(block, path)


def _get(tree, path):
    for k in path.split("/"):
        tree = tree[k]
    return tree


def test_cached_decode_matches_full(setup):
    model, params, tokens, apply, ref = setup
    cache = model.init_cache(B, 16)
    out, cache = apply(params, tokens[:, :4], cache=cache)
    outs = [out]
    for t in range(4, T):
        out, cache = apply(params, tokens[:, t : t + 1], cache=cache)
        outs.append(out)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), ref, atol=1e-5)
    with pytest.raises(ValueError, match="overflow"):
        model.apply(params, tokens, cache=cache)


def test_generate_is_greedy_argmax(setup):
    model, params, tokens, apply, _ = setup
    out = model.generate(params, tokens[:, :3], 4)
    assert out.shape == (B, 7) and out.dtype == jnp.int32
    full, _ = apply(params, out)
    np.testing.assert_array_equal(np.argmax(np.asarray(full[:, 2:-1]), -1), np.asarray(out[:, 3:]))
    with pytest.raises(ValueError, match="max_len"):
        model.generate(params, tokens[:, :3], 4, max_len=5)


@dataclasses.dataclass(frozen=True)
class _ZeroValues:
    """Keeps keys, zeroes values: attention then contributes only the output projection's bias."""

    def keys(self, k):
        return k

    def values(self, v):
        return jnp.zeros_like(v)


@dataclasses.dataclass(frozen=True)
class _Identity:
    def keys(self, k):
        assert k.ndim == 4 and k.shape[:2] == (B, T) and k.shape[2] in (2, 4)  # [B, T, Hkv, hd]
        return k

    def values(self, v):
        return v


def test_kv_quant_hook(setup):
    model, params, tokens, apply, ref = setup
    same, _ = apply(params, tokens, kv_quant=_Identity())
    np.testing.assert_allclose(np.asarray(same), ref, atol=1e-6)
    zero, _ = apply(params, tokens, kv_quant=_ZeroValues())
    stripped = jax.tree.map(lambda x: x, params)
    for name in model.layer_names:
        attn = stripped[name]["attn"]
        out = "o_proj" if "o_proj" in attn else "c_proj"
        attn[out] = dict(attn[out], kernel=jnp.zeros_like(attn[out]["kernel"]))
    ref0, _ = apply(stripped, tokens)
    np.testing.assert_allclose(np.asarray(zero), np.asarray(ref0), atol=1e-5)


def test_quantized_kernels_run_unchanged():
    model, params, tokens, apply, ref = _setup("llama")  # GPT-2 goes through the same linear()
    spec = QuantSpec(bits=8, symmetric=True, granularity=per_channel(1))

    def q(path, leaf):
        if path[0].key == "layers_0" and path[-1].key == "kernel":  # one layer keeps the test quick
            w = quantize(leaf, spec)
            return ActQuantKernel(w) if "mlp" in str(path) else w
        return leaf

    qparams = jax.tree_util.tree_map_with_path(q, params)
    logits, _ = apply(qparams, tokens)
    err = np.abs(np.asarray(logits) - ref).max()
    assert 0 < err < 0.05 * np.abs(ref).max()


def test_bfloat16_compute():
    model, params, tokens, _, ref = _setup("llama")
    bf = dataclasses.replace(model, dtype="bfloat16")
    logits, _ = jax.jit(bf.apply)(params, tokens)
    assert logits.dtype == jnp.float32
    assert np.abs(np.asarray(logits) - ref).max() < 0.1 * np.abs(ref).max()


def test_rope_scaling_variants():
    base = dict(vocab=8, hidden=16, intermediate=8, n_layers=1, n_heads=2)
    c = LlamaConfig(**base, rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert c.rope_scaling == RopeScaling("linear", 2.0)
    hash(c)
    with pytest.raises(ConfigError, match="yarn"):
        LlamaConfig(**base, rope_scaling={"rope_type": "yarn", "factor": 2.0})


def test_hf_config_roundtrip_and_errors():
    d = {
        "model_type": "llama", "vocab_size": 10, "hidden_size": 16, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": True,
    }
    c = from_hf_config(d)
    assert c.rope_theta == 500000.0 and c.rope_scaling.type == "llama3" and c.n_kv_heads == 2
    assert from_hf_config(to_hf_config(c)) == c
    assert from_hf_config(to_hf_config(GPT2)) == GPT2
    with pytest.raises(ConfigError, match=r"my/config.json.*BertModel"):
        from_hf_config({"model_type": "bert", "architectures": ["BertModel"]}, source="my/config.json")
    with pytest.raises(ConfigError, match="dynamic"):
        from_hf_config({**d, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    with pytest.raises(ConfigError, match="n_kv_heads"):
        LlamaConfig(vocab=8, hidden=16, intermediate=8, n_layers=1, n_heads=4, n_kv_heads=3)
