"""Float64 references of AWQ's scale search (Lin et al., 2023) and SmoothQuant's smoothing factors
(Xiao et al., 2023), written from the published algorithms and eqjax's documented choices, sharing no
code with eqjax (grids from :mod:`tests.methods.ref_grid`).

AWQ (``eqjax.methods.awq`` docs): ``x_mean = mean |x|`` per input channel; for ``r`` in ``{0, 1/n, ...,
(n-1)/n}``: ``s = max(x_mean**r, 1e-4)``, ``s /= sqrt(max s * min s)``; the loss of ``r`` is the output
error ``tr(E^T H E)``, ``H = X^T X / n_tokens``, ``E = W - Q(diag(s) W) / s``, ``Q`` the min/max
quantizer of the weight's format (here: groups along the input, one grid per group and output).

SmoothQuant: ``s_j = max|X_j|**alpha / max|W_j|**(1 - alpha)`` with both maxima (and ``s``) clamped
at ``>= 1e-5``, ``max|W_j|`` over every output of the weights sharing the input.
"""

from __future__ import annotations

import numpy as np

from tests.methods import ref_grid as rg


def fake_quant_groups(w, bits, group, symmetric, full_range, scale_dtype):
    """``Q(w)`` for ``w [K, N]`` in groups of ``group`` rows (a short last group), min/max grid per
    (group, column), plus ``near``: whether any raw scale lies within 3 u of a storage boundary, or any
    ``w / scale`` within 2 u relative of a rounding boundary (where a float32 implementation may differ)."""
    w = np.asarray(w, np.float64)
    out = np.empty_like(w)
    near = False
    for a in range(0, w.shape[0], group):
        blk = w[a:a + group]
        lo, hi = blk.min(0), blk.max(0)
        raw = rg.raw_scale(lo, hi, bits, symmetric, full_range)
        s = rg.round_up_to(raw, scale_dtype)
        lo_s, hi_s = rg.scale_interval(raw, scale_dtype, 3 * rg.U32)
        near |= bool(np.any(lo_s != hi_s)) if scale_dtype != "float32" else False
        zp = None
        if not symmetric:
            zp, ztie = rg.zero_point(lo, s, bits)
            near |= bool(ztie.any())
        t = blk / s
        near |= bool(np.any(rg.distance_to_boundary(t) <= 2 * rg.U32 * np.abs(t)))
        out[a:a + group] = rg.integer_values(blk, s, zp, bits) * s
    return out, near


def awq_scale(x_mean, r):
    s = np.maximum(np.asarray(x_mean, np.float64) ** r, 1e-4)
    return s / np.sqrt(s.max() * s.min())


def awq_losses(w, x, *, bits, group, symmetric, full_range, scale_dtype, n_grid, factor_rank=None):
    """``(losses [n_grid], near [n_grid], bounds [n_grid])``: the float64 loss of every ``r``, whether a
    float32 implementation may round a code or a scale differently there, and a bound on how far a float32
    implementation's loss may lie from it elsewhere (docstring of :func:`loss_bound`; ``factor_rank``: the
    implementation prices the loss through a float32 factor of ``H`` with that many columns)."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    h = x.T @ x / len(x)
    x_mean = np.abs(x).mean(0)
    losses, near, bounds = [], [], []
    for i in range(n_grid):
        s = awq_scale(x_mean, i / n_grid)[:, None]
        qw, nr = fake_quant_groups(w * s, bits, group, symmetric, full_range, scale_dtype)
        e = w - qw / s
        losses.append(float(np.sum((h @ e) * e)))
        near.append(nr)
        bounds.append(loss_bound(w, e, h, x_mean, i / n_grid, factor_rank))
    return np.array(losses), np.array(near), np.array(bounds)


def loss_bound(w, e, h, x_mean, r, factor_rank=None):
    """Float32 error bound of ``tr(E^T H E)`` with the codes fixed, first order in ``u = 2**-24``.

    ``s`` in float32: ``x**r`` is ``exp(r ln x)`` (``(|r ln x| + 2) u``), the normalization three more
    roundings, so ``|ds| / s <= rho = (max |r ln x| + 6) u``. ``E = w - (k scale) / s`` with the
    codes fixed: the grid scale of ``w s`` moves with ``s`` (``rho``, plus 3 u of its own arithmetic), the
    product and quotient round twice, the difference once: ``|dE| <= (2 rho + 6 u) |w| + u |E|``. ``H`` is
    handed over in float64 and stored in float32 (``u |H|`` per entry). The loss then moves by at most
    ``2 |E|^T |H| |dE| + (K + 3) u |E|^T |H| |E|`` (the stored ``H``, the matmul over ``K`` terms, the
    final sum); doubled for the neglected second-order terms.

    Through a factor ``H ~ L L^T`` of ``r`` columns (``||L^T E||^2``): ``|L| |L|^T <= A``, ``A_ij =
    sqrt(H_ii H_jj)`` (Cauchy-Schwarz, as ``(L L^T)_ii <= H_ii``) takes the place of ``|H|``; the stored ``L``,
    the matmul over ``K`` terms squared and the sum over ``r`` give ``(2 K + r + 5) u |E|^T A |E|``; the factor
    leaves out at most ``u tr(H) ||E||_F^2`` (its stopping rule)."""
    lnx = np.abs(np.log(np.maximum(x_mean, 1e-30)))
    rho = (float(np.max(r * lnx)) + 6) * rg.U32
    de = (2 * rho + 6 * rg.U32) * np.abs(w) + rg.U32 * np.abs(e)
    ae = np.abs(e)
    k = h.shape[0]
    if factor_rank is None:
        ah, terms, left_out = np.abs(h), k + 3, 0.0
    else:
        d = np.sqrt(np.diag(h))
        ah, terms, left_out = np.outer(d, d), 2 * k + factor_rank + 5, rg.U32 * np.trace(h) * np.sum(ae**2)
    return 2 * float(2 * np.sum((ah @ ae) * de) + terms * rg.U32 * np.sum((ah @ ae) * ae) + left_out)


def smooth_scales(x_absmax, w_absmax, alpha):
    x = np.maximum(np.asarray(x_absmax, np.float64), 1e-5)
    w = np.maximum(np.asarray(w_absmax, np.float64), 1e-5)
    return np.maximum(x**alpha / w ** (1.0 - alpha), 1e-5)
