"""Block-wise quantization-aware training (EfficientQAT's Block-AP, Chen et al., 2024), block by block.

Starting from a quantized param tree (any weight-only recipe's :class:`~eqjax.core.qarray.QArray` s), each
decoder block's QArrays become :class:`~eqjax.methods.qat.FakeQuant` s (latent weights, relative scales and
zero points in grid units) and are trained so that the block reproduces the *float* block: the loss is the
mean squared error between the block's outputs with the fake-quantized weights and the original float
block's outputs (every param of the block, norms included, from the params the recipe started from), both
on the same inputs. Inputs (``advance``): ``"new"`` (default), the outputs of the already trained quantized
blocks before it, so a block also learns to undo the error that reaches it; ``"original"``: the float
model's activations.

One calibration batch per step, batches in a seeded order; the optimizer is
:func:`~eqjax.methods.qat.default_optimizer` over ``iters`` steps (Adam per kind, warmup, cosine decay).
Per block the output error over every calibration batch is measured before and after training; with
``keep_better`` (default) the trained weights are kept only when they lower it. The block's training step
is compiled once and reused by every block that traces to the same program.

The result is ordinary QArrays (:func:`~eqjax.methods.qat.to_qarray`: the same format and bytes as the
QArrays it started from), typically followed by end-to-end training (:class:`~eqjax.methods.qat.QAT`): the
``+bqat+qat`` recipe suffixes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from eqjax.calibration.blockfit import shared_jit
from eqjax.calibration.calibrate import block_mse
from eqjax.core.errors import InputError, RecipeError
from eqjax.core.pytree import flatten_with_paths
from eqjax.methods.qat import FakeQuant, default_optimizer, fake_value, to_qarray, trainable, trainable_paths
from eqjax.recipes.schema import step_kwargs

__all__ = ["BlockQAT"]

log = logging.getLogger("eqjax")


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _sq_err(outs: list[Any], ref: list[Any], which: list[int]) -> jax.Array:
    """Sum of squared differences over the outputs ``which`` (float32)."""
    return sum(jnp.sum(jnp.square(outs[i].astype(jnp.float32) - ref[i].astype(jnp.float32))) for i in which)


@dataclasses.dataclass(frozen=True)
class BlockQAT:
    """Block-wise training of a quantized model's QArrays against the float blocks (see the module docs).

    Attributes:
      iters: optimizer steps per block (one calibration batch each).
      lr_scale, lr_weight, warmup: :func:`~eqjax.methods.qat.default_optimizer` (grid units).
      advance: ``"new"`` (quantized inputs) or ``"original"`` (float inputs).
      keep_better: keep a block's trained weights only if they lower its output error on the calibration set.
      seed: batch order.
    """

    iters: int = 8
    lr_scale: float = 1e-2
    lr_weight: float = 1e-2
    warmup: float = 0.05
    advance: str = "new"
    keep_better: bool = True
    seed: int = 0
    name: str = "bqat"
    needs_calibration = True

    def __post_init__(self) -> None:
        if isinstance(self.iters, bool) or not isinstance(self.iters, int) or self.iters < 0:
            raise ValueError(f"bqat: iters must be an int >= 0, got {self.iters!r}")
        if not self.lr_scale >= 0 or not self.lr_weight >= 0 or not 0 <= self.warmup < 1:
            raise ValueError("bqat: lr_scale >= 0, lr_weight >= 0 and 0 <= warmup < 1 required")
        if self.advance not in ("new", "original"):
            raise ValueError(f"bqat: advance must be 'new' or 'original', got {self.advance!r}")

    @classmethod
    def from_config(cls, d: Mapping[str, Any]) -> "BlockQAT":
        return cls(**step_kwargs(cls, d, "bqat", exclude=()))

    def __call__(self, params: Mapping[str, Any], ctx: Any) -> dict[str, Any]:
        if ctx.fn is None or not ctx.batches:
            raise RecipeError(f"step {self.name!r} trains on the model's blocks: it needs the model and "
                              "calibration batches (model=, calibration=)")
        targets = set(trainable_paths(params))  # refuses a leaf quantized another way, naming it
        cal = ctx.calibrator(self.name)
        paths, leaves, _ = flatten_with_paths(ctx.template)
        original = dict(zip(paths, leaves))
        rng = np.random.default_rng(self.seed + int(getattr(ctx, "seed", 0)))
        tx = default_optimizer(max(self.iters, 1), lr_scale=self.lr_scale, lr_weight=self.lr_weight,
                               warmup=self.warmup)
        blocks: dict[str, dict[str, Any]] = {}
        object.__setattr__(self, "blocks", blocks)  # per-block figures, for reports; not part of the hash
        t_start = time.perf_counter()

        def per_block(bc: Any, p: dict[str, Any]) -> dict[str, Any]:
            weights = tuple(dict.fromkeys(u.path for u in bc.uses if u.path in targets))
            if not weights:
                return p
            t0 = time.perf_counter()
            out, info = self._block(bc, p, trainable({w: p[w] for w in weights})[0], original, tx, rng)
            info["seconds"] = time.perf_counter() - t0
            blocks[bc.name] = info
            log.info("%s %s: block output error %.4g -> %.4g (%d steps, %.1fs)", self.name, bc.name, info["mse_init"],
                     info["mse_trained"], info["iters"], info["seconds"])
            return out

        out = cal.run_blocks(params, per_block, advance=self.advance, progress=ctx.progress, desc=self.name)
        ratios = [b["mse_trained"] / b["mse_init"] for b in blocks.values() if b["mse_init"] > 0]
        object.__setattr__(self, "report", {  # a summary, for reports; not part of the hash
            "iters": self.iters, "blocks": len(blocks), "kept": sum(b["kept"] for b in blocks.values()),
            "mse_ratio_median": float(np.median(ratios)) if ratios else 1.0, "lr_scale": self.lr_scale,
            "lr_weight": self.lr_weight, "seconds": time.perf_counter() - t_start})
        for name, info in blocks.items():
            ctx.report.append((name, f"{self.name}: block output error {info['mse_init']:.4g} -> "
                                     f"{info['mse_trained']:.4g} ({info['iters']} steps, "
                                     f"{'kept' if info['kept'] else 'not kept'})"))
        return out

    def _block(self, bc: Any, p: dict[str, Any], start: dict[str, FakeQuant], original: Mapping[str, Any],
               tx: optax.GradientTransformation, rng: np.random.Generator) -> tuple[dict[str, Any], dict]:
        paths = bc.param_paths()
        missing = [k for k in paths if k not in original]
        if missing:
            raise InputError(f"{self.name} ({bc.name}): the float params the recipe started from have no "
                             f"{missing[0]!r}; block-wise training needs the float block as its teacher")
        teacher = bc.outputs({**p, **{k: original[k] for k in paths}})
        inputs = bc.inputs()
        floats = [i for i, o in enumerate(teacher[0]) if _is_float(o)]
        fn = bc.function()
        frozen = {k: p[k] for k in paths if k not in start}
        per_batch = sum(int(np.prod(teacher[0][i].shape)) for i in floats)

        def run(train, ins):
            return fn({**frozen, **{w: fake_value(f) for w, f in train.items()}}, ins)

        def loss_fn(train, ins, ref):
            return _sq_err(run(train, ins), ref, floats) / per_batch

        def step(state, ins, ref):
            train, opt = state
            loss, grads = jax.value_and_grad(loss_fn)(train, ins, ref)
            updates, opt = tx.update(grads, opt, train)
            train = optax.apply_updates(train, updates)
            train = {w: dataclasses.replace(f, scale=jnp.maximum(f.scale, 1e-6)) for w, f in train.items()}
            return (train, opt), loss

        t_err = time.perf_counter()
        mse0 = block_mse(bc.outputs(p), teacher)
        t_err = time.perf_counter() - t_err
        info: dict[str, Any] = {"mse_init": mse0, "mse_trained": mse0, "iters": 0, "kept": False, "error_seconds": t_err}
        if self.iters == 0:
            return p, info
        state = (start, tx.init(start))
        step_c = shared_jit(step)
        order: list[int] = []
        t_train = time.perf_counter()
        for _ in range(self.iters):
            if not order:
                order = list(rng.permutation(len(inputs)))
            i = order.pop()
            state, loss = step_c(state, inputs[i], teacher[i])
        new = {**p, **{w: to_qarray(f, w) for w, f in state[0].items()}}
        mse1 = block_mse(bc.outputs(new), teacher)
        kept = mse1 < mse0 or not self.keep_better
        info.update(mse_trained=mse1, iters=self.iters, kept=kept, loss_last=float(loss),
                    train_seconds=time.perf_counter() - t_train)
        return (new if kept else p), info
