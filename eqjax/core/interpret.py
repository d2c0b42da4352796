"""Evaluate a program node by node: the one path for running, calibrating and fake-quantizing.

:func:`run` evaluates nodes ``[start, stop)`` of a :class:`~eqjax.core.program.Program` into an
environment (value id -> array). Params are given by path and may be float arrays, QArrays or
ActQuantKernels:

* a weight use (``dot_general`` on a param) calls ``dot_hook(use, x, w, default)`` when given, else
  ``default(x, w)``: the float dot for a float ``w``, eqjax's quantized matmul
  (:func:`eqjax.core.qdot.weight_dot`) for a quantized one. Hooks see the activation ``x`` and the
  param leaf ``w`` in the param's own layout; they may record ``x`` (calibration), replace ``w``
  (fake quantization for distillation) or both;
* a row gather of a quantized table gathers codes and scales and dequantizes only those rows;
* layout ops on a quantized param are deferred to its use; any other reader gets the dequantized
  param (correct, just not faster).

Everything is traceable: ``jax.jit`` of a function calling :func:`run` compiles the model with the
quantized matmuls in place of the float ones.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, MutableMapping, Sequence

import jax

from eqjax.core.analysis import Analysis, WeightUse
from eqjax.core.numerics import dequantize_leaf
from eqjax.core.program import Lit, Node, Program, Ref
from eqjax.core.qarray import is_quantized
from eqjax.core.qdot import embedding_gather, weight_dot
from eqjax.core.views import apply_view, bind

__all__ = ["run", "evaluate", "DotHook"]

DotHook = Callable[[WeightUse, Any, Any, Callable[[Any, Any], Any]], Any]
"""``(use, x, w, default) -> y``; ``default(x, w)`` computes the use's dot for any leaf ``w``."""


@dataclasses.dataclass(frozen=True)
class _Deferred:
    """A layout view of a quantized param, materialized only if something other than a use reads it."""

    path: str
    chain: tuple[Node, ...]


def run(
    prog: Program,
    an: Analysis,
    env: MutableMapping[int, Any],
    params: Mapping[str, Any],
    start: int = 0,
    stop: int | None = None,
    *,
    dot_hook: DotHook | None = None,
) -> MutableMapping[int, Any]:
    """Evaluate nodes ``[start, stop)`` into ``env`` (which must hold their inputs); returns ``env``."""
    stop = len(prog.nodes) if stop is None else stop

    def read(r: Ref) -> Any:
        v = _lookup(prog, env, params, r)
        if isinstance(v, _Deferred):
            w = dequantize_leaf(params[v.path])
            for n in v.chain:
                w = bind(n, [w] + [x.value for x in n.ins[1:]])[0]
            return w
        return dequantize_leaf(v) if is_quantized(v) else v

    def raw(r: Ref) -> Any:
        if isinstance(r, int):
            if r in env:
                return env[r]
            if r in prog.param_of:
                return params[prog.param_of[r]]
        return None

    for i in range(start, stop):
        node = prog.nodes[i]
        use = an.use_at(i)
        if use is not None:
            w = params[use.path]

            def default(x: Any, w: Any, use: WeightUse = use, node: Node = node) -> Any:
                if is_quantized(w):
                    return weight_dot(prog, use, node, x, w)
                operand = apply_view(prog, use, w)
                ins = [x, operand] if use.side == 1 else [operand, x]
                return bind(node, ins)[0]

            x = read(use.x)
            env[node.outs[0]] = dot_hook(use, x, w, default) if dot_hook is not None else default(x, w)
            continue
        emb = an.embedding_at(i)
        if emb is not None and is_quantized(params[emb.path]):
            env[node.outs[0]] = embedding_gather(prog, emb, node, params[emb.path], read(node.ins[1]))
            continue
        src = raw(node.ins[0]) if node.ins else None
        if node.name in _VIEWS and (is_quantized(src) or isinstance(src, _Deferred)):
            base = src if isinstance(src, _Deferred) else _Deferred(prog.param_of[node.ins[0]], ())
            env[node.outs[0]] = _Deferred(base.path, base.chain + (node,))
            continue
        outs = bind(node, [read(r) for r in node.ins])
        for o, v in zip(node.outs, outs):
            env[o] = v
    return env


_VIEWS = frozenset({"convert_element_type", "copy", "copy_p", "transpose", "reshape", "squeeze",
                    "broadcast_in_dim", "slice"})


def _lookup(prog: Program, env: Mapping[int, Any], params: Mapping[str, Any], r: Ref) -> Any:
    """The value behind ``r``: a literal, a computed value, a param (by path) or a constant."""
    if isinstance(r, Lit):
        return r.value
    if r in env:
        return env[r]
    if r in prog.param_of:
        return params[prog.param_of[r]]
    return prog.consts[r]


def evaluate(prog: Program, an: Analysis, params: Mapping[str, Any], args: Sequence[Any], *,
             dot_hook: DotHook | None = None) -> Any:
    """The program's output pytree for ``params`` (by path) and the array arguments ``args``."""
    if len(args) != len(prog.args):
        raise ValueError(f"the program takes {len(prog.args)} array arguments, got {len(args)}")
    env: dict[int, Any] = dict(zip(prog.args, args))
    run(prog, an, env, params, dot_hook=dot_hook)

    def out(r: Ref) -> Any:
        v = _lookup(prog, env, params, r)
        return dequantize_leaf(v) if is_quantized(v) else v

    return jax.tree_util.tree_unflatten(prog.out_tree, [out(r) for r in prog.outputs])
