"""ZeroQuant with layer-by-layer knowledge distillation (LKD).

ZeroQuant quantizes weights group-wise (groups along the input) and activations token-wise (dynamic
int8). LKD then trains each block, one at a time, to match the float teacher:

* the teacher is the float block; its input is the float model's values entering the block (the
  calibration advances with the *original* params), its outputs the target;
* the student is the same block with every matmul weight and its input fake-quantized with a
  straight-through estimator (rounding passes the gradient unchanged), trained with Adam (optax) on
  the block-output MSE, ``steps`` steps of ``micro_batch`` calibration batches;
* the trained float weights are then quantized with the same rule (round to nearest) into
  :class:`~eqjax.core.qarray.ActQuantKernel` s. Per block, the real quantized output error with and
  without the training is measured on all calibration batches and the better params kept, so LKD
  never makes a block worse on the calibration set.

The student's fake quantization is a dot hook of the program interpreter
(:func:`eqjax.core.interpret.run`): the model is neither patched nor rewritten.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from eqjax.calibration.blockfit import StepBudget, share_budget, shared_jit
from eqjax.calibration.calibrate import block_mse
from eqjax.core.analysis import WeightUse
from eqjax.core.errors import RecipeError
from eqjax.core.linear import quantize_activations
from eqjax.core.numerics import QuantSpec, fake_quantize
from eqjax.core.qarray import is_quantized
from eqjax.methods.rtn import concrete_spec, quantize_by_rules, zeroquant_rule
from eqjax.recipes.rules import Rule
from eqjax.recipes.schema import step_kwargs

__all__ = ["ZeroQuantLKD", "zeroquant_rule", "fake_quant_hook"]

log = logging.getLogger("eqjax")


def _ste(x: jax.Array, fq: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Straight-through: forward ``fq(x)``, gradient identity (the range is taken on ``stop_gradient(x)``:
    float16 scales are rounded with ``nextafter``, which has no JVP rule)."""
    xs = jax.lax.stop_gradient(x)
    return x + jax.lax.stop_gradient(fq(xs) - xs)


def _fake_quant_tokens(x: jax.Array, use: WeightUse, bits: int) -> jax.Array:
    """Per-token fake quantization of an activation over its contracted axes: exactly the activation
    quantization of eqjax's W8A8 matmul (:func:`eqjax.core.linear.quantize_activations` on the rows)."""
    others = tuple(a for a in range(x.ndim) if a not in use.x_contracting)
    perm = others + tuple(use.x_contracting)
    xt = jnp.transpose(x, perm)
    q, s = quantize_activations(xt.reshape(-1, use.k), bits, "token")
    back = (q.astype(jnp.float32) * s).reshape(xt.shape)
    return jnp.transpose(back, np.argsort(perm)).astype(x.dtype)


def fake_quant_hook(specs: Mapping[str, QuantSpec], act_bits: int | None) -> Callable:
    """A dot hook: weights in ``specs`` (by path, concrete granularities) and their inputs
    (``act_bits`` per token; None = float) fake-quantized with straight-through gradients."""

    def hook(use: WeightUse, x: Any, w: Any, default: Callable) -> Any:
        spec = specs.get(use.path)
        if spec is None or is_quantized(w):
            return default(x, w)
        if act_bits is not None:
            x = _ste(x, lambda t: _fake_quant_tokens(t, use, act_bits))
        return default(x, _ste(w, lambda t: fake_quantize(t, spec)))

    return hook


