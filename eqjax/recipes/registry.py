"""Named recipes, addressable from Python (:func:`get_recipe`) and the CLI (``--recipe NAME``).

Every matmul weight is quantized, selected by role (``Rule(".*", spec, role="matmul")``), so the
recipes apply to any model eqjax can trace; embedding tables (and a tied LM head) and everything that
is not a matmul weight stay in float, unless the name ends in ``+emb-int8`` (the embedding / tied LM
head int8 per row, symmetric), ``+emb-int4`` (int4 groups of 32, asymmetric, float16 scales) or
``+emb-w7a8`` (7-bit per row in int8 storage, a tied head's activations int8 per token): any recipe,
e.g. ``w4g128-gptq+emb-int4``; ``+bqat`` then ``+qat`` (first of the suffixes) train the recipe's quantized weights
block by block (:mod:`eqjax.methods.blockqat`) and end to end (:mod:`eqjax.methods.qat`) after its post-training
steps (e.g. ``w3g128-gptq+bqat+qat``); a final ``+f16`` / ``+bf16`` stores every param still float in 16 bits
(:mod:`eqjax.methods.halffloat`; ``fp+f16`` is the float16 model). Granularities are role-relative: one scale per output channel,
or groups along the input. Group-wise recipes store float16 scales (rounded up), the per-channel and
per-tensor ones float32.
"""

from __future__ import annotations

import json
import pathlib
import tomllib
from collections.abc import Mapping
from typing import Any, Callable

from eqjax.core.errors import RecipeError
from eqjax.core.numerics import QuantSpec
from eqjax.core.qarray import per_input_group, per_output_channel, per_tensor
from eqjax.methods.awq import AWQ
from eqjax.methods.blockqat import BlockQAT
from eqjax.methods.gptq import GPTQ
from eqjax.methods.grid import SearchedRTN
from eqjax.methods.halffloat import HALF_KINDS, HalfFloats
from eqjax.methods.kvquant import KVQuant
from eqjax.methods.lkd import ZeroQuantLKD
from eqjax.methods.qat import QAT
from eqjax.methods.rotation import Rotation
from eqjax.methods.rtn import RTN
from eqjax.methods.signround import SignRound
from eqjax.methods.smoothquant import SmoothQuant
from eqjax.recipes.checks import check_quantizes
from eqjax.recipes.rules import Rule, rule_from_dict
from eqjax.recipes.schema import SchemaError, validate_recipe_dict
from eqjax.recipes.types import Recipe

__all__ = ["EMBEDDINGS", "RECIPES", "embedding_step", "get_recipe", "recipe_names", "weight_rule",
           "with_embedding", "with_half_floats", "with_qat", "with_block_qat"]

EMBEDDINGS = ("int8", "int4", "w7a8")


def weight_rule(
    bits: int,
    *,
    symmetric: bool = True,
    group: int | None = None,
    per_tensor_scale: bool = False,
    calibrator: str = "minmax",
    act_bits: int | None = None,
    act_granularity: str = "token",
    pattern: str = ".*",
    role: str = "matmul",
    full_range: bool | None = None,
) -> Rule:
    """One rule for every matmul weight: per output channel by default, ``group`` along the input.

    ``full_range`` (default: symmetric 2..4-bit weight-only rules): symmetric grids on all ``2**b``
    codes (:class:`~eqjax.core.numerics.QuantSpec`); 5..8-bit and W8A8 grids keep ``+-(2**(b-1) - 1)``.
    """
    if group is not None:
        gran = per_input_group(group)
    elif per_tensor_scale:
        gran = per_tensor()
    else:
        gran = per_output_channel()
    scale_dtype = "float16" if group is not None else "float32"
    if full_range is None:
        full_range = symmetric and bits <= 4 and act_bits is None
    spec = QuantSpec(bits, symmetric, gran, calibrator, scale_dtype=scale_dtype, full_range=full_range)
    return Rule(pattern, spec, act_bits, act_granularity, role)


def _rtn(name: str, description: str, rule: Rule) -> Callable[[], Recipe]:
    return lambda: Recipe(name, (RTN((rule,)),), description)



