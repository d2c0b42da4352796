"""The ``eqjax recipes`` command: every built-in recipe with its description, stored bits per weight,
activation / KV-cache quantization and the output formats that can hold it.

Bits per weight are the storage bits of a decoder block's linear weights (codes, scales and zero points, as
:mod:`eqjax.core.qarray` stores them) over their element count, on :data:`REFERENCE_SHAPES` (SmolLM2-135M),
read from the recipe's steps: calibrated methods store what RTN stores at the same bits and layout. The
formats come from each writer's own recipe check (:data:`FORMAT_CHECKS`).
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any, Callable, Iterator

import numpy as np

from eqjax.core.errors import InputError
from eqjax.core.numerics import QuantSpec
from eqjax.core.qarray import (
    Granularity,
    pack_axis_for,
    per_channel,
    per_group,
    scale_shape,
    storage_dtype,
    storage_shape,
)
from eqjax.export.package import check_recipe
from eqjax.io.compressed_tensors import FORMAT as CT_FORMAT
from eqjax.io.compressed_tensors import check_recipe as check_ct_recipe
from eqjax.io.gguf_write import check_gguf_recipe
from eqjax.io.gptq import GPTQ_FORMAT
from eqjax.io.gptq import check_recipe as check_gptq_recipe
from eqjax.methods.awq import AWQ
from eqjax.methods.blockqat import BlockQAT
from eqjax.methods.halffloat import HALF_KINDS, HalfFloats
from eqjax.methods.lkd import ZeroQuantLKD
from eqjax.methods.qat import QAT
from eqjax.methods.rotation import Rotation
from eqjax.methods.smoothquant import SmoothQuant
from eqjax.recipes.registry import EMBEDDINGS, HALF_SUFFIXES, RECIPES, embedding_rule_dict
from eqjax.recipes.rules import Rule
from eqjax.recipes.types import Recipe

__all__ = ["FORMAT_CHECKS", "REFERENCE_SHAPES", "add_recipes_args", "bits_per_weight", "recipe_formats",
           "recipe_rows", "recipes_main", "spec_bits", "suffix_rows"]

FORMAT_CHECKS: dict[str, Callable[[Recipe], None] | None] = {"orbax": None, "onnx": check_recipe, "gguf": check_gguf_recipe,
                                                             CT_FORMAT: check_ct_recipe, GPTQ_FORMAT: check_gptq_recipe}
"""Output format -> its recipe check (raises an :class:`InputError` for a recipe it cannot hold; None: any)."""

REFERENCE_SHAPES: dict[str, tuple[int, int]] = {
    "layers_0/attn/q_proj/kernel": (576, 9 * 64),
    "layers_0/attn/k_proj/kernel": (576, 3 * 64),
    "layers_0/attn/v_proj/kernel": (576, 3 * 64),
    "layers_0/attn/o_proj/kernel": (9 * 64, 576),
    "layers_0/mlp/gate_proj/kernel": (576, 1536),
    "layers_0/mlp/up_proj/kernel": (576, 1536),
    "layers_0/mlp/down_proj/kernel": (1536, 576),
}
"""``[in, out]`` kernels of one SmolLM2-135M decoder block (hidden 576, MLP 1536, 9 query / 3 KV heads of 64)."""

_SCALING_ONLY = (AWQ, SmoothQuant)  # steps that rescale float weights and store nothing quantized


def recipe_formats(recipe: Recipe) -> list[str]:
    """The formats whose check accepts ``recipe``, in :data:`FORMAT_CHECKS` order."""
    out = []
    for name, check in FORMAT_CHECKS.items():
        try:
            if check is not None:
                check(recipe)
        except InputError:
            continue
        out.append(name)
    return out


def _concrete(gran: Granularity) -> Granularity:
    """A role-relative granularity on an ``[in, out]`` kernel."""
    if gran.kind == "output":
        return per_channel(1)
    if gran.kind == "input_group":
        return per_group(0, gran.group_size)
    return gran.normalized(2)


def spec_bits(spec: QuantSpec, shape: tuple[int, int]) -> int:
    """Stored bits of an ``[in, out]`` kernel quantized as ``spec``: codes, scales and zero points."""
    gran = _concrete(spec.granularity)
    n_codes = math.prod(storage_shape(shape, spec.bits, pack_axis_for(gran)))
    n_scales = math.prod(scale_shape(shape, gran))
    bits = n_codes * storage_dtype(spec.bits, spec.symmetric).itemsize * 8
    bits += n_scales * np.dtype(spec.scale_dtype).itemsize * 8
    if not spec.symmetric:
        bits += n_scales * np.dtype(np.uint8).itemsize * 8
    return bits


def _entries(step: Any, outer: tuple[Rule, ...] = (), act_bits: int | None = None
             ) -> Iterator[tuple[tuple[Rule, ...], QuantSpec | None, int | None]]:
    """``(rules a weight must all match, its stored format or None, activation bits)`` of a step, in the
    order they claim weights (the first match wins)."""
    if isinstance(step, Rotation):
        for s in step.then:
            yield from _entries(s, outer, step.act_bits)
    elif isinstance(step, (*_SCALING_ONLY, HalfFloats)):
        return
    elif isinstance(step, ZeroQuantLKD):
        yield (*outer, step.rule), step.rule.weight, step.rule.act_bits
    elif callable(getattr(step, "spec", None)):  # GPTQ, searched RTN, SignRound: optional rules, then the step's format
        own = (*outer, Rule(step.pattern, role=step.role))
        for r in getattr(step, "rules", ()):
            yield (*own, r), r.weight, act_bits
        yield own, step.spec(), act_bits
    else:  # RTN
        for r in getattr(step, "rules", ()):
            yield (*outer, r), r.weight, r.act_bits if r.act_bits is not None else act_bits


def _weight_formats(recipe: Recipe) -> dict[str, tuple[QuantSpec | None, int | None]]:
    """Reference kernel path -> (stored format or None for float, activation bits)."""
    out: dict[str, tuple[QuantSpec | None, int | None]] = {}
    for step in recipe.steps:
        for rules, spec, act in _entries(step):
            for path in REFERENCE_SHAPES:
                if path not in out and all(r.matches(path, "matmul") for r in rules):
                    out[path] = (spec, act if spec is not None else None)
    return out


def _float_bits(recipe: Recipe, path: str) -> int:
    half = [s for s in recipe.steps if isinstance(s, HalfFloats) and Rule(s.pattern, role="any").matches(path)]
    return 16 if half else 32


def bits_per_weight(recipe: Recipe) -> float:
    """Stored bits per element of :data:`REFERENCE_SHAPES` (float weights: 32, or 16 after ``+f16``)."""
    formats = _weight_formats(recipe)
    total = n = 0
    for path, shape in REFERENCE_SHAPES.items():
        spec = formats.get(path, (None, None))[0]
        total += spec_bits(spec, shape) if spec is not None else math.prod(shape) * _float_bits(recipe, path)
        n += math.prod(shape)
    return total / n


def _quantizes(recipe: Recipe) -> dict[str, Any]:
    """Activation bits (a set of widths) and the KV cache's key / value bits, or None."""
    acts = sorted({a for _, a in _weight_formats(recipe).values() if a is not None})
    kv = None if recipe.kv is None else {"key_bits": recipe.kv.key_bits, "value_bits": recipe.kv.value_bits}
    return {"act_bits": acts[0] if len(acts) == 1 else (acts or None), "kv": kv}


