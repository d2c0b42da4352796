"""Could pydantic replace eqjax's hand-rolled recipe checkers? A measurement, not a migration.

The recipe / rule / kv / step-table checks of :mod:`eqjax.recipes.schema` (``Int``, ``Float``, ``Str``, ``Table``,
``validate_rule_dict``, ``validate_kv_dict``, ``validate_recipe_dict``, ``check_step_fields``) are ported
here to pydantic v2 models (strict mode, ``extra="forbid"``, validators for the conflicting keys, step
tables derived from the step dataclasses' annotations like ``check_step_fields`` does, and a formatter
turning a ``ValidationError`` into eqjax's one-line message). The port lives in this script only.

Measured:

* lines of code (non-blank, non-comment, docstrings excluded, imports excluded) of the hand-rolled
  checkers, by top-level name with ``ast``, against the port including its error formatter;
* a corpus of bad recipe dicts (from tests/recipes/test_rules_recipes.py, tests/robustness/robustness_cases.py,
  tests/robustness/test_fuzz_recipes.py, plus cases covering each checker) and of valid ones (every
  built-in recipe in dict form, the TOML examples of docs/ and tests/): accepted or refused by each, both
  messages, and whether they name the same key path, allowed values and found value;
* seeded random mutants of the valid dicts (one value replaced, one key added or removed), the same way;
* the time of both validators on the valid corpus (and on the bad one, message included), median of repeats.

    python bench/validators.py [--repeats 21] [--mutants 400] [--out bench/results/validators]

Writes ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import datetime
import io
import json
import math
import os
import pathlib
import platform
import random
import re
import statistics
import sys
import time
import tokenize
import tomllib
import types
import typing
from typing import Annotated, Any, Callable, ClassVar, Literal, Mapping, Union

ROOT = pathlib.Path(__file__).resolve().parents[1]
# this script's directory holds bench/onnx.py, which would shadow the onnx package
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_IMPORT_T0 = time.perf_counter()
import pydantic  # noqa: E402
from pydantic import (  # noqa: E402
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    WrapValidator,
    create_model,
    model_validator,
)
from pydantic_core import ErrorDetails, InitErrorDetails, PydanticCustomError  # noqa: E402

PYDANTIC_IMPORT_SECONDS = time.perf_counter() - _IMPORT_T0

from eqjax.recipes.registry import STEP_TYPES  # noqa: E402
from eqjax.recipes.schema import SchemaError, validate_recipe_dict  # noqa: E402

SCHEMA_PY = ROOT / "eqjax" / "recipes" / "schema.py"
HAND_ROLLED = (
    "_show", "Checker", "_is_int", "Int", "Float", "Bool", "Str", "Regex", "Optional", "List", "Table", "_join",
    "_conflict", "GRANULARITIES", "RULE_FIELDS", "RULE_KEYS", "_QUANT_KEYS", "validate_rule_dict", "KV_FIELDS",
    "validate_kv_dict", "_FIELD_RANGES", "_checker_for", "check_step_fields", "_validate_step",
    "RECIPE_FIELDS", "validate_recipe_dict",
)
"""The checkers of eqjax/recipes/schema.py (``SchemaError`` itself is kept by either design and counted by neither)."""

_PORT_T0 = time.perf_counter()
# >>> pydantic port
_MSG = "expected {expected}, found {found}"


def _show(v: Any) -> str:
    """``found`` part of a message: the type and a short repr."""
    if v is None:
        return "null"
    r = repr(v)
    if len(r) > 60:
        r = r[:57] + "..."
    return f"{type(v).__name__} {r}"


def _err(loc: tuple[Any, ...], value: Any, expected: str, found: str | None = None, **ctx: Any) -> InitErrorDetails:
    """An error in eqjax's words (``rank``: 0 unknown key, 1 missing key, else a value; ``key``: appended to the path)."""
    ctx = {"expected": expected, "found": _show(value) if found is None else found, **ctx}
    return {"type": PydanticCustomError("eqjax", _MSG, ctx), "loc": loc, "input": value}


def _keep(x: ErrorDetails) -> InitErrorDetails:
    if x["type"] == "eqjax":
        return {"type": PydanticCustomError("eqjax", _MSG, x["ctx"]), "loc": x["loc"], "input": x["input"]}
    return {k: x[k] for k in ("type", "loc", "input", "ctx") if k in x}  # type: ignore[return-value]


def _relabelled(v: Any, handler: Callable[[Any], Any], relabel: Callable[[ErrorDetails], InitErrorDetails | None]) -> Any:
    """``handler(v)``, its errors re-raised with those ``relabel`` rewrites rewritten."""
    try:
        return handler(v)
    except ValidationError as e:
        errors = [relabel(x) or _keep(x) for x in e.errors(include_url=False)]
        raise ValidationError.from_exception_data(e.title, errors) from None


def _expect(expected: str, **by_type: str) -> WrapValidator:
    """Name what is allowed for this value's own errors (not its items'); ``by_type``: per pydantic error type."""
    def relabel(x: ErrorDetails) -> InitErrorDetails | None:
        if x["loc"] or x["type"] == "eqjax":
            return None
        empty = "an empty list" if x["type"] == "too_short" else None
        return _err((), x["input"], by_type.get(x["type"], expected), empty)

    return WrapValidator(lambda v, handler: _relabelled(v, handler, relabel))


def Int(lo: int | None = None, hi: int | None = None) -> Any:
    rng = "" if lo is None and hi is None else (
        f" in {lo}..{hi}" if lo is not None and hi is not None else (f" >= {lo}" if lo is not None else f" <= {hi}"))
    return Annotated[int, Field(strict=True, ge=lo, le=hi), _expect(f"an integer{rng}")]


def Float(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False) -> Any:
    parts = []
    if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {lo}")
    if hi is not None:
        parts.append(f"{'<' if hi_open else '<='} {hi}")
    rng = (" " + " and ".join(parts)) if parts else ""
    bounds = {"gt" if lo_open else "ge": lo, "lt" if hi_open else "le": hi}
    return Annotated[float, Field(strict=True, allow_inf_nan=False, **bounds), _expect(f"a finite number{rng}")]


def Bool() -> Any:
    return Annotated[bool, Field(strict=True), _expect("true or false (a boolean, not a string or number)")]


def Str(choices: tuple[str, ...] | None = None, *, nonempty: bool = False) -> Any:
    if choices is not None:
        return Annotated[Literal[choices], _expect(f"one of {list(choices)}")]
    if nonempty:
        return Annotated[str, Field(strict=True, pattern=r"\S"), _expect("a string", string_pattern_mismatch="a non-empty string")]
    return Annotated[str, Field(strict=True), _expect("a string")]


def _compiles(v: str) -> str:
    try:
        re.compile(v)
    except Exception as e:  # noqa: BLE001 - re.error, OverflowError, RecursionError on hostile patterns
        raise PydanticCustomError("eqjax", _MSG, {"expected": "a regular expression that compiles",
                                                  "found": f"{_show(v)}, which does not compile ({type(e).__name__}: {e})"})
    return v


