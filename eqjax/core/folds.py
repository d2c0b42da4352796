"""Where a per-input-channel scale can be folded: the norm or linear that produces a weight's input.

SmoothQuant, AWQ and rotations replace a group of weight uses that read one activation ``x`` by
``(x / s) @ (diag(s) W)``. That is exact only if ``x / s`` can be produced for free, by dividing
something upstream by ``s``. :func:`find_fold` walks the program backwards from ``x`` through ops that
commute with a per-channel scale, tracking which element of each upstream value every input channel
comes from, until it reaches

* a **norm**: a product with a param that varies only along the channel (RMSNorm / LayerNorm scale;
  a LayerNorm bias added after it is divided too), or
* a **linear**: the output of another weight use (its output columns, and a bias added after it), e.g.
  ``v_proj -> attention -> o_proj`` (the scale is then shared by the query heads of a kv head: the
  channel map is many-to-one and the caller ties those channels) or ``up_proj -> * silu(gate) ->
  down_proj``.

Ops walked through: dtype conversion, transpose, reshape (of trailing channel blocks), squeeze,
broadcast (repeated channels tie), one-index and token slices, a ``dot_general`` whose output channels
are one operand's free/batch axes (attention's ``P @ V``), products (any factor may be the one
divided), and bias additions. Every value on the way must have no other reader (else dividing it
would change that reader), and ``x`` may only be read by the group itself. Anything else stops the
walk with a reason, which callers report (e.g. GPT-2's ``gelu`` before ``c_proj``).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Sequence

import numpy as np

from eqjax.core.analysis import Analysis, WeightUse, _view_closure, param_view
from eqjax.core.program import Lit, Program, Ref

__all__ = ["FoldTarget", "Fold", "find_fold"]


@dataclasses.dataclass(frozen=True, eq=False)
class FoldTarget:
    """Divide ``param[..., index[k] on axes, ...]`` by ``s[k]`` (broadcast over the other axes).

    Attributes:
      path: the param.
      kind: ``"scale"`` (a norm's multiplicative param), ``"bias"`` (an added param), ``"linear"``
        (a weight's output columns).
      axes: the param axes ``index`` addresses.
      index: ``[K, len(axes)]`` int array: for input channel ``k`` of the group, the element of the
        param it comes from. Rows may repeat (tied channels).
    """

    path: str
    kind: Literal["scale", "bias", "linear"]
    axes: tuple[int, ...]
    index: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class Fold:
    """``uses`` (all reading one ``x``) can take a per-channel scale by dividing ``targets``.

    ``kind``: ``"norm"`` or ``"linear"``; ``source``: the producing weight use for ``"linear"``.
    """

    uses: tuple[WeightUse, ...]
    targets: tuple[FoldTarget, ...]
    kind: Literal["norm", "linear"]
    source: WeightUse | None = None

    @property
    def tie(self) -> np.ndarray:
        """``[K]`` ids of the distinct source channels (channels with one id must share a scale)."""
        idx = self.targets[0].index
        _, inv = np.unique(idx.reshape(len(idx), -1), axis=0, return_inverse=True)
        return inv.reshape(-1)


class _Fail(Exception):
    pass


def _shape(prog: Program, r: Ref) -> tuple[int, ...]:
    return prog.shape(r)


def _param_target(an: Analysis, ref: Ref, comp: np.ndarray, kind: str) -> FoldTarget | None:
    """A target when ``ref`` is a view of a param read only here and varying only along channels."""
    prog = an.program
    view = param_view(prog, ref)
    if view is None:
        return None
    values, vnodes = _view_closure(prog, view.value)
    readers = {i for v in values for i in prog.users.get(v, ()) if i not in vnodes}
    if len(readers) != 1 or any(v in prog.output_ids for v in values):
        raise _Fail(f"{view.path} is also used elsewhere")
    pshape = prog.shape(view.value)
    pcomp = np.full((comp.shape[0], len(pshape)), -1, np.int64)
    for j, pa in enumerate(view.axes):
        if pa is not None:
            pcomp[:, pa] = comp[:, j]
    for pa, i in view.index:
        pcomp[:, pa] = i
    axes = []
    for d, s in enumerate(pshape):
        if s == 1:
            continue
        if np.any(pcomp[:, d] < 0):
            raise _Fail(f"{view.path} varies along a non-channel axis")
        axes.append(d)
    return FoldTarget(view.path, kind, tuple(axes), pcomp[:, axes])


def _single_reader(prog: Program, v: Ref, via: int, comp: np.ndarray | None = None) -> None:
    """``v`` must be read only by node ``via``, or by slices that take none of the scaled elements."""
    if isinstance(v, Lit) or v in prog.output_ids:
        raise _Fail("an intermediate value is a model output")
    for i in prog.users.get(v, ()):
        if i == via:
            continue
        n = prog.nodes[i]
        if n.name != "slice" or comp is None or not _disjoint(n, comp):
            raise _Fail("an intermediate value has other readers")


def _disjoint(node, comp: np.ndarray) -> bool:
    """True if the slice ``node`` reads none of the elements ``comp`` addresses (-1 = every index)."""
    for d, (a, b) in enumerate(zip(node.params["start_indices"], node.params["limit_indices"])):
        col = comp[:, d]
        if np.all(col >= 0) and not np.any((col >= a) & (col < b)):
            return True
    return False


def _factors(prog: Program, ref: Ref, top: bool = True) -> list[Ref]:
    if isinstance(ref, int):
        i = prog.producer.get(ref)
        if i is not None and prog.nodes[i].name == "mul" and (top or prog.n_users(ref) == 1):
            n = prog.nodes[i]
            return _factors(prog, n.ins[0], False) + _factors(prog, n.ins[1], False)
    return [ref]


def _broadcast_comp(comp: np.ndarray, out_shape: tuple[int, ...], in_shape: tuple[int, ...]) -> np.ndarray:
    """Comp of an operand of an implicitly broadcasting elementwise op (unit dims read index 0)."""
    c = comp.copy()
    for d, (o, i) in enumerate(zip(out_shape, in_shape)):
        if i == 1 and o != 1:
            c[:, d] = np.where(c[:, d] >= 0, 0, -1)
    return c


def _walk(an: Analysis, v: int, comp: np.ndarray, depth: int = 0) -> tuple[list[FoldTarget], str, WeightUse | None]:
    """Targets whose division by ``s`` divides ``v``'s channel elements ``comp`` by ``s``."""
    if depth > 64:
        raise _Fail("walk too deep")
    prog = an.program
    i = prog.producer.get(v)
    if i is None:
        raise _Fail("reaches a model input or constant")
    node = prog.nodes[i]
    name = node.name
    out_shape = _shape(prog, v)
    src = node.ins[0] if node.ins else None

    def go(ref: Ref, c: np.ndarray):
        _single_reader(prog, ref, i, c)
        return _walk(an, ref, c, depth + 1)

    use = an.use_at(i)
    if use is not None:
        return _into_weight(an, use, node, comp)
    if name in ("convert_element_type", "copy", "copy_p"):
        return go(src, comp)
    if name == "transpose":
        perm = node.params["permutation"]
        c = np.full_like(comp, -1)
        for j, p in enumerate(perm):
            c[:, p] = comp[:, j]
        return go(src, c)
    if name == "squeeze":
        in_shape = _shape(prog, src)
        kept = [d for d in range(len(in_shape)) if d not in node.params["dimensions"]]
        c = np.zeros((comp.shape[0], len(in_shape)), np.int64)
        c[:, kept] = comp
        return go(src, c)
    if name == "reshape":
        return go(src, _reshape_comp(comp, out_shape, _shape(prog, src)))
    if name == "broadcast_in_dim":
        in_shape = _shape(prog, src)
        bd = node.params["broadcast_dimensions"]
        c = np.full((comp.shape[0], len(in_shape)), -1, np.int64)
        for k, b in enumerate(bd):
            c[:, k] = comp[:, b] if in_shape[k] == out_shape[b] else np.where(comp[:, b] >= 0, 0, -1)
        if not np.any(c >= 0):
            raise _Fail("a broadcast drops every channel")
        return go(src, c)
    if name == "slice":
        strides = node.params.get("strides")
        if strides is not None and any(s != 1 for s in strides):
            raise _Fail("strided slice")
        start = np.asarray(node.params["start_indices"], np.int64)
        return go(src, np.where(comp >= 0, comp + start[None, :], -1))
    if name == "split":
        axis = node.params["axis"]
        k = node.outs.index(v)
        offset = int(sum(node.params["sizes"][:k]))
        c = comp.copy()
        c[:, axis] = np.where(c[:, axis] >= 0, c[:, axis] + offset, -1)
        if np.any(c[:, axis] < 0):
            raise _Fail("a split along a non-channel axis")
        return go(src, c)
    if name == "mul":
        return _through_product(an, v, comp, depth)
    if name in ("add", "sub", "add_any"):
        a, b = node.ins
        for bias, other in ((b, a), (a, b)):
            t = _param_target(an, bias, _broadcast_comp(comp, out_shape, _shape(prog, bias)), "bias")
            if t is not None:
                targets, kind, source = go(other, _broadcast_comp(comp, out_shape, _shape(prog, other)))
                return targets + [t], kind, source
        raise _Fail(f"an {name} of two activations (a residual connection)")
    if name == "dot_general":
        return _through_dot(an, node, comp, out_shape, go)
    raise _Fail(f"{name} does not commute with a per-channel scale")


def _reshape_comp(comp: np.ndarray, out_shape: tuple[int, ...], in_shape: tuple[int, ...]) -> np.ndarray:
    ch = [d for d in range(len(out_shape)) if np.any(comp[:, d] >= 0)]
    if not ch:
        raise _Fail("no channel axis left")
    lo = min(ch)
    if np.any(comp[:, lo:] < 0):
        raise _Fail("a reshape mixes channel and token axes")
    if np.any(comp[:, :lo] >= 0):
        raise _Fail("a reshape of non-trailing channel axes")
    block = int(np.prod(out_shape[lo:], dtype=np.int64))
    li = len(in_shape)
    while li > 0 and int(np.prod(in_shape[li - 1:], dtype=np.int64)) <= block:
        li -= 1
        if int(np.prod(in_shape[li:], dtype=np.int64)) == block:
            break
    if int(np.prod(in_shape[li:], dtype=np.int64)) != block:
        raise _Fail("a reshape does not keep the channel block")
    flat = np.ravel_multi_index(tuple(comp[:, lo:].T), out_shape[lo:])
    c = np.full((comp.shape[0], len(in_shape)), -1, np.int64)
    c[:, li:] = np.stack(np.unravel_index(flat, in_shape[li:]), axis=1)
    return c


def _free_axes(ndim: int, c: Sequence[int], b: Sequence[int]) -> list[int]:
    return [a for a in range(ndim) if a not in c and a not in b]


def _through_dot(an: Analysis, node, comp: np.ndarray, out_shape, go):
    prog = an.program
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    shapes = [_shape(prog, r) for r in node.ins]
    lf, rf = _free_axes(len(shapes[0]), lc, lb), _free_axes(len(shapes[1]), rc, rb)
    nb = len(lb)
    errors = []
    for side in (0, 1):
        ref = node.ins[side]
        if isinstance(ref, Lit) or param_view(prog, ref) is not None:
            continue
        batch = lb if side == 0 else rb
        free, other_free = (lf, rf) if side == 0 else (rf, lf)
        offset = nb if side == 0 else nb + len(lf)
        other_offset = nb + len(lf) if side == 0 else nb
        c = np.full((comp.shape[0], len(shapes[side])), -1, np.int64)
        for k, a in enumerate(batch):
            c[:, a] = comp[:, k]
        for k, a in enumerate(free):
            c[:, a] = comp[:, offset + k]
        if not np.any(c >= 0):
            continue
        del other_free, other_offset  # the other operand's free axes are summed over: channels tie
        try:
            return go(ref, c)
        except _Fail as e:
            errors.append(str(e))
    raise _Fail(" / ".join(errors) or "a dot_general whose channels come from no walkable operand")


def _through_product(an: Analysis, v: int, comp: np.ndarray, depth: int):
    prog = an.program
    out_shape = _shape(prog, v)
    facs = [f for f in _factors(prog, v) if not isinstance(f, Lit)]
    via = {f: i for i, n in enumerate(prog.nodes) if n.name == "mul" for f in n.ins if f in facs}
    for f in facs:
        t = _param_target(an, f, _broadcast_comp(comp, out_shape, _shape(prog, f)), "scale")
        if t is not None:
            return [t], "norm", None
    last: _Fail | None = None
    for f in facs:
        c = _broadcast_comp(comp, out_shape, _shape(prog, f))
        if not np.any(c >= 0):
            continue
        try:
            _single_reader(prog, f, via.get(f, -1), c)
            return _walk(an, f, c, depth + 1)
        except _Fail as e:
            last = e
    raise last or _Fail("a product with no factor varying along the channel")


def _into_weight(an: Analysis, use: WeightUse, node, comp: np.ndarray):
    prog = an.program
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    shapes = [_shape(prog, r) for r in node.ins]
    lf, rf = _free_axes(len(shapes[0]), lc, lb), _free_axes(len(shapes[1]), rc, rb)
    nb = len(lb)
    wb = lb if use.side == 0 else rb
    wf = lf if use.side == 0 else rf
    xf = rf if use.side == 0 else lf
    w_off = nb if use.side == 0 else nb + len(lf)
    x_off = nb + len(lf) if use.side == 0 else nb
    if np.any(comp[:, x_off:x_off + len(xf)] >= 0):
        raise _Fail(f"the channel of {use.path}'s output varies along a token axis")
    pcomp = np.full((comp.shape[0], len(use.shape)), -1, np.int64)
    for k, a in enumerate(wb):
        if use.view.axes[a] is not None:
            pcomp[:, use.view.axes[a]] = comp[:, k]
    for k, a in enumerate(wf):
        if use.view.axes[a] is not None:
            pcomp[:, use.view.axes[a]] = comp[:, w_off + k]
    for pa, i in use.view.index:
        pcomp[:, pa] = i
    axes = tuple(d for d in use.free + use.batch if use.shape[d] != 1)
    if np.any(pcomp[:, list(axes)] < 0):
        raise _Fail(f"the channel does not select {use.path}'s output columns")
    axes = tuple(sorted(set(axes) | {pa for pa, _ in use.view.index}))
    return [FoldTarget(use.path, "linear", axes, pcomp[:, list(axes)])], "linear", use


def find_fold(an: Analysis, uses: Sequence[WeightUse]) -> tuple[Fold | None, str]:
    """The fold for a group of uses reading one activation, or ``(None, reason)``."""
    prog = an.program
    uses = tuple(uses)
    x, xc = uses[0].x, uses[0].x_contracting
    if any(u.x != x or u.x_contracting != xc for u in uses):
        return None, "the uses do not read one activation"
    if isinstance(x, Lit):
        return None, "the input is a literal"
    for u in uses:
        role = an.roles.get(u.path)
        if role is None or role.kind != "matmul" or len(an.uses_of(u.path)) != 1:
            return None, f"the weight {u.path} is also used elsewhere (e.g. a tied embedding)"
    readers = set(prog.users.get(x, ()))
    if readers != {u.node for u in uses} or x in prog.output_ids:
        return None, "the input is also read by something other than these weights"
    shape = _shape(prog, x)
    dims = [shape[a] for a in xc]
    comp = np.full((uses[0].k, len(shape)), -1, np.int64)
    comp[:, list(xc)] = np.stack(np.unravel_index(np.arange(uses[0].k), dims), axis=1)
    try:
        targets, kind, source = _walk(an, x, comp)
    except _Fail as e:
        return None, str(e)
    if source is not None and source.path in {u.path for u in uses}:
        return None, "the input depends on the weight itself"
    return Fold(uses, tuple(targets), kind, source), ""
