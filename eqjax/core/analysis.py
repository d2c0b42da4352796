"""What a program does with its params: matmul weights, embedding tables, everything else.

A param is found by its *role*, not its name:

* a **weight use** is a ``dot_general`` one of whose operands is a *view* of a param leaf (the leaf
  itself after layout-only ops: ``transpose``, dtype conversion, unit-dim ``reshape`` /
  ``squeeze`` / ``broadcast_in_dim``, or a one-index ``slice`` of a stacked param); the other operand
  is the activation. Axes come from the dot's dimension numbers: the weight's contracted axes are
  its *input* axes (the K of groups and of GPTQ), its free axes its *output channels*;
* an **embedding use** is a ``gather`` of whole rows of a param (``jnp.take(table, ids, axis=0)``);
* a param's :class:`Role` is ``"matmul"`` when every use is a weight use, ``"embedding"`` when it is
  gathered (and possibly also used as a matmul weight: a tied LM head), else ``"other"`` (norm scales,
  biases, anything read by another primitive), with the reason.

Canonical matrix of a weight use: the param's contracted axes (in the param's own order) flattened
to ``K``, its free axes flattened to ``N``: :func:`weight_matrix` gives ``[K, N]``,
:func:`activation_matrix` the activation as ``[M, K]`` with ``K`` in the same order, so that
``activation_matrix(x) @ weight_matrix(w)`` is the dot's result up to layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eqjax.core.program import VIEW_PRIMS, Lit, Program, Ref

__all__ = [
    "ParamView", "MatrixLayout", "WeightUse", "EmbeddingUse", "Role", "Analysis", "analyze", "param_view",
    "weight_matrix", "activation_matrix", "from_weight_matrix", "token_axis", "matrix_to_slice", "slice_to_matrix",
]


@dataclasses.dataclass(frozen=True)
class ParamView:
    """An operand that is a param leaf up to layout.

    Attributes:
      path: the param's path; value: its value id.
      axes: for each axis of the operand, the param axis it is (None: an inserted unit axis).
      index: ``(param axis, index)`` of axes a one-index slice took (stacked params).
    """

    path: str
    value: int
    axes: tuple[int | None, ...]
    index: tuple[tuple[int, int], ...] = ()


class MatrixLayout(NamedTuple):
    """The static part of a weight use that the canonical ``[K, N]`` matrix depends on (hashable:
    jit-static, shared by every layer of the same shape)."""

    shape: tuple[int, ...]
    contracting: tuple[int, ...]
    free: tuple[int, ...]
    index: tuple[tuple[int, int], ...] = ()

    @property
    def k(self) -> int:
        return int(np.prod([self.shape[a] for a in self.contracting], dtype=np.int64))

    @property
    def n(self) -> int:
        return int(np.prod([self.shape[a] for a in self.free], dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class WeightUse:
    """A ``dot_general`` with a param operand.

    Attributes:
      node: index of the dot node; path: the weight's param path; side: 0 (lhs) / 1 (rhs).
      view: how the operand derives from the param.
      contracting: the param's contracted axes, ascending (the canonical ``K`` order).
      free: the param's free (output-channel) axes, ascending.
      batch: the param's axes that are dot batch dims (per-head weights; rare).
      x: the activation operand; x_contracting: its axes paired with ``contracting``.
      shape: the param's shape.
    """

    node: int
    path: str
    side: int
    view: ParamView
    contracting: tuple[int, ...]
    free: tuple[int, ...]
    batch: tuple[int, ...]
    x: Ref
    x_contracting: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def k(self) -> int:
        """Input features: the product of the contracted axes."""
        return int(np.prod([self.shape[a] for a in self.contracting], dtype=np.int64))

    @property
    def n(self) -> int:
        """Output channels: the product of the free axes."""
        return int(np.prod([self.shape[a] for a in self.free], dtype=np.int64))

    @property
    def sliced(self) -> bool:
        return bool(self.view.index)

    @property
    def index(self) -> tuple[tuple[int, int], ...]:
        return self.view.index

    @property
    def layout(self) -> MatrixLayout:
        return MatrixLayout(self.shape, self.contracting, self.free, self.view.index)


@dataclasses.dataclass(frozen=True)
class EmbeddingUse:
    """A row gather ``table[ids]``: ``node`` index, the table's ``path``, the gathered param ``axis``."""

    node: int
    path: str
    axis: int
    view: ParamView


