"""Typed validation of recipe dictionaries (TOML/JSON recipe files) and of param trees before quantization.

Recipe dicts are checked against a schema *without coercion*: a bool must be a bool (``symmetric =
"false"`` is refused, not read as True), an int must be an int (``bits = 4.7`` is refused, not run as
4-bit), a float may be given as an int; unknown keys are refused and keys that contradict each other
(``skip = true`` with ``bits``, ``group_size`` without ``granularity = "group"``, ``percentile`` with
another calibrator, ...) are refused. Every error is a :class:`SchemaError` (a
:class:`~eqjax.recipe.RecipeError` and a :class:`~eqjax.rules.RuleError`) whose message names the key
path (``steps[0].rules[1].bits``), the expected type/range and the value found.

Step tables of dataclass steps (``gptq``, ``awq``, ``smoothquant``, ``zeroquant_lkd``) are checked
against the dataclass's annotated field types (:func:`check_step_fields`), so new fields are covered
without editing this file.

:func:`check_params` and :func:`check_recipe_fits` check a param tree before (and after) a recipe runs:
non-finite or non-float parameters are named with their path and first bad index, and a group size
larger than every axis it groups is reported.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any, Callable, Mapping

import numpy as np

from eqjax.errors import CompatibilityError, NonFiniteError
from eqjax.recipe import RecipeError
from eqjax.rules import RuleError

__all__ = [
    "SchemaError", "NonFiniteParamsError", "validate_recipe_dict", "validate_rule_dict", "validate_kv_dict", "check_step_fields",
    "check_params", "check_recipe_fits", "RULE_KEYS",
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


class NonFiniteParamsError(RecipeError, NonFiniteError):
    """A param given to :func:`eqjax.quantize` holds NaN/Inf: a RecipeError (the recipe cannot run on
    these params) and a :class:`~eqjax.errors.NonFiniteError`."""


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
        ok = (_is_int(v) or isinstance(v, float)) and math.isfinite(float(v))
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


def _step_schema_class(method: str) -> type | None:
    import importlib

    from eqjax.recipe import STEP_TYPES

    module, _, name = STEP_TYPES[method].partition(":")
    cls = getattr(importlib.import_module(module), name)
    return cls if dataclasses.is_dataclass(cls) else None


def _validate_step(d: Any, where: str) -> dict[str, Any]:
    from eqjax.recipe import STEP_TYPES

    if not isinstance(d, Mapping):
        raise SchemaError(where, "a step table with a 'method' key", _show(d))
    if "method" not in d:
        raise SchemaError(_join(where, "method"), f"one of {sorted(STEP_TYPES)} (required key 'method')", "nothing")
    method = d["method"]
    if not isinstance(method, str) or method not in STEP_TYPES:
        raise SchemaError(_join(where, "method"), f"one of {sorted(STEP_TYPES)}", f"unknown step method {method!r}")
    rest = {k: v for k, v in d.items() if k != "method"}
    if method == "rtn":
        Table({"rules": List(lambda v, w: v, nonempty=True, what="a list of rule tables")},
              required=("rules",), what="an rtn step", kind="'rtn'")(rest, where)
        for i, r in enumerate(rest["rules"]):
            validate_rule_dict(r, f"{where}.rules[{i}]")
        return dict(d)
    cls = _step_schema_class(method)
    if cls is not None:
        check_step_fields(cls, rest, method, exclude=(), where=where)
    return dict(d)


RECIPE_FIELDS = ("name", "description", "steps", "kv")


def validate_recipe_dict(d: Any, source: str | None = None) -> dict[str, Any]:
    """Check a whole recipe dict (``{name, description?, steps, kv?}``); SchemaError names the key path.

    ``source`` (a file name) is put into the message.
    """
    try:
        top = Table({"name": Str(nonempty=True), "description": Str(), "steps": lambda v, w: v,
                     "kv": lambda v, w: v}, required=("name", "steps"), what="a recipe table", kind="recipe")(d, "")
        steps = top["steps"]
        if not isinstance(steps, (list, tuple)):
            raise SchemaError("steps", "a list of step tables ([[steps]] in TOML, a JSON array)", _show(steps))
        for i, s in enumerate(steps):
            _validate_step(s, f"steps[{i}]")
        if top.get("kv") is not None:
            validate_kv_dict(top["kv"], "kv")
    except SchemaError as e:
        raise (e.with_source(source) if source else e) from None
    return dict(d)


# ------------------------------------------------------------------------------------ param trees
def _np(x: Any) -> np.ndarray:
    """Host copy of a leaf; a global array spanning other processes' devices is read from this
    process's replica, or gathered (a collective: every process checks the same tree)."""
    if getattr(x, "is_fully_addressable", True) is False:
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils  # noqa: PLC0415

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _first_bad(a: np.ndarray) -> tuple[int, tuple[int, ...]] | None:
    if a.dtype.kind not in "fc" and a.dtype.name != "bfloat16":
        return None
    f = a.astype(np.float32) if a.dtype.name == "bfloat16" else a
    bad = ~np.isfinite(f)
    if not bad.any():
        return None
    return int(bad.sum()), tuple(int(i) for i in np.argwhere(bad)[0])