def _tag(row: dict[str, Any]) -> str:
    tags = [f"a{row['act_bits']}"] if row["act_bits"] is not None else []
    kv = row["kv"]
    if kv is not None:
        k, v = kv["key_bits"], kv["value_bits"]
        tags.append(f"kv{k}" if k == v else f"k{k}v{v}")
    return ",".join(tags) or "-"


def recipe_rows(pattern: str | None = None) -> list[dict[str, Any]]:
    """One dict per built-in recipe (registry order) whose name contains ``pattern``."""
    rows = []
    for name, make in RECIPES.items():
        if pattern and pattern not in name:
            continue
        r = make()
        has_weights = any(spec is not None for spec, _ in _weight_formats(r).values())
        rows.append({"name": name, "description": r.description, "bits_per_weight": round(bits_per_weight(r), 4),
                     "weights": "quantized" if has_weights else "float", **_quantizes(r),
                     "calibrated": r.needs_calibration, "formats": recipe_formats(r)})
    return rows


def suffix_rows() -> list[tuple[str, str]]:
    """``(+suffix, what it does)`` for every recipe-name suffix of the registry."""
    out = [("+bqat", f"first: block-wise quantization-aware training of a weight-only recipe's quantized weights "
                     f"against the float blocks ({BlockQAT.iters} steps per block unless --qat-block-iters)"),
           ("+qat", f"first (after +bqat): end-to-end quantization-aware training of a weight-only recipe's quantized "
                    f"weights ({QAT.tokens} tokens unless --qat-tokens)")]
    for kind in EMBEDDINGS:
        d = embedding_rule_dict(kind)
        how = "per row" if d["granularity"] == "channel" else f"groups of {d['group_size']}"
        sym = "symmetric" if d["symmetric"] else "asymmetric"
        act = f", a tied LM head's activations int{d['act_bits']}" if d.get("act_bits") else ""
        out.append((f"+emb-{kind}", f"embedding table (and a tied LM head) {d['bits']}-bit {how}, {sym}{act}"))
    for kind in HALF_SUFFIXES:
        out.append((f"+{kind}", f"every param still float stored as {HALF_KINDS[kind]} (last)"))
    return out


