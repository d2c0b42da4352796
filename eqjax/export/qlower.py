"""eqjax's quantized params at their uses, as onnxruntime operators.

Every quantized param is first brought to its *canonical blocked form* for one use
(:func:`blocked`): unsigned codes ``[N, K]`` (``N`` = the use's output channels, ``K`` = its
contracted axes flattened, as :func:`eqjax.core.analysis.weight_matrix`), and one scale / zero point
per ``[1, block]`` run along ``K``. The block is the group size when groups run along ``K``, else the
largest power of two in 16..256 dividing ``K`` (per-channel and per-tensor scales repeat per block: the
same numbers), else one zero-padded power-of-two block. That every scale really is constant per block
is *checked* on the numbers, so an exported weight is exactly eqjax's or the export fails naming it.

=====================================  =================================================================
weight-only, 2 / 4 / 8 bits            ``com.microsoft.MatMulNBits``: B ``[N, K/bs, bs*bits/8]`` packed
                                       along K (low bits first), scales float32 ``[N, K/bs]``, zero points
                                       packed ``[N, ceil(K/bs*bits/8)]`` (omitted when they all equal the
                                       op's default ``2**(bits-1)``: eqjax's symmetric grids);
                                       ``accuracy_level`` from the target (:mod:`eqjax.export.package`)
weight-only, 5..7 bits                 ``DequantizeLinear`` (canonical ``[K, N]``, per-axis or blocked)
                                       -> ``MatMul``
ActQuantKernel (W8A8)                  per-token int8 activations as :func:`eqjax.core.linear.quantize_activations`
                                       (scale ``ReduceMax(Abs) / 127``, or 127.5 on the full-range
                                       grid; codes by ``QuantizeLinear`` per
                                       row, once per input: siblings share them), then
                                       ``com.microsoft.MatMulIntegerToFloat`` with uint8 activations
                                       (``q + 128``, zero point 128) and the weight scales; weights int8
                                       when their integers lie within +-64 (u8 x s8, the fast kernel: its
                                       int16 pair sums cannot saturate on CPUs without VNNI), else uint8
                                       ``w + 128`` (u8 x u8 widens to 16 bits): exact on every x86 CPU
embedding gather, 2 / 4 / 8 bits       ``com.microsoft.GatherBlockQuantized`` (gather_axis 0,
                                       quantize_axis 1) on the *same* initializer as the tied LM head's
                                       MatMulNBits (reshaped), so a tied table is stored once
online rotation (RotatedKernel)        the activation times ``Q = diag(signs) kron(H_b, S_p) / sqrt(n)``
                                       as ``Mul`` (signs), ``MatMul`` by ``S_p / sqrt(n)`` and by ``H_b``
                                       on ``[..., b, p]`` (the small factors, shared by every layer of
                                       the width), then the inner kernel's lowering above
=====================================  =================================================================
3-bit weights have no onnxruntime kernel: :func:`check_exportable` refuses them before any work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx

from eqjax.core.hadamard import hadamard_factor_matrices
from eqjax.core.numerics import codes, expand_scale, integer_values
from eqjax.core.pytree import flatten, is_leaf
from eqjax.core.qarray import ActQuantKernel, HalfFloat, PermutedKernel, QArray, RotatedKernel, is_quantized
from eqjax.export.graph import MS_DOMAIN, ExportError, Graph

__all__ = ["Blocked", "blocked", "check_exportable", "export_params", "emit_weight_matmul",
           "emit_matmul", "emit_gather", "W8A8_ZERO_POINT", "S8_WEIGHT_LIMIT",
           "w8a8_weight_codes", "w8a8_table", "emit_table_gather", "NBITS", "lowered_at_use", "half_initializer"]

NBITS = (2, 4, 8)
W8A8_ZERO_POINT = 128
"""Zero point of both uint8 ``MatMulInteger`` operands of the W8A8 lowering (codes are ``q + 128``)."""


def export_params(params: Any) -> tuple[Any, dict[str, Any]]:
    """``(params to trace, path -> leaf)``: a :class:`~eqjax.core.qarray.RotatedKernel` or
    :class:`~eqjax.core.qarray.PermutedKernel` is traced as a float array of its logical shape (the walker
    lowers its online rotation or input gather at the weight use, :func:`emit_weight_matmul`) and kept whole
    in the path map."""
    import jax


    def leaf(x: Any) -> bool:
        return is_leaf(x) or isinstance(x, (RotatedKernel, PermutedKernel))

    traced = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, (RotatedKernel, PermutedKernel))
                          else x,
                          params, is_leaf=leaf)
    return traced, dict(flatten(params, leaf_type=leaf))


def lowered_at_use(leaf: Any) -> bool:
    """True for a quantized leaf, lowered where a matmul or gather reads it (ONNX) / written as blocks
    (GGUF); False for float params and a :class:`~eqjax.core.qarray.HalfFloat` (a float tensor:
    :func:`half_initializer`, or widened to float32)."""
    return is_quantized(leaf) and not isinstance(leaf, HalfFloat)


def half_initializer(leaf: Any) -> bool:
    """A float16 HalfFloat: written as float16 (ONNX: an initializer + ``Cast``, folded by onnxruntime at
    load; GGUF: ``F16``); bfloat16 ones are widened to float32."""
    return isinstance(leaf, HalfFloat) and np.dtype(leaf.values.dtype) == np.float16


def check_exportable(path: str, leaf: Any) -> str:
    """The lowering of a quantized leaf (``"nbits" | "dq" | "w8a8"``; a RotatedKernel's inner leaf's, or
    ``"float"``), or :class:`ExportError` naming it."""
    if isinstance(leaf, (RotatedKernel, PermutedKernel)):
        what = "an online rotation" if isinstance(leaf, RotatedKernel) else "an input gather (activation-ordered groups)"
        if len(leaf.shape) != 2 or leaf.axis != 0:
            raise ExportError(f"{path}: {what} is exported for a 2-D [in, out] weight along its input axis 0, got "
                              f"shape {tuple(leaf.shape)}, axis {leaf.axis}")
        return check_exportable(path, leaf.kernel)
    if isinstance(leaf, ActQuantKernel):
        w = leaf.weight
        if not w.symmetric:
            raise ExportError(f"{path}: W8A8 with an asymmetric int{w.bits} weight (zero point) cannot be exported: "
                              "the MatMulInteger lowering needs symmetric weights (use a symmetric recipe)")
        if w.bits > 8 or leaf.act_bits > 8:
            raise ExportError(f"{path}: more than 8-bit weights or activations do not fit MatMulInteger")
        return "w8a8"
    if not isinstance(leaf, QArray):
        return "float"
    if leaf.bits == 3:
        raise ExportError(f"{path}: 3-bit weights cannot be exported to ONNX (no 3-bit MatMulNBits / "
                          "DequantizeLinear kernel in onnxruntime); use 2, 4 or 8 bits")
    return "nbits" if leaf.bits in NBITS else "dq"


def _pack(c: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned codes along the last axis, first code in the lowest bits (8 bits: unchanged)."""
    if bits == 8:
        return c.astype(np.uint8)
    n = 8 // bits
    pad = (-c.shape[-1]) % n
    if pad:
        c = np.concatenate([c, np.zeros(c.shape[:-1] + (pad,), c.dtype)], axis=-1)
    out = np.zeros(c.shape[:-1] + (c.shape[-1] // n,), np.uint8)
    src, dst = c.reshape(-1, c.shape[-1]), out.reshape(-1, out.shape[-1])
    step = max(1, _PIECE // max(1, c.shape[-1]))
    for lo in range(0, src.shape[0], step):  # rows a piece at a time, field by field in uint8: an LM head's
        part = dst[lo:lo + step]               # 5e8 codes get no full-size temporary
        for j in range(n):
            part |= (src[lo:lo + step, j::n].astype(np.uint8) << np.uint8(bits * j)).astype(np.uint8)
    return out


def _matrix(a: np.ndarray, contracting: tuple[int, ...], free: tuple[int, ...], index: tuple = ()) -> np.ndarray:
    """A param-layout array as ``[N, K]`` for a use (stacked-param slices taken)."""
    for axis, i in index:
        a = np.take(a, [i], axis=axis)
    rest = tuple(x for x in range(a.ndim) if x not in contracting + free)
    K = int(np.prod([a.shape[x] for x in contracting], dtype=np.int64))
    N = int(np.prod([a.shape[x] for x in free], dtype=np.int64))
    return np.transpose(a, free + contracting + rest).reshape(N, K)


@dataclasses.dataclass(frozen=True)
class Blocked:
    """A quantized matrix in MatMulNBits form.

    Attributes:
      codes: unsigned codes ``[N, nb * block]`` (the padding holds the zero point).
      scales: float32 ``[N, nb]``; zero_points: int ``[N, nb]``; bits; block; K (unpadded), N.
    """

    codes: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray
    bits: int
    block: int
    K: int
    N: int

    @property
    def nb(self) -> int:
        return self.scales.shape[1]

    @property
    def default_zero_point(self) -> bool:
        return bool(np.all(self.zero_points == 2 ** (self.bits - 1)))


def _block_size(q: QArray, contracting: tuple[int, ...], shape: tuple[int, ...], K: int) -> int:
    g = q.granularity
    if g.kind == "group" and all(a in contracting for a in g.axes):
        G = g.group_size
        # groups are MatMulNBits blocks of the flattened K when their axes end it and they never straddle
        # an outer contracted index (or span all of K)
        span = int(np.prod([shape[a] for a in g.axes], dtype=np.int64))
        trailing = tuple(sorted(contracting))[len(contracting) - len(g.axes):] == g.axes
        inner_ok = trailing and (len(g.axes) == len(contracting) or span % G == 0)
        if not inner_ok or G < 16 or G & (G - 1):
            return 0
        # a short last group (576 = 4 x 128 + 64): blocks of gcd(G, K) hold the same numbers without padding
        # the codes (smaller, and int8-activation blocks stay aligned with the groups)
        common = np.gcd(G, K) & -np.gcd(G, K)  # the largest power of two dividing both
        return int(common) if common >= 16 else G
    for bs in (256, 128, 64, 32, 16):
        if K % bs == 0:
            return bs
    return max(16, 1 << (K - 1).bit_length())


_PIECE = 1 << 22
"""Elements of a weight :func:`blocked` converts at a time (its int32 / float32 temporaries: about 0.1 GB)."""


def _rows_of(q: QArray, axis: int, lo: int, hi: int) -> QArray:
    """Positions ``[lo, hi)`` of ``q`` along ``axis``: an axis that is neither grouped nor packed, whose scales
    are per position or shared (size 1)."""
    def cut(a: Any) -> Any:
        return a if a is None or a.shape[axis] == 1 else a[(slice(None),) * axis + (slice(lo, hi),)]

    shape = tuple(hi - lo if i == axis else d for i, d in enumerate(q.shape))
    return dataclasses.replace(q, values=cut(q.values), scale=cut(q.scale), zero_point=cut(q.zero_point), shape=shape)


def blocked(q: QArray, contracting: tuple[int, ...], free: tuple[int, ...], index: tuple = (), *,
            path: str = "weight") -> Blocked:
    """The canonical blocked form of ``q`` for a use with these param axes (see the module docs); a large
    weight is converted in pieces of output rows (along its first free axis), so its temporaries stay small."""
    f = free[0] if free else None
    n = q.shape[f] if f is not None else 1
    if f is None or q.size <= _PIECE or (q.packed and q.pack_axis == f) or f in q.granularity.axes \
            and q.granularity.kind == "group":
        return _blocked(q, contracting, free, index, path)
    step = max(1, _PIECE // max(1, q.size // n))
    out: list[np.ndarray] = []
    row = 0
    for lo in range(0, n, step):  # each piece written into the whole result: no list of pieces beside it
        b = _blocked(_rows_of(q, f, lo, min(lo + step, n)), contracting, free, index, path)
        if not out:
            rows = b.N // min(step, n) * n  # rows per position along the axis, times its positions
            out = [np.empty((rows,) + a.shape[1:], a.dtype) for a in (b.codes, b.scales, b.zero_points)]
        for dst, src in zip(out, (b.codes, b.scales, b.zero_points)):
            dst[row:row + b.N] = src
        row += b.N
    return Blocked(*out, b.bits, b.block, b.K, row)


def _blocked(q: QArray, contracting: tuple[int, ...], free: tuple[int, ...], index: tuple, path: str) -> Blocked:
    c = np.asarray(codes(q)).astype(np.int32)
    iv = np.asarray(integer_values(q)).astype(np.int32)
    zp = c - iv
    if q.symmetric and not q.packed:  # int8-style signed codes: shift to unsigned, zero point 2**(b-1)
        c, zp = c + 2 ** (q.bits - 1), np.full_like(c, 2 ** (q.bits - 1))
    s = np.asarray(expand_scale(q)).astype(np.float32)
    cm, zm, sm = (_matrix(a, contracting, free, index) for a in (c, zp, s))
    N, K = cm.shape
    bs = _block_size(q, contracting, q.shape, K)
    if bs == 0:
        raise ExportError(f"{path}: group size {q.granularity.group_size} along {q.granularity} cannot be laid out "
                          "as MatMulNBits blocks (needs a power of two >= 16 along the trailing input axes)")
    nb = -(-K // bs)
    pad = nb * bs - K
    if pad:
        cm = np.concatenate([cm, zm[:, -1:].repeat(pad, 1)], axis=1)
        zm = np.concatenate([zm, zm[:, -1:].repeat(pad, 1)], axis=1)
        sm = np.concatenate([sm, sm[:, -1:].repeat(pad, 1)], axis=1)
    s3, z3 = sm.reshape(N, nb, bs), zm.reshape(N, nb, bs)
    if not (np.all(s3 == s3[:, :, :1]) and np.all(z3 == z3[:, :, :1])):
        raise ExportError(f"{path}: its scales ({q.granularity}) are not constant over blocks of {bs} along the input; "
                          "MatMulNBits cannot represent it")
    return Blocked(cm.astype(np.uint8), s3[:, :, 0].copy(), z3[:, :, 0].copy(), q.bits, bs, K, N)


def _nbits_inputs(g: Graph, b: Blocked, key: Any, hint: str) -> list[str]:
    """[B, scales, (zero points)] initializer names, shared per ``key``."""
    def make() -> list[str]:
        blob = b.block * b.bits // 8
        B = _pack(b.codes.reshape(b.N, b.nb, b.block), b.bits).reshape(b.N, b.nb, blob)
        ins = [g.init(hint + ".qweight", B), g.init(hint + ".scales", b.scales.astype(np.float32))]
        if not b.default_zero_point:
            ins.append(g.init(hint + ".qzeros", _pack(b.zero_points.astype(np.uint8), b.bits)))
        return ins
    return g.memo(("nbits", key), make)


def emit_matmul(g: Graph, x: str, leaf: Any, use: Any, *, hint: str, accuracy_level: int | None,
                key: Any = None, lead: Sequence[Any] | None = None) -> str:
    """``x [..., K]`` (K in the canonical order) times the quantized ``leaf`` at ``use``: ``[..., N]``.
    ``lead``: x's leading dimensions (ints / symbolic), when known: W8A8's per-token zero points are then
    one tensor shared by every product over the same leading shape."""
    kind = check_exportable(use.path, leaf)
    key = key if key is not None else (use.path, use.contracting, use.free, use.index)
    if kind == "w8a8":
        return _emit_w8a8(g, x, leaf, use, hint, lead)
    b = blocked(leaf, use.contracting, use.free, use.index, path=use.path)
    if kind == "dq":
        return _emit_dq(g, x, b, hint)
    attrs: dict[str, Any] = {"K": b.K, "N": b.N, "bits": b.bits, "block_size": b.block}
    if accuracy_level is not None:
        attrs["accuracy_level"] = int(accuracy_level)
    return g.op("MatMulNBits", [x] + _nbits_inputs(g, b, key, hint), domain=MS_DOMAIN, hint=hint, **attrs)


def emit_rotation(g: Graph, x: str, leaf: RotatedKernel, rank: int, *, hint: str) -> str:
    """``x [..., n] @ Q`` (``rank`` = x's rank) for a RotatedKernel's online Hadamard: what
    :func:`eqjax.core.hadamard.hadamard_transform` computes, in ``O(n (b + p))`` per row."""

    n = int(leaf.shape[leaf.axis])
    hb, sp = hadamard_factor_matrices(n)
    b, p = hb.shape[0], sp.shape[0]
    keep = [0] * (rank - 1)  # Reshape's 0: copy that dimension
    signs = g.memo(("rot-signs", n, leaf.seed), lambda: g.init(f"rotation.signs_{n}_{leaf.seed}", leaf.signs()))
    y = g.op("Reshape", [g.op("Mul", [x, signs]), g.const(keep + [b, p], np.int64)])
    s = g.memo(("rot-sylvester", p, n), lambda: g.init(f"rotation.sylvester_{p}_over_sqrt{n}",
                                                        (sp / np.sqrt(n)).astype(np.float32)))
    y = g.op("MatMul", [y, s])
    if b > 1:
        h = g.memo(("rot-base", b), lambda: g.init(f"rotation.hadamard_{b}", hb.astype(np.float32)))
        perm = list(range(rank - 1)) + [rank, rank - 1]
        y = g.op("Transpose", [g.op("MatMul", [g.op("Transpose", [y], perm=perm), h])], perm=perm)
    return g.op("Reshape", [y, g.const(keep + [n], np.int64)], hint=hint + ".rotated")


def emit_weight_matmul(g: Graph, x: str, leaf: Any, use: Any, lead: Sequence[Any], *, hint: str,
                       accuracy_level: int | None) -> str:
    """:func:`emit_matmul` of ``x [*lead, K]``, with a PermutedKernel's gather of ``x``'s features and a
    RotatedKernel's online rotation of ``x`` first (then its inner kernel: quantized as there, or a float
    ``MatMul``)."""
    if isinstance(leaf, PermutedKernel):
        check_exportable(use.path, leaf)
        perm = g.init(hint + ".perm", np.asarray(leaf.perm, np.int64))
        x, leaf = g.op("Gather", [x, perm], axis=-1, hint=hint + ".gathered"), leaf.kernel
    if isinstance(leaf, RotatedKernel):
        kind = check_exportable(use.path, leaf)
        x, leaf = emit_rotation(g, x, leaf, len(lead) + 1, hint=hint), leaf.kernel
        if kind == "float":
            w = _matrix(np.asarray(leaf, np.float32), use.contracting, use.free).T
            return g.op("MatMul", [x, g.init(hint + ".inner", np.ascontiguousarray(w))], hint=hint)
    return emit_matmul(g, x, leaf, use, hint=hint, accuracy_level=accuracy_level, lead=lead)


def emit_gather(g: Graph, ids: str, leaf: QArray, contracting: tuple[int, ...], free: tuple[int, ...], *,
                hint: str, key: Any) -> str:
    """Rows ``leaf[ids]`` of a quantized table (rows = ``free``, features = ``contracting``): ``[..., K]``."""
    if check_exportable(hint, leaf) != "nbits":
        raise ExportError(f"{hint}: a {leaf.bits}-bit embedding table cannot be gathered quantized (2, 4 or 8 bits)")
    b = blocked(leaf, contracting, free, path=hint)
    ins = _nbits_inputs(g, b, key, hint)
    width = b.nb * b.block * b.bits // 8
    data = g.memo(("gbq-data", key), lambda: g.op("Reshape", [ins[0], g.const([b.N, width], np.int64)], hint=hint + ".rows"))
    args = [data, ids, ins[1]] + ([ins[2]] if len(ins) > 2 else [])
    y = g.op("GatherBlockQuantized", args, domain=MS_DOMAIN, bits=b.bits, block_size=b.block, gather_axis=0,
             quantize_axis=1, hint=hint)
    if b.nb * b.block != b.K:  # a zero-padded last block: drop the padding columns
        y = g.op("Slice", [y, g.const([0], np.int64), g.const([b.K], np.int64), g.const([-1], np.int64)])
    return y


def _emit_dq(g: Graph, x: str, b: Blocked, hint: str) -> str:
    """5..7-bit weights: DequantizeLinear of the canonical ``[K, N]`` codes (blocked along K) -> MatMul."""
    Kp = b.nb * b.block
    def make() -> str:
        codes_kn = np.ascontiguousarray(b.codes.T)  # [Kp, N]
        ins = [g.init(hint + ".qweight", codes_kn.astype(np.uint8)), g.init(hint + ".scales", b.scales.T.copy()),
               g.init(hint + ".qzeros", b.zero_points.T.astype(np.uint8).copy())]
        w = g.op("DequantizeLinear", ins, axis=0, block_size=b.block, hint=hint + ".w")
        if Kp != b.K:
            w = g.op("Slice", [w, g.const([0], np.int64), g.const([b.K], np.int64), g.const([0], np.int64)])
        return w
    return g.op("MatMul", [x, g.memo(("dq", hint), make)], hint=hint)


S8_WEIGHT_LIMIT = 64
"""Weight integers within ``+-64`` take the signed (u8 x s8) W8A8 lowering: ``2 * 255 * 64 = 32640`` fits
the int16 pair sums of x86 CPUs without VNNI (``vpmaddubsw``), so onnxruntime's fast u8 x s8 GEMM is exact
on every CPU; wider weights fall back to u8 x u8 (exact everywhere, about half the speed)."""


def w8a8_weight_codes(w: QArray, contracting: tuple[int, ...] = (0,), free: tuple[int, ...] = (1,)) -> np.ndarray:
    """``[K, N]`` weight operand of the W8A8 ``MatMulInteger``: int8 ``integer_values(w)`` where they all lie
    within ``+-S8_WEIGHT_LIMIT``, else uint8 ``integer_values(w) + 128`` (zero point 128)."""
    iv = _matrix(np.asarray(integer_values(w)).astype(np.int32), contracting, free).T
    if iv.size and (iv.min() < -127 or iv.max() > 127):
        raise ExportError(f"W8A8 weight integers {iv.min()}..{iv.max()} do not fit int8 [-127, 127]")
    if not iv.size or np.abs(iv).max() <= S8_WEIGHT_LIMIT:
        return iv.astype(np.int8)
    return (iv + W8A8_ZERO_POINT).astype(np.uint8)


def _quantize_rows(g: Graph, x: str, k: ActQuantKernel, K: int, hint: str,
                   lead: Sequence[Any] | None = None) -> tuple[str, str]:
    """uint8 activation codes ``q + 128`` of ``x [*lead, K]`` (its own shape) and their scale: ``[*lead, 1]``
    per token, a scalar per tensor. Emitted once per input and activation setting (Q / K / V, gate / up
    share them); the per-token zero points once per ``lead`` (fewer nodes for onnxruntime to dispatch), or
    from the scale's shape where ``lead`` is unknown."""
    qmax = float(2 ** (k.act_bits - 1) - 1)
    lo = -qmax - 1 if k.act_full_range else -qmax  # the grid of eqjax.core.linear.quantize_activations
    static = None if k.act_scale is None else np.asarray(k.act_scale, np.float32).reshape(-1)[:1]

    def make() -> tuple[str, str]:
        if static is not None:  # a static scale: codes may leave the grid, so clip as eqjax does
            s = g.const(static.reshape(()))
            r = g.op("Round", [g.op("Div", [x, s])])
            qx = g.op("Cast", [g.op("Add", [g.op("Clip", [r, g.const(lo), g.const(qmax)]), g.const(128.0)])],
                      to=2, hint=hint + ".qx")  # 2 = UINT8
            return qx, s
        # a dynamic scale keeps x / s within [-qmax, qmax] (full range: [-qmax - 1/2, qmax + 1/2], whose ends
        # round half to even to -qmax - 1 and qmax + 1; uint8 saturation clips the latter to qmax, as eqjax
        # does), so one QuantizeLinear (x / s rounded half to even, + 128; per token: blocked along the last
        # axis, one block of K) gives the codes of Round(Div) + Clip + Cast
        token = k.act_granularity == "token"
        amax = g.op("ReduceMax", [g.op("Abs", [x])] + ([g.const([-1], np.int64)] if token else []), keepdims=int(token))
        # eqjax gives a zero row scale 1; any positive scale gives it codes 0 and outputs 0, so one Max with
        # the smallest normal float32 (never reached by a real row's absmax / qmax) replaces Greater + Where
        div = qmax + 0.5 if k.act_full_range else qmax
        s = g.op("Max", [g.op("Div", [amax, g.const(div)]), g.const(float(np.finfo(np.float32).tiny))],
                 hint=hint + ".sx")  # [..., 1] or []
        if not token:
            return g.op("QuantizeLinear", [x, s, g.const(W8A8_ZERO_POINT, np.uint8)], hint=hint + ".qx"), s
        zx = _token_zero_points(g, s, lead)
        return g.op("QuantizeLinear", [x, s, zx], axis=-1, block_size=K, hint=hint + ".qx"), s

    key = ("act-q", x, K, k.act_bits, k.act_granularity, k.act_full_range,
           None if static is None else static.tobytes())
    return g.memo(key, make)


def _token_zero_points(g: Graph, s: str, lead: Sequence[Any] | None) -> str:
    """uint8 ``W8A8_ZERO_POINT`` in the shape of the per-token scale ``s`` (``[*lead, 1]``)."""
    def make(shape: str) -> str:
        return g.op("ConstantOfShape", [shape], value=onnx.helper.make_tensor(
            "zp", onnx.TensorProto.UINT8, [1], [W8A8_ZERO_POINT]), hint="zp_tokens")
    if lead is None:
        return make(g.op("Shape", [s]))
    return g.memo(("token-zp", tuple(str(d) for d in lead)), lambda: make(g.shape(list(lead) + [1])))


def _emit_w8a8(g: Graph, x: str, k: ActQuantKernel, use: Any, hint: str,
               lead: Sequence[Any] | None = None) -> str:
    w = k.weight
    if use.index or use.batch:
        raise ExportError(f"{use.path}: W8A8 needs a weight used without batch or stacked axes")
    K, N = use.k, use.n
    gran = w.granularity
    grouped = gran.kind == "group" and all(a in use.contracting for a in gran.axes)
    if grouped and (len(use.contracting) != 1 or K % gran.group_size):
        raise ExportError(f"{use.path}: W8A8 group size {gran.group_size} must divide the input width {K} "
                          "(a short last group) and run along a single input axis")
    if gran.kind == "group" and not grouped or gran.kind == "channel" and any(a not in use.free for a in gran.axes):
        raise ExportError(f"{use.path}: W8A8 needs per-output-channel, per-tensor or input-group weight scales, got {gran}")
    zp = g.const(W8A8_ZERO_POINT, np.uint8)
    table = not grouped and _is_table(w, use.contracting, use.free)
    if table:  # a tied LM head: the table stored once, as the gather reads it
        table_q, ws_name, u8 = w8a8_table(g, w, hint)
        wq_name = g.op("Transpose", [table_q], perm=[1, 0])  # an initializer's transpose: folded at load
    else:
        wq = w8a8_weight_codes(w, use.contracting, use.free)
        u8 = wq.dtype == np.uint8
        ws = _matrix(np.asarray(expand_scale(w)), use.contracting, use.free).T  # [K, N] per-element scales
    # activations uint8 (zero point 128); weights int8 (zero point 0) when within +-64, else uint8 (zero point
    # 128): both exact on every x86 CPU (see S8_WEIGHT_LIMIT)
    wzp = zp if u8 else g.const(0, np.int8)
    if grouped:
        G = gran.group_size
        ng = K // G
        qx, s = _quantize_rows(g, g.op("Reshape", [x, g.const([-1, K], np.int64)]), k, K, hint)
        q3 = g.op("Transpose", [g.op("Reshape", [qx, g.const([-1, ng, G], np.int64)])], perm=[1, 0, 2])
        acc = g.op("MatMulInteger", [q3, g.init(hint + ".wq", wq.reshape(ng, G, N)), zp, wzp])  # [ng, M, N]
        y = g.op("Mul", [g.op("Cast", [acc], to=1), g.init(hint + ".ws", ws[::G].reshape(ng, 1, N).astype(np.float32))])
        y = g.op("ReduceSum", [y, g.const([0], np.int64)], keepdims=0)
        y = g.op("Mul", [y, s])
        x_lead = g.op("Slice", [g.op("Shape", [x]), g.const([0], np.int64), g.const([-1], np.int64)])
        return g.op("Reshape", [y, g.op("Concat", [x_lead, g.const([N], np.int64)], axis=0)], hint=hint)
    # codes and scales in x's own shape, so the product is [..., N] straight from one MatMulIntegerToFloat
    # (float(acc) * ws: the same two roundings as Cast then Mul) and a Mul: siblings then pack into one
    # wider product (eqjax.export.pack). A [..., 1] a_scale would drop the Mul (onnxruntime broadcasts it)
    # but rounds fl(sx * ws) once more and measured no faster (2026-11-26, SmolLM2 prefill).
    qx_nd, s_nd = _quantize_rows(g, x, k, K, hint, lead)
    if not table:
        wq_name, ws_name = g.init(hint + ".wq", wq), g.init(hint + ".ws", ws[0].reshape(N).astype(np.float32))
    if k.act_granularity == "tensor":  # one scalar scale: the op's own a_scale, no Mul over the output
        return g.op("MatMulIntegerToFloat", [qx_nd, wq_name, s_nd, ws_name, zp, wzp], domain=MS_DOMAIN, hint=hint)
    y = g.op("MatMulIntegerToFloat", [qx_nd, wq_name, g.const(1.0), ws_name, zp, wzp], domain=MS_DOMAIN)
    return g.op("Mul", [y, s_nd], hint=hint)


def _is_table(w: QArray, contracting: tuple[int, ...], free: tuple[int, ...]) -> bool:
    """A 2-D ``[N, K]`` weight (rows = outputs) with one scale per row: an embedding table's layout."""
    return (len(w.shape) == 2 and contracting == (1,) and free == (0,) and w.granularity.kind == "channel"
            and tuple(w.granularity.axes) == (0,))


def w8a8_table(g: Graph, w: QArray, hint: str) -> tuple[str, str, bool]:
    """A W8A8 table ``[V, D]`` (per-row scales) as initializers, once: its integer codes (int8 within
    ``+-S8_WEIGHT_LIMIT``, else uint8 ``+ 128``), its float32 scales ``[V]``, and whether the codes are uint8."""
    def make() -> tuple[str, str, bool]:
        vd = w8a8_weight_codes(w, (1,), (0,)).T  # [V, D]
        return (g.init(hint + ".wq", np.ascontiguousarray(vd)),
                g.init(hint + ".ws", np.asarray(w.scale, np.float32).reshape(-1)), vd.dtype == np.uint8)
    return g.memo(("w8a8-table", hint), make)


def emit_table_gather(g: Graph, ids: str, k: ActQuantKernel, *, hint: str) -> str:
    """Rows ``table[ids]`` ``[..., D]`` of a W8A8 table (a tied head's embedding): integers times the row
    scales, from the same initializers as the head's ``MatMulIntegerToFloat``."""
    if not _is_table(k.weight, (1,), (0,)):
        raise ExportError(f"{hint}: a W8A8 embedding table needs one scale per row, got {k.weight.granularity}")
    table_q, scales, u8 = w8a8_table(g, k.weight, hint)
    rows = g.op("Cast", [g.op("Gather", [table_q, ids], axis=0)], to=1)
    if u8:
        rows = g.op("Sub", [rows, g.const(float(W8A8_ZERO_POINT))])
    s = g.op("Unsqueeze", [g.op("Gather", [scales, ids], axis=0), g.const([-1], np.int64)])
    return g.op("Mul", [rows, s], hint=hint)