@dataclasses.dataclass(frozen=True)
class Role:
    """``kind``: ``"matmul"``, ``"embedding"`` or ``"other"``; ``why``: for ``"other"``, the first
    non-matmul use found (e.g. ``"read by mul"``)."""

    kind: Literal["matmul", "embedding", "other"]
    why: str = ""


# ------------------------------------------------------------------------------------------------
# Param views.
# ------------------------------------------------------------------------------------------------


def _map_through(prog: Program, node: Any, cur: int, axes: list, idx: dict) -> tuple[list, dict] | None:
    """Map operand axes of ``cur`` (the node's output) to axes of its input; None if not a view."""
    src = node.ins[0]
    in_shape = prog.shape(src)
    out_shape = prog.shape(cur)
    name = node.name
    p = node.params

    def remap(f):
        return [None if a is None else f(a) for a in axes], {f(k): v for k, v in idx.items()}

    if name in ("convert_element_type", "copy", "copy_p"):
        return axes, idx
    if name == "transpose":
        perm = p["permutation"]
        return remap(lambda a: perm[a])
    if name == "squeeze":
        kept = [d for d in range(len(in_shape)) if d not in p["dimensions"]]
        return remap(lambda a: kept[a])
    if name == "broadcast_in_dim":
        bd = tuple(p["broadcast_dimensions"])
        for j, d in enumerate(out_shape):
            if j not in bd and d != 1:
                return None
        if any(in_shape[k] != out_shape[b] for k, b in enumerate(bd)):
            return None
        new_axes = [None if (a is None or a not in bd) else bd.index(a) for a in axes]
        new_idx = {bd.index(k): v for k, v in idx.items() if k in bd}
        return new_axes, new_idx
    if name == "reshape":
        if p.get("dimensions") is not None:
            return None
        nz_in = [d for d, s in enumerate(in_shape) if s != 1]
        nz_out = [d for d, s in enumerate(out_shape) if s != 1]
        if [in_shape[d] for d in nz_in] != [out_shape[d] for d in nz_out]:
            return None
        pos = {o: i for o, i in zip(nz_out, nz_in)}
        new_axes = [None if (a is None or a not in pos) else pos[a] for a in axes]
        new_idx = {pos[k]: v for k, v in idx.items() if k in pos}
        return new_axes, new_idx
    if name == "slice":
        strides = p.get("strides")
        if strides is not None and any(s != 1 for s in strides):
            return None
        new_idx = dict(idx)
        for d, (a, b) in enumerate(zip(p["start_indices"], p["limit_indices"])):
            if (a, b) == (0, in_shape[d]):
                continue
            if b - a != 1:
                return None
            new_idx[d] = int(a)
        new_axes = [None if (a is not None and a in new_idx and a not in idx and out_shape[a] == 1
                            and in_shape[a] != 1) else a for a in axes]
        return new_axes, new_idx
    return None


def param_view(prog: Program, ref: Ref) -> ParamView | None:
    """The param ``ref`` is a view of, or None."""
    if isinstance(ref, Lit):
        return None
    cur = ref
    axes: list = list(range(len(prog.shape(cur))))
    idx: dict[int, int] = {}
    while True:
        if cur in prog.param_of:
            shape = prog.shape(cur)
            covered = {a for a in axes if a is not None} | set(idx)
            if any(shape[d] != 1 and d not in covered for d in range(len(shape))):
                return None
            return ParamView(prog.param_of[cur], cur, tuple(axes), tuple(sorted(idx.items())))
        i = prog.producer.get(cur)
        if i is None:
            return None
        node = prog.nodes[i]
        if node.name not in VIEW_PRIMS or not isinstance(node.ins[0], int):
            return None
        mapped = _map_through(prog, node, cur, axes, idx)
        if mapped is None:
            return None
        axes, idx = mapped
        cur = node.ins[0]


# ------------------------------------------------------------------------------------------------
# Uses and roles.
# ------------------------------------------------------------------------------------------------


