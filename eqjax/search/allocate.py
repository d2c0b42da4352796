"""Mixed-precision search: :func:`search` measures every layer's error at every candidate width
(Hessian, relative, weight or KL proxy), solves the multiple-choice knapsack for a size budget and
returns the per-layer recipe.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from eqjax.core.pytree import get_path
from eqjax.methods.gptq import GPTQ
from eqjax.search.knapsack import BudgetError, mck_table
from eqjax.search.layers import (
    DEFAULT_CANDIDATES,
    PROXIES,
    Candidate,
    SearchResult,
    _fixed_bytes,
    _linear_numel,
    _make_recipe,
    avg_bits,
    choice_counts,
    collect_hessians,
    layer_table,
    rules_for_picks,
    searched_shapes,
    smallest_bytes,
)
from eqjax.search.sensitivity import KLProbe, calibrate_kl, embedding_layer, method_errors


def search(
    model: Any,
    params: Any,
    calibration_windows: np.ndarray,
    *,
    budget_bits: float | None = None,
    budget_bytes: int | None = None,
    candidates: Sequence[Candidate] = DEFAULT_CANDIDATES,
    method: str = "rtn",
    proxy: str = "kl",
    cells: int = 200_000,
    pareto_bits: Sequence[float] = (2.5, 3.0, 3.5, 4.0, 4.25, 4.5, 5.0, 6.0, 8.0),
    hessians: Mapping[str, np.ndarray] | None = None,
    name: str | None = None,
    kl_windows: np.ndarray | None = None,
    kl_ref_bits: int | Sequence[int] = 3,
    embedding: Sequence[str] = (),
    progress: Callable[[str], None] | None = None,
) -> SearchResult:
    """Choose a candidate per linear kernel minimizing the summed sensitivity proxy under a size budget.

    Args:
      model, params: an :class:`eqjax.models.Model` and its float params.
      calibration_windows: int ``[n, T]`` token windows for the input statistics.
      budget_bits: average stored bits per searched weight (metadata included), or
      budget_bytes: total stored bytes of the whole quantized param tree. Exactly one is required.
      candidates: options per layer (groups adjusted per layer, see the module docs).
      method: how the rules are applied: a :data:`METHODS` name (``"rtn"``, ``"gptq"``, ``"gptq-search"``)
        or a step registered in :data:`eqjax.recipes.registry.STEP_TYPES` whose ``from_config`` takes ``rules``.
      proxy: ``"kl"`` (default: measured single-layer KL carried over the options by their Hessian error,
        see :func:`eqjax.search.sensitivity.calibrate_kl`; with a GPTQ ``method``, each option's error is GPTQ's,
        :func:`eqjax.search.sensitivity.method_errors`), ``"relative"``, ``"hessian"`` or ``"weight"``.
      cells: DP resolution (size axis cells); the rounding slack is at most ``n_layers * unit`` bytes.
      pareto_bits: average-bit budgets at which the Pareto curve is sampled.
      hessians: precomputed :func:`collect_hessians` output (skips the forward pass).
      kl_windows: token windows for the ``kl`` proxy's forward passes (default: the first two calibration
        windows); kl_ref_bits: the bit width(s) it is measured at (each layer's smallest option of that width;
        several: each option carried from the nearest, :func:`eqjax.search.sensitivity.calibrate_kl`).
      embedding: embedding options (``"int8"``, ``"int4"``, ``"f16"``, ``"bf16"``) searched beside float for the table(s)
        as one more knapsack item (``kl`` proxy only; :func:`eqjax.search.sensitivity.embedding_layer`). ``budget_bits`` then means
        the bytes of linears at that average with the tables float, spent however the search finds best.

    Raises :class:`BudgetError` (with the minimum) when the budget is below the smallest model.
    """
    say = progress or (lambda s: None)
    if (budget_bits is None) == (budget_bytes is None):
        raise BudgetError("give exactly one of budget_bits and budget_bytes")
    if proxy not in PROXIES:
        raise ValueError(f"unknown proxy {proxy!r}: use one of {', '.join(PROXIES)}")
    if not candidates:
        raise ValueError("no candidates")
    missing = sorted({int(b) for b in np.atleast_1d(kl_ref_bits)} - {c.bits for c in candidates})
    if proxy == "kl" and missing:
        raise ValueError(f"kl_ref_bits {missing} is not among the candidates' widths "
                         f"{sorted({c.bits for c in candidates})}")
    if budget_bits is not None and (not budget_bits > 0 or not math.isfinite(budget_bits)):
        raise BudgetError(f"budget_bits must be a positive number, got {budget_bits}")
    if not embedding:  # a budget below the smallest model is refused before the statistics' forward pass
        shapes = (searched_shapes(model, params, calibration_windows) if hessians is None
                  else {p: tuple(np.shape(get_path(params, p))) for p in hessians})
        _budget(budget_bits, budget_bytes, sum(math.prod(s) for s in shapes.values()), _fixed_bytes(params, set(shapes)),
                0, sum(smallest_bytes(s, candidates) for s in shapes.values()), len(shapes))
    t0 = time.perf_counter()
    if hessians is None:
        hessians = collect_hessians(model, params, calibration_windows, progress=say)
    say(f"statistics of {len(hessians)} linear layers ({time.perf_counter() - t0:.1f}s)")
    layers = layer_table(params, hessians, candidates, progress=say)

    step = _make_recipe("probe", "", method, [candidates[0].rule_dict(".*", 128)]).steps[0]
    if proxy == "kl" and isinstance(step, GPTQ):

        t1 = time.perf_counter()
        layers = method_errors(params, hessians, layers, step, progress=say)
        say(f"{method} errors of every option ({time.perf_counter() - t1:.1f}s)")
    if embedding and proxy != "kl":
        raise ValueError("embedding options are searched with the kl proxy only")
    if proxy == "kl":
        t1 = time.perf_counter()
        kw = calibration_windows[:2] if kl_windows is None else kl_windows

        probe = KLProbe(model, params, kw)
        layers = calibrate_kl(model, params, kw, layers, ref_bits=kl_ref_bits, progress=say, probe=probe)
        emb = embedding_layer(model, params, probe, tuple(embedding)) if embedding else None
        layers = layers + ([emb] if emb is not None else [])
        say(f"kl proxy measured on {list(np.shape(kw))} tokens ({time.perf_counter() - t1:.1f}s)"
            + (f"; embedding options {dict(zip([o.kind for o in emb.options], emb.errors['kl']))}" if emb else ""))
    numel = _linear_numel(layers)
    fixed = _fixed_bytes(params, {p for L in layers for p in L.paths})
    tables = sum(L.nbytes[0] for L in layers if L.is_embedding)  # the tables' float bytes
    min_searched = sum(min(L.nbytes) for L in layers)
    max_searched = sum(max(L.nbytes) for L in layers)
    budget = _budget(budget_bits, budget_bytes, numel, fixed, tables, min_searched, len(layers))
    cap = max(budget, int(max(pareto_bits, default=0) * numel / 8) + tables, max_searched)
    cap = min(cap, max_searched)
    unit = max(1, -(-cap // cells))
    errs = [L.errors[proxy] for L in layers]
    tab = mck_table([L.nbytes for L in layers], errs, max(cap, budget), unit)
    say(f"knapsack: {len(layers)} layers x {max(len(L.options) for L in layers)} options, unit {unit} B, "
        f"{len(tab.best)} cells")

    def solution(cap_bytes: int) -> list[int] | None:
        return tab.backtrack(min(cap_bytes, max_searched))

    picks = solution(budget)
    if picks is None:  # rounding slack: the budget fits only with exact sizes
        raise BudgetError(f"budget {budget} bytes cannot be met at knapsack resolution {unit} bytes; raise it slightly")
    searched_bytes = sum(L.nbytes[j] for L, j in zip(layers, picks))
    assert searched_bytes <= budget
    pareto = []
    for b in sorted(set(pareto_bits) | ({budget_bits} if budget_bits else set())):
        pk = solution(int(b * numel / 8) + tables)
        if pk is None:
            continue
        sb = sum(L.nbytes[j] for L, j in zip(layers, pk))
        pareto.append({"budget_bits": b, "avg_bits": avg_bits(layers, pk), "searched_bytes": sb, "total_bytes": sb + fixed,
                       "proxy_error": float(sum(e[j] for e, j in zip(errs, pk))), "choice_counts": choice_counts(layers, pk),
                       "picks": pk})
    rule_dicts = rules_for_picks(layers, picks)
    label = f"{budget_bits}bits" if budget_bits is not None else f"{int(budget_bytes)}B"
    name = name or f"search-{method}-{label}"
    desc = (f"mixed precision found by eqjax.search ({proxy} proxy, exact knapsack): "
            f"{avg_bits(layers, picks):.3f} bits/weight over {sum(not L.is_embedding for L in layers)} kernels"
            + "".join(f", table {L.options[j].kind}" for L, j in zip(layers, picks) if L.is_embedding))
    recipe = _make_recipe(name, desc, method, rule_dicts)
    rules = tuple(recipe.steps[0].rules) if hasattr(recipe.steps[0], "rules") else ()
    choices = {L.path: L.options[j].label(L.shape[0]) for L, j in zip(layers, picks)}
    say(f"solution: {avg_bits(layers, picks):.3f} bits/weight, {searched_bytes} bytes searched, "
        f"{searched_bytes + fixed} total ({time.perf_counter() - t0:.1f}s)")
    res = SearchResult(recipe, rules, pareto, choices, searched_bytes, searched_bytes + fixed,
                       avg_bits(layers, picks), budget, layers, proxy)
    object.__setattr__(res, "_method", method)
    object.__setattr__(res, "_rule_dicts", rule_dicts)
    object.__setattr__(res, "_within", solution)
    return res


def _budget(budget_bits: float | None, budget_bytes: int | None, numel: int, fixed: int, tables: int,
            min_searched: int, n_layers: int) -> int:
    """The searched kernels' byte budget; :class:`BudgetError` when it is below their smallest total."""
    if budget_bits is not None:
        budget = int(budget_bits * numel / 8) + tables
        if budget < min_searched:
            raise BudgetError(
                f"budget of {budget_bits} bits/weight is below the smallest possible model: "
                f"{8 * (min_searched - tables) / numel:.4f} bits/weight ({min_searched} bytes for the {n_layers} searched "
                f"kernels, every one at its smallest candidate)")
        return budget
    budget = int(budget_bytes) - fixed
    if budget < min_searched:
        raise BudgetError(
            f"budget of {int(budget_bytes)} bytes is below the smallest possible model: {fixed + min_searched} "
            f"bytes ({fixed} bytes of unsearched params + {min_searched} bytes of the {n_layers} kernels at "
            "their smallest candidates)")
    return budget
