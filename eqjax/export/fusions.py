"""Pattern matching on the traced program: onnxruntime's fused ops where the model's own ops fit them.

Each matcher reads the program's data flow (primitives, params, shapes; never names) and returns
:class:`~eqjax.export.walker.Fused` ops that replace program values; whatever does not match is
lowered op by op (always correct, just slower). Matched, per decoder layer of eqjax's Llama (and of any
model computing the same things the same way):

* **RMSNorm** ``x * rsqrt(mean(x * x) + eps) * scale`` -> ``SimplifiedLayerNormalization``; when ``x``
  is a residual sum ``h + a`` -> ``SkipSimplifiedLayerNormalization(h, a)``, whose fourth output
  replaces the sum for its other readers.
* **RoPE** (rotate-half convention, angles ``positions * inv_freq`` with constant ``inv_freq``, positions
  derived from the cache length and ``iota`` only) -> ``RotaryEmbedding`` on the projection output,
  fed by the graph's ``position_ids`` and cos/sin tables of ``context_length`` rows.
* **Cached attention**: keys/values written into a per-layer cache buffer ``[B, Hkv, S, hd]`` with
  ``dynamic_update_slice`` at the cache length, scores ``q . k`` (optionally times a constant), a causal
  mask from positions (``select_n``), softmax, ``p . v``, heads merged to ``[B, T, Hq * hd]`` ->
  ``GroupQueryAttention`` with the shared KV buffer (``past_key`` / ``present_key`` the same tensor in
  onnxruntime-genai; a growing cache works too), ``seqlens_k`` / ``total_sequence_length`` from the
  attention mask. Sliding-window masks, soft-capping or anything else in the softmax chain: not fused.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from eqjax.core.program import Lit, Program, Ref
from eqjax.core.views import bind
from eqjax.export.graph import MS_DOMAIN
from eqjax.export.walker import Fused, Walker

__all__ = ["DecodeContext", "find_fusions"]


@dataclasses.dataclass
class DecodeContext:
    """Graph-level tensors the attention fusions read (built once by the package writer).

    Attributes:
      position_ids: int64 ``[B, T]`` graph input; seqlens_k: int32 ``[B]``; total_len: int32 scalar.
      length_arg: the program value id of the cache length argument.
      context_length: rows of the RoPE cos/sin tables.
    """

    position_ids: str
    seqlens_k: str
    total_len: str
    length_arg: int
    context_length: int


class _P:
    """Small helpers over a program."""

    def __init__(self, prog: Program) -> None:
        self.prog = prog

    def node(self, ref: Ref) -> Any:
        if isinstance(ref, Lit) or ref not in self.prog.producer:
            return None
        return self.prog.nodes[self.prog.producer[ref]]

    def is_(self, ref: Ref, *names: str) -> Any:
        n = self.node(ref)
        return n if n is not None and n.name in names else None

    def users(self, vid: int) -> list[Any]:
        return [self.prog.nodes[i] for i in self.prog.users.get(vid, ())]

    def through(self, ref: Ref, *names: str) -> Ref:
        """Follow producers of the given (layout/dtype) kinds backwards."""
        while True:
            n = self.is_(ref, *names)
            if n is None:
                return ref
            ref = n.ins[0]

    def lit(self, ref: Ref) -> float | None:
        if isinstance(ref, Lit):
            return float(np.asarray(ref.value))
        return None

    def const_value(self, ref: Ref, depth: int = 8) -> np.ndarray | None:
        """The value of a ref computed from constants only (None if it reads args or params)."""

        if isinstance(ref, Lit):
            return np.asarray(ref.value)
        if ref in self.prog.consts:
            return np.asarray(self.prog.consts[ref])
        n = self.node(ref)
        if n is None or depth == 0:
            return None
        vals = [self.const_value(r, depth - 1) for r in n.ins]
        if any(v is None for v in vals):
            return None
        import jax.numpy as jnp

        return np.asarray(bind(n, [jnp.asarray(v) for v in vals])[n.outs.index(ref)])

    def ancestry(self, ref: Ref, stop: set[int], limit: int = 200) -> tuple[set[str], set[int]]:
        """(primitive names, input/param/const value ids) reachable backwards from ``ref``."""
        names, leaves, todo, seen = set(), set(), [ref], set()
        while todo and len(seen) < limit:
            r = todo.pop()
            if isinstance(r, Lit) or r in seen:
                continue
            seen.add(r)
            n = self.node(r)
            if n is None or r in stop:
                leaves.add(r)
                continue
            names.add(n.name)
            todo.extend(n.ins)
        return names, leaves


# -------------------------------------------------------------------------------------------- RMSNorm
def _rms_norms(P: _P) -> list[Fused]:
    prog, out = P.prog, []
    claimed_adds: set[int] = set()
    for n in prog.nodes:
        if n.name != "rsqrt":
            continue
        add = P.is_(n.ins[0], "add")
        if add is None:
            continue
        eps = P.lit(add.ins[1]) if P.lit(add.ins[1]) is not None else P.lit(add.ins[0])
        mean_ref = add.ins[0] if isinstance(add.ins[1], Lit) else add.ins[1]
        div = P.is_(mean_ref, "div")
        if eps is None or div is None or P.lit(div.ins[1]) is None:
            continue
        red = P.is_(P.through(div.ins[0], "broadcast_in_dim", "reshape"), "reduce_sum")
        if red is None:
            continue
        sq = P.is_(red.ins[0], "mul", "integer_pow")
        if sq is None or (sq.name == "mul" and sq.ins[0] != sq.ins[1]) or \
                (sq.name == "integer_pow" and sq.params["y"] != 2):
            continue
        X = sq.ins[0]
        xs = prog.shape(X)
        if tuple(red.params["axes"]) != (len(xs) - 1,) or P.lit(div.ins[1]) != xs[-1]:
            continue
        ys = [u for u in P.users(n.outs[0]) if u.name == "mul" and X in u.ins]
        if len(ys) != 1:
            continue
        y = ys[0].outs[0]
        yc = P.users(y)
        if len(yc) == 1 and yc[0].name == "convert_element_type":
            y = yc[0].outs[0]
        fin = [u for u in P.users(y) if u.name == "mul"]
        if len(fin) != 1:
            continue
        other = fin[0].ins[0] if fin[0].ins[1] == y else fin[0].ins[1]
        scale = P.through(other, "broadcast_in_dim", "convert_element_type", "reshape")
        if not isinstance(scale, int) or scale not in prog.param_of or len(prog.shape(scale)) != 1:
            continue
        x = P.through(X, "convert_element_type")
        res = P.is_(x, "add")
        skip = (res is not None and all(isinstance(r, int) for r in res.ins)
                and prog.shape(res.ins[0]) == prog.shape(res.ins[1]) == xs and res.outs[0] not in claimed_adds)
        norm_out = fin[0].outs[0]
        if skip:
            claimed_adds.add(res.outs[0])
            out.append(Fused((res.ins[0], res.ins[1], scale), (norm_out, res.outs[0]),
                             _emit_skip(res.ins[0], res.ins[1], scale, eps), "SkipSimplifiedLayerNormalization"))
        # a norm without a residual sum (the first layer's) stays plain ops: SimplifiedLayerNormalization is
        # an onnxruntime op in the default domain that onnx.checker does not know
    return out


def _emit_norm(x: Ref, scale: int, eps: float) -> Callable[[Walker], list[str]]:
    def emit(w: Walker) -> list[str]:
        return [w.g.op("SimplifiedLayerNormalization", [w.name(x), w.name(scale)], axis=-1, epsilon=float(eps),
                       stash_type=1, hint="rmsnorm")]
    return emit


def _emit_skip(h: Ref, a: Ref, scale: int, eps: float) -> Callable[[Walker], list[str]]:
    def emit(w: Walker) -> list[str]:
        y, s = w.g.name("skipnorm"), w.g.name("residual")
        w.g.op("SkipSimplifiedLayerNormalization", [w.name(h), w.name(a), w.name(scale)], domain=MS_DOMAIN,
               outputs=[y, "", "", s], epsilon=float(eps))
        return [y, s]
    return emit


# -------------------------------------------------------------------------------------------- RoPE
@dataclasses.dataclass(frozen=True)
class _Rope:
    pre: Ref          # the projection output [B, T, H * hd] (before the head reshape)
    inv_freq: np.ndarray
    heads: int


def _rope(P: _P, ref: Ref, ctx: DecodeContext) -> _Rope | None:
    """``ref`` [B, T, H, hd] = rope(reshape(pre)) in the rotate-half convention, or None."""
    prog = P.prog
    add = P.is_(ref, "add")
    if add is None or len(prog.shape(ref)) != 4:
        return None
    m1, m2 = P.is_(add.ins[0], "mul"), P.is_(add.ins[1], "mul")
    if m1 is None or m2 is None:
        return None
    for a, b in ((m1, m2), (m2, m1)):
        for qi in (0, 1):
            q, cos_ref = a.ins[qi], a.ins[1 - qi]
            cos = P.is_(P.through(cos_ref, "convert_element_type", "broadcast_in_dim"), "cos")
            if cos is None:
                continue
            for ri in (0, 1):
                rot, sin_ref = b.ins[ri], b.ins[1 - ri]
                sin = P.is_(P.through(sin_ref, "convert_element_type", "broadcast_in_dim"), "sin")
                if sin is None or P.through(sin.ins[0], "broadcast_in_dim") != P.through(cos.ins[0], "broadcast_in_dim"):
                    continue
                if not _rotate_half(P, rot, q):
                    continue
                inv = _inv_freq(P, cos.ins[0], ctx)
                pre = P.is_(q, "reshape")
                if inv is None or pre is None:
                    continue
                B, T, H, hd = prog.shape(q)
                if inv.shape != (hd // 2,) or len(prog.shape(pre.ins[0])) != 3:
                    continue
                return _Rope(pre.ins[0], inv, int(H))
    return None


def _rotate_half(P: _P, rot: Ref, q: Ref) -> bool:
    """``rot == concat(-q[..., h:], q[..., :h])``."""
    cat = P.is_(rot, "concatenate")
    if cat is None or len(cat.ins) != 2 or cat.params["dimension"] != len(P.prog.shape(q)) - 1:
        return False
    neg = P.is_(cat.ins[0], "neg")
    if neg is None:
        return False
    hd = P.prog.shape(q)[-1]
    return _half(P, neg.ins[0], q, hd // 2) and _half(P, cat.ins[1], q, 0)


def _half(P: _P, ref: Ref, q: Ref, start: int) -> bool:
    """``ref`` is ``q[..., start:start + hd/2]`` (a slice or a constant-index gather)."""
    n = P.node(ref)
    if n is None or n.ins[0] != q:
        return False
    hd = P.prog.shape(q)[-1]
    if n.name == "slice":
        return tuple(n.params["start_indices"])[-1] == start and tuple(n.params["limit_indices"])[-1] == start + hd // 2
    if n.name == "gather":
        idx = P.const_value(n.ins[1])
        dn = n.params["dimension_numbers"]
        return (idx is not None and idx.shape == (1,) and int(idx[0]) == start
                and tuple(dn.start_index_map) == (len(P.prog.shape(q)) - 1,) and n.params["slice_sizes"][-1] == hd // 2)
    return False


def _inv_freq(P: _P, ang_ref: Ref, ctx: DecodeContext) -> np.ndarray | None:
    """inv_freq of ``angles = concat(a, a)``, ``a = positions * inv_freq`` (positions from the length and iota)."""
    cat = P.is_(P.through(ang_ref, "broadcast_in_dim", "reshape"), "concatenate")
    if cat is None or len(cat.ins) != 2 or cat.ins[0] != cat.ins[1]:
        return None
    mul = P.is_(cat.ins[0], "mul")
    if mul is None:
        return None
    for i in (0, 1):
        inv = P.const_value(mul.ins[1 - i])
        if inv is None:
            continue
        names, leaves = P.ancestry(mul.ins[i], stop=set())
        if names <= {"iota", "add", "mul", "broadcast_in_dim", "convert_element_type", "reshape", "dim_as_value"} and \
                leaves <= {ctx.length_arg} | set(P.prog.consts):
            return np.asarray(inv, np.float32).reshape(-1)
    return None


# -------------------------------------------------------------------------------------------- attention
_SOFTMAX_PRIMS = {"mul", "div", "select_n", "reduce_max", "max", "broadcast_in_dim", "stop_gradient", "sub", "exp",
                  "reduce_sum", "convert_element_type", "reshape"}


def _heads_from(P: _P, ref: Ref) -> Ref | None:
    """``ref`` = transpose(X, (0, 2, 1, 3)): X [B, T, H, hd], else None."""
    t = P.is_(ref, "transpose")
    if t is None or tuple(t.params["permutation"]) != (0, 2, 1, 3):
        return None
    return t.ins[0]


def _attention(P: _P, ctx: DecodeContext) -> list[Fused]:
    prog, out = P.prog, []
    for dk in prog.nodes:
        if dk.name != "dynamic_update_slice" or len(prog.shape(dk.outs[0])) != 4:
            continue
        starts = dk.ins[2:]
        if not (P.lit(starts[0]) == 0 and P.lit(starts[1]) == 0 and P.lit(starts[3]) == 0):
            continue
        K4 = _heads_from(P, dk.ins[1])
        if K4 is None:
            continue
        # scores: dot_general(Q5 [B, Hkv, G, T, hd], Kc [B, Hkv, S, hd])
        kc = [u for u in _readers(P, dk.outs[0]) if u.name == "dot_general"]
        if len(kc) != 1:
            continue
        S = kc[0]
        (lc, rc), (lb, rb) = S.params["dimension_numbers"]
        if tuple(lc) != (4,) or tuple(rc) != (3,) or tuple(lb) != (0, 1) or tuple(rb) != (0, 1):
            continue
        q5 = P.is_(S.ins[0], "reshape")
        Q4 = _heads_from(P, q5.ins[0]) if q5 is not None else None
        if Q4 is None:
            continue
        chain, O, scale = _softmax_chain(P, S)
        if O is None:
            continue
        (olc, orc), (olb, orb) = O.params["dimension_numbers"]
        dv = P.is_(P.through(O.ins[0], "convert_element_type"), "dynamic_update_slice")
        if dv is None or tuple(olc) != (2,) or tuple(orc) != (4,) or tuple(olb) != (0, 1) or tuple(orb) != (0, 1):
            continue
        if not (P.lit(dv.ins[2]) == 0 and P.lit(dv.ins[3]) == 0 and P.lit(dv.ins[5]) == 0):
            continue
        V4 = _heads_from(P, dv.ins[1])
        tr = [u for u in P.users(O.outs[0])]
        if V4 is None or len(tr) != 1 or tr[0].name != "transpose" or tuple(tr[0].params["permutation"]) != (0, 4, 1, 3, 2):
            continue
        rs = [u for u in P.users(tr[0].outs[0])]
        if len(rs) != 1 or rs[0].name != "reshape" or len(prog.shape(rs[0].outs[0])) != 3:
            continue
        A = rs[0].outs[0]
        B, Hkv, G, T, hd = prog.shape(q5.outs[0])
        if int(hd) % 8:  # onnxruntime's GroupQueryAttention: "head_size must be a multiple of 8"
            continue
        rq, rk = _rope(P, Q4, ctx), _rope(P, K4, ctx)
        ins = (rq.pre if rq else Q4, rk.pre if rk else K4, V4, dk.ins[0], dv.ins[0])
        out.append(Fused(ins, (A, dk.outs[0], dv.outs[0]),
                         _emit_gqa(P, ctx, Q4, K4, V4, dk.ins[0], dv.ins[0], int(Hkv) * int(G), int(Hkv), int(hd), scale),
                         "GroupQueryAttention"))
    return out


def _readers(P: _P, vid: int) -> list[Any]:
    """Readers of ``vid``, looking through dtype conversions."""
    out = []
    for u in P.users(vid):
        if u.name == "convert_element_type":
            out.extend(_readers(P, u.outs[0]))
        else:
            out.append(u)
    return out


def _softmax_chain(P: _P, S: Any) -> tuple[list[Any], Any, float]:
    """From the scores node: (chain nodes, the probabilities . values dot, scale) or (.., None, ..)."""
    scale = 1.0
    frontier, chain, O = [S.outs[0]], [], None
    seen: set[int] = set()
    while frontier:
        v = frontier.pop()
        for u in P.users(v):
            if id(u) in seen:
                continue
            seen.add(id(u))
            if u.name == "dot_general":
                if O is not None and O is not u:
                    return chain, None, scale
                O = u
                continue
            if u.name not in _SOFTMAX_PRIMS:
                return chain, None, scale
            if u.name == "select_n":
                names, _ = P.ancestry(u.ins[0], stop=set())
                if names - {"iota", "add", "mul", "broadcast_in_dim", "convert_element_type", "le", "ge", "lt", "gt",
                            "reshape", "dim_as_value", "sub", "select_n"}:
                    return chain, None, scale  # a window ('and'), padding masks, ...: not plain causal
            if u.name == "mul" and v == S.outs[0]:
                c = P.lit(u.ins[1]) if P.lit(u.ins[1]) is not None else P.lit(u.ins[0])
                if c is None:
                    return chain, None, scale
                scale = c
            chain.append(u)
            frontier.extend(u.outs)
    return chain, O, scale


def _emit_gqa(P: _P, ctx: DecodeContext, Q4: Ref, K4: Ref, V4: Ref, pk: Ref, pv: Ref, Hq: int, Hkv: int, hd: int,
              scale: float) -> Callable[[Walker], list[str]]:
    rq, rk = _rope(P, Q4, ctx), _rope(P, K4, ctx)

    def flat(w: Walker, ref: Ref, rope: _Rope | None) -> str:
        if rope is not None:
            cos, sin = _rope_tables(w, rope.inv_freq, ctx.context_length)
            w.counts["RotaryEmbedding"] = w.counts.get("RotaryEmbedding", 0) + 1
            return w.g.op("RotaryEmbedding", [w.name(rope.pre), ctx.position_ids, cos, sin], domain=MS_DOMAIN,
                          interleaved=0, hint="rope")
        return w.g.op("Reshape", [w.name(ref), w.g.const([0, 0, -1], np.int64)])

    def emit(w: Walker) -> list[str]:
        q, k, v = flat(w, Q4, rq), flat(w, K4, rk), flat(w, V4, None)
        o, pres_k, pres_v = w.g.name("attn"), w.g.name("present_k"), w.g.name("present_v")
        w.g.op("GroupQueryAttention", [q, k, v, w.name(pk), w.name(pv), ctx.seqlens_k, ctx.total_len],
               domain=MS_DOMAIN, outputs=[o, pres_k, pres_v], num_heads=Hq, kv_num_heads=Hkv, scale=float(scale),
               local_window_size=-1, do_rotary=0)
        return [o, pres_k, pres_v]
    return emit


def _rope_tables(w: Walker, inv_freq: np.ndarray, n: int) -> tuple[str, str]:
    def make() -> tuple[str, str]:
        ang = np.arange(n, dtype=np.float32)[:, None] * inv_freq[None, :].astype(np.float32)
        return w.g.init("cos_cache", np.cos(ang).astype(np.float32)), w.g.init("sin_cache", np.sin(ang).astype(np.float32))
    return w.g.memo(("rope", inv_freq.tobytes(), n), make)


def find_fusions(prog: Program, ctx: DecodeContext | None, *, norms: bool = True) -> tuple[Fused, ...]:
    """Every fusion that applies to ``prog`` (attention ones only with a decode context)."""
    P = _P(prog)
    out: list[Fused] = []
    if ctx is not None:
        out += _attention(P, ctx)
    if norms:
        out += _rms_norms(P)
    return tuple(out)
