"""Rules: which parameters are quantized, how, chosen by a regex over the parameter path.

A :class:`Rule` pairs a regular expression (matched with ``re.fullmatch`` against '/'-joined paths
such as ``layers_3/attn/q_proj/kernel``) with a weight :class:`~eqjax.numerics.QuantSpec` (or None to
keep the tensor in float) and optional activation quantization. The first matching rule wins, like
qwix's module-path rules. :func:`assign` also reports the rules that matched nothing, so a typo in a
pattern is visible instead of silently quantizing less than intended.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal, Mapping

from eqjax.numerics import QuantSpec
from eqjax.pytree import Params, flatten
from eqjax.qarray import QArrayError, per_channel, per_group, per_tensor

__all__ = ["Rule", "RuleError", "assign", "rule_from_dict", "LINEAR_KERNELS"]

LINEAR_KERNELS = r".*/kernel"
"""Every linear layer's kernel (embeddings and norms are not matched)."""


class RuleError(ValueError):
    """A rule is malformed (bad regex, unknown key, impossible setting)."""


@dataclasses.dataclass(frozen=True)
class Rule:
    """Quantize the parameters whose path fully matches ``pattern``.

    Attributes:
      pattern: regular expression over the '/'-joined parameter path (``re.fullmatch``).
      weight: how to quantize the weight; None keeps matching parameters in float (an exclusion).
      act_bits: if set, the layer's input activations are quantized to this many bits (W8A8).
      act_granularity: ``"token"`` (dynamic, one scale per token) or ``"tensor"``.
    """

    pattern: str
    weight: QuantSpec | None = None
    act_bits: int | None = None
    act_granularity: Literal["token", "tensor"] = "token"

    def __post_init__(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise RuleError(f"rule pattern {self.pattern!r} does not compile: {e}") from None
        if self.act_bits is not None and not 2 <= self.act_bits <= 8:
            raise RuleError(f"rule {self.pattern!r}: act_bits must be in 2..8, got {self.act_bits}")
        if self.act_granularity not in ("token", "tensor"):
            raise RuleError(f"rule {self.pattern!r}: act_granularity must be 'token' or 'tensor'")

    def matches(self, path: str) -> bool:
        return re.fullmatch(self.pattern, path) is not None


def assign(params: Params, rules: tuple[Rule, ...]) -> tuple[dict[str, Rule], tuple[Rule, ...]]:
    """Map each parameter path to its first matching rule; also return the rules that matched nothing."""
    chosen: dict[str, Rule] = {}
    used: set[int] = set()
    for path, _ in flatten(params):
        for i, rule in enumerate(rules):
            if rule.matches(path):
                chosen[path] = rule
                used.add(i)
                break
    unused = tuple(r for i, r in enumerate(rules) if i not in used)
    return chosen, unused


_GRANULARITY_KEYS = {"tensor", "channel", "group"}
_RULE_KEYS = {
    "pattern", "bits", "symmetric", "granularity", "axis", "group_size", "calibrator", "percentile",
    "scale_dtype", "act_bits", "act_granularity", "skip",
}


def rule_from_dict(d: Mapping[str, Any]) -> Rule:
    """A rule from a recipe file entry, e.g. ``{pattern, bits, symmetric, granularity, group_size}``.

    ``granularity``: ``tensor`` | ``channel`` (``axis`` = kept axis, default -1 = output channels) |
    ``group`` (``axis`` = grouped axis, default 0 = input features; ``group_size`` required).
    ``skip = true`` keeps matching parameters in float.
    """
    from eqjax.schema import validate_rule_dict  # noqa: PLC0415 - typed check: no coercion, conflicts refused

    validate_rule_dict(d)
    unknown = set(d) - _RULE_KEYS
    if unknown:
        raise RuleError(f"unknown rule key(s) {sorted(unknown)}; allowed: {sorted(_RULE_KEYS)}")
    if "pattern" not in d:
        raise RuleError(f"a rule needs a 'pattern': {dict(d)}")
    if d.get("skip", False):
        return Rule(d["pattern"], None)
    kind = d.get("granularity", "channel")
    if kind not in _GRANULARITY_KEYS:
        raise RuleError(f"rule {d['pattern']!r}: granularity must be one of {sorted(_GRANULARITY_KEYS)}")
    try:
        if kind == "tensor":
            gran = per_tensor()
        elif kind == "channel":
            gran = per_channel(int(d.get("axis", -1)))
        else:
            if "group_size" not in d:
                raise RuleError(f"rule {d['pattern']!r}: granularity 'group' needs group_size")
            gran = per_group(int(d.get("axis", 0)), int(d["group_size"]))
        spec = QuantSpec(
            bits=int(d.get("bits", 8)),
            symmetric=bool(d.get("symmetric", True)),
            granularity=gran,
            calibrator=d.get("calibrator", "minmax"),
            percentile=float(d.get("percentile", 99.9)),
            scale_dtype=d.get("scale_dtype", "float32"),
        )
    except QArrayError as e:
        raise RuleError(f"rule {d['pattern']!r}: {e}") from None
    act = d.get("act_bits")
    return Rule(d["pattern"], spec, None if act is None else int(act), d.get("act_granularity", "token"))