Regex = Annotated[str, Field(strict=True), AfterValidator(_compiles), _expect("a regular expression string")]


def List(inner: Any, *, nonempty: bool = False, what: str = "a list") -> Any:
    return Annotated[list[inner], BeforeValidator(lambda v: list(v) if isinstance(v, tuple) else v),
                     Field(min_length=1 if nonempty else None), _expect(what, too_short=f"a non-empty {what.removeprefix('a ')}")]


def _conflict(key: str, expected: str, found: str) -> PydanticCustomError:
    return PydanticCustomError("eqjax", _MSG, {"expected": expected, "found": found, "key": key})


class _Table(BaseModel):
    """A table: strict values, unknown keys refused; its own errors (not a table, unknown or missing key) relabelled.

    A field defaulting to None is a key that may be absent: pydantic does not validate defaults, and a given None is
    checked like any value."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    what: ClassVar[str] = "a table"
    kind: ClassVar[str] = ""

    @model_validator(mode="wrap")
    @classmethod
    def _key_errors(cls, data: Any, handler: Callable[[Any], Any]) -> Any:
        keys = sorted(k for k in cls.model_fields if k != "method")

        def relabel(x: ErrorDetails) -> InitErrorDetails | None:
            t, loc = x["type"], x["loc"]
            if t == "model_type" and not loc:
                return _err(loc, data, f"{cls.what} (key = value pairs)")
            if t == "extra_forbidden" and len(loc) == 1:
                return _err(loc, x["input"], f"one of the keys {keys}", f"unknown {cls.kind + ' ' if cls.kind else ''}key {loc[0]!r}", rank=0)
            if t == "missing" and len(loc) == 1:
                return _err(loc, None, f"a value (required key {loc[0]!r})", "nothing", rank=1)
            if t == "invalid_key":
                return _err(loc[:-1], loc[-1], "string keys", rank=0)
            return None

        return _relabelled(data, handler, relabel)


GRANULARITIES = ("tensor", "channel", "group")
_QUANT_KEYS = ("bits", "symmetric", "granularity", "axis", "group_size", "calibrator", "percentile", "scale_dtype",
               "act_bits", "act_granularity", "full_range")


class RuleTable(_Table):
    what: ClassVar[str] = "a rule table"
    kind: ClassVar[str] = "rule"
    pattern: Regex
    skip: Bool() = False
    bits: Int(2, 8) = 8
    symmetric: Bool() = True
    granularity: Str(GRANULARITIES) = "channel"
    axis: Int(-64, 63) = None
    group_size: Int(1, 65536) = None
    calibrator: Str(("absmax", "minmax", "percentile", "mse")) = "minmax"
    percentile: Float(50.0, 100.0, lo_open=True) = None
    scale_dtype: Str(("float32", "float16", "bfloat16")) = "float32"
    act_bits: Int(2, 8) = None
    act_granularity: Str(("token", "tensor")) = "token"
    role: Str(("matmul", "embedding", "any")) = "any"
    full_range: Bool() = False

    @model_validator(mode="after")
    def _conflicts(self) -> RuleTable:
        given = self.model_fields_set
        if self.skip:
            extra = [k for k in _QUANT_KEYS if k in given]
            if extra:
                raise _conflict(extra[0], "no quantization keys in a rule with skip = true",
                                f"{extra[0]} = {getattr(self, extra[0])!r} (conflicts with skip = true)")
            return self
        kind = self.granularity
        if kind == "group" and "group_size" not in given:
            raise _conflict("group_size", "a group size (granularity = 'group' needs one)", "nothing")
        if kind != "group" and "group_size" in given:
            raise _conflict("group_size", "granularity = 'group' (group_size only applies to groups)",
                            f"granularity {kind!r}" + ("" if "granularity" in given else " (the default)"))
        if kind == "tensor" and "axis" in given:
            raise _conflict("axis", "no axis with granularity = 'tensor'", f"axis = {self.axis!r}")
        if "percentile" in given and self.calibrator != "percentile":
            raise _conflict("percentile", "calibrator = 'percentile' (percentile only applies to it)",
                            f"calibrator {self.calibrator!r}")
        if "act_granularity" in given and "act_bits" not in given:
            raise _conflict("act_granularity", "act_bits as well (activations are only quantized with act_bits)",
                            "act_granularity without act_bits")
        return self


_LEVELS = List(Float(0.0, 1.0), nonempty=True, what="a list of levels in [0, 1]")


class KVTable(_Table):
    what: ClassVar[str] = "a kv table"
    kind: ClassVar[str] = "kv"
    bits: Int(2, 8) = None
    key_bits: Int(2, 8) = None
    value_bits: Int(2, 8) = None
    outlier_fraction: Float(0.0, 0.5, hi_open=True) = None
    sink_tokens: Int(0, 1 << 20) = None
    key_group: Int(1, 1 << 20) | None = None
    value_group: Int(1, 1 << 20) | None = None
    key_levels: _LEVELS | None = None
    value_levels: _LEVELS | None = None
    recent_float: Bool() = None

    @model_validator(mode="after")
    def _conflicts(self) -> KVTable:
        given = self.model_fields_set
        if "bits" in given and ("key_bits" in given or "value_bits" in given):
            k = "key_bits" if "key_bits" in given else "value_bits"
            raise _conflict(k, "either bits or key_bits/value_bits", f"both bits = {self.bits} and {k} = {getattr(self, k)}")
        return self


class RTNTable(_Table):
    what: ClassVar[str] = "an rtn step"
    kind: ClassVar[str] = "'rtn'"
    method: Literal["rtn"]
    rules: List(RuleTable, nonempty=True, what="a list of rule tables")


# value ranges for fields of dataclass steps, by name (types come from the annotations)
_FIELD_RANGES: dict[str, Any] = {
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
    "alphas": List(Float(0.0, 1.0)),
    "percdamp": Float(0.0, 10.0, lo_open=True),
    "lr": Float(0.0, 10.0, lo_open=True),
    "max_shrink": Float(0.0, 1.0, hi_open=True),
    "sink_weight": Float(0.0, None),
    "scale_dtype": Str(("float32", "float16", "bfloat16")),
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
    "pattern": Regex,
    "name": Str(nonempty=True),
}

_TYPED = {bool: Bool(), int: Int(), float: Float(), str: Str()}


def _typed(tp: Any) -> Any:
    """The type checked for an annotated field type (Any: anything)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        t = _typed(inner[0]) if len(inner) == 1 else Any
        return t | None if t is not Any and type(None) in args else t
    if typing.get_origin(tp) is tuple and args:
        return List(_typed(args[0]))
    return _TYPED.get(tp, Any)


