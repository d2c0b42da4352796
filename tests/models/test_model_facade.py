"""The Model facade without torch: jit, block-by-block, KV cache, kv_quant hook, quantized kernels, configs."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqjax.models import GPT2Config, LlamaConfig, Model

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
