"""``attend`` (causal GQA, sliding window, float recent block) against a float64 per-query loop, and the
models' use of a KV quantizer's float recent block (``KVQuant(recent_float=True)``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqjax.methods.kvquant import KVQuant, kv_bytes
from eqjax.models import GPT2Config, LlamaConfig, Model
from eqjax.models.llama import attend


def _oracle(q, k, v, kf, vf, block, scale, window):
    """float64 loop: query i of head h reads kv head h // g; key j visible iff j <= i (and i - window < j);
    from (kf, vf) where j // block == i // block, else from (k, v)."""
    q, k, v, kf, vf = (np.asarray(t, np.float64) for t in (q, k, v, kf, vf))
    B, Hq, T, hd = q.shape
    g = Hq // k.shape[1]
    out = np.zeros((B, T, Hq, hd))
    for b in range(B):
        for h in range(Hq):
            for i in range(T):
                js = [j for j in range(T) if j <= i and (window is None or j > i - window)]
                keys = np.stack([(kf if block and j // block == i // block else k)[b, h // g, j] for j in js])
                vals = np.stack([(vf if block and j // block == i // block else v)[b, h // g, j] for j in js])
                s = keys @ q[b, h, i] * scale
                p = np.exp(s - s.max())
                out[b, i, h] = (p / p.sum()) @ vals
    return out.reshape(B, T, Hq * hd)


@pytest.mark.parametrize("block,window", [(0, None), (4, None), (3, None), (4, 5), (16, None)])
def test_attend_matches_a_per_query_loop(block, window):
    rng = np.random.default_rng(block * 10 + (window or 0))
    B, Hq, Hkv, T, hd = 2, 4, 2, 10, 8
    q = rng.normal(size=(B, Hq, T, hd)).astype(np.float32)
    k, v, kf, vf = (rng.normal(size=(B, Hkv, T, hd)).astype(np.float32) for _ in range(4))
    pos = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    recent = (jnp.asarray(kf), jnp.asarray(vf), block) if block else None
    got = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos), jnp.asarray(pos), scale=0.3,
                 window=window, recent=recent)
    np.testing.assert_allclose(np.asarray(got), _oracle(q, k, v, kf, vf, block, 0.3, window), rtol=2e-5, atol=2e-5)


LLAMA = LlamaConfig(vocab=64, hidden=32, intermediate=48, n_layers=2, n_heads=4, n_kv_heads=2)
GPT2 = GPT2Config(vocab=64, hidden=32, n_layers=2, n_heads=4, n_positions=64)


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_recent_float_block(cfg):
    """A block as long as the window reads every key / value in float16 (so equals a float16 cache up
    to rounding); a short block lies between that and fully quantized; bytes add one float16 block;
    decoding with a cache quantizes per call, as without the block."""
    model = Model(cfg)
    params = model.init_params(jax.random.key(0), std=0.3)
    toks = jax.random.randint(jax.random.key(1), (2, 24), 0, 64, dtype=jnp.int32)
    fp, _ = model.apply(params, toks)
    base = dict(outlier_fraction=0.0, key_group=8, value_group=8)
    q2, _ = model.apply(params, toks, kv_quant=KVQuant(2, 2, **base))
    whole = KVQuant(2, 2, **{**base, "key_group": 24}, recent_float=True)
    wf, _ = model.apply(params, toks, kv_quant=whole)
    np.testing.assert_allclose(np.asarray(wf), np.asarray(fp), atol=2e-2)  # float16 rounding of K / V only
    part, _ = model.apply(params, toks, kv_quant=KVQuant(2, 2, **base, recent_float=True))
    err_q, err_p = float(jnp.abs(q2 - fp).mean()), float(jnp.abs(part - fp).mean())
    assert 0 < err_p < err_q and float(jnp.abs(q2 - fp).max()) > 0.2, (err_p, err_q)
    # the first block's queries read only float keys: their logits equal the float model's
    np.testing.assert_allclose(np.asarray(part[:, :8]), np.asarray(fp[:, :8]), atol=2e-2)
    extra = kv_bytes(cfg, KVQuant(2, 2, **base, recent_float=True), 64) - kv_bytes(cfg, KVQuant(2, 2, **base), 64)
    assert extra == cfg.n_layers * 8 * (getattr(cfg, "n_kv_heads", None) or cfg.n_heads) * cfg.head_dim * 2 * 2
    # decoding with a cache: per-call fake quantization, as without the float block
    a = model.generate(params, toks[:1, :4], 3, kv_quant=KVQuant(2, 2, **base, recent_float=True))
    b = model.generate(params, toks[:1, :4], 3, kv_quant=KVQuant(2, 2, **base))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="key_group"):
        KVQuant(2, 2, recent_float=True)
