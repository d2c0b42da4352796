"""Quantize your own flax.nnx model with a calibrated recipe and compare it with the float model.

    python examples/nnx_model.py                                # GPTQ, 4-bit weights in groups of 128
    python examples/nnx_model.py --recipe w8a8-smoothquant --layers 1

A tiny decoder-only language model written with ``flax.nnx`` (embedding, causal self-attention, MLP,
RMSNorm, random init) is quantized by ``eqjax.quantize_model`` with calibration batches of token ids.
The result is called like the module; the example prints what was done to each param, the relative
error of the logits, the agreement of the next-token predictions, the param bytes, and a JSON summary
as its last line.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import eqjax


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        self.heads = heads
        self.attn_norm = nnx.RMSNorm(d, rngs=rngs)
        self.q, self.k, self.v, self.o = (nnx.Linear(d, d, use_bias=False, rngs=rngs) for _ in range(4))
        self.mlp_norm = nnx.RMSNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (f(h).reshape(b, t, self.heads, d // self.heads) for f in (self.q, self.k, self.v))
        s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d // self.heads)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
        x = x + self.o(jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v).reshape(b, t, d))
        return x + self.down(nnx.gelu(self.up(self.mlp_norm(x))))


class TinyLM(nnx.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, heads, rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def quantized(leaf: object) -> bool:
    return isinstance(leaf, (eqjax.QArray, eqjax.ActQuantKernel))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="w4g128-gptq", help="a built-in recipe name (see eqjax.recipe_names())")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--calib-batches", type=int, default=4)
    args = ap.parse_args(argv)

    vocab, seq = 512, 32
    model = TinyLM(vocab, args.width, args.layers, heads=4, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    calibration = [(jnp.asarray(rng.integers(0, vocab, (8, seq)), jnp.int32),) for _ in range(args.calib_batches)]
    ids = jnp.asarray(rng.integers(0, vocab, (16, seq)), jnp.int32)

    qmodel = eqjax.quantize_model(model, args.recipe, calibration=calibration)
    for path, what in qmodel.report:
        print(f"  {path:28s} {what}")

    ref = np.asarray(model(ids))
    got = np.asarray(qmodel(ids))
    float_params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    summary = {
        "recipe": args.recipe,
        "rel_err": float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
        "max_rel_err": float(np.abs(got - ref).max() / np.abs(ref).max()),
        "top1_agreement": float(np.mean(got.argmax(-1) == ref.argmax(-1))),
        "quantized": sum(map(quantized, jax.tree.leaves(qmodel.params, is_leaf=quantized))),
        "float_bytes": eqjax.tree_nbytes(float_params),
        "quantized_bytes": eqjax.tree_nbytes(qmodel.params),
    }
    print(f"{args.recipe}: logits relative error {summary['rel_err']:.2e} (max {summary['max_rel_err']:.2e}), "
          f"next-token agreement {summary['top1_agreement']:.1%}; {summary['quantized']} weights quantized, params "
          f"{summary['float_bytes']} -> {summary['quantized_bytes']} bytes")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
