"""Param-pytree utilities: '/'-joined paths, leaves that are quantized arrays, true byte sizes."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import jax
import numpy as np

from eqjax.linear import ActQuantKernel
from eqjax.qarray import QArray

__all__ = ["is_leaf", "path_str", "flatten", "map_with_path", "tree_nbytes", "get_path", "set_path"]

Params = Any


def is_leaf(x: Any) -> bool:
    """QArray and ActQuantKernel count as single leaves of a param tree."""
    return isinstance(x, (QArray, ActQuantKernel))


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


def flatten(params: Params) -> Iterator[tuple[str, Any]]:
    """(path, leaf) pairs in tree order; quantized arrays are leaves."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_leaf)
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
