"""Typed validation of recipe dictionaries (TOML/JSON recipe files).

Recipe dicts are checked against a schema *without coercion*: a bool must be a bool (``symmetric =
"false"`` is refused, not read as True), an int must be an int (``bits = 4.7`` is refused, not run as
4-bit), a float may be given as an int; unknown keys are refused and keys that contradict each other
(``skip = true`` with ``bits``, ``group_size`` without ``granularity = "group"``, ``percentile`` with
another calibrator, ...) are refused. Every error is a :class:`SchemaError` (a
:class:`~eqjax.core.errors.RecipeError` and a :class:`~eqjax.core.errors.RuleError`) whose message names the key
path (``steps[0].rules[1].bits``), the expected type/range and the value found.

Step tables of dataclass steps (``gptq``, ``awq``, ``smoothquant``, ``zeroquant_lkd``) are checked
against the dataclass's annotated field types (:func:`check_step_fields`), so new fields are covered
without editing this file.

Param trees are checked by :func:`eqjax.core.validate.check_params` and
:func:`eqjax.recipes.checks.check_recipe_fits`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any, Callable, Mapping

from eqjax.core.errors import RecipeError, RuleError

__all__ = [
    "SchemaError", "validate_recipe_dict", "validate_rule_dict", "validate_kv_dict", "check_step_fields", "step_kwargs",
    "RULE_KEYS",
]


class SchemaError(RecipeError, RuleError):
    """A recipe value has the wrong type, is out of range, unknown, or conflicts with another key."""

    def __init__(self, where: str, expected: str, found: str, source: str | None = None) -> None:
        self.where, self.expected, self.found, self.source = where, expected, found, source
        super().__init__(self._message())

    def _message(self) -> str:
        where = self.where or "top level"
        loc = f"{self.source}: {where}" if self.source else where
        return f"invalid recipe value ({loc}): expected {self.expected}, found {self.found}"

    def with_source(self, source: str) -> "SchemaError":
        return SchemaError(self.where, self.expected, self.found, source)


def _show(v: Any) -> str:
    """``found`` part of a message: the type and a short repr."""
    if v is None:
        return "null"
    r = repr(v)
    if len(r) > 60:
        r = r[:57] + "..."
    return f"{type(v).__name__} {r}"


# ------------------------------------------------------------------------------------ value checkers
Checker = Callable[[Any, str], Any]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def Int(lo: int | None = None, hi: int | None = None) -> Checker:
    rng = "" if lo is None and hi is None else (
        f" in {lo}..{hi}" if lo is not None and hi is not None else (f" >= {lo}" if lo is not None else f" <= {hi}")
    )

    def check(v: Any, where: str) -> int:
        if not _is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
            raise SchemaError(where, f"an integer{rng}", _show(v))
        return v

    return check


def Float(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False) -> Checker:
    parts = []
    if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {lo}")
    if hi is not None:
        parts.append(f"{'<' if hi_open else '<='} {hi}")
    rng = (" " + " and ".join(parts)) if parts else ""

    def check(v: Any, where: str) -> float:
        try:  # an int too large for a float (a JSON file may hold one) is out of range, not a crash
            ok = (_is_int(v) or isinstance(v, float)) and math.isfinite(float(v))
        except OverflowError:
            ok = False
        if ok:
            f = float(v)
            if lo is not None and (f < lo or (lo_open and f == lo)):
                ok = False
            if hi is not None and (f > hi or (hi_open and f == hi)):
                ok = False
        if not ok:
            raise SchemaError(where, f"a finite number{rng}", _show(v))
        return float(v)

    return check


def Bool() -> Checker:
    def check(v: Any, where: str) -> bool:
        if not isinstance(v, bool):
            raise SchemaError(where, "true or false (a boolean, not a string or number)", _show(v))
        return v

    return check


def Str(choices: tuple[str, ...] | None = None, *, nonempty: bool = False) -> Checker:
    def check(v: Any, where: str) -> str:
        if not isinstance(v, str):
            raise SchemaError(where, "a string" if choices is None else f"one of {list(choices)}", _show(v))
        if choices is not None and v not in choices:
            raise SchemaError(where, f"one of {list(choices)}", _show(v))
        if nonempty and not v.strip():
            raise SchemaError(where, "a non-empty string", _show(v))
        return v

    return check


def Regex() -> Checker:
    def check(v: Any, where: str) -> str:
        if not isinstance(v, str):
            raise SchemaError(where, "a regular expression string", _show(v))
        try:
            re.compile(v)
        except Exception as e:  # noqa: BLE001 - re.error, OverflowError, RecursionError on hostile patterns
            raise SchemaError(where, "a regular expression that compiles",
                              f"{_show(v)}, which does not compile ({type(e).__name__}: {e})") from None
        return v

    return check


def Optional(inner: Checker) -> Checker:
    def check(v: Any, where: str) -> Any:
        return None if v is None else inner(v, where)

    return check


def List(inner: Checker, *, nonempty: bool = False, what: str = "a list") -> Checker:
    def check(v: Any, where: str) -> list:
        if not isinstance(v, (list, tuple)):
            raise SchemaError(where, what, _show(v))
        if nonempty and not v:
            raise SchemaError(where, f"a non-empty {what.removeprefix('a ')}", "an empty list")
        return [inner(x, f"{where}[{i}]") for i, x in enumerate(v)]

    return check


def Table(fields: Mapping[str, Checker], *, required: tuple[str, ...] = (), what: str = "a table",
          kind: str = "") -> Checker:
    def check(v: Any, where: str) -> dict:
        if not isinstance(v, Mapping):
            raise SchemaError(where, f"{what} (key = value pairs)", _show(v))
        for k in v:
            if not isinstance(k, str):
                raise SchemaError(where, "string keys", _show(k))
        unknown = sorted(set(v) - set(fields))
        if unknown:
            raise SchemaError(_join(where, unknown[0]), f"one of the keys {sorted(fields)}",
                              f"unknown {kind + ' ' if kind else ''}key {unknown[0]!r}")
        for k in required:
            if k not in v:
                raise SchemaError(_join(where, k), f"a value (required key {k!r})", "nothing")
        return {k: fields[k](x, _join(where, k)) for k, x in v.items()}

    return check


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _conflict(where: str, key: str, needs: str, found: str) -> SchemaError:
    return SchemaError(_join(where, key), needs, found)


# ------------------------------------------------------------------------------------ rules
GRANULARITIES = ("tensor", "channel", "group")
RULE_FIELDS: dict[str, Checker] = {
    "pattern": Regex(),
    "skip": Bool(),
    "bits": Int(2, 8),
    "symmetric": Bool(),
    "granularity": Str(GRANULARITIES),
    "axis": Int(-64, 63),
    "group_size": Int(1, 65536),
    "calibrator": Str(("absmax", "minmax", "percentile", "mse")),
    "percentile": Float(50.0, 100.0, lo_open=True),
    "scale_dtype": Str(("float32", "float16", "bfloat16")),
    "act_bits": Int(2, 8),
    "act_granularity": Str(("token", "tensor")),
    "role": Str(("matmul", "embedding", "any")),
    "full_range": Bool(),
}
RULE_KEYS = frozenset(RULE_FIELDS)
_QUANT_KEYS = tuple(k for k in RULE_FIELDS if k not in ("pattern", "skip", "role"))


def validate_rule_dict(d: Any, where: str = "rule") -> dict[str, Any]:
    """Check one rule table (types, ranges, unknown and conflicting keys); returns it unchanged."""
    out = Table(RULE_FIELDS, required=("pattern",), what="a rule table", kind="rule")(d, where)
    if out.get("skip", False):
        extra = [k for k in _QUANT_KEYS if k in out]
        if extra:
            raise _conflict(where, extra[0], "no quantization keys in a rule with skip = true",
                            f"{extra[0]} = {out[extra[0]]!r} (conflicts with skip = true)")
        return dict(d)
    kind = out.get("granularity", "channel")
    if kind == "group" and "group_size" not in out:
        raise SchemaError(_join(where, "group_size"), "a group size (granularity = 'group' needs one)", "nothing")
    if kind != "group" and "group_size" in out:
        raise _conflict(where, "group_size", "granularity = 'group' (group_size only applies to groups)",
                        f"granularity {kind!r}" + ("" if "granularity" in out else " (the default)"))
    if kind == "tensor" and "axis" in out:
        raise _conflict(where, "axis", "no axis with granularity = 'tensor'", f"axis = {out['axis']!r}")
    if "percentile" in out and out.get("calibrator", "minmax") != "percentile":
        raise _conflict(where, "percentile", "calibrator = 'percentile' (percentile only applies to it)",
                        f"calibrator {out.get('calibrator', 'minmax')!r}")
    if "act_granularity" in out and "act_bits" not in out:
        raise _conflict(where, "act_granularity", "act_bits as well (activations are only quantized with act_bits)",
                        "act_granularity without act_bits")
    return dict(d)


# ------------------------------------------------------------------------------------ kv cache
KV_FIELDS: dict[str, Checker] = {
    "bits": Int(2, 8),
    "key_bits": Int(2, 8),
    "value_bits": Int(2, 8),
    "outlier_fraction": Float(0.0, 0.5, hi_open=True),
    "sink_tokens": Int(0, 1 << 20),
    "key_group": Optional(Int(1, 1 << 20)),
    "value_group": Optional(Int(1, 1 << 20)),
    "key_levels": Optional(List(Float(0.0, 1.0), nonempty=True, what="a list of levels in [0, 1]")),
    "value_levels": Optional(List(Float(0.0, 1.0), nonempty=True, what="a list of levels in [0, 1]")),
    "recent_float": Bool(),
}


def validate_kv_dict(d: Any, where: str = "kv") -> dict[str, Any]:
    """Check the ``kv`` table (KV-cache quantization)."""
    out = Table(KV_FIELDS, what="a kv table", kind="kv")(d, where)
    if "bits" in out and ("key_bits" in out or "value_bits" in out):
        k = "key_bits" if "key_bits" in out else "value_bits"
        raise _conflict(where, k, "either bits or key_bits/value_bits", f"both bits = {out['bits']} and {k} = {out[k]}")
    return dict(d)


# ------------------------------------------------------------------------------------ steps
# value ranges for fields of dataclass steps, by name (types come from the annotations)
_FIELD_RANGES: dict[str, Checker] = {
    "bits": Int(2, 8),
    "act_bits": Int(2, 8),
    "group_size": Int(1, 65536),
    "batch_size": Int(1, 1 << 20),
    "micro_batch": Int(1, 1 << 20),
    "blocksize": Int(1, 1 << 24),
    "n_grid": Int(1, 10_000),
    "clip_grid": Int(1, 10_000),
    "steps": Int(0, 10_000_000),
    "sink_tokens": Int(0, 1 << 20),
    "alpha": Float(0.0, 1.0),
    "percdamp": Float(0.0, 10.0, lo_open=True),
    "lr": Float(0.0, 10.0, lo_open=True),
    "max_shrink": Float(0.0, 1.0, hi_open=True),
    "sink_weight": Float(0.0, None),
    "scale_dtype": Optional(Str(("float32", "float16", "bfloat16"))),
    # searched grids, learned rounding
    "grid": Str(("minmax", "search")),
    "grid_weighting": Str(("hessian", "diagonal", "none")),
    "weighting": Str(("hessian", "diagonal", "none")),
    "grid_n": Int(1, 10_000),
    "grid_min_ratio": Float(0.0, 1.0, lo_open=True),
    "min_ratio": Float(0.0, 1.0, lo_open=True),
    "grid_refine": Int(0, 1000),
    "refine": Int(0, 1000),
    "damp": Float(0.0, 10.0),
    "iters": Int(0, 1_000_000),
    "optimizer": Str(("sign", "adam")),
    "init": Str(("minmax", "search")),
    "advance": Str(("new", "original")),
    "time_budget": Float(0.0, None, lo_open=True),
    "scale_min": Float(0.0, 1.0, lo_open=True),
    "scale_max": Float(1.0, 100.0),
    "pattern": Regex(),
    "name": Str(nonempty=True),
}


def _checker_for(tp: Any) -> Checker | None:
    """A checker for an annotated field type (None: accept anything)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            c = _checker_for(inner[0])
            return None if c is None else (Optional(c) if type(None) in args else c)
        return None
    if tp is bool:
        return Bool()
    if tp is int:
        return Int()
    if tp is float:
        return Float()
    if tp is str:
        return Str()
    if origin is tuple and args:
        c = _checker_for(args[0])
        return List(c) if c is not None else List(lambda v, w: v)
    return None


