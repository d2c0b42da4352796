"""Param-tree checks: every leaf finite and floating (quantized leaves: finite scales), named by path
and first bad index; shared by the loaders and by :func:`eqjax.quantize`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from eqjax.core.errors import CompatibilityError, NonFiniteError, RecipeError
from eqjax.core.linear import ActQuantKernel
from eqjax.core.pytree import flatten
from eqjax.core.qarray import HalfFloat, PermutedKernel, QArray


class NonFiniteParamsError(RecipeError, NonFiniteError):
    """A param given to :func:`eqjax.quantize` holds NaN/Inf: a RecipeError (the recipe cannot run on
    these params) and a :class:`~eqjax.core.errors.NonFiniteError`."""


# ------------------------------------------------------------------------------------ param trees
def _np(x: Any) -> np.ndarray:
    """Host copy of a leaf; a global array spanning other processes' devices is read from this
    process's replica, or gathered (a collective: every process checks the same tree)."""
    if getattr(x, "is_fully_addressable", True) is False:
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


_CHECK_CHUNK = 1 << 22
"""Elements per pass of the finiteness check: its temporaries stay small whatever the array (an LM head is
half a billion)."""


def _first_bad(a: np.ndarray) -> tuple[int, tuple[int, ...]] | None:
    if a.dtype.kind not in "fc" and a.dtype.name != "bfloat16":
        return None
    flat = a.reshape(-1)
    wide = a.dtype.name == "bfloat16"
    if all(np.isfinite(flat[i:i + _CHECK_CHUNK].astype(np.float32) if wide else flat[i:i + _CHECK_CHUNK]).all()
           for i in range(0, flat.size, _CHECK_CHUNK)):
        return None
    f = a.astype(np.float32) if wide else a
    bad = ~np.isfinite(f)
    if not bad.any():
        return None
    return int(bad.sum()), tuple(int(i) for i in np.argwhere(bad)[0])


def check_params(params: Any, source: str = "params", *, allow_int: bool = False,
                 nonfinite: type[NonFiniteError] = NonFiniteError) -> None:
    """Raise naming ``source``, the param path and the first bad index if a float leaf holds NaN/Inf,
    a quantized leaf has a non-finite scale, or (unless ``allow_int``) a plain leaf is not floating-point.

    Concrete arrays only (a no-op for tracers). ``nonfinite``: the error class for NaN/Inf (a subclass
    of :class:`~eqjax.core.errors.NonFiniteError`).
    """
    import jax


    for path, leaf in flatten(params):
        if leaf is None:
            continue
        parts: list[tuple[str, Any]]
        if isinstance(leaf, PermutedKernel):  # its inner kernel's arrays; the permutation is checked when built
            leaf = leaf.kernel
        if isinstance(leaf, HalfFloat):
            parts = [("", leaf.values)]
        elif isinstance(leaf, ActQuantKernel):
            parts = [("scale", leaf.weight.scale)] + ([("act_scale", leaf.act_scale)] if leaf.act_scale is not None else [])
        elif isinstance(leaf, QArray):
            parts = [("scale", leaf.scale)]
        elif hasattr(leaf, "dtype") and hasattr(leaf, "shape"):
            parts = [("", leaf)]
        else:
            continue
        for field, arr in parts:
            if isinstance(arr, jax.core.Tracer):
                continue
            a = _np(arr)
            name = path + (f" ({field})" if field else "")
            if not field and a.dtype.kind not in "fc" and a.dtype.name != "bfloat16" and not allow_int:
                raise CompatibilityError(
                    f"non-float parameter ({source}: {name}): expected a floating-point dtype, found {a.dtype.name}"
                )
            hit = _first_bad(a)
            if hit is not None:
                n, idx = hit
                raise nonfinite(
                    f"non-finite parameter ({source}: {name}): expected finite values, found {n} NaN/Inf, "
                    f"first at index {idx} of shape {tuple(a.shape)}"
                )
