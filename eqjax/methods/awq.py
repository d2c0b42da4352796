"""AWQ (Lin et al., 2023): activation-aware per-input-channel weight scaling, then weight clipping.

The step only transforms *float* weights (the function is unchanged by the scaling; clipping changes
it slightly), so it composes with a quantizer after it: ``AWQ -> RTN`` or ``AWQ -> GPTQ``.

Per block (reference ``llm-awq`` ``auto_scale_block`` / ``auto_clip_block``), for each linear group
of :attr:`Model.linear_groups` whose predecessor can absorb a scale (norm -> q/k/v, v_proj -> o_proj
with the scale shared by the query heads of a kv head, norm -> gate/up, up_proj -> down_proj):

* ``x_mean = mean |x|`` per input channel over the calibration tokens;
* for ``r`` in ``{0, 1/n_grid, ..., (n_grid-1)/n_grid}``: ``s = x_mean**r`` (clamped >= 1e-4),
  ``s /= sqrt(max s * min s)``; loss = output MSE of the group's linears with ``W -> Q(s W) / s``;
  keep the best ``r`` (``r = 0`` is plain round-to-nearest, so the proxy never gets worse);
* fold ``s``: the predecessor's output ``/ s`` (norm scale and bias, or a linear's output columns),
  the linears' kernel rows ``* s``.

Then for each linear except q/k (whose error passes through the softmax): per group of ``G`` inputs and
per output channel, shrink ``max|w|`` by ``1 - i / clip_grid`` for ``i < max_shrink * clip_grid`` (the
reference's 1.00, 0.95, ..., 0.55), keep the ratio minimizing that group's partial-output MSE, and
clamp the weights to ``[-max, max]``.

Losses use the linear *outputs* through the input second moment: ``||X E||^2 = tr(E^T X^T X E)``, exact
and independent of the number of calibration tokens (the reference measures the enclosing module's
output, e.g. the attention output for q/k/v; this is the cheaper per-linear proxy). The next block is
calibrated on the float model's outputs (reference behaviour). The first ``sink_tokens`` positions
of every window get ``sink_weight`` in the statistics (see :mod:`eqjax.calibrate`); default: kept.
Measured on SmolLM2-135M (W4 asym, groups of 96 at the time, 32 x 512 calibration tokens, 8 x 1024 evaluation tokens;
FP 19.92, RTN 25.28): AWQ -> RTN 23.40 with the first token kept, 23.54 with it excluded.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from eqjax import calibrate
from eqjax.methods.gptq import group_size_for
from eqjax.numerics import QuantSpec, fake_quantize
from eqjax.pytree import Params, get_path, is_leaf, set_path
from eqjax.qarray import per_channel, per_group

__all__ = ["AWQ", "search_scale", "search_clip", "fold_map", "quant_spec"]

log = logging.getLogger("eqjax")


def quant_spec(in_features: int, bits: int, group_size: int | None, symmetric: bool, scale_dtype: str | None = None) -> QuantSpec:
    """The RTN spec AWQ assumes for an ``[in, out]`` kernel (group size fitted to ``in``)."""
    g = group_size_for(in_features, group_size)
    gran = per_channel(1) if g is None else per_group(0, g)
    sd = scale_dtype or ("float16" if g is not None else "float32")
    return QuantSpec(bits, symmetric, gran, "minmax", scale_dtype=sd)


def _out_err(w: jax.Array, wq: jax.Array, h: jax.Array) -> jax.Array:
    """``tr(E^T H E)`` with ``E = w - wq`` (``[in, out]``)."""
    e = w - wq
    return jnp.sum(jnp.matmul(h, e, precision="highest") * e)


@functools.partial(jax.jit, static_argnames=("specs", "n_grid"))
def _scale_losses(ws: tuple, x_mean: jax.Array, h: jax.Array, idx: jax.Array, *, specs: tuple, n_grid: int):
    """Loss of every grid point: ``[n_grid]``; ``x_mean`` is per *tied* channel, ``idx`` maps inputs to it."""

    def loss(r):
        s = jnp.maximum(x_mean**r, 1e-4)
        s = s / jnp.sqrt(jnp.max(s) * jnp.min(s))
        se = s[idx][:, None]
        total = 0.0
        for w, spec in zip(ws, specs):
            wq = fake_quantize(w * se, spec) / se
            total = total + _out_err(w, wq, h)
        return total

    rs = jnp.arange(n_grid, dtype=jnp.float32) / n_grid
    return jax.lax.map(loss, rs)


def search_scale(
    ws: list[jax.Array], x_mean: jax.Array, h: jax.Array, specs: list[QuantSpec], *, n_grid: int = 20,
    idx: jax.Array | None = None,
) -> tuple[jax.Array, float, np.ndarray]:
    """Best AWQ scale for linears ``ws`` (``[in, out]`` each) sharing an input.

    Args:
      x_mean: mean |x| per (tied) channel; ``idx [in]`` maps each input to its tied channel (default
        identity).
      h: ``X^T X / n`` of the input ``[in, in]``.

    Returns ``(s per tied channel, best r, losses [n_grid])``.
    """
    x_mean = jnp.asarray(x_mean, jnp.float32)
    if idx is None:
        idx = jnp.arange(x_mean.shape[0])
    losses = np.asarray(
        _scale_losses(tuple(jnp.asarray(w, jnp.float32) for w in ws), x_mean, jnp.asarray(h, jnp.float32),
                      jnp.asarray(idx), specs=tuple(specs), n_grid=n_grid)
    )
    if not np.all(np.isfinite(losses)):
        raise ValueError("awq: non-finite loss in the scale search (check the calibration statistics)")
    best = int(np.argmin(losses))
    r = best / n_grid
    s = jnp.maximum(x_mean**r, 1e-4)
    s = s / jnp.sqrt(jnp.max(s) * jnp.min(s))
    return s, r, losses


@functools.partial(jax.jit, static_argnames=("spec", "ratios"))
def _clip(w: jax.Array, h: jax.Array, *, spec: QuantSpec, ratios: tuple[float, ...]) -> jax.Array:
    n_in, n_out = w.shape
    G = spec.granularity.group_size if spec.granularity.kind == "group" else n_in
    ng = -(-n_in // G)  # a short last group is zero-padded here; its padding adds no error
    pad = ng * G - n_in
    hp = jnp.pad(h, ((0, pad), (0, pad)))
    hb = jnp.stack([hp[g * G : (g + 1) * G, g * G : (g + 1) * G] for g in range(ng)])  # [ng, G, G]
    wv = jnp.pad(w, ((0, pad), (0, 0))).reshape(ng, G, n_out)
    amax = jnp.max(jnp.abs(wv), axis=1, keepdims=True)  # [ng, 1, out]

    def clipped(m):
        return jnp.clip(wv, -m, m).reshape(ng * G, n_out)[:n_in]

    def err(r):
        e = w - fake_quantize(clipped(amax * r), spec)
        e = jnp.pad(e, ((0, pad), (0, 0))).reshape(ng, G, n_out)
        return jnp.einsum("gab,gao,gbo->go", hb, e, e, precision="highest")

    errs = jax.lax.map(err, jnp.asarray(ratios, jnp.float32))  # [R, ng, out]
    best = jnp.asarray(ratios, jnp.float32)[jnp.argmin(errs, axis=0)]  # [ng, out]
    return clipped(amax * best[:, None, :])


def search_clip(w: jax.Array, h: jax.Array, spec: QuantSpec, *, max_shrink: float = 0.5, clip_grid: int = 20) -> jax.Array:
    """``w [in, out]`` clamped per (group, output channel) to the ``max|w|`` shrink minimizing the
    group's partial-output error ``e^T H_gg e`` after fake quantization with ``spec``."""
    n = max(1, int(round(max_shrink * clip_grid)))
    ratios = tuple(1.0 - i / clip_grid for i in range(n))
    return _clip(jnp.asarray(w, jnp.float32), jnp.asarray(h, jnp.float32), spec=spec, ratios=ratios)


