"""ONNX export of (quantized) Llama-family and GPT-2 models, built node by node with ``onnx.helper``.

Graph (opset 21 + ``com.microsoft`` 1):

* inputs ``input_ids`` int64 ``[batch, seq]``; with ``decode=True`` also ``past_key_<i>`` /
  ``past_value_<i>`` float32 ``[batch, n_kv_heads, past, head_dim]`` (``past`` may be 0: the same graph
  does prefill and decode);
* outputs ``logits`` float32 ``[batch, seq, vocab]``; with ``decode=True`` also ``present_key_<i>`` /
  ``present_value_<i>`` = past concatenated with this call's (post-RoPE) keys/values. The tokens sit at
  positions ``past .. past + seq - 1``. (eqjax's own cache has fixed ``max_len`` slots; the ONNX graph
  grows its cache instead, the usual ONNX convention; the attended keys are the same.)

Every linear layer is emitted from its kernel kind:

==================================  ==========================================================
float ``[in, out]``                 ``MatMul`` (float32 initializer)
QArray, 5..8 bits (weight-only)     ``DequantizeLinear`` (int8 sym / uint8 + zero point asym;
                                    per-tensor, per-axis, or blocked along the input axis,
                                    opset 21 ``block_size``) -> ``MatMul``
QArray, 2 or 4 bits (weight-only)   ``com.microsoft.MatMulNBits``: B uint8 ``[N, K/bs, bs*bits/8]``
                                    (eqjax's packing along the input axis, transposed), scales
                                    ``[N * K/bs]`` float32, zero points packed ``[N * ceil(K/bs
                                    * bits / 8)]`` (omitted for symmetric: the implicit
                                    ``2**(bits-1)`` is MatMulNBits' default). ``bs`` = the group
                                    size (or ``K`` for per-channel); it must be a power of two
                                    >= 16, as the contrib op requires.
ActQuantKernel (W8A8)               per-token (or per-tensor) symmetric int8 activations built by
                                    hand: ``ReduceMax(Abs)`` -> ``Where(amax>0, amax/127, 1)`` ->
                                    ``Round(x/s)`` -> ``Clip(-127,127)`` -> ``+128``, ``Cast uint8``
                                    -> ``MatMulInteger`` (u8 ``q + 128``, a_zero_point 128 x u8
                                    ``w + 128``, b_zero_point 128 -> int32: exactly eqjax's
                                    int8 x int8 sums on every CPU, see below) -> ``Cast`` -> ``Mul``
                                    by the weight scales -> ``Mul`` by the token scales: the same
                                    arithmetic, in the same order, as :func:`eqjax.linear.linear`
                                    (ONNX ``Round`` is half-to-even like ``jnp.round``). Group-wise
                                    weights (ZeroQuant) use a batched ``MatMulInteger`` over the
                                    groups and a ``ReduceSum``. SmoothQuant needs nothing here: it
                                    is folded into the norms and kernels before export.
==================================  ==========================================================

Why both W8A8 operands are uint8: onnxruntime's MLAS runs a u8 x s8 ``MatMulInteger`` on x86-64 CPUs
without VNNI (AVX2-only, AVX-512 without VNNI, SSE4.1) with ``vpmaddubsw``, which adds the two
products of adjacent K positions into a *saturating* int16: ``2 * 255 * 127 = 64770 > 32767``, so the
integer sums are wrong whenever an activation code above 0 (uint8 > 128) meets a large weight pair
(seen as 47 of 672 wrong outputs, up to 0.29 off). MLAS's u8 x u8 kernels widen both operands to 16 bits
and add product pairs with ``vpmaddwd`` into int32 (``2 * 255 * 255 = 130050``), or use
VNNI-INT8 / NEON dot products with 32-bit sums: exact on every CPU. (s8 x s8 has no x86 kernel before
AVX-VNNI-INT8 and runs ~10x slower; splitting activations into two half-range u8 x s8 products is also
exact but doubles the weights and is slower at decode.) The price, on an AVX-512 VNNI CPU where u8 x s8
is exact and fastest: a 512 x 576 x 1536 W8A8 layer takes ~3.1 ms instead of ~1.7 ms (2 threads); a
one-token decode step costs the same.

Not expressible (raise :class:`ExportError` naming the layer): 3-, 5-, 6-, 7-bit packed codes in a
weight-only 2/4-bit path (3-bit has no ONNX/ORT kernel), a non-power-of-two 2/4-bit block size,
groups along the output axis for 2/4 bits, and W8A8 with asymmetric weights (MatMulInteger with a
per-column weight zero point would be possible but is not what eqjax computes in int8).

Quantized embedding tables (QArray) are dequantized into float32 initializers. RMSNorm, RoPE
(``rotate_half``, angles computed in-graph in float32), GQA, causal / sliding-window masks and
softmax are built from standard ops.
"""

from __future__ import annotations

