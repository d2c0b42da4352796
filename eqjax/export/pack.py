"""Sibling MatMulNBits packing: projections reading the same input become one wider MatMulNBits + Split.

Q, K and V (and gate / up) read the same normalized activation; one ``MatMulNBits`` with their
weights concatenated along ``N`` (B, scales and zero points are per output row, so concatenation is
exact) reads the activation once and runs one kernel instead of three, which is most of what a decode
step costs on a CPU. Siblings pack only when every attribute (K, bits, block size, accuracy level) and
the presence of zero points agree and their weights are initializers read by nothing else.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["pack_siblings"]


def _attrs(n: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in n.attribute}


def pack_siblings(m: onnx.ModelProto) -> int:
    """Pack sibling MatMulNBits nodes of ``m`` in place; returns how many groups were packed."""
    g = m.graph
    inits = {t.name: t for t in g.initializer}
    readers: dict[str, int] = defaultdict(int)
    for n in g.node:
        for i in n.input:
            readers[i] += 1
    groups: dict[tuple, list[onnx.NodeProto]] = defaultdict(list)
    for n in g.node:
        if n.op_type != "MatMulNBits" or n.domain != "com.microsoft":
            continue
        a = _attrs(n)
        ws = [i for i in n.input[1:] if i]
        if len(n.input) > 4 or not all(i in inits and readers[i] == 1 for i in ws):
            continue
        key = (n.input[0], a["K"], a["bits"], a["block_size"], a.get("accuracy_level"), len(ws))
        groups[key].append(n)
    packed = 0
    drop_nodes, drop_inits = set(), set()
    new_nodes: dict[int, list[onnx.NodeProto]] = {}
    order = {id(n): k for k, n in enumerate(g.node)}
    for key, nodes in groups.items():
        if len(nodes) < 2:
            continue
        a = _attrs(nodes[0])
        ns = [_attrs(n)["N"] for n in nodes]
        arrays = [[numpy_helper.to_array(inits[i]) for i in n.input[1:] if i] for n in nodes]
        cat = [np.concatenate([arr[j] for arr in arrays], axis=0) for j in range(len(arrays[0]))]
        base = nodes[0].name + "_packed"
        names = [f"{base}.{s}" for s in ("B", "scales", "zp")[:len(cat)]]
        g.initializer.extend(numpy_helper.from_array(c, nm) for c, nm in zip(cat, names))
        y = base + ".y"
        mm = helper.make_node("MatMulNBits", [nodes[0].input[0]] + names, [y], name=base, domain="com.microsoft",
                              **{**a, "N": int(sum(ns))})
        split = helper.make_node("Split", [y, base + ".sizes"], [n.output[0] for n in nodes], name=base + "_split",
                                 axis=-1)
        g.initializer.append(numpy_helper.from_array(np.asarray(ns, np.int64), base + ".sizes"))
        first = min(order[id(n)] for n in nodes)
        new_nodes[first] = [mm, split]
        for n in nodes:
            drop_nodes.add(id(n))
            drop_inits.update(i for i in n.input[1:] if i)
        packed += 1
    if not packed:
        return 0
    out = []
    for k, n in enumerate(g.node):
        if k in new_nodes:
            out.extend(new_nodes[k])
        if id(n) not in drop_nodes:
            out.append(n)
    del g.node[:]
    g.node.extend(out)
    keep = [t for t in g.initializer if t.name not in drop_inits]
    del g.initializer[:]
    g.initializer.extend(keep)
    return packed