def check_step_fields(cls: type, d: Mapping[str, Any], method: str, *, exclude: tuple[str, ...] = ("name",),
                      where: str = "") -> None:
    """Check a step table against dataclass ``cls``: unknown keys, annotated types, known value ranges."""
    hints = typing.get_type_hints(cls)
    allowed = {f.name for f in dataclasses.fields(cls) if f.init} - set(exclude)
    for k in d:
        if not isinstance(k, str) or k not in allowed:
            raise SchemaError(_join(where, str(k)), f"one of the keys {sorted(allowed)}", f"unknown {method!r} key {k!r}")
    for k, v in d.items():
        typed = _checker_for(hints.get(k, Any))
        if typed is not None:
            typed(v, _join(where, k))
        rng = _FIELD_RANGES.get(k)
        if rng is not None and v is not None:
            if isinstance(v, (list, tuple)):
                continue
            rng(v, _join(where, k))
        if k in ("alphas",) and isinstance(v, (list, tuple)):
            for i, a in enumerate(v):
                Float(0.0, 1.0)(a, f"{_join(where, k)}[{i}]")


def _validate_step(d: Any, where: str, step_types: Mapping[str, type]) -> dict[str, Any]:
    if not isinstance(d, Mapping):
        raise SchemaError(where, "a step table with a 'method' key", _show(d))
    if "method" not in d:
        raise SchemaError(_join(where, "method"), f"one of {sorted(step_types)} (required key 'method')", "nothing")
    method = d["method"]
    if not isinstance(method, str) or method not in step_types:
        raise SchemaError(_join(where, "method"), f"one of {sorted(step_types)}", f"unknown step method {method!r}")
    rest = {k: v for k, v in d.items() if k != "method"}
    if method == "rtn":
        Table({"rules": List(lambda v, w: v, nonempty=True, what="a list of rule tables")},
              required=("rules",), what="an rtn step", kind="'rtn'")(rest, where)
        for i, r in enumerate(rest["rules"]):
            validate_rule_dict(r, f"{where}.rules[{i}]")
        return dict(d)
    cls = step_types[method]
    if dataclasses.is_dataclass(cls):
        check_step_fields(cls, rest, method, exclude=(), where=where)
    return dict(d)