import math
import os
import pathlib
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from eqjax.linear import ActQuantKernel
from eqjax.numerics import codes, dequantize, integer_values
from eqjax.qarray import QArray
from eqjax.errors import InputError

__all__ = [
    "ExportError",
    "OPSET",
    "build_model",
    "export_onnx",
    "linear_graph",
    "check_exportable",
    "make_session",
    "onnx_logits",
    "onnx_perplexity",
    "add_export_args",
    "export_main",
]

OPSET = 21
MS_DOMAIN = "com.microsoft"
_NEG = float(np.finfo(np.float32).min)


class ExportError(InputError):
    """The model or a layer's quantization cannot be expressed in the ONNX graph."""


# ------------------------------------------------------------------------------------ graph builder
class _Graph:
    """Accumulates nodes and initializers; hands out unique tensor names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0
        self._consts: dict[tuple, str] = {}

    def name(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def init(self, hint: str, array: np.ndarray) -> str:
        name = self.name(hint)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def const(self, value: Any, dtype: Any = np.float32) -> str:
        """A small shared constant (scalars, shape vectors)."""
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            self._consts[key] = self.init("const", arr)
        return self._consts[key]

    def op(self, op_type: str, inputs: Sequence[str], *, n_out: int = 1, domain: str | None = None,
           hint: str | None = None, **attrs: Any) -> Any:
        outs = [self.name(hint or op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self.name("n_" + op_type),
                                           domain=domain, **attrs))
        return outs[0] if n_out == 1 else outs


def _f32(x: Any) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


# ------------------------------------------------------------------------------------ linear layers
def check_exportable(path: str, kernel: Any) -> str:
    """The ONNX lowering of ``kernel`` (``"matmul" | "dq_matmul" | "matmulnbits" | "w8a8"``), or raise
    :class:`ExportError` naming ``path`` and the reason."""
    if isinstance(kernel, ActQuantKernel):
        w = kernel.weight
        if not w.symmetric:
            raise ExportError(
                f"{path}: W8A8 with an asymmetric int{w.bits} weight (zero point) cannot be exported: the "
                "MatMulInteger lowering needs symmetric weights (use a symmetric recipe)")
        if kernel.act_bits > 8:
            raise ExportError(f"{path}: {kernel.act_bits}-bit activations do not fit int8")
        g = w.granularity
        if g.kind == "group" and g.axes != (0,):
            raise ExportError(f"{path}: W8A8 with groups along axis {g.axes[0]} cannot be exported (need axis 0)")
        if g.kind == "group" and w.shape[0] % g.group_size:
            raise ExportError(
                f"{path}: W8A8 group size {g.group_size} does not divide the input width {w.shape[0]} (a short "
                "last group); the MatMulInteger lowering needs whole groups")
        if g.kind == "channel" and g.axes != (1,):
            raise ExportError(f"{path}: W8A8 needs per-output-channel weight scales, got {g}")
        return "w8a8"
    if not isinstance(kernel, QArray):
        return "matmul"
    if len(kernel.shape) != 2:
        raise ExportError(f"{path}: only 2-D [in, out] kernels can be exported, got shape {kernel.shape}")
    K, N = kernel.shape
    g = kernel.granularity
    if kernel.bits >= 5:
        if g.kind == "channel" and len(g.axes) != 1:
            raise ExportError(f"{path}: per-channel scales over axes {g.axes} cannot be exported")
        return "dq_matmul"
    if kernel.bits not in (2, 4):
        raise ExportError(
            f"{path}: {kernel.bits}-bit weights cannot be exported to ONNX (no {kernel.bits}-bit "
            "DequantizeLinear type or onnxruntime kernel; MatMulNBits is exported for 2 and 4 bits)")
    if g.kind == "group" and g.axes != (0,):
        raise ExportError(f"{path}: int{kernel.bits} groups along the output axis cannot be exported "
                          "(MatMulNBits blocks run along the input axis K)")
    if g.kind == "channel" and g.axes != (1,):
        raise ExportError(f"{path}: int{kernel.bits} per-input-row scales cannot be exported")
    bs = g.group_size if g.kind == "group" else K
    if not _is_pow2(bs) or bs < 16:
        raise ExportError(
            f"{path}: int{kernel.bits} block size {bs} (group size, or K for per-channel) is not a power of "
            "two >= 16, which MatMulNBits requires")
    return "matmulnbits"


def _scale_np(q: QArray) -> np.ndarray:
    return np.asarray(q.scale.astype("float32"))


def _emit_dq_matmul(G: _Graph, x: str, q: QArray, hint: str) -> str:
    K, N = q.shape
    vals = np.asarray(q.values)
    s = _scale_np(q)
    g = q.granularity
    attrs: dict[str, Any] = {}
    zp = None if q.zero_point is None else np.asarray(q.zero_point)
    if g.kind == "tensor":
        s = s.reshape(())
        zp = None if zp is None else zp.reshape(())
    elif g.kind == "channel":
        (ax,) = g.axes
        attrs["axis"] = ax
        s = s.reshape(-1)
        zp = None if zp is None else zp.reshape(-1)
    else:
        attrs["axis"] = g.axes[0]
        attrs["block_size"] = g.group_size
    ins = [G.init(hint + "_q", vals), G.init(hint + "_scale", s)]
    if zp is not None:
        ins.append(G.init(hint + "_zp", zp.astype(np.uint8)))
    w = G.op("DequantizeLinear", ins, hint=hint + "_w", **attrs)
    return G.op("MatMul", [x, w], hint=hint)


def _pack_low_first(codes_: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned codes along the last axis, first code in the lowest bits (per byte)."""
    n = 8 // bits
    pad = (-codes_.shape[-1]) % n
    if pad:
        codes_ = np.concatenate([codes_, np.zeros(codes_.shape[:-1] + (pad,), codes_.dtype)], axis=-1)
    c = codes_.reshape(codes_.shape[:-1] + (-1, n)).astype(np.uint32)
    return np.sum(c << (np.arange(n, dtype=np.uint32) * bits), axis=-1).astype(np.uint8)


