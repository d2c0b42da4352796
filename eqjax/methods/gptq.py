"""GPTQ (Frantar et al., 2022): layer-wise weight quantization with second-order error compensation.

The algorithm follows the reference ``fasterquant`` (IST-DASLab/gptq), transposed to our ``[in, out]``
kernels (the reference's ``W [out, in]`` is ``kernel.T``; its "columns" are our input features):

* ``H = 2 X^T X / n`` over the calibration tokens feeding the layer (:func:`eqjax.calibration.statistics.xtx`);
* dead inputs (``H_ii == 0``): ``H_ii = 1`` and the weight row is zeroed;
* act-order: inputs permuted by ``diag(H)`` descending;
* damping ``H += percdamp * mean(diag H) * I``; if the Cholesky factorization fails (H not positive
  definite) the damping is multiplied by 10 and retried (at most ``max_damp_tries`` times), with a
  warning naming the layer;
* ``U = chol(H^-1)`` upper; columns processed in lazy blocks of ``blocksize``: each column is
  quantized, its error ``(w - q) / U_ii`` propagated to the rest of the block, and the block's errors
  to the later columns at the end of the block;
* grid: the scale / zero point of a group are computed from the (error-updated) weights when the
  group starts (reference behaviour) or, with ``static_groups``, from the original weights up front.
  Act-order with groups always uses static groups: each input feature then keeps the scale of its
  *own* contiguous group, so the result is an ordinary ``per_group(0, G)`` QArray (no ``g_idx``).

Grids are eqjax's (:func:`eqjax.core.numerics.range_to_qparams`): asymmetric min/max with an integer zero
point, symmetric on all ``2**b`` codes (``2 absmax / (2**b - 1)``, the reference's grid; ``full_range=False``:
``absmax / (2**(b-1) - 1)``, 15 codes at 4 bits); or, with ``grid="search"``, static grids searched up
front per (group, output) to minimize the ``H``-weighted output error of round to nearest
(:func:`eqjax.methods.grid.search_grid`; not always better: see that module's notes). Scales are stored as ``scale_dtype`` (float16 for group
layouts) and the GPTQ loop uses exactly those scales, so ``dequantize(result)`` equals the values GPTQ
chose, bit for bit.

A group size that does not divide the input width (SmolLM2's 576 with 128) leaves a shorter last group
(576 = 4 x 128 + 64), as the reference does and as the RTN recipes store it, so GPTQ and RTN results
of the same recipe have the same layout and size.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg

from eqjax.calibration.statistics import hessian
from eqjax.core.analysis import WeightUse, from_weight_matrix, weight_matrix
from eqjax.core.errors import InputError
from eqjax.core.numerics import QuantSpec, quantize_with, range_to_qparams, symmetric_bounds
from eqjax.core.qarray import QArray, QArrayError, describe_granularity, per_channel, per_group
from eqjax.distributed.mesh import put
from eqjax.methods.grid import gran_group_ids, grids_to_param, group_ids, place_grid, search_grid
from eqjax.methods.rtn import concrete_spec, step_targets, unused_rule_error, weight_step_spec
from eqjax.recipes.rules import Rule, assign, rule_from_dict
from eqjax.recipes.schema import step_kwargs

__all__ = ["GPTQ", "GPTQWarning", "gptq_quantize", "gptq_matrix", "group_size_for", "hessian_cholesky"]

log = logging.getLogger("eqjax")

_ROW_CHUNK_BYTES = 64 << 20  # float32 weight rows per GPTQ sweep: see gptq_matrix
_FACTOR_FILL_BYTES = 16 << 20  # Hessian columns per block when the float64 factor copy is filled


class GPTQWarning(UserWarning):
    """GPTQ had to increase the damping of a non-positive-definite Hessian."""


def group_size_for(in_features: int, requested: int | None) -> int | None:
    """The group size used for an input width: ``requested``, capped at ``in_features`` (a width that
    ``requested`` does not divide gets a shorter last group). ``None`` (per-channel) stays None."""
    if requested is None:
        return None
    requested = int(requested)
    if requested < 1:
        raise ValueError(f"group size must be >= 1, got {requested}")
    return min(requested, int(in_features))


def hessian_cholesky(
    h: np.ndarray, percdamp: float = 0.01, *, max_damp_tries: int = 4, name: str = "layer",
    order: np.ndarray | None = None,
) -> tuple[np.ndarray, float]:
    """Upper Cholesky factor ``U`` of ``(H' + damp I)^-1`` (float64) and the damping fraction used, where
    ``H' = H[order][:, order]`` (``order``: a permutation of the ``K`` inputs; None: ``H`` as it is).

    ``damp = percdamp * mean(diag H)``; on failure (non-positive-definite) ``percdamp`` is multiplied
    by 10 up to ``max_damp_tries`` more times, warning (:class:`GPTQWarning`) with ``name``. ``H`` stays
    in its dtype: the one float64 copy is the permuted matrix itself (:func:`_inverse_upper_factor`).
    """
    h = np.asarray(h)
    diag = np.diag(h) if order is None else np.diag(h)[np.asarray(order)]
    mean_diag = float(np.mean(np.abs(diag.astype(np.float64))))
    if not np.isfinite(mean_diag):
        raise ValueError(f"{name}: the GPTQ Hessian has non-finite entries")
    if mean_diag == 0.0:
        mean_diag = 1.0
    pd = percdamp
    for attempt in range(max_damp_tries + 1):
        u = _inverse_upper_factor(h, pd * mean_diag, order)
        if u is not None and np.all(np.isfinite(u)):
            if attempt:
                warnings.warn(
                    f"{name}: GPTQ Hessian is not positive definite with damping {percdamp:g}; "
                    f"used damping {pd:g} of mean(diag H)",
                    GPTQWarning,
                    stacklevel=3,
                )
            return u, pd
        pd *= 10.0
    raise ValueError(
        f"{name}: GPTQ Hessian is not positive definite even with damping {pd / 10:g} x mean(diag H); "
        "check the calibration data"
    )


def _inverse_upper_factor(h: np.ndarray, damp: float, order: np.ndarray | None = None) -> np.ndarray | None:
    """Upper ``U`` with positive diagonal and ``U^T U = (h' + damp I)^-1`` (``h' = h[order][:, order]``), or
    None if ``h' + damp I`` is not positive definite. With ``R`` the reversal of the inputs,
    ``R (h' + damp I) R = L L^T`` gives ``(h' + damp I)^-1 = (R L^-1 R)^T (R L^-1 R)`` and ``R L^-1 R`` is
    upper: one Cholesky and one triangular inverse (2/3 K^3 flops) on one K x K float64 copy, where
    inverting ``H`` and factoring the inverse costs about 3 K^3 and three copies (1.6 GB each at K = 14336).
    The copy is filled column block by column block straight from ``h`` (a permuted float32 ``h'`` would be
    one more K x K temporary)."""
    k = h.shape[0]
    q = (np.arange(k) if order is None else np.asarray(order))[::-1]
    a = np.empty((k, k), np.float64, order="F")
    step = max(1, _FACTOR_FILL_BYTES // (h.itemsize * max(k, 1)))
    for j in range(0, k, step):
        a[:, j:j + step] = h[np.ix_(q, q[j:j + step])]
    a[np.diag_indices_from(a)] += damp
    c, info = scipy.linalg.lapack.dpotrf(a, lower=1, clean=1, overwrite_a=1)
    if info != 0:
        return None
    c, info = scipy.linalg.lapack.dtrtri(c, lower=1, overwrite_c=1)
    return c[::-1, ::-1] if info == 0 else None


def _qparams(lo: jax.Array, hi: jax.Array, bits: int, symmetric: bool, scale_dtype: str, full_range: bool = False):
    """(stored scale, float32 scale, float32 zero point) of a range; symmetric zero point 0."""
    scale, zp = range_to_qparams(lo, hi, bits, symmetric, scale_dtype, full_range)
    s32 = scale.astype(jnp.float32)
    z32 = jnp.zeros_like(s32) if zp is None else zp.astype(jnp.float32)
    return scale, s32, z32, zp


def _quant(w, s, z, bits: int, symmetric: bool):
    if symmetric:
        lo, hi = symmetric_bounds(bits)
        return jnp.clip(jnp.round(w / s), lo, hi) * s
    return (jnp.clip(jnp.round(w / s) + z, 0, 2**bits - 1) - z) * s


@functools.partial(jax.jit, static_argnames=("bits", "symmetric"))
def _gptq_block(w1, u1, s_cols, z_cols, *, bits: int, symmetric: bool):
    """One lazy block: ``w1 [out, B]``, ``u1 [B, B]`` (upper), per-column grids ``[B, out]``.

    Returns ``(q1 [out, B], err1 [out, B])``.
    """

    def body(i, carry):
        w1, q1, e1 = carry
        w = jax.lax.dynamic_index_in_dim(w1, i, axis=1, keepdims=False)
        d = u1[i, i]
        q = _quant(w, s_cols[i], z_cols[i], bits, symmetric)
        err = (w - q) / d
        w1 = w1 - err[:, None] * u1[i][None, :]  # U upper: columns < i get 0
        q1 = jax.lax.dynamic_update_index_in_dim(q1, q, i, axis=1)
        e1 = jax.lax.dynamic_update_index_in_dim(e1, err, i, axis=1)
        return w1, q1, e1

    z = jnp.zeros_like(w1)
    _, q1, e1 = jax.lax.fori_loop(0, w1.shape[1], body, (w1, z, z))
    return q1, e1


@functools.partial(jax.jit, static_argnames=("n_groups", "bits", "symmetric", "blocksize", "static", "scale_dtype",
                                             "starts", "full_range"))
def _gptq_core(W, U, perm, gid, n_groups, grid=None, *, bits: int, symmetric: bool, blocksize: int, static: bool,
               scale_dtype: str, starts: tuple[int, ...], full_range: bool = False):
    """The whole GPTQ sweep of ``W [out, in]`` (dead inputs already zeroed, original order).

    ``U``: upper Cholesky factor of the damped inverse Hessian in permuted order; ``perm``: the
    permutation; ``gid [in]``: the grid (group) of each input in original order, ``n_groups`` of
    them (one scale per group and output); ``starts``: the first input of each group (only used
    without ``static``: the grid is then computed from the error-updated weights when the sweep
    reaches a lazy block holding the group's start). Returns ``(Q [out, in] original order, stored
    scales [n_groups, out], stored zero points [n_groups, out] or None)``.
    """
    n_out, n_in = W.shape

    def grid_of(wcols_mask_w):
        w, mask = wcols_mask_w
        lo = jnp.min(jnp.where(mask, w, jnp.inf), axis=1)
        hi = jnp.max(jnp.where(mask, w, -jnp.inf), axis=1)
        if symmetric:
            a = jnp.maximum(jnp.abs(lo), jnp.abs(hi))
            lo, hi = -a, a
        return _qparams(lo, hi, bits, symmetric, scale_dtype, full_range)

    def all_grids(w):  # every group's range in one pass over w: O(out x in) memory, not O(groups x out x in)
        lo = jax.ops.segment_min(w.T, gid, num_segments=n_groups)  # [n_groups, out]
        hi = jax.ops.segment_max(w.T, gid, num_segments=n_groups)
        if symmetric:
            a = jnp.maximum(jnp.abs(lo), jnp.abs(hi))
            lo, hi = -a, a
        return _qparams(lo, hi, bits, symmetric, scale_dtype, full_range)

    if grid is not None:  # precomputed static grids (e.g. searched): stored scale and zero point
        stored, zps = grid
        s_all = stored.astype(jnp.float32)
        z_all = jnp.zeros_like(s_all) if zps is None else zps.astype(jnp.float32)
    else:  # without static groups these are placeholders, replaced per group below
        stored, s_all, z_all, zps = all_grids(W)
    Wp = W[:, perm]
    gp = gid[perm]
    q_blocks = []
    for i1 in range(0, n_in, blocksize):
        i2 = min(i1 + blocksize, n_in)
        if not static:  # groups starting in [i1, i2): grid from the current (error-updated) weights
            Wcur = jnp.zeros_like(W).at[:, perm].set(Wp)
            for g, st in enumerate(starts):
                if i1 <= st < i2:
                    sc, s32, z32, zp = grid_of((Wcur, (gid == g)[None, :]))
                    stored = stored.at[g].set(sc)
                    s_all = s_all.at[g].set(s32)
                    z_all = z_all.at[g].set(z32)
                    if zps is not None:
                        zps = zps.at[g].set(zp)
        cols = gp[i1:i2]
        q1, e1 = _gptq_block(Wp[:, i1:i2], U[i1:i2, i1:i2], s_all[cols], z_all[cols], bits=bits, symmetric=symmetric)
        q_blocks.append(q1)
        if i2 < n_in:
            Wp = Wp.at[:, i2:].add(-jnp.matmul(e1, U[i1:i2, i2:], precision="highest"))
    Q = jnp.concatenate(q_blocks, axis=1)
    Q = Q[:, jnp.argsort(perm)]
    return Q, stored, (None if symmetric else zps)


def gptq_matrix(
    w2: Any,
    hessian: Any,
    gid: np.ndarray,
    n_groups: int,
    *,
    bits: int = 4,
    symmetric: bool = False,
    act_order: bool = True,
    static_groups: bool = False,
    percdamp: float = 0.01,
    blocksize: int = 128,
    scale_dtype: str = "float16",
    max_damp_tries: int = 4,
    full_range: bool = False,
    grid: str = "minmax",
    grid_kwargs: Mapping[str, Any] | None = None,
    name: str = "kernel",
    mesh: Any = None,
    max_rows: int | None = None,
) -> tuple[Any, jax.Array, jax.Array | None]:
    """GPTQ of a canonical weight ``w2 [K, N]`` given ``H [K, K]`` (any positive multiple of ``X^T X``).

    ``gid [K]`` assigns each input to one of ``n_groups`` grids (one scale per grid and output).
    Act-order implies static grids (each input keeps the grid of its own group). ``grid="search"``:
    static grids searched up front on the original weights, weighted by ``H``
    (:func:`eqjax.methods.grid.search_grid` with ``grid_kwargs``). Returns ``(Q [K, N] float32 on the
    grid, stored scales [n_groups, N], zero points [n_groups, N] or None)``, jax arrays; with a
    multi-device ``mesh`` (and the min/max grid) the ``N`` output channels of ``Q`` were quantized split
    over the mesh's devices (bitwise the same values). On one device the ``N`` output
    channels are swept ``max_rows`` at a time (default: as many as 64 MiB of float32 weights hold), which
    bounds the sweep's working copies of the weight without changing its values.
    """
    w_in = np.asarray(w2, np.float32)
    if w_in.ndim != 2:
        raise ValueError(f"{name}: GPTQ needs a [K, N] matrix, got shape {w_in.shape}")
    n_in, _ = w_in.shape
    h = np.asarray(hessian)  # kept in its float dtype until the factorization's one float64 copy
    if h.dtype not in (np.float32, np.float64):
        h = h.astype(np.float64)
    if h.shape != (n_in, n_in):
        raise ValueError(f"{name}: Hessian shape {h.shape} does not match the weight's input width {n_in}")
    if blocksize < 1:
        raise ValueError(f"{name}: blocksize must be >= 1")
    if grid not in ("minmax", "search"):
        raise ValueError(f"{name}: GPTQ grid must be 'minmax' or 'search', got {grid!r}")
    static = static_groups or act_order or n_groups == 1 or grid == "search"
    dead = np.diag(h) == 0
    if dead.any():
        h = h.copy()
        h[dead, dead] = 1.0
        w_in = w_in.copy()
        w_in[dead] = 0.0
    fixed = None
    if grid == "search":
        sc, zp0, _ = search_grid(w_in, h, gid, n_groups, bits=bits, symmetric=symmetric, full_range=full_range,
                                 scale_dtype=scale_dtype, **dict(grid_kwargs or {}))
        fixed = (sc, zp0)
    perm = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(n_in)
    u, _ = hessian_cholesky(h, percdamp, max_damp_tries=max_damp_tries, name=name, order=perm)
    starts = tuple(int(np.argmax(gid == g)) for g in range(n_groups)) if not static else ()
    # float32 on the host first, the float64 factor dropped, then the one device copy: jnp.asarray(u, float32)
    # straight from float64 peaks at three times the float32 size (2.3 GiB above the factor at K = 14336)
    u32 = np.asarray(u, np.float32)
    del u
    shared = (jnp.asarray(u32), jnp.asarray(perm, jnp.int32), jnp.asarray(gid, jnp.int32))
    del u32
    kw = dict(bits=bits, symmetric=symmetric, blocksize=int(blocksize), static=bool(static), scale_dtype=scale_dtype,
              starts=starts, full_range=bool(full_range))
    n_out = w_in.shape[1]
    if fixed is None and mesh is not None and mesh.size > 1 and n_out % mesh.size == 0:
        Q, scale, zp = _gptq_columns(mesh, jnp.asarray(w_in.T), *shared, n_groups, **kw)
        return jnp.transpose(Q), scale, zp
    # Output channels in equal chunks (one compiled sweep for all): given U, GPTQ treats each output channel on
    # its own, so the sweep's [out, in] working copies (the reference's orientation) are bounded by the chunk
    # and the result is written in place into one [K, N] jax array (a 128k-row LM head would need several of
    # 2 GB; a numpy result would need one more copy to become the jax array the caller keeps).
    rows = max_rows or max(1, _ROW_CHUNK_BYTES // (4 * n_in))
    rows = -(-n_out // -(-n_out // rows))
    Q = jnp.zeros((n_in, n_out), jnp.float32)
    scales, zps = [], []
    for r in range(0, n_out, rows):
        sl = slice(r, r + rows)
        fx = None if fixed is None else (fixed[0][:, sl], None if fixed[1] is None else fixed[1][:, sl])
        q, sc, z = _gptq_core(jnp.asarray(w_in[:, sl].T), *shared, n_groups, fx, **kw)
        Q = _put_columns(Q, q, r)
        scales.append(sc)
        zps.append(z)
    scale = scales[0] if len(scales) == 1 else jnp.concatenate(scales, axis=1)
    zp = None if zps[0] is None else zps[0] if len(zps) == 1 else jnp.concatenate(zps, axis=1)
    return Q, scale, zp


def _gptq_columns(mesh: Any, W: jax.Array, U: jax.Array, perm: jax.Array, gid: jax.Array, n_groups: int,
                  **kw: Any) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """:func:`_gptq_core` with the output channels (rows of ``W [out, in]``) split over every device of
    ``mesh`` (:mod:`eqjax.distributed`): given the shared ``U``, GPTQ treats each output channel on its
    own, and a row split rounds every matmul exactly as one device does, so the result is bitwise the
    same. ``Q [out, in]`` and the grids ``[n_groups, out]`` come back split along ``out``."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P


    axes = tuple(mesh.axis_names)
    W = put(W, NamedSharding(mesh, P(axes, None)))
    U, perm, gid = (put(a, NamedSharding(mesh, P())) for a in (U, perm, gid))
    out = _sharded_core(mesh, n_groups, tuple(sorted(kw.items())))(W, U, perm, gid)
    return (out[0], out[1], out[2] if len(out) == 3 else None)


@functools.lru_cache(maxsize=64)
def _sharded_core(mesh: Any, n_groups: int, kw_items: tuple) -> Any:
    from jax.sharding import PartitionSpec as P

    kw = dict(kw_items)
    axes = tuple(mesh.axis_names)
    rows, cols, rep = P(axes, None), P(None, axes), P()
    asym = not kw["symmetric"]

    def local(w, u, p, g):
        q, s, z = _gptq_core(w, u, p, g, n_groups, **kw)
        return (q, s, z) if asym else (q, s)

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(rows, rep, rep, rep),
                                 out_specs=(rows, cols, cols) if asym else (rows, cols), check_vma=False))


