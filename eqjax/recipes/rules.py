"""Rules: which parameters are quantized, and how.

A :class:`Rule` selects params by *role* (what the model does with them: ``"matmul"`` weights,
``"embedding"`` tables, or ``"any"``) and by a regular expression over the '/'-joined param path
(``re.fullmatch``, e.g. ``layers_3/attn/q_proj/kernel``), and gives a weight
:class:`~eqjax.core.numerics.QuantSpec` (or None to keep the param in float) plus optional activation
quantization. The first rule whose role and pattern match wins, like qwix's module-path rules.
Built-in recipes use ``Rule(".*", spec, role="matmul")`` with role-relative granularities
(``per_output_channel()``, ``per_input_group(128)``), so they apply to any model; name rules stay for
users who want them. :func:`assign` also reports the rules that matched nothing, so a typo in a
pattern is visible instead of silently quantizing less than intended.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal, Mapping

from eqjax.core.errors import InputError, RuleError
from eqjax.core.numerics import QuantSpec
from eqjax.core.qarray import QArrayError, per_channel, per_group, per_input_group, per_output_channel, per_tensor
from eqjax.recipes.schema import validate_rule_dict

__all__ = ["Rule", "RuleError", "assign", "rule_from_dict", "LINEAR_KERNELS", "ROLES"]

LINEAR_KERNELS = r".*/kernel"
"""A name pattern for Flax-style linear kernels (role rules are preferred: ``role="matmul"``)."""

ROLES = ("matmul", "embedding", "any")


@dataclasses.dataclass(frozen=True)
class Rule:
    """Quantize the params whose role and path match.

    Attributes:
      pattern: regular expression over the '/'-joined parameter path (``re.fullmatch``).
      weight: how to quantize the weight; None keeps matching parameters in float (an exclusion).
      act_bits: if set, the weight's input activations are quantized to this many bits (W8A8).
      act_granularity: ``"token"`` (dynamic, one scale per token) or ``"tensor"``.
      role: ``"matmul"`` (weights of a matmul that are not gathered), ``"embedding"`` (gathered
        tables, including a tied LM head), or ``"any"`` (by name only).
    """

    pattern: str
    weight: QuantSpec | None = None
    act_bits: int | None = None
    act_granularity: Literal["token", "tensor"] = "token"
    role: Literal["matmul", "embedding", "any"] = "any"

    def __post_init__(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise RuleError(f"rule pattern {self.pattern!r} does not compile: {e}") from None
        if self.act_bits is not None and (isinstance(self.act_bits, bool) or not 2 <= self.act_bits <= 8):
            raise RuleError(f"rule {self.pattern!r}: act_bits must be in 2..8, got {self.act_bits}")
        if self.act_granularity not in ("token", "tensor"):
            raise RuleError(f"rule {self.pattern!r}: act_granularity must be 'token' or 'tensor'")
        if self.role not in ROLES:
            raise RuleError(f"rule {self.pattern!r}: role must be one of {ROLES}, got {self.role!r}")

    def matches(self, path: str, role: str | None = None) -> bool:
        """Pattern match, and role match when the param's role is known (``role`` None: unknown)."""
        if re.fullmatch(self.pattern, path) is None:
            return False
        if self.role == "any":
            return True
        if role is None:
            raise InputError(f"rule {self.pattern!r} selects {self.role} params, which needs the model "
                             "(pass model= / the model's call) so eqjax can see how params are used")
        return role == self.role


def assign(paths: Mapping[str, Any], rules: tuple[Rule, ...], roles: Mapping[str, Any] | None = None
           ) -> tuple[dict[str, Rule], tuple[Rule, ...]]:
    """Map each path to its first matching rule; also return the rules that matched nothing.

    ``roles``: path -> :class:`~eqjax.core.analysis.Role` (None when the model is unknown).
    """
    chosen: dict[str, Rule] = {}
    used: set[int] = set()
    for path in paths:
        role = None if roles is None else getattr(roles.get(path), "kind", "other")
        for i, rule in enumerate(rules):
            if rule.matches(path, role):
                chosen[path] = rule
                used.add(i)
                break
    unused = tuple(r for i, r in enumerate(rules) if i not in used)
    return chosen, unused