def _step_field(name: str, hint: Any) -> Any:
    """The annotated type, then (a non-None value as given) the known range of a field of that name."""
    typed, rng = _typed(hint), _FIELD_RANGES.get(name)
    if rng is None:
        return typed
    check = TypeAdapter(rng).validate_python

    def typed_then_range(v: Any, handler: Callable[[Any], Any]) -> Any:
        out = handler(v)
        if v is not None:
            check(v)
        return out

    return Annotated[typed, WrapValidator(typed_then_range)]


def _step_table(method: str) -> type[BaseModel]:
    cls = STEP_TYPES[method]
    name = cls.__name__
    if not dataclasses.is_dataclass(cls):
        return create_model(f"{name}Table", __config__=ConfigDict(extra="allow"), method=(Literal[method], ...))
    hints = typing.get_type_hints(cls)
    fields = {f.name: (_step_field(f.name, hints.get(f.name, Any)), None) for f in dataclasses.fields(cls) if f.init}
    model = create_model(f"{name}Table", __base__=_Table, method=(Literal[method], ...), **fields)
    model.kind = repr(method)
    return model


def _step_errors(v: Any, handler: Callable[[Any], Any]) -> Any:
    """A step's errors in eqjax's words (not a table, no or an unknown method), the method tag left out of paths."""
    methods = sorted(STEP_TYPES)

    def relabel(x: ErrorDetails) -> InitErrorDetails | None:
        t, loc = x["type"], x["loc"]
        if t == "model_attributes_type":
            return _err(loc, v, "a step table with a 'method' key")
        if t == "union_tag_not_found":
            return _err(("method",), None, f"one of {methods} (required key 'method')", "nothing", rank=1)
        if t == "union_tag_invalid":
            return _err(("method",), v["method"], f"one of {methods}", f"unknown step method {v['method']!r}")
        if loc and loc[0] == v.get("method"):
            return {**_keep(x), "loc": loc[1:]}
        return None

    return _relabelled(v, handler, relabel)


_STEP = Annotated[Union[tuple([RTNTable] + [_step_table(m) for m in STEP_TYPES if m != "rtn"])],
                  Field(discriminator="method"), WrapValidator(_step_errors)]


class RecipeTable(_Table):
    what: ClassVar[str] = "a recipe table"
    kind: ClassVar[str] = "recipe"
    name: Str(nonempty=True)
    description: Str() = ""
    steps: List(_STEP, what="a list of step tables ([[steps]] in TOML, a JSON array)")
    kv: KVTable | None = None


def first_error(e: ValidationError, data: Any) -> tuple[str, str, str]:
    """``(key path, expected, found)`` of the error eqjax reports first: in each table of ``data`` its unknown keys
    (by name), then its missing keys, then its values in the table's order."""
    def order(x: ErrorDetails) -> list[tuple[int, Any]]:
        loc, rank, node, key = x["loc"], (x.get("ctx") or {}).get("rank", 2), data, []
        for n, p in enumerate(loc):
            if rank < 2 and n == len(loc) - 1:
                key.append((rank, str(p)))
            else:
                key.append((2, list(node).index(p) if isinstance(node, Mapping) else p))
                node = node[p]
        return key

    x = min(e.errors(include_url=False), key=order)
    ctx = x.get("ctx") or {}
    where = ""
    for p in x["loc"] + ((ctx["key"],) if "key" in ctx else ()):
        where += f"[{p}]" if isinstance(p, int) else (f".{p}" if where else str(p))
    return where, ctx.get("expected", x["msg"]), ctx.get("found", _show(x["input"]))


def pydantic_check(d: Any, source: str | None = None) -> str | None:
    """None if ``d`` is a valid recipe dict, else eqjax's one-line message."""
    try:
        RecipeTable.model_validate(d)
    except ValidationError as e:
        where, expected, found = first_error(e, d)
        loc = f"{source}: {where or 'top level'}" if source else (where or "top level")
        return f"invalid recipe value ({loc}): {_MSG.format(expected=expected, found=found)}"
    return None
# <<< pydantic port
PORT_SECONDS = time.perf_counter() - _PORT_T0

SOURCE = "recipe.toml"


# ------------------------------------------------------------------------------------ lines of code
def code_lines(path: pathlib.Path, names: tuple[str, ...] | None = None, between: tuple[str, str] | None = None
               ) -> dict[str, int]:
    """Non-blank, non-comment, non-docstring lines of each top-level function / class / assignment of ``path``:
    those named ``names``, or every one between the two marker comments ``between``; imports are not counted."""
    src = path.read_text(encoding="utf-8")
    tree = ast.parse(src)
    code: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
            tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in skip:
            code.update(range(tok.start[0], tok.end[0] + 1))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body and \
                isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            code.difference_update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = src.splitlines()
    lo = hi = 0
    if between is not None:
        lo = next(i for i, line in enumerate(lines, 1) if line.strip() == between[0])
        hi = next(i for i, line in enumerate(lines, 1) if line.strip() == between[1])
    out: dict[str, int] = {}
    for i, node in enumerate(tree.body):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            name = node.name
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name = node.target.id
        else:
            continue
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        if names is not None and name not in names or between is not None and not lo < start < hi:
            continue
        out[name] = len([n for n in range(start, node.end_lineno + 1) if n in code])
    return out


# ------------------------------------------------------------------------------------ corpora
def _rtn(**rule: Any) -> dict[str, Any]:
    return {"name": "r", "steps": [{"method": "rtn", "rules": [{"pattern": ".*/kernel", **rule}]}]}


def _step(method: str, **keys: Any) -> dict[str, Any]:
    return {"name": "r", "steps": [{"method": method, **keys}]}


def _kv(**kv: Any) -> dict[str, Any]:
    return {"name": "r", "steps": [], "kv": kv}


T_RULES = "tests/recipes/test_rules_recipes.py"
T_ROBUST = "tests/robustness/robustness_cases.py"
T_FUZZ = "tests/robustness/test_fuzz_recipes.py"
OWN = "this script"