@functools.partial(jax.jit, donate_argnums=0)
def _put_columns(Q: jax.Array, q: jax.Array, start: jax.Array) -> jax.Array:
    """``Q [K, N]`` with columns ``start:start + rows`` set to ``q.T`` (``q [rows, K]``), in place (``Q`` donated)."""
    return jax.lax.dynamic_update_slice(Q, q.T, (0, start))


def gptq_quantize(kernel: Any, hessian: Any, *, group_size: int | None = 128, scale_dtype: str | None = None,
                  **kw: Any) -> QArray:
    """GPTQ of one 2-D ``[in, out]`` kernel (groups along ``in``, a short last group where the group
    does not divide it); returns a QArray whose dequantization is exactly GPTQ's result."""
    w = np.asarray(kernel, np.float32)
    if w.ndim != 2:
        raise ValueError(f"GPTQ needs a 2-D [in, out] kernel, got shape {w.shape}")
    if group_size is not None and not 1 <= group_size <= w.shape[0]:
        raise QArrayError(f"group size {group_size} must be in 1..{w.shape[0]} (the input width)")
    gid, ng = group_ids((w.shape[0],), group_size)
    sd = scale_dtype or ("float16" if group_size is not None else "float32")
    Q, scale, zp = gptq_matrix(w, hessian, gid, ng, scale_dtype=sd, **kw)
    gran = per_channel(1) if group_size is None else per_group(0, group_size)
    shape = (1, w.shape[1]) if group_size is None else scale.shape
    return _quantize_with(jnp.asarray(Q), scale.reshape(shape), None if zp is None else zp.reshape(shape),
                          bits=kw.get("bits", 4), granularity=gran)