def _emit_matmulnbits(G: _Graph, x: str, q: QArray, hint: str, accuracy_level: int | None) -> str:
    K, N = q.shape
    bits = q.bits
    g = q.granularity
    bs = g.group_size if g.kind == "group" else K
    nb = -(-K // bs)  # a short last group (e.g. K = 576, bs = 128) is a zero-padded last block
    # eqjax packs along axis 0 (K) of [K, N], low bits first: byte-identical to MatMulNBits' K packing.
    vals = np.asarray(q.values)  # [ceil(K*bits/8), N]
    rows = nb * bs * bits // 8
    if vals.shape[0] < rows:
        vals = np.concatenate([vals, np.zeros((rows - vals.shape[0], N), vals.dtype)])
    B = np.ascontiguousarray(vals.T).reshape(N, nb, bs * bits // 8)
    s = np.broadcast_to(_scale_np(q), (nb if g.kind == "group" else 1, N))
    s = np.broadcast_to(s, (nb, N)).T.reshape(-1).astype(np.float32)  # [N * nb], block-major per column
    ins = [x, G.init(hint + "_B", B), G.init(hint + "_scales", np.ascontiguousarray(s))]
    if q.zero_point is not None:
        zp = np.broadcast_to(np.asarray(q.zero_point), (nb, N)).T  # [N, nb]
        ins.append(G.init(hint + "_zp", _pack_low_first(np.ascontiguousarray(zp), bits).reshape(-1)))
    attrs: dict[str, Any] = {"K": K, "N": N, "bits": bits, "block_size": bs}
    if accuracy_level is not None:
        attrs["accuracy_level"] = accuracy_level
    return G.op("MatMulNBits", ins, domain=MS_DOMAIN, hint=hint, **attrs)


W8A8_ZERO_POINT = 128
"""Zero point of both uint8 ``MatMulInteger`` operands of the W8A8 lowering (codes are ``q + 128``)."""


def w8a8_weight_codes(w: QArray) -> np.ndarray:
    """uint8 ``[K, N]`` weight operand of the W8A8 ``MatMulInteger``: ``integer_values(w) + 128``.

    ``w`` is symmetric (``check_exportable``), so its integers lie in ``[-127, 127]`` and the codes in
    ``[1, 255]``.
    """
    iv = np.asarray(integer_values(w)).astype(np.int32)
    if iv.size and (iv.min() < -127 or iv.max() > 127):
        raise ExportError(f"W8A8 weight integers {iv.min()}..{iv.max()} do not fit int8 [-127, 127]")
    return (iv + W8A8_ZERO_POINT).astype(np.uint8)


def _emit_w8a8(G: _Graph, x: str, k: ActQuantKernel, hint: str) -> str:
    w = k.weight
    K, N = w.shape
    qmax = float(2 ** (k.act_bits - 1) - 1)
    lead = G.op("Slice", [G.op("Shape", [x]), G.const([0], np.int64), G.const([-1], np.int64)])
    out_shape = G.op("Concat", [lead, G.const([N], np.int64)], axis=0)
    x2 = G.op("Reshape", [x, G.const([-1, K], np.int64)], hint=hint + "_x2")
    if k.act_scale is not None:
        s = G.const(np.asarray(k.act_scale, np.float32).reshape(-1)[:1].reshape(1, 1))
    else:
        ax = G.op("Abs", [x2])
        if k.act_granularity == "token":
            amax = G.op("ReduceMax", [ax, G.const([1], np.int64)], keepdims=1)
        else:
            amax = G.op("ReduceMax", [ax], keepdims=1)
        pos = G.op("Greater", [amax, G.const(0.0)])
        s = G.op("Where", [pos, G.op("Div", [amax, G.const(qmax)]), G.const(1.0)], hint=hint + "_sx")
    r = G.op("Round", [G.op("Div", [x2, s])])
    # Both operands are uint8 with zero point 128 (q + 128 and w + 128): the same integers as eqjax's
    # int8 x int8, and a u8 x u8 MatMulInteger never saturates (see the module docs: u8 x s8 does on
    # x86 CPUs without VNNI).
    qx = G.op("Cast", [G.op("Add", [G.op("Clip", [r, G.const(-qmax), G.const(qmax)]), G.const(128.0)])],
              to=TensorProto.UINT8, hint=hint + "_qx")
    zp = G.const(W8A8_ZERO_POINT, np.uint8)
    wq = w8a8_weight_codes(w)  # [K, N] uint8
    ws = _scale_np(w)
    g = w.granularity
    if g.kind == "group":
        gs = g.group_size
        ng = K // gs
        q3 = G.op("Transpose", [G.op("Reshape", [qx, G.const([-1, ng, gs], np.int64)])], perm=[1, 0, 2])
        acc = G.op("MatMulInteger", [q3, G.init(hint + "_wq", wq.reshape(ng, gs, N)), zp, zp])  # [ng, M, N]
        y = G.op("Mul", [G.op("Cast", [acc], to=TensorProto.FLOAT), G.init(hint + "_ws", ws.reshape(ng, 1, N))])
        y = G.op("ReduceSum", [y, G.const([0], np.int64)], keepdims=0)
    else:
        acc = G.op("MatMulInteger", [qx, G.init(hint + "_wq", wq), zp, zp])
        y = G.op("Mul", [G.op("Cast", [acc], to=TensorProto.FLOAT), G.init(hint + "_ws", ws.reshape(1, -1))])
    y = G.op("Mul", [y, s])
    return G.op("Reshape", [y, out_shape], hint=hint)


def _emit_linear(G: _Graph, x: str, layer: Mapping[str, Any], path: str, accuracy_level: int | None = None) -> str:
    kernel = layer["kernel"]
    kind = check_exportable(path, kernel)
    hint = path.replace("/", ".")
    if kind == "matmul":
        y = G.op("MatMul", [x, G.init(hint + "_w", _f32(kernel))], hint=hint)
    elif kind == "dq_matmul":
        y = _emit_dq_matmul(G, x, kernel, hint)
    elif kind == "matmulnbits":
        y = _emit_matmulnbits(G, x, kernel, hint, accuracy_level)
    else:
        y = _emit_w8a8(G, x, kernel, hint)
    bias = layer.get("bias")
    if bias is not None:
        y = G.op("Add", [y, G.init(hint + "_b", _f32(bias))], hint=hint + "_out")
    return y


def _opsets() -> list[onnx.OperatorSetIdProto]:
    return [helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)]


def _make(G: _Graph, inputs, outputs, name: str) -> onnx.ModelProto:
    graph = helper.make_graph(G.nodes, name, inputs, outputs, initializer=G.inits)
    m = helper.make_model(graph, opset_imports=_opsets(), producer_name="eqjax", ir_version=10)
    return m


def linear_graph(layer: Mapping[str, Any], *, path: str = "linear", accuracy_level: int | None = None) -> onnx.ModelProto:
    """A one-layer graph ``x [M, K] -> y [M, N]`` for ``layer = {"kernel", "bias"?}`` (for tests)."""
    K, N = tuple(layer["kernel"].shape)
    G = _Graph()
    y = _emit_linear(G, "x", layer, path, accuracy_level)
    G.nodes.append(helper.make_node("Identity", [y], ["y"]))
    return _make(G, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", N])], "linear")


# ------------------------------------------------------------------------------------ model graphs
def _table(x: Any) -> np.ndarray:
    if isinstance(x, QArray):
        return np.asarray(dequantize(x, "float32"))
    return _f32(x)


def _rms_norm(G: _Graph, x: str, scale: Any, eps: float, hint: str) -> str:
    ms = G.op("ReduceMean", [G.op("Mul", [x, x]), G.const([-1], np.int64)], keepdims=1)
    r = G.op("Reciprocal", [G.op("Sqrt", [G.op("Add", [ms, G.const(eps)])])])
    return G.op("Mul", [G.op("Mul", [x, r]), G.init(hint + "_scale", _f32(scale))], hint=hint)


def _rope(G: _Graph, x: str, cos: str, sin: str, hd: int) -> str:
    """``x [B, H, T, hd]``: ``x * cos + rotate_half(x) * sin``."""
    x1, x2 = G.op("Split", [x, G.const([hd // 2, hd // 2], np.int64)], n_out=2, axis=-1)
    rot = G.op("Concat", [G.op("Neg", [x2]), x1], axis=-1)
    return G.op("Add", [G.op("Mul", [x, cos]), G.op("Mul", [rot, sin])])


class _Ctx:
    """Per-graph shared values: positions, masks, past length."""

    def __init__(self, G: _Graph, ids: str, past: str | None) -> None:
        self.G = G
        shape = G.op("Shape", [ids])
        self.T = G.op("Slice", [shape, G.const([1], np.int64), G.const([2], np.int64)])  # [1]
        if past is None:
            self.P = G.const([0], np.int64)
        else:
            self.P = G.op("Slice", [G.op("Shape", [past]), G.const([2], np.int64), G.const([3], np.int64)])
        end = G.op("Add", [self.P, self.T])
        sq = lambda v: G.op("Squeeze", [v, G.const([0], np.int64)])  # noqa: E731
        self.pos = G.op("Range", [sq(self.P), sq(end), G.const(1, np.int64)], hint="positions")  # [T]
        self.kpos = G.op("Range", [G.const(0, np.int64), sq(end), G.const(1, np.int64)], hint="kpos")  # [S]
        self._masks: dict[int | None, str] = {}

    def mask(self, window: int | None) -> str:
        """bool ``[T, S]``: key j visible to query i."""
        if window not in self._masks:
            G = self.G
            qp = G.op("Unsqueeze", [self.pos, G.const([1], np.int64)])
            kp = G.op("Unsqueeze", [self.kpos, G.const([0], np.int64)])
            m = G.op("LessOrEqual", [kp, qp])
            if window is not None:
                lo = G.op("Sub", [qp, G.const(window, np.int64)])
                m = G.op("And", [m, G.op("Greater", [kp, lo])])
            self._masks[window] = m
        return self._masks[window]


def _attention_core(G: _Graph, ctx: _Ctx, q: str, k: str, v: str, *, Hq: int, Hkv: int, hd: int, scale: float,
                    window: int | None, past: tuple[str, str] | None) -> tuple[str, str, str]:
    """q ``[B, Hq, T, hd]``, k/v ``[B, Hkv, T, hd]`` (post-RoPE) -> (``[B, T, Hq*hd]``, present k, v)."""
    if past is not None:
        k = G.op("Concat", [past[0], k], axis=2, hint="present_k")
        v = G.op("Concat", [past[1], v], axis=2, hint="present_v")
    grp = Hq // Hkv
    qg = G.op("Reshape", [q, G.const([0, Hkv, grp, -1, hd], np.int64)])
    ku = G.op("Unsqueeze", [k, G.const([2], np.int64)])
    vu = G.op("Unsqueeze", [v, G.const([2], np.int64)])
    s = G.op("MatMul", [qg, G.op("Transpose", [ku], perm=[0, 1, 2, 4, 3])])  # [B, Hkv, G, T, S]
    s = G.op("Mul", [s, G.const(scale)])
    s = G.op("Where", [ctx.mask(window), s, G.const(_NEG)])
    p = G.op("Softmax", [s], axis=-1)
    o = G.op("MatMul", [p, vu])  # [B, Hkv, G, T, hd]
    o = G.op("Reshape", [o, G.const([0, Hq, -1, hd], np.int64)])
    o = G.op("Transpose", [o], perm=[0, 2, 1, 3])
    o = G.op("Reshape", [o, G.const([0, 0, Hq * hd], np.int64)])
    return o, k, v


def _heads(G: _Graph, x: str, H: int, hd: int) -> str:
    """``[B, T, H*hd] -> [B, H, T, hd]``."""
    return G.op("Transpose", [G.op("Reshape", [x, G.const([0, 0, H, hd], np.int64)])], perm=[0, 2, 1, 3])


def _llama_graph(G: _Graph, config: Any, params: Mapping[str, Any], ids: str, pasts, acc) -> tuple[str, list[str]]:
    from eqjax.models.llama import rope_inv_freq

    c = config
    hd, Hq, Hkv, eps = c.head_dim, c.n_heads, c.n_kv_heads, c.rms_norm_eps
    ctx = _Ctx(G, ids, pasts[0][0] if pasts else None)
    table = _table(params["embed"]["embedding"])
    emb = G.init("embed", table)
    h = G.op("Gather", [emb, ids], axis=0, hint="h0")
    ang = G.op("Mul", [G.op("Unsqueeze", [G.op("Cast", [ctx.pos], to=TensorProto.FLOAT), G.const([1], np.int64)]),
                       G.const(rope_inv_freq(c).reshape(1, -1))])
    ang = G.op("Concat", [ang, ang], axis=-1)  # [T, hd]
    cos, sin = G.op("Cos", [ang], hint="cos"), G.op("Sin", [ang], hint="sin")
    presents: list[str] = []
    for i in range(c.n_layers):
        p = params[f"layers_{i}"]
        a = p["attn"]
        pre = f"layers_{i}"
        x = _rms_norm(G, h, p["attn_norm"]["scale"], eps, pre + ".attn_norm")
        q = _linear_heads(G, x, a, "q_proj", pre, Hq, hd, acc)
        k = _linear_heads(G, x, a, "k_proj", pre, Hkv, hd, acc)
        v = _heads(G, _emit_linear(G, x, a["v_proj"], f"{pre}/attn/v_proj", acc), Hkv, hd)
        if c.qk_norm:
            q = _rms_norm(G, q, a["q_norm"]["scale"], eps, pre + ".q_norm")
            k = _rms_norm(G, k, a["k_norm"]["scale"], eps, pre + ".k_norm")
        q, k = _rope(G, q, cos, sin, hd), _rope(G, k, cos, sin, hd)
        o, kk, vv = _attention_core(G, ctx, q, k, v, Hq=Hq, Hkv=Hkv, hd=hd, scale=hd**-0.5,
                                    window=c.window_for(i), past=pasts[i] if pasts else None)
        presents += [kk, vv]
        h = G.op("Add", [h, _emit_linear(G, o, a["o_proj"], f"{pre}/attn/o_proj", acc)])
        x = _rms_norm(G, h, p["mlp_norm"]["scale"], eps, pre + ".mlp_norm")
        m = p["mlp"]
        gt = _emit_linear(G, x, m["gate_proj"], f"{pre}/mlp/gate_proj", acc)
        up = _emit_linear(G, x, m["up_proj"], f"{pre}/mlp/up_proj", acc)
        act = G.op("Mul", [G.op("Mul", [gt, G.op("Sigmoid", [gt])]), up])
        h = G.op("Add", [h, _emit_linear(G, act, m["down_proj"], f"{pre}/mlp/down_proj", acc)])
    x = _rms_norm(G, h, params["final_norm"]["scale"], eps, "final_norm")
    if "lm_head" in params:
        logits = _emit_linear(G, x, params["lm_head"], "lm_head", acc)
    else:
        logits = G.op("MatMul", [x, G.op("Transpose", [emb], perm=[1, 0])])
    return logits, presents


def _linear_heads(G, x, a, name, pre, H, hd, acc):
    """Projection, reshaped to heads ``[B, T, H, hd]`` and transposed to ``[B, H, T, hd]``.

    (The Qwen3 q/k RMSNorm over ``hd`` is applied after the transpose; it is per-head so the order is
    immaterial.)"""
    return _heads(G, _emit_linear(G, x, a[name], f"{pre}/attn/{name}", acc), H, hd)


def _layer_norm(G: _Graph, x: str, p: Mapping[str, Any], eps: float, hint: str) -> str:
    return G.op("LayerNormalization", [x, G.init(hint + "_scale", _f32(p["scale"])), G.init(hint + "_bias", _f32(p["bias"]))],
                axis=-1, epsilon=float(eps), hint=hint)


def _gpt2_graph(G: _Graph, config: Any, params: Mapping[str, Any], ids: str, pasts, acc) -> tuple[str, list[str]]:
    c = config
    H, hd, D = c.n_heads, c.head_dim, c.hidden
    ctx = _Ctx(G, ids, pasts[0][0] if pasts else None)
    wte = G.init("wte", _table(params["wte"]["embedding"]))
    wpe = G.init("wpe", _table(params["wpe"]["embedding"]))
    h = G.op("Add", [G.op("Gather", [wte, ids], axis=0), G.op("Gather", [wpe, ctx.pos], axis=0)], hint="h0")
    presents: list[str] = []
    for i in range(c.n_layers):
        p = params[f"layers_{i}"]
        pre = f"layers_{i}"
        x = _layer_norm(G, h, p["ln_1"], c.layer_norm_eps, pre + ".ln_1")
        qkv = _emit_linear(G, x, p["attn"]["c_attn"], f"{pre}/attn/c_attn", acc)
        q, k, v = G.op("Split", [qkv, G.const([D, D, D], np.int64)], n_out=3, axis=-1)
        q, k, v = (_heads(G, t, H, hd) for t in (q, k, v))
        scale = hd**-0.5
        if c.scale_attn_by_inverse_layer_idx:
            scale /= float(i + 1)
        o, kk, vv = _attention_core(G, ctx, q, k, v, Hq=H, Hkv=H, hd=hd, scale=scale, window=None,
                                    past=pasts[i] if pasts else None)
        presents += [kk, vv]
        h = G.op("Add", [h, _emit_linear(G, o, p["attn"]["c_proj"], f"{pre}/attn/c_proj", acc)])
        x = _layer_norm(G, h, p["ln_2"], c.layer_norm_eps, pre + ".ln_2")
        f = _emit_linear(G, x, p["mlp"]["c_fc"], f"{pre}/mlp/c_fc", acc)
        if c.activation in ("gelu_new", "gelu_pytorch_tanh"):
            f = G.op("Gelu", [f], approximate="tanh")
        elif c.activation == "gelu":
            f = G.op("Gelu", [f])
        else:
            f = G.op("Relu", [f])
        h = G.op("Add", [h, _emit_linear(G, f, p["mlp"]["c_proj"], f"{pre}/mlp/c_proj", acc)])
    x = _layer_norm(G, h, params["ln_f"], c.layer_norm_eps, "ln_f")
    logits = G.op("MatMul", [x, G.op("Transpose", [wte], perm=[1, 0])])
    return logits, presents


def _check_all(params: Mapping[str, Any]) -> None:
    """Fail early (before building anything) on the first layer the exporter cannot express."""
    from eqjax.pytree import flatten

    for path, leaf in flatten(params):
        if path.endswith("/kernel") and isinstance(leaf, (QArray, ActQuantKernel)):
            check_exportable(path.rsplit("/", 1)[0], leaf)


def _check_architecture(c: Any) -> None:
    """Raise :class:`ExportError` for Llama-family features the graph does not emit (Gemma, Phi-3, gelu)."""
    missing = [what for cond, what in (
        (getattr(c, "hidden_act", "silu") != "silu", f"hidden_act {getattr(c, 'hidden_act', '')!r} (only silu)"),
        (getattr(c, "embed_scale", False), "Gemma's embedding scale"),
        (getattr(c, "rotary_dim", None) not in (None, getattr(c, "head_dim", None)), "partial RoPE (rotary_dim)"),
    ) if cond]
    if missing:
        raise ExportError(f"ONNX export of a {getattr(c, 'model_type', '?')} model is not supported: "
                          f"the graph has no {', '.join(missing)}")


def build_model(model: Any, params: Mapping[str, Any], *, seq_len: int | None = None, decode: bool = False,
                accuracy_level: int | None = None, batch: int | None = None) -> onnx.ModelProto:
    """The ONNX ``ModelProto`` of ``model`` (an :class:`eqjax.models.Model`) with ``params``.

    ``seq_len``/``batch`` fix those input dimensions (default symbolic). ``decode`` adds past/present
    KV tensors (see the module docs). ``accuracy_level`` is passed to every MatMulNBits node (None =
    the op's default, 0: float computation).
    """
    from eqjax.models import GPT2Config

    _check_all(params)
    c = model.config
    _check_architecture(c)
    G = _Graph()
    ids = "input_ids"
    b = batch if batch is not None else "batch"
    t = seq_len if seq_len is not None else "seq"
    inputs = [helper.make_tensor_value_info(ids, TensorProto.INT64, [b, t])]
    outputs = []
    pasts = None
    kv_shape = [b, c.n_kv_heads, "past", c.head_dim]
    if decode:
        pasts = []
        for i in range(c.n_layers):
            pk, pv = f"past_key_{i}", f"past_value_{i}"
            inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, kv_shape) for n in (pk, pv)]
            pasts.append((pk, pv))
    impl = _gpt2_graph if isinstance(c, GPT2Config) else _llama_graph
    logits, presents = impl(G, c, params, ids, pasts, accuracy_level)
    G.nodes.append(helper.make_node("Identity", [logits], ["logits"]))
    outputs.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, [b, t, c.vocab]))
    if decode:
        for i in range(c.n_layers):
            for kind, src in (("key", presents[2 * i]), ("value", presents[2 * i + 1])):
                name = f"present_{kind}_{i}"
                G.nodes.append(helper.make_node("Identity", [src], [name]))
                outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT,
                                                             [b, c.n_kv_heads, "total", c.head_dim]))
    return _make(G, inputs, outputs, f"eqjax_{getattr(c, 'model_type', 'model')}")