def _smoothquant(name: str, alpha: float, search: bool = False, *, weight_bits: int = 8, calibrator: str = "minmax",
                 what: str = "W8 per-channel") -> Recipe:

    how = "alpha searched per block" if search else f"alpha {alpha}"
    return Recipe(name, (SmoothQuant(alpha, search), RTN((weight_rule(weight_bits, act_bits=8, calibrator=calibrator),))),
                  f"SmoothQuant ({how}) + {what} + A8 per-token dynamic")


def _lkd(name: str, bits: int) -> Recipe:

    return Recipe(name, (ZeroQuantLKD(bits=bits, group_size=64),),
                  f"ZeroQuant W{bits} group-64 symmetric + A8 per token, layer-by-layer distillation (Adam)")


def _kv(name: str, description: str, kb: int, vb: int, outliers: float = 0.0, **kw: Any) -> Recipe:

    return Recipe(name, (), description, kv=KVQuant(kb, vb, outliers, sink_tokens=1, key_group=32, value_group=32, **kw))


# 2-bit non-uniform levels (positions in each block's range): the best of bench/kv_levels.py's candidates
# on the calibration half of the text (bench/results/kv_levels.md), never on the evaluation tokens
KV2_LEVELS = (0.1, 0.36, 0.64, 0.9)


