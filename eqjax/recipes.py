"""Named recipes, addressable from Python (:func:`get_recipe`) and the CLI (``--recipe NAME``).

Every linear kernel (``.*/kernel``) is quantized; embeddings and norms stay in float (the tied
embedding doubles as the LM head). Group-wise recipes store float16 scales (rounded up), the
per-channel and per-tensor ones float32.
"""

from __future__ import annotations

from typing import Callable

from eqjax.methods.rtn import RTN
from eqjax.numerics import QuantSpec
from eqjax.qarray import per_channel, per_group, per_tensor
from eqjax.recipe import Recipe, RecipeError
from eqjax.rules import LINEAR_KERNELS, Rule

__all__ = ["RECIPES", "get_recipe", "recipe_names", "weight_rule"]


def weight_rule(
    bits: int,
    *,
    symmetric: bool = True,
    group: int | None = None,
    per_tensor_scale: bool = False,
    calibrator: str = "minmax",
    act_bits: int | None = None,
    act_granularity: str = "token",
    pattern: str = LINEAR_KERNELS,
) -> Rule:
    """One rule for all linear kernels: per-channel by default, ``group`` along the input axis."""
    if group is not None:
        gran = per_group(0, group)
    elif per_tensor_scale:
        gran = per_tensor()
    else:
        gran = per_channel(-1)
    scale_dtype = "float16" if group is not None else "float32"
    spec = QuantSpec(bits, symmetric, gran, calibrator, scale_dtype=scale_dtype)
    return Rule(pattern, spec, act_bits, act_granularity)


def _rtn(name: str, description: str, rule: Rule) -> Callable[[], Recipe]:
    return lambda: Recipe(name, (RTN((rule,)),), description)


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
    "w4g128-rtn-sym": _rtn("w4g128-rtn-sym", "W4 symmetric, group 128, round to nearest", weight_rule(4, group=128)),
    "w3g128-rtn": _rtn("w3g128-rtn", "W3 asymmetric, group 128, round to nearest", weight_rule(3, symmetric=False, group=128)),
}


def recipe_names() -> list[str]:
    return list(RECIPES)


def get_recipe(name: str) -> Recipe:
    """The built-in recipe ``name``, or a recipe file path (``.toml``/``.json``)."""
    if name in RECIPES:
        return RECIPES[name]()
    if name.endswith((".toml", ".json")):
        from eqjax.recipe import load_recipe  # noqa: PLC0415

        return load_recipe(name)
    raise RecipeError(f"unknown recipe {name!r}; built-in: {', '.join(RECIPES)} (or a .toml/.json file)")
