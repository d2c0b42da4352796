"""A traced model as one flat program: numbered values, primitive nodes, params and arguments as inputs.

:func:`trace` turns any callable ``fn(params, *args, **kwargs)`` (a linen ``module.apply``, an NNX
module called functionally, eqjax's own ``Model.apply``, a plain JAX function) into a
:class:`Program`: ``jax.make_jaxpr`` with *abstract* float params (so the same program serves float
params, QArrays and tracers), then every call-like sub-jaxpr (``jit``, ``custom_jvp_call``,
``custom_vjp_call``, ``checkpoint``/``remat``, ``closed_call``) is inlined, every ``scan`` whose
inputs derive from params is unrolled (stacked params, ``nn.scan``), and every ``cond`` with a
literal predicate is replaced by its branch. What remains is a list of :class:`Node` s in execution
order over integer value ids, which the analysis (:mod:`eqjax.core.analysis`) reads and the
interpreter (:mod:`eqjax.core.interpret`) evaluates, one node at a time or a segment at a time.

Nothing is patched and nothing is parsed: the program is built from the jaxpr's own objects
(primitives, params, avals), and primitives are re-bound with their own params when evaluated.

Inputs: non-array leaves of ``args``/``kwargs`` (Python bools, ints, strings, ``None``) are static (part
of the trace key, as ``jax.jit`` static arguments would be); array leaves are the program's
arguments. Param leaves may be float arrays, QArrays or ActQuantKernels (their float shape/dtype is
what is traced).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import jax.extend.core as jcore
import numpy as np

from eqjax.core.errors import InputError
from eqjax.core.pytree import flatten_with_paths, float_aval

__all__ = ["Lit", "Ref", "Node", "Program", "ProgramError", "trace", "VIEW_PRIMS"]


class ProgramError(InputError):
    """A model could not be traced into a program eqjax can analyse."""


@dataclasses.dataclass(frozen=True)
class Lit:
    """A literal operand (a scalar the jaxpr inlined)."""

    value: Any


Ref = int | Lit
"""An operand: a value id, or a literal."""


@dataclasses.dataclass(frozen=True, eq=False)
class Node:
    """One primitive application: ``outs = prim.bind(*ins, **params)``.

    Attributes:
      prim: the JAX primitive.
      params: its params, as in the jaxpr equation.
      ins: operand refs.
      outs: ids of the produced values.
    """

    prim: Any
    params: Mapping[str, Any]
    ins: tuple[Ref, ...]
    outs: tuple[int, ...]

    @property
    def name(self) -> str:
        return self.prim.name


VIEW_PRIMS = frozenset({"convert_element_type", "copy", "copy_p", "transpose", "reshape", "squeeze",
                        "broadcast_in_dim", "expand_dims", "slice"})
"""Primitives that only change a param's layout or dtype (see :mod:`eqjax.core.analysis`)."""

_CALL_JAXPR = {
    "jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
    "remat2": "jaxpr", "checkpoint": "jaxpr",
}


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """A flat program. Value ids index ``avals``.

    Attributes:
      nodes: in execution order.
      avals: ``jax.core.ShapedArray`` of every value id.
      params: value ids of the param leaves, in ``param_paths`` order.
      param_paths: '/'-joined path of each param leaf.
      args: value ids of the array leaves of the call arguments.
      consts: value id -> constant (closed-over arrays of the traced function).
      outputs: refs of the output leaves; ``out_tree`` rebuilds the output pytree.
      opaque: indices of nodes left un-inlined that read params (``while``, ``cond`` on a traced
        predicate, ``scan`` without param inputs never counts): params they read are not quantizable.
    """

    nodes: tuple[Node, ...]
    avals: tuple[Any, ...]
    params: tuple[int, ...]
    param_paths: tuple[str, ...]
    args: tuple[int, ...]
    consts: Mapping[int, Any]
    outputs: tuple[Ref, ...]
    out_tree: Any
    opaque: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        producer: dict[int, int] = {}
        users: dict[int, list[int]] = {}
        for i, n in enumerate(self.nodes):
            for o in n.outs:
                producer[o] = i
            for r in n.ins:
                if isinstance(r, int):
                    users.setdefault(r, []).append(i)
        object.__setattr__(self, "producer", producer)
        object.__setattr__(self, "users", {k: tuple(v) for k, v in users.items()})
        object.__setattr__(self, "param_of", dict(zip(self.params, self.param_paths)))
        object.__setattr__(self, "output_ids", frozenset(r for r in self.outputs if isinstance(r, int)))

    producer: Mapping[int, int] = dataclasses.field(init=False, repr=False)
    """value id -> index of the node producing it (absent for inputs and constants)."""
    users: Mapping[int, tuple[int, ...]] = dataclasses.field(init=False, repr=False)
    """value id -> indices of the nodes reading it."""
    param_of: Mapping[int, str] = dataclasses.field(init=False, repr=False)
    """param value id -> its path."""
    output_ids: frozenset = dataclasses.field(init=False, repr=False)

    def shape(self, ref: Ref) -> tuple[int, ...]:
        return tuple(np.shape(ref.value)) if isinstance(ref, Lit) else tuple(self.avals[ref].shape)

    def n_users(self, vid: int) -> int:
        """How many nodes (and program outputs) read ``vid``."""
        return len(self.users.get(vid, ())) + (1 if vid in self.output_ids else 0)

    def __repr__(self) -> str:
        return (f"Program({len(self.nodes)} nodes, {len(self.params)} params, {len(self.args)} args, "
                f"{len(self.outputs)} outputs)")