RECIPES: dict[str, Callable[[], Recipe]] = {
    "fp": lambda: Recipe("fp", (), "float32 baseline (no quantization)"),
    "w8-absmax": _rtn("w8-absmax", "W8 symmetric, one absmax scale per tensor (seed: absmax)",
                      weight_rule(8, per_tensor_scale=True, calibrator="absmax")),
    "w8-zeropoint": _rtn("w8-zeropoint", "W8 asymmetric min/max with a zero point, per tensor (seed: zero-point)",
                         weight_rule(8, symmetric=False, per_tensor_scale=True)),
    "w8": _rtn("w8", "W8 symmetric per output channel, weight-only (seed: symmetric 8-bit)", weight_rule(8)),
    "w8a8-naive": _rtn("w8a8-naive", "W8 per-channel + A8 per-token dynamic, no smoothing",
                       weight_rule(8, act_bits=8, act_granularity="token")),
    "w8a8-naive-tensor": _rtn("w8a8-naive-tensor", "W8 per-channel + A8 per-tensor dynamic, no smoothing",
                              weight_rule(8, act_bits=8, act_granularity="tensor")),
    "w8a8-zeroquant": _rtn("w8a8-zeroquant", "ZeroQuant: W8 group-64 symmetric + A8 per-token dynamic",
                           weight_rule(8, group=64, act_bits=8)),
    "w4g128-rtn": _rtn("w4g128-rtn", "W4 asymmetric, group 128, round to nearest", weight_rule(4, symmetric=False, group=128)),
    "w4g128-rtn-sym": _rtn("w4g128-rtn-sym", "W4 symmetric (16 codes), group 128, round to nearest", weight_rule(4, group=128)),
    "w3g128-rtn": _rtn("w3g128-rtn", "W3 asymmetric, group 128, round to nearest", weight_rule(3, symmetric=False, group=128)),
    "w2g64-rtn": _rtn("w2g64-rtn", "W2 asymmetric, group 64, round to nearest", weight_rule(2, symmetric=False, group=64)),
    # SmoothQuant (alpha smoothing, then W8 per-channel + A8 per-token), ZeroQuant + LKD, KV cache.
    "w8a8-smoothquant": lambda: _smoothquant("w8a8-smoothquant", 0.85),
    "w8a8-smoothquant-a0.5": lambda: _smoothquant("w8a8-smoothquant-a0.5", 0.5),
    "w8a8-smoothquant-search": lambda: _smoothquant("w8a8-smoothquant-search", 0.85, search=True),
    # the edge-runtime flavour: 7-bit weight integers make onnxruntime's fast u8 x s8 int8 GEMM exact on
    # CPUs without VNNI (no int16 pair-sum saturation), ~2x faster than the u8 x u8 lowering of W8
    "w7a8-smoothquant": lambda: _smoothquant(
        "w7a8-smoothquant", 0.6, weight_bits=7, calibrator="mse",
        what="W7 per-channel, MSE-clipped (int8 storage within +-63: onnxruntime's fast u8 x s8 int8 GEMM is exact "
             "with it on every x86 CPU)"),
    "w8a8-zeroquant-lkd": lambda: _lkd("w8a8-zeroquant-lkd", 8),
    "w4a8-zeroquant-lkd": lambda: _lkd("w4a8-zeroquant-lkd", 4),
    # KV cache (KIVI/KVQuant-style groups): keys per channel pre-RoPE in blocks of 32 tokens, values per
    # token in groups of 32 channels, float16 ranges; the first token (attention sink) kept in float16.
    "kv8": lambda: _kv("kv8", "KV cache int8 (keys per channel pre-RoPE, values per token, groups of 32, sink kept); weights float", 8, 8),
    "kv4": lambda: _kv("kv4", "KV cache int4 (keys per channel pre-RoPE, values per token, groups of 32, sink kept) + 1% float16 outliers; weights float", 4, 4, 0.01),
    "kv3-outliers": lambda: _kv("kv3-outliers", "KV cache int3, groups of 32, sink kept, + 1% float16 outliers; weights float", 3, 3, 0.01),
    "kv2": lambda: _kv("kv2", "KV cache int2, groups of 32, sink kept, no outliers; weights float", 2, 2),
    "kv2-outliers": lambda: _kv("kv2-outliers", "KV cache int2, groups of 32, sink kept, + 1% float16 outliers; weights float", 2, 2, 0.01),
    "kv2-nuq": lambda: _kv("kv2-nuq", "KV cache int2 on non-uniform levels (0.1, 0.36, 0.64, 0.9 of each range), groups of 32, "
                           "sink kept, + 1% float16 outliers; weights float", 2, 2, 0.01, key_levels=KV2_LEVELS,
                           value_levels=KV2_LEVELS),
    "kv2-nuq-recent": lambda: _kv("kv2-nuq-recent", "kv2-nuq + each query's still-filling 32-token block in float16 "
                                  "(KIVI's residual); weights float", 2, 2, 0.01, key_levels=KV2_LEVELS,
                                  value_levels=KV2_LEVELS, recent_float=True),
    # GPTQ / AWQ (eqjax.methods.gptq, eqjax.methods.awq): groups of 128 with a short last group where 128
    # does not divide the input width (576 = 4 x 128 + 64), the same layout as the RTN recipes.
    "w4g128-gptq": lambda: Recipe("w4g128-gptq", (_gptq(bits=4),), "GPTQ W4 asymmetric, group 128, act-order"),
    "w4g128-gptq-sym": lambda: Recipe("w4g128-gptq-sym", (_gptq(bits=4, symmetric=True),),
                                      "GPTQ W4 symmetric (16 codes), group 128, act-order"),
    "w3g128-gptq": lambda: Recipe("w3g128-gptq", (_gptq(bits=3),), "GPTQ W3 asymmetric, group 128, act-order"),
    "w4g128-awq": lambda: Recipe("w4g128-awq", (_awq(bits=4), RTN((weight_rule(4, symmetric=False, group=128),))),
                                 "AWQ scales + clipping, then W4 asymmetric group-128 RTN"),
    "w4g128-awq-gptq": lambda: Recipe("w4g128-awq-gptq", (_awq(bits=4, clip=False), _gptq(bits=4)),
                                      "AWQ scales, then GPTQ W4 asymmetric group 128, act-order"),
    "w3g128-awq": lambda: Recipe("w3g128-awq", (_awq(bits=3), RTN((weight_rule(3, symmetric=False, group=128),))),
                                 "AWQ scales + clipping, then W3 asymmetric group-128 RTN"),
    # Rotations (QuaRot; eqjax.methods.rotation): residual stream rotated by a randomized Hadamard with
    # the norm scales folded, per-head Hadamard on values / o_proj, online Hadamard before down_proj;
    # the tied LM head is untied by the rotation and kept float (as the other recipes keep the table).
    "w8a8-rot": lambda: _rot("w8a8-rot", "Rotation + W8 per-channel + A8 per-token dynamic (RTN)",
                             RTN((weight_rule(8, act_bits=8, pattern=_LAYERS),))),
    "w4g128-rot-rtn": lambda: _rot("w4g128-rot-rtn", "Rotation + W4 asymmetric group 128 RTN",
                                   RTN((weight_rule(4, symmetric=False, group=128, pattern=_LAYERS),))),
    "w4g128-rot-gptq": lambda: _rot("w4g128-rot-gptq", "Rotation + GPTQ W4 asymmetric group 128, act-order",
                                    _gptq(bits=4, pattern=_LAYERS)),
    "w4a8-rot-gptq": lambda: _rot("w4a8-rot-gptq", "Rotation + GPTQ W4 asymmetric group 128 + A8 per-token dynamic",
                                  _gptq(bits=4, pattern=_LAYERS), act_bits=8),
    # the rotation unties the LM head: int8 per output channel here, so that with +emb-int8 (the table)
    # the whole artifact is smaller than w4g128-rtn's (whose table stays float)
    "w4g128-rot-gptq-search": lambda: _rot(
        "w4g128-rot-gptq-search", "Rotation + GPTQ W4 asymmetric g128 on searched grids, the untied LM head int8 per channel",
        _gptq(bits=4, pattern=_LAYERS, grid="search"), RTN((weight_rule(8, pattern="lm_head/.*"),), name="lm-head-int8")),
    # the same with the untied head left float: with +f16 it is stored as float16 (the whole artifact
    # stays below w4g128-rtn's bytes with +emb-int8)
    "w4g128-rot-gptq-search-fhead": lambda: _rot(
        "w4g128-rot-gptq-search-fhead", "Rotation + GPTQ W4 asymmetric g128 on searched grids, the untied LM head float",
        _gptq(bits=4, pattern=_LAYERS, grid="search")),
}