def _bits_text(row: dict[str, Any]) -> str:
    bpw = row["bits_per_weight"]
    return f"{bpw:g} (float)" if row["weights"] == "float" else f"{bpw:.3f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as an aligned plain-text table, then the suffixes."""
    head = ("recipe", "bits/w", "a/kv", "formats", "description")
    body = [(r["name"], _bits_text(r), _tag(r), ",".join(r["formats"]), r["description"]) for r in rows]
    widths = [max(len(x[i]) for x in (head, *body)) for i in range(len(head) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(x[:-1], widths)) + "  " + x[-1] for x in (head, *body)]
    ref = ", ".join(f"{p.split('/')[-2]} {i}x{o}" for p, (i, o) in REFERENCE_SHAPES.items())
    lines += ["", f"bits/w: stored bits (codes + scales + zero points) per linear weight of a decoder block ({ref})",
              "suffixes (after any recipe name, e.g. w4g128-gptq+bqat+qat+emb-int8+f16; +bqat / +qat first, then at most one "
              "+emb-*, then +f16 or +bf16):"]
    sw = max(len(s) for s, _ in suffix_rows())
    lines += [f"  {s.ljust(sw)}  {what}" for s, what in suffix_rows()]
    return "\n".join(lines)


def add_recipes_args(p: Any) -> Any:
    """Arguments of ``eqjax recipes``."""
    p.add_argument("filter", nargs="?", default=None, help="list only recipes whose name contains this text")
    p.add_argument("--json", action="store_true", help="print the list as JSON instead of a table")
    return p


def recipes_main(args: Any) -> int:
    """``eqjax recipes``: print the table (or JSON) of the built-in recipes."""
    rows = recipe_rows(getattr(args, "filter", None))
    if args.json:
        sys.stdout.write(json.dumps(rows, indent=1) + "\n")
    elif not rows:
        print(f"no built-in recipe name contains {args.filter!r}")
    else:
        print(format_table(rows))
    return 0
