"""Sibling packing: projections reading the same input become one wider matmul + Split.

Q, K and V (and gate / up) read the same normalized activation; one ``MatMulNBits`` with their
weights concatenated along ``N`` (B, scales and zero points are per output row, so concatenation is
exact) reads the activation once and runs one kernel instead of three, which is most of what a decode
step costs on a CPU. Siblings pack only when every attribute (K, bits, block size, accuracy level) and
the presence of zero points agree and their weights are initializers read by nothing else. W8A8's
``MatMulIntegerToFloat`` siblings (the same quantized activation, scale and zero points; weights
``[K, N]`` with one scale per column) pack the same way, their shared per-token ``Mul`` moved before
the Split.

:func:`fuse_packed_attention` then hands a packed Q/K/V straight to ``GroupQueryAttention`` (its packed
input form, with the RoPE tables and ``do_rotary=1``) instead of ``Split`` + two ``RotaryEmbedding`` +
reshapes: what onnxruntime-genai's own builder emits. GQA then derives positions from ``seqlens_k``
(past length + offset), so ``position_ids`` is no longer read: right for contiguous positions (what
onnxruntime-genai and eqjax's runners feed), not for custom position ids.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import helper, numpy_helper

from eqjax.export.tensors import TensorStore

__all__ = ["pack_siblings", "fuse_packed_attention"]


def _attrs(n: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in n.attribute}


def _sibling_key(n: onnx.NodeProto, inits: dict, readers: dict) -> tuple | None:
    """What packable siblings share (None: ``n`` does not pack): the input, the op's attributes, the
    presence and dtype of the other operands; weights must be initializers read by ``n`` alone."""
    if n.domain != "com.microsoft":
        return None
    if n.op_type == "MatMulNBits":
        a = _attrs(n)
        ws = [i for i in n.input[1:] if i]
        if len(n.input) > 4 or not all(i in inits and readers[i] == 1 for i in ws):
            return None
        return ("nbits", n.input[0], a["K"], a["bits"], a["block_size"], a.get("accuracy_level"), len(ws))
    if n.op_type == "MatMulIntegerToFloat":
        ins = list(n.input) + [""] * (6 - len(n.input))
        b, bs = ins[1], ins[3]
        if len(n.input) > 6 or not all(i in inits and readers[i] == 1 for i in (b, bs)) \
                or len(inits[b].dims) != 2 or list(inits[bs].dims) != [inits[b].dims[1]]:
            return None  # only [K, N] weights with one scale per column concatenate along N
        return ("mmitf", ins[0], ins[2], ins[4], ins[5], inits[b].data_type, inits[b].dims[0])
    return None


def _hoisted_mul(nodes: list, consumers: dict) -> list | None:
    """The ``Mul`` nodes, one per sibling, that scale each sibling's output by one shared tensor (W8A8's
    per-token activation scale), or None: then the packed product is scaled once, before its Split."""
    muls = []
    for n in nodes:
        c = consumers[n.output[0]]
        if len(c) != 1 or c[0].op_type != "Mul" or c[0].input[0] != n.output[0]:
            return None
        muls.append(c[0])
    return muls if len({m.input[1] for m in muls}) == 1 else None


def pack_siblings(m: onnx.ModelProto, store: TensorStore | None = None) -> int:
    """Pack sibling MatMulNBits / MatMulIntegerToFloat nodes of ``m`` in place; returns how many groups.

    ``store``: where the graph's initializers were made (:class:`~eqjax.export.tensors.TensorStore`); the packed
    ones are made there too (default: inside the graph)."""
    store = store if store is not None else TensorStore()
    g = m.graph
    inits = {t.name: t for t in g.initializer}
    readers: dict[str, int] = defaultdict(int)
    for n in g.node:
        for i in n.input:
            readers[i] += 1
    consumers = _consumers(g)
    groups: dict[tuple, list[onnx.NodeProto]] = defaultdict(list)
    for n in g.node:
        key = _sibling_key(n, inits, readers)
        if key is not None:
            groups[key].append(n)
    packed = 0
    drop_nodes, drop_inits = set(), set()
    new_nodes: dict[int, list[onnx.NodeProto]] = {}
    order = {id(n): k for k, n in enumerate(g.node)}
    for key, nodes in groups.items():
        if len(nodes) < 2:
            continue
        a = _attrs(nodes[0])
        base = nodes[0].name + "_packed"
        y = base + ".y"
        outs = [n.output[0] for n in nodes]
        if key[0] == "nbits":
            ns = [_attrs(n)["N"] for n in nodes]
            arrays = [[store.array(inits[i]) for i in n.input[1:] if i] for n in nodes]
            cat = [np.concatenate([arr[j] for arr in arrays], axis=0) for j in range(len(arrays[0]))]
            names = [f"{base}.{s}" for s in ("B", "scales", "zp")[:len(cat)]]
            mm = helper.make_node("MatMulNBits", [nodes[0].input[0]] + names, [y], name=base, domain="com.microsoft",
                                  **{**a, "N": int(sum(ns))})
            made = [mm]
        else:  # MatMulIntegerToFloat: B [K, N] along axis 1, b_scale [N]
            ns = [inits[n.input[1]].dims[1] for n in nodes]
            cat = [np.concatenate([store.array(inits[n.input[j]]) for n in nodes], axis=ax)
                   for j, ax in ((1, 1), (3, 0))]
            names = [f"{base}.B", f"{base}.b_scale"]
            ins = list(nodes[0].input)
            ins[1], ins[3] = names
            made = [helper.make_node("MatMulIntegerToFloat", ins, [y], name=base, domain="com.microsoft")]
            muls = _hoisted_mul(nodes, consumers)
            if muls is not None:
                made.append(helper.make_node("Mul", [y, muls[0].input[1]], [base + ".ys"], name=base + "_scale"))
                y = base + ".ys"
                outs = [mu.output[0] for mu in muls]
                drop_nodes.update(id(mu) for mu in muls)
        g.initializer.extend(store.tensor(nm, c) for c, nm in zip(cat, names))
        made.append(helper.make_node("Split", [y, base + ".sizes"], outs, name=base + "_split", axis=-1))
        g.initializer.append(numpy_helper.from_array(np.asarray(ns, np.int64), base + ".sizes"))
        new_nodes[min(order[id(n)] for n in nodes)] = made
        for n in nodes:
            drop_nodes.add(id(n))
            drop_inits.update(i for i in (n.input[1:] if key[0] == "nbits" else (n.input[1], n.input[3])) if i)
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


def _consumers(g: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    out: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for n in g.node:
        for i in n.input:
            out[i].append(n)
    return out


def _through_reshapes(x: str, producers: dict, consumers: dict, chain: list) -> str:
    """Follow single-reader Reshapes back from ``x``; the Reshape nodes go into ``chain``."""
    while x in producers and producers[x].op_type == "Reshape" and len(consumers[x]) == 1:
        chain.append(producers[x])
        x = producers[x].input[0]
    return x


def fuse_packed_attention(m: onnx.ModelProto) -> int:
    """Feed packed Q/K/V projections to GroupQueryAttention directly (rotary inside); returns how many.

    Applies where a GQA (``do_rotary=0``) reads ``RotaryEmbedding(q)``, ``RotaryEmbedding(k)`` (rotate-half,
    one cos/sin table covering the whole head) and ``v``, and q, k, v are the three outputs, in that order
    and read by nothing else, of one ``Split`` of a packed projection (:func:`pack_siblings`).
    """
    g = m.graph
    producers = {o: n for n in g.node for o in n.output}
    consumers = _consumers(g)
    inits = {t.name: t for t in g.initializer}
    drop: set[int] = set()
    fused = 0
    for gqa in g.node:
        a = _attrs(gqa) if gqa.op_type == "GroupQueryAttention" else {}
        if not a or a.get("do_rotary", 0) or len(gqa.input) != 7:
            continue
        ropes = [producers.get(gqa.input[i]) for i in (0, 1)]
        if any(r is None or r.op_type != "RotaryEmbedding" or _attrs(r).get("interleaved", 0)
               or len(consumers[r.output[0]]) != 1 for r in ropes):
            continue
        rq, rk = ropes
        if rq.input[1:] != rk.input[1:] or rq.input[2] not in inits:
            continue
        chain: list = []
        v = _through_reshapes(gqa.input[2], producers, consumers, chain)
        split = producers.get(rq.input[0])
        if (split is None or split.op_type != "Split" or list(split.output) != [rq.input[0], rk.input[0], v]
                or any(len(consumers[o]) != 1 for o in split.output)):
            continue
        hq, hkv = a["num_heads"], a["kv_num_heads"]
        sizes = numpy_helper.to_array(inits[split.input[1]]) if split.input[1] in inits else None
        half = inits[rq.input[2]].dims[1]
        if sizes is None or sizes[0] % hq or list(sizes) != [sizes[0], sizes[0] // hq * hkv, sizes[0] // hq * hkv] \
                or 2 * half != sizes[0] // hq:
            continue
        ins = list(gqa.input)
        del gqa.input[:]
        gqa.input.extend([split.input[0], "", "", *ins[3:7], rq.input[2], rq.input[3]])
        for att in gqa.attribute:
            if att.name == "do_rotary":
                att.i = 1
        gqa.attribute.append(helper.make_attribute("rotary_interleaved", 0))
        drop.update(id(n) for n in (split, rq, rk, *chain))
        fused += 1
    if fused:
        keep = [n for n in g.node if id(n) not in drop]
        del g.node[:]
        g.node.extend(keep)
        used = {i for n in g.node for i in n.input}
        keep_i = [t for t in g.initializer if t.name in used]
        del g.initializer[:]
        g.initializer.extend(keep_i)
    return fused