# ---- searched grids (:mod:`eqjax.methods.grid`) and learned rounding
# (:mod:`eqjax.methods.signround`); same stored layout and bytes as the RTN / GPTQ recipes above.
_G128 = dict(group_size=128)
SEARCHED_AND_LEARNED: dict[str, Callable[[], Recipe]] = {
    "w4g128-rtn-search": lambda: Recipe("w4g128-rtn-search", (_search(bits=4),),
                                        "W4 asymmetric g128, grid per group searched (H-weighted output error)"),
    "w4g128-rtn-search-sym": lambda: Recipe("w4g128-rtn-search-sym", (_search(bits=4, symmetric=True),),
                                            "W4 symmetric (16 codes) g128, grid per group searched (H-weighted)"),
    "w4g128-gptq-search": lambda: Recipe("w4g128-gptq-search", (_gptq(bits=4, grid="search"),),
                                         "GPTQ W4 asymmetric g128, act-order, searched static grids"),
    "w4g128-gptq-search-sym": lambda: Recipe("w4g128-gptq-search-sym", (_gptq(bits=4, symmetric=True, grid="search"),),
                                             "GPTQ W4 symmetric (16 codes) g128, act-order, searched static grids"),
    "w4g128-awq-rtn-search": lambda: Recipe("w4g128-awq-rtn-search", (_awq(bits=4, clip=False), _search(bits=4)),
                                            "AWQ scales, then W4 asymmetric g128 RTN on searched grids"),
    "w4g128-awq-gptq-search": lambda: Recipe("w4g128-awq-gptq-search", (_awq(bits=4, clip=False), _gptq(bits=4, grid="search")),
                                             "AWQ scales, then GPTQ W4 asymmetric g128 on searched static grids"),
    "w4g128-signround": lambda: Recipe("w4g128-signround", (_signround(bits=4),),
                                       "SignRound W4 asymmetric g128 (learned rounding + grid, <= 200 iters/block within 20 min, searched init)"),
    "w4g128-signround-sym": lambda: Recipe("w4g128-signround-sym", (_signround(bits=4, symmetric=True),),
                                           "SignRound W4 symmetric (16 codes) g128, <= 200 iters/block within 20 min, searched init"),
    "w4g128-awq-signround": lambda: Recipe("w4g128-awq-signround", (_awq(bits=4, clip=False), _signround(bits=4)),
                                           "AWQ scales, then SignRound W4 asymmetric g128 (<= 200 iters/block within 20 min, searched init)"),
    "w3g128-rtn-search": lambda: Recipe("w3g128-rtn-search", (_search(bits=3),),
                                        "W3 asymmetric g128, grid per group searched (H-weighted)"),
    "w3g128-gptq-search": lambda: Recipe("w3g128-gptq-search", (_gptq(bits=3, grid="search"),),
                                         "GPTQ W3 asymmetric g128, act-order, searched static grids"),
    "w2g64-gptq-search": lambda: Recipe("w2g64-gptq-search", (_gptq(bits=2, group_size=64, grid="search"),),
                                        "GPTQ W2 asymmetric g64, act-order, searched static grids"),
    "w3g128-awq-gptq-search": lambda: Recipe("w3g128-awq-gptq-search", (_awq(bits=3, clip=False), _gptq(bits=3, grid="search")),
                                             "AWQ scales, then GPTQ W3 asymmetric g128 on searched static grids"),
    "w3g128-signround": lambda: Recipe("w3g128-signround", (_signround(bits=3),),
                                       "SignRound W3 asymmetric g128 (<= 200 iters/block within 20 min, searched init)"),
    "w3g128-awq-signround": lambda: Recipe("w3g128-awq-signround", (_awq(bits=3, clip=False), _signround(bits=3)),
                                           "AWQ scales, then SignRound W3 asymmetric g128 (<= 200 iters/block within 20 min, searched init)"),
}
RECIPES.update(SEARCHED_AND_LEARNED)


