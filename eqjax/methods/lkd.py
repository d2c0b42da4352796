"""ZeroQuant with layer-by-layer knowledge distillation (LKD).

ZeroQuant quantizes weights group-wise (groups along the input axis) and activations token-wise
(dynamic int8). LKD then trains each block, one at a time, to match the float teacher:

* the teacher is the float block; its input is the float model's hidden states (the streaming
  calibration advances with the *original* params), its output the target;
* the student is the same block with every linear's weight and input fake-quantized
  (:func:`eqjax.numerics.fake_quantize` with ``straight_through=True``, so rounding passes the
  gradient unchanged), trained with Adam (optax) on the block-output MSE, ``steps`` steps of
  ``micro_batch`` calibration windows;
* the trained float weights are then quantized with the same spec (round to nearest) into
  :class:`~eqjax.linear.ActQuantKernel` s. Per block, the real quantized output error with and
  without the training is measured on all calibration windows and the better params kept, so LKD
  never makes a block worse on the calibration set.

The student's fake quantization is injected by swapping the ``linear`` function the model modules
imported while (and only while) the training step is traced, the same mechanism
:mod:`eqjax.calibrate` uses to capture linear inputs; the models need no hook for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import time
from typing import Any, Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from eqjax.calibrate import run_layerwise
from eqjax.numerics import QuantSpec, fake_quantize
from eqjax.pytree import Params
from eqjax.methods.rtn import quantize_by_rules, zeroquant_rule
from eqjax.qarray import per_channel
from eqjax.recipe import RecipeError
from eqjax.rules import Rule

__all__ = ["ZeroQuantLKD", "zeroquant_rule", "fake_quant_linears"]

log = logging.getLogger("eqjax")


def _real_linear() -> Callable:
    return sys.modules["eqjax.linear"].linear


def _ste(x: jax.Array, spec: QuantSpec) -> jax.Array:
    """Straight-through fake quantization: forward ``fake_quantize(x)``, gradient identity.

    Same as ``fake_quantize(x, spec, straight_through=True)``, but the range is computed on
    ``stop_gradient(x)``: float16 scales are rounded with ``nextafter``, which has no JVP rule.
    """
    xs = jax.lax.stop_gradient(x)
    return x + jax.lax.stop_gradient(fake_quantize(xs, spec) - xs)


@contextlib.contextmanager
def fake_quant_linears(weight: QuantSpec, act_bits: int | None) -> Iterator[None]:
    """While active, every float linear in the model modules runs with STE fake-quantized
    weights (``weight``) and per-token fake-quantized inputs (``act_bits``; None = float inputs).

    Only meant to be active while a function is *traced* (the jitted result keeps the behaviour).
    """
    real = _real_linear()
    modules = [
        m for name, m in list(sys.modules.items())
        if m is not None and name.startswith("eqjax.models") and getattr(m, "linear", None) is real
    ]
    act = None if act_bits is None else QuantSpec(act_bits, True, per_channel(0), "absmax")

    def fq_linear(x: jax.Array, layer: Mapping[str, Any], **kw: Any) -> jax.Array:
        k = layer.get("kernel") if isinstance(layer, Mapping) else None
        if k is None or not hasattr(k, "dtype") or not jnp.issubdtype(k.dtype, jnp.floating):
            return real(x, layer, **kw)
        x2 = x.reshape(-1, x.shape[-1])
        if act is not None:
            x2 = _ste(x2, act)
        w = _ste(k, weight)
        y = jnp.matmul(x2, w.astype(x2.dtype))
        if layer.get("bias") is not None:
            y = y + layer["bias"].astype(y.dtype)
        return y.astype(x.dtype).reshape(x.shape[:-1] + (k.shape[1],))

    for m in modules:
        m.linear = fq_linear
    try:
        yield
    finally:
        for m in modules:
            m.linear = real


@dataclasses.dataclass(frozen=True)
class ZeroQuantLKD:
    """ZeroQuant W{bits} group-wise + A{act_bits} per token, with layer-by-layer distillation.

    Attributes:
      bits: weight bits (8 or 4 typically); group_size: group along the input axis.
      act_bits: activation bits (dynamic per token).
      steps: Adam steps per block (0 = plain ZeroQuant, no distillation).
      lr: Adam learning rate.
      micro_batch: calibration windows per step.
      train_norms: also train the block's norm scales/biases (ZeroQuant trains the whole layer).
      keep_better: per block, keep the untrained params when training did not lower the quantized
        block-output MSE on the calibration windows.
      batch_size: windows per jitted forward call (statistics, outputs).
    """

    bits: int = 8
    group_size: int = 64
    act_bits: int = 8
    steps: int = 100
    lr: float = 5e-5
    micro_batch: int = 2
    train_norms: bool = True
    keep_better: bool = True
    batch_size: int = 8
    name: str = "zeroquant_lkd"
    needs_calibration = True

    def __post_init__(self) -> None:
        if self.steps < 0 or self.micro_batch < 1 or self.lr <= 0:
            raise ValueError("ZeroQuantLKD needs steps >= 0, micro_batch >= 1 and lr > 0")

    @classmethod
    def from_config(cls, d: Mapping[str, Any]) -> "ZeroQuantLKD":
        from eqjax.recipe import step_kwargs  # noqa: PLC0415

        return cls(**step_kwargs(cls, d, "zeroquant_lkd"))

    @property
    def rule(self) -> Rule:
        return zeroquant_rule(self.bits, self.group_size, self.act_bits)

    def __call__(self, params: Params, ctx: Any) -> Params:
        ctx.require_calibration(self.name)

        model, rule = ctx.model, self.rule
        rng = np.random.default_rng(ctx.seed)
        report: dict[str, dict[str, float]] = {}
        object.__setattr__(self, "report", report)  # per-block MSEs, for reports; not part of the hash

        def per_layer(name: str, lp: Params, cal: Any) -> Params:
            for path, leaf in jax.tree_util.tree_flatten_with_path(lp)[0]:
                if not jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.floating):
                    raise RecipeError(f"{name}: ZeroQuantLKD needs float params, found {jax.tree_util.keystr(path)}")
            t0 = time.perf_counter()
            teacher = cal.outputs(lp)
            if not bool(jnp.all(jnp.isfinite(teacher))):
                raise RecipeError(f"{name}: NaN/Inf in the float block's outputs on the calibration windows")
            q0 = quantize_by_rules(lp, (rule,), warn_unused=False)
            mse0 = float(jnp.mean(jnp.square(cal.outputs(q0) - teacher)))
            if self.steps == 0:
                report[name] = {"mse_rtn": mse0}
                return q0
            trained = self._train(model, cal, lp, teacher, rule, rng)
            q1 = quantize_by_rules(trained, (rule,), warn_unused=False)
            mse1 = float(jnp.mean(jnp.square(cal.outputs(q1) - teacher)))
            report[name] = {"mse_rtn": mse0, "mse_lkd": mse1, "seconds": time.perf_counter() - t0}
            log.info("lkd %s: block mse %.3e -> %.3e (%.1fs)", name, mse0, mse1, time.perf_counter() - t0)
            if self.keep_better and not mse1 < mse0:
                return q0
            return q1

        return run_layerwise(
            model, params, ctx.calibration, per_layer, batch_size=self.batch_size, progress=ctx.progress,
            advance="original", desc=self.name,
        )

    def _train(self, model: Any, cal: Any, lp: Params, teacher: jax.Array, rule: Rule, rng: np.random.Generator) -> Params:
        """Adam on the block-output MSE of the fake-quantized student; returns trained float params."""
        labels = jax.tree_util.tree_map_with_path(
            lambda p, _: "train" if self.train_norms or jax.tree_util.keystr(p).endswith("['kernel']") else "freeze", lp
        )
        opt = optax.multi_transform({"train": optax.adam(self.lr), "freeze": optax.set_to_zero()}, labels)
        i, wspec, abits = cal.layer_index, rule.weight, rule.act_bits

        def loss_fn(p: Params, h: jax.Array, y: jax.Array) -> jax.Array:
            pos = model.positions(h.shape[0], h.shape[1])
            with fake_quant_linears(wspec, abits):  # active while tracing only
                out, _ = model.block(p, h, pos, layer_index=i)
            return jnp.mean(jnp.square(out.astype(jnp.float32) - y.astype(jnp.float32)))

        @jax.jit
        def step(p, state, h, y):
            loss, g = jax.value_and_grad(loss_fn)(p, h, y)
            upd, state = opt.update(g, state, p)
            return optax.apply_updates(p, upd), state, loss

        p, state = lp, opt.init(lp)
        n = cal.n_windows
        mb = min(self.micro_batch, n)
        for _ in range(self.steps):
            idx = np.sort(rng.choice(n, mb, replace=False))
            p, state, _loss = step(p, state, cal.inputs[idx], teacher[idx])
        return p