def bad_corpus() -> list[tuple[str, str, str, Any]]:
    """``(case, group, origin, dict)`` for dicts that eqjax refuses (or should)."""
    nan, inf = float("nan"), float("inf")
    c: list[tuple[str, str, str, Any]] = [
        # ---- from the tests
        ("rule symmetric = \"false\"", "wrong type", T_RULES, _rtn(symmetric="false")),
        ("rule bits = 4.7", "wrong type", T_RULES, _rtn(bits=4.7)),
        ("rule bits = true", "bool for int", T_RULES, _rtn(bits=True)),
        ("rule granularity group without group_size", "conflict", T_RULES, _rtn(granularity="group")),
        ("rule group_size = 0", "out of range", T_RULES, _rtn(granularity="group", group_size=0)),
        ("rule skip = true with bits", "conflict", T_RULES, _rtn(skip=True, bits=4)),
        ("rule unknown key colour", "unknown key", T_RULES, _rtn(colour=1)),
        ("rule role = \"norm\"", "out of range", T_RULES, _rtn(role="norm")),
        ("rule tensor granularity with axis", "conflict", T_RULES, _rtn(granularity="tensor", axis=0)),
        ("step method = \"nope\"", "unknown key", T_RULES, _step("nope")),
        ("rule pattern \"((\" does not compile", "out of range", T_RULES, {**_rtn(), "steps": [{"method": "rtn", "rules": [{"pattern": "(("}]}]}),
        ("steps = 5", "wrong type", T_ROBUST, {"name": "r", "steps": 5}),
        ("rule unknown key bitz", "unknown key", T_ROBUST, _rtn(bitz=4)),
        ("rule group_size without granularity group", "conflict", T_ROBUST, _rtn(group_size=32)),
        ("rule group_size = 100000", "out of range", T_ROBUST, _rtn(granularity="group", group_size=100000)),
        ("rule percentile with the minmax calibrator", "conflict", T_ROBUST, _rtn(percentile=99.0)),
        ("empty file (no name, no steps)", "missing key", T_ROBUST, {}),
        ("kv key_bits = \"4\"", "wrong type", T_ROBUST, _kv(key_bits="4")),
        ("gptq bits = 3.0", "wrong type", T_ROBUST, _step("gptq", bits=3.0)),
        ("smoothquant alpha = true", "bool for int", T_FUZZ, _step("smoothquant", alpha=True)),
        ("smoothquant alpha = \"0.5\"", "wrong type", T_FUZZ, _step("smoothquant", alpha="0.5")),
        ("smoothquant alpha = NaN", "NaN / Inf", T_FUZZ, _step("smoothquant", alpha=nan)),
        # ---- top level
        ("no name", "missing key", OWN, {"steps": []}),
        ("no steps", "missing key", OWN, {"name": "r"}),
        ("name = \"\"", "out of range", OWN, {"name": "", "steps": []}),
        ("name = \"  \" (blank)", "out of range", OWN, {"name": "  ", "steps": []}),
        ("name = 5", "wrong type", OWN, {"name": 5, "steps": []}),
        ("description = 5", "wrong type", OWN, {"name": "r", "description": 5, "steps": []}),
        ("description = null", "wrong type", OWN, {"name": "r", "description": None, "steps": []}),
        ("unknown top-level key", "unknown key", OWN, {"name": "r", "steps": [], "author": "me"}),
        ("top level a list", "wrong type", OWN, [{"name": "r"}]),
        ("steps a table", "wrong type", OWN, {"name": "r", "steps": {"method": "rtn"}}),
        # ---- steps
        ("step = 5", "wrong type", OWN, {"name": "r", "steps": [5]}),
        ("step without method", "missing key", OWN, {"name": "r", "steps": [{"bits": 4}]}),
        ("method = 5", "wrong type", OWN, _step(5)),  # type: ignore[arg-type]
        ("method = [\"rtn\"]", "nested list", OWN, {"name": "r", "steps": [{"method": ["rtn"]}]}),
        ("rtn step without rules", "missing key", OWN, _step("rtn")),
        ("rtn rules = []", "out of range", OWN, _step("rtn", rules=[])),
        ("rtn rules = \"x\"", "wrong type", OWN, _step("rtn", rules="x")),
        ("rtn step with a name", "unknown key", OWN, _step("rtn", rules=[{"pattern": ".*"}], name="mine")),
        ("rule a string", "wrong type", OWN, _step("rtn", rules=["bits = 4"])),
        ("rule without pattern", "missing key", OWN, _step("rtn", rules=[{"bits": 4}])),
        ("rule with a non-string key", "wrong type", OWN, _step("rtn", rules=[{"pattern": ".*", 5: 1}])),
        # ---- rule values
        ("rule pattern = 5", "wrong type", OWN, _step("rtn", rules=[{"pattern": 5}])),
        ("rule axis = 100", "out of range", OWN, _rtn(axis=100)),
        ("rule axis = \"0\"", "wrong type", OWN, _rtn(axis="0")),
        ("rule granularity = \"row\"", "out of range", OWN, _rtn(granularity="row")),
        ("rule granularity = 1", "wrong type", OWN, _rtn(granularity=1)),
        ("rule calibrator = \"best\"", "out of range", OWN, _rtn(calibrator="best")),
        ("rule percentile = 50 (open bound)", "out of range", OWN, _rtn(calibrator="percentile", percentile=50)),
        ("rule percentile = 100.5", "out of range", OWN, _rtn(calibrator="percentile", percentile=100.5)),
        ("rule percentile = NaN", "NaN / Inf", OWN, _rtn(calibrator="percentile", percentile=nan)),
        ("rule percentile = Inf", "NaN / Inf", OWN, _rtn(calibrator="percentile", percentile=inf)),
        ("rule percentile = true", "bool for int", OWN, _rtn(calibrator="percentile", percentile=True)),
        ("rule percentile = a 400-digit integer (JSON)", "out of range", OWN, _rtn(calibrator="percentile", percentile=10**400)),
        ("rule scale_dtype = \"float64\"", "out of range", OWN, _rtn(scale_dtype="float64")),
        ("rule act_bits = 9", "out of range", OWN, _rtn(act_bits=9)),
        ("rule act_bits = 8.0", "wrong type", OWN, _rtn(act_bits=8.0)),
        ("rule act_bits = [8]", "nested list", OWN, _rtn(act_bits=[8])),
        ("rule act_granularity without act_bits", "conflict", OWN, _rtn(act_granularity="tensor")),
        ("rule act_granularity = \"channel\"", "out of range", OWN, _rtn(act_bits=8, act_granularity="channel")),
        ("rule full_range = \"yes\"", "wrong type", OWN, _rtn(full_range="yes")),
        ("rule full_range = 1", "bool for int", OWN, _rtn(full_range=1)),
        ("rule skip = \"true\"", "wrong type", OWN, _rtn(skip="true")),
        ("rule skip = true with granularity and group_size", "conflict", OWN, _rtn(skip=True, granularity="group", group_size=8)),
        ("rule bits = 10**20", "out of range", OWN, _rtn(bits=10**20)),
        ("rule bits = -4", "out of range", OWN, _rtn(bits=-4)),
        ("rule bits = null", "wrong type", OWN, _rtn(bits=None)),
        # ---- kv
        ("kv bits with key_bits", "conflict", OWN, _kv(bits=8, key_bits=4)),
        ("kv unknown key", "unknown key", OWN, _kv(key_bits=4, group=32)),
        ("kv outlier_fraction = 0.5 (open bound)", "out of range", OWN, _kv(outlier_fraction=0.5)),
        ("kv key_levels = []", "out of range", OWN, _kv(key_levels=[])),
        ("kv key_levels = [0.5, 1.5]", "nested list", OWN, _kv(key_levels=[0.5, 1.5])),
        ("kv value_levels = [0.1, NaN]", "NaN / Inf", OWN, _kv(value_levels=[0.1, nan])),
        ("kv key_levels = [[0.5]]", "nested list", OWN, _kv(key_levels=[[0.5]])),
        ("kv key_levels = \"0.5\"", "wrong type", OWN, _kv(key_levels="0.5")),
        ("kv key_group = 0", "out of range", OWN, _kv(key_group=0)),
        ("kv recent_float = 1", "bool for int", OWN, _kv(recent_float=1)),
        ("kv sink_tokens = -1", "out of range", OWN, _kv(sink_tokens=-1)),
        ("kv bits = null", "wrong type", OWN, _kv(bits=None)),
        ("kv = \"int8\"", "wrong type", OWN, {"name": "r", "steps": [], "kv": "int8"}),
        # ---- dataclass steps
        ("gptq percdamp = 0 (open bound)", "out of range", OWN, _step("gptq", percdamp=0)),
        ("gptq unknown key", "unknown key", OWN, _step("gptq", damp=0.1)),
        ("gptq group_size = 0", "out of range", OWN, _step("gptq", group_size=0)),
        ("gptq bits = 9", "out of range", OWN, _step("gptq", bits=9)),
        ("gptq bits = true", "bool for int", OWN, _step("gptq", bits=True)),
        ("gptq scale_dtype = \"float64\"", "out of range", OWN, _step("gptq", scale_dtype="float64")),
        ("gptq scale_dtype = 5", "wrong type", OWN, _step("gptq", scale_dtype=5)),
        ("gptq pattern = 5", "wrong type", OWN, _step("gptq", pattern=5)),
        ("gptq pattern = \"((\"", "out of range", OWN, _step("gptq", pattern="((")),
        ("gptq rules = \"x\"", "wrong type", OWN, _step("gptq", rules="x")),
        ("gptq name = \"\"", "out of range", OWN, _step("gptq", name="")),
        ("gptq two unknown keys, not in alphabetical order", "unknown key", OWN, _step("gptq", zeta=1, alpha=2)),
        ("awq no_clip = \"q_proj\"", "wrong type", OWN, _step("awq", no_clip="q_proj")),
        ("awq no_clip = [\"q_proj\", 1]", "nested list", OWN, _step("awq", no_clip=["q_proj", 1])),
        ("smoothquant alphas = [0.5, 2.0]", "nested list", OWN, _step("smoothquant", alphas=[0.5, 2.0])),
        ("smoothquant alphas = [0.5, \"x\"]", "nested list", OWN, _step("smoothquant", alphas=[0.5, "x"])),
        ("smoothquant alphas = 0.5", "wrong type", OWN, _step("smoothquant", alphas=0.5)),
        ("zeroquant_lkd steps = -1", "out of range", OWN, _step("zeroquant_lkd", steps=-1)),
        ("zeroquant_lkd lr = Inf", "NaN / Inf", OWN, _step("zeroquant_lkd", lr=inf)),
        ("zeroquant_lkd time_budget = 0", "out of range", OWN, _step("zeroquant_lkd", time_budget=0)),
        ("signround optimizer = \"sgd\"", "out of range", OWN, _step("signround", optimizer="sgd")),
        ("signround lr = 0.0 (open bound)", "out of range", OWN, _step("signround", lr=0.0)),
        ("rotation seed = true", "bool for int", OWN, _step("rotation", seed=True)),
        ("rotation then a table", "wrong type", OWN, _step("rotation", then={"method": "rtn"})),
        ("rotation act_bits = 9", "out of range", OWN, _step("rotation", act_bits=9)),
        ("half dtype = 5", "wrong type", OWN, _step("half", dtype=5)),
        ("rtn_search weighting = \"l2\"", "out of range", OWN, _step("rtn_search", weighting="l2")),
        # ---- several errors at once: the first is reported
        ("unknown top-level key and no name", "several", OWN, {"steps": [], "zz": 1}),
        ("rule symmetric and bits both bad (symmetric first in the table)", "several", OWN, _rtn(symmetric="x", bits=9)),
        ("rules[0] conflict and rules[1] bad bits", "several", OWN,
         _step("rtn", rules=[{"pattern": ".*", "skip": True, "bits": 4}, {"pattern": ".*", "bits": 9}])),
        ("bad step then bad kv", "several", OWN, {"name": "r", "steps": [{"method": "gptq", "bits": 9}], "kv": {"bits": 1}}),
        ("bad kv table before bad steps (JSON order)", "several", OWN,
         {"name": "r", "kv": {"bits": 1}, "steps": [{"method": "gptq", "bits": 9}]}),
        ("bad steps before a bad name (JSON order)", "several", OWN, {"steps": [{"method": "gptq", "bits": 9}], "name": 5}),
        ("bad name and unknown rule key", "several", OWN, {"name": 5, "steps": [{"method": "rtn", "rules": [{"pattern": ".*", "x": 1}]}]}),
    ]
    return c