def fold_map(model: Any, layer_params: Params, prev: str, n_in: int) -> np.ndarray | None:
    """For a linear predecessor ``prev``: the output column of ``prev`` feeding each of the ``n_in``
    inputs of the next linears, or None when it cannot be folded."""
    n_prev = get_path(layer_params, prev + "/kernel").shape[1]
    c = np.arange(n_in)
    if n_prev == n_in:
        return c
    cfg = model.config
    if prev.endswith("v_proj") and hasattr(cfg, "n_kv_heads"):
        hd, g = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
        if n_prev == cfg.n_kv_heads * hd and n_in == cfg.n_heads * hd:
            return (c // hd // g) * hd + c % hd
    if n_prev == 3 * n_in:  # GPT-2 fused c_attn: the last third are the values
        return 2 * n_in + c
    return None


def _scale_prev(lp: Params, prev: str, s: jax.Array, cols: np.ndarray | None) -> Params:
    """Divide the predecessor's output by ``s`` (norm: scale/bias; linear: the columns ``cols``)."""
    node = get_path(lp, prev)
    if "scale" in node and "kernel" not in node:
        lp = set_path(lp, prev + "/scale", (node["scale"].astype(jnp.float32) / s).astype(node["scale"].dtype))
        if "bias" in node:
            lp = set_path(lp, prev + "/bias", (node["bias"].astype(jnp.float32) / s).astype(node["bias"].dtype))
        return lp
    k = node["kernel"]
    lp = set_path(lp, prev + "/kernel", k.at[:, cols].set((k[:, cols].astype(jnp.float32) / s).astype(k.dtype)))
    if "bias" in node:
        b = node["bias"]
        lp = set_path(lp, prev + "/bias", b.at[cols].set((b[cols].astype(jnp.float32) / s).astype(b.dtype)))
    return lp


@dataclasses.dataclass(frozen=True)
class AWQ:
    """AWQ scale search + clip search on float weights (follow with RTN or GPTQ of the same format)."""

    bits: int = 4
    group_size: int | None = 128
    symmetric: bool = False
    n_grid: int = 20
    clip: bool = True
    max_shrink: float = 0.5
    clip_grid: int = 20
    scale_dtype: str | None = None
    sink_tokens: int = 0
    sink_weight: float = 0.0
    batch_size: int = 8
    no_clip: tuple[str, ...] = ("q_proj", "k_proj", "c_attn")
    name: str = "awq"
    needs_calibration = True

    def __post_init__(self) -> None:
        if not 2 <= int(self.bits) <= 8:
            raise ValueError(f"awq: bits must be in 2..8, got {self.bits}")
        if self.n_grid < 1 or self.clip_grid < 1 or not 0 < self.max_shrink < 1:
            raise ValueError("awq: n_grid, clip_grid >= 1 and 0 < max_shrink < 1 required")

    def spec_for(self, in_features: int) -> QuantSpec:
        return quant_spec(in_features, self.bits, self.group_size, self.symmetric, self.scale_dtype)

    def transform_layer(self, model: Any, layer_name: str, lp: Params, stats: Mapping[str, Mapping[str, Any]]) -> Params:
        """Scale and clip one block given its linears' input statistics (``xtx`` and ``abs_mean``)."""
        h_of = {p: jnp.asarray(st["xtx"], jnp.float32) for p, st in stats.items()}
        for prev, linears in model.linear_groups:
            linears = tuple(p for p in linears if p in stats and not is_leaf(get_path(lp, p + "/kernel")))
            if prev is None or not linears:
                continue
            ws = [get_path(lp, p + "/kernel").astype(jnp.float32) for p in linears]
            n_in = ws[0].shape[0]
            x_mean = jnp.asarray(stats[linears[0]]["abs_mean"], jnp.float32)
            h = h_of[linears[0]]
            cols = None
            idx = np.arange(n_in)
            if "/" in prev:  # a linear predecessor
                fm = fold_map(model, lp, prev, n_in)
                if fm is None:
                    log.info("awq: %s: cannot fold a scale into %s; group skipped", layer_name, prev)
                    continue
                cols, idx = np.unique(fm, return_inverse=True)
                # tie channels reading the same predecessor column: mean of their |x|
                x_mean = jax.ops.segment_sum(x_mean, idx, num_segments=len(cols)) / np.bincount(idx)
            specs = [self.spec_for(n_in) for _ in ws]
            s, r, _ = search_scale(ws, x_mean, h, specs, n_grid=self.n_grid, idx=jnp.asarray(idx))
            log.debug("awq: %s %s: r=%.2f", layer_name, linears, r)
            se = s[idx]
            lp = _scale_prev(lp, prev, s, cols)
            for p, w in zip(linears, ws):
                k = get_path(lp, p + "/kernel")
                lp = set_path(lp, p + "/kernel", (w * se[:, None]).astype(k.dtype))
                # the input of p is now x / s: its second moment scales accordingly
                h_of[p] = h_of[p] / (se[:, None] * se[None, :])
        if self.clip:
            for p in stats:
                k = get_path(lp, p + "/kernel")
                if is_leaf(k) or any(p.endswith(n) for n in self.no_clip):
                    continue
                w = search_clip(k.astype(jnp.float32), h_of[p], self.spec_for(k.shape[0]),
                                max_shrink=self.max_shrink, clip_grid=self.clip_grid)
                lp = set_path(lp, p + "/kernel", w.astype(k.dtype))
        return lp

    def __call__(self, params: Params, ctx: Any) -> Params:
        ctx.require_calibration(self.name)
        model = ctx.model
        want = {"xtx": calibrate.xtx(), "abs_mean": calibrate.abs_sum()}

        def per_layer(layer_name: str, lp: Params, cal: calibrate.LayerCalibration) -> Params:
            stats = cal.statistics(want, lp)
            return self.transform_layer(model, layer_name, lp, stats)

        return calibrate.run_layerwise(
            model, params, ctx.calibration, per_layer, batch_size=self.batch_size,
            progress=getattr(ctx, "progress", False), sink_tokens=self.sink_tokens,
            sink_weight=self.sink_weight, advance="original", desc=self.name,
        )

    @classmethod
    def from_config(cls, d: Mapping[str, Any]) -> "AWQ":
        from eqjax.recipe import step_kwargs  # noqa: PLC0415

        return cls(**step_kwargs(cls, d, "awq", exclude=(), tuples=('no_clip',)))
