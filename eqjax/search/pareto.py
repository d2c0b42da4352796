"""The Pareto report of a mixed-precision search: perplexity of each searched point and of uniform
baselines (:func:`evaluate_pareto`), and its plot (:func:`plot_pareto`)."""

from __future__ import annotations

import pathlib
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from eqjax.core.pytree import flatten, tree_nbytes
from eqjax.evaluate import perplexity
from eqjax.io.atomic import atomic_path
from eqjax.recipes.apply import quantize as run_recipe
from eqjax.recipes.registry import get_recipe
from eqjax.search.layers import (
    Candidate,
    SearchResult,
    _linear_numel,
    _make_recipe,
    avg_bits,
    choice_counts,
    rules_for_picks,
    uniform_picks,
)

__all__ = ["evaluate_pareto", "plot_pareto"]


def evaluate_pareto(model: Any, params: Any, res: SearchResult, windows: np.ndarray, *, method: str = "rtn",
                    baselines: Sequence[tuple[str, Candidate | str]] = (("uniform w4g128a", Candidate(4, 128)),
                                                                        ("uniform w3g128a", Candidate(3, 128)),
                                                                        ("uniform w8pc", Candidate(8, None, True))),
                    calibration: np.ndarray | None = None, matched: bool = True,
                    progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Perplexity (``eqjax.evaluate.perplexity``) of FP, uniform baselines and each Pareto point.

    A baseline is a :class:`Candidate` on every searched kernel (applied by ``method``) or a built-in recipe
    name (applied as it is). ``matched``: for each baseline, also the searched mix at <= that baseline's whole
    bytes (``kind`` = ``"searched <= <label>"``), the like-for-like comparison. ``calibration``: token windows
    for calibrated methods and recipes."""

    say = progress or (lambda s: None)
    numel = _linear_numel(res.layers)
    fixed = res.total_bytes - res.searched_bytes
    fp = perplexity(model, params, windows)
    fp_bytes16 = sum(int(np.prod(np.shape(x))) for _, x in flatten(params)) * 2
    pts: list[dict[str, Any]] = [{"kind": "fp32", "ppl": fp.ppl, "total_bytes": tree_nbytes(params),
                                  "fp16_total_bytes": fp_bytes16}]
    say(f"fp32 ppl {fp.ppl:.3f}")

    def measure(kind: str, recipe: Any, extra: dict[str, Any]) -> dict[str, Any]:
        calib = calibration if recipe.needs_calibration else None
        qp = run_recipe(params, recipe, model=model, calibration=calib)
        r = perplexity(model, qp, windows)
        pt = {"kind": kind, "ppl": r.ppl, "total_bytes": tree_nbytes(qp), **extra}
        pts.append(pt)
        say(f"{kind}: {pt['total_bytes'] / 1e6:.2f} MB, ppl {r.ppl:.3f}")
        return pt

    def run(kind: str, picks: list[int], extra: dict[str, Any]) -> dict[str, Any]:
        sb = sum(L.nbytes[j] for L, j in zip(res.layers, picks))
        recipe = _make_recipe(kind, kind, method, rules_for_picks(res.layers, picks))
        lin = sum(L.nbytes[j] for L, j in zip(res.layers, picks) if not L.is_embedding)
        return measure(kind, recipe, {"avg_bits": avg_bits(res.layers, picks), "searched_bytes": sb,
                                      "ratio_vs_fp16_linears": (numel * 2) / lin, **extra})

    for lab, base in baselines:
        if isinstance(base, str):
            pt = measure(lab, get_recipe(base), {"recipe": base})
        else:
            try:
                pt = run(lab, uniform_picks(res.layers, base), {})
            except ValueError as e:
                say(f"skip {lab}: {e}")
                continue
        pk = res.picks_within(pt["total_bytes"] - fixed) if matched else None
        if pk is not None:
            run(f"searched <= {lab}", pk, {"matched": lab, "choice_counts": choice_counts(res.layers, pk)})
    for p in res.pareto:
        run(f"searched {p['budget_bits']}b", p["picks"], {"budget_bits": p["budget_bits"],
                                                         "proxy_error": p["proxy_error"],
                                                         "choice_counts": p["choice_counts"]})
    return pts


def plot_pareto(report: Mapping[str, Any], path: str | pathlib.Path) -> None:
    """PNG of ppl (or proxy error when no ppl) vs average bits: searched curve and uniform baselines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = report["pareto"]
    fig, ax = plt.subplots(figsize=(6, 4))
    if pts and "ppl" in pts[0]:
        mb = lambda p: p["total_bytes"] / 1e6  # noqa: E731
        s = [p for p in pts if "budget_bits" in p]
        ax.plot([mb(p) for p in s], [p["ppl"] for p in s], "o-", label="searched (exact knapsack)")
        for p in pts:
            if p["kind"] == "fp32":
                ax.axhline(p["ppl"], ls="--", c="k", lw=0.8, label="fp32")
                ax.axhline(p["ppl"] * 1.05, ls=":", c="gray", lw=0.8, label="fp32 + 5 %")
            elif "matched" in p:
                ax.plot(mb(p), p["ppl"], "*", ms=10, label=p["kind"])
            elif "budget_bits" not in p:
                ax.plot(mb(p), p["ppl"], "s", label=p["kind"])
        ax.set_ylabel("perplexity")
        ax.set_yscale("log")
        ax.set_xlabel("whole artifact MB")
    else:
        ax.plot([p["avg_bits"] for p in pts], [p["proxy_error"] for p in pts], "o-")
        ax.set_ylabel("summed proxy error")
        ax.set_yscale("log")
        ax.set_xlabel("average stored bits per linear weight")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