@dataclasses.dataclass(frozen=True)
class ZeroQuantLKD:
    """ZeroQuant W{bits} group-wise + A{act_bits} per token, with layer-by-layer distillation.

    Attributes:
      bits: weight bits (8 or 4 typically); group_size: group along the input.
      act_bits: activation bits (dynamic per token).
      steps: Adam steps per block (0 = plain ZeroQuant, no distillation).
      lr: Adam learning rate.
      micro_batch: calibration batches per step.
      train_norms: also train the block's other float params (norm scales, biases).
      keep_better: per block, keep the untrained params when training did not lower the quantized
        block-output MSE on the calibration batches.
      time_budget: seconds of training for the whole step (None: no limit): each block gets the time
        left divided by the blocks left, and fewer than ``steps`` steps when that runs out
        (:class:`eqjax.calibration.blockfit.StepBudget`).
    """

    bits: int = 8
    group_size: int = 64
    act_bits: int = 8
    steps: int = 100
    lr: float = 5e-5
    micro_batch: int = 1
    train_norms: bool = True
    keep_better: bool = True
    time_budget: float | None = None
    name: str = "zeroquant_lkd"
    needs_calibration = True
    advance = "original"  # block inputs: see eqjax.calibration.calibrate.Calibrator.run_blocks

    def __post_init__(self) -> None:
        if self.steps < 0 or self.micro_batch < 1 or self.lr <= 0:
            raise ValueError("ZeroQuantLKD needs steps >= 0, micro_batch >= 1 and lr > 0")
        if self.time_budget is not None and not self.time_budget > 0:
            raise ValueError("zeroquant_lkd: time_budget must be > 0 seconds (or None)")

    @classmethod
    def from_config(cls, d: Mapping[str, Any]) -> "ZeroQuantLKD":

        return cls(**step_kwargs(cls, d, "zeroquant_lkd", exclude=()))

    @property
    def rule(self) -> Rule:
        return zeroquant_rule(self.bits, self.group_size, self.act_bits)

    def __call__(self, params: Mapping[str, Any], ctx: Any) -> dict[str, Any]:
        cal = ctx.calibrator(self.name)
        an = cal.analysis
        rng = np.random.default_rng(ctx.seed)
        report: dict[str, dict[str, float]] = {}
        object.__setattr__(self, "report", report)  # per-block MSEs, for reports; not part of the hash
        t_start = time.perf_counter()
        n_blocks = sum(1 for b in cal.blocks if any(an.roles[u.path].kind == "matmul" for u in b.uses))
        done = [0]

        def per_block(bc: Any, p: dict[str, Any]) -> dict[str, Any]:
            t0 = time.perf_counter()
            weights = tuple(dict.fromkeys(u.path for u in bc.uses if not is_quantized(p[u.path])
                                          and an.roles[u.path].kind == "matmul"))
            if not weights:
                return p
            rule = dataclasses.replace(self.rule, pattern="|".join(re.escape(w) for w in weights))
            specs = {w: concrete_spec(rule.weight, an, w, tuple(p[w].shape)) for w in weights}
            teacher = bc.outputs(p)
            if not all(bool(jnp.all(jnp.isfinite(o))) for t in teacher for o in t if _is_float(o)):
                raise RecipeError(f"{bc.name}: NaN/Inf in the float block's outputs on the calibration data")
            q0 = quantize_by_rules(p, (rule,), ctx, warn_unused=False, step=self.name, report=False)
            mse0 = block_mse(bc.outputs(q0), teacher)
            if self.steps == 0:
                report[bc.name] = {"mse_rtn": mse0}
                return q0
            clock = StepBudget(self.steps, share_budget(self.time_budget, t_start, n_blocks - done[0]))
            done[0] += 1
            if clock.exhausted:
                report[bc.name] = {"mse_rtn": mse0, "steps": 0}
                return q0
            trained, steps = self._train(bc, p, teacher, specs, weights, rng, clock)
            q1 = quantize_by_rules(trained, (rule,), ctx, warn_unused=False, step=self.name, report=False)
            mse1 = block_mse(bc.outputs(q1), teacher)
            report[bc.name] = {"mse_rtn": mse0, "mse_lkd": mse1, "steps": steps, "seconds": time.perf_counter() - t0}
            log.info("lkd %s: block mse %.3e -> %.3e (%d steps, %.1fs)", bc.name, mse0, mse1, steps,
                     time.perf_counter() - t0)
            if self.keep_better and not mse1 < mse0:
                return q0
            return q1

        out = cal.run_blocks(params, per_block, advance=self.advance, progress=ctx.progress, desc=self.name)
        for path, leaf in out.items():
            if is_quantized(leaf) and not is_quantized(params[path]):
                ctx.report.append((path, f"{self.name}: int{self.bits} group {self.group_size} + A{self.act_bits}"))
        return out

    def _train(self, bc: Any, p: dict[str, Any], teacher: list[list[Any]], specs: Mapping[str, QuantSpec],
               weights: tuple[str, ...], rng: np.random.Generator, clock: StepBudget) -> tuple[dict[str, Any], int]:
        """Adam on the block-output MSE of the fake-quantized student; returns the trained float
        params and the number of steps taken."""
        fn = bc.function(fake_quant_hook(specs, self.act_bits))
        paths = bc.param_paths()
        train = [q for q in paths if q in weights or (self.train_norms and _is_float(p[q]) and not is_quantized(p[q]))]
        frozen = {q: p[q] for q in paths if q not in train}
        opt = optax.adam(self.lr)

        def loss_fn(tp, ins_list, targets_list):
            total = 0.0
            for ins, targets in zip(ins_list, targets_list):
                outs = fn({**frozen, **tp}, ins)
                for o, t in zip(outs, targets):
                    if _is_float(o):
                        total = total + jnp.mean(jnp.square(o.astype(jnp.float32) - t.astype(jnp.float32)))
            return total / len(ins_list)

        def step(tp, state, ins_list, targets_list):
            loss, g = jax.value_and_grad(loss_fn)(tp, ins_list, targets_list)
            upd, state = opt.update(g, state, tp)
            return optax.apply_updates(tp, upd), state, loss

        step_c = shared_jit(step)  # one executable for every block that traces to the same program
        tp = {q: p[q] for q in train}
        state = opt.init(tp)
        inputs = bc.inputs()
        n = len(inputs)
        mb = min(self.micro_batch, n)
        steps, it = self.steps, 0
        while it < steps:
            idx = np.sort(rng.choice(n, mb, replace=False))
            tp, state, loss = step_c(tp, state, [inputs[i] for i in idx], [teacher[i] for i in idx])
            it += 1
            steps = clock.after(it, loss)
        return {**p, **tp}, it


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