RECIPE_FIELDS = ("name", "description", "steps", "kv")


def validate_recipe_dict(d: Any, source: str | None, step_types: Mapping[str, type]) -> dict[str, Any]:
    """Check a whole recipe dict (``{name, description?, steps, kv?}``); SchemaError names the key path.

    ``source`` (a file name) is put into the message; ``step_types`` maps each step ``method`` to its
    class (:data:`eqjax.recipes.registry.STEP_TYPES`): dataclass steps are checked field by field.
    """
    try:
        top = Table({"name": Str(nonempty=True), "description": Str(), "steps": lambda v, w: v,
                     "kv": lambda v, w: v}, required=("name", "steps"), what="a recipe table", kind="recipe")(d, "")
        steps = top["steps"]
        if not isinstance(steps, (list, tuple)):
            raise SchemaError("steps", "a list of step tables ([[steps]] in TOML, a JSON array)", _show(steps))
        for i, s in enumerate(steps):
            _validate_step(s, f"steps[{i}]", step_types)
        if top.get("kv") is not None:
            validate_kv_dict(top["kv"], "kv")
    except SchemaError as e:
        raise (e.with_source(source) if source else e) from None
    return dict(d)


def step_kwargs(
    cls: type, d: Mapping[str, Any], method: str, *, exclude: tuple[str, ...] = ("name",),
    tuples: tuple[str, ...] = (),
) -> dict[str, Any]:
    """A step dataclass's keyword arguments from a recipe-file table, checked against its fields.

    Unknown keys, values of the wrong type (no coercion: ``bits = 4.7`` or ``symmetric = "false"`` is
    refused) and out-of-range values raise :class:`~eqjax.recipes.schema.SchemaError` naming the key;
    ``tuples`` are list-valued fields converted to tuples (steps must stay hashable).
    """

    check_step_fields(cls, d, method, exclude=exclude)
    return {k: (tuple(v) if k in tuples else v) for k, v in d.items()}
