"""Float64 GPTQ (Frantar et al., 2022, the reference ``fasterquant``) with its own min/max grid, and a
first-order bound on how far a float32 implementation of the same sweep may drift from it.

Nothing here calls eqjax. The grid follows :mod:`tests.methods.ref_grid`. Orientation: ``W [out, in]``
(the reference's), inputs processed in ``perm`` order (act-order: ``diag H`` descending), lazy blocks of
``blocksize``; each group's grid from the original weights (static: act-order or ``static=True`` or a
single group) or from the weights updated by the earlier lazy blocks when the sweep reaches the lazy block
holding the group's first input (dynamic).

``follow`` (optional) makes the reference take an implementation's choice where the two may legitimately
differ: at a code whose quotient ``w / s`` lies within the drift bound of a rounding boundary, and at a
dynamic grid whose raw scale lies within the drift bound of a storage-format boundary. Every such
acceptance is recorded; any other difference is reported as a mismatch. Following keeps one tie from
cascading through the error feedback into differences that are not ties.

Drift bound (first order in ``u = 2**-24``, float32's unit roundoff; absolute, per element). Local
rounding ``L`` injected into each weight: quantizing column ``c`` rounds ``q = k s`` (``u |q|``), ``w - q``
(``u |w - q|``) and ``err = (w - q) / d`` with ``d = U_cc`` stored in float32 (``2 u |err|``, i.e.
``2 u |err d|`` as a perturbation of ``w_c``); an update ``w_j -= err U_cj`` rounds ``U_cj`` to float32, the
product and the difference (``2 u |err U_cj| + u |w_j|``); a lazy block's trailing update is a matmul over
``B`` terms (``(B + 2) u sum |err U_cj| + u |w_j|``). The inputs are float32, exact. With the codes held
fixed, a perturbation of ``w_k`` reaches the later ``w_j`` linearly through ``M = V^-T``, ``V = diag(U)^-1 U``
(the sweep's ``w_j -= (w_k - q_k) / U_kk U_kj``), so the drift of ``w_j`` when it is quantized is at most
``D_j = sum_k |M_jk| L_k``; a dynamic grid sees ``L_j + sum_k |V_kj| D_k`` over the columns ``k`` already
quantized. A code is a tie when ``w / s`` lies within ``2 (D / s + 2 u |t|)`` of a half-integer (the
quotient's own rounding is ``u |t|``); the factor 2 covers the neglected second-order terms and the two
float64 Cholesky paths (~1e-12 relative).
"""

from __future__ import annotations

import numpy as np

from tests.methods import ref_grid as rg

U = rg.U32


def upper_inverse_cholesky(h: np.ndarray, percdamp: float) -> np.ndarray:
    """``U`` upper with ``U^T U = (H + percdamp mean(diag H) I)^-1``."""
    n = h.shape[0]
    hd = h + np.eye(n) * percdamp * np.mean(np.diag(h))
    return np.linalg.cholesky(np.linalg.inv(hd)).T


