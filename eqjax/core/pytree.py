"""Param-pytree utilities: '/'-joined paths, leaves that are quantized arrays, true byte sizes."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

import jax
import numpy as np

from eqjax.core.errors import InputError
from eqjax.core.qarray import ActQuantKernel, HalfFloat, PermutedKernel, QArray

__all__ = [
    "is_leaf", "path_str", "flatten", "flatten_with_paths", "float_aval", "map_with_path", "tree_nbytes",
    "get_path", "set_path", "unflatten_paths", "nest_paths",
]

Params = Any


def is_leaf(x: Any) -> bool:
    """QArray, ActQuantKernel, PermutedKernel and HalfFloat count as single leaves of a param tree."""
    return isinstance(x, (QArray, ActQuantKernel, PermutedKernel, HalfFloat))


def path_str(path: tuple) -> str:
    """'layers_0/attn/q_proj/kernel' for a jax key path."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        else:
            parts.append(str(k))
    return "/".join(parts)


def flatten_with_paths(params: Params) -> tuple[list[str], list[Any], Any]:
    """(paths, leaves, treedef) with quantized arrays as leaves."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_leaf)
    return [path_str(p) for p, _ in leaves], [x for _, x in leaves], treedef


def float_aval(x: Any, path: str = "param") -> jax.ShapeDtypeStruct:
    """The float shape/dtype a leaf stands for (a QArray's logical shape and float dtype)."""
    if isinstance(x, ActQuantKernel):
        x = x.weight
    if isinstance(x, QArray):
        return jax.ShapeDtypeStruct(tuple(x.shape), np.dtype(x.dtype))
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(tuple(x.shape), np.dtype(x.dtype))
    if isinstance(x, (bool, int, float, complex, np.generic)):
        return jax.ShapeDtypeStruct((), np.result_type(x))
    raise InputError(f"{path}: a param leaf must be an array, got {type(x).__name__}")


def unflatten_paths(values: dict[str, Any], template: Params) -> Params:
    """``template``'s tree with the leaf at each path replaced by ``values[path]`` where present."""
    paths, leaves, treedef = flatten_with_paths(template)
    return jax.tree_util.tree_unflatten(treedef, [values.get(p, x) for p, x in zip(paths, leaves)])


def flatten(params: Params, *, leaf_type: Callable[[Any], bool] | None = None) -> Iterator[tuple[str, Any]]:
    """(path, leaf) pairs in tree order; quantized arrays are leaves (and whatever ``leaf_type`` accepts)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=leaf_type or is_leaf)
    for path, leaf in leaves:
        yield path_str(path), leaf


def map_with_path(fn: Callable[[str, Any], Any], params: Params) -> Params:
    """``jax.tree.map`` with the '/'-joined path as first argument; quantized arrays are leaves."""
    return jax.tree_util.tree_map_with_path(lambda p, x: fn(path_str(p), x), params, is_leaf=is_leaf)


def tree_nbytes(params: Params) -> int:
    """Bytes of every leaf as stored (packed codes + scales + zero points for quantized leaves)."""
    total = 0
    for _, leaf in flatten(params):
        if is_leaf(leaf):
            total += leaf.nbytes
        elif leaf is not None and hasattr(leaf, "dtype"):
            total += int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


def get_path(params: Params, path: str) -> Any:
    """The subtree at a '/'-joined path of nested dicts."""
    node = params
    for part in path.split("/"):
        try:
            node = node[part]
        except (KeyError, TypeError):
            raise KeyError(f"no parameter at path {path!r} (missing {part!r})") from None
    return node


def set_path(params: Params, path: str, value: Any) -> Params:
    """A copy of nested dicts ``params`` with ``value`` at ``path`` (only the spine is copied)."""
    head, _, rest = path.partition("/")
    if head not in params:
        raise KeyError(f"no parameter at path {path!r} (missing {head!r})")
    out = dict(params)
    out[head] = set_path(params[head], rest, value) if rest else value
    return out


def nest_paths(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Nested dicts from ``{'a/b/c': leaf}`` (the inverse of :func:`flatten_with_paths` for dict trees)."""
    out: dict[str, Any] = {}
    for path, leaf in flat.items():
        node = out
        *parents, last = path.split("/")
        for k in parents:
            node = node.setdefault(k, {})
        node[last] = leaf
    return out
