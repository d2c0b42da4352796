"""From rules to concrete quantization: which params a rule may touch and on which axes.

* :func:`weight_layout` gives a param's matmul layout (contracted and free axes) from its uses in
  the program; a tied embedding table takes the layout of its LM-head use, an embedding table
  without one is laid out as ``[rows, features...]``.
* :func:`resolve_granularity` turns the role-relative granularities (``per_output_channel``,
  ``per_input_group``) into concrete axes of the param: one scale per output channel (the free axes,
  plus stacked axes of a scanned param), groups along the last contracted axis (a group never spans two
  indices of an outer contracted axis; where the group does not divide the axis, the last group of each
  row is shorter, and an axis shorter than the group is one group).
* :func:`check_quantizable` refuses params that are neither matmul weights nor embedding tables,
  naming what reads them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from eqjax.core.analysis import Analysis, Role
from eqjax.core.errors import InputError
from eqjax.core.qarray import Granularity, per_channel, per_group, per_tensor

__all__ = ["Layout", "weight_layout", "resolve_granularity", "check_quantizable"]


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
    return per_group(max(layout.contracting), gran.group_size)


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