_GRANULARITY_KEYS = {"tensor", "channel", "group"}
_RULE_KEYS = {
    "pattern", "bits", "symmetric", "granularity", "axis", "group_size", "calibrator", "percentile",
    "scale_dtype", "act_bits", "act_granularity", "skip", "role", "full_range",
}


def _typed(d: Mapping[str, Any], key: str, types: tuple[type, ...], default: Any) -> Any:
    """``d[key]`` if it has one of ``types`` (bool is not an int here), else a RuleError."""
    if key not in d:
        return default
    v = d[key]
    ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in types)
    if not ok:
        want = " or ".join(t.__name__ for t in types)
        raise RuleError(f"rule {d.get('pattern')!r}: {key} must be {want}, got {v!r} ({type(v).__name__})")
    return v


def rule_from_dict(d: Mapping[str, Any]) -> Rule:
    """A rule from a recipe-file entry, e.g. ``{pattern, role, bits, symmetric, granularity, group_size}``.

    ``granularity``: ``tensor`` | ``channel`` (without ``axis``: per output channel of the matmul;
    ``axis`` = a kept axis) | ``group`` (without ``axis``: along the matmul's input; ``group_size``
    required). ``skip = true`` keeps matching parameters in float. ``role``: ``matmul`` |
    ``embedding`` | ``any`` (default ``any``). Values are type-checked, never coerced.
    """
    if not isinstance(d, Mapping):
        raise RuleError(f"a rule must be a table/object, got {type(d).__name__}")

    validate_rule_dict(d)
    unknown = set(d) - _RULE_KEYS
    if unknown:
        raise RuleError(f"unknown rule key(s) {sorted(unknown)}; allowed: {sorted(_RULE_KEYS)}")
    if "pattern" not in d:
        raise RuleError(f"a rule needs a 'pattern': {dict(d)}")
    pattern = _typed(d, "pattern", (str,), None)
    role = _typed(d, "role", (str,), "any")
    if _typed(d, "skip", (bool,), False):
        extra = set(d) - {"pattern", "skip", "role"}
        if extra:
            raise RuleError(f"rule {pattern!r}: skip = true conflicts with {sorted(extra)}")
        return Rule(pattern, None, role=role)
    kind = _typed(d, "granularity", (str,), "channel")
    if kind not in _GRANULARITY_KEYS:
        raise RuleError(f"rule {pattern!r}: granularity must be one of {sorted(_GRANULARITY_KEYS)}")
    axis = _typed(d, "axis", (int,), None)
    if kind == "tensor" and (axis is not None or "group_size" in d):
        raise RuleError(f"rule {pattern!r}: a per-tensor rule takes no axis / group_size")
    if kind == "channel" and "group_size" in d:
        raise RuleError(f"rule {pattern!r}: group_size needs granularity = 'group'")
    try:
        if kind == "tensor":
            gran = per_tensor()
        elif kind == "channel":
            gran = per_output_channel() if axis is None else per_channel(axis)
        else:
            if "group_size" not in d:
                raise RuleError(f"rule {pattern!r}: granularity 'group' needs group_size")
            size = _typed(d, "group_size", (int,), None)
            if size < 1:
                raise RuleError(f"rule {pattern!r}: group_size must be >= 1, got {size}")
            gran = per_input_group(size) if axis is None else per_group(axis, size)
        spec = QuantSpec(
            bits=_typed(d, "bits", (int,), 8),
            symmetric=_typed(d, "symmetric", (bool,), True),
            granularity=gran,
            calibrator=_typed(d, "calibrator", (str,), "minmax"),
            percentile=float(_typed(d, "percentile", (int, float), 99.9)),
            scale_dtype=_typed(d, "scale_dtype", (str,), "float32"),
            full_range=_typed(d, "full_range", (bool,), False),
        )
    except (QArrayError, ValueError) as e:
        if isinstance(e, RuleError):
            raise
        raise RuleError(f"rule {pattern!r}: {e}") from None
    act = _typed(d, "act_bits", (int,), None)
    return Rule(pattern, spec, act, _typed(d, "act_granularity", (str,), "token"), role)
