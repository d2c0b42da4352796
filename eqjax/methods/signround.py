"""Learned rounding (AutoRound / SignRound, Cheng et al., 2023): per block, train how each weight rounds.

For every float matmul weight ``W`` of a block (groups along the input, as the RTN / GPTQ recipes
store them) the block runs with ``W`` replaced by

    ``W_hat = s * (clip(round(W / s + V) + z, 0, Q) - z)``  (symmetric: ``clip(round(W / s + V))``)

where ``V`` (``W``'s shape, in ``[-1/2, 1/2]``) moves each weight to the other neighbouring code, and the
grid ``(s, z)`` comes from the initial grid's ends multiplied by learned factors (``alpha`` for the
lower end, ``beta`` for the upper end, per group, in ``[scale_min, scale_max]``; the zero point is
rounded with a straight-through gradient). The initial grid is min/max (``init="minmax"``) or the
searched grid of :mod:`eqjax.methods.grid` (``init="search"``, one extra statistics pass per block).
Per step, one calibration batch runs through the block (:meth:`eqjax.calibration.calibrate.BlockCalibration.function`
with the fake-quantized weights as params); the loss is the mean squared error against the float
block's outputs. ``V``, ``alpha`` and ``beta`` take signed-gradient steps (``optimizer="sign"``:
``p -= lr * sign(grad)``, ``lr`` decaying linearly to 0 over the block's iterations, AutoRound's
default ``lr = 1 / iters``) or Adam (``optimizer="adam"``), then are clipped to their ranges.

Block inputs (``advance``): ``"new"`` (default): the quantized previous blocks' outputs feed both the
student and the float teacher; ``"original"``: the float model's activations (ZeroQuant-LKD style).
Measured on SmolLM2-135M: see bench/results/quality.md.

``time_budget`` (seconds, whole step) caps the iterations: each block gets the time left divided by
the blocks left, and its iteration count (and so its learning-rate schedule) is fixed from the time of
its first steps. Per block the quantized block's output error on all calibration batches is measured
before (round to nearest on the initial grid) and after training; the better one is kept
(``keep_better``), so training never makes a block worse on the calibration set. The result is an
ordinary QArray (codes ``round(W / s + V)``, the stored scale and zero point): the same bytes as RTN.

Compilation: the blocks of a transformer trace to the same program; a training step (and the error
measurement) is compiled once and reused for every block whose traced program is identical.
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

from eqjax.calibration.blockfit import StepBudget, share_budget, shared_jit
from eqjax.calibration.statistics import xtx
from eqjax.core.numerics import (
    QuantSpec,
    _blocked,
    _to_view,
    _unblock,
    compute_range,
    fake_quantize_grid,
    nearest_scale,
    quantize_with,
    range_to_qparams,
    round_ste,
)
from eqjax.core.qarray import describe_granularity, is_quantized
from eqjax.methods.grid import grid_of_use, grids_to_param, place_grid
from eqjax.methods.rtn import concrete_spec, step_targets, weight_step_spec
from eqjax.recipes.rules import Rule
from eqjax.recipes.schema import step_kwargs

__all__ = ["SignRound"]

log = logging.getLogger("eqjax")


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _grid_from_factors(s0, z0, a, b, bits: int, symmetric: bool):
    """Scale and (float) zero point of the initial grid ``(s0, z0)`` with its ends scaled by ``a``, ``b``."""
    if symmetric:
        return s0 * b, None
    q = 2**bits - 1
    lo = -z0 * s0 * a
    hi = (q - z0) * s0 * b
    s = jnp.maximum((hi - lo) / q, 1e-12)
    z = jnp.clip(round_ste(-lo / s), 0, q)
    return s, z


@dataclasses.dataclass(frozen=True)
class SignRound:
    """Learned rounding and grid (AutoRound's SignRound) of the float matmul weights, block by block.

    Attributes:
      bits, group_size, symmetric, full_range, scale_dtype: the stored format (as GPTQ / RTN).
      iters: steps per block (one calibration batch each); lr: None = ``1 / iters``.
      optimizer: ``"sign"`` (signed gradient, linear decay) or ``"adam"``.
      learn_grid: also learn the grid's end factors (else only the rounding offsets).
      scale_min, scale_max: range of the end factors.
      init: ``"minmax"`` or ``"search"`` (searched grid, :mod:`eqjax.methods.grid`, ``H``-weighted).
      advance: ``"new"`` (quantized inputs, float teacher on them) or ``"original"`` (float inputs).
      time_budget: seconds for the whole step (None: no limit); keep_better: see the module docs.
    """

    bits: int = 4
    group_size: int | None = 128
    symmetric: bool = False
    full_range: bool = True
    scale_dtype: str | None = None
    iters: int = 200
    lr: float | None = None
    optimizer: str = "sign"
    learn_grid: bool = True
    scale_min: float = 0.5
    scale_max: float = 1.5
    init: str = "minmax"
    grid_weighting: str = "hessian"
    advance: str = "new"
    time_budget: float | None = None
    keep_better: bool = True
    seed: int = 0
    pattern: str = ".*"
    role: str = "matmul"
    name: str = "signround"
    needs_calibration = True

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 2 <= self.bits <= 8:
            raise ValueError(f"signround: bits must be an int in 2..8, got {self.bits!r}")
        if self.iters < 0 or (self.lr is not None and not self.lr > 0):
            raise ValueError("signround: iters >= 0 and lr > 0 required")
        if self.optimizer not in ("sign", "adam"):
            raise ValueError(f"signround: optimizer must be 'sign' or 'adam', got {self.optimizer!r}")
        if self.init not in ("minmax", "search"):
            raise ValueError(f"signround: init must be 'minmax' or 'search', got {self.init!r}")
        if self.advance not in ("new", "original"):
            raise ValueError(f"signround: advance must be 'new' or 'original', got {self.advance!r}")
        if not 0 < self.scale_min <= 1 <= self.scale_max:
            raise ValueError("signround: 0 < scale_min <= 1 <= scale_max required")
        if self.time_budget is not None and not self.time_budget > 0:
            raise ValueError("signround: time_budget must be > 0 seconds (or None)")
        self.spec()
        Rule(self.pattern, role=self.role)

    def spec(self) -> QuantSpec:
        """The stored format (:func:`eqjax.methods.rtn.weight_step_spec`)."""

        return weight_step_spec(self.bits, self.symmetric, self.group_size, self.scale_dtype, self.full_range)

    @classmethod
    def from_config(cls, d: Mapping[str, Any]) -> "SignRound":

        return cls(**step_kwargs(cls, d, "signround", exclude=()))

    # ---- the step --------------------------------------------------------------------------------
    def __call__(self, params: Mapping[str, Any], ctx: Any) -> dict[str, Any]:


        cal, targets = step_targets(self, params, ctx)
        if not targets:
            return dict(params)
        an = cal.analysis
        rng = np.random.default_rng(self.seed + int(getattr(ctx, "seed", 0)))
        report: dict[str, dict[str, float]] = {}
        object.__setattr__(self, "report", report)  # per-block figures, for reports; not part of the hash
        t_start = time.perf_counter()
        n_blocks = sum(1 for b in cal.blocks if any(u.path in targets for u in b.uses))
        done = [0]

        def per_block(bc: Any, p: dict[str, Any]) -> dict[str, Any]:
            weights = tuple(dict.fromkeys(u.path for u in bc.uses if u.path in targets and not is_quantized(p[u.path])))
            if not weights:
                return p
            t0 = time.perf_counter()
            specs = {w: concrete_spec(self.spec(), an, w, tuple(p[w].shape)) for w in weights}
            grids = self._initial_grids(bc, p, weights, specs, an)
            budget = share_budget(self.time_budget, t_start, n_blocks - done[0])
            q, info = self._block(bc, p, weights, specs, grids, rng, budget)
            done[0] += 1
            info["seconds"] = time.perf_counter() - t0
            report[bc.name] = info
            log.info("signround %s: block mse %.4g -> %.4g (%d iters, %.1fs)", bc.name, info["mse_init"],
                     info.get("mse_trained", float("nan")), info["iters"], info["seconds"])
            return q

        out = cal.run_blocks(params, per_block, advance=self.advance, progress=ctx.progress, desc=self.name)
        for path in targets:
            if is_quantized(out[path]):
                q = out[path]
                ctx.report.append((path, f"{self.name}: int{q.bits} {'sym' if q.symmetric else 'asym'} "
                                         f"{describe_granularity(q.granularity, q.shape)}, learned rounding"))
        return out

    def _initial_grids(self, bc: Any, p: dict[str, Any], weights: tuple[str, ...], specs: Mapping[str, QuantSpec],
                       an: Any) -> dict[str, tuple[jax.Array, jax.Array]]:
        """Per weight ``(scale float32, zero point float32)`` in the param's scale layout."""
        out = {}
        if self.init == "search":

            uses = [u for u in bc.uses if u.path in weights]
            stats = bc.statistics({"xtx": xtx()}, uses, p)
            parts: dict[str, list] = {}
            for u in uses:
                spec = specs[u.path]
                s, z = grid_of_use(p[u.path], u, stats[u.path]["xtx"], spec, weighting=self.grid_weighting)
                old = parts.get(u.path, [None, None])
                gran = spec.granularity
                parts[u.path] = [place_grid(old[0], grids_to_param(s, u, gran), u, gran),
                                 None if z is None else place_grid(old[1], grids_to_param(z, u, gran), u, gran)]
            for w in weights:
                s, z = parts[w]
                out[w] = (s.astype(jnp.float32), jnp.zeros_like(s, jnp.float32) if z is None else z.astype(jnp.float32))
            return out
        for w in weights:
            spec = specs[w]
            lo, hi = compute_range(jnp.asarray(p[w], jnp.float32), spec)
            s, z = range_to_qparams(lo, hi, spec.bits, spec.symmetric, spec.scale_dtype, spec.full_range)
            out[w] = (s.astype(jnp.float32), jnp.zeros_like(s, jnp.float32) if z is None else z.astype(jnp.float32))
        return out

    def _quantized(self, p: Mapping[str, Any], weights, specs, grids, tv) -> dict[str, Any]:
        """QArrays of the weights for trainables ``tv`` (None: round to nearest on the initial grid)."""
        out = dict(p)
        for w in weights:
            spec = specs[w]
            s0, z0 = grids[w]
            if tv is None:
                s, z, v = s0, (None if spec.symmetric else z0), 0.0
            else:
                a, b = tv[w]["a"], tv[w]["b"]
                s, z = _grid_from_factors(s0, z0, a, b, spec.bits, spec.symmetric)
                v = tv[w]["v"]
            stored = nearest_scale(s, spec.scale_dtype)
            s32 = stored.astype(jnp.float32)
            x = jnp.asarray(p[w], jnp.float32)
            if tv is not None:
                gran = spec.granularity.normalized(x.ndim)
                view, _ = _blocked(x, gran)
                x = _unblock(view + _blocked(v, gran)[0] * _to_view(s32, gran), gran, x.shape)
            zp = None if z is None else jnp.round(z).astype(jnp.int32)
            q = quantize_with(x, stored, zp, bits=spec.bits, granularity=spec.granularity, name=w)
            out[w] = dataclasses.replace(q, dtype=jnp.dtype(jnp.asarray(p[w]).dtype))
        return out

    def _block(self, bc: Any, p: dict[str, Any], weights, specs, grids, rng, budget) -> tuple[dict[str, Any], dict]:
        fn = bc.function()
        paths = bc.param_paths()
        frozen = {k: p[k] for k in paths if k not in weights}
        teacher = bc.outputs(p)
        inputs = bc.inputs()
        floats = [i for i, o in enumerate(teacher[0]) if _is_float(o)]

        def fq_params(tv):
            out = dict(frozen)
            for w in weights:
                spec = specs[w]
                s0, z0 = grids[w]
                a = tv[w]["a"] if self.learn_grid else jnp.ones_like(s0)
                b = tv[w]["b"] if self.learn_grid else jnp.ones_like(s0)
                s, z = _grid_from_factors(s0, z0, a, b, spec.bits, spec.symmetric)
                out[w] = fake_quantize_grid(jnp.asarray(p[w], jnp.float32), s, z, bits=spec.bits,
                                            granularity=spec.granularity, offset=tv[w]["v"]).astype(p[w].dtype)
            return out

        def loss_fn(tv, ins, targets):
            outs = fn(fq_params(tv), ins)
            total = 0.0
            for i in floats:
                total = total + jnp.mean(jnp.square(outs[i].astype(jnp.float32) - targets[i].astype(jnp.float32)))
            return total

        def mse_fn(qp, ins, targets):
            outs = fn(qp, ins)
            return sum(jnp.sum(jnp.square(outs[i].astype(jnp.float32) - targets[i].astype(jnp.float32))) for i in floats)

        n_el = sum(int(np.prod(teacher[0][i].shape)) for i in floats) * len(teacher)

        mse_c = shared_jit(mse_fn)

        def block_mse(qp):
            sub = {k: qp[k] for k in paths}
            return float(sum(float(mse_c(sub, ins, t)) for ins, t in zip(inputs, teacher))) / n_el

        q0 = self._quantized(p, weights, specs, grids, None)
        mse0 = block_mse(q0)
        info: dict[str, float] = {"mse_init": mse0, "iters": 0}
        clock = StepBudget(self.iters, budget)
        if self.iters == 0 or clock.exhausted:
            return q0, info
        tv = {w: {"v": jnp.zeros(jnp.shape(p[w]), jnp.float32), "a": jnp.ones_like(grids[w][0]),
                  "b": jnp.ones_like(grids[w][0])} for w in weights}
        lr0 = self.lr if self.lr is not None else 1.0 / self.iters
        if self.optimizer == "adam":
            opt = optax.inject_hyperparams(optax.adam)(learning_rate=lr0)
        else:
            opt = optax.inject_hyperparams(optax.sign_sgd)(learning_rate=lr0)
        state = opt.init(tv)
        lo, hi = self.scale_min, self.scale_max

        def step(tv, state, lr, ins, targets):
            loss, g = jax.value_and_grad(loss_fn)(tv, ins, targets)
            state.hyperparams["learning_rate"] = lr
            upd, state = opt.update(g, state, tv)
            tv = optax.apply_updates(tv, upd)
            tv = {w: {"v": jnp.clip(d["v"], -0.5, 0.5), "a": jnp.clip(d["a"], lo, hi), "b": jnp.clip(d["b"], lo, hi)}
                  for w, d in tv.items()}
            return tv, state, loss

        step_c = shared_jit(step)
        n = len(inputs)
        iters = self.iters
        order: list[int] = []
        t_train = time.perf_counter()
        it = 0
        while it < iters:
            if not order:
                order = list(rng.permutation(n))
            i = order.pop()
            frac = it / iters
            lr = jnp.asarray(lr0 * (1.0 - frac) if self.optimizer == "sign" else lr0, jnp.float32)
            tv, state, loss = step_c(tv, state, lr, inputs[i], teacher[i])
            it += 1
            iters = clock.after(it, loss)
        q1 = self._quantized(p, weights, specs, grids, tv)
        mse1 = block_mse(q1)
        info.update(mse_trained=mse1, iters=it, train_seconds=time.perf_counter() - t_train)
        if self.keep_better and not mse1 < mse0:
            return q0, info
        return q1, info
