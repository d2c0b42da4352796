"""Mixed-precision bit-width search: per-layer sensitivity + an exact multiple-choice knapsack.

Pipeline (:func:`search`):

1. **Statistics.** One eager forward pass of the float model over the calibration windows records, for
   every linear layer, the input second moment ``H = E[x x^T]`` (``[in, in]``, over all tokens).
2. **Sensitivity proxy.** For each layer and each candidate (bits, group) the weight is quantized with
   RTN and scored by the Hessian-weighted error ``tr(dW^T H dW) = E ||x dW||^2``: the expected squared
   output error of that layer alone (the layer-wise objective GPTQ minimizes). That error says nothing
   of how much the rest of the network amplifies it, so the default proxy ``kl``
   (:func:`eqjax.sensitivity.calibrate_kl`) measures, once per layer, the KL of the logits with that layer
   alone quantized at 3 bits (one forward pass per layer, not per candidate) and carries it to the layer's
   other candidates in proportion to their Hessian error. Other proxies: ``hessian``, ``relative``
   (Hessian error / output energy), ``weight`` (plain ``||dW||^2``).
   :func:`eqjax.sensitivity.validate_proxy` measures single-layer KL at other bit widths on other windows
   and reports each proxy's rank correlation with it.
3. **Knapsack.** Minimize the summed proxy subject to the summed true storage bytes (packed codes +
   scales + zero points, exactly as :attr:`QArray.nbytes`) <= budget: a multiple-choice knapsack solved
   exactly by dynamic programming over the size axis in units of ``u`` bytes (sizes rounded *up*, the
   capacity rounded *down*, so the answer always fits; ``u = 1`` is exact, the default ``u`` keeps
   ~200k cells, a rounding slack of at most ``n_layers * u`` bytes). One DP table gives the optimum for
   every budget at once (the Pareto curve).

Groups run along a layer's input as the built-in recipes lay them out: where the group does not divide the
width, the last group is shorter (SmolLM2's 576 = 4 x 128 + 64), so a uniform candidate is exactly the
recipe of the same name (``w4g128a`` = ``w4g128-rtn``) and the search can always fall back to it.

Budgets: ``budget_bits`` is the average stored bits per weight over the searched (linear) kernels,
metadata included (W4 g128 asymmetric with float16 scales is 4.1875); ``budget_bytes`` is the total
stored size of the whole param tree (:func:`eqjax.pytree.tree_nbytes`), unsearched params (embeddings,
norms, float32) included.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eqjax.numerics import QuantSpec, fake_quantize, quantize
from eqjax.pytree import flatten
from eqjax.qarray import per_channel, per_group
from eqjax.recipe import Recipe
from eqjax.rules import Rule
from eqjax.knapsack import BudgetError, mck_table, solve_mck

__all__ = [
    "Candidate",
    "EmbeddingCandidate",
    "DEFAULT_CANDIDATES",
    "BudgetError",
    "SearchResult",
    "Layer",
    "layer_group",
    "collect_hessians",
    "layer_table",
    "solve_mck",
    "search",
    "avg_bits",
    "choice_counts",
    "PROXIES",
]

PROXIES = ("kl", "relative", "hessian", "weight")
"""Sensitivity proxies :func:`search` accepts (see the module docs)."""




@dataclasses.dataclass(frozen=True)
class Candidate:
    """One quantization choice for a layer: ``bits``, groups of ``group`` along the input (None =
    per output channel), symmetric or not. Group scales are float16 (as the built-in recipes)."""

    bits: int
    group: int | None = 128
    symmetric: bool = False

    def label(self, k_in: int | None = None) -> str:
        g = self.group if k_in is None else layer_group(k_in, self.group)
        gs = "pc" if g is None else f"g{g}"
        return f"w{self.bits}{gs}{'s' if self.symmetric else 'a'}"

    def spec(self, k_in: int) -> QuantSpec:
        g = layer_group(k_in, self.group)
        if g is None:
            return QuantSpec(self.bits, self.symmetric, per_channel(-1), "minmax", scale_dtype="float32")
        return QuantSpec(self.bits, self.symmetric, per_group(0, g), "minmax", scale_dtype="float16")

    def rule_dict(self, pattern: str, k_in: int) -> dict[str, Any]:
        g = layer_group(k_in, self.group)
        d: dict[str, Any] = {"pattern": pattern, "bits": self.bits, "symmetric": self.symmetric}
        if g is None:
            d.update(granularity="channel", axis=-1)
        else:
            d.update(granularity="group", axis=0, group_size=g, scale_dtype="float16")
        return d


DEFAULT_CANDIDATES: tuple[Candidate, ...] = (
    Candidate(2, 32), Candidate(3, 32), Candidate(3, 64), Candidate(3, 128), Candidate(4, 32), Candidate(4, 64),
    Candidate(4, 128), Candidate(8, None, True),
)


@dataclasses.dataclass(frozen=True)
class EmbeddingCandidate:
    """One storage choice for the embedding table(s) (and a tied LM head): ``float`` (as loaded), a
    built-in embedding option of :func:`eqjax.recipes.embedding_rule_dict` (``int8``, ``int4``), or the
    float table stored in 16 bits (``f16``, ``bf16``: :class:`~eqjax.methods.halffloat.HalfFloats`)."""

    kind: str = "float"

    def label(self, k_in: int | None = None) -> str:
        return f"emb-{self.kind}"

    def rule_dict(self, pattern: str = ".*", k_in: int | None = None) -> dict[str, Any] | None:
        """The option's recipe-file rule (role ``embedding``); a 16-bit option's carries ``half`` (its
        dtype) and ``pattern`` (the tables' paths), and becomes a ``half`` step of its own; float: None."""
        from eqjax.methods.halffloat import HALF_KINDS  # noqa: PLC0415
        from eqjax.recipes import embedding_rule_dict  # noqa: PLC0415

        if self.kind in HALF_KINDS:
            return {"role": "embedding", "half": HALF_KINDS[self.kind], "pattern": pattern}
        return None if self.kind == "float" else embedding_rule_dict(self.kind)


def layer_group(k_in: int, group: int | None) -> int | None:
    """The group size used on a layer with ``k_in`` inputs: ``group`` (the last group shorter where it does not
    divide ``k_in``), at most ``k_in``; None = per output channel."""
    return None if group is None else min(group, k_in)


@dataclasses.dataclass(frozen=True)
class Layer:
    """A searchable linear kernel: its path, shape and one (candidate, bytes, proxy errors) per option."""

    path: str  # e.g. "layers_3/attn/q_proj/kernel"
    shape: tuple[int, int]
    options: tuple[Candidate, ...] | tuple[EmbeddingCandidate, ...]
    nbytes: tuple[int, ...]
    errors: Mapping[str, tuple[float, ...]]  # proxy name -> error per option
    covers: tuple[str, ...] = ()  # the param paths its bytes count (default: path alone)

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def is_embedding(self) -> bool:
        return isinstance(self.options[0], EmbeddingCandidate)

    @property
    def paths(self) -> tuple[str, ...]:
        return self.covers or (self.path,)


def _linear_numel(layers: Sequence[Layer]) -> int:
    return sum(L.numel for L in layers if not L.is_embedding)


# ------------------------------------------------------------------------------------ statistics
def collect_hessians(model: Any, params: Any, windows: np.ndarray, *, batch_size: int = 8,
                     progress: Callable[[str], None] | None = None) -> dict[str, np.ndarray]:
    """``{weight path: E[x x^T]}`` (float32 ``[K, K]``, the canonical input order) of every float 2-D
    matmul weight's input on ``windows``, from one block-by-block pass of the float model
    (:mod:`eqjax.calibrate`)."""
    from eqjax.recipe import model_context, window_batches  # noqa: PLC0415
    from eqjax.statistics import xtx  # noqa: PLC0415

    ctx = model_context(model, params, None)
    ctx.batches = window_batches(windows, batch_size)
    cal = ctx.calibrator("search")
    from eqjax.pytree import flatten_with_paths  # noqa: PLC0415

    paths, leaves, _ = flatten_with_paths(params)
    flat = dict(zip(paths, leaves))
    out: dict[str, np.ndarray] = {}

    def per_block(bc: Any, p: dict[str, Any]) -> dict[str, Any]:
        uses = [u for u in bc.uses if len(u.shape) == 2 and u.contracting == (0,) and hasattr(p[u.path], "ndim")
                and jnp.issubdtype(p[u.path].dtype, jnp.floating) and cal.analysis.roles[u.path].kind == "matmul"]
        if uses:
            st = bc.statistics({"xtx": xtx()}, uses)
            out.update({path: np.asarray(v["xtx"]) for path, v in st.items()})
        if progress:
            progress(f"statistics: block {bc.name}")
        return p

    cal.run_blocks(flat, per_block, advance="original")
    if not out:
        raise ValueError("no float [in, out] matmul weight was seen")
    return out


_fq_cache: dict[tuple, Callable] = {}


def _fake_quant(w: jax.Array, spec: QuantSpec) -> jax.Array:
    key = (tuple(w.shape), spec)
    if key not in _fq_cache:
        _fq_cache[key] = jax.jit(lambda a: fake_quantize(a, spec))
    return _fq_cache[key](w)


def _qbytes(shape: tuple[int, ...], spec: QuantSpec) -> int:
    q = jax.eval_shape(lambda a: quantize(a, spec), jax.ShapeDtypeStruct(shape, jnp.float32))
    return int(q.nbytes)


@jax.jit
def _errors(w, wq, h):
    d = (wq - w).astype(jnp.float32)
    hd = jnp.matmul(h, d, precision="highest")
    herr = jnp.sum(d * hd)
    energy = jnp.sum(w * jnp.matmul(h, w, precision="highest"))
    return herr, herr / jnp.maximum(energy, 1e-30), jnp.sum(d * d)


def layer_table(params: Any, hessians: Mapping[str, np.ndarray], candidates: Sequence[Candidate] = DEFAULT_CANDIDATES,
                *, progress: Callable[[str], None] | None = None) -> list[Layer]:
    """One :class:`Layer` per recorded linear kernel: options deduplicated per layer (groups adjusted to
    the width), their stored bytes and proxy errors (``hessian``, ``relative``, ``weight``)."""
    from eqjax.pytree import get_path

    layers = []
    for n, (path, h) in enumerate(sorted(hessians.items(), key=lambda kv: _natural(kv[0]))):
        w = jnp.asarray(get_path(params, path), jnp.float32)
        k_in = int(w.shape[0])
        seen: dict[tuple, Candidate] = {}
        for c in candidates:
            key = (c.bits, layer_group(k_in, c.group), c.symmetric)
            seen.setdefault(key, c)
        opts = tuple(seen.values())
        hj = jnp.asarray(h)
        errs: dict[str, list[float]] = {"hessian": [], "relative": [], "weight": []}
        sizes = []
        for c in opts:
            spec = c.spec(k_in)
            e = _errors(w, _fake_quant(w, spec), hj)
            for name, v in zip(("hessian", "relative", "weight"), e):
                errs[name].append(float(v))
            sizes.append(_qbytes(tuple(w.shape), spec))
        layers.append(Layer(path, tuple(int(s) for s in w.shape), opts, tuple(sizes),
                            {k: tuple(v) for k, v in errs.items()}))
        if progress and (n + 1) % 10 == 0:
            progress(f"sensitivity: {n + 1}/{len(hessians)} layers")
    return layers


def _natural(s: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


# ------------------------------------------------------------------------------------ search
@dataclasses.dataclass(frozen=True)
class SearchResult:
    """What :func:`search` found.

    Attributes:
      recipe: a :class:`Recipe` (one step of ``method`` with the rules) usable with ``eqjax.recipe.quantize``.
      rules: one rule per searched kernel (``re.escape``'d full path), in model order.
      pareto: points ``{avg_bits, searched_bytes, total_bytes, proxy_error, choice_counts}`` of the optimal
        proxy-vs-size curve (plus ``ppl`` where evaluated).
      choices: path -> candidate label.
      searched_bytes / total_bytes / avg_bits: of the chosen solution (``total_bytes`` = whole tree).
      budget_bytes_searched: the byte budget the knapsack got for the searched kernels.
      layers: the per-layer table (sizes and proxy errors per option).
      proxy: the proxy used.
    """

    recipe: Recipe
    rules: tuple[Rule, ...]
    pareto: list[dict[str, Any]]
    choices: dict[str, str]
    searched_bytes: int
    total_bytes: int
    avg_bits: float
    budget_bytes_searched: int
    layers: list[Layer]
    proxy: str

    def recipe_dict(self) -> dict[str, Any]:
        """The recipe as a file-ready dict (``eqjax.recipe.recipe_from_dict`` reads it back)."""
        return _recipe_dict(self.recipe.name, self.recipe.description, self._method, self._rule_dicts)

    _method: str = "rtn"
    _rule_dicts: tuple = ()
    _within: Any = None

    def picks_within(self, searched_bytes: int) -> list[int] | None:
        """The optimal option per layer (indices into ``layers[i].options``) with the searched kernels'
        bytes <= ``searched_bytes``, or None when nothing fits (from the same knapsack table)."""
        return self._within(searched_bytes)


METHODS: dict[str, dict[str, Any]] = {
    "rtn": {"method": "rtn"},
    "gptq": {"method": "gptq"},
    "gptq-search": {"method": "gptq", "grid": "search"},
}
"""How a searched mix is applied: name -> the recipe step (without its rules). ``rtn``: round to nearest;
``gptq``: GPTQ with each layer's own format, one pass (act-order, the built-in recipes' settings);
``gptq-search``: the same on searched grids (as ``w4g128-gptq-search``)."""


def _recipe_dict(name: str, description: str, method: str, rule_dicts: Sequence[Mapping[str, Any] | None]) -> dict[str, Any]:
    """One ``method`` step (:data:`METHODS`, or a step name) for the matmul rules, then one ``rtn`` step for
    embedding rules (if any), then a ``half`` step per 16-bit table option (last: it only stores)."""
    rule_dicts = [r for r in rule_dicts if r is not None]
    mats = [dict(r) for r in rule_dicts if r.get("role") != "embedding"]
    embs = [dict(r) for r in rule_dicts if r.get("role") == "embedding" and "half" not in r]
    halves = [{"method": "half", "dtype": r["half"], "pattern": r["pattern"]} for r in rule_dicts if "half" in r]
    step = dict(METHODS.get(method, {"method": method}))
    steps = [{**step, "rules": mats}] + ([{"method": "rtn", "rules": embs}] if embs else []) + halves
    return {"name": name, "description": description, "steps": steps}


def _make_recipe(name: str, description: str, method: str, rule_dicts: Sequence[Mapping[str, Any]]) -> Recipe:
    from eqjax.recipe import recipe_from_dict

    return recipe_from_dict(_recipe_dict(name, description, method, rule_dicts))


def _fixed_bytes(params: Any, searched: set[str]) -> int:
    total = 0
    for path, leaf in flatten(params):
        if path not in searched and hasattr(leaf, "shape"):
            total += int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


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
        or a step registered in :data:`eqjax.recipe.STEP_TYPES` whose ``from_config`` takes ``rules``.
      proxy: ``"kl"`` (default: measured single-layer KL carried over the options by their Hessian error,
        see :func:`eqjax.sensitivity.calibrate_kl`; with a GPTQ ``method``, each option's error is GPTQ's,
        :func:`eqjax.sensitivity.method_errors`), ``"relative"``, ``"hessian"`` or ``"weight"``.
      cells: DP resolution (size axis cells); the rounding slack is at most ``n_layers * unit`` bytes.
      pareto_bits: average-bit budgets at which the Pareto curve is sampled.
      hessians: precomputed :func:`collect_hessians` output (skips the forward pass).
      kl_windows: token windows for the ``kl`` proxy's forward passes (default: the first two calibration
        windows); kl_ref_bits: the bit width(s) it is measured at (each layer's smallest option of that width;
        several: each option carried from the nearest, :func:`eqjax.sensitivity.calibrate_kl`).
      embedding: embedding options (``"int8"``, ``"int4"``, ``"f16"``, ``"bf16"``) searched beside float for the table(s)
        as one more knapsack item (``kl`` proxy only; :func:`eqjax.sensitivity.embedding_layer`). ``budget_bits`` then means
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
    t0 = time.perf_counter()
    if hessians is None:
        hessians = collect_hessians(model, params, calibration_windows, progress=say)
    say(f"statistics of {len(hessians)} linear layers ({time.perf_counter() - t0:.1f}s)")
    layers = layer_table(params, hessians, candidates, progress=say)
    from eqjax.methods.gptq import GPTQ  # noqa: PLC0415

    step = _make_recipe("probe", "", method, [candidates[0].rule_dict(".*", 128)]).steps[0]
    if proxy == "kl" and isinstance(step, GPTQ):
        from eqjax.sensitivity import method_errors  # noqa: PLC0415 - imports search

        t1 = time.perf_counter()
        layers = method_errors(params, hessians, layers, step, progress=say)
        say(f"{method} errors of every option ({time.perf_counter() - t1:.1f}s)")
    if embedding and proxy != "kl":
        raise ValueError("embedding options are searched with the kl proxy only")
    if proxy == "kl":
        t1 = time.perf_counter()
        kw = calibration_windows[:2] if kl_windows is None else kl_windows
        from eqjax.sensitivity import KLProbe, calibrate_kl, embedding_layer  # noqa: PLC0415 - imports search

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
    if budget_bits is not None:
        if not budget_bits > 0 or not math.isfinite(budget_bits):
            raise BudgetError(f"budget_bits must be a positive number, got {budget_bits}")
        budget = int(budget_bits * numel / 8) + tables
        if budget < min_searched:
            raise BudgetError(
                f"budget of {budget_bits} bits/weight is below the smallest possible model: "
                f"{8 * (min_searched - tables) / numel:.4f} bits/weight ({min_searched} bytes for the {len(layers)} searched "
                f"kernels, every one at its smallest candidate)")
    else:
        budget = int(budget_bytes) - fixed
        if budget < min_searched:
            raise BudgetError(
                f"budget of {int(budget_bytes)} bytes is below the smallest possible model: {fixed + min_searched} "
                f"bytes ({fixed} bytes of unsearched params + {min_searched} bytes of the {len(layers)} kernels at "
                "their smallest candidates)")
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


def rules_for_picks(layers: Sequence[Layer], picks: Sequence[int]) -> tuple[dict[str, Any], ...]:
    """Rule dicts for one option per layer (e.g. a Pareto point's ``picks``); a float table has none."""
    rd = (L.options[j].rule_dict("|".join(re.escape(p) for p in L.paths), L.shape[0]) for L, j in zip(layers, picks))
    return tuple(r for r in rd if r is not None)


def avg_bits(layers: Sequence[Layer], picks: Sequence[int]) -> float:
    """Average stored bits per weight of the linear kernels (metadata included; tables not counted)."""
    return 8 * sum(L.nbytes[j] for L, j in zip(layers, picks) if not L.is_embedding) / _linear_numel(layers)


def choice_counts(layers: Sequence[Layer], picks: Sequence[int]) -> dict[str, int]:
    """How many layers took each option label."""
    out: dict[str, int] = {}
    for L, j in zip(layers, picks):
        lab = L.options[j].label(L.shape[0])
        out[lab] = out.get(lab, 0) + 1
    return out


def uniform_picks(layers: Sequence[Layer], candidate: Candidate) -> list[int]:
    """The option index of ``candidate`` on every layer (groups adjusted as the search adjusts them)."""
    out = []
    for L in layers:
        if L.is_embedding:  # a uniform baseline keeps the tables as loaded
            out.append(0)
            continue
        key = (candidate.bits, layer_group(L.shape[0], candidate.group), candidate.symmetric)
        idx = [i for i, c in enumerate(L.options) if (c.bits, layer_group(L.shape[0], c.group), c.symmetric) == key]
        if not idx:
            raise ValueError(f"{L.path}: {candidate} is not among the searched options")
        out.append(idx[0])
    return out
