"""GPTQ (Frantar et al., 2022): layer-wise weight quantization with second-order error compensation.

The algorithm follows the reference ``fasterquant`` (IST-DASLab/gptq), transposed to our ``[in, out]``
kernels (the reference's ``W [out, in]`` is ``kernel.T``; its "columns" are our input features):

* ``H = 2 X^T X / n`` over the calibration tokens feeding the layer (:func:`eqjax.calibrate.xtx`);
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

Grids are eqjax's (:func:`eqjax.numerics.range_to_qparams`): asymmetric min/max with an integer zero
point, symmetric ``absmax / (2**(b-1) - 1)``; scales are stored as ``scale_dtype`` (float16 for group
layouts, rounded up) and the GPTQ loop uses exactly those scales, so ``dequantize(result)`` equals the
values GPTQ chose, bit for bit.

A group size that does not divide the input width (SmolLM2's 576 with 128) leaves a shorter last group
(576 = 4 x 128 + 64), as the reference does and as the RTN recipes store it, so GPTQ and RTN results
of the same recipe have the same layout and size.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import warnings
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg

from eqjax import calibrate
from eqjax.numerics import quantize_with, range_to_qparams
from eqjax.pytree import Params, get_path, is_leaf, set_path
from eqjax.qarray import QArray, QArrayError, per_channel, per_group
from eqjax.rules import LINEAR_KERNELS

__all__ = ["GPTQ", "GPTQWarning", "gptq_quantize", "group_size_for", "hessian_cholesky"]

log = logging.getLogger("eqjax")


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
    h: np.ndarray, percdamp: float = 0.01, *, max_damp_tries: int = 4, name: str = "layer"
) -> tuple[np.ndarray, float]:
    """Upper Cholesky factor ``U`` of ``(H + damp I)^-1`` (float64) and the damping fraction used.

    ``damp = percdamp * mean(diag H)``; on failure (non-positive-definite) ``percdamp`` is multiplied
    by 10 up to ``max_damp_tries`` more times, warning (:class:`GPTQWarning`) with ``name``.
    """
    h = np.asarray(h, np.float64)
    n = h.shape[0]
    mean_diag = float(np.mean(np.abs(np.diag(h))))
    if not np.isfinite(mean_diag):
        raise ValueError(f"{name}: the GPTQ Hessian has non-finite entries")
    if mean_diag == 0.0:
        mean_diag = 1.0
    pd = percdamp
    for attempt in range(max_damp_tries + 1):
        hd = h + np.eye(n) * (pd * mean_diag)
        try:
            lower = scipy.linalg.cholesky(hd, lower=True)
            hinv = scipy.linalg.cho_solve((lower, True), np.eye(n))
            hinv = (hinv + hinv.T) / 2
            u = scipy.linalg.cholesky(hinv, lower=False)
            if np.all(np.isfinite(u)):
                if attempt:
                    warnings.warn(
                        f"{name}: GPTQ Hessian is not positive definite with damping {percdamp:g}; "
                        f"used damping {pd:g} of mean(diag H)",
                        GPTQWarning,
                        stacklevel=3,
                    )
                return u, pd
        except (np.linalg.LinAlgError, scipy.linalg.LinAlgError, ValueError):
            pass
        pd *= 10.0
    raise ValueError(
        f"{name}: GPTQ Hessian is not positive definite even with damping {pd / 10:g} x mean(diag H); "
        "check the calibration data"
    )


def _qparams(lo: jax.Array, hi: jax.Array, bits: int, symmetric: bool, scale_dtype: str):
    """(stored scale, float32 scale, float32 zero point) of a range; symmetric zero point 0."""
    scale, zp = range_to_qparams(lo, hi, bits, symmetric, scale_dtype)
    s32 = scale.astype(jnp.float32)
    z32 = jnp.zeros_like(s32) if zp is None else zp.astype(jnp.float32)
    return scale, s32, z32, zp


def _range(w: jax.Array, symmetric: bool) -> tuple[jax.Array, jax.Array]:
    """Per-row range of ``w [out, k]`` -> ``[out]`` each (eqjax's min/max calibrator)."""
    if symmetric:
        a = jnp.max(jnp.abs(w), axis=1)
        return -a, a
    return jnp.min(w, axis=1), jnp.max(w, axis=1)


def _quant(w, s, z, bits: int, symmetric: bool):
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        return jnp.clip(jnp.round(w / s), -qmax, qmax) * s
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


@functools.partial(
    jax.jit, static_argnames=("bits", "symmetric", "group_size", "blocksize", "static", "scale_dtype")
)
def _gptq_core(W, U, perm, *, bits: int, symmetric: bool, group_size: int | None, blocksize: int, static: bool,
               scale_dtype: str):
    """The whole GPTQ sweep of ``W [out, in]`` (dead inputs already zeroed, original order).

    ``U``: upper Cholesky factor of the damped inverse Hessian in permuted order; ``perm``: the
    permutation (identity without act-order). Returns ``(Q [out, in] original order, stored scales
    [n_groups, out], stored zero points [n_groups, out] or None)``.
    """
    n_out, n_in = W.shape
    G = group_size
    n_groups = 1 if G is None else -(-n_in // G)  # a short last group when G does not divide

    def grid(wcols):
        lo, hi = _range(wcols, symmetric)
        return _qparams(lo, hi, bits, symmetric, scale_dtype)

    if G is None or static:
        parts = [grid(W)] if G is None else [grid(W[:, g * G : (g + 1) * G]) for g in range(n_groups)]
        stored = [p[0] for p in parts]
        zps = [p[3] for p in parts]
        s_all = jnp.stack([p[1] for p in parts])
        z_all = jnp.stack([p[2] for p in parts])
    else:
        stored, zps = [None] * n_groups, [None] * n_groups
        s_all = jnp.zeros((n_groups, n_out), jnp.float32)
        z_all = jnp.zeros((n_groups, n_out), jnp.float32)
    group_of_col = jnp.zeros((n_in,), jnp.int32) if G is None else (perm // G).astype(jnp.int32)
    Wp = W[:, perm]
    q_blocks = []
    for i1 in range(0, n_in, blocksize):
        i2 = min(i1 + blocksize, n_in)
        if G is not None and not static:  # groups starting in [i1, i2): grid from the current weights
            for g in range(-(-i1 // G), -(-i2 // G)):
                sc, s32, z32, zp = grid(Wp[:, g * G : (g + 1) * G])
                stored[g], zps[g] = sc, zp
                s_all = s_all.at[g].set(s32)
                z_all = z_all.at[g].set(z32)
        cols = group_of_col[i1:i2]
        q1, e1 = _gptq_block(Wp[:, i1:i2], U[i1:i2, i1:i2], s_all[cols], z_all[cols], bits=bits, symmetric=symmetric)
        q_blocks.append(q1)
        if i2 < n_in:
            Wp = Wp.at[:, i2:].add(-jnp.matmul(e1, U[i1:i2, i2:], precision="highest"))
    Q = jnp.concatenate(q_blocks, axis=1)
    Q = Q[:, jnp.argsort(perm)]
    scale = jnp.stack(stored)
    zp = None if symmetric else jnp.stack(zps)
    return Q, scale, zp


def gptq_quantize(
    kernel: Any,
    hessian: Any,
    *,
    bits: int = 4,
    group_size: int | None = 128,
    symmetric: bool = False,
    act_order: bool = True,
    static_groups: bool = False,
    percdamp: float = 0.01,
    blocksize: int = 128,
    scale_dtype: str | None = None,
    max_damp_tries: int = 4,
    name: str = "kernel",
) -> QArray:
    """GPTQ-quantize one ``[in, out]`` kernel given ``H [in, in]`` (any positive multiple of ``X^T X``).

    ``group_size`` groups along ``in`` (``None``: one scale per output channel); when it does not divide
    ``in`` the last group is shorter. Act-order with groups implies static groups. ``scale_dtype``
    defaults to float16 for groups and float32 per channel (as the RTN recipes). Returns a QArray
    (``per_group(0, G)`` or ``per_channel(1)``) whose dequantization is exactly GPTQ's result.
    """
    w_in = np.asarray(kernel, np.float32)
    if w_in.ndim != 2:
        raise ValueError(f"{name}: GPTQ needs a 2-D [in, out] kernel, got shape {w_in.shape}")
    n_in, n_out = w_in.shape
    h = np.array(hessian, np.float64)
    if h.shape != (n_in, n_in):
        raise ValueError(f"{name}: Hessian shape {h.shape} does not match the kernel's input width {n_in}")
    if group_size is not None and not 1 <= group_size <= n_in:
        raise QArrayError(f"{name}: group size {group_size} must be in 1..{n_in} (the input width)")
    if blocksize < 1:
        raise ValueError(f"{name}: blocksize must be >= 1")
    G = group_size
    if scale_dtype is None:
        scale_dtype = "float16" if G is not None else "float32"
    static = static_groups or (act_order and G is not None)

    W = w_in.T.copy()  # [out, in], the reference's orientation
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    W[:, dead] = 0.0
    perm = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(n_in)
    u, _ = hessian_cholesky(h[np.ix_(perm, perm)], percdamp, max_damp_tries=max_damp_tries, name=name)
    Q, scale, zp = _gptq_core(
        jnp.asarray(W), jnp.asarray(u, jnp.float32), jnp.asarray(perm, jnp.int32), bits=bits, symmetric=symmetric,
        group_size=G, blocksize=int(blocksize), static=bool(static), scale_dtype=scale_dtype,
    )
    if G is None:
        gran = per_channel(1)
        scale = scale.reshape(1, n_out)
        zp = None if zp is None else zp.reshape(1, n_out)
    else:
        gran = per_group(0, G)
    return _quantize_with(Q.T, scale, zp, bits=bits, granularity=gran)


# One compiled program per shape instead of op-by-op dispatch (GPTQ's values are finite by construction).
_quantize_with = jax.jit(quantize_with, static_argnames=("bits", "granularity"))


@dataclasses.dataclass(frozen=True)
class GPTQ:
    """GPTQ recipe step: quantize the float kernels matching ``pattern``, block by block.

    Each block is calibrated on the outputs of the already-quantized blocks (reference behaviour).
    With ``true_sequential`` the linear groups of a block (q/k/v, o, gate/up, down) are also quantized
    one after another, each calibrated with the earlier groups already quantized (one extra pass per
    group). The first ``sink_tokens`` positions of every calibration window get ``sink_weight`` in the
    Hessian (see :mod:`eqjax.calibrate`). Default: keep them (``sink_tokens=0``). Measured on
    SmolLM2-135M (W4 asym act-order, groups of 96 at the time, 32 x 512 calibration tokens, 8 x 1024 evaluation tokens;
    FP 19.92, RTN 25.28): first token kept 24.28, first token excluded 28.30. Excluding it lets GPTQ
    push its compensation into the few channels that carry the sink's huge activation, and the sink
    token (attended by every later token) then breaks.
    """

    bits: int = 4
    group_size: int | None = 128
    symmetric: bool = False
    act_order: bool = True
    static_groups: bool = False
    percdamp: float = 0.01
    blocksize: int = 128
    scale_dtype: str | None = None
    pattern: str = LINEAR_KERNELS
    sink_tokens: int = 0
    sink_weight: float = 0.0
    true_sequential: bool = False
    batch_size: int = 8
    name: str = "gptq"
    needs_calibration = True

    def __post_init__(self) -> None:
        if not 2 <= int(self.bits) <= 8:
            raise ValueError(f"gptq: bits must be in 2..8, got {self.bits}")
        if self.group_size is not None and int(self.group_size) < 1:
            raise ValueError(f"gptq: group_size must be >= 1 or None, got {self.group_size}")
        if not self.percdamp > 0:
            raise ValueError(f"gptq: percdamp must be > 0, got {self.percdamp}")
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ValueError(f"gptq: pattern {self.pattern!r} does not compile: {e}") from None

    def _targets(self, layer_name: str, lp: Params) -> tuple[str, ...]:
        out = []
        for p in calibrate.linear_paths(lp):
            k = get_path(lp, p + "/kernel")
            if is_leaf(k) or not jnp.issubdtype(k.dtype, jnp.floating):
                continue
            if re.fullmatch(self.pattern, f"{layer_name}/{p}/kernel"):
                out.append(p)
        return tuple(out)

    def quantize_kernel(self, kernel: Any, hessian: Any, name: str) -> QArray:
        g = group_size_for(kernel.shape[0], self.group_size)
        return gptq_quantize(
            kernel, hessian, bits=self.bits, group_size=g, symmetric=self.symmetric, act_order=self.act_order,
            static_groups=self.static_groups, percdamp=self.percdamp, blocksize=self.blocksize,
            scale_dtype=self.scale_dtype, name=name,
        )

    def _sequential_groups(self, model: Any, targets: tuple[str, ...]) -> list[tuple[str, ...]]:
        if not self.true_sequential:
            return [targets]
        groups = [tuple(p for p in lin if p in targets) for _, lin in getattr(model, "linear_groups", ())]
        seen = {p for g in groups for p in g}
        groups.append(tuple(p for p in targets if p not in seen))
        return [g for g in groups if g]

    def __call__(self, params: Params, ctx: Any) -> Params:
        ctx.require_calibration(self.name)
        model = ctx.model
        stat = {"xtx": calibrate.xtx()}

        def per_layer(layer_name: str, lp: Params, cal: calibrate.LayerCalibration) -> Params:
            targets = self._targets(layer_name, lp)
            for group in self._sequential_groups(model, targets):
                stats = cal.statistics(stat, lp, linears=group)
                for p in group:
                    k = get_path(lp, p + "/kernel")
                    h = 2.0 * np.asarray(stats[p]["xtx"], np.float64)
                    q = self.quantize_kernel(k, h, f"{layer_name}/{p}/kernel")
                    lp = set_path(lp, p + "/kernel", q)
            return lp

        return calibrate.run_layerwise(
            model, params, ctx.calibration, per_layer, batch_size=self.batch_size,
            progress=getattr(ctx, "progress", False), sink_tokens=self.sink_tokens,
            sink_weight=self.sink_weight, advance="new", desc=self.name,
        )

    @classmethod
    def from_config(cls, d: Mapping[str, Any]) -> "GPTQ":
        from eqjax.recipe import step_kwargs  # noqa: PLC0415

        return cls(**step_kwargs(cls, d, "gptq", exclude=()))