def _weight_use(prog: Program, i: int) -> WeightUse | None:
    node = prog.nodes[i]
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    views = [param_view(prog, node.ins[0]), param_view(prog, node.ins[1])]
    if (views[0] is None) == (views[1] is None):
        return None
    side = 0 if views[0] is not None else 1
    view = views[side]
    w_c, x_c = (lc, rc) if side == 0 else (rc, lc)
    w_b = lb if side == 0 else rb
    wshape = prog.shape(node.ins[side])
    pshape = prog.shape(view.value)
    pairs = sorted((view.axes[a], xa) for a, xa in zip(w_c, x_c) if view.axes[a] is not None)
    batch = tuple(sorted(view.axes[a] for a in w_b if view.axes[a] is not None))
    free = tuple(sorted(view.axes[a] for a in range(len(wshape))
                        if a not in w_c and a not in w_b and view.axes[a] is not None))
    if not pairs:
        return None
    return WeightUse(i, view.path, side, view, tuple(p for p, _ in pairs), free, batch, node.ins[1 - side],
                     tuple(x for _, x in pairs), pshape)


def _embedding_use(prog: Program, i: int) -> EmbeddingUse | None:
    node = prog.nodes[i]
    view = param_view(prog, node.ins[0])
    if view is None:
        return None
    dn = node.params["dimension_numbers"]
    shape = prog.shape(node.ins[0])
    if (tuple(dn.collapsed_slice_dims) != (0,) or tuple(dn.start_index_map) != (0,)
            or tuple(getattr(dn, "operand_batching_dims", ())) or len(shape) < 2
            or tuple(node.params["slice_sizes"]) != (1,) + tuple(shape[1:])):
        return None
    axis = view.axes[0]
    if axis is None:
        return None
    return EmbeddingUse(i, view.path, axis, view)


@dataclasses.dataclass(frozen=True, eq=False)
class Analysis:
    """The uses and roles of a program's params (see the module docs).

    Attributes:
      program: the analysed program.
      uses: every weight use, in node order.
      embeddings: every row gather of a param.
      roles: param path -> :class:`Role`.
      shapes: param path -> shape.
    """

    program: Program
    uses: tuple[WeightUse, ...]
    embeddings: tuple[EmbeddingUse, ...]
    roles: dict[str, Role]
    shapes: dict[str, tuple[int, ...]]

    def uses_of(self, path: str) -> tuple[WeightUse, ...]:
        return tuple(u for u in self.uses if u.path == path)

    def use_at(self, node: int) -> WeightUse | None:
        return self._by_node.get(node)

    def embedding_at(self, node: int) -> EmbeddingUse | None:
        return self._emb_by_node.get(node)

    def paths(self, kind: str) -> tuple[str, ...]:
        """Param paths of a role kind, in program order of first use."""
        return tuple(p for p, r in self.roles.items() if r.kind == kind)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_node", {u.node: u for u in self.uses})
        object.__setattr__(self, "_emb_by_node", {e.node: e for e in self.embeddings})


def _view_closure(prog: Program, vid: int) -> tuple[set[int], set[int]]:
    """(values that are views of ``vid``, indices of the view nodes producing them)."""
    values, nodes, todo = {vid}, set(), [vid]
    while todo:
        v = todo.pop()
        for i in prog.users.get(v, ()):
            n = prog.nodes[i]
            if n.name in VIEW_PRIMS and n.ins[0] == v and i not in nodes:
                nodes.add(i)
                values.update(n.outs)
                todo.extend(n.outs)
    return values, nodes


def analyze(prog: Program) -> Analysis:
    """Find every weight use, embedding use and param role of ``prog``."""
    uses, embs = [], []
    for i, node in enumerate(prog.nodes):
        if node.name == "dot_general":
            u = _weight_use(prog, i)
            if u is not None:
                uses.append(u)
        elif node.name == "gather":
            e = _embedding_use(prog, i)
            if e is not None:
                embs.append(e)
    use_nodes = {u.node for u in uses}
    emb_nodes = {e.node for e in embs}
    roles: dict[str, Role] = {}
    for vid, path in zip(prog.params, prog.param_paths):
        values, vnodes = _view_closure(prog, vid)
        kinds, why = set(), ""
        for v in values:
            if v in prog.output_ids:
                why = why or "returned by the model"
            for i in prog.users.get(v, ()):
                if i in vnodes:
                    continue
                if i in use_nodes and any(u.node == i and u.view.value == vid for u in uses):
                    kinds.add("matmul")
                elif i in emb_nodes and prog.nodes[i].ins[0] in values:
                    kinds.add("embedding")
                else:
                    why = why or f"read by {prog.nodes[i].name}"
        if why or not kinds:
            roles[path] = Role("other", why or "not used")
        elif "embedding" in kinds:
            roles[path] = Role("embedding")
        else:
            roles[path] = Role("matmul")
    shapes = {p: prog.shape(v) for v, p in zip(prog.params, prog.param_paths)}
    return Analysis(prog, tuple(uses), tuple(embs), roles, shapes)