def _search(**kw):

    return SearchedRTN(**{**_G128, **kw})


SIGNROUND_BUDGET_S = 1200.0  # wall seconds for the whole SignRound step of the built-in recipes


def _signround(**kw):

    return SignRound(**{**_G128, "init": "search", "time_budget": SIGNROUND_BUDGET_S, **kw})


_LAYERS = r"layers_\d+/.*"


def _rot(name: str, description: str, *then, act_bits: int | None = None) -> Recipe:

    return Recipe(name, (Rotation(then=tuple(then), act_bits=act_bits),), description)


def _gptq(**kw):

    return GPTQ(**kw)


def _awq(**kw):

    return AWQ(**kw)


def recipe_names() -> list[str]:
    return list(RECIPES)


def embedding_rule_dict(kind: str) -> dict[str, Any]:
    """The recipe-file rule of an embedding option: ``int8`` per row (symmetric), ``int4`` groups of 32
    (asymmetric, float16 scales), or ``w7a8``: 7-bit integers per row in int8 storage, and a tied LM head's
    input activations int8 per token (the head runs as W8A8; onnxruntime's fast u8 x s8 GEMM is exact with
    it; an untied table is read by no matmul and is only stored in 7 bits)."""
    if kind not in EMBEDDINGS:
        raise RecipeError(f"unknown embedding option {kind!r}; choose one of {', '.join(EMBEDDINGS)}")
    base = {"pattern": ".*", "role": "embedding"}
    return {
        "int8": {**base, "bits": 8, "symmetric": True, "granularity": "channel"},
        "int4": {**base, "bits": 4, "symmetric": False, "granularity": "group", "group_size": 32, "scale_dtype": "float16"},
        "w7a8": {**base, "bits": 7, "symmetric": True, "granularity": "channel", "act_bits": 8},
    }[kind]


def embedding_step(kind: str) -> RTN:
    """An RTN step quantizing the embedding table(s) as :func:`embedding_rule_dict` says."""

    return RTN((rule_from_dict(embedding_rule_dict(kind)),), name=f"embedding-{kind}")


def with_embedding(recipe: Recipe, kind: str) -> Recipe:
    """``recipe`` followed by :func:`embedding_step` (named ``<recipe>+emb-<kind>``); before a final
    ``+f16`` / ``+bf16`` step, which must stay last (``w4g128-rtn+f16`` -> ``w4g128-rtn+emb-int8+f16``)."""
    import dataclasses


    had = [s.name for s in recipe.steps if str(getattr(s, "name", "")).startswith("embedding-")]
    if had:
        raise RecipeError(f"conflicting embedding options (recipe {recipe.name!r}): expected one embedding step, "
                          f"found {had[0]!r} and another, emb-{kind}")
    steps, tail = list(recipe.steps), []
    while steps and isinstance(steps[-1], HalfFloats):
        tail.insert(0, steps.pop())
    base, sep, half = recipe.name.rpartition("+")
    name = f"{base}+emb-{kind}+{half}" if tail and sep and half in ("f16", "bf16") else f"{recipe.name}+emb-{kind}"
    return dataclasses.replace(recipe, name=name, steps=tuple(steps) + (embedding_step(kind),) + tuple(tail))


