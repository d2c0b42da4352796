"""Checks of the arguments a recipe runs on: the model and params given to :func:`eqjax.quantize`,
rule patterns that match nothing, recipes that quantize nothing, group sizes no axis fits.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from eqjax.core.errors import InputError, RecipeError
from eqjax.core.pytree import flatten
from eqjax.core.qarray import is_quantized
from eqjax.recipes.rules import assign
from eqjax.recipes.schema import _is_int
from eqjax.recipes.types import Recipe

_FOREIGN = {"torch": "a PyTorch module", "tensorflow": "a TensorFlow object", "keras": "a Keras model"}


def check_model_arg(model: Any, where: str) -> None:
    """Refuse a model of another framework (a ``torch.nn.Module``, a Keras model) with an
    :class:`InputError` naming ``where``: eqjax traces JAX functions and Flax modules only."""
    for cls in type(model).__mro__:
        root = (getattr(cls, "__module__", "") or "").split(".")[0]
        if root in _FOREIGN:
            raise InputError(f"unsupported model ({where}): expected an eqjax Model, a Flax linen/NNX module, a "
                             f"Hugging Face Flax model or a JAX function fn(params, *args), found "
                             f"{_FOREIGN[root]} ({type(model).__module__}.{type(model).__name__}); convert it to "
                             "Flax/JAX first")


def check_params_arg(params: Any, where: str) -> None:
    """``params`` must be a non-empty param tree (a dict of arrays): an :class:`InputError` naming ``where``
    otherwise (e.g. the arguments given in the wrong order)."""
    if isinstance(params, Mapping) and params:
        return
    found = "an empty dict" if isinstance(params, Mapping) else f"{type(params).__name__} {repr(params)[:60]}"
    raise InputError(f"bad params ({where}): expected the model's param tree (a non-empty dict of arrays), found "
                     f"{found}")


_QUANTIZING_STEPS = frozenset({"RTN", "GPTQ", "SearchedRTN", "SignRound", "ZeroQuantLKD"})


def _quantizing_step(step: Any) -> bool:
    then = getattr(step, "then", None)
    if then is not None:
        return any(_quantizing_step(t) for t in then)
    return type(step).__name__ in _QUANTIZING_STEPS


def check_quantized_something(recipe: "Recipe", before: Mapping[str, Any], after: Mapping[str, Any]) -> None:
    """A recipe with a quantizing step must have quantized at least one param (``after`` vs ``before``, by
    path); else a :class:`RecipeError` naming the recipe and its steps."""

    if not any(_quantizing_step(s) for s in recipe.steps):
        return
    if any(is_quantized(v) and not is_quantized(before.get(p)) for p, v in after.items()):
        return
    names = [getattr(s, "name", type(s).__name__) for s in recipe.steps]
    raise RecipeError(f"recipe quantized nothing (recipe {recipe.name!r}, steps {names}): expected at least one param "
                      "quantized, found every param left as it was (its rules select no param of the role they name, "
                      "or only skip = true)")


def check_rule_patterns(recipe: "Recipe", paths: list[str]) -> None:
    """Before any step runs: every rule pattern (and step ``pattern``) of the steps up to the first one that
    may add params (a rotation) must match at least one param path, else a :class:`RecipeError` naming the
    pattern and the step."""
    import re

    for i, step in enumerate(recipe.steps):
        if getattr(step, "then", None) is not None:
            return  # a rotation adds params (an untied LM head): later patterns may name them
        name = getattr(step, "name", type(step).__name__)
        patterns = [getattr(r, "pattern", None) for r in getattr(step, "rules", None) or ()]
        patterns.append(getattr(step, "pattern", None))
        for pat in (p for p in patterns if isinstance(p, str)):
            if not any(re.fullmatch(pat, p) for p in paths):
                raise RecipeError(f"rule matches no parameter (recipe {recipe.name!r}, step {i} {name!r}, pattern "
                                  f"{pat!r}): expected a pattern matching at least one param path (e.g. "
                                  f"{paths[0]!r}), found none")


_TRANSFORM_METHODS = frozenset({"smoothquant", "awq"})


def _quantizing(step: Mapping[str, Any]) -> bool:
    if step.get("method") == "rotation":
        return any(isinstance(t, Mapping) and _quantizing(t) for t in step.get("then") or ())
    return step.get("method") not in _TRANSFORM_METHODS


def check_quantizes(d: Mapping[str, Any], source: str) -> None:
    """A recipe file must quantize something: a step that quantizes (not only ``smoothquant`` / ``awq`` /
    a rotation without ``then``) or a ``kv`` table; else a :class:`RecipeError` naming the file."""
    steps = [s for s in d.get("steps") or () if isinstance(s, Mapping)]
    if d.get("kv") is None and not any(_quantizing(s) for s in steps):
        found = ", ".join(str(s.get("method")) for s in steps) or "no steps"
        raise RecipeError(f"recipe quantizes nothing ({source}: steps): expected a quantizing step (rtn, gptq, "
                          f"rtn_search, signround, zeroquant_lkd, half, rotation with then) or a [kv] table, found "
                          f"{found}")


def check_recipe_fits(recipe: Any, params: Any) -> list[str]:
    """Warn (logging, and returned) when a group size exceeds the grouped axis of *every* parameter its
    rule or step matches: each is then one (short) group, i.e. per channel, which is almost never what
    the recipe meant. A group larger than only some axes is the documented short-last-group layout.
    Absurd group sizes are refused earlier by the schema (``group_size`` in 1..65536)."""
    import logging


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
                axes = [a + len(shape) if a < 0 else a for a in g.axes]
                if all(0 <= a < len(shape) for a in axes):
                    span = int(np.prod([shape[a] for a in axes], dtype=np.int64))
                    groups.setdefault(f"rule {rule.pattern!r}", (g.group_size, []))[1].append(span)
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