def _rule_dict(rule: Any) -> dict[str, Any]:
    """A :class:`~eqjax.recipes.rules.Rule` as a recipe-file rule table."""
    d: dict[str, Any] = {"pattern": rule.pattern, "role": rule.role}
    w = rule.weight
    if w is None:
        return {**d, "skip": True}
    g = w.granularity
    kind = {"output": "channel", "input_group": "group"}.get(g.kind, g.kind)
    d.update(bits=w.bits, symmetric=w.symmetric, granularity=kind, calibrator=w.calibrator, scale_dtype=w.scale_dtype,
             full_range=w.full_range)
    if g.kind in ("channel", "group"):
        d["axis"] = g.axes[0]
    if kind == "group":
        d["group_size"] = g.group_size
    if w.calibrator == "percentile":
        d["percentile"] = w.percentile
    if rule.act_bits is not None:
        d.update(act_bits=rule.act_bits, act_granularity=rule.act_granularity)
    return d


def _plain(v: Any) -> Any:
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    return v


def step_dict(step: Any) -> dict[str, Any]:
    """A recipe step as a recipe-file step table: every init field of its dataclass but a default ``name`` (an rtn
    step: its rules)."""
    method = next(m for m, cls in STEP_TYPES.items() if cls is type(step))
    if method == "rtn":
        return {"method": "rtn", "rules": [_rule_dict(r) for r in step.rules]}
    d: dict[str, Any] = {"method": method}
    for f in dataclasses.fields(step):
        v = getattr(step, f.name)
        if not f.init or f.name == "name" and v == f.default:
            continue
        if f.name == "rules":
            v = [_rule_dict(r) for r in v]
        elif f.name == "then":
            v = [step_dict(s) for s in v]
        d[f.name] = _plain(v)
    return d


KV_KEYS = ("key_bits", "value_bits", "outlier_fraction", "sink_tokens", "key_group", "value_group", "key_levels",
           "value_levels", "recent_float")


