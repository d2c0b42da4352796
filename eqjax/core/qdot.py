"""eqjax's quantized matmul and quantized row gather at a program's weight / embedding uses.

:func:`weight_dot` replaces one ``dot_general`` whose weight operand is a quantized param:

* :class:`~eqjax.core.qarray.ActQuantKernel` (W8A8, W4A8): the activation is brought to ``[M, K]`` rows
  (its contracted axes in the weight's canonical order), quantized per token and multiplied in
  integers by :func:`eqjax.core.linear.act_quant_matmul` (``int8 x int8 -> int32``); the ``[M, N]`` result
  is put back into the dot's own output layout. Any weight rank and either operand side.
* :class:`~eqjax.core.qarray.RotatedKernel`: the activation is rotated along its contracted axis (fast
  Hadamard transform, :mod:`eqjax.core.hadamard`), then the inner kernel's dot as above (float or quantized).
* :class:`~eqjax.core.qarray.PermutedKernel`: the activation's contracted features are gathered in the
  kernel's row order (activation-ordered GPTQ groups), then the inner kernel's dot as above.
* :class:`~eqjax.core.qarray.HalfFloat` (a float weight stored in 16 bits): widened, then the dot as the model
  wrote it.
* :class:`~eqjax.core.qarray.QArray` (weight-only): with a Pallas backend and a plain ``[in, out]``
  right-hand weight, the packed kernel; otherwise the weight is dequantized in the param's own
  layout, its layout ops replayed, and the dot bound as the model wrote it (same numerics as the
  float model on the dequantized weight).

:func:`embedding_gather` gathers the codes and scales of the looked-up rows only and dequantizes them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from eqjax.core.analysis import EmbeddingUse, WeightUse
from eqjax.core.errors import InputError
from eqjax.core.linear import act_quant_matmul, current_backend, matmul_2d, w8a8_k_order
from eqjax.core.numerics import dequantize, dequantize_leaf
from eqjax.core.program import Node, Program
from eqjax.core.qarray import ActQuantKernel, HalfFloat, PermutedKernel, QArray, RotatedKernel, is_quantized
from eqjax.core.views import apply_view, bind

__all__ = ["weight_dot", "embedding_gather", "activation_rows", "assemble_output"]


def activation_rows(x: jax.Array, use: WeightUse, order: tuple[int, ...] | None = None) -> jax.Array:
    """The activation as ``[M, K]``: rows over its free axes, columns over the axes paired with the
    weight's contracted axes taken in ``order`` (param axes; default ascending)."""
    order = use.contracting if order is None else order
    pair = dict(zip(use.contracting, use.x_contracting))
    others = tuple(a for a in range(x.ndim) if a not in use.x_contracting)
    return jnp.transpose(x, others + tuple(pair[a] for a in order)).reshape(-1, use.k)


def assemble_output(y2: jax.Array, use: WeightUse, node: Node, prog: Program, x: jax.Array) -> jax.Array:
    """``[M, N]`` (N over the weight's free axes in param order) -> the dot's output layout."""
    others = [a for a in range(x.ndim) if a not in use.x_contracting]
    y = y2.reshape([x.shape[a] for a in others] + [use.shape[p] for p in use.free])
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    wc, wb = (rc, rb) if use.side == 1 else (lc, lb)
    w_ndim = len(prog.shape(node.ins[use.side]))
    op_free = [use.view.axes[a] for a in range(w_ndim) if a not in wc and a not in wb]
    nx = len(others)
    w_perm = [nx + use.free.index(p) for p in op_free if p is not None]
    x_part = list(range(nx))
    y = jnp.transpose(y, (x_part + w_perm) if use.side == 1 else (w_perm + x_part))
    return y.reshape(prog.avals[node.outs[0]].shape)


def _plain(use: WeightUse) -> bool:
    return use.side == 1 and use.contracting == (0,) and use.free == (1,) and len(use.shape) == 2 and not use.view.index


def weight_dot(prog: Program, use: WeightUse, node: Node, x: jax.Array, w: Any) -> jax.Array:
    """The dot at ``use`` with the quantized param ``w`` (QArray, ActQuantKernel, RotatedKernel, PermutedKernel
    or HalfFloat)."""
    out_dtype = prog.avals[node.outs[0]].dtype
    if isinstance(w, HalfFloat):
        operand = apply_view(prog, use, dequantize_leaf(w))
        return bind(node, [x, operand] if use.side == 1 else [operand, x])[0]
    if isinstance(w, (RotatedKernel, PermutedKernel)):
        if use.contracting != (w.axis,) or use.batch or use.view.index:
            what = "an online-rotated" if isinstance(w, RotatedKernel) else "an input-permuted"
            raise InputError(f"{use.path}: {what} weight must be used with its axis {w.axis} as the only "
                             f"contracted axis (found {use.contracting}) and no batch or stacked axes")
        k = use.x_contracting[0]
        x = w.rotate_input(x, axis=k) if isinstance(w, RotatedKernel) else w.gather_input(x, axis=k)
        if is_quantized(w.kernel):
            return weight_dot(prog, use, node, x, w.kernel)
        operand = apply_view(prog, use, w.kernel)
        return bind(node, [x, operand] if use.side == 1 else [operand, x])[0]
    if isinstance(w, ActQuantKernel):
        if use.batch or use.view.index:
            raise InputError(f"{use.path}: activation quantization needs a weight used without batch or "
                             "stacked axes")
        order = w8a8_k_order(w.weight, use.contracting)
        y2 = act_quant_matmul(activation_rows(x, use, order), w, order, use.free)
        return assemble_output(y2, use, node, prog, x).astype(out_dtype)
    if current_backend() != "xla" and _plain(use) and use.x_contracting == (x.ndim - 1,) and x.ndim >= 2:
        y2 = matmul_2d(x.reshape(-1, use.k), w)
        return assemble_output(y2, use, node, prog, x).astype(out_dtype)
    operand = apply_view(prog, use, dequantize(w, w.dtype))
    return bind(node, [x, operand] if use.side == 1 else [operand, x])[0]


def embedding_gather(prog: Program, emb: EmbeddingUse, node: Node, w: Any, indices: jax.Array) -> jax.Array:
    """The row gather at ``emb`` from a quantized table: only the looked-up rows are dequantized."""
    if isinstance(w, (RotatedKernel, PermutedKernel, HalfFloat)):
        return bind(node, [apply_view(prog, emb, dequantize_leaf(w, w.dtype)), indices])[0]
    q = w.weight if isinstance(w, ActQuantKernel) else w
    out = prog.avals[node.outs[0]]
    identity = emb.view.axes == tuple(range(len(q.shape))) and not emb.view.index
    along_rows = (q.packed and q.pack_axis == 0) or (q.granularity.kind == "group" and q.granularity.axes == (0,))
    if not identity or along_rows:
        table = apply_view(prog, emb, dequantize(q, q.dtype))
        return bind(node, [table, indices])[0]
    ids = indices[..., 0].reshape(-1)
    take = lambda a: jnp.take(a, ids, axis=0, mode="clip") if a.shape[0] == q.shape[0] else a  # noqa: E731
    rows = QArray(take(q.values), take(q.scale), None if q.zero_point is None else take(q.zero_point),
                  q.bits, q.symmetric, q.granularity, (int(ids.shape[0]),) + tuple(q.shape[1:]), q.dtype)
    return dequantize(rows, out.dtype).reshape(out.shape)

