"""Which output columns of a weight feed attention scores: found by data flow, not by name.

AWQ skips its clip search for the outputs of query and key projections: their error passes through a
softmax, where a clipped outlier changes which tokens are attended to. A fused weight (kv ``[2, K, D,
H]``, GPT-2's ``c_attn [D, 3D]``) holds both such columns and value columns, so the answer is per
output column.

:func:`score_columns` follows a weight use's output forward through the program, tracking for every
element which output column it comes from (a *label* array, the value's shape), and stops at

* a ``dot_general`` with a param operand (the next linear layer: not followed), or
* a ``dot_general`` of two activations (attention's ``Q K^T`` or ``P V``): the columns that reach it
  feed scores when its output reaches an ``exp`` (the softmax) before any other ``dot_general``.

Layout ops (transpose, reshape, squeeze, broadcast, slice, concatenate, pad, rev, dtype casts) are
replayed on the labels, so a slice of a fused output keeps only its columns. An elementwise op keeps
the labels of its first operand that has them and carries the others' columns along as a set (RoPE's
``rotate_half`` mixes columns of one head). Any other op keeps the set of columns without positions.
The walk is bounded (:data:`MAX_NODES` nodes per use); a use whose walk is cut short is reported with
no score columns.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import jax
import numpy as np

from eqjax.core.analysis import Analysis, WeightUse
from eqjax.core.program import Program
from eqjax.core.qdot import assemble_output
from eqjax.core.views import bind

__all__ = ["score_columns", "MAX_NODES"]

MAX_NODES = 256
"""How many nodes downstream of a weight's output :func:`score_columns` visits at most."""

_LAYOUT = frozenset({"transpose", "reshape", "squeeze", "broadcast_in_dim", "expand_dims", "slice", "rev",
                     "concatenate", "pad", "copy", "copy_p", "split"})
_PASS = frozenset({"convert_element_type", "reduce_precision", "optimization_barrier"})
_EXP = frozenset({"exp", "exp2"})


@dataclasses.dataclass(frozen=True, eq=False)
class _Taint:
    """``labels``: output column of each element (-1: none; None: not tracked); ``extra``: further columns
    present without known positions."""

    labels: np.ndarray | None
    extra: frozenset[int] = frozenset()


def _output_labels(prog: Program, use: WeightUse) -> np.ndarray:
    """The dot's output with each element labelled by its canonical output column (free axes in order)."""
    node = prog.nodes[use.node]
    x = jax.ShapeDtypeStruct(prog.shape(use.x), np.int32)
    m = int(np.prod([x.shape[a] for a in range(len(x.shape)) if a not in use.x_contracting], dtype=np.int64))
    y2 = np.broadcast_to(np.arange(use.n, dtype=np.int32), (m, use.n))
    return np.asarray(assemble_output(y2, use, node, prog, x))


def _reaches_exp(prog: Program, vid: int, budget: int = 64) -> bool:
    """Whether ``vid`` flows into an ``exp`` without passing another ``dot_general``."""
    todo, seen = deque([vid]), {vid}
    while todo and budget > 0:
        for i in prog.users.get(todo.popleft(), ()):
            budget -= 1
            n = prog.nodes[i]
            if n.name in _EXP:
                return True
            if n.name == "dot_general":
                continue
            for o in n.outs:
                if o not in seen:
                    seen.add(o)
                    todo.append(o)
    return False


def _layout_labels(prog: Program, node, taint: dict[int, _Taint]) -> list[np.ndarray] | None:
    """The node's op replayed on the labels (untainted data operands as -1), one array per output; None
    where it cannot be."""
    vals = []
    for k, r in enumerate(node.ins):
        t = taint.get(r) if isinstance(r, int) else None
        if t is not None and t.labels is not None:
            vals.append(t.labels)
        elif t is not None:
            return None
        elif node.name == "pad" and k == 1:
            vals.append(np.int32(-1))
        else:
            vals.append(np.full(prog.shape(r), -1, np.int32))
    try:
        return [np.asarray(v) for v in bind(node, vals)]
    except Exception:  # noqa: BLE001 - an op the labels cannot replay: keep the columns without positions
        return None


def _step(prog: Program, node, taint: dict[int, _Taint]) -> list[_Taint]:
    """The taint of each of the node's outputs."""
    ins = [taint[r] for r in node.ins if isinstance(r, int) and r in taint]
    extra = frozenset().union(*(t.extra for t in ins))
    everything = frozenset().union(*(_columns(t) for t in ins))
    n_out = len(node.outs)
    if node.name in _PASS:
        return [_Taint(ins[0].labels, extra)] * n_out
    if node.name in _LAYOUT:
        labels = _layout_labels(prog, node, taint)
        if labels is not None:
            return [_Taint(lab, extra) for lab in labels]
        return [_Taint(None, everything)] * n_out
    out_shape = tuple(prog.avals[node.outs[0]].shape)
    first = next((t for t in ins if t.labels is not None), None)
    if n_out == 1 and first is not None and first.labels.shape == out_shape:
        others = frozenset().union(*(_columns(t) for t in ins if t is not first))
        return [_Taint(first.labels, first.extra | others)]
    return [_Taint(None, everything)] * n_out


def _columns(t: _Taint) -> frozenset[int]:
    got = set(t.extra) if t.labels is None else set(np.unique(t.labels).tolist()) | set(t.extra)
    got.discard(-1)
    return frozenset(got)


def score_columns(an: Analysis, use: WeightUse) -> np.ndarray:
    """``[N]`` bool: which canonical output columns of ``use`` (free axes flattened in param order) reach
    an attention score (see the module docs)."""
    prog = an.program
    out = np.zeros((use.n,), bool)
    if use.batch:
        return out
    start = prog.nodes[use.node].outs[0]
    reach = _downstream(an, start)
    if reach is None:
        return out
    dots = [i for i in reach if prog.nodes[i].name == "dot_general" and an.use_at(i) is None
            and _reaches_exp(prog, prog.nodes[i].outs[0])]
    if not dots:
        return out
    taint = {start: _Taint(_output_labels(prog, use))}
    for i in _upstream(prog, dots, set(reach)):  # execution order: a node's tainted operands are known
        node = prog.nodes[i]
        if i in dots:
            cols = set().union(*(_columns(taint[r]) for r in node.ins if isinstance(r, int) and r in taint))
            out[sorted(cols)] = True
        elif node.name != "dot_general":
            taint.update(zip(node.outs, _step(prog, node, taint)))
    return out


def _upstream(prog: Program, targets: list[int], within: set[int]) -> list[int]:
    """The nodes of ``within`` that ``targets`` depend on (``targets`` included), in execution order."""
    keep, todo = set(targets), list(targets)
    while todo:
        for r in prog.nodes[todo.pop()].ins:
            i = prog.producer.get(r) if isinstance(r, int) else None
            if i is not None and i in within and i not in keep:
                keep.add(i)
                todo.append(i)
    return sorted(keep)


def _downstream(an: Analysis, start: int) -> list[int] | None:
    """Indices of the nodes reading ``start`` or a value derived from it, up to the first
    ``dot_general`` on each path, in execution order; None past :data:`MAX_NODES`."""
    prog = an.program
    todo, seen = deque([start]), set()
    while todo:
        for i in prog.users.get(todo.popleft(), ()):
            if i in seen:
                continue
            seen.add(i)
            if len(seen) > MAX_NODES:
                return None
            node = prog.nodes[i]
            if node.name != "dot_general":
                todo.extend(node.outs)
    return sorted(seen)