def with_half_floats(recipe: Recipe, kind: str) -> Recipe:
    """``recipe`` followed by :class:`~eqjax.methods.halffloat.HalfFloats` (named ``<recipe>+<kind>``):
    every param it leaves float stored as float16 (``f16``) or bfloat16 (``bf16``)."""
    import dataclasses


    if kind not in HALF_KINDS:
        raise RecipeError(f"unknown float storage option {kind!r}; choose one of {', '.join(HALF_KINDS)}")
    return dataclasses.replace(recipe, name=f"{recipe.name}+{kind}",
                               steps=tuple(recipe.steps) + (HalfFloats(HALF_KINDS[kind]),))


def _weight_only(recipe: Recipe, suffix: str) -> None:
    """Refuse training (``+bqat`` / ``+qat``) for a recipe that quantizes nothing, quantizes activations or the
    KV cache, or rotates (training takes weight-only QArrays)."""
    where = f"recipe {recipe.name!r} with +{suffix}"
    if recipe.kv is not None:
        raise RecipeError(f"{where}: expected a weight-only recipe, found KV-cache quantization")
    for s in recipe.steps:
        acts = [r for r in getattr(s, "rules", ()) if getattr(r, "act_bits", None) is not None]
        if acts or isinstance(s, (SmoothQuant, ZeroQuantLKD, Rotation)) or getattr(s, "act_bits", None) is not None:
            raise RecipeError(f"{where}: expected a weight-only recipe, found step {s.name!r} "
                              "(activation quantization or a rotation)")
    if not any(getattr(s, "name", "") != "half" and not isinstance(s, HalfFloats) for s in recipe.steps):
        raise RecipeError(f"{where}: expected a recipe that quantizes weights, found no quantizing step")


def with_qat(recipe: Recipe, step: QAT | None = None) -> Recipe:
    """``recipe`` followed by end-to-end quantization-aware training (named ``<recipe>+qat``). Refused for a
    recipe that quantizes nothing, quantizes activations or the KV cache, or rotates (QAT trains
    weight-only QArrays)."""
    import dataclasses

    _weight_only(recipe, "qat")
    return dataclasses.replace(recipe, name=f"{recipe.name}+qat", steps=tuple(recipe.steps) + (step or QAT(),),
                               description=f"{recipe.description}; then quantization-aware training")


def with_block_qat(recipe: Recipe, step: BlockQAT | None = None) -> Recipe:
    """``recipe`` followed by block-wise quantization-aware training (named ``<recipe>+bqat``; refused as
    :func:`with_qat` is)."""
    import dataclasses

    _weight_only(recipe, "bqat")
    return dataclasses.replace(recipe, name=f"{recipe.name}+bqat", steps=tuple(recipe.steps) + (step or BlockQAT(),),
                               description=f"{recipe.description}; then block-wise quantization-aware training")


HALF_SUFFIXES = ("f16", "bf16")
TRAINING_SUFFIXES = ("bqat", "qat")
SUFFIXES = TRAINING_SUFFIXES + tuple(f"emb-{k}" for k in EMBEDDINGS) + HALF_SUFFIXES


def _is_file(name: str) -> bool:
    return name.endswith((".toml", ".json"))


def split_suffixes(name: str) -> tuple[str, list[str]]:
    """``(base, suffixes)`` of a recipe name: the longest ``+``-separated prefix that is a built-in recipe or
    a recipe file, and the suffixes after it (``"w8+emb-int8+f16"`` -> ``("w8", ["emb-int8", "f16"])``).
    A :class:`RecipeError` when no prefix is a recipe."""
    parts = name.split("+")
    for i in range(len(parts), 0, -1):
        base = "+".join(parts[:i])
        if base in RECIPES or _is_file(base):
            return base, parts[i:]
    raise RecipeError(f"unknown recipe {name!r}; built-in: {', '.join(RECIPES)}, each optionally with "
                      f"+bqat, then +qat, then +emb-int8 / +emb-int4 / +emb-w7a8, then +f16 / +bf16 (or a .toml/.json file)")