# ------------------------------------------------------------------------------------------------
# Building: inline calls, unroll param scans.
# ------------------------------------------------------------------------------------------------


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.avals: list[Any] = []
        self.consts: dict[int, Any] = {}
        self.from_params: set[int] = set()
        self.opaque: list[int] = []

    def new(self, aval: Any) -> int:
        self.avals.append(aval)
        return len(self.avals) - 1

    def const(self, value: Any) -> int:
        vid = self.new(jax.typeof(value))
        self.consts[vid] = value
        return vid

    def _tainted(self, refs: Iterable[Ref]) -> bool:
        return any(isinstance(r, int) and r in self.from_params for r in refs)

    def emit(self, prim: Any, params: Mapping[str, Any], ins: Sequence[Ref], out_avals: Sequence[Any]) -> list[int]:
        outs = [self.new(a) for a in out_avals]
        self.nodes.append(Node(prim, dict(params), tuple(ins), tuple(outs)))
        if self._tainted(ins):
            self.from_params.update(outs)
        return outs

    def inline(self, jaxpr: Any, const_refs: Sequence[Ref], in_refs: Sequence[Ref]) -> list[Ref]:
        env: dict[Any, Ref] = {}
        for v, r in zip(jaxpr.constvars, const_refs):
            env[v] = r
        for v, r in zip(jaxpr.invars, in_refs):
            env[v] = r

        def read(a: Any) -> Ref:
            return Lit(a.val) if isinstance(a, jcore.Literal) else env[a]

        for eqn in jaxpr.eqns:
            ins = [read(a) for a in eqn.invars]
            name = eqn.primitive.name
            if name in _CALL_JAXPR:
                outs = self._call(eqn.params[_CALL_JAXPR[name]], ins)
            elif name == "scan" and self._tainted(ins):
                outs = self._unroll_scan(eqn.params, ins)
            elif name == "cond" and isinstance(ins[0], Lit):
                branches = eqn.params["branches"]
                idx = int(np.clip(int(ins[0].value), 0, len(branches) - 1))
                outs = self._call(branches[idx], ins[1:])
            else:
                if name in ("while", "cond", "scan") and self._tainted(ins):
                    self.opaque.append(len(self.nodes))
                outs = self.emit(eqn.primitive, eqn.params, ins, [v.aval for v in eqn.outvars])
            for v, r in zip(eqn.outvars, outs):
                if not isinstance(v, jcore.DropVar):
                    env[v] = r
        return [read(v) for v in jaxpr.outvars]

    def _call(self, sub: Any, ins: Sequence[Ref]) -> list[Ref]:
        if isinstance(sub, jcore.ClosedJaxpr):
            return self.inline(sub.jaxpr, [self.const(c) for c in sub.consts], ins)
        return self.inline(sub, [], ins)

    def _helper(self, fn: Callable, refs: Sequence[Ref]) -> list[Ref]:
        """Inline the jaxpr of ``fn`` applied to ``refs`` (used for slicing/stacking unrolled scans)."""
        avals = [jax.typeof(r.value) if isinstance(r, Lit) else self.avals[r] for r in refs]
        closed = jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
        return self.inline(closed.jaxpr, [self.const(c) for c in closed.consts], refs)

    def _unroll_scan(self, params: Mapping[str, Any], ins: Sequence[Ref]) -> list[Ref]:
        body, length = params["jaxpr"], params["length"]
        consts, carry, xs = scan_operand_groups(params, ins)
        n_carry = len(carry)
        per_iter: list[list[Ref]] = []
        order = range(length - 1, -1, -1) if params["reverse"] else range(length)
        for i in order:
            x_i = [self._helper(lambda a, i=i: jax.lax.index_in_dim(a, i, 0, keepdims=False), [x])[0] for x in xs]
            outs = self._call(body, consts + carry + x_i)
            carry, ys = outs[:n_carry], outs[n_carry:]
            per_iter.append(ys)
        if params["reverse"]:
            per_iter.reverse()
        n_ys = len(per_iter[0]) if per_iter else 0
        stacked = [self._helper(lambda *a: jax.numpy.stack(a), [it[k] for it in per_iter])[0] for k in range(n_ys)]
        return carry + stacked