# One compiled program per shape instead of op-by-op dispatch (GPTQ's values are finite by construction).
_quantize_with = jax.jit(quantize_with, static_argnames=("bits", "granularity"))


@dataclasses.dataclass(frozen=True)
class GPTQ:
    """GPTQ recipe step: quantize the float matmul weights (role ``matmul`` matching ``pattern``),
    block by block, each block calibrated on the outputs of the already-quantized blocks.

    Weights of any rank: the canonical ``[K, N]`` matrix (contracted axes flattened, groups along the
    flattened contraction: :func:`eqjax.core.roles.input_group_axes`) is quantized and written back in the param's layout. With
    ``true_sequential`` the input groups of a block (q/k/v, o, gate/up, down) are quantized one after
    another, each calibrated with the earlier groups already quantized. The first ``sink_tokens``
    positions of every calibration window get ``sink_weight`` in the Hessian (see
    :mod:`eqjax.calibration.calibrate`). Default: the first token weighs as 32 tokens. Why: the attention-sink
    token's key and value are read by every later query of the window (most of the attention mass in
    SmolLM2), so an error in its ``v_proj`` output reaches every position, while ``H`` counts it as one
    token in 512; with weight 1, GPTQ trades the sink's error away for the other tokens' (SmolLM2
    layer 20 ``v_proj``: the sink's output error 8x RTN's while the other tokens' fell to 0.3x). Measured
    on SmolLM2-135M, RoPE base 1e4 (bench/flax_models.py protocol: 16 x 512 calibration, 4 x 1024
    evaluation tokens; FP 19.20, RTN on ``v_proj`` only 19.30): GPTQ on ``v_proj`` only 21.33 with
    weight 1, 19.22 with 32; GPTQ on the attention projections only, first token excluded 27.08, weight
    1 21.76, RTN 20.64. Down-weighting (0.01) is worse still on the whole model (29.9). The weight is a
    measured choice, not derived (the same for every projection, though only keys/values need it).

    ``rules`` (optional): per-layer formats, e.g. a mixed-precision search's solution. Each still-float
    matmul weight takes the weight spec of its first matching rule (its bits, symmetry, group or
    per-channel layout, scale dtype, full range) instead of ``bits`` / ``group_size`` / ``symmetric`` /
    ``scale_dtype`` / ``full_range``; ``pattern`` still limits the step. Rules are weight-only (no
    ``act_bits``); a rule without a weight (``skip``) keeps its matches in float. Every layer is quantized
    in the same block-by-block pass, so a mix costs one GPTQ run.
    """

    bits: int = 4
    group_size: int | None = 128
    symmetric: bool = False
    act_order: bool = True
    static_groups: bool = False
    percdamp: float = 0.01
    blocksize: int = 128
    scale_dtype: str | None = None
    pattern: str = ".*"
    role: str = "matmul"
    sink_tokens: int = 1
    sink_weight: float = 32.0
    true_sequential: bool = False
    full_range: bool = True
    grid: str = "minmax"
    grid_weighting: str = "hessian"
    grid_n: int = 64
    grid_min_ratio: float = 0.5
    grid_refine: int = 4
    rules: tuple[Rule, ...] = ()
    name: str = "gptq"
    needs_calibration = True
    advance = "new"  # block inputs: see eqjax.calibration.calibrate.Calibrator.run_blocks

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 2 <= self.bits <= 8:
            raise ValueError(f"gptq: bits must be an int in 2..8, got {self.bits!r}")
        if self.group_size is not None and (isinstance(self.group_size, bool) or not isinstance(self.group_size, int)
                                            or self.group_size < 1):
            raise ValueError(f"gptq: group_size must be an int >= 1 or None, got {self.group_size!r}")
        if not self.percdamp > 0:
            raise ValueError(f"gptq: percdamp must be > 0, got {self.percdamp}")
        if self.grid not in ("minmax", "search"):
            raise ValueError(f"gptq: grid must be 'minmax' or 'search', got {self.grid!r}")
        if self.grid_weighting not in ("hessian", "diagonal", "none"):
            raise ValueError(f"gptq: grid_weighting must be 'hessian', 'diagonal' or 'none', got {self.grid_weighting!r}")
        Rule(self.pattern, role=self.role)  # validates the pattern and role
        for r in self.rules:
            if not isinstance(r, Rule):
                raise ValueError(f"gptq: rules must be Rule objects, got {type(r).__name__}")
            if r.act_bits is not None:
                raise ValueError(f"gptq: rule {r.pattern!r} quantizes activations; GPTQ rules are weight-only")
            if r.weight is None:
                continue
            if not 2 <= r.weight.bits <= 8:
                raise ValueError(f"gptq: rule {r.pattern!r} has {r.weight.bits} bits; GPTQ takes 2..8")
            if r.weight.granularity.kind == "tensor":
                raise ValueError(f"gptq: rule {r.pattern!r} is per-tensor; GPTQ needs per-channel or group scales")
            if r.weight.calibrator not in ("minmax", "absmax"):
                raise ValueError(f"gptq: rule {r.pattern!r} asks for the {r.weight.calibrator!r} calibrator; GPTQ's "
                                 "grids are min/max or searched (the step's grid setting)")

    def spec(self) -> QuantSpec:
        """The stored format (:func:`eqjax.methods.rtn.weight_step_spec`)."""

        return weight_step_spec(self.bits, self.symmetric, self.group_size, self.scale_dtype, self.full_range)

    def grid_kwargs(self) -> dict[str, Any]:
        return dict(weighting=self.grid_weighting, n_grid=self.grid_n, min_ratio=self.grid_min_ratio,
                    refine=self.grid_refine)

    def targets(self, params: Mapping[str, Any], ctx: Any) -> tuple[Any, dict[str, QuantSpec]]:
        """The calibrator and ``{path: stored format}`` of the still-float matmul weights this step
        quantizes (``spec()`` for all, or each one's first matching rule); InputError if none."""

        cal, paths = step_targets(self, params, ctx)
        if not self.rules:
            return cal, {p: self.spec() for p in paths}
        chosen, unused = assign({p: params[p] for p in paths}, self.rules, cal.analysis.roles)
        partial = getattr(ctx, "partial", False)  # one unit of a streamed model: the caller checks the rules
        for rule in () if partial else unused:
            err = unused_rule_error(self.name, rule, sorted(paths), chosen, "float matmul weight",
                                    roles=cal.analysis.roles)
            if err is not None:
                raise err
        specs = {p: r.weight for p, r in chosen.items() if r.weight is not None}
        if not specs and not partial:
            raise InputError(f"{self.name}: no rule with a weight format matches a float matmul weight "
                             f"(rules: {', '.join(repr(r.pattern) for r in self.rules)})")
        return cal, specs

    def __call__(self, params: Mapping[str, Any], ctx: Any) -> dict[str, Any]:
        cal, specs = self.targets(params, ctx)
        if not specs:
            return dict(params)
        targets = set(specs)
        an = cal.analysis
        grids: dict[str, list] = {}

        def per_block(bc: Any, p: dict[str, Any]) -> dict[str, Any]:
            uses = [u for u in bc.uses if u.path in targets]
            groups = bc.groups if self.true_sequential else [tuple(uses)]
            for group in groups:
                group = [u for u in group if u.path in targets]
                if not group:
                    continue
                stats = bc.statistics({"h": hessian()}, group, p, sink_tokens=self.sink_tokens,
                                      sink_weight=self.sink_weight)
                for u in group:  # each Hessian is dropped once used (float32 here; float64 only inside _one)
                    p[u.path] = self._one(p[u.path], u, np.asarray(stats.pop(u.path)["h"]), an, grids, bc.mesh,
                                          specs[u.path])
            return p

        out = cal.run_blocks(params, per_block, advance=self.advance, progress=ctx.progress, desc=self.name)
        for path, parts in grids.items():
            gran, scale, zp = parts
            bits, sym = specs[path].bits, specs[path].symmetric
            out[path] = _quantize_with(jnp.asarray(out[path], jnp.float32), scale, zp, bits=bits, granularity=gran)
            out[path] = dataclasses.replace(out[path], dtype=jnp.dtype(params[path].dtype))
            ctx.report.append((path, f"{self.name}: int{bits} {'sym' if sym else 'asym'} "
                                      f"{describe_granularity(gran, tuple(params[path].shape))}"))
        return out

    def _one(self, w: Any, u: WeightUse, h: np.ndarray, an: Any, grids: dict, mesh: Any, spec: QuantSpec) -> Any:
        if u.batch:
            raise InputError(f"{self.name}: {u.path} is used with batch axes; GPTQ needs a plain matmul weight")
        spec = concrete_spec(spec, an, u.path, u.shape)
        gran = spec.granularity
        if gran.kind == "tensor":
            raise InputError(f"{self.name}: {u.path}: GPTQ needs per-channel or group scales, not per-tensor")
        dims = tuple(u.shape[a] for a in u.contracting)
        gid, ng = gran_group_ids(dims, gran)
        Q2, scale, zp = gptq_matrix(
            weight_matrix(w, u), h, gid, ng, bits=spec.bits, symmetric=spec.symmetric, act_order=self.act_order,
            static_groups=self.static_groups, percdamp=self.percdamp, blocksize=self.blocksize,
            scale_dtype=spec.scale_dtype, full_range=spec.full_range, grid=self.grid, grid_kwargs=self.grid_kwargs(),
            name=u.path, mesh=mesh,
        )
        old = grids.get(u.path, (None, None, None))
        sp = place_grid(old[1], grids_to_param(scale, u, gran), u, gran)
        zpp = None if zp is None else place_grid(old[2], grids_to_param(zp, u, gran), u, gran)
        grids[u.path] = (gran, sp, zpp)
        return from_weight_matrix(jnp.asarray(Q2), u, w)

    @classmethod
    def from_config(cls, d: Mapping[str, Any]) -> "GPTQ":

        d = dict(d)
        rules = d.pop("rules", None)
        if rules is not None and not isinstance(rules, list):
            raise ValueError("a 'gptq' step's 'rules' must be a list of rule tables")
        rules = tuple(rule_from_dict(r) for r in rules or ())
        return cls(**step_kwargs(cls, d, "gptq", exclude=("rules",)), rules=rules)
