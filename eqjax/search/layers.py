"""Mixed-precision bit-width search: per-layer sensitivity + an exact multiple-choice knapsack.

Pipeline (:func:`search`):

1. **Statistics.** One eager forward pass of the float model over the calibration windows records, for
   every linear layer, the input second moment ``H = E[x x^T]`` (``[in, in]``, over all tokens).
2. **Sensitivity proxy.** For each layer and each candidate (bits, group) the weight is quantized with
   RTN and scored by the Hessian-weighted error ``tr(dW^T H dW) = E ||x dW||^2``: the expected squared
   output error of that layer alone (the layer-wise objective GPTQ minimizes). That error says nothing
   of how much the rest of the network amplifies it, so the default proxy ``kl``
   (:func:`eqjax.search.sensitivity.calibrate_kl`) measures, once per layer, the KL of the logits with that layer
   alone quantized at 3 bits (one forward pass per layer, not per candidate) and carries it to the layer's
   other candidates in proportion to their Hessian error. Other proxies: ``hessian``, ``relative``
   (Hessian error / output energy), ``weight`` (plain ``||dW||^2``).
   :func:`eqjax.search.sensitivity.validate_proxy` measures single-layer KL at other bit widths on other windows
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
stored size of the whole param tree (:func:`eqjax.core.pytree.tree_nbytes`), unsearched params (embeddings,
norms, float32) included.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eqjax.calibration.statistics import xtx
from eqjax.core.numerics import QuantSpec, fake_quantize, quantize
from eqjax.core.pytree import flatten, flatten_with_paths, get_path
from eqjax.core.qarray import per_channel, per_group
from eqjax.methods.halffloat import HALF_KINDS
from eqjax.recipes.apply import model_context
from eqjax.recipes.registry import embedding_rule_dict, recipe_from_dict
from eqjax.recipes.rules import Rule
from eqjax.recipes.types import Recipe, window_batches
from eqjax.search.knapsack import BudgetError, solve_mck

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
    "layer_options",
    "searched_shapes",
    "smallest_bytes",
    "solve_mck",
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
    built-in embedding option of :func:`eqjax.recipes.registry.embedding_rule_dict` (``int8``, ``int4``), or the
    float table stored in 16 bits (``f16``, ``bf16``: :class:`~eqjax.methods.halffloat.HalfFloats`)."""

    kind: str = "float"

    def label(self, k_in: int | None = None) -> str:
        return f"emb-{self.kind}"

    def rule_dict(self, pattern: str = ".*", k_in: int | None = None) -> dict[str, Any] | None:
        """The option's recipe-file rule (role ``embedding``); a 16-bit option's carries ``half`` (its
        dtype) and ``pattern`` (the tables' paths), and becomes a ``half`` step of its own; float: None."""

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
    (:mod:`eqjax.calibration.calibrate`)."""

    cal = _search_calibrator(model, params, windows, batch_size)
    paths, leaves, _ = flatten_with_paths(params)
    flat = dict(zip(paths, leaves))
    out: dict[str, np.ndarray] = {}

    def per_block(bc: Any, p: dict[str, Any]) -> dict[str, Any]:
        uses = [u for u in bc.uses if _searchable(cal, u, p)]
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


def _search_calibrator(model: Any, params: Any, windows: np.ndarray, batch_size: int = 8) -> Any:
    ctx = model_context(model, params, None)
    ctx.batches = window_batches(windows, batch_size)
    return ctx.calibrator("search")


def _searchable(cal: Any, use: Any, flat: Mapping[str, Any]) -> bool:
    """A float ``[in, out]`` matmul weight: what the search assigns a candidate to."""
    leaf = flat[use.path]
    return (len(use.shape) == 2 and use.contracting == (0,) and hasattr(leaf, "ndim")
            and jnp.issubdtype(leaf.dtype, jnp.floating) and cal.analysis.roles[use.path].kind == "matmul")


def searched_shapes(model: Any, params: Any, windows: np.ndarray) -> dict[str, tuple[int, ...]]:
    """``{weight path: shape}`` of the kernels :func:`collect_hessians` records, from tracing the model
    alone (no forward pass): what a budget can be checked against before any statistics are gathered."""
    cal = _search_calibrator(model, params, windows[:1], 1)
    paths, leaves, _ = flatten_with_paths(params)
    flat = dict(zip(paths, leaves))
    return {u.path: tuple(int(d) for d in u.shape) for u in cal.analysis.uses if _searchable(cal, u, flat)}


def layer_options(k_in: int, candidates: Sequence["Candidate"]) -> tuple["Candidate", ...]:
    """The candidates distinct for a layer of ``k_in`` inputs (groups adjusted to the width)."""
    seen: dict[tuple, Candidate] = {}
    for c in candidates:
        seen.setdefault((c.bits, layer_group(k_in, c.group), c.symmetric), c)
    return tuple(seen.values())


def smallest_bytes(shape: tuple[int, ...], candidates: Sequence["Candidate"]) -> int:
    """Stored bytes of a ``shape`` kernel at its smallest candidate."""
    return min(_qbytes(shape, c.spec(int(shape[0]))) for c in layer_options(int(shape[0]), candidates))


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

    layers = []
    for n, (path, h) in enumerate(sorted(hessians.items(), key=lambda kv: _natural(kv[0]))):
        w = jnp.asarray(get_path(params, path), jnp.float32)
        k_in = int(w.shape[0])
        opts = layer_options(k_in, candidates)
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
      recipe: a :class:`Recipe` (one step of ``method`` with the rules) usable with ``eqjax.recipes.apply.quantize``.
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
        """The recipe as a file-ready dict (``eqjax.recipes.registry.recipe_from_dict`` reads it back)."""
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

    return recipe_from_dict(_recipe_dict(name, description, method, rule_dicts))


def _fixed_bytes(params: Any, searched: set[str]) -> int:
    total = 0
    for path, leaf in flatten(params):
        if path not in searched and hasattr(leaf, "shape"):
            total += int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


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
