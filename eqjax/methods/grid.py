"""Searched grids: per group, the scale (and zero point) that minimizes the weighted output error.

Round to nearest on a min/max (or absmax) grid wastes codes on the few largest weights of a group; a
smaller step rounds the bulk more finely and clips the extremes. Which step is best depends on what
the layer's output feels: the output error of a weight ``W [K, N]`` quantized to ``Q`` over the
calibration inputs ``X`` is ``||X (W - Q)||^2 = sum_n e_n^T H e_n`` with ``H = X^T X`` and ``e_n`` column
``n`` of ``W - Q``. A group of inputs ``g`` of one output has its own scale; errors of different groups
only interact through the off-block entries of ``H``, so each ``(group, output)`` grid is chosen on its
own block ``H_gg`` (``weighting="hessian"``; ``"diagonal"``: ``sum_i H_ii e_i^2``, the activation-weighted
error of AutoRound's ``iters=0``; ``"none"``: plain weight MSE). ``H`` is damped by ``damp *
mean(diag H)`` so a group whose inputs never fire still gets a sensible grid.

:func:`search_grid` tries, per ``(group, output)``:

* symmetric: ``scale = r * absmax / d`` for ``r`` in ``linspace(min_ratio, 1, n_grid)`` (``d`` of the
  spec's grid, :func:`eqjax.core.numerics.symmetric_divisor`; a full-range grid also tries the 15-code step);
* asymmetric: ranges ``[r_lo * min, r_hi * max]`` for ``r_lo, r_hi`` on a ``sqrt(n_grid)``-point grid
  in ``[min_ratio, 1]`` (zero point rounded as :func:`eqjax.core.numerics.range_to_qparams` does);

each candidate's scale rounded to the stored ``scale_dtype``; then ``refine`` rounds of weighted least
squares: with the best codes fixed, the scale (and zero point, rounded to an integer code) that fit the
weights best under ``H``, re-quantized and kept only where the error drops. The first candidate is the
plain min/max (absmax) grid and a candidate replaces the best only when strictly better, so the result
is never worse than round to nearest under the chosen weighting.

The :class:`SearchedRTN` step quantizes every float matmul weight on its searched grid (one jitted
statistics pass per block for ``X^T X``); :class:`~eqjax.methods.gptq.GPTQ` (``grid="search"``) and
:class:`~eqjax.methods.signround.SignRound` use :func:`search_grid` for their grids.

What does not work (tested, tests/methods/test_grid.py): inside GPTQ the searched grids are chosen for
round to nearest, and the clipping they favour can make GPTQ's output error *larger* than on min/max
grids (x1.1..x2.2 on synthetic heavy-tailed 3-bit layers): GPTQ pushes the clipped weights' errors onto
the inputs still to come. Measured on SmolLM2 in bench/results/quality_issue13.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from eqjax.calibration.statistics import xtx
from eqjax.core.analysis import WeightUse, weight_matrix
from eqjax.core.errors import InputError
from eqjax.core.numerics import QuantSpec, quantize_with, range_to_qparams, symmetric_bounds, symmetric_divisor
from eqjax.core.qarray import describe_granularity, scale_shape
from eqjax.methods.rtn import concrete_spec, step_targets, weight_step_spec
from eqjax.recipes.rules import Rule
from eqjax.recipes.schema import step_kwargs

__all__ = ["search_grid", "grid_blocks", "weighted_error", "SearchedRTN", "Weighting", "group_ids", "gran_group_ids", "grids_to_param",
           "place_grid"]

Weighting = Literal["hessian", "diagonal", "none"]


def group_ids(contract_dims: tuple[int, ...], group_size: int | None, span: int = 1) -> tuple[np.ndarray, int]:
    """Group id of each canonical input (contracted axes flattened in order) and the number of groups:
    groups run along the flattened last ``span`` contracted axes (the granularity's group axes,
    :func:`eqjax.core.roles.input_group_axes`), with a short last group per outer index when the group
    does not divide their product."""
    k = int(np.prod(contract_dims, dtype=np.int64))
    if group_size is None:
        return np.zeros((k,), np.int32), 1
    dg = int(np.prod(contract_dims[len(contract_dims) - span:], dtype=np.int64))
    g = min(int(group_size), dg)
    ng = -(-dg // g)
    idx = np.arange(k)
    return ((idx // dg) * ng + (idx % dg) // g).astype(np.int32), (k // dg) * ng


def gran_group_ids(contract_dims: tuple[int, ...], gran: Any) -> tuple[np.ndarray, int]:
    """:func:`group_ids` for a concrete granularity (groups along its axes, else one per output)."""
    if gran.kind != "group":
        return group_ids(contract_dims, None)
    return group_ids(contract_dims, gran.group_size, len(gran.axes))


def grid_blocks(gid: np.ndarray, n_groups: int) -> np.ndarray:
    """``[n_groups, G]`` canonical input rows of each group (``-1`` pads a short group)."""
    size = int(np.max(np.bincount(gid, minlength=n_groups)))
    out = np.full((n_groups, size), -1, np.int32)
    for g in range(n_groups):
        rows = np.flatnonzero(gid == g)
        out[g, : rows.size] = rows
    return out


def _codes(wb, s, z, bits: int, symmetric: bool):
    """Integer offsets ``code - zero point`` of ``wb`` on the grid ``(s, z)`` (float32)."""
    if symmetric:
        lo, hi = symmetric_bounds(bits)
        return jnp.clip(jnp.round(wb / s), lo, hi)
    return jnp.clip(jnp.round(wb / s) + z, 0, 2**bits - 1) - z


def weighted_error(e: jax.Array, hb: jax.Array, weighting: str) -> jax.Array:
    """``[B, N]`` error of ``e [B, G, N]`` per group block: ``e^T H_b e`` / ``sum diag(H_b) e^2`` / ``sum e^2``."""
    if weighting == "hessian":
        return jnp.sum(e * jnp.einsum("bij,bjn->bin", hb, e, precision="highest"), axis=1)
    if weighting == "diagonal":
        d = jnp.diagonal(hb, axis1=1, axis2=2)[:, :, None]
        return jnp.sum(d * e * e, axis=1)
    return jnp.sum(e * e, axis=1)


def _to_dtype(s: jax.Array, scale_dtype: str) -> jax.Array:
    """Nearest ``scale_dtype`` value of a positive float32 scale, back as float32 (stays > 0)."""
    if scale_dtype == "float32":
        return s
    dt = jnp.dtype(scale_dtype)
    r = s.astype(dt)
    r = jnp.where(r > 0, r, jnp.asarray(jnp.finfo(dt).smallest_subnormal, dt))
    return r.astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("bits", "symmetric", "full_range", "scale_dtype", "weighting",
                                             "n_grid", "min_ratio", "refine"))
def _search(w2, h, blocks, *, bits: int, symmetric: bool, full_range: bool, scale_dtype: str, weighting: str,
            n_grid: int, min_ratio: float, refine: int):
    valid = blocks >= 0
    safe = jnp.where(valid, blocks, 0)
    vm = valid[:, :, None]
    wb = jnp.where(vm, w2[safe], 0.0)  # [B, G, N]
    hb = jnp.where(vm & valid[:, None, :], h[safe[:, :, None], safe[:, None, :]], 0.0)  # [B, G, G]
    big = jnp.finfo(jnp.float32).max
    lo0 = jnp.min(jnp.where(vm, wb, big), axis=1, keepdims=True)
    hi0 = jnp.max(jnp.where(vm, wb, -big), axis=1, keepdims=True)

    def err_of(s, z):
        e = jnp.where(vm, wb - _codes(wb, s, z, bits, symmetric) * s, 0.0)
        return weighted_error(e, hb, weighting)[:, None, :]

    def qparams(a, b):
        s, z = range_to_qparams(lo0 * a, hi0 * b, bits, symmetric, scale_dtype, full_range)
        return s.astype(jnp.float32), (jnp.zeros_like(s, jnp.float32) if z is None else z.astype(jnp.float32))

    if symmetric:
        ratios = np.linspace(1.0, min_ratio, n_grid)
        if full_range:  # the 15-code step (absmax / (2**(b-1) - 1)) as a candidate too
            ratios = np.append(ratios, symmetric_divisor(bits, True) / symmetric_divisor(bits, False))
        pairs = np.stack([ratios, ratios], axis=1)
    else:
        m = max(1, int(round(np.sqrt(n_grid))))
        r = np.linspace(1.0, min_ratio, m)
        pairs = np.stack(np.meshgrid(r, r, indexing="ij"), axis=-1).reshape(-1, 2)
    pairs = jnp.asarray(pairs, jnp.float32)

    s0, z0 = qparams(pairs[0, 0], pairs[0, 1])
    init = (err_of(s0, z0), s0, z0)

    def body(carry, ab):
        best, bs, bz = carry
        s, z = qparams(ab[0], ab[1])
        e = err_of(s, z)
        better = e < best
        return (jnp.where(better, e, best), jnp.where(better, s, bs), jnp.where(better, z, bz)), None

    (best, bs, bz), _ = jax.lax.scan(body, init, pairs[1:])

    def hdot(v):  # H_b v for v [B, G, N]
        if weighting == "hessian":
            return jnp.einsum("bij,bjn->bin", hb, v, precision="highest")
        if weighting == "diagonal":
            return jnp.diagonal(hb, axis1=1, axis2=2)[:, :, None] * v
        return v

    def refine_once(carry, _):
        best, bs, bz = carry
        q = jnp.where(vm, _codes(wb, bs, bz, bits, symmetric), 0.0)  # integer offsets
        if symmetric:
            hq = hdot(q)
            num = jnp.sum(hq * wb, axis=1, keepdims=True)
            den = jnp.sum(hq * q, axis=1, keepdims=True)
            s = jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), bs)
            z = bz
        else:  # w ~ s * c + t with c = q + z the codes; then z = round(-t / s), s refit with z fixed
            c = jnp.where(vm, q + bz, 0.0)
            one = vm.astype(jnp.float32) * jnp.ones_like(wb)
            hc, h1 = hdot(c), hdot(one)
            a11 = jnp.sum(hc * c, axis=1, keepdims=True)
            a12 = jnp.sum(hc * one, axis=1, keepdims=True)
            a22 = jnp.sum(h1 * one, axis=1, keepdims=True)
            b1 = jnp.sum(hc * wb, axis=1, keepdims=True)
            b2 = jnp.sum(h1 * wb, axis=1, keepdims=True)
            det = a11 * a22 - a12 * a12
            ok = det > 1e-12 * jnp.maximum(a11 * a22, 1e-30)
            sd = jnp.where(ok, det, 1.0)
            s1 = (b1 * a22 - b2 * a12) / sd
            t1 = (a11 * b2 - a12 * b1) / sd
            ok = ok & (s1 > 0)
            z = jnp.where(ok, jnp.clip(jnp.round(-t1 / jnp.where(ok, s1, 1.0)), 0, 2**bits - 1), bz)
            qz = jnp.where(vm, c - z, 0.0)
            hq = hdot(qz)
            num = jnp.sum(hq * wb, axis=1, keepdims=True)
            den = jnp.sum(hq * qz, axis=1, keepdims=True)
            s = jnp.where(ok & (den > 0), num / jnp.where(den > 0, den, 1.0), bs)
        s = jnp.where(jnp.isfinite(s) & (s > 0), s, bs)
        s = _to_dtype(s, scale_dtype)
        e = err_of(s, z)
        better = e < best
        return (jnp.where(better, e, best), jnp.where(better, s, bs), jnp.where(better, z, bz)), None

    if refine:
        (best, bs, bz), _ = jax.lax.scan(refine_once, (best, bs, bz), None, length=refine)
    return bs[:, 0, :], bz[:, 0, :], best[:, 0, :]


def search_grid(
    w2: Any,
    h: Any,
    gid: np.ndarray,
    n_groups: int,
    *,
    bits: int = 4,
    symmetric: bool = False,
    full_range: bool = False,
    scale_dtype: str = "float16",
    weighting: Weighting = "hessian",
    n_grid: int = 64,
    min_ratio: float = 0.5,
    refine: int = 4,
    damp: float = 0.01,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """The searched grid of a canonical weight ``w2 [K, N]`` (see the module docs).

    ``h [K, K]``: any positive multiple of ``X^T X`` (None: plain weight MSE); ``gid [K]``: the group of
    each input (:func:`eqjax.methods.gptq.group_ids`). Returns ``(scale [n_groups, N] in scale_dtype,
    zero point [n_groups, N] int32 or None, weighted error [n_groups, N] float32)``.
    """
    if weighting not in ("hessian", "diagonal", "none"):
        raise InputError(f"grid search: weighting must be 'hessian', 'diagonal' or 'none', got {weighting!r}")
    if n_grid < 1 or not 0.0 < min_ratio <= 1.0 or refine < 0:
        raise InputError("grid search: n_grid >= 1, 0 < min_ratio <= 1 and refine >= 0 required")
    w = jnp.asarray(w2, jnp.float32)
    k = w.shape[0]
    if h is None or weighting == "none":
        hh = jnp.eye(k, dtype=jnp.float32)
        weighting = "none"
    else:
        hn = np.array(h, np.float64)
        if hn.shape != (k, k):
            raise InputError(f"grid search: H of shape {hn.shape} does not match the weight's {k} inputs")
        mean = float(np.mean(np.abs(np.diag(hn)))) or 1.0
        hn[np.diag_indices(k)] += damp * mean
        hn /= mean  # normalized: the argmin does not depend on H's scale
        hn = hn.astype(np.float32)  # on the host: jnp.asarray(float64, float32) would peak at 3x the float32 size
        hh = jnp.asarray(hn)
        del hn
    s, z, err = _search(w, hh, jnp.asarray(grid_blocks(np.asarray(gid), n_groups)), bits=bits, symmetric=symmetric,
                        full_range=full_range, scale_dtype=scale_dtype, weighting=weighting, n_grid=int(n_grid),
                        min_ratio=float(min_ratio), refine=int(refine))
    return s.astype(scale_dtype), (None if symmetric else z.astype(jnp.int32)), err


@dataclasses.dataclass(frozen=True)
class SearchedRTN:
    """Round to nearest on searched grids: every float matmul weight matching ``pattern``.

    Per block, ``X^T X`` of each weight's input (one jitted pass over the calibration batches; the
    blocks see the float model's activations) weights the grid search of :func:`search_grid`; the
    result is an ordinary group-wise (or per-output-channel) QArray, the same bytes as plain RTN.
    Composes after :class:`~eqjax.methods.awq.AWQ` (scales only: ``clip=False``).
    """

    bits: int = 4
    group_size: int | None = 128
    symmetric: bool = False
    full_range: bool = True
    weighting: str = "hessian"
    n_grid: int = 64
    min_ratio: float = 0.5
    refine: int = 4
    damp: float = 0.01
    scale_dtype: str | None = None
    sink_tokens: int = 0
    sink_weight: float = 0.0
    pattern: str = ".*"
    role: str = "matmul"
    name: str = "rtn_search"
    needs_calibration = True
    advance = "original"  # block inputs: see eqjax.calibration.calibrate.Calibrator.run_blocks

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 2 <= self.bits <= 8:
            raise ValueError(f"{self.name}: bits must be an int in 2..8, got {self.bits!r}")
        if self.weighting not in ("hessian", "diagonal", "none"):
            raise ValueError(f"{self.name}: weighting must be 'hessian', 'diagonal' or 'none'")
        self.spec()  # validates bits / symmetric / full_range
        Rule(self.pattern, role=self.role)

    def spec(self) -> QuantSpec:
        """The stored format (:func:`eqjax.methods.rtn.weight_step_spec`)."""

        return weight_step_spec(self.bits, self.symmetric, self.group_size, self.scale_dtype, self.full_range)

    def search_kwargs(self) -> dict[str, Any]:
        return dict(weighting=self.weighting, n_grid=self.n_grid, min_ratio=self.min_ratio, refine=self.refine,
                    damp=self.damp)

    def __call__(self, params: Mapping[str, Any], ctx: Any) -> dict[str, Any]:


        cal, targets = step_targets(self, params, ctx)
        if not targets:
            return dict(params)
        an = cal.analysis
        grids: dict[str, tuple] = {}

        def per_block(bc: Any, p: dict[str, Any]) -> dict[str, Any]:
            uses = [u for u in bc.uses if u.path in targets and not u.batch]
            if not uses:
                return p
            stats = bc.statistics({"xtx": xtx()}, uses, sink_tokens=self.sink_tokens, sink_weight=self.sink_weight)
            for u in uses:
                spec = concrete_spec(self.spec(), an, u.path, u.shape)
                gran = spec.granularity
                gid, ng = gran_group_ids(tuple(u.shape[a] for a in u.contracting), gran)
                s, z, _ = search_grid(weight_matrix(p[u.path], u), stats[u.path]["xtx"], gid, ng, bits=self.bits,
                                      symmetric=self.symmetric, full_range=spec.full_range,
                                      scale_dtype=spec.scale_dtype, **self.search_kwargs())
                old = grids.get(u.path, (None, None, None))
                sp = place_grid(old[1], grids_to_param(s, u, gran), u, gran)
                zp = None if z is None else place_grid(old[2], grids_to_param(z, u, gran), u, gran)
                grids[u.path] = (gran, sp, zp)
            return p

        out = cal.run_blocks(params, per_block, advance=self.advance, progress=ctx.progress, desc=self.name)
        return finish_grids(out, params, grids, self.bits, ctx, self.name, self.symmetric)

    @classmethod
    def from_config(cls, d: Mapping[str, Any]) -> "SearchedRTN":

        return cls(**step_kwargs(cls, d, "rtn_search", exclude=()))


def grids_to_param(scale: jax.Array, use: WeightUse, gran: Any) -> jax.Array:
    """Canonical grids ``[n_groups, N]`` -> the used slice of the param's scale layout for ``gran``
    (stacked axes of a scanned param have size 1: :func:`place_grid` puts the slice in place)."""
    shape = list(use.shape)
    for ax, _ in use.view.index:
        shape[ax] = 1
    order = use.contracting + use.free
    rest = [a for a in range(len(shape)) if a not in order]
    if gran.kind == "group":
        span = len(gran.axes)
        n = -(-int(np.prod([shape[a] for a in gran.axes], dtype=np.int64)) // gran.group_size)
        dims = [shape[a] for a in use.contracting[:-span]] + [1] * (span - 1) + [n]
    else:
        dims = [1] * len(use.contracting)
    t = scale.reshape(dims + [shape[a] for a in use.free] + [1] * len(rest))
    return jnp.transpose(t, np.argsort(order + tuple(rest)))


def place_grid(full: jax.Array | None, part: jax.Array, use: WeightUse, gran: Any) -> jax.Array:
    """``part`` (a slice's grid) written into the whole param's grid array (created as ones)."""
    if not use.view.index:
        return part
    if full is None:
        full = jnp.ones(scale_shape(use.shape, gran), part.dtype)
    start = [0] * len(use.shape)
    for ax, i in use.view.index:
        start[ax] = i
    return jax.lax.dynamic_update_slice(full, part, start)


_quantize_with = jax.jit(quantize_with, static_argnames=("bits", "granularity"))


def finish_grids(out: dict[str, Any], params: Mapping[str, Any], grids: Mapping[str, tuple], bits: int, ctx: Any,
                 step: str, symmetric: bool, what: str = "") -> dict[str, Any]:
    """Quantize each ``out[path]`` on its grid ``(granularity, scale, zero point)`` into a QArray of the
    param's own dtype, reporting it in ``ctx.report``."""
    for path, (gran, scale, zp) in grids.items():
        q = _quantize_with(jnp.asarray(out[path], jnp.float32), scale, zp, bits=bits, granularity=gran)
        out[path] = dataclasses.replace(q, dtype=jnp.dtype(params[path].dtype))
        ctx.report.append((path, f"{step}: int{bits} {'sym' if symmetric else 'asym'} "
                                  f"{describe_granularity(gran, tuple(params[path].shape))}{what}"))
    return out


def grid_of_use(w: Any, u: WeightUse, h: Any, spec: QuantSpec, **kw: Any) -> tuple[jax.Array, jax.Array | None]:
    """Searched ``(scale, zero point)`` of one use's canonical matrix, in canonical ``[n_groups, N]``."""
    gran = spec.granularity
    gid, ng = gran_group_ids(tuple(u.shape[a] for a in u.contracting), gran)
    s, z, _ = search_grid(weight_matrix(w, u), h, gid, ng, bits=spec.bits, symmetric=spec.symmetric,
                          full_range=spec.full_range, scale_dtype=spec.scale_dtype, **kw)
    return s, z


