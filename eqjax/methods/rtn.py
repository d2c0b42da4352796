"""Round-to-nearest weight quantization driven by rules, and the seed's methods built on it.

* :class:`RTN`: the step most recipes end with: quantize each param its rule picks (QArray),
  wrapping it in an :class:`~eqjax.core.qarray.ActQuantKernel` when the rule quantizes activations.
  Role-relative granularities are resolved against how the model uses each weight
  (:mod:`eqjax.core.roles`); a rule matching a param that is not a matmul weight or an embedding
  table, or one already quantized by an earlier step, is an error naming it.
* :func:`absmax_rule`, :func:`zero_point_rule`, :func:`symmetric_rule`, :func:`zeroquant_rule`: the
  seed's methods as rules over every matmul weight.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import warnings
from typing import Any, Mapping

import jax.numpy as jnp

from eqjax.core.errors import InputError
from eqjax.core.numerics import QuantSpec, quantize
from eqjax.core.qarray import ActQuantKernel, describe_granularity, is_quantized, per_input_group, per_output_channel, per_tensor
from eqjax.core.roles import check_quantizable, resolve_granularity, weight_layout
from eqjax.recipes.rules import Rule, assign, rule_from_dict

__all__ = [
    "RTN", "UnusedRuleWarning", "quantize_by_rules", "concrete_spec", "absmax_rule", "zero_point_rule",
    "symmetric_rule", "zeroquant_rule",
]

log = logging.getLogger("eqjax")


class UnusedRuleWarning(UserWarning):
    """A rule matched no parameter."""



def weight_step_spec(bits: int, symmetric: bool, group_size: int | None, scale_dtype: str | None = None,
                     full_range: bool = True) -> QuantSpec:
    """The stored weight format of a calibrated step (GPTQ, AWQ, grid search, SignRound): groups of
    ``group_size`` along the input (per output channel when None), float16 group scales (float32 per
    channel) unless ``scale_dtype``, min/max ranges; symmetric 2..4-bit grids on all 2**b codes
    (``full_range``, the reference's ``2 absmax / (2**b - 1)`` grid)."""
    gran = per_output_channel() if group_size is None else per_input_group(group_size)
    sd = scale_dtype or ("float16" if group_size is not None else "float32")
    full = bool(full_range) and symmetric and bits <= 4
    return QuantSpec(bits, symmetric, gran, "minmax", scale_dtype=sd, full_range=full)

def concrete_spec(spec: QuantSpec, an: Any, path: str, shape: tuple[int, ...]) -> QuantSpec:
    """``spec`` with its granularity resolved for the param ``path`` of ``shape``."""
    gran = resolve_granularity(spec.granularity, weight_layout(an, path, shape), shape, path)
    return dataclasses.replace(spec, granularity=gran)


def step_targets(step: Any, params: Mapping[str, Any], ctx: Any) -> tuple[Any, set[str]]:
    """A calibrated step's calibrator and the still-float matmul weights its ``pattern`` / ``role`` select
    (``step.spec()`` checks that they can hold its format); :class:`InputError` naming the step if none."""
    cal = ctx.calibrator(step.name)
    chosen, _ = assign(params, (Rule(step.pattern, step.spec(), role=step.role),), cal.analysis.roles)
    targets = {p for p in chosen if not is_quantized(params[p])}
    if not targets and not getattr(ctx, "partial", False):
        raise InputError(f"{step.name}: no float matmul weight matches pattern {step.pattern!r}")
    return cal, targets


def unused_rule_error(step: str, rule: Rule, paths: Any, chosen: Mapping[str, Rule],
                      what: str = "parameter", roles: Mapping[str, Any] | None = None) -> InputError | None:
    """The error for ``rule`` of ``step`` that selected nothing: its pattern matches no path of ``paths``
    (a typo), or every path it matches with its role (``roles``: path -> Role) went to an earlier rule (a
    dead rule). None when it matched paths of another role only (a role rule on a model without such
    params: a warning, not an error)."""
    named = [p for p in paths if re.fullmatch(rule.pattern, p)]
    if named and rule.role != "any":
        named = [p for p in named if roles is not None and getattr(roles.get(p), "kind", "other") == rule.role]
        if not named:
            return None
    where = f"step {step!r}, rule {rule.pattern!r}"
    if not named:
        example = next(iter(paths), None)
        return InputError(f"rule matches no {what} ({where}): expected a pattern matching at least one param "
                          f"path{f' (e.g. {example!r})' if example else ''}, found none")
    if all(p in chosen for p in named):
        return InputError(f"rule is shadowed ({where}): expected it to select a {what}, found all its "
                          f"{len(named)} match(es) (e.g. {named[0]!r}) taken by the earlier rule "
                          f"{chosen[named[0]].pattern!r}")
    return None


def quantize_by_rules(params: Mapping[str, Any], rules: tuple[Rule, ...], ctx: Any = None, *,
                      warn_unused: bool = True, step: str = "rtn", report: bool = True,
                      strict: bool = False) -> dict[str, Any]:
    """Quantize every param (by path) whose first matching rule has a weight spec.

    ``ctx`` (a :class:`~eqjax.recipes.types.Context`) gives the model's analysis (roles, layouts); with
    ``report`` what was done is appended to ``ctx.report``. ``strict``: a rule whose pattern matches no
    param path, or whose matches all went to earlier rules, is an :class:`InputError` naming the step and
    the pattern (:func:`unused_rule_error`); other rules that matched nothing (another role) are an
    :class:`UnusedRuleWarning` when ``warn_unused``.
    """
    an = None if ctx is None else ctx.analysis
    chosen, unused = assign(params, rules, None if an is None else an.roles)
    if getattr(ctx, "partial", False):  # one unit of a streamed model: the caller checks the rules
        strict = warn_unused = False
    for rule in unused if strict else ():
        err = unused_rule_error(step, rule, list(params), chosen, roles=None if an is None else an.roles)
        if err is not None:
            raise err
    if unused and warn_unused:
        warnings.warn("rules matched no parameter: " + ", ".join(repr(r.pattern) for r in unused),
                      UnusedRuleWarning, stacklevel=2)
    out = dict(params)
    for path, rule in chosen.items():
        if rule.weight is None:
            continue
        leaf = params[path]
        if is_quantized(leaf):
            raise InputError(f"{step}: {path} is already quantized (by an earlier step); a recipe quantizes each "
                             "param once — exclude it from this step's rules")
        if not hasattr(leaf, "dtype") or not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise InputError(f"{path}: rule {rule.pattern!r} matched a non-float parameter "
                             f"({getattr(leaf, 'dtype', type(leaf).__name__)})")
        role = check_quantizable(an, path, rule.pattern)
        spec = concrete_spec(rule.weight, an, path, tuple(leaf.shape))
        q = quantize(leaf, spec, name=path)
        if rule.act_bits is not None and an is not None and rule.role == "embedding" and not an.uses_of(path):
            pass  # an embedding table no matmul reads (an untied model): nothing to quantize the input of
        elif rule.act_bits is not None:
            if an is not None and (role is None or not an.uses_of(path)):
                raise InputError(f"{path}: activation quantization needs a matmul weight")
            if an is None and leaf.ndim != 2:
                raise InputError(f"{path}: activation quantization without the model needs a 2-D [in, out] kernel")
            q = ActQuantKernel(q, None, rule.act_bits, rule.act_granularity)
        out[path] = q
        if ctx is not None and report:
            ctx.report.append((path, f"{step}: int{spec.bits} {'sym' if spec.symmetric else 'asym'} "
                               f"{describe_granularity(spec.granularity, tuple(leaf.shape))}"
                               + (f" + A{rule.act_bits}" if rule.act_bits else "")))
    return out


@dataclasses.dataclass(frozen=True)
class RTN:
    """Round-to-nearest quantization of the parameters the rules pick (no calibration)."""

    rules: tuple[Rule, ...]
    name: str = "rtn"
    needs_calibration = False

    def __call__(self, params: Mapping[str, Any], ctx: Any = None) -> dict[str, Any]:
        return quantize_by_rules(params, self.rules, ctx, step=self.name, strict=True)

    @classmethod
    def from_config(cls, d: Mapping[str, Any]) -> "RTN":
        d = dict(d)
        rules = d.pop("rules", None)
        if not rules or not isinstance(rules, list):
            raise ValueError("an 'rtn' step needs a non-empty 'rules' list")
        if d:
            raise ValueError(f"unknown 'rtn' key(s): {sorted(d)}")
        return cls(tuple(rule_from_dict(r) for r in rules))


def absmax_rule(bits: int = 8) -> Rule:
    """Seed method: per-tensor symmetric absmax weight quantization of every matmul weight."""
    return Rule(".*", QuantSpec(bits, True, per_tensor(), "absmax"), role="matmul")


def zero_point_rule(bits: int = 8) -> Rule:
    """Seed method: per-tensor asymmetric (min/max, integer zero point) weight quantization."""
    return Rule(".*", QuantSpec(bits, False, per_tensor(), "minmax"), role="matmul")


def symmetric_rule(bits: int = 8) -> Rule:
    """Seed method: symmetric weight quantization, one scale per output channel."""
    return Rule(".*", QuantSpec(bits, True, per_output_channel(), "absmax"), role="matmul")


def zeroquant_rule(bits: int = 8, group_size: int = 64, act_bits: int = 8, *, scale_dtype: str = "float16") -> Rule:
    """ZeroQuant's rule: group-wise symmetric weights (groups along the input) + A8 per token."""
    spec = QuantSpec(bits, True, per_input_group(group_size), "absmax", scale_dtype=scale_dtype)
    return Rule(".*", spec, act_bits, "token", role="matmul")
