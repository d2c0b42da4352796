"""Quantize a Hugging Face Flax model (FlaxLlamaForCausalLM) and compare its logits with the float model.

    python examples/hf_flax_model.py                            # AWQ, 4-bit weights in groups of 128
    python examples/hf_flax_model.py --recipe w8a8-smoothquant --layers 4

A tiny Llama is built from a ``transformers.LlamaConfig`` with random weights (no download; transformers
4.x, the last release line with Flax models). ``eqjax.quantize_model`` takes the Hugging Face model
itself (its ``.module`` and ``.params``) and calibration batches of the module's positional arguments
``(input_ids, attention_mask, position_ids)``; the quantized model runs the same ``apply`` call. The
example prints what was done to each param, the relative error of the logits, the agreement of the
next-token predictions, and a JSON summary as its last line.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from transformers import FlaxLlamaForCausalLM, LlamaConfig

import eqjax


def batch(rng: np.random.Generator, vocab: int, b: int, t: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    ids = jnp.asarray(rng.integers(0, vocab, (b, t)), jnp.int32)
    return ids, jnp.ones_like(ids), jnp.broadcast_to(jnp.arange(t), ids.shape)


def quantized(leaf: object) -> bool:
    return isinstance(leaf, (eqjax.QArray, eqjax.ActQuantKernel))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="w4g128-awq", help="a built-in recipe name (see eqjax.recipe_names())")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--calib-batches", type=int, default=4)
    args = ap.parse_args(argv)

    cfg = LlamaConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128)
    hf_model = FlaxLlamaForCausalLM(cfg, seed=0)
    rng = np.random.default_rng(0)
    calibration = [batch(rng, cfg.vocab_size, 8, 32) for _ in range(args.calib_batches)]
    inputs = batch(rng, cfg.vocab_size, 16, 32)

    qmodel, qparams = eqjax.quantize_model(hf_model, args.recipe, calibration=calibration)
    for path, what in qmodel.report:
        print(f"  {path:48s} {what}")

    ref = np.asarray(hf_model.module.apply({"params": hf_model.params}, *inputs).logits)
    got = np.asarray(qmodel.apply({"params": qparams}, *inputs).logits)
    summary = {
        "recipe": args.recipe,
        "rel_err": float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
        "max_rel_err": float(np.abs(got - ref).max() / np.abs(ref).max()),
        "top1_agreement": float(np.mean(got.argmax(-1) == ref.argmax(-1))),
        "quantized": sum(map(quantized, jax.tree.leaves(qparams, is_leaf=quantized))),
        "float_bytes": eqjax.tree_nbytes(hf_model.params),
        "quantized_bytes": eqjax.tree_nbytes(qparams),
    }
    print(f"{args.recipe}: logits relative error {summary['rel_err']:.2e} (max {summary['max_rel_err']:.2e}), "
          f"next-token agreement {summary['top1_agreement']:.1%}; {summary['quantized']} weights quantized, params "
          f"{summary['float_bytes']} -> {summary['quantized_bytes']} bytes")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