def recipe_dict(recipe: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"name": recipe.name, "description": recipe.description,
                         "steps": [step_dict(s) for s in recipe.steps]}
    if recipe.kv is not None:
        d["kv"] = {k: _plain(getattr(recipe.kv, k)) for k in KV_KEYS if getattr(recipe.kv, k) is not None}
    return d


TEST_TOMLS = {
    "tests/recipes/test_rules_recipes.py: recipe file": (
        'name = "mine"\ndescription = "d"\n[[steps]]\nmethod = "rtn"\n[[steps.rules]]\npattern = ".*"\nrole = "matmul"\n'
        'bits = 4\nsymmetric = false\ngranularity = "group"\ngroup_size = 8\nscale_dtype = "float16"\n'),
    "tests/robustness/test_corrupt_files.py: RECIPE_TOML": (
        'name = "r"\ndescription = "d"\n[[steps]]\nmethod = "rtn"\n[[steps.rules]]\npattern = ".*/kernel"\n'
        'bits = 4\nsymmetric = false\ngranularity = "group"\ngroup_size = 32\n[kv]\nkey_bits = 4\nvalue_bits = 4\n'),
    "tests/robustness/robustness_cases.py: valid TOML, group 32": (
        'name = "r"\n[[steps]]\nmethod = "rtn"\n[[steps.rules]]\npattern = ".*/kernel"\n'
        'bits = 4\nsymmetric = false\ngranularity = "group"\ngroup_size = 32\nscale_dtype = "float16"\n'),
    "tests/recipes/test_rules_recipes.py: with a kv table": 'name = "r"\nsteps = []\n[kv]\nbits = 8\n',
    "tests/robustness/robustness_recipes.py: half step": 'name = "r"\n[[steps]]\nmethod = "half"\npattern = "decoder/.*"\n',
}


def valid_corpus() -> list[tuple[str, str, Any, bool | None]]:
    """``(case, origin, dict, round trip)``: every built-in recipe in dict form (round trip: ``recipe_from_dict`` of
    the dict equals the recipe), the TOML blocks of docs/ and the recipe files written by the tests."""
    from eqjax.recipes.registry import get_recipe, recipe_from_dict, recipe_names

    out: list[tuple[str, str, Any, bool | None]] = []
    for name in recipe_names():
        r = get_recipe(name)
        d = recipe_dict(r)
        try:
            same = recipe_from_dict(copy.deepcopy(d)) == r
        except Exception:  # noqa: BLE001 - reported as a failed round trip
            same = False
        out.append((f"built-in {name}", "eqjax.recipes", d, same))
    for md in sorted((ROOT / "docs").rglob("*.md")):
        for i, block in enumerate(re.findall(r"```toml\n(.*?)```", md.read_text(encoding="utf-8"), re.S)):
            out.append((f"{md.relative_to(ROOT)} toml block {i}", str(md.relative_to(ROOT)), tomllib.loads(block), None))
    for name, text in TEST_TOMLS.items():
        out.append((name, name.split(":")[0], tomllib.loads(text), None))
    py = [
        ("steps as a tuple (Python)", {"name": "r", "steps": ({"method": "rtn", "rules": ({"pattern": ".*"},)},)}),
        ("kv = None (Python)", {"name": "r", "steps": [], "kv": None}),
        ("rule percentile with the percentile calibrator", _rtn(calibrator="percentile", percentile=99)),
        ("rule skip = false with group settings", _rtn(skip=False, granularity="group", group_size=64, axis=0)),
        ("rule skip = true, role embedding", _rtn(skip=True, role="embedding")),
        ("gptq group_size = null (Python)", _step("gptq", group_size=None, scale_dtype=None)),
        ("signround lr = null, float fields as ints", _step("signround", lr=None, scale_min=1, scale_max=2)),
        ("kv levels as ints", _kv(key_bits=2, value_bits=2, key_levels=[0, 1], key_group=32)),
    ]
    out += [(name, OWN, d, None) for name, d in py]
    return out


def mutants(valid: list[Any], n: int, seed: int) -> list[Any]:
    """``n`` copies of valid dicts with one change each: a value replaced, a key added, or a key removed."""
    rng = random.Random(seed)
    pool: list[Any] = [None, True, False, 0, -1, 4, 9, 4.0, 0.5, 100.5, 10**20, float("nan"), float("inf"), "", " ",
                       "4", "false", "group", "((", "rtn", [], [1], [0.5, 2.0], {}, {"x": 1}]
    keys = ["bitz", "bits", "group_size", "percentile", "axis", "act_granularity", "key_bits", "method", "name", "skip"]
    out = []
    for _ in range(n):
        d = copy.deepcopy(rng.choice(valid))
        tables: list[dict[str, Any]] = []
        todo: list[Any] = [d]
        while todo:
            x = todo.pop()
            if isinstance(x, dict):
                tables.append(x)
                todo += list(x.values())
            elif isinstance(x, (list, tuple)):
                todo += list(x)
        t = rng.choice(tables)
        op = rng.choice(("set", "set", "add", "del"))
        if op == "set" and t:
            t[rng.choice(sorted(t))] = copy.deepcopy(rng.choice(pool))
        elif op == "del" and t:
            del t[rng.choice(sorted(t))]
        else:
            t[rng.choice(keys)] = copy.deepcopy(rng.choice(pool))
        out.append(d)
    return out


# ------------------------------------------------------------------------------------ running both
_PARTS = re.compile(r"^invalid recipe value \((?:[^:()]*: )?(.*?)\): expected (.*), found (.*)$", re.S)


def hand_check(d: Any, source: str | None = SOURCE) -> dict[str, Any]:
    try:
        validate_recipe_dict(d, source, STEP_TYPES)
    except SchemaError as e:
        return {"outcome": "refused", "message": str(e), "where": e.where or "top level", "expected": e.expected,
                "found": e.found}
    except Exception as e:  # noqa: BLE001 - a crash is a result here
        return {"outcome": "crash", "message": f"{type(e).__name__}: {e}"}
    return {"outcome": "accepted"}


def port_check(d: Any, source: str | None = SOURCE) -> dict[str, Any]:
    try:
        msg = pydantic_check(d, source)
    except Exception as e:  # noqa: BLE001 - a crash is a result here
        return {"outcome": "crash", "message": f"{type(e).__name__}: {e}"}
    if msg is None:
        return {"outcome": "accepted"}
    m = _PARTS.match(msg)
    where, expected, found = m.groups() if m else ("?", "?", "?")
    return {"outcome": "refused", "message": msg, "where": where, "expected": expected, "found": found}


def compare(d: Any) -> dict[str, Any]:
    h, p = hand_check(d), port_check(d)
    row: dict[str, Any] = {"hand": h, "pydantic": p, "same_outcome": h["outcome"] == p["outcome"]}
    if h["outcome"] == p["outcome"] == "refused":
        row.update(same_path=h["where"] == p["where"], same_expected=h["expected"] == p["expected"],
                   same_found=h["found"] == p["found"], equal=h["message"] == p["message"],
                   one_line=all("\n" not in x["message"] and SOURCE in x["message"] for x in (h, p)))
    else:
        row.update(equal=row["same_outcome"] and h.get("message") == p.get("message"))
    return row


