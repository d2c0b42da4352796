"""Replaying a program's nodes on new values: one node (:func:`bind`) and the layout-only chain from a
param to the operand a weight / embedding use reads (:func:`view_nodes`, :func:`apply_view`).

Shared by the evaluator (:mod:`eqjax.core.interpret`), the quantized matmul (:mod:`eqjax.core.qdot`)
and the ONNX exporter; it depends only on :mod:`eqjax.core.program` and :mod:`eqjax.core.analysis`.
"""

from __future__ import annotations

from typing import Any, Sequence

from eqjax.core.analysis import EmbeddingUse, WeightUse
from eqjax.core.program import Node, Program

__all__ = ["bind", "view_nodes", "apply_view"]


def bind(node: Node, vals: Sequence[Any]) -> list[Any]:
    """``node.prim`` applied to ``vals`` with the node's own params; always a list of outputs."""
    out = node.prim.bind(*vals, **node.prim.get_bind_params(dict(node.params)))
    return list(out) if node.prim.multiple_results else [out]


def view_nodes(prog: Program, use: WeightUse | EmbeddingUse) -> tuple[Node, ...]:
    """The layout nodes from the param to the use's weight operand, in execution order."""
    node = prog.nodes[use.node]
    ref = node.ins[use.side] if isinstance(use, WeightUse) else node.ins[0]
    chain = []
    while ref != use.view.value:
        n = prog.nodes[prog.producer[ref]]
        chain.append(n)
        ref = n.ins[0]
    return tuple(reversed(chain))


def apply_view(prog: Program, use: WeightUse | EmbeddingUse, w: Any) -> Any:
    """The use's weight operand computed from the param ``w`` (in the param's own layout)."""
    for n in view_nodes(prog, use):
        w = bind(n, [w] + [r.value for r in n.ins[1:]])[0]
    return w