def scan_operand_groups(params: Mapping[str, Any], ins: Sequence[Any]) -> tuple[list, list, list]:
    """A ``scan`` equation's operands split into (consts, carry, xs). jax 0.10 gives the counts
    (``num_consts``, ``num_carry``); jax 0.11 a flat-tree description of the three groups (``ft_in``)."""
    if "num_consts" in params:
        n_consts, n_carry = params["num_consts"], params["num_carry"]
        return list(ins[:n_consts]), list(ins[n_consts:n_consts + n_carry]), list(ins[n_consts + n_carry:])
    consts, carry, xs = params["ft_in"].update(list(ins)).unpack()
    return list(consts), list(carry), list(xs)


def _split_static(tree: Any) -> tuple[list[Any], list[int], list[Any], Any]:
    """(all leaves, positions of array leaves, static leaves, treedef)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    dyn = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray, np.generic))
           or hasattr(x, "shape") and hasattr(x, "dtype")]
    static = [None if i in dyn else leaves[i] for i in range(len(leaves))]
    return leaves, dyn, static, treedef


def trace(fn: Callable[..., Any], params: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
          *, what: str = "model") -> Program:
    """Trace ``fn(params, *args, **kwargs)`` into a flat :class:`Program`.

    ``params`` may hold float arrays, QArrays or ActQuantKernels (traced as float arrays of their
    logical shape and dtype), or ``jax.ShapeDtypeStruct`` s. Errors raised while tracing are re-raised
    as :class:`ProgramError` naming ``what``.
    """
    kwargs = dict(kwargs or {})
    paths, p_leaves, p_tree = flatten_with_paths(params)
    p_avals = [float_aval(x, p) for p, x in zip(paths, p_leaves)]
    leaves, dyn, static, a_tree = _split_static((tuple(args), kwargs))
    # a ShapeDtypeStruct argument may carry symbolic dimensions (jax.export.symbolic_shape): kept as is
    a_avals = [leaves[i] if isinstance(leaves[i], jax.ShapeDtypeStruct)
               else jax.ShapeDtypeStruct(np.shape(leaves[i]), jax.numpy.result_type(leaves[i])) for i in dyn]
    out_tree_box: list[Any] = []

    def flat(p_flat: list[Any], a_flat: list[Any]) -> list[Any]:
        full = list(static)
        for i, v in zip(dyn, a_flat):
            full[i] = v
        a, k = jax.tree_util.tree_unflatten(a_tree, full)
        out = fn(jax.tree_util.tree_unflatten(p_tree, p_flat), *a, **k)
        out_leaves, out_tree = jax.tree_util.tree_flatten(out)
        out_tree_box.append(out_tree)
        return out_leaves

    try:
        closed = jax.make_jaxpr(flat)(p_avals, a_avals)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        raise ProgramError(f"{what}: tracing the call failed: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    b = _Builder()
    jaxpr = closed.jaxpr
    const_refs = [b.const(c) for c in closed.consts]
    in_ids = [b.new(v.aval) for v in jaxpr.invars]
    n_p = len(p_avals)
    b.from_params.update(in_ids[:n_p])
    outs = b.inline(jaxpr, const_refs, in_ids)
    return Program(
        nodes=tuple(b.nodes), avals=tuple(b.avals), params=tuple(in_ids[:n_p]), param_paths=tuple(paths),
        args=tuple(in_ids[n_p:]), consts=dict(b.consts), outputs=tuple(outs), out_tree=out_tree_box[-1],
        opaque=tuple(b.opaque),
    )


def trace_key(params: Any, args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> Any:
    """A hashable key of what :func:`trace` depends on (param avals, argument avals, static values)."""
    paths, p_leaves, p_tree = flatten_with_paths(params)
    p_sig = tuple((p, tuple(float_aval(x, p).shape), str(float_aval(x, p).dtype)) for p, x in zip(paths, p_leaves))
    leaves, dyn, static, a_tree = _split_static((tuple(args), dict(kwargs or {})))
    a_sig = tuple((tuple(np.shape(leaves[i])), str(jax.numpy.result_type(leaves[i]))) for i in dyn)
    try:
        s_sig = tuple(static)
        hash(s_sig)
    except TypeError:
        raise InputError("model call: non-array arguments must be hashable (they are static to the trace)") from None
    return (p_tree, p_sig, a_tree, a_sig, s_sig)