def check_suffixes(name: str, suffixes: list[str]) -> None:
    """Refuse unknown, repeated, conflicting or misordered suffixes (at most one ``+emb-*``, then at most
    one ``+f16`` / ``+bf16``), naming them."""
    where = f"recipe {name!r}"
    for sfx in suffixes:
        if sfx.startswith("emb-") and sfx not in SUFFIXES:
            embedding_rule_dict(sfx[len("emb-"):])  # names the embedding options
        if sfx not in SUFFIXES:
            raise RecipeError(f"unknown recipe suffix ({where}): expected +bqat, then +qat, then "
                              f"{' / '.join('+emb-' + k for k in EMBEDDINGS)}, then +f16 / +bf16, found {'+' + sfx!r}")
    dup = next((x for i, x in enumerate(suffixes) if x in suffixes[:i]), None)
    if dup is not None:
        raise RecipeError(f"repeated recipe suffix ({where}): expected each suffix once, found {'+' + dup!r} twice")
    for kind, group in (("embedding", [x for x in suffixes if x.startswith("emb-")]),
                        ("float storage", [x for x in suffixes if x in HALF_SUFFIXES])):
        if len(group) > 1:
            raise RecipeError(f"conflicting recipe suffixes ({where}): expected at most one {kind} suffix, found "
                              + " and ".join(repr("+" + x) for x in group))
    training = [x for x in suffixes if x in TRAINING_SUFFIXES]
    order = [x for x in TRAINING_SUFFIXES if x in training]
    if suffixes[:len(training)] != order:
        after = next(x for x, y in zip(suffixes, order + [None] * len(suffixes)) if x != y)
        raise RecipeError(f"misordered recipe suffixes ({where}): expected +bqat / +qat first (in that order), right "
                          f"after the base recipe, found {'+' + after!r} in their place")
    suffixes = [x for x in suffixes if x not in TRAINING_SUFFIXES]
    if len(suffixes) == 2 and suffixes[0] in HALF_SUFFIXES:
        raise RecipeError(f"misordered recipe suffixes ({where}): expected +emb-* before +f16 / +bf16, found "
                          f"'+{suffixes[0]}' before '+{suffixes[1]}'")


def get_recipe(name: str) -> Recipe:
    """The built-in recipe ``name`` (optionally ``+emb-int8`` / ``+emb-int4`` / ``+emb-w7a8``, then
    optionally ``+f16`` / ``+bf16``), or a recipe file path (with the same optional suffixes).

    Unknown, repeated (``w8+f16+f16``), conflicting (``w8+f16+bf16``, ``+emb-int8+emb-int4``) or
    misordered suffixes are a :class:`RecipeError` naming them."""
    if not isinstance(name, str):
        raise RecipeError(f"bad recipe name (recipe): expected a string, found {type(name).__name__} {repr(name)[:60]}")
    if not name.strip():
        raise RecipeError(f"empty recipe name (recipe): expected a built-in name ({', '.join(list(RECIPES)[:4])}, ...) "
                          f"or a .toml/.json file, found {name!r}")
    base, suffixes = split_suffixes(name)
    check_suffixes(name, suffixes)
    if base in RECIPES:
        recipe = RECIPES[base]()
    else:

        recipe = load_recipe(base)
    for sfx in suffixes:
        if sfx == "qat":
            recipe = with_qat(recipe)
        elif sfx == "bqat":
            recipe = with_block_qat(recipe)
        else:
            recipe = with_half_floats(recipe, sfx) if sfx in HALF_SUFFIXES else with_embedding(recipe, sfx[len("emb-"):])
    return recipe


def resolve_recipe(recipe: Any, where: str = "recipe") -> "Recipe":
    """A :class:`Recipe` from ``recipe``: a Recipe, a built-in recipe name or a recipe file path; any other
    type is a :class:`RecipeError` naming ``where``."""
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, (str, pathlib.PurePath)):

        return get_recipe(str(recipe))
    raise RecipeError(f"bad recipe ({where}): expected an eqjax Recipe, a built-in recipe name or a .toml/.json "
                      f"file path, found {type(recipe).__name__} {repr(recipe)[:60]}")


