"""Quantize your own flax.linen model with a calibrated recipe and compare it with the float model.

    python examples/linen_model.py                              # W8A8 + SmoothQuant
    python examples/linen_model.py --recipe w4g128-gptq --width 256

A small pre-norm residual MLP classifier (random init) is quantized by ``eqjax.quantize_model`` with
calibration batches of its own inputs. The quantized module runs the same ``apply`` call; the example
prints what was done to each param, the relative error of the logits, the top-1 agreement, the param
bytes, and a JSON summary as its last line.
"""

from __future__ import annotations

import argparse
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import eqjax


class ResidualMLP(nn.Module):
    width: int
    depth: int = 2
    classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(self.depth):
            h = nn.Dense(2 * self.width, name=f"up_{i}")(nn.LayerNorm(name=f"norm_{i}")(x))
            x = x + nn.Dense(self.width, name=f"down_{i}")(nn.gelu(h))
        return nn.Dense(self.classes, name="head")(nn.LayerNorm(name="final_norm")(x))


def inputs(key: jax.Array, batch: int, width: int) -> jax.Array:
    """Gaussian features with a few large channels: the activation outliers SmoothQuant is made for."""
    boost = jnp.ones(width).at[:: max(width // 8, 1)].set(8.0)
    return jax.random.normal(key, (batch, width)) * boost


def quantized(leaf: object) -> bool:
    return isinstance(leaf, (eqjax.QArray, eqjax.ActQuantKernel))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="w8a8-smoothquant", help="a built-in recipe name (see eqjax.recipe_names())")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--calib-batches", type=int, default=4)
    args = ap.parse_args(argv)

    net = ResidualMLP(args.width)
    x = inputs(jax.random.key(0), 256, args.width)
    params = net.init(jax.random.key(1), x)["params"]
    calibration = [(inputs(jax.random.key(10 + i), 64, args.width),) for i in range(args.calib_batches)]

    qnet, qparams = eqjax.quantize_model(net, args.recipe, params=params, calibration=calibration)
    for path, what in qnet.report:
        print(f"  {path:24s} {what}")

    ref = np.asarray(net.apply({"params": params}, x))
    got = np.asarray(qnet.apply({"params": qparams}, x))
    summary = {
        "recipe": args.recipe,
        "rel_err": float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
        "max_rel_err": float(np.abs(got - ref).max() / np.abs(ref).max()),
        "top1_agreement": float(np.mean(got.argmax(-1) == ref.argmax(-1))),
        "quantized": sum(map(quantized, jax.tree.leaves(qparams, is_leaf=quantized))),
        "float_bytes": eqjax.tree_nbytes(params),
        "quantized_bytes": eqjax.tree_nbytes(qparams),
    }
    print(f"{args.recipe}: logits relative error {summary['rel_err']:.2e} (max {summary['max_rel_err']:.2e}), "
          f"top-1 agreement {summary['top1_agreement']:.1%}; params {summary['float_bytes']} -> "
          f"{summary['quantized_bytes']} bytes")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