def export_onnx(model: Any, params: Mapping[str, Any], path: str | os.PathLike[str], *, seq_len: int | None = None,
                decode: bool = False, accuracy_level: int | None = None, check: bool = True) -> pathlib.Path:
    """Build (see :func:`build_model`), run ``onnx.checker`` and save to ``path``. Returns the path.

    Raises :class:`ExportError` naming the first layer whose quantization ONNX cannot express.
    """
    import tempfile

    from eqjax.atomic import atomic_path, check_output_file, fsync_tree

    path = pathlib.Path(path)
    check_output_file(path, overwrite=True, what="ONNX file")  # an unwritable path fails before the build
    m = build_model(model, params, seq_len=seq_len, decode=decode, accuracy_level=accuracy_level)
    # atomic write: temporary sibling, fsync, rename (a killed export leaves the previous file intact)
    if m.ByteSize() > 1_900_000_000:
        data = path.parent / (path.name + ".data")
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.tmp-{os.getpid()}-") as td:
            tmp = pathlib.Path(td)
            onnx.save_model(m, str(tmp / path.name), save_as_external_data=True, location=data.name)
            if check:
                onnx.checker.check_model(str(tmp / path.name))
            fsync_tree(tmp)
            os.replace(tmp / data.name, data)  # the weights first, then the graph that points at them
            os.replace(tmp / path.name, path)
    else:
        if check:
            onnx.checker.check_model(m)
        with atomic_path(path) as tmp:
            onnx.save_model(m, str(tmp))
    return path


