"""AWQ (Lin et al., 2023): activation-aware per-input-channel weight scaling, then weight clipping.

The step only transforms *float* weights (scaling leaves the function unchanged; clipping changes it
slightly), so it composes with a quantizer after it: ``AWQ -> RTN`` or ``AWQ -> GPTQ``.

Per block (reference ``llm-awq`` ``auto_scale_block`` / ``auto_clip_block``), for each group of matmul
weights reading one input whose producer can absorb a per-channel scale (found from the program:
:func:`eqjax.core.folds.find_fold`; a norm, or another linear such as ``v_proj -> o_proj``, where the
channels of the query heads sharing a kv head are tied):

* ``x_mean = mean |x|`` per input channel over the calibration tokens (tied channels averaged);
* for ``r`` in ``{0, 1/n_grid, ..., (n_grid-1)/n_grid}``: ``s = x_mean**r`` (clamped >= 1e-4),
  ``s /= sqrt(max s * min s)``; loss = output error of the group's weights with ``W -> Q(diag(s) W) /
  s``, quantized in each weight's own layout; keep the best ``r`` (``r = 0`` is plain round to
  nearest, so the proxy never gets worse);
* fold ``s``: the producer's output ``/ s``, the weights' input rows ``* s``.

A group whose input has no such producer (e.g. GPT-2's ``gelu`` before ``c_proj``, or an input that is
also a residual) is not scaled; the step logs which and why. Then, for every weight except those
whose error passes through a softmax (the output columns of query / key projections, found by data
flow: :func:`eqjax.core.scores.score_columns`, so a fused kv or qkv weight clips only its value
columns; ``no_clip`` names further weights by path component), per group of ``G`` inputs and per
output channel, shrink ``max|w|`` by ``1 - i / clip_grid`` for ``i <
max_shrink * clip_grid`` and keep the ratio minimizing that group's partial-output error.

Losses use the weight *outputs* through the input second moment: ``||X E||^2 = tr(E^T X^T X E)``,
exact and independent of the number of calibration tokens (the reference measures the enclosing
module's output; this is the cheaper per-weight proxy). When fewer tokens than inputs calibrate a weight
(an 8B model's 4096- and 14336-wide inputs on 2,048 tokens), ``H`` has rank ``r < K`` and, for ``r <= 0.8 K``, the
scale search prices ``||L^T E||^2`` through a pivoted-Cholesky factor ``H = L L^T`` (:func:`gram_factor`):
``r K N`` multiply-adds per ratio instead of ``K^2 N``, linear in the weight's size at a fixed number of
tokens. The next block is calibrated on the float
model's outputs (reference behaviour).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg

from eqjax.calibration.statistics import abs_sum, xtx
from eqjax.core.analysis import WeightUse, from_weight_matrix, matrix_to_slice, slice_to_matrix, weight_matrix
from eqjax.core.errors import InputError
from eqjax.core.folds import Fold
from eqjax.core.numerics import QuantSpec, fake_quantize
from eqjax.core.scores import score_columns
from eqjax.methods.grid import gran_group_ids
from eqjax.methods.rtn import concrete_spec, step_targets, weight_step_spec
from eqjax.recipes.rules import Rule
from eqjax.recipes.schema import step_kwargs

__all__ = ["AWQ", "search_scale", "search_clip", "apply_fold", "gram_factor"]

log = logging.getLogger("eqjax")



def _out_err(e: jax.Array, h: jax.Array) -> jax.Array:
    """``tr(E^T H E)`` for ``E [K, N]``."""
    return jnp.sum(jnp.matmul(h, e, precision="highest") * e)


_FACTOR_RANK = 0.8
"""Largest rank, as a fraction of ``K``, at which the scale search uses :func:`gram_factor`: ``r K N`` against
``K^2 N`` multiply-adds per ratio, at least a fifth saved (float32 rounding adds pivots past a second moment's
exact rank: 2,060 for 2,048 tokens over 14,336 channels)."""


def gram_factor(h: Any) -> np.ndarray | None:
    """``L [K, r]`` (float32) with ``L L^T = h`` for a second moment ``h [K, K]`` of numerical rank
    ``r <= 0.8 K``; None when its rank is higher (or ``h`` is zero or not finite).

    LAPACK's pivoted Cholesky (``dpstrf``, float64, one copy of ``h``, about ``K r^2`` flops) stops when the
    largest diagonal left is at most ``u mean(diag h)`` (``u = 2^-24``, float32's unit roundoff). What it
    leaves, ``h - L L^T``, is positive semi-definite with trace at most ``u tr(h)``, so a loss
    ``tr(E^T h E)`` moves by at most ``u tr(h) ||E||_F^2``: the order of ``h``'s own float32 rounding.
    """
    h = np.asarray(h)
    k = h.shape[0]
    diag = np.diag(h).astype(np.float64)
    tol = float(np.mean(diag)) * 2.0**-24 if k else 0.0
    if not (np.isfinite(tol) and tol > 0):
        return None
    a = np.array(h, np.float64, order="F")
    c, piv, rank, info = scipy.linalg.lapack.dpstrf(a, tol=tol, lower=1, overwrite_a=1)
    del a
    if info < 0 or rank > _FACTOR_RANK * k:
        return None
    out = np.zeros((k, rank), np.float32)
    out[piv - 1] = np.tril(c[:, :rank])  # (P^T h P) = C C^T: row i of C belongs to input piv[i]
    return out


def _fq(w2: jax.Array, use: Any, spec: QuantSpec) -> jax.Array:
    """Fake-quantize a canonical ``[K, N]`` weight in its param's own layout."""
    return slice_to_matrix(fake_quantize(matrix_to_slice(w2, use), spec), use)


_PIECE = 1 << 25
"""Elements of one ``[K, n]`` column piece of a weight in the searches (128 MiB of float32): a wide weight (an LM
head of 128k outputs) is searched piece by piece, each piece one compiled call."""


def _pieces(layout: Any, spec: QuantSpec) -> list[tuple[Any, int, int]]:
    """``(layout of the piece, first column, end column)`` of the canonical ``[K, N]`` matrix of ``layout``, cut
    along the param's first free axis where quantization keeps its positions apart (groups along other axes, or
    a scale per position); one piece where it does not or the weight is small. Output columns are independent in
    both searches, so the pieces' losses add up to the whole weight's and their clips are its clip."""
    f = layout.free[0] if layout.free else None
    g = spec.granularity
    apart = f is not None and ((g.kind == "group" and f not in g.axes) or (g.kind == "channel" and f in g.axes))
    if not apart or layout.k * layout.n <= _PIECE:
        return [(layout, 0, layout.n)]
    inner = layout.n // layout.shape[f]  # canonical columns per position along f (f leads the column order)
    step = max(1, _PIECE // (layout.k * inner))
    out = []
    for lo in range(0, layout.shape[f], step):
        hi = min(lo + step, layout.shape[f])
        out.append((layout._replace(shape=tuple(hi - lo if a == f else d for a, d in enumerate(layout.shape))),
                    lo * inner, hi * inner))
    return out


@jax.jit
def _ratio_scale(x_mean: jax.Array, r: jax.Array) -> jax.Array:
    s = jnp.maximum(x_mean**r, 1e-4)
    return s / jnp.sqrt(jnp.max(s) * jnp.min(s))


@functools.partial(jax.jit, static_argnames=("layout", "spec"))
def _scaled_err(w: jax.Array, se: jax.Array, m: jax.Array, *, layout: Any, spec: QuantSpec) -> jax.Array:
    """Output error of ``w [K, n]`` with ``W -> Q(diag(se) W) / se`` (``se [K, 1]``) through ``m``: ``H [K, K]``,
    or its factor ``L [K, r]`` (``r < K``; :func:`gram_factor`)."""
    e = w - _fq(w * se, layout, spec) / se
    if m.shape[1] == m.shape[0]:
        return _out_err(e, m)
    return jnp.sum(jnp.square(jnp.matmul(m.T, e, precision="highest")))


def search_scale(ws: Sequence[jax.Array], uses: Sequence[WeightUse], specs: Sequence[QuantSpec], x_mean: jax.Array,
                 h: jax.Array, tie: np.ndarray, *, n_grid: int = 20) -> tuple[jax.Array, float, np.ndarray]:
    """Best AWQ scale for canonical weights ``ws`` (``[K, N_i]``) sharing an input.

    ``x_mean``: mean |x| per *tied* channel; ``tie [K]`` maps each input to its tied channel;
    ``h = X^T X / n [K, K]``, priced through its factor where its rank is at most ``0.8 K``
    (:func:`gram_factor`). Returns ``(s per tied channel, best r, losses [n_grid])``. Each ratio, and each
    column piece of a wide weight, is one compiled call (an interrupt lands between them; memory stays at a
    piece's).
    """
    x_mean = jnp.asarray(x_mean, jnp.float32)
    factor = gram_factor(h)
    m = jnp.asarray(h if factor is None else factor, jnp.float32)
    del factor
    tie_j = jnp.asarray(tie)
    ws = [jnp.asarray(w, jnp.float32) for w in ws]
    plans = [_pieces(getattr(u, "layout", u), spec) for u, spec in zip(uses, specs)]
    losses = np.zeros(n_grid)
    for i in range(n_grid):
        se = _ratio_scale(x_mean, jnp.float32(i / n_grid))[tie_j][:, None]
        for w, spec, plan in zip(ws, specs, plans):
            for layout, lo, hi in plan:
                piece = w if len(plan) == 1 else w[:, lo:hi]
                losses[i] += float(_scaled_err(piece, se, m, layout=layout, spec=spec))
    if not np.all(np.isfinite(losses)):
        raise InputError("awq: non-finite loss in the scale search (check the calibration data)")
    best = int(np.argmin(losses))
    r = best / n_grid
    return _ratio_scale(x_mean, jnp.float32(r)), r, losses


@functools.partial(jax.jit, static_argnames=("use", "spec", "ratios", "blocks"))
def _clip(w2: jax.Array, h: jax.Array, *, use: Any, spec: QuantSpec, ratios: tuple[float, ...],
          blocks: tuple[tuple[int, ...], ...]) -> jax.Array:
    idx = jnp.asarray(blocks)  # [B, G] canonical input rows of each grid block, -1 = padding
    valid = idx >= 0
    safe = jnp.where(valid, idx, 0)
    wb = jnp.where(valid[:, :, None], w2[safe], 0.0)  # [B, G, N]
    hb = jnp.where(valid[:, :, None] & valid[:, None, :], h[safe[:, :, None], safe[:, None, :]], 0.0)
    amax = jnp.max(jnp.abs(wb), axis=1, keepdims=True)  # [B, 1, N]

    def clipped(m):
        c = jnp.clip(wb, -m, m)
        return jnp.zeros_like(w2).at[safe.reshape(-1)].add(jnp.where(valid[:, :, None], c, 0.0).reshape(-1, w2.shape[1]))

    def err(r):
        e = w2 - _fq(clipped(amax * r), use, spec)
        eb = jnp.where(valid[:, :, None], e[safe], 0.0)
        return jnp.einsum("bij,bin,bjn->bn", hb, eb, eb, precision="highest")

    rs = jnp.asarray(ratios, jnp.float32)
    errs = jax.lax.map(err, rs)  # [R, B, N]
    best = rs[jnp.argmin(errs, axis=0)]  # [B, N]
    return clipped(amax * best[:, None, :])


def search_clip(w2: jax.Array, h: jax.Array, use: WeightUse, spec: QuantSpec, *, max_shrink: float = 0.5,
                clip_grid: int = 20, in_place: bool = False) -> jax.Array:
    """``w2 [K, N]`` clamped per (grid block, output) to the ``max|w|`` shrink minimizing the block's
    partial-output error ``e^T H_bb e`` after fake quantization with ``spec`` (the param's layout); a wide
    weight is searched one column piece at a time, each piece's result written into one array: ``w2`` itself
    with ``in_place`` (then ``w2`` is consumed: the caller holds no other reference to it)."""
    gran = spec.granularity
    dims = tuple(use.shape[a] for a in use.contracting)
    gid, ng = gran_group_ids(dims, gran)
    size = int(np.max(np.bincount(gid)))
    blocks = tuple(tuple(np.pad(np.flatnonzero(gid == g), (0, size - int(np.sum(gid == g))), constant_values=-1))
                   for g in range(ng))
    n = max(1, int(round(max_shrink * clip_grid)))
    ratios = tuple(1.0 - i / clip_grid for i in range(n))
    w2, h = jnp.asarray(w2, jnp.float32), jnp.asarray(h, jnp.float32)
    plan = _pieces(getattr(use, "layout", use), spec)
    if len(plan) == 1:
        return _clip(w2, h, use=plan[0][0], spec=spec, ratios=ratios, blocks=blocks)
    src = None if in_place else w2  # out of place: pieces read from the input, written to a new array
    out = w2 if in_place else jnp.zeros(w2.shape, jnp.float32)
    del w2
    for layout, lo, hi in plan:  # in place, a piece is read before its columns are written (pieces are disjoint)
        piece = (out if src is None else src)[:, lo:hi]
        out = _put_columns(out, _clip(piece, h, use=layout, spec=spec, ratios=ratios, blocks=blocks), lo)
    return out


@functools.partial(jax.jit, donate_argnums=0)
def _put_columns(out: jax.Array, piece: jax.Array, start: int) -> jax.Array:
    """``out [K, N]`` with columns ``start:start + n`` set to ``piece [K, n]``, in place (``out`` donated)."""
    return jax.lax.dynamic_update_slice(out, piece, (0, start))


def apply_fold(params: dict[str, Any], fold: Fold, s: jax.Array, tie: np.ndarray) -> dict[str, Any]:
    """Divide the fold's targets by the per-channel scale (``s`` per tied channel, ``tie [K]``)."""
    s_k = np.asarray(s, np.float64)[tie]
    for t in fold.targets:
        p = np.array(params[t.path], np.float64)
        div = np.ones(p.shape, np.float64)
        rows, first = np.unique(t.index, axis=0, return_index=True)
        sel = [slice(None)] * p.ndim
        for r, k in zip(rows, first):
            for a, i in zip(t.axes, r):
                sel[a] = int(i)
            div[tuple(sel)] = s_k[k]
        params[t.path] = jnp.asarray(p / div, jnp.asarray(params[t.path]).dtype)
    return params


def _tied_mean(x: jax.Array, tie: np.ndarray) -> jax.Array:
    n = int(tie.max()) + 1
    return jax.ops.segment_sum(x, jnp.asarray(tie), num_segments=n) / np.bincount(tie, minlength=n)


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
    no_clip: tuple[str, ...] = ()
    pattern: str = ".*"
    role: str = "matmul"
    full_range: bool = True
    name: str = "awq"
    needs_calibration = True
    advance = "original"  # block inputs: see eqjax.calibration.calibrate.Calibrator.run_blocks

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 2 <= self.bits <= 8:
            raise ValueError(f"awq: bits must be an int in 2..8, got {self.bits!r}")
        if self.n_grid < 1 or self.clip_grid < 1 or not 0 < self.max_shrink < 1:
            raise ValueError("awq: n_grid, clip_grid >= 1 and 0 < max_shrink < 1 required")
        Rule(self.pattern, role=self.role)

    def spec(self) -> QuantSpec:
        """The stored format (:func:`eqjax.methods.rtn.weight_step_spec`)."""

        return weight_step_spec(self.bits, self.symmetric, self.group_size, self.scale_dtype, self.full_range)

    def __call__(self, params: Mapping[str, Any], ctx: Any) -> dict[str, Any]:

        cal, targets = step_targets(self, params, ctx)
        if not targets:
            return dict(params)
        an = cal.analysis
        want = {"xtx": xtx(), "abs_mean": abs_sum()}
        skipped: list[str] = []

        def per_block(bc: Any, p: dict[str, Any]) -> dict[str, Any]:
            uses = [u for u in bc.uses if u.path in targets and not u.batch]
            if not uses:
                return p
            stats = bc.statistics(want, uses, sink_tokens=self.sink_tokens, sink_weight=self.sink_weight)
            h_of = {u.path: jnp.asarray(stats[u.path]["xtx"], jnp.float32) for u in uses}
            scaled: set[str] = set()  # params this step replaced by scaled copies of its own
            for group in bc.groups:
                group = tuple(u for u in group if u in uses)
                if not group:
                    continue
                fold, why = bc.fold(group)
                if fold is None or any(t.path in {u.path for u in group} for t in fold.targets):
                    skipped.append(f"{group[0].path}: {why or 'folds into itself'}")
                    continue
                tie = fold.tie
                ws = [weight_matrix(p[u.path], u).astype(jnp.float32) for u in group]
                specs = [concrete_spec(self.spec(), an, u.path, u.shape) for u in group]
                x_mean = _tied_mean(jnp.asarray(stats[group[0].path]["abs_mean"], jnp.float32), tie)
                s, r, _ = search_scale(ws, group, specs, x_mean, h_of[group[0].path], tie, n_grid=self.n_grid)
                log.debug("awq: %s %s: r=%.2f", bc.name, [u.path for u in group], r)
                se = jnp.asarray(s)[jnp.asarray(tie)]
                p = apply_fold(p, fold, s, tie)
                for u, w in zip(group, ws):
                    p[u.path] = from_weight_matrix(w * se[:, None], u, p[u.path])
                    scaled.add(u.path)
                    h_of[u.path] = h_of[u.path] / (se[:, None] * se[None, :])
                del ws, w  # the unscaled copies: an LM head's is 2 GB at 8B
            if self.clip:
                for u in uses:
                    keep = score_columns(an, u)
                    if keep.all() or any(part in self.no_clip for part in u.path.split("/")):
                        continue
                    spec = concrete_spec(self.spec(), an, u.path, u.shape)
                    w = weight_matrix(p[u.path], u)
                    like = p[u.path]
                    # the scaled weight this step made, and its matrix is the param itself: clipped in place (an
                    # 8B model's LM head: no third 2 GB copy beside the caller's and the scaled one)
                    in_place = u.path in scaled and w is like and not keep.any()
                    if in_place:
                        like = p[u.path] = jax.ShapeDtypeStruct(w.shape, w.dtype)
                    w2 = search_clip(w, h_of[u.path], u, spec, max_shrink=self.max_shrink, clip_grid=self.clip_grid,
                                     in_place=in_place)
                    if keep.any():  # score columns keep their weights (a fused qkv's q and k)
                        w2 = jnp.where(jnp.asarray(keep)[None, :], w, w2)
                    del w
                    p[u.path] = w2.astype(like.dtype) if in_place else from_weight_matrix(w2, u, like)
            return p

        out = cal.run_blocks(params, per_block, advance=self.advance, progress=ctx.progress, desc=self.name)
        for msg in dict.fromkeys(skipped):
            log.warning("awq: not scaled: %s", msg)
            ctx.report.append((msg.split(":")[0], f"{self.name}: not scaled ({msg.split(': ', 1)[-1]})"))
        return out

    @classmethod
    def from_config(cls, d: Mapping[str, Any]) -> "AWQ":

        return cls(**step_kwargs(cls, d, "awq", exclude=(), tuples=("no_clip",)))