# ------------------------------------------------------------------------------------------------
# Canonical matrices.
# ------------------------------------------------------------------------------------------------


def _select(w: Any, use: WeightUse) -> Any:
    """The param with stacked-param indices applied (other axes unchanged, indexed axes kept size 1)."""
    for axis, i in use.index:
        w = jax.lax.slice_in_dim(w, i, i + 1, axis=axis)
    return w


def weight_matrix(w: Any, use: WeightUse) -> jax.Array:
    """The param ``w`` (float, the param's shape) as ``[K, N]`` for this use."""
    w = _select(jnp.asarray(w), use)
    order = use.contracting + use.free
    rest = tuple(a for a in range(w.ndim) if a not in order)  # unit / indexed axes
    return jnp.transpose(w, order + rest).reshape(use.k, use.n)


def from_weight_matrix(w2: Any, use: WeightUse, like: Any) -> jax.Array:
    """Inverse of :func:`weight_matrix`: ``[K, N]`` back into a param of ``like``'s shape (for a
    stacked param, only the used slice is replaced)."""
    like = jnp.asarray(like)
    order = use.contracting + use.free
    rest = tuple(a for a in range(like.ndim) if a not in order)
    sel_shape = list(like.shape)
    for axis, _ in use.index:
        sel_shape[axis] = 1
    t_shape = [sel_shape[a] for a in order + rest]
    block = jnp.transpose(jnp.asarray(w2).reshape(t_shape), np.argsort(order + rest)).astype(like.dtype)
    if not use.index:
        return block
    start = [0] * like.ndim
    for axis, i in use.index:
        start[axis] = i
    return jax.lax.dynamic_update_slice(like, block, start)


def matrix_to_slice(w2: Any, use: WeightUse) -> jax.Array:
    """``[K, N]`` back to the param's layout (for a stacked param: the used slice, indexed axes of
    size 1), without writing it anywhere (for fake quantization in the param's own layout)."""
    shape = list(use.shape)
    for axis, _ in use.index:
        shape[axis] = 1
    order = use.contracting + use.free
    rest = tuple(a for a in range(len(shape)) if a not in order)
    t = jnp.asarray(w2).reshape([shape[a] for a in order + rest])
    return jnp.transpose(t, np.argsort(order + rest))


def slice_to_matrix(w: Any, use: WeightUse) -> jax.Array:
    """Inverse of :func:`matrix_to_slice` (the slice-shaped param to ``[K, N]``)."""
    order = use.contracting + use.free
    rest = tuple(a for a in range(jnp.ndim(w)) if a not in order)
    return jnp.transpose(jnp.asarray(w), order + rest).reshape(use.k, use.n)


def activation_matrix(x: Any, use: WeightUse) -> jax.Array:
    """The activation operand as ``[M, K]`` (K in the canonical order of :func:`weight_matrix`)."""
    x = jnp.asarray(x)
    others = tuple(a for a in range(x.ndim) if a not in use.x_contracting)
    return jnp.transpose(x, others + use.x_contracting).reshape(-1, use.k)


def token_axis(use: WeightUse, x_ndim: int) -> int | None:
    """The activation axis taken as the sequence axis (the last non-contracted one), or None."""
    others = [a for a in range(x_ndim) if a not in use.x_contracting]
    return others[-1] if others else None


def tie_columns(index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(unique rows, inverse) of a ``[K, d]`` index: channels mapping to one row share a scale."""
    rows, inverse = np.unique(np.asarray(index).reshape(len(index), -1), axis=0, return_inverse=True)
    return rows, inverse.reshape(-1)


def group_uses_by_input(uses: Sequence[WeightUse]) -> list[tuple[WeightUse, ...]]:
    """Uses reading the same activation with the same contracted axes, in node order."""
    groups: dict[tuple, list[WeightUse]] = {}
    for u in uses:
        groups.setdefault((u.x, u.x_contracting), []).append(u)
    return [tuple(g) for g in sorted(groups.values(), key=lambda g: g[0].node)]