# method name -> step class; each class has ``from_config(dict) -> step``.
STEP_TYPES: dict[str, type] = {
    "rtn": RTN,
    "rotation": Rotation,
    "gptq": GPTQ,
    "awq": AWQ,
    "smoothquant": SmoothQuant,
    "zeroquant_lkd": ZeroQuantLKD,
    "rtn_search": SearchedRTN,
    "signround": SignRound,
    "qat": QAT,
    "bqat": BlockQAT,
    "half": HalfFloats,
}


def _step_from_dict(d: Mapping[str, Any], where: str = "step") -> Any:
    d = dict(d)
    method = d.pop("method", None)
    if method not in STEP_TYPES:
        raise RecipeError(f"unknown step method ({where}.method): expected one of {sorted(STEP_TYPES)}, found {method!r}")
    step_cls = STEP_TYPES[method]
    try:
        if isinstance(d.get("then"), list):  # a composite step (rotation): its inner steps are built here
            d["then"] = [_step_from_dict(s, f"then[{i}]") for i, s in enumerate(d["then"])]
        return step_cls.from_config(d)
    except RecipeError as e:
        if getattr(e, "where", None) is not None:  # a SchemaError: put the step's position in front

            raise SchemaError(f"{where}.{e.where}".rstrip("."), e.expected, e.found) from None
        raise
    except (TypeError, ValueError) as e:
        raise RecipeError(f"invalid {method!r} step ({where}): {e}") from None


def recipe_from_dict(d: Mapping[str, Any], *, source: str | None = None) -> Recipe:
    """A recipe from a parsed file: ``{name, description?, steps: [{method, ...}], kv?: {...}}``.

    The dict is checked first (:func:`eqjax.recipes.schema.validate_recipe_dict`: types without coercion,
    unknown and conflicting keys refused); every error is a :class:`RecipeError` naming the key path
    (and ``source``, the file, when given).
    """

    validate_recipe_dict(d, source, STEP_TYPES)
    prefix = f"{source}: " if source else ""
    steps = tuple(_step_from_dict(s, f"{prefix}steps[{i}]") for i, s in enumerate(d["steps"]))
    kv = None
    if d.get("kv") is not None:

        try:
            kv = KVQuant.from_config(dict(d["kv"]))
        except (TypeError, ValueError) as e:
            raise RecipeError(f"invalid kv table ({prefix}kv): {e}") from None
    return Recipe(d["name"], steps, d.get("description", ""), kv)


def _no_duplicate_keys(source: str) -> Any:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise RecipeError(f"duplicate key in a recipe file ({source}: {k!r}): expected each key once, found it twice")
            out[k] = v
        return out

    return hook


def load_recipe(path: str | pathlib.Path) -> Recipe:
    """Read a recipe from a ``.toml`` or ``.json`` UTF-8 file, checked (see :func:`recipe_from_dict`).

    Every problem (missing file, not UTF-8, does not parse, duplicate JSON key, schema violation) is a
    :class:`RecipeError` naming the file.
    """
    p = pathlib.Path(path)
    if not p.exists():
        raise RecipeError(f"recipe file does not exist ({p}): expected a .toml or .json file, found nothing")
    if not p.is_file():
        raise RecipeError(f"recipe path is not a file ({p}): expected a .toml or .json file, found a directory")
    if p.suffix not in (".toml", ".json"):
        raise RecipeError(f"unknown recipe file type ({p}): expected a .toml or .json suffix, found {p.suffix!r}")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise RecipeError(f"cannot read the recipe file ({p}): {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise RecipeError(
            f"recipe file is not UTF-8 ({p}): expected UTF-8 text, found byte 0x{raw[e.start]:02x} at offset {e.start}"
        ) from None
    try:
        if p.suffix == ".toml":
            d = tomllib.loads(text)
        else:
            d = json.loads(text, object_pairs_hook=_no_duplicate_keys(str(p)))
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise RecipeError(f"recipe file does not parse ({p}): {e}") from None
    except RecursionError:
        raise RecipeError(f"recipe file does not parse ({p}): nested too deeply") from None
    recipe = recipe_from_dict(d, source=str(p))
    check_quantizes(d, str(p))
    return recipe