# ------------------------------------------------------------------------------------ running
def make_session(model_or_path: Any, *, threads: int | None = None, qdq_accuracy_level: int | None = 0,
                 optimization: str = "all") -> Any:
    """An onnxruntime CPU session.

    ``qdq_accuracy_level`` sets ``session.qdq_matmulnbits_accuracy_level``: onnxruntime's optimizer
    rewrites ``DequantizeLinear -> MatMul`` (per-channel / blocked) into ``MatMulNBits`` with this
    accuracy level. The default here is 0 (float activations: the graph computes exactly what eqjax
    computes); None leaves onnxruntime's own default, which in onnxruntime 1.32 quantizes the
    activations to int8 (level 4) and changes W8 logits by ~0.4 % of their range.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    so.graph_optimization_level = {
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    }[optimization]
    if qdq_accuracy_level is not None:
        so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(qdq_accuracy_level))
    src = model_or_path.SerializeToString() if isinstance(model_or_path, onnx.ModelProto) else str(model_or_path)
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


def onnx_logits(session: Any, tokens: np.ndarray) -> np.ndarray:
    """Logits ``[B, T, V]`` of a prefill graph (past inputs, if any, are fed empty)."""
    tokens = np.asarray(tokens, np.int64)
    feeds: dict[str, np.ndarray] = {"input_ids": tokens}
    for inp in session.get_inputs():
        if inp.name.startswith("past_"):
            _, hkv, _, hd = inp.shape
            feeds[inp.name] = np.zeros((tokens.shape[0], hkv, 0, hd), np.float32)
    return session.run(["logits"], feeds)[0]


def onnx_perplexity(session: Any, windows: np.ndarray, *, batch_size: int = 1) -> float:
    """Perplexity over token windows ``[n, T]``: exp(mean next-token NLL over all ``n * (T-1)`` targets)."""
    windows = np.asarray(windows)
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        w = windows[i:i + batch_size]
        lg = onnx_logits(session, w)[:, :-1].astype(np.float64)
        tgt = w[:, 1:]
        m = lg.max(-1, keepdims=True)
        lse = np.log(np.exp(lg - m).sum(-1)) + m[..., 0]
        nll = lse - np.take_along_axis(lg, tgt[..., None].astype(np.int64), -1)[..., 0]
        total += float(nll.sum())
        count += nll.size
    return float(math.exp(total / count))


# ------------------------------------------------------------------------------------ CLI
def add_export_args(p: Any) -> Any:
    """Arguments of ``eqjax export-onnx``."""
    p.add_argument("--recipe", default="fp", help="built-in recipe name or a .toml/.json recipe file")
    p.add_argument("--out", required=True, help="output .onnx file")
    p.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2-135M)")
    p.add_argument("--decode", action="store_true", help="add past/present KV-cache inputs and outputs")
    p.add_argument("--seq-len", type=int, default=None, help="fix the sequence length (default symbolic)")
    p.add_argument("--accuracy-level", type=int, default=None, help="MatMulNBits accuracy_level attribute")
    p.add_argument("--calib-windows", type=int, default=16, help="calibration windows for calibrated recipes")
    p.add_argument("--calib-len", type=int, default=256)
    return p


def load_quantized(recipe_name: str, model_path: str | None = None, *, calib_windows: int = 16, calib_len: int = 256,
                   seed: int = 0) -> tuple[Any, Any, Any]:
    """``(model, quantized params, tokenizer)`` of the GGUF model under ``recipe_name``."""
    from eqjax.io.gguf import load_gguf
    from eqjax.models import Model
    from eqjax.recipe import quantize
    from eqjax.recipes import get_recipe

    cfg, params, tok = load_gguf(model_path)
    model = Model(cfg)
    recipe = get_recipe(recipe_name)
    cal = None
    if recipe.needs_calibration:
        from eqjax.data import calibration_windows, wikipedia_tokens

        cal = calibration_windows(wikipedia_tokens(tok)[0], calib_windows, calib_len, seed)
    return model, quantize(params, recipe, model=model, calibration=cal, seed=seed), tok


def export_main(args: Any) -> int:
    """``eqjax export-onnx``: quantize with ``--recipe`` and write ``--out``. Returns the exit code."""
    import sys

    from eqjax.recipe import RecipeError

    try:
        model, qparams, _ = load_quantized(args.recipe, getattr(args, "model", None),
                                           calib_windows=args.calib_windows, calib_len=args.calib_len)
        out = export_onnx(model, qparams, args.out, seq_len=args.seq_len, decode=args.decode,
                          accuracy_level=args.accuracy_level)
    except (ExportError, RecipeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    size = out.stat().st_size
    print(f"wrote {out} ({size / 2**20:.1f} MiB, recipe {args.recipe}, decode={args.decode})")
    return 0