def gptq_reference(w, h, *, bits, group_size, symmetric, full_range, act_order, static_groups=False,
                   percdamp=0.01, blocksize=128, scale_dtype="float16", follow=None):
    """GPTQ of a ``[in, out]`` kernel ``w`` with Hessian ``h [in, in]``.

    Returns a dict: ``iv [in, out]`` integer values (code - zp), ``scale`` and ``zp`` ``[n_groups, out]``
    (``zp`` None when symmetric), ``gid [in]``, ``tie [in, out]`` (the code is within the drift bound of a
    rounding boundary), ``followed`` (codes taken from ``follow`` at a tie), ``grid_followed`` (dynamic
    grids taken from ``follow``), ``grid_mismatch`` (dynamic grids ``follow`` disagrees with outside the
    bound). ``follow``: ``(iv [in, out], scale [n_groups, out], zp [n_groups, out] or None)``.
    """
    W = np.asarray(w, np.float64).T.copy()  # [out, in]
    H = np.asarray(h, np.float64).copy()
    n_out, n = W.shape
    dead = np.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    G = n if group_size is None else min(int(group_size), n)
    gid = np.arange(n) // G
    ng = int(gid.max()) + 1
    static = act_order or static_groups or ng == 1
    perm = np.argsort(-np.diag(H), kind="stable") if act_order else np.arange(n)
    Uf = upper_inverse_cholesky(H[np.ix_(perm, perm)], percdamp)
    f_iv = f_s = f_z = None
    if follow is not None:
        f_iv, f_s, f_z = follow
        f_iv = np.asarray(f_iv, np.float64).T  # [out, in]
        f_s = np.asarray(f_s, np.float64)
        f_z = None if f_z is None else np.asarray(f_z, np.float64)

    scale = np.zeros((ng, n_out))
    zp = None if symmetric else np.zeros((ng, n_out))
    grid_followed = np.zeros((ng, n_out), bool)
    grid_mismatch = np.zeros((ng, n_out), bool)

    def set_grid(g, Wcur, Dcur):
        cols = gid == g
        lo = Wcur[:, cols].min(1)
        hi = Wcur[:, cols].max(1)
        # drift of the range ends (dynamic grids only; static ones see the exact inputs)
        dmax = Dcur[:, cols].max(1)
        raw = rg.raw_scale(lo, hi, bits, symmetric, full_range)
        s = rg.round_up_to(raw, scale_dtype)
        # the range ends drift by at most dmax: the raw scale by 2 dmax / (2**b - 1) (asymmetric) or
        # dmax / D (symmetric), relative to raw; plus three float32 roundings (span, quotient, cast)
        steps = (2**bits - 1) / 2 if not symmetric else rg.sym_divisor(bits, full_range)
        rel = 3 * U + 2 * dmax / np.maximum(raw * steps, 1e-300)
        lo_s, hi_s = rg.scale_interval(raw, scale_dtype, rel)
        if scale_dtype == "float32":
            s = raw  # an implementation's float32 scale is checked against [lo_s, hi_s], then followed
        z = None
        if not symmetric:
            z, _ = rg.zero_point(lo, s, bits)
        if f_s is not None:
            fs = f_s[g]
            ok = (fs >= lo_s) & (fs <= hi_s)
            # float32 scales carry the implementation's own rounding: inside the interval is agreement;
            # a stored float16 scale must be the reference's own round-up unless followed at a boundary
            same = (fs == s) if scale_dtype != "float32" else ok.copy()
            if not symmetric:
                fz = f_z[g]
                zz, _ = rg.zero_point(lo, fs, bits)
                zslack = 2 * (dmax / fs + 2 * U * np.abs(lo / fs))
                zok = (fz == zz) | (rg.distance_to_boundary(-np.minimum(lo, 0) / fs) <= zslack)
                ok &= zok
                same &= fz == z if scale_dtype != "float32" else zok
            grid_mismatch[g] = ~ok
            grid_followed[g] = ok & ~same
            s = np.where(ok, fs, s)
            if not symmetric:
                z = np.where(ok, fz, z)
        scale[g] = s
        if not symmetric:
            zp[g] = z

    if static:
        for g in range(ng):
            set_grid(g, W, np.zeros_like(W))
    starts = [int(np.argmax(gid == g)) for g in range(ng)]
    # propagation of a perturbation of w_k to the later w_j: V = diag(U)^-1 U (unit upper), M = V^-T
    V = Uf / np.diag(Uf)[:, None]
    absM = np.abs(np.linalg.inv(V).T)
    Wp = W[:, perm].copy()
    Lp = np.zeros_like(Wp)  # local rounding injected into each element (absolute)
    Dq = np.zeros_like(Wp)  # drift bound of each element when it is quantized
    gp = gid[perm]
    iv = np.zeros_like(Wp)
    tie = np.zeros(Wp.shape, bool)
    followed = np.zeros(Wp.shape, bool)
    slacks = np.zeros(Wp.shape)
    lo_b, hi_b = (None, None) if not symmetric else rg.sym_bounds(bits)
    for i1 in range(0, n, blocksize):
        i2 = min(i1 + blocksize, n)
        if not static:  # the weights updated by the lazy blocks before i1: one hop from each done column
            Dnow = Lp + Dq[:, :i1] @ np.abs(V[:i1, :])
            Wcur, Dcur = np.zeros_like(W), np.zeros_like(W)
            Wcur[:, perm], Dcur[:, perm] = Wp, Dnow
            for g, st in enumerate(starts):
                if i1 <= st < i2:
                    set_grid(g, Wcur, Dcur)
        W1 = Wp[:, i1:i2].copy()
        E1 = np.zeros_like(W1)
        for i in range(i2 - i1):
            c = i1 + i
            g = gp[c]
            s = scale[g]
            wv = W1[:, i]
            t = wv / s
            if symmetric:
                k = np.clip(np.round(t), lo_b, hi_b)
            else:
                k = np.clip(np.round(t) + zp[g], 0, 2**bits - 1) - zp[g]
            Dq[:, c] = Lp[:, :c + 1] @ absM[c, :c + 1]
            slack = 2 * (Dq[:, c] / s + 2 * U * np.abs(t))
            tie[:, c] = rg.distance_to_boundary(t) <= slack
            slacks[:, c] = slack
            if f_iv is not None:
                fk = f_iv[:, perm[c]]
                take = tie[:, c] & (fk != k)
                followed[:, c] = take
                k = np.where(take, fk, k)
            iv[:, c] = k
            q = k * s
            d = Uf[c, c]
            err = (wv - q) / d
            # rounding of q, w - q, the division and d's float32 copy, as a perturbation of w_c
            Lp[:, c] += U * np.abs(q) + U * np.abs(wv - q) + 2 * U * np.abs(err * d)
            row = Uf[c, c + 1:i2]
            W1[:, i + 1:] -= np.outer(err, row)
            Lp[:, c + 1:i2] += 2 * U * np.abs(np.outer(err, row)) + U * np.abs(W1[:, i + 1:])
            E1[:, i] = err
        if i2 < n:
            blk = Uf[i1:i2, i2:]
            Wp[:, i2:] -= E1 @ blk
            Lp[:, i2:] += (i2 - i1 + 2) * U * (np.abs(E1) @ np.abs(blk)) + U * np.abs(Wp[:, i2:])
    inv = np.argsort(perm)
    return {
        "iv": iv[:, inv].T, "scale": scale, "zp": zp, "gid": gid, "tie": tie[:, inv].T,
        "followed": followed[:, inv].T, "slack": slacks[:, inv].T, "grid_followed": grid_followed, "grid_mismatch": grid_mismatch,
    }
