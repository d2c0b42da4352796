"""Quantization-aware training (QAT): learned scales, zero points and weights of a quantized model.

Starting from a quantized param tree (any recipe's :class:`~eqjax.core.qarray.QArray` s: RTN, GPTQ, AWQ,
SignRound), every QArray becomes a :class:`FakeQuant`. Its parameters are in units of the QArray's own
grid, the starting scale ``u`` of each block (a constant): a latent weight ``v`` (float weight ``w = v * u``;
it starts at the integer codes, so training starts from exactly the quantized model), a relative scale ``r``
(scale ``s = r * u``; it starts at 1) and (asymmetric) a zero point ``z`` (codes). The model runs with each
such weight replaced by

    ``w_hat = (clip(round(w / s') + z', 0, 2**b - 1) - z') * s'``   (symmetric: ``clip(round(w / s'), lo, hi) * s'``)

with ``s'`` the nearest value of the QArray's scale dtype and ``z' = clip(round(z), 0, 2**b - 1)``. Every
rounding passes its gradient straight through, so the scale gets the LSQ gradient (Esser et al., 2020):
``round(w / s) - w / s`` inside the range, the clipped integer outside; the weight gets the identity inside
the range and 0 where it is clipped. Grid units make one learning rate mean the same for every layer, model
and width: a weight step of 0.01 is a hundredth of its quantization step, a scale step of 0.01 one percent.
The layout (groups along a flattened multi-axis contraction, per channel, per tensor) is the QArray's own
granularity, so a recipe trains the same whatever the weight's layout.

:func:`export` gives back QArrays with the scale, zero point and codes the forward used: their dequantized
values equal the trained forward's weights bit for bit, and every runner and exporter takes them (no
separate QAT format).

Loss: :func:`kl_to_teacher` (distillation from the float model's logits) or the caller's own. The
optimizer is any optax transformation; :func:`leaf_kind` names each leaf (``"weight"``, ``"scale"``,
``"zero"``, and ``"unit"``: the constant grid unit, which gets no gradient and must get no update, so no weight
decay on it); :func:`default_optimizer` is Adam per kind with warmup and cosine decay (weights frozen at
``lr_weight=0``, EfficientQAT's end-to-end stage).

The recipe step :class:`QAT` trains the whole model this way after the recipe's post-training steps, on
the calibration batches (a token budget), with the float params the recipe started from as the teacher.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import pathlib
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from eqjax.calibration.train import fit
from eqjax.core.errors import InputError, RecipeError
from eqjax.core.numerics import (
    expand_grid,
    fake_quantize_grid,
    integer_values,
    nearest_scale,
    quantize_with,
    round_ste,
    widen_halves,
)
from eqjax.core.qarray import Granularity, QArray, is_quantized, validate
from eqjax.recipes.schema import step_kwargs
from eqjax.recipes.types import with_paths

__all__ = ["FakeQuant", "from_qarray", "fake_value", "to_qarray", "trainable", "trainable_paths", "fake_params", "export",
           "default_optimizer", "leaf_kind", "kl_to_teacher", "rebatch", "logits_of", "distillation_step", "QAT"]

log = logging.getLogger("eqjax")


@dataclasses.dataclass(frozen=True)
class FakeQuant:
    """A quantized weight in training (a pytree: ``weight``, ``scale``, ``zero``, ``unit`` are its leaves).

    Attributes:
      weight: latent float32 weight in grid units (the float weight is ``weight * unit`` per block), the
        QArray's logical shape.
      scale: float32 relative scale (the scale is ``scale * unit``, used as ``scale_dtype``),
        :func:`~eqjax.core.qarray.scale_shape` of ``granularity``; > 0.
      zero: float32 zero point (codes) of ``scale``'s shape (used rounded), None for a symmetric grid.
      unit: float32 grid unit (the starting scale) of ``scale``'s shape, > 0; a constant (no gradient).
      bits, granularity, dtype, scale_dtype: the QArray's format (static).
    """

    weight: jax.Array
    scale: jax.Array
    zero: jax.Array | None
    unit: jax.Array
    bits: int
    granularity: Granularity
    dtype: Any
    scale_dtype: Any

    @property
    def symmetric(self) -> bool:
        return self.zero is None


jax.tree_util.register_dataclass(FakeQuant, data_fields=["weight", "scale", "zero", "unit"],
                                 meta_fields=["bits", "granularity", "dtype", "scale_dtype"])


def _is_fq(x: Any) -> bool:
    return isinstance(x, FakeQuant)


def from_qarray(q: QArray) -> FakeQuant:
    """The :class:`FakeQuant` whose forward value is ``dequantize(q)`` (latent weight = the integer codes)."""
    zero = None if q.symmetric else jnp.asarray(q.zero_point, jnp.float32)
    unit = jnp.asarray(q.scale, jnp.float32)
    return FakeQuant(integer_values(q).astype(jnp.float32), jnp.ones_like(unit), zero, unit, q.bits,
                     q.granularity, jnp.dtype(q.dtype), jnp.dtype(q.scale.dtype))


def float_weight(fq: FakeQuant) -> jax.Array:
    """The latent float32 weight ``weight * unit`` (differentiable in ``weight`` only)."""
    unit = jax.lax.stop_gradient(fq.unit)
    return fq.weight * expand_grid(unit, fq.granularity, fq.weight.shape)


def _grid(fq: FakeQuant) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """The float32 scale, the scale (in its stored dtype) and the integer zero point the forward and
    :func:`to_qarray` use."""
    s = fq.scale * jax.lax.stop_gradient(fq.unit)
    z = None if fq.zero is None else jnp.clip(jnp.round(fq.zero), 0, 2**fq.bits - 1)
    return s, nearest_scale(s, fq.scale_dtype), z


def fake_value(fq: FakeQuant) -> jax.Array:
    """The weight the model runs with (``fq.dtype``), differentiable in ``weight``, ``scale`` and ``zero``."""
    s, s_used, _ = _grid(fq)
    s = s + jax.lax.stop_gradient(s_used.astype(jnp.float32) - s)
    z = None if fq.zero is None else jnp.clip(round_ste(fq.zero), 0, 2**fq.bits - 1)
    return fake_quantize_grid(float_weight(fq), s, z, bits=fq.bits, granularity=fq.granularity).astype(fq.dtype)


def to_qarray(fq: FakeQuant, name: str = "weight") -> QArray:
    """The QArray of ``fq``: ``dequantize(to_qarray(fq)) == fake_value(fq)`` bit for bit."""
    _, s, z = _grid(fq)
    zp = None if z is None else z.astype(jnp.int32)
    q = quantize_with(float_weight(fq), s, zp, bits=fq.bits, granularity=fq.granularity, name=name)
    return validate(dataclasses.replace(q, dtype=fq.dtype), name=name)


def trainable_paths(qparams: Mapping[str, Any]) -> list[str]:
    """The paths of the QArrays QAT trains, in order; a leaf quantized another way (an activation-quantized or
    rotated kernel) or no QArray at all is an :class:`InputError` naming it: QAT trains weight-only QArrays."""
    paths = []
    for path, x in qparams.items():
        if isinstance(x, QArray):
            paths.append(path)
        elif is_quantized(x) and type(x).__name__ != "HalfFloat":
            raise InputError(f"quantization-aware training ({path}): expected a weight-only QArray or a float "
                             f"param, found a {type(x).__name__} (QAT trains weight-only recipes)")
    if not paths:
        raise InputError("quantization-aware training: expected quantized params (QArrays from a recipe), "
                         "found none; quantize first (e.g. w4g128-rtn or w4g128-gptq)")
    return paths


def trainable(qparams: Mapping[str, Any]) -> tuple[dict[str, FakeQuant], dict[str, Any]]:
    """Split params by path into ``(FakeQuant of every QArray, every other leaf)`` (refusals:
    :func:`trainable_paths`)."""
    train = {p: from_qarray(qparams[p]) for p in trainable_paths(qparams)}
    return train, {p: x for p, x in qparams.items() if p not in train}


def fake_params(train: Mapping[str, FakeQuant], frozen: Mapping[str, Any], template: Any) -> Any:
    """The float param tree (``template``'s structure) the model runs with."""
    flat = {**widen_halves(dict(frozen)), **{p: fake_value(f) for p, f in train.items()}}
    return with_paths(template, flat)


def export(train: Mapping[str, FakeQuant]) -> dict[str, QArray]:
    """QArrays of the trained weights, by path."""
    return {p: to_qarray(f, p) for p, f in train.items()}


_KINDS = ("weight", "scale", "zero", "unit")


def leaf_kind(keypath: tuple[Any, ...]) -> str:
    """``"weight"``, ``"scale"``, ``"zero"`` or ``"unit"``: what a leaf is, from its key path (a
    :class:`FakeQuant` field, or a leaf under ``qat_grids`` of an NNX module in training)."""
    names = [str(getattr(k, "name", getattr(k, "key", k))) for k in keypath]
    for k in keypath:
        if isinstance(k, jax.tree_util.GetAttrKey) and k.name in _KINDS:
            return k.name
    if "qat_grids" in names and names[-1] in _KINDS:
        return names[-1]
    return "weight"


def default_optimizer(steps: int, *, lr_scale: float = 5e-3, lr_weight: float = 1e-3,
                      warmup: float = 0.05) -> optax.GradientTransformation:
    """Adam with learning rate ``lr_scale`` on the relative scales and ``lr_weight`` on the latent weights and
    zero points (grid units: see the module docs; 0 freezes them), each with a linear warmup over ``warmup``
    of the steps and a cosine decay to a tenth; grid units get no update. Leaves are told apart by
    :func:`leaf_kind` (a FakeQuant tree, or an NNX module's ``QatParam`` state)."""
    if not lr_scale >= 0 or not lr_weight >= 0:
        raise InputError(f"QAT learning rates (lr_scale={lr_scale}, lr_weight={lr_weight}): expected >= 0")
    n = max(int(steps), 2)
    w = min(max(int(warmup * n), 1), n - 1)

    rates = {"scale": optax.warmup_cosine_decay_schedule(0.0, lr_scale, w, n, end_value=lr_scale / 10),
             "weight": optax.warmup_cosine_decay_schedule(0.0, lr_weight, w, n, end_value=lr_weight / 10)}
    rates["zero"] = rates["weight"]
    rates["unit"] = optax.constant_schedule(0.0)

    def init(params: Any) -> optax.ScaleByScheduleState:
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update(updates: Any, state: optax.ScaleByScheduleState, params: Any = None) -> tuple[Any, Any]:
        lr = {k: f(state.count) for k, f in rates.items()}
        out = jax.tree_util.tree_map_with_path(lambda kp, u: -lr[leaf_kind(kp)] * u, updates)
        return out, optax.ScaleByScheduleState(count=state.count + 1)

    return optax.chain(optax.scale_by_adam(), optax.GradientTransformation(init, update))


def logits_of(out: Any) -> jax.Array:
    """The logits of a model's output: the output itself, its ``.logits`` (Hugging Face), or its first
    element (eqjax's models return ``(logits, cache)``)."""
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def kl_to_teacher(student: jax.Array, teacher: jax.Array, temperature: float = 1.0) -> jax.Array:
    """Mean over positions of ``KL(softmax(teacher / T) || softmax(student / T))`` (nats; last axis = classes)."""
    t = jax.nn.log_softmax(teacher.astype(jnp.float32) / temperature, axis=-1)
    s = jax.nn.log_softmax(student.astype(jnp.float32) / temperature, axis=-1)
    return jnp.mean(jnp.sum(jnp.exp(t) * (t - s), axis=-1))


def distillation_step(fn: Callable[..., Any], template: Any, tx: optax.GradientTransformation,
                      loss: Callable[..., jax.Array] | None = None) -> Callable:
    """A pure training step ``((train, opt_state), batch, frozen, teacher) -> ((train, opt_state), loss)``.

    ``fn(params, *batch)`` is the model's call; ``teacher`` the float params (None with a ``loss`` that
    needs no teacher). ``loss(student_out, teacher_out, batch)`` defaults to :func:`kl_to_teacher` on the
    logits. Scales are kept positive after each update."""

    def objective(train, batch, frozen, teacher):
        out = fn(fake_params(train, frozen, template), *batch)
        ref = None if teacher is None else jax.lax.stop_gradient(fn(teacher, *batch))
        if loss is not None:
            return loss(out, ref, batch)
        return kl_to_teacher(logits_of(out), logits_of(ref))

    def step(state, batch, frozen, teacher):
        train, opt_state = state
        value, grads = jax.value_and_grad(objective)(train, batch, frozen, teacher)
        updates, opt_state = tx.update(grads, opt_state, train)
        train = optax.apply_updates(train, updates)
        train = jax.tree.map(lambda f: dataclasses.replace(f, scale=jnp.maximum(f.scale, 1e-6)) if _is_fq(f) else f,
                             train, is_leaf=_is_fq)
        return (train, opt_state), value

    return step


def rebatch(batches: list[tuple[Any, ...]], rows: int) -> list[tuple[Any, ...]]:
    """``batches`` re-cut along axis 0 of every argument into batches of ``rows`` rows (0, or rows that do not
    divide the total: as given)."""
    total = sum(int(np.shape(b[0])[0]) for b in batches)
    if rows < 1 or total % rows or any(np.ndim(a) == 0 for a in batches[0]):
        return list(batches)
    joined = [np.concatenate([np.asarray(b[i]) for b in batches]) for i in range(len(batches[0]))]
    return [tuple(a[j:j + rows] for a in joined) for j in range(0, total, rows)]


def _tokens_of(batch: tuple[Any, ...]) -> int:
    return int(np.prod(np.shape(batch[0]))) if batch else 0


@dataclasses.dataclass(frozen=True)
class QAT:
    """End-to-end quantization-aware training of a quantized model (see the module docs).

    Attributes:
      tokens: training budget in tokens (elements of each batch's first argument: ``B x T`` token ids);
        steps = ceil(tokens / tokens per batch), cycling over the calibration batches.
      batch_size: rows (windows) per step: the calibration batches are re-cut into batches of this many
        rows (0: as given).
      lr_scale, lr_weight, warmup: :func:`default_optimizer`.
      checkpoint: directory for the training state (saved every ``save_every`` steps; a rerun resumes).
      seed: batch order.
    """

    tokens: int = 262144
    batch_size: int = 2
    lr_scale: float = 5e-3
    lr_weight: float = 1e-3
    warmup: float = 0.05
    checkpoint: str | None = None
    save_every: int = 50
    seed: int = 0
    name: str = "qat"
    needs_calibration = True
    end_to_end = True  # runs on the whole model: not unit by unit (eqjax.recipes.stream refuses it)

    def __post_init__(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 1:
            raise ValueError(f"qat: tokens must be an int >= 1, got {self.tokens!r}")
        if not self.lr_scale >= 0 or not self.lr_weight >= 0 or not 0 <= self.warmup < 1:
            raise ValueError("qat: lr_scale >= 0, lr_weight >= 0 and 0 <= warmup < 1 required")
        if self.save_every < 1 or self.batch_size < 0:
            raise ValueError("qat: save_every >= 1 and batch_size >= 0 required")

    @classmethod
    def from_config(cls, d: Mapping[str, Any]) -> "QAT":
        return cls(**step_kwargs(cls, d, "qat", exclude=()))

    def steps_for(self, batches: list[tuple[Any, ...]]) -> int:
        return max(1, math.ceil(self.tokens / max(1, _tokens_of(batches[0]))))

    def __call__(self, params: Mapping[str, Any], ctx: Any) -> dict[str, Any]:
        if ctx.fn is None or not ctx.batches:
            raise RecipeError(f"step {self.name!r} trains on the model's outputs: it needs the model and "
                              "calibration batches (model=, calibration=)")
        if getattr(ctx, "partial", False):
            raise RecipeError(f"step {self.name!r} trains the whole model end to end: it cannot run unit by unit")
        train, frozen = trainable(params)
        batches = rebatch(ctx.batches, self.batch_size)
        steps = self.steps_for(batches)
        tx = default_optimizer(steps, lr_scale=self.lr_scale, lr_weight=self.lr_weight, warmup=self.warmup)
        step = distillation_step(ctx.fn, ctx.template, tx)
        log.info("%s: %d steps over %d batches (%d tokens)", self.name, steps, len(batches),
                 steps * _tokens_of(batches[0]))
        run = fit(step, (train, tx.init(train)), batches, steps=steps, seed=self.seed + int(ctx.seed),
                  checkpoint=None if self.checkpoint is None else pathlib.Path(self.checkpoint),
                  save_every=self.save_every, consts=(frozen, ctx.template),
                  describe={k: v for k, v in dataclasses.asdict(self).items() if k not in ("checkpoint", "save_every")})
        out = dict(params)
        out.update(export(run.state[0]))
        report = {"steps": steps, "tokens": steps * _tokens_of(batches[0]), "first_step": run.first_step,
                  "seconds": run.seconds, "lr_weight": self.lr_weight, "lr_scale": self.lr_scale,
                  "loss_first": run.losses[0] if run.losses else float("nan"),
                  "loss_last": run.losses[-1] if run.losses else float("nan")}
        object.__setattr__(self, "report", report)  # figures for reports; not part of the hash
        for path in run.state[0]:
            ctx.report.append((path, f"{self.name}: trained {steps} steps (scale, zero point, weight)"))
        return out
