"""SmoothQuant: migrate activation outliers into the weights with a per-input-channel scale.

For each group of matmul weights reading one input that a norm produces (found from the program:
:func:`eqjax.core.folds.find_fold`; q/k/v after the attention norm, gate/up after the MLP norm,
GPT-2's ``ln_1 -> c_attn``, ``ln_2 -> c_fc``, or a user model's equivalents), per input channel ``j``::

    s_j = max|X_j|**alpha / max|W_j|**(1 - alpha)      (clamped >= 1e-5)

with ``max|W_j|`` over every output of the group's weights and ``max|X_j|`` over the calibration
tokens. The scale is folded: the norm's scale (and bias) divided by ``s``, the weights' input rows
multiplied by ``s``, so the float function is unchanged; the activations then have flatter
channels and W8A8 loses less. ``smooth_linear`` also smooths groups fed by another linear
(``up_proj -> down_proj`` through the gated product, ``v_proj -> o_proj``); the reference does not.

This step only transforms float params. W8A8 follows as a separate step::

    Recipe("w8a8-smoothquant", (SmoothQuant(0.85), RTN((weight_rule(8, act_bits=8),))))

``search=True`` picks ``alpha`` per block from ``alphas``, minimizing the block-output MSE of the
smoothed block under W8A8 (per-channel int8 weights, per-token dynamic int8 activations) against the
float block on the calibration windows.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from eqjax.calibration.calibrate import block_mse
from eqjax.calibration.statistics import absmax, nonfinite
from eqjax.core.analysis import from_weight_matrix, weight_matrix
from eqjax.core.errors import InputError, RecipeError
from eqjax.core.numerics import QuantSpec
from eqjax.core.qarray import is_quantized, per_output_channel
from eqjax.methods.awq import apply_fold
from eqjax.methods.rtn import quantize_by_rules
from eqjax.recipes.rules import Rule
from eqjax.recipes.schema import step_kwargs

__all__ = ["SmoothQuant", "smooth_scales", "W8A8_RULE"]

log = logging.getLogger("eqjax")

W8A8_RULE = Rule(".*", QuantSpec(8, True, per_output_channel(), "minmax"), 8, "token", role="matmul")
"""Per-output-channel int8 weights + per-token dynamic int8 activations (the SmoothQuant setting)."""

_MIN = 1e-5


def smooth_scales(x_absmax: Any, w_absmax: Any, alpha: float) -> jax.Array:
    """``s = max|X|**alpha / max|W|**(1 - alpha)`` per input channel (float32, >= 1e-5)."""
    x = jnp.maximum(jnp.asarray(x_absmax, jnp.float32), _MIN)
    w = jnp.maximum(jnp.asarray(w_absmax, jnp.float32), _MIN)
    return jnp.maximum(x**alpha / w ** (1.0 - alpha), _MIN)


def _tied_max(x: jax.Array, tie: np.ndarray) -> jax.Array:
    return jax.ops.segment_max(jnp.asarray(x), jnp.asarray(tie), num_segments=int(tie.max()) + 1)


@jax.jit
def _row_absmax(w: jax.Array) -> jax.Array:
    """``max |w|`` over the outputs of a canonical ``[K, N]`` weight: ``[K]``, one pass, no ``|w|`` copy (an LM
    head's would be 2 GB)."""
    return jnp.max(jnp.abs(w), axis=1)


@dataclasses.dataclass(frozen=True)
class SmoothQuant:
    """SmoothQuant smoothing step (float -> float params); follow it with W8A8 RTN (or GPTQ).

    Attributes:
      alpha: migration strength (0.5 OPT-like, 0.8-0.85 Llama-like).
      search: choose alpha per block from ``alphas`` by W8A8 block-output MSE on the calibration set.
      alphas: the search grid.
      smooth_linear: also smooth groups whose input comes from another linear (not only from a norm).
      sink_tokens: exclude the first positions of every window from ``max|X|`` (0 = reference).
    """

    alpha: float = 0.85
    search: bool = False
    alphas: tuple[float, ...] = (0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9)
    smooth_linear: bool = False
    sink_tokens: int = 0
    name: str = "smoothquant"
    needs_calibration = True
    advance = "original"  # block inputs: see eqjax.calibration.calibrate.Calibrator.run_blocks

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0 or any(not 0.0 <= a <= 1.0 for a in self.alphas):
            raise ValueError(f"SmoothQuant alpha must be in [0, 1], got {self.alpha} / {self.alphas}")

    @classmethod
    def from_config(cls, d: Mapping[str, Any]) -> "SmoothQuant":

        return cls(**step_kwargs(cls, d, "smoothquant", exclude=(), tuples=("alphas",)))

    def __call__(self, params: Mapping[str, Any], ctx: Any) -> dict[str, Any]:
        cal = ctx.calibrator(self.name)
        chosen: dict[str, float] = {}
        object.__setattr__(self, "chosen_alphas", chosen)  # for reports; not part of the hash
        skipped: list[str] = []
        n_groups = [0]

        def per_block(bc: Any, p: dict[str, Any]) -> dict[str, Any]:
            plan = []
            for group in bc.groups:
                done = [u.path for u in group if is_quantized(p[u.path])]
                if done:
                    raise RecipeError(f"{bc.name}: SmoothQuant needs float weights (run it before RTN/GPTQ); "
                                      f"{done[0]} is already quantized")
                if any(u.batch for u in group):
                    continue
                fold, why = bc.fold(group)
                if fold is None or (fold.kind == "linear" and not self.smooth_linear):
                    skipped.append(f"{group[0].path}: {why or 'fed by a linear (smooth_linear=False)'}")
                    continue
                plan.append((group, fold))
            if not plan:
                return p
            uses = [u for g, _ in plan for u in g]
            stats = bc.statistics({"absmax": absmax(), "nonfinite": nonfinite()}, uses, sink_tokens=self.sink_tokens,
                                  sink_weight=0.0)
            for g, _ in plan:
                a = np.asarray(stats[g[0].path]["absmax"])
                if not np.isfinite(a).all() or float(stats[g[0].path]["nonfinite"]) > 0:
                    raise RecipeError(f"{bc.name}: NaN/Inf in the calibration activations entering "
                                      f"{[u.path for u in g]}")
            alphas = self.alphas if self.search else (self.alpha,)
            best, best_err, ref = None, np.inf, None
            for alpha in alphas:
                new = dict(p)
                for group, fold in plan:
                    tie = fold.tie
                    ws = [weight_matrix(p[u.path], u).astype(jnp.float32) for u in group]
                    w_max = functools.reduce(jnp.maximum, [_row_absmax(w) for w in ws])
                    x_max = stats[group[0].path]["absmax"]
                    s = smooth_scales(_tied_max(x_max, tie), _tied_max(w_max, tie), alpha)
                    new = apply_fold(new, fold, s, tie)
                    se = s[jnp.asarray(tie)]
                    for u, w in zip(group, ws):
                        new[u.path] = from_weight_matrix(w * se[:, None], u, p[u.path])
                if len(alphas) == 1:
                    n_groups[0] += len(plan)
                    return new

                if ref is None:
                    ref = bc.outputs(p)
                paths = {u.path for u in uses}
                rule = dataclasses.replace(W8A8_RULE, pattern="|".join(map(_escape, sorted(paths))))
                q = quantize_by_rules(new, (rule,), ctx, warn_unused=False, step=self.name, report=False)
                err = block_mse(bc.outputs(q), ref)
                log.debug("smoothquant %s alpha %.2f block mse %.3e", bc.name, alpha, err)
                if err < best_err:
                    best, best_err = (alpha, new), err
            chosen[bc.name] = best[0]
            n_groups[0] += len(plan)
            return best[1]

        out = cal.run_blocks(params, per_block, advance=self.advance, progress=ctx.progress, desc=self.name)
        if n_groups[0] == 0 and not getattr(ctx, "partial", False):
            raise InputError(f"{self.name}: no group of matmul weights is fed by a norm it could fold into "
                             f"({'; '.join(dict.fromkeys(skipped)) or 'no float matmul weights'})")
        for msg in dict.fromkeys(skipped):
            log.info("smoothquant: not smoothed: %s", msg)
            ctx.report.append((msg.split(":")[0], f"{self.name}: not smoothed ({msg.split(': ', 1)[-1]})"))
        return out


def _escape(p: str) -> str:
    return re.escape(p)