def check_params(params: Any, source: str = "params", *, allow_int: bool = False,
                 nonfinite: type[NonFiniteError] = NonFiniteError) -> None:
    """Raise naming ``source``, the param path and the first bad index if a float leaf holds NaN/Inf,
    a quantized leaf has a non-finite scale, or (unless ``allow_int``) a plain leaf is not floating-point.

    Concrete arrays only (a no-op for tracers). ``nonfinite``: the error class for NaN/Inf (a subclass
    of :class:`~eqjax.errors.NonFiniteError`).
    """
    import jax

    from eqjax.linear import ActQuantKernel
    from eqjax.pytree import flatten
    from eqjax.qarray import HalfFloat, QArray

    for path, leaf in flatten(params):
        if leaf is None:
            continue
        parts: list[tuple[str, Any]]
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


def check_recipe_fits(recipe: Any, params: Any) -> list[str]:
    """Warn (logging, and returned) when a group size exceeds the grouped axis of *every* parameter its
    rule or step matches: each is then one (short) group, i.e. per channel, which is almost never what
    the recipe meant. A group larger than only some axes is the documented short-last-group layout.
    Absurd group sizes are refused earlier by the schema (``group_size`` in 1..65536)."""
    import logging

    from eqjax.pytree import flatten
    from eqjax.qarray import is_quantized
    from eqjax.rules import assign

    log = logging.getLogger("eqjax")
    leaves = {p: x for p, x in flatten(params) if not is_quantized(x) and hasattr(x, "shape")}
    notes: list[str] = []
    for i, step in enumerate(getattr(recipe, "steps", ())):
        name = getattr(step, "name", type(step).__name__)
        rules = getattr(step, "rules", None)
        groups: dict[str, tuple[int, list[int]]] = {}  # what -> (group size, grouped axis sizes)
        if isinstance(rules, tuple) and rules and all(hasattr(r, "pattern") for r in rules):
            try:
                chosen, _ = assign(params, rules)
            except Exception:  # noqa: BLE001 - rules that need the model's call: the step itself reports
                chosen = {}
            for path, rule in chosen.items():
                g = getattr(getattr(rule, "weight", None), "granularity", None)
                if path not in leaves or g is None or getattr(g, "kind", None) != "group" or not getattr(g, "axes", None):
                    continue
                shape = tuple(leaves[path].shape)
                ax = g.axes[0] + len(shape) if g.axes[0] < 0 else g.axes[0]
                if 0 <= ax < len(shape):
                    groups.setdefault(f"rule {rule.pattern!r}", (g.group_size, []))[1].append(shape[ax])
        else:
            gs = getattr(step, "group_size", None)
            if _is_int(gs) and gs > 0:
                pattern = getattr(step, "pattern", r".*/kernel")
                for path, x in leaves.items():
                    if len(x.shape) == 2 and re.fullmatch(pattern, path):
                        groups.setdefault(f"group_size of step {name!r}", (gs, []))[1].append(int(x.shape[0]))
        for what, (gs, sizes) in groups.items():
            if sizes and gs > max(sizes):
                msg = (f"recipe {recipe.name!r} step {i} {name!r}: {what} groups {gs} values but the largest grouped "
                       f"axis it matches has {max(sizes)}: every matched parameter is one group (per channel)")
                log.warning(msg)
                notes.append(msg)
    return notes
