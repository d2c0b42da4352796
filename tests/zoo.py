"""Small models of every kind eqjax must handle, shared by the core, API and method tests.

Each ``make_*`` returns ``(fn, params, batches)``: ``fn(params, *args)`` is the model's own call,
``params`` its float params, ``batches`` a few argument tuples of one shape (deterministic).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

V = 64


def token_batches(n: int = 3, b: int = 2, t: int = 8, seed: int = 0, vocab: int = V) -> list[tuple]:
    rng = np.random.default_rng(seed)
    return [(jnp.asarray(rng.integers(0, vocab, (b, t)), jnp.int32),) for _ in range(n)]


def make_linen():
    """A linen transformer-ish model: Dense, RMSNorm, DenseGeneral (3-D kernel), Einsum (3-D), a
    top-level Dense head, two repeated blocks, an embedding."""
    import flax.linen as nn

    class Block(nn.Module):
        d: int = 32

        @nn.compact
        def __call__(self, x):
            h = nn.RMSNorm(name="norm")(x)
            qkv = nn.DenseGeneral((3, 4, self.d // 4), name="qkv")(h)  # kernel [d, 3, 4, hd]
            q, k, v = qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]
            s = jnp.einsum("bthk,bshk->bhts", q, k) / np.sqrt(self.d // 4)
            mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
            p = jax.nn.softmax(jnp.where(mask, s, -1e9), -1)
            o = jnp.einsum("bhts,bshk->bthk", p, v)
            x = x + nn.Einsum((4, self.d // 4, self.d), "bthk,hkd->btd", name="out")(o)
            h = nn.RMSNorm(name="mlp_norm")(x)
            g = nn.Dense(2 * self.d, use_bias=False, name="gate")(h)
            u = nn.Dense(2 * self.d, use_bias=False, name="up")(h)
            return x + nn.Dense(self.d, name="down")(jax.nn.silu(g) * u)

    class Net(nn.Module):
        @nn.compact
        def __call__(self, ids):
            x = nn.Embed(V, 32, name="embed")(ids)
            for i in range(2):
                x = Block(name=f"block_{i}")(x)
            return nn.Dense(V, name="head")(nn.RMSNorm(name="final_norm")(x))

    net = Net()
    batches = token_batches()
    params = net.init(jax.random.key(0), batches[0][0])["params"]
    return net, params, batches


def make_nnx():
    """An NNX model with fused 4-D qkv einsum kernels (the weight is dot_general's lhs), 3-D out
    kernels, an nnx.List of blocks, an embedding and a linear head."""
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, d, rngs):
            self.norm = nnx.RMSNorm(d, rngs=rngs)
            self.qkv = nnx.Einsum("btd,sdhk->sbthk", (3, d, 4, d // 4), rngs=rngs)
            self.out = nnx.Einsum("bthk,hkd->btd", (4, d // 4, d), rngs=rngs)
            self.mlp_norm = nnx.RMSNorm(d, rngs=rngs)
            self.up = nnx.Linear(d, 2 * d, rngs=rngs)
            self.down = nnx.Linear(2 * d, d, rngs=rngs)

        def __call__(self, x):
            q, k, v = self.qkv(self.norm(x))
            s = jnp.einsum("bthk,bshk->bhts", q, k) / np.sqrt(q.shape[-1])
            mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
            o = jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(jnp.where(mask, s, -1e9), -1), v)
            x = x + self.out(o)
            return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(V, 32, rngs=rngs)
            self.blocks = nnx.List([Block(32, rngs) for _ in range(2)])
            self.head = nnx.Linear(32, V, rngs=rngs)

        def __call__(self, ids):
            x = self.embed(ids)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    return Net(nnx.Rngs(0)), token_batches()


def nnx_function(module):
    """``(fn(pure_params, *args), pure_params)`` of an NNX module."""
    from flax import nnx

    graphdef, state, rest = nnx.split(module, nnx.Param, ...)

    def fn(pd, *args):
        st = jax.tree.map(lambda x: x, state)
        nnx.replace_by_pure_dict(st, pd)
        return nnx.merge(graphdef, st, rest)(*args)

    return fn, nnx.to_pure_dict(state)


def make_hf_llama(layers: int = 2):
    from transformers import FlaxLlamaForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return FlaxLlamaForCausalLM(cfg, seed=0)


def make_hf_gpt2(layers: int = 2):
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    cfg = GPT2Config(vocab_size=V, n_embd=32, n_layer=layers, n_head=4, n_positions=64)
    return FlaxGPT2LMHeadModel(cfg, seed=0)


def hf_batches(n: int = 3, b: int = 2, t: int = 8, seed: int = 0) -> list[tuple]:
    out = []
    for (ids,) in token_batches(n, b, t, seed):
        out.append((ids, jnp.ones_like(ids), jnp.broadcast_to(jnp.arange(t), ids.shape)))
    return out


def hf_fn(model):
    return lambda p, ids, am, pos: model.module.apply({"params": p}, ids, am, pos).logits


def make_eqjax(kind: str = "llama"):
    from eqjax.models import GPT2Config, LlamaConfig, Model

    cfg = (LlamaConfig(vocab=V, hidden=32, intermediate=64, n_layers=2, n_heads=4, n_kv_heads=2) if kind == "llama"
           else GPT2Config(vocab=V, hidden=32, n_layers=2, n_heads=4, n_positions=64))
    model = Model(cfg)
    return model, model.init_params(jax.random.key(0), std=0.1)


def all_models():
    """``{name: (fn, params, batches)}`` for every kind (flax imports deferred to call time)."""
    out = {}
    net, p, b = make_linen()
    out["linen"] = (lambda params, ids: net.apply({"params": params}, ids), p, b)
    m, b = make_nnx()
    fn, pd = nnx_function(m)
    out["nnx"] = (fn, pd, b)
    for name, mk in (("hf-llama", make_hf_llama), ("hf-gpt2", make_hf_gpt2)):
        hm = mk()
        out[name] = (hf_fn(hm), hm.params, hf_batches())
    for kind in ("llama", "gpt2"):
        model, params = make_eqjax(kind)
        out[f"eqjax-{kind}"] = (lambda p, t, model=model: model.apply(p, t)[0], params, token_batches())
    return out
