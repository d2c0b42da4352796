"""From rules to concrete quantization: which params a rule may touch and on which axes.

* :func:`weight_layout` gives a param's matmul layout (contracted and free axes) from its uses in
  the program; a tied embedding table takes the layout of its LM-head use, an embedding table
  without one is laid out as ``[rows, features...]``.
* :func:`resolve_granularity` turns the role-relative granularities (``per_output_channel``,
  ``per_input_group``) into concrete axes of the param: one scale per output channel (the free axes,
  plus stacked axes of a scanned param), groups along the *flattened* contraction ``K`` (the contracted
  axes in order, row-major), so a weight means the same whatever its layout: ``[H*hd, D]`` and
  ``[H, hd, D]`` get the same groups. The granularity names the fewest trailing contracted axes whose
  product the group divides (one axis when it divides the last); where it divides none, all of them,
  and the last group of ``K`` is shorter (``576 = 4 x 128 + 64``). Contracted axes that are not
  adjacent in the param cannot be flattened in place: groups then run along the last one, with a
  :class:`GroupLayoutWarning` naming the weight.
* :func:`check_quantizable` refuses params that are neither matmul weights nor embedding tables,
  naming what reads them.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import numpy as np

from eqjax.core.analysis import Analysis, Role
from eqjax.core.errors import InputError
from eqjax.core.qarray import Granularity, per_channel, per_group, per_tensor

__all__ = ["Layout", "GroupLayoutWarning", "weight_layout", "resolve_granularity", "input_group_axes",
           "check_quantizable"]


class GroupLayoutWarning(UserWarning):
    """A recipe's input groups could not run along a weight's flattened contraction."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """A weight's axes: ``contracting`` (inputs, ascending), ``free`` (outputs), ``stacked`` (axes
    indexed by a scan), and whether any use contracts over a batch axis (``batched``)."""

    contracting: tuple[int, ...]
    free: tuple[int, ...]
    stacked: tuple[int, ...] = ()
    batched: bool = False


def weight_layout(an: Analysis | None, path: str, shape: tuple[int, ...]) -> Layout | None:
    """The layout of ``path`` from its uses, or None without an analysis."""
    if an is None:
        return None
    uses = an.uses_of(path)
    if uses:
        layouts = {(u.contracting, tuple(sorted(u.free + u.batch))) for u in uses}
        if len(layouts) > 1:
            raise InputError(f"{path}: used by several matmuls with different axes {sorted(layouts)}; "
                             "quantize it with an explicit-axis rule")
        u = uses[0]
        stacked = tuple(sorted({a for x in uses for a, _ in x.view.index}))
        free = tuple(sorted(set(u.free + u.batch) | set(stacked)))
        return Layout(u.contracting, free, stacked, any(x.batch for x in uses))
    embs = [e for e in an.embeddings if e.path == path]
    if embs:
        axis = embs[0].axis
        return Layout(tuple(a for a in range(len(shape)) if a != axis), (axis,))
    return None


def resolve_granularity(gran: Granularity, layout: Layout | None, shape: tuple[int, ...], path: str) -> Granularity:
    """A concrete granularity for ``path`` (see the module docs)."""
    if not gran.role_relative:
        try:
            return gran.normalized(len(shape))
        except ValueError as e:
            raise InputError(f"{path}: {e}") from None
    if layout is None:
        raise InputError(f"{path}: granularity {gran} depends on how the model uses the weight; "
                         "pass the model (model= / calibration=) or use an explicit-axis rule")
    if gran.kind == "output":
        return per_channel(layout.free) if layout.free else per_tensor()
    if not layout.contracting:
        raise InputError(f"{path}: no input axis to group along")
    return per_group(input_group_axes(layout.contracting, shape, gran.group_size, path), gran.group_size)


def input_group_axes(contracting: tuple[int, ...], shape: tuple[int, ...], group_size: int,
                     path: str = "") -> tuple[int, ...]:
    """The param axes groups of ``group_size`` run along (see the module docs): the fewest trailing
    contracted axes whose product ``group_size`` divides, else all of them."""
    for j in range(len(contracting) - 1, -1, -1):
        if int(np.prod([shape[a] for a in contracting[j:]], dtype=np.int64)) % group_size == 0:
            break
    else:
        j = 0
    axes = tuple(contracting[j:])
    if axes != tuple(range(axes[0], axes[0] + len(axes))):
        warnings.warn(f"{path}: groups of {group_size} cannot run along the flattened contraction of axes "
                      f"{axes} (not adjacent in the param {tuple(shape)}); grouped along axis {axes[-1]} alone",
                      GroupLayoutWarning, stacklevel=3)
        return (axes[-1],)
    return axes


def check_quantizable(an: Analysis | None, path: str, rule_pattern: str) -> Role | None:
    """The param's role; raises for a param that is neither a matmul weight nor an embedding table."""
    if an is None:
        return None
    role = an.roles.get(path)
    if role is not None and role.kind == "other":
        raise InputError(f"{path}: rule {rule_pattern!r} matched it, but it is not a matmul weight or an embedding "
                         f"table ({role.why}); eqjax quantizes only those: narrow the pattern")
    return role


def describe(an: Analysis) -> dict[str, Any]:
    """Counts of params by role, for reports."""
    out: dict[str, int] = {}
    for r in an.roles.values():
        out[r.kind] = out.get(r.kind, 0) + 1
    return out
