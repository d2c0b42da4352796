"""Round-to-nearest weight quantization driven by rules, and the seed's methods built on it.

* :class:`RTN`: the step every recipe ends with: quantize each parameter its rule picks (QArray),
  wrapping it in an :class:`~eqjax.linear.ActQuantKernel` when the rule quantizes activations.
* :func:`absmax`, :func:`zero_point`, :func:`symmetric`, :func:`zeroquant`: the seed's methods as
  pure functions ``params -> qparams``.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any, Mapping

import jax.numpy as jnp

from eqjax.linear import ActQuantKernel
from eqjax.numerics import QuantSpec, quantize
from eqjax.pytree import Params, is_leaf, map_with_path
from eqjax.qarray import per_channel, per_group, per_tensor
from eqjax.rules import LINEAR_KERNELS, Rule, assign, rule_from_dict

__all__ = ["RTN", "quantize_by_rules", "absmax", "zero_point", "symmetric", "zeroquant", "zeroquant_rule"]

log = logging.getLogger("eqjax")


class UnusedRuleWarning(UserWarning):
    """A rule matched no parameter."""


def quantize_by_rules(params: Params, rules: tuple[Rule, ...], *, warn_unused: bool = True) -> Params:
    """Quantize every float parameter whose first matching rule has a weight spec."""
    chosen, unused = assign(params, rules)
    if unused and warn_unused:
        warnings.warn(
            "rules matched no parameter: " + ", ".join(repr(r.pattern) for r in unused),
            UnusedRuleWarning,
            stacklevel=2,
        )

    def one(path: str, leaf: Any) -> Any:
        rule = chosen.get(path)
        if rule is None or rule.weight is None or is_leaf(leaf):
            return leaf
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise TypeError(f"{path}: rule {rule.pattern!r} matched a non-float parameter ({leaf.dtype})")
        q = quantize(leaf, rule.weight, name=path)
        if rule.act_bits is None:
            return q
        if leaf.ndim != 2:
            raise ValueError(f"{path}: activation quantization needs a 2-D [in, out] kernel, got {leaf.shape}")
        return ActQuantKernel(q, None, rule.act_bits, rule.act_granularity)

    return map_with_path(one, params)


@dataclasses.dataclass(frozen=True)
class RTN:
    """Round-to-nearest quantization of the parameters the rules pick (no calibration)."""

    rules: tuple[Rule, ...]
    name: str = "rtn"
    needs_calibration = False

    def __call__(self, params: Params, ctx: Any = None) -> Params:
        return quantize_by_rules(params, self.rules)

    @classmethod
    def from_config(cls, d: Mapping[str, Any]) -> "RTN":
        d = dict(d)
        rules = d.pop("rules", None)
        if not rules:
            raise ValueError("an 'rtn' step needs a non-empty 'rules' list")
        if d:
            raise ValueError(f"unknown 'rtn' key(s): {sorted(d)}")
        return cls(tuple(rule_from_dict(r) for r in rules))


def absmax(params: Params, bits: int = 8, pattern: str = LINEAR_KERNELS) -> Params:
    """Seed method: per-tensor symmetric absmax weight quantization."""
    return quantize_by_rules(params, (Rule(pattern, QuantSpec(bits, True, per_tensor(), "absmax")),))


def zero_point(params: Params, bits: int = 8, pattern: str = LINEAR_KERNELS) -> Params:
    """Seed method: per-tensor asymmetric (min/max, integer zero point) weight quantization."""
    return quantize_by_rules(params, (Rule(pattern, QuantSpec(bits, False, per_tensor(), "minmax")),))


def symmetric(params: Params, bits: int = 8, pattern: str = LINEAR_KERNELS) -> Params:
    """Seed method: symmetric weight quantization, one scale per output channel."""
    return quantize_by_rules(params, (Rule(pattern, QuantSpec(bits, True, per_channel(-1), "absmax")),))


def zeroquant_rule(
    bits: int = 8, group_size: int = 64, act_bits: int = 8, *, pattern: str = r".*/kernel",
    scale_dtype: str = "float16",
) -> Rule:
    """ZeroQuant's rule: group-wise symmetric weights (groups along the input) + A8 per token."""
    spec = QuantSpec(bits, True, per_group(0, group_size), "absmax", scale_dtype=scale_dtype)
    return Rule(pattern, spec, act_bits, "token")


def zeroquant(
    params: Params, bits: int = 8, group_size: int = 64, act_bits: int = 8, pattern: str = LINEAR_KERNELS
) -> Params:
    """ZeroQuant: group-wise symmetric weights (groups along the input) + token-wise dynamic activations."""
    sd = "float16" if bits <= 4 else "float32"
    return quantize_by_rules(params, (zeroquant_rule(bits, group_size, act_bits, pattern=pattern, scale_dtype=sd),))
