"""SmoothQuant: migrate activation outliers into the weights with a per-input-channel scale.

For each group of linears that read one input (q/k/v after ``attn_norm``, gate/up after
``mlp_norm``; GPT-2's ``ln_1 -> c_attn``, ``ln_2 -> c_fc``), per input channel ``j``::

    s_j = max|X_j|**alpha / max|W_j|**(1 - alpha)      (clamped >= 1e-5)

with ``max|W_j|`` over the concatenated output columns of the group's kernels and ``max|X_j|`` over
the calibration tokens. The scale is folded: the preceding norm's ``scale`` (and ``bias``) is divided
by ``s``, the kernels' input rows multiplied by ``s``, so the float function is unchanged; the
activations then have flatter channels and W8A8 loses less. ``smooth_down`` also smooths
``down_proj`` through ``up_proj`` (``silu(gate) * up`` is linear in ``up``); the reference does not.

This step only transforms float params. W8A8 follows as a separate step::

    Recipe("w8a8-smoothquant", (SmoothQuant(0.85), RTN((weight_rule(8, act_bits=8),))))

``search=True`` picks ``alpha`` per block from ``alphas``, minimizing the block-output MSE of the
smoothed block under W8A8 (per-channel int8 weights, per-token dynamic int8 activations) against the
float block on the calibration windows.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from eqjax.calibrate import Statistic, absmax, run_layerwise
from eqjax.numerics import QuantSpec
from eqjax.pytree import Params, get_path, set_path
from eqjax.qarray import per_channel
from eqjax.recipe import RecipeError
from eqjax.rules import Rule

__all__ = ["SmoothQuant", "smooth_scales", "fold_scales", "smoothing_groups", "W8A8_RULE"]

log = logging.getLogger("eqjax")

W8A8_RULE = Rule(r".*/kernel", QuantSpec(8, True, per_channel(-1), "minmax"), 8, "token")
"""Per-output-channel int8 weights + per-token dynamic int8 activations (the SmoothQuant setting)."""

_MIN = 1e-5


def _nonfinite() -> Statistic:
    """Number of NaN/Inf entries seen (XLA's max may drop NaN, so absmax alone cannot tell)."""
    return Statistic(
        "nonfinite",
        lambda f: jnp.zeros((), jnp.float32),
        lambda s, x, w: s + jnp.sum(~jnp.isfinite(x.astype(jnp.float32))).astype(jnp.float32),
        "sum",
    )


def smoothing_groups(model: Any, *, smooth_down: bool = False) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The ``(prev, linears)`` groups SmoothQuant folds: those after a norm (+ up -> down if asked)."""
    out = []
    for prev, names in model.linear_groups:
        if prev is None:
            continue
        if "/" not in prev or (smooth_down and prev == "mlp/up_proj" and names == ("mlp/down_proj",)):
            out.append((prev, tuple(names)))
    return tuple(out)


def smooth_scales(x_absmax: jax.Array, kernels: list, alpha: float) -> jax.Array:
    """``s = max|X|**alpha / max|W|**(1 - alpha)`` per input channel (float32 ``[in]``, >= 1e-5)."""
    w_max = jnp.max(jnp.concatenate([jnp.abs(jnp.asarray(k, jnp.float32)) for k in kernels], axis=1), axis=1)
    x = jnp.maximum(jnp.asarray(x_absmax, jnp.float32), _MIN)
    w = jnp.maximum(w_max, _MIN)
    return jnp.maximum(x**alpha / w ** (1.0 - alpha), _MIN)


def _check_float(node: Any, where: str) -> jax.Array:
    if not hasattr(node, "dtype") or not jnp.issubdtype(node.dtype, jnp.floating):
        raise RecipeError(
            f"{where}: SmoothQuant needs float params (run it before RTN/GPTQ); found {type(node).__name__}"
        )
    return node


def fold_scales(layer_params: Params, prev: str, linears: tuple[str, ...], s: jax.Array, *, layer: str = "") -> Params:
    """Divide ``prev``'s output by ``s`` and multiply each linear's input rows by ``s`` (exact in float)."""
    s = jnp.asarray(s, jnp.float32)
    lp = layer_params
    try:
        prev_node = get_path(lp, prev)
    except KeyError:
        raise RecipeError(f"{layer}: SmoothQuant needs the op before {linears} ({prev!r}) but it is missing") from None
    if "/" not in prev:  # a norm: scale (and bias)
        if "scale" not in prev_node:
            raise RecipeError(f"{layer}/{prev}: not a norm with a 'scale' to fold the smoothing scale into")
        for name in ("scale", "bias"):
            if name in prev_node:
                v = _check_float(prev_node[name], f"{layer}/{prev}/{name}")
                lp = set_path(lp, f"{prev}/{name}", (v.astype(jnp.float32) / s).astype(v.dtype))
    else:  # a linear: its output columns (and bias)
        k = _check_float(prev_node["kernel"], f"{layer}/{prev}/kernel")
        if k.shape[1] != s.shape[0]:
            raise RecipeError(f"{layer}/{prev}: {k.shape[1]} outputs cannot feed {linears} with {s.shape[0]} inputs")
        lp = set_path(lp, f"{prev}/kernel", (k.astype(jnp.float32) / s[None, :]).astype(k.dtype))
        if "bias" in prev_node:
            b = prev_node["bias"]
            lp = set_path(lp, f"{prev}/bias", (b.astype(jnp.float32) / s).astype(b.dtype))
    for name in linears:
        k = _check_float(get_path(lp, name + "/kernel"), f"{layer}/{name}/kernel")
        if k.shape[0] != s.shape[0]:
            raise RecipeError(f"{layer}/{name}: kernel has {k.shape[0]} inputs, smoothing scale has {s.shape[0]}")
        lp = set_path(lp, name + "/kernel", (k.astype(jnp.float32) * s[:, None]).astype(k.dtype))
    return lp


@dataclasses.dataclass(frozen=True)
class SmoothQuant:
    """SmoothQuant smoothing step (float -> float params); follow it with W8A8 RTN (or GPTQ).

    Attributes:
      alpha: migration strength (0.5 OPT-like, 0.8-0.85 Llama-like).
      search: choose alpha per block from ``alphas`` by W8A8 block-output MSE on the calibration set.
      alphas: the search grid.
      smooth_down: also smooth ``down_proj`` via ``up_proj`` (Llama family only).
      sink_tokens: exclude the first positions of every window from ``max|X|`` (0 = reference).
      batch_size: calibration windows per jitted call.
    """

    alpha: float = 0.85
    search: bool = False
    alphas: tuple[float, ...] = (0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9)
    smooth_down: bool = False
    sink_tokens: int = 0
    batch_size: int = 8
    name: str = "smoothquant"
    needs_calibration = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0 or any(not 0.0 <= a <= 1.0 for a in self.alphas):
            raise ValueError(f"SmoothQuant alpha must be in [0, 1], got {self.alpha} / {self.alphas}")

    @classmethod
    def from_config(cls, d: Mapping[str, Any]) -> "SmoothQuant":
        from eqjax.recipe import step_kwargs  # noqa: PLC0415

        return cls(**step_kwargs(cls, d, "smoothquant", tuples=('alphas',)))

    def __call__(self, params: Params, ctx: Any) -> Params:
        ctx.require_calibration(self.name)
        model = ctx.model
        groups = smoothing_groups(model, smooth_down=self.smooth_down)
        if not groups:
            raise RecipeError(f"{self.name}: the model has no linear group after a norm to smooth")
        targets = tuple(n for _, names in groups for n in names)
        chosen: dict[str, float] = {}
        object.__setattr__(self, "chosen_alphas", chosen)  # for reports; not part of the hash

        def per_layer(name: str, lp: Params, cal: Any) -> Params:
            for prev, names in groups:
                for p in (prev, *names):
                    try:
                        get_path(lp, p)
                    except KeyError:
                        raise RecipeError(
                            f"{name}: SmoothQuant expects {p!r} in the block (groups {groups}); wrong param tree?"
                        ) from None
                for n in names:
                    _check_float(get_path(lp, n + "/kernel"), f"{name}/{n}/kernel")
            stats = cal.statistics({"absmax": absmax(), "nonfinite": _nonfinite()}, lp, linears=targets)
            xmax = {}
            for prev, names in groups:
                a = np.asarray(stats[names[0]]["absmax"])
                if not np.isfinite(a).all() or float(stats[names[0]]["nonfinite"]) > 0:
                    raise RecipeError(f"{name}: NaN/Inf in the calibration activations entering {names}")
                xmax[prev] = a
            alphas = self.alphas if self.search else (self.alpha,)
            best, best_err, ref = None, np.inf, None
            for alpha in alphas:
                new = lp
                for prev, names in groups:
                    s = smooth_scales(xmax[prev], [get_path(lp, n + "/kernel") for n in names], alpha)
                    new = fold_scales(new, prev, names, s, layer=name)
                if len(alphas) == 1:
                    return new
                from eqjax.methods.rtn import quantize_by_rules  # noqa: PLC0415

                if ref is None:
                    ref = cal.outputs(lp)
                q = quantize_by_rules(new, (W8A8_RULE,), warn_unused=False)
                err = float(jnp.mean(jnp.square(cal.outputs(q) - ref)))
                log.debug("smoothquant %s alpha %.2f block mse %.3e", name, alpha, err)
                if err < best_err:
                    best, best_err = (alpha, new), err
            chosen[name] = best[0]
            return best[1]

        return run_layerwise(
            model, params, ctx.calibration, per_layer, batch_size=self.batch_size, progress=ctx.progress,
            sink_tokens=self.sink_tokens, advance="original", desc=self.name,
        )
