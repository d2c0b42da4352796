"""Lower a traced :class:`~eqjax.core.program.Program` to ONNX nodes, one primitive at a time.

The walker evaluates the program's nodes in order into an environment of *values*:

* a ``str``: an ONNX tensor name;
* a ``numpy`` array: a compile-time constant (literals, closed-over constants, and every node whose
  inputs are all constants is folded at export time by binding the primitive, so index vectors,
  masks built from literals and similar never reach the graph);
* a :class:`Stack`: a list of values along axis 0 (a stacked KV cache ``[L, ...]`` whose layers are
  separate graph inputs/outputs; a constant-index ``gather`` picks one, a constant-index ``scatter``
  replaces one, anything else materializes the stack with ``Concat``).

Params are initializers (shared per path). At a weight use (:mod:`eqjax.core.analysis`) a quantized
param goes through :mod:`eqjax.export.qlower` (the activation brought to ``[..., K]`` and the result
back to the dot's layout); a quantized table's row gather becomes ``GatherBlockQuantized``; any other
reader of a quantized param gets its dequantized float values (correct, counted in ``dequantized``).
Fusions (:mod:`eqjax.export.fusions`) replace values by fused ops; nodes whose values nobody needs
afterwards are not emitted. Symbolic dimensions come from :meth:`eqjax.export.graph.Graph.dim`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import numpy as np

from eqjax.core.analysis import Analysis
from eqjax.core.numerics import dequantize_leaf
from eqjax.core.program import Lit, Program, Ref
from eqjax.core.qarray import ActQuantKernel, is_quantized
from eqjax.core.views import bind, view_nodes
from eqjax.export.graph import ExportError, Graph, onnx_dtype
from eqjax.export.qlower import check_exportable, emit_gather, emit_table_gather, emit_weight_matmul, half_initializer, lowered_at_use

__all__ = ["Stack", "Walker", "Fused"]

_FOLD_LIMIT = 1 << 20  # fold constant nodes up to this many elements


@dataclasses.dataclass
class Stack:
    """Values along axis 0 of a stacked array (see the module docs)."""

    items: list


@dataclasses.dataclass
class Fused:
    """A fused op: ``emit(walker) -> [output names]`` replacing the program values ``outs``; it reads
    the program values ``ins`` (for liveness)."""

    ins: tuple[Ref, ...]
    outs: tuple[int, ...]
    emit: Callable[["Walker"], list[str]]
    kind: str = "fused"


def _static(d: Any) -> bool:
    return isinstance(d, (int, np.integer))


def _shape_eq(a: Any, b: Any) -> bool:
    return str(a) == str(b)


class Walker:
    """One lowering of ``prog`` into ``g`` (see the module docs).

    Args:
      prog, an: the program and its analysis.
      params: path -> float array, QArray, ActQuantKernel or RotatedKernel.
      g: the graph to fill.
      accuracy_level: MatMulNBits ``accuracy_level`` (None: the op's default).
      fused: the fusions to apply.
    """

    def __init__(self, prog: Program, an: Analysis, params: Mapping[str, Any], g: Graph, *,
                 accuracy_level: int | None = None, fused: tuple[Fused, ...] = ()) -> None:
        self.prog, self.an, self.params, self.g = prog, an, params, g
        self.accuracy_level = accuracy_level
        self.env: dict[int, Any] = {}
        self.fused = fused
        self.replaced = {v: (f, k) for f in fused for k, v in enumerate(f.outs)}
        self._emitted: dict[int, list[str]] = {}
        self.dequantized: list[str] = []
        self.counts: dict[str, int] = {}

    # ------------------------------------------------------------------------------------ values
    def value(self, ref: Ref) -> Any:
        """The value of a ref: a tensor name, a constant array or a Stack."""
        if isinstance(ref, Lit):
            return np.asarray(ref.value)
        if ref in self.replaced:
            f, k = self.replaced[ref]
            if id(f) not in self._emitted:
                self._emitted[id(f)] = f.emit(self)
                self.counts[f.kind] = self.counts.get(f.kind, 0) + 1
            return self._emitted[id(f)][k]
        if ref in self.env:
            return self.env[ref]
        if ref in self.prog.param_of:
            return self.param_tensor(self.prog.param_of[ref])
        if ref in self.prog.consts:
            return np.asarray(self.prog.consts[ref])
        raise ExportError(f"internal: value {ref} has no definition")

    def name(self, ref_or_val: Any, dtype: Any = None) -> str:
        """A tensor name for a ref or value (constants become initializers; stacks are concatenated)."""
        v = self.value(ref_or_val) if isinstance(ref_or_val, (int, Lit)) else ref_or_val
        if isinstance(v, str):
            return v
        if isinstance(v, Stack):
            parts = [self.g.op("Unsqueeze", [self.name(x), self.g.const([0], np.int64)]) for x in v.items]
            return self.g.op("Concat", parts, axis=0, hint="stack")
        arr = np.asarray(v)
        if dtype is not None:
            arr = arr.astype(dtype)
        if arr.dtype == np.dtype("bfloat16") or arr.dtype == np.float16:
            arr = arr.astype(np.float32)
        return self.g.const(arr, arr.dtype)

    def param_tensor(self, path: str) -> str:
        """The float initializer of a param (dequantized when quantized; a float16 HalfFloat stays float16
        in the file, widened by a ``Cast`` that onnxruntime folds at load)."""
        def make() -> str:
            leaf = self.params[path]
            if half_initializer(leaf):
                return self.g.op("Cast", [self.g.init(path.replace("/", "."), np.asarray(leaf.values))], to=1)
            if is_quantized(leaf):
                self.dequantized.append(path)
                arr = np.asarray(dequantize_leaf(leaf, np.float32))
            else:
                arr = np.asarray(leaf)
                if arr.dtype != np.float32 and np.issubdtype(arr.dtype, np.floating):
                    arr = arr.astype(np.float32)
            return self.g.init(path.replace("/", "."), arr)
        return self.g.memo(("param", path), make)

    def aval(self, ref: Ref) -> Any:
        return jax.typeof(ref.value) if isinstance(ref, Lit) else self.prog.avals[ref]

    # ------------------------------------------------------------------------------------ liveness
    def _live(self) -> list[bool]:
        prog = self.prog
        need = {r for r in prog.outputs if isinstance(r, int)}
        todo = list(need)
        fused_done: set[int] = set()

        def mark(r: Ref) -> None:
            if isinstance(r, int) and r not in need:
                need.add(r)
                todo.append(r)

        live = [False] * len(prog.nodes)
        for i in range(len(prog.nodes) - 1, -1, -1):
            # values replaced by fused ops pull in the fused op's inputs instead of their producers
            while todo:
                r = todo.pop()
                if r in self.replaced:
                    f, _ = self.replaced[r]
                    if id(f) not in fused_done:
                        fused_done.add(id(f))
                        for x in f.ins:
                            mark(x)
            node = prog.nodes[i]
            if any(o in need and o not in self.replaced for o in node.outs):
                live[i] = True
                use, emb = self.an.use_at(i), self.an.embedding_at(i)
                if use is not None:  # the weight operand is rebuilt from the param itself
                    mark(use.x)
                elif emb is not None and lowered_at_use(self.params[emb.path]):
                    mark(node.ins[1])
                else:
                    for r in node.ins:
                        mark(r)
        return live

    # ------------------------------------------------------------------------------------ run
    def run(self, inputs: Mapping[int, Any]) -> list[Any]:
        """Lower every live node given the program args' values; returns the outputs' values."""
        self.env.update(inputs)
        live = self._live()
        for i, node in enumerate(self.prog.nodes):
            if not live[i]:
                continue
            use = self.an.use_at(i)
            if use is not None:
                self.env[node.outs[0]] = self._weight_use(i, use)
                continue
            emb = self.an.embedding_at(i)
            if emb is not None and lowered_at_use(self.params[emb.path]):
                self.env[node.outs[0]] = self._quantized_gather(i, emb)
                continue
            ins = [self.value(r) for r in node.ins]
            if ins and all(isinstance(v, np.ndarray) for v in ins) and self._foldable(node):
                outs = bind(node, [jax.numpy.asarray(v) for v in ins])
                for o, v in zip(node.outs, outs):
                    self.env[o] = np.asarray(v)
                continue
            lower = _LOWER.get(node.name)
            if lower is None:
                raise ExportError(f"the primitive {node.name!r} has no ONNX lowering (node {i} of the traced program)")
            outs = lower(self, node, ins)
            outs = outs if isinstance(outs, (list, tuple)) else [outs]
            for o, v in zip(node.outs, outs):
                self.env[o] = v
        return [self.value(r) for r in self.prog.outputs]

    def _foldable(self, node: Any) -> bool:
        return all(all(_static(d) for d in self.prog.avals[o].shape) and
                   int(np.prod(self.prog.avals[o].shape, dtype=np.int64)) <= _FOLD_LIMIT for o in node.outs)

    # ------------------------------------------------------------------------------------ weights
    def _weight_use(self, i: int, use: Any) -> str:
        node = self.prog.nodes[i]
        leaf = self.params[use.path]
        if not lowered_at_use(leaf):
            w = self.param_tensor(use.path)
            w = self._view(use, w)
            ins = [self.name(use.x), w] if use.side == 1 else [w, self.name(use.x)]
            return _dot_general(self, node, ins)
        check_exportable(use.path, leaf)
        if use.batch:
            raise ExportError(f"{use.path}: a quantized weight used with batch dimensions cannot be exported")
        x = self.name(use.x)
        xs = self.aval(use.x).shape
        others = [a for a in range(len(xs)) if a not in use.x_contracting]
        perm = others + list(use.x_contracting)
        if perm != list(range(len(xs))):
            x = self.g.op("Transpose", [x], perm=perm)
        if len(use.x_contracting) != 1:
            x = self.g.op("Reshape", [x, self.g.shape([xs[a] for a in others] + [use.k])])
        y = emit_weight_matmul(self.g, x, leaf, use, [xs[a] for a in others], hint=use.path.replace("/", "."),
                               accuracy_level=self.accuracy_level)
        self.counts["quantized_matmul"] = self.counts.get("quantized_matmul", 0) + 1
        out_shape = self.prog.avals[node.outs[0]].shape
        (lc, rc), (lb, rb) = node.params["dimension_numbers"]
        wc = rc if use.side == 1 else lc
        w_ndim = len(self.prog.shape(node.ins[use.side]))
        op_free = [use.view.axes[a] for a in range(w_ndim) if a not in wc and use.view.axes[a] is not None]
        nx = len(others)
        if len(use.free) != 1:
            y = self.g.op("Reshape", [y, self.g.shape([xs[a] for a in others] + [use.shape[p] for p in use.free])])
        w_perm = [nx + use.free.index(p) for p in op_free]
        perm = (list(range(nx)) + w_perm) if use.side == 1 else (w_perm + list(range(nx)))
        if perm != list(range(len(perm))):
            y = self.g.op("Transpose", [y], perm=perm)
        if len(perm) != len(out_shape):
            y = self.g.op("Reshape", [y, self.g.shape(out_shape)])
        return y

    def _view(self, use: Any, w: str) -> str:
        """Replay the layout ops from the param to the use's operand."""
        for n in view_nodes(self.prog, use):
            w = _LOWER[n.name](self, n, [w] + [self.value(r) for r in n.ins[1:]])
        return w

    def _quantized_gather(self, i: int, emb: Any) -> str:
        node = self.prog.nodes[i]
        leaf = self.params[emb.path]
        q = leaf.weight if isinstance(leaf, ActQuantKernel) else leaf
        shape = self.an.shapes[emb.path]
        if emb.view.axes != tuple(range(len(shape))) or emb.view.index or emb.axis != 0 or len(shape) != 2:
            w = self.param_tensor(emb.path)
            return _gather(self, node, [self._view(emb, w), self.value(node.ins[1])])
        ids = self.name(node.ins[1])
        ids = self.g.op("Squeeze", [ids, self.g.const([-1], np.int64)])
        # a tied table shares the MatMulNBits initializer of its LM-head use
        uses = self.an.uses_of(emb.path)
        key = (emb.path, uses[0].contracting, uses[0].free, uses[0].index) if uses else (emb.path, (1,), (0,), ())
        self.counts["quantized_gather"] = self.counts.get("quantized_gather", 0) + 1
        if isinstance(leaf, ActQuantKernel):  # a W8A8 tied head: rows from the head's own initializers
            return emit_table_gather(self.g, ids, leaf, hint=emb.path.replace("/", "."))
        return emit_gather(self.g, ids, q, (1,), (0,), hint=emb.path.replace("/", "."), key=key)


# ---------------------------------------------------------------------------------------- lowerings
def _lit_as(w: Walker, v: Any, like: Any) -> str:
    """A constant operand cast to the dtype of the other operand's aval."""
    return w.name(np.asarray(v).astype(like)) if isinstance(v, np.ndarray) else w.name(v)


def _elementwise(op: str) -> Callable:
    def f(w: Walker, node: Any, ins: list) -> str:
        dt = next((w.aval(r).dtype for r, v in zip(node.ins, ins) if not isinstance(v, np.ndarray)),
                  w.prog.avals[node.outs[0]].dtype)
        return w.g.op(op, [_lit_as(w, v, dt) for v in ins])
    return f


def _unary(op: str, **attrs: Any) -> Callable:
    return lambda w, node, ins: w.g.op(op, [w.name(ins[0])], **attrs)


def _ne(w: Walker, node: Any, ins: list) -> str:
    return w.g.op("Not", [_elementwise("Equal")(w, node, ins)])


def _logical(op: str, bit: str) -> Callable:
    def f(w: Walker, node: Any, ins: list) -> str:
        dt = w.prog.avals[node.outs[0]].dtype
        return _elementwise(op if dt == np.bool_ else bit)(w, node, ins)
    return f


def _not(w: Walker, node: Any, ins: list) -> str:
    dt = w.prog.avals[node.outs[0]].dtype
    return w.g.op("Not" if dt == np.bool_ else "BitwiseNot", [w.name(ins[0])])


def _rsqrt(w: Walker, node: Any, ins: list) -> str:
    return w.g.op("Reciprocal", [w.g.op("Sqrt", [w.name(ins[0])])])


def _integer_pow(w: Walker, node: Any, ins: list) -> str:
    y = int(node.params["y"])
    x = w.name(ins[0])
    if y == 2:
        return w.g.op("Mul", [x, x])
    dt = w.prog.avals[node.outs[0]].dtype
    return w.g.op("Pow", [x, w.g.const(float(y), dt)])


def _convert(w: Walker, node: Any, ins: list) -> str:
    src, dst = w.aval(node.ins[0]).dtype, node.params["new_dtype"]
    x = w.name(ins[0])
    return x if np.dtype(src) == np.dtype(dst) else w.g.op("Cast", [x], to=onnx_dtype(dst))


def _identity(w: Walker, node: Any, ins: list) -> Any:
    return ins[0] if len(ins) == 1 else list(ins)


def _select_n(w: Walker, node: Any, ins: list) -> str:
    pred, cases = ins[0], ins[1:]
    dt = w.prog.avals[node.outs[0]].dtype
    if len(cases) != 2:
        raise ExportError(f"select_n with {len(cases)} cases has no ONNX lowering")
    p = w.name(pred)
    if w.aval(node.ins[0]).dtype != np.bool_:
        p = w.g.op("Cast", [p], to=onnx_dtype(np.bool_))
    return w.g.op("Where", [p, _lit_as(w, cases[1], dt), _lit_as(w, cases[0], dt)])


def _clamp(w: Walker, node: Any, ins: list) -> str:
    dt = w.prog.avals[node.outs[0]].dtype
    lo, x, hi = (_lit_as(w, v, dt) for v in ins)
    return w.g.op("Max", [w.g.op("Min", [x, hi]), lo])


def _broadcast_in_dim(w: Walker, node: Any, ins: list) -> str:
    shape, bd = node.params["shape"], tuple(node.params["broadcast_dimensions"])
    x = w.name(ins[0])
    in_shape = w.aval(node.ins[0]).shape
    new = [i for i in range(len(shape)) if i not in bd]
    if new:
        x = w.g.op("Unsqueeze", [x, w.g.const(new, np.int64)])
    full = [1] * len(shape)
    for k, b in enumerate(bd):
        full[b] = in_shape[k]
    if any(not _shape_eq(a, b) for a, b in zip(full, shape)):
        x = w.g.op("Expand", [x, w.g.shape(shape)])
    return x


def _reshape(w: Walker, node: Any, ins: list) -> str:
    if node.params.get("dimensions") is not None:
        raise ExportError("reshape with dimensions has no ONNX lowering")
    return w.g.op("Reshape", [w.name(ins[0]), w.g.shape(node.params["new_sizes"])])


def _squeeze(w: Walker, node: Any, ins: list) -> str:
    return w.g.op("Squeeze", [w.name(ins[0]), w.g.const(list(node.params["dimensions"]), np.int64)])


def _expand_dims(w: Walker, node: Any, ins: list) -> str:
    return w.g.op("Unsqueeze", [w.name(ins[0]), w.g.const(list(node.params["dimensions"]), np.int64)])


def _transpose(w: Walker, node: Any, ins: list) -> str:
    return w.g.op("Transpose", [w.name(ins[0])], perm=list(node.params["permutation"]))


def _concatenate(w: Walker, node: Any, ins: list) -> str:
    dt = w.prog.avals[node.outs[0]].dtype
    return w.g.op("Concat", [_lit_as(w, v, dt) for v in ins], axis=int(node.params["dimension"]))


def _slice(w: Walker, node: Any, ins: list) -> str:
    starts, limits = node.params["start_indices"], node.params["limit_indices"]
    strides = node.params.get("strides") or [1] * len(starts)
    axes = [a for a in range(len(starts)) if not (starts[a] == 0 and _shape_eq(limits[a], w.aval(node.ins[0]).shape[a])
                                                   and strides[a] == 1)]
    if not axes:
        return w.name(ins[0])
    ends = w.g.op("Concat", [w.g.dim(limits[a]) for a in axes], axis=0) if any(not _static(limits[a]) for a in axes) \
        else w.g.const([int(limits[a]) for a in axes], np.int64)
    return w.g.op("Slice", [w.name(ins[0]), w.g.const([int(starts[a]) for a in axes], np.int64), ends,
                            w.g.const(axes, np.int64), w.g.const([int(strides[a]) for a in axes], np.int64)])


def _index_i64(w: Walker, v: Any) -> str:
    """A scalar index value as int64 [1]."""
    if isinstance(v, np.ndarray):
        return w.g.const([int(v)], np.int64)
    return w.g.op("Reshape", [w.g.op("Cast", [v], to=onnx_dtype(np.int64)), w.g.const([1], np.int64)])


def _clamped_starts(w: Walker, shape: Any, sizes: Any, starts: list) -> list[str]:
    out = []
    for d, sz, s in zip(shape, sizes, starts):
        hi = w.g.op("Sub", [w.g.dim(d), w.g.dim(sz)])
        out.append(w.g.op("Max", [w.g.op("Min", [_index_i64(w, s), hi]), w.g.const([0], np.int64)]))
    return out


def _dynamic_slice(w: Walker, node: Any, ins: list) -> str:
    shape, sizes = w.aval(node.ins[0]).shape, node.params["slice_sizes"]
    st = _clamped_starts(w, shape, sizes, ins[1:])
    starts = w.g.op("Concat", st, axis=0)
    ends = w.g.op("Add", [starts, w.g.shape(sizes)])
    return w.g.op("Slice", [w.name(ins[0]), starts, ends, w.g.const(list(range(len(shape))), np.int64)])


def _dynamic_update_slice(w: Walker, node: Any, ins: list) -> str:
    op, upd, starts = ins[0], ins[1], ins[2:]
    shape, ushape = w.aval(node.ins[0]).shape, w.aval(node.ins[1]).shape
    dyn = [a for a, s in enumerate(starts) if not (isinstance(s, np.ndarray) and int(s) == 0)]
    if not dyn:
        dyn = [0]
    if len(dyn) != 1:
        raise ExportError("dynamic_update_slice at more than one non-zero start has no ONNX lowering here")
    a = dyn[0]
    (start,) = _clamped_starts(w, [shape[a]], [ushape[a]], [starts[a]])
    rng = w.g.op("Range", [w.g.op("Squeeze", [start, w.g.const([0], np.int64)]),
                           w.g.op("Squeeze", [w.g.op("Add", [start, w.g.dim(ushape[a])]), w.g.const([0], np.int64)]),
                           w.g.const(1, np.int64)])
    view = [1] * len(ushape)
    view[a] = -1
    idx = w.g.op("Expand", [w.g.op("Reshape", [rng, w.g.const(view, np.int64)]), w.g.shape(ushape)])
    return w.g.op("ScatterElements", [w.name(op), idx, w.name(upd)], axis=a)


def _gather(w: Walker, node: Any, ins: list) -> Any:
    operand, idx = ins
    dn = node.params["dimension_numbers"]
    sizes = node.params["slice_sizes"]
    oshape = w.aval(node.ins[0]).shape
    collapsed, smap = tuple(dn.collapsed_slice_dims), tuple(dn.start_index_map)
    if isinstance(idx, np.ndarray) and idx.shape == (len(smap),):  # a static window
        if isinstance(operand, Stack) and smap == (0,) and collapsed == (0,):
            return operand[int(idx[0])] if isinstance(operand, list) else operand.items[int(idx[0])]
        x = w.name(operand)
        st = [int(np.clip(int(i), 0, (oshape[a] - sizes[a]) if _static(oshape[a]) and _static(sizes[a]) else int(i)))
              for i, a in zip(idx, smap)]
        x = w.g.op("Slice", [x, w.g.const(st, np.int64), w.g.op("Concat", [w.g.dim(s + sizes[a]) for s, a in zip(st, smap)],
                                                                   axis=0), w.g.const(list(smap), np.int64)])
        if collapsed:
            x = w.g.op("Squeeze", [x, w.g.const(list(collapsed), np.int64)])
        return x
    full = all(_shape_eq(sizes[a], oshape[a]) for a in range(1, len(oshape)))
    if smap == (0,) and collapsed == (0,) and sizes[0] == 1 and full and not tuple(getattr(dn, "operand_batching_dims", ())):
        ids = w.g.op("Squeeze", [w.name(idx), w.g.const([-1], np.int64)])
        return w.g.op("Gather", [w.name(operand), ids], axis=0)
    raise ExportError(f"gather with {dn} has no ONNX lowering here")


def _scatter(w: Walker, node: Any, ins: list) -> Any:
    operand, idx, upd = ins
    dn = node.params["dimension_numbers"]
    if isinstance(operand, Stack) and isinstance(idx, np.ndarray) and idx.shape == (1,) \
            and tuple(dn.inserted_window_dims) == (0,) and tuple(dn.scatter_dims_to_operand_dims) == (0,):
        items = list(operand.items)
        items[int(idx[0])] = upd
        return Stack(items)
    raise ExportError(f"scatter with {dn} has no ONNX lowering here (only per-layer cache updates)")


def _reduce(op: str) -> Callable:
    def f(w: Walker, node: Any, ins: list) -> str:
        return w.g.op(op, [w.name(ins[0]), w.g.const(list(node.params["axes"]), np.int64)], keepdims=0)
    return f


def _argmax(w: Walker, node: Any, ins: list, op: str = "ArgMax") -> str:
    (axis,) = node.params["axes"]
    y = w.g.op(op, [w.name(ins[0])], axis=int(axis), keepdims=0)
    return w.g.op("Cast", [y], to=onnx_dtype(node.params["index_dtype"]))


def _cumsum(w: Walker, node: Any, ins: list) -> str:
    return w.g.op("CumSum", [w.name(ins[0]), w.g.const(int(node.params["axis"]), np.int64)],
                  reverse=int(bool(node.params.get("reverse", False))))


def _iota(w: Walker, node: Any, ins: list) -> str:
    shape, dim, dt = node.params["shape"], int(node.params["dimension"]), node.params["dtype"]
    n = w.g.op("Squeeze", [w.g.dim(shape[dim]), w.g.const([0], np.int64)])
    r = w.g.op("Range", [w.g.const(0, np.int64), n, w.g.const(1, np.int64)])
    if len(shape) > 1:
        view = [1] * len(shape)
        view[dim] = -1
        r = w.g.op("Expand", [w.g.op("Reshape", [r, w.g.const(view, np.int64)]), w.g.shape(shape)])
    return w.g.op("Cast", [r], to=onnx_dtype(dt))


def _split(w: Walker, node: Any, ins: list) -> list[str]:
    sizes = [int(s) for s in node.params["sizes"]]
    return w.g.op("Split", [w.name(ins[0]), w.g.const(sizes, np.int64)], n_out=len(sizes), axis=int(node.params["axis"]))


def _pad(w: Walker, node: Any, ins: list) -> str:
    cfg = node.params["padding_config"]
    if any(int(i) != 0 for _, _, i in cfg) or any(int(lo) < 0 or int(hi) < 0 for lo, hi, _ in cfg):
        raise ExportError("pad with interior or negative padding has no ONNX lowering here")
    pads = [int(lo) for lo, _, _ in cfg] + [int(hi) for _, hi, _ in cfg]
    dt = w.prog.avals[node.outs[0]].dtype
    return w.g.op("Pad", [w.name(ins[0]), w.g.const(pads, np.int64), _lit_as(w, ins[1], dt)])


def _dot_general(w: Walker, node: Any, ins: list) -> str:
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    ls, rs = w.aval(node.ins[0]).shape, w.aval(node.ins[1]).shape
    a, b = (w.name(v) for v in ins)
    nb = len(lb)
    in_dt, out_dt = np.dtype(w.aval(node.ins[0]).dtype), w.prog.avals[node.outs[0]].dtype
    simple = (tuple(lb) == tuple(range(nb)) and tuple(rb) == tuple(range(nb)) and len(lc) == 1 and len(rc) == 1
              and lc[0] == len(ls) - 1 and rc[0] in (len(rs) - 2, nb) and len(rs) == nb + 2 and len(ls) >= nb + 1)
    if nb == 0 and len(rs) == 2 and tuple(rc) == (1,) and tuple(lc) == (len(ls) - 1,) and in_dt == np.float32:
        # x . W^T, W [N, K] as stored (a tied embedding read as the LM head): Gemm(transB=1), about twice as
        # fast in onnxruntime as an Einsum (which transposes W on every call)
        y = w.g.op("Gemm", [w.g.op("Reshape", [a, w.g.const([-1, ls[-1]], np.int64)]), b], transB=1)
        y = w.g.op("Reshape", [y, w.g.shape(tuple(ls[:-1]) + (rs[0],))])
    elif simple and (len(ls) == nb + 2 or nb == 0):
        if rc[0] == len(rs) - 1:
            b = w.g.op("Transpose", [b], perm=list(range(nb)) + [nb + 1, nb])
        y = w.g.op("MatMul", [a, b])
    else:
        letters = iter("abcdefghijklmnopqrstuvwxyz")
        la = [next(letters) for _ in ls]
        lr = [None] * len(rs)
        for x, y_ in zip(lb, rb):
            lr[y_] = la[x]
        for x, y_ in zip(lc, rc):
            lr[y_] = la[x]
        lr = [c if c is not None else next(letters) for c in lr]
        out = [la[x] for x in lb] + [la[x] for x in range(len(ls)) if x not in lb and x not in lc] + \
              [lr[x] for x in range(len(rs)) if x not in rb and x not in rc]
        y = w.g.op("Einsum", [a, b], equation=f"{''.join(la)},{''.join(lr)}->{''.join(out)}")
    return y if in_dt == np.dtype(out_dt) else w.g.op("Cast", [y], to=onnx_dtype(out_dt))


def _exp2(w: Walker, node: Any, ins: list) -> str:
    dt = w.prog.avals[node.outs[0]].dtype
    return w.g.op("Pow", [w.g.const(2.0, dt), w.name(ins[0])])


def _erfc(w: Walker, node: Any, ins: list) -> str:  # exact GELU: 0.5 x erfc(-x / sqrt 2)
    return w.g.op("Sub", [w.g.const(1.0, w.prog.avals[node.outs[0]].dtype), w.g.op("Erf", [w.name(ins[0])])])


def _is_finite(w: Walker, node: Any, ins: list) -> str:
    x = w.name(ins[0])
    return w.g.op("Not", [w.g.op("Or", [w.g.op("IsInf", [x]), w.g.op("IsNaN", [x])])])


def _rem(w: Walker, node: Any, ins: list) -> str:
    dt = w.prog.avals[node.outs[0]].dtype
    return w.g.op("Mod", [_lit_as(w, v, dt) for v in ins], fmod=1)


_LOWER: dict[str, Callable] = {
    "add": _elementwise("Add"), "sub": _elementwise("Sub"), "mul": _elementwise("Mul"), "div": _elementwise("Div"),
    "max": _elementwise("Max"), "min": _elementwise("Min"), "rem": _rem,
    "pow": lambda w, node, ins: w.g.op("Pow", [w.name(v) for v in ins]),
    "eq": _elementwise("Equal"), "ne": _ne, "lt": _elementwise("Less"), "le": _elementwise("LessOrEqual"),
    "gt": _elementwise("Greater"), "ge": _elementwise("GreaterOrEqual"),
    "and": _logical("And", "BitwiseAnd"), "or": _logical("Or", "BitwiseOr"), "xor": _logical("Xor", "BitwiseXor"),
    "not": _not, "neg": _unary("Neg"), "exp": _unary("Exp"), "log": _unary("Log"), "tanh": _unary("Tanh"),
    "logistic": _unary("Sigmoid"), "sin": _unary("Sin"), "cos": _unary("Cos"), "tan": _unary("Tan"),
    "sqrt": _unary("Sqrt"), "rsqrt": _rsqrt, "abs": _unary("Abs"), "sign": _unary("Sign"), "floor": _unary("Floor"),
    "ceil": _unary("Ceil"), "round": _unary("Round"), "erf": _unary("Erf"), "exp2": _exp2,
    "square": lambda w, node, ins: w.g.op("Mul", [w.name(ins[0])] * 2),
    "integer_pow": _integer_pow, "is_finite": _is_finite, "erfc": _erfc,
    "convert_element_type": _convert, "stop_gradient": _identity, "copy": _identity, "copy_p": _identity,
    "reduce_precision": _identity, "optimization_barrier": _identity, "sharding_constraint": _identity,
    "select_n": _select_n, "clamp": _clamp, "broadcast_in_dim": _broadcast_in_dim, "reshape": _reshape,
    "squeeze": _squeeze, "expand_dims": _expand_dims, "transpose": _transpose, "concatenate": _concatenate,
    "slice": _slice, "dynamic_slice": _dynamic_slice, "dynamic_update_slice": _dynamic_update_slice,
    "gather": _gather, "scatter": _scatter, "reduce_sum": _reduce("ReduceSum"), "reduce_max": _reduce("ReduceMax"),
    "reduce_min": _reduce("ReduceMin"), "reduce_prod": _reduce("ReduceProd"), "argmax": _argmax,
    "argmin": lambda w, n, i: _argmax(w, n, i, "ArgMin"), "cumsum": _cumsum, "iota": _iota,
    "dim_as_value": lambda w, node, ins: w.g.scalar_dim(node.params["dim"], w.prog.avals[node.outs[0]].dtype),
    "split": _split, "pad": _pad, "dot_general": _dot_general,
}