def _reason(r: dict[str, Any]) -> str:
    """Why two results differ, in a few words."""
    h, p = r["hand"], r["pydantic"]
    name = r.get("case", "a mutant")
    if h["outcome"] != p["outcome"]:
        hs, ps = (x["outcome"] + (f" ({x['message'].split(':')[0]})" if x["outcome"] == "crash" else "") for x in (h, p))
        return f"{name}: hand-rolled {hs}, pydantic {ps}"
    if h["where"] != p["where"]:
        return f"{name}: another error reported first (hand-rolled {h['where']}, pydantic {p['where']})"
    if h["found"] != p["found"]:
        return f"{name}: found {h['found']} vs {p['found']}"
    return f"{name}: expected {h['expected']} vs {p['expected']}"


def timed(fn: Callable[[Any], Any], corpus: list[Any], repeats: int, loops: int) -> float:
    """Median over ``repeats`` of the microseconds per dict of ``loops`` passes over ``corpus``."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(loops):
            for d in corpus:
                fn(d)
        times.append((time.perf_counter() - t0) / (loops * len(corpus)) * 1e6)
    return statistics.median(times)


def _cpu() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _json_safe(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 2**63:
        return f"int with {len(str(abs(v)))} digits"
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


# ------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=21, help="timing repeats (the median is reported)")
    ap.add_argument("--mutants", type=int, default=400, help="random one-change mutants of the valid dicts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "validators"), help="output path without suffix")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()

    hand_lines = code_lines(SCHEMA_PY, HAND_ROLLED)
    port_lines = code_lines(pathlib.Path(__file__), between=("# >>> pydantic port", "# <<< pydantic port"))
    missing = sorted(set(HAND_ROLLED) - set(hand_lines))

    bad = [{"case": n, "group": g, "origin": o, "input": _json_safe(d), **compare(d)} for n, g, o, d in bad_corpus()]
    valid_raw = valid_corpus()
    valid = [{"case": n, "origin": o, "round_trip": rt, **compare(d)} for n, o, d, rt in valid_raw]
    mut = [compare(d) for d in mutants([d for _, _, d, _ in valid_raw], args.mutants, args.seed)]

    def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
        both = [r for r in rows if r["hand"]["outcome"] == r["pydantic"]["outcome"] == "refused"]
        return {
            "cases": len(rows),
            "hand": {k: sum(r["hand"]["outcome"] == k for r in rows) for k in ("accepted", "refused", "crash")},
            "pydantic": {k: sum(r["pydantic"]["outcome"] == k for r in rows) for k in ("accepted", "refused", "crash")},
            "same_outcome": sum(r["same_outcome"] for r in rows),
            "refused_by_both": len(both),
            "same_path": sum(r["same_path"] for r in both),
            "same_expected": sum(r["same_expected"] for r in both),
            "same_found": sum(r["same_found"] for r in both),
            "equal_message": sum(r["equal"] for r in both),
            "one_line_naming_file": sum(r["one_line"] for r in both),
        }

    valid_dicts = [d for _, _, d, _ in valid_raw]
    bad_dicts = [d for _, _, _, d in bad_corpus()]
    loops = 5
    timing = {
        "valid_hand_us": timed(lambda d: validate_recipe_dict(d, SOURCE, STEP_TYPES), valid_dicts, args.repeats, loops),
        "valid_pydantic_us": timed(lambda d: RecipeTable.model_validate(d), valid_dicts, args.repeats, loops),
        "bad_hand_us": timed(lambda d: hand_check(d)["outcome"], bad_dicts, args.repeats, loops),
        "bad_pydantic_us": timed(lambda d: port_check(d)["outcome"], bad_dicts, args.repeats, loops),
        "repeats": args.repeats, "loops": loops,
        "port_build_s": PORT_SECONDS, "pydantic_import_s": PYDANTIC_IMPORT_SECONDS,
    }
    s_bad, s_valid, s_mut = summary(bad), summary(valid), summary(mut)
    h_total, p_total = sum(hand_lines.values()), sum(port_lines.values())
    disagree = [r for r in bad + valid if not r["equal"]]
    mut_disagree = [r for r in mut if not r["equal"]]
    verdict = (
        f"pydantic: {p_total} lines vs {h_total} lines hand-rolled ({p_total - h_total:+d}); "
        f"{s_bad['equal_message']} of {s_bad['cases']} bad-dict messages equal "
        f"({s_bad['same_outcome']} of {s_bad['cases']} same outcome, {s_bad['same_path']} of {s_bad['refused_by_both']} "
        f"refused by both name the same key path, {s_bad['same_found']} the same found value); "
        f"{s_valid['same_outcome']} of {s_valid['cases']} valid dicts accepted by both; "
        f"{len(mut) - len(mut_disagree)} of {len(mut)} mutants give identical results; "
        f"disagreements: {'; '.join(_reason(r) for r in disagree + mut_disagree) or 'none'}; "
        f"time per valid recipe: pydantic {timing['valid_pydantic_us']:.0f} us, hand-rolled {timing['valid_hand_us']:.0f} us"
    )
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "platform": platform.platform(), "cpu": _cpu(), "cpu_count": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0], "python": platform.python_version(), "pydantic": pydantic.VERSION,
        "wall_seconds": round(time.perf_counter() - t0, 2), "mutants_seed": args.seed,
    }
    payload = {
        "meta": meta, "verdict": verdict,
        "lines": {"hand_rolled": hand_lines, "hand_rolled_total": h_total, "hand_rolled_missing": missing,
                  "pydantic": port_lines, "pydantic_total": p_total,
                  "counted": "non-blank, non-comment lines; docstrings and imports excluded; per top-level name (ast)"},
        "summary": {"bad": s_bad, "valid": s_valid, "mutants": s_mut},
        "timing": timing,
        "bad": bad, "valid": valid,
        "mutant_disagreements": [{"hand": r["hand"], "pydantic": r["pydantic"]} for r in mut_disagree],
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from eqjax.io.atomic import write_text

    write_text(out.with_suffix(".json"), json.dumps(_json_safe(payload), indent=1) + "\n")
    write_text(out.with_suffix(".md"), markdown(payload, disagree, mut_disagree))
    print(verdict)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')} in {meta['wall_seconds']:.1f} s")
    return 0


def _cell(s: Any) -> str:
    s = str(s).replace("|", "\\|").replace("\n", " ")
    return s if len(s) <= 200 else s[:197] + "..."


def markdown(p: dict[str, Any], disagree: list[dict[str, Any]], mut_disagree: list[dict[str, Any]]) -> str:
    m, ln, t = p["meta"], p["lines"], p["timing"]
    sb, sv, sm = p["summary"]["bad"], p["summary"]["valid"], p["summary"]["mutants"]
    lines = [
        "# Hand-rolled recipe checkers vs a pydantic port",
        "",
        f"{m['date']}, {m['platform']}, {m['cpu']}, {m['cpu_count']} CPU cores (1-min load {m['load_avg_1m']:.1f}), "
        f"Python {m['python']}, pydantic {m['pydantic']}; `python bench/validators.py` in {m['wall_seconds']:.1f} s.",
        "",
        f"**Verdict.** {p['verdict']}.",
        "",
        "## Lines of code",
        "",
        f"Counted: {ln['counted']}. Hand-rolled: the checkers of `eqjax/recipes/schema.py`; pydantic: the port in "
        "`bench/validators.py` between its `# >>> pydantic port` / `# <<< pydantic port` markers, its error "
        "formatter included. `SchemaError` (the exception class both would raise) is counted by neither.",
        "",
        "| hand-rolled (eqjax/recipes/schema.py) | lines | | pydantic port | lines |",
        "|---|---:|---|---|---:|",
    ]
    h, q = list(ln["hand_rolled"].items()), list(ln["pydantic"].items())
    for i in range(max(len(h), len(q))):
        a = h[i] if i < len(h) else ("", "")
        b = q[i] if i < len(q) else ("", "")
        lines.append(f"| {'`' + a[0] + '`' if a[0] else ''} | {a[1]} | | {'`' + b[0] + '`' if b[0] else ''} | {b[1]} |")
    lines += [f"| **total** | **{ln['hand_rolled_total']}** | | **total** | **{ln['pydantic_total']}** |", ""]
    if ln["hand_rolled_missing"]:
        lines += [f"Names not found in eqjax/recipes/schema.py (not counted): {', '.join(ln['hand_rolled_missing'])}.", ""]

    def srow(name: str, s: dict[str, Any]) -> str:
        hs, ps = s["hand"], s["pydantic"]
        return (f"| {name} | {s['cases']} | {hs['accepted']} / {hs['refused']} / {hs['crash']} | "
                f"{ps['accepted']} / {ps['refused']} / {ps['crash']} | {s['same_outcome']} | {s['refused_by_both']} | "
                f"{s['same_path']} | {s['same_expected']} | {s['same_found']} | {s['equal_message']} |")

    lines += [
        "## Corpus",
        "",
        "Every dict goes through `eqjax.recipes.schema.validate_recipe_dict(d, 'recipe.toml')` and through the port "
        "(`RecipeTable.model_validate` + the formatter). Path, expected and found are compared separately, then the "
        "whole message. Mutants: each a valid dict with one value replaced, one key added or one removed "
        f"(seed {m['mutants_seed']}).",
        "",
        "| corpus | dicts | hand-rolled accepted / refused / crash | pydantic accepted / refused / crash | same outcome "
        "| refused by both | same key path | same allowed values | same found value | equal message |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        srow("bad dicts", sb), srow("valid dicts", sv), srow("mutants", sm),
        "",
        f"Every message refused by both is one line naming the file: {sb['one_line_naming_file']} of "
        f"{sb['refused_by_both']} (bad dicts), {sm['one_line_naming_file']} of {sm['refused_by_both']} (mutants).",
        "",
        "## Disagreements (bad and valid dicts)",
        "",
    ]
    if not disagree:
        lines += ["None.", ""]
    else:
        lines += ["| case | hand-rolled | pydantic port |", "|---|---|---|"]
        for r in disagree:
            lines.append(f"| {_cell(r['case'])} | {_cell(r['hand'].get('message', r['hand']['outcome']))} | "
                         f"{_cell(r['pydantic'].get('message', r['pydantic']['outcome']))} |")
        lines.append("")
    lines += [f"## Disagreements (mutants): {len(mut_disagree)} of {sm['cases']}", ""]
    if mut_disagree:
        lines += ["| hand-rolled | pydantic port |", "|---|---|"]
        seen: set[tuple[str, str]] = set()
        for r in mut_disagree:
            key = (str(r["hand"].get("message", r["hand"]["outcome"])), str(r["pydantic"].get("message", r["pydantic"]["outcome"])))
            if key not in seen:
                seen.add(key)
                lines.append(f"| {_cell(key[0])} | {_cell(key[1])} |")
        lines.append("")
    lines += [
        "## Time",
        "",
        f"Median of {t['repeats']} repeats of {t['loops']} passes over the corpus, microseconds per dict, this process.",
        "",
        "| corpus | hand-rolled | pydantic port | ratio |",
        "|---|---:|---:|---:|",
        f"| valid dicts ({sv['cases']}) | {t['valid_hand_us']:.1f} | {t['valid_pydantic_us']:.1f} | "
        f"{t['valid_pydantic_us'] / t['valid_hand_us']:.2f} |",
        f"| bad dicts ({sb['cases']}), message included | {t['bad_hand_us']:.1f} | {t['bad_pydantic_us']:.1f} | "
        f"{t['bad_pydantic_us'] / t['bad_hand_us']:.2f} |",
        "",
        f"One-off costs of the port, at import: `import pydantic` {t['pydantic_import_s'] * 1000:.0f} ms, building "
        f"its models {t['port_build_s'] * 1000:.0f} ms (the step modules imported before, as both need them).",
        "",
        "## Bad dicts",
        "",
        "| case | group | from | hand-rolled message | same path / allowed / found | equal |",
        "|---|---|---|---|---|---|",
    ]
    yn = {True: "yes", False: "no", None: "—"}
    for r in p["bad"]:
        flags = " / ".join(yn[r.get(k)] for k in ("same_path", "same_expected", "same_found"))
        lines.append(f"| {_cell(r['case'])} | {r['group']} | {r['origin']} | "
                     f"{_cell(r['hand'].get('message', r['hand']['outcome']))} | {flags} | {yn[r['equal']]} |")
    lines += ["", "## Valid dicts", "", "| case | from | hand-rolled | pydantic port | dict form round trip |",
              "|---|---|---|---|---|"]
    for r in p["valid"]:
        lines.append(f"| {_cell(r['case'])} | {r['origin']} | {r['hand']['outcome']} | {r['pydantic']['outcome']} | "
                     f"{yn[r['round_trip']]} |")
    lines += [
        "",
        "Round trip: `recipe_from_dict` of the dict form equals the built-in recipe; \"no\" where the recipe holds "
        "something a recipe file cannot say (e.g. an rtn step's own name), so the dict form is a near copy.",
    ]
    lines += [
        "",
        "## Verdict",
        "",
        p["verdict"] + ".",
        "",
        "What equal messages cost the port (all counted above): a label of what is allowed on every value type (a wrap "
        "validator relabelling pydantic's own error), a model wrap validator relabelling unknown / missing keys and "
        "non-tables, the method tag of the discriminated union removed from key paths, and an ordering of pydantic's "
        "errors (it reports all of them) to pick the one the hand-rolled checkers report first.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
