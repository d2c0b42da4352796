"""The run report: ``results.json``, ``results.md`` (:func:`markdown_table`) and two PNG plots (weight
histograms of one layer, perplexity against size), written as one set: all or none replaced.
"""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np

from eqjax.core.pytree import get_path
from eqjax.io.atomic import atomic_files, dumps_json
from eqjax.protocol import DEFAULT_PLOT_LAYER, Setup, _hist_bins, layer_histogram, plot_layer_for


def markdown_table(rows: list[dict[str, Any]], protocol: dict[str, Any] | None = None) -> str:
    """The results as a markdown table (plus the protocol line)."""
    head = "| recipe | W bits | A bits | KV | ppl | vs FP | size MB | quantize s | eval tok/s |\n"
    head += "|---|---|---|---|---|---|---|---|---|\n"
    lines = []
    for r in rows:
        d = r.get("delta_pct")
        lines.append(
            f"| {r['recipe']} | {r['w_bits']} | {r['a_bits']} | {r['kv_bits']} | {r['ppl']:.3f} | "
            f"{'—' if d is None else f'{d:+.2f} %'} | {r['size_mb']:.1f} | {r['quantize_seconds']:.1f} | "
            f"{r['eval_tokens_per_s']:.0f} |"
        )
    out = head + "\n".join(lines) + "\n"
    if protocol:
        out += (
            f"\nProtocol: {protocol['model']}; {protocol['text']}; {protocol['eval_windows']} windows x "
            f"{protocol['ctx']} tokens = {protocol['eval_tokens']} tokens ({protocol['predictions']} predictions), "
            f"no BOS, non-overlapping; calibration {protocol['calib_windows']} x {protocol['calib_ctx']} tokens "
            f"from the calibration split, seed {protocol['seed']}.\n"
        )
    return out


def _plot(rows: list[dict[str, Any]], setup: Setup, dest: dict[str, pathlib.Path], layer: str | None) -> list[str]:
    """Draw the report plots into ``dest[name]`` (temporary paths); returns the names drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt


    paths = []
    # 1. weight-value histograms of one layer per method (counts recorded in each row as it finished)
    hist_rows = []
    for r in rows:
        if r.get("_hist") is None and r.get("_params") is not None and layer is not None:
            r = {**r, "_hist": layer_histogram(setup, r["_params"], layer), "_hist_layer": layer}
        if r.get("_hist") is not None and r.get("_hist_layer") == layer:
            hist_rows.append(r)
    if layer is not None and hist_rows:
        n = len(hist_rows)
        cols = min(4, n)
        nrows = -(-n // cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 2.8 * nrows), squeeze=False)
        bins = _hist_bins(setup, layer)
        fp_counts = np.histogram(np.asarray(get_path(setup.params, layer), np.float32).ravel(), bins=bins)[0]
        for ax, r in zip(axes.ravel(), hist_rows):
            ax.stairs(fp_counts, bins, fill=True, color="0.8", label="fp")
            ax.stairs(np.asarray(r["_hist"]), bins, color="C0", label=r["recipe"])
            ax.set_title(f"{r['recipe']}", fontsize=9)
            ax.set_yscale("log")
            ax.tick_params(labelsize=7)
        for ax in axes.ravel()[n:]:
            ax.axis("off")
        fig.suptitle(f"weight values of {layer} (grey: FP32)", fontsize=10)
        fig.tight_layout()
        fig.savefig(dest["weight_histograms.png"], dpi=110, format="png")
        plt.close(fig)
        paths.append("weight_histograms.png")
    # 2. perplexity vs model size
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for r in rows:
        ax.scatter(r["size_mb"], r["ppl"], s=25)
        ax.annotate(r["recipe"], (r["size_mb"], r["ppl"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("model size (MB, stored)")
    ax.set_ylabel(f"perplexity ({setup.protocol['eval_tokens']} tokens, ctx {setup.protocol['ctx']})")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.set_title("perplexity vs size")
    fig.tight_layout()
    fig.savefig(dest["ppl_vs_size.png"], dpi=110, format="png")
    plt.close(fig)
    paths.append("ppl_vs_size.png")
    return paths


REPORT_FILES = ("results.json", "results.md", "weight_histograms.png", "ppl_vs_size.png")


def write_report(rows: list[dict[str, Any]], setup: Setup, out_dir: str | pathlib.Path,
                 json_path: str | pathlib.Path | None = None, plot_layer: str = DEFAULT_PLOT_LAYER
                 ) -> dict[str, pathlib.Path]:
    """Write ``results.json``, ``results.md`` and the two PNG plots into ``out_dir``, and the list of rows
    to ``json_path``, as one set (:func:`~eqjax.io.atomic.atomic_files`): a failure part-way (a full disk)
    leaves every previous file as it was. Strict JSON: a NaN or Inf anywhere is an error naming the key,
    never ``Infinity`` in the file."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    clean = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    texts = {out / "results.json": dumps_json({"protocol": setup.protocol, "results": clean},
                                              source=str(out / "results.json")) + "\n",
             out / "results.md": markdown_table(rows, setup.protocol)}
    if json_path is not None:
        texts[pathlib.Path(json_path)] = dumps_json(clean, source=str(json_path)) + "\n"
    plots = {name: out / name for name in REPORT_FILES if name.endswith(".png")}
    with atomic_files([*texts, *plots.values()]) as tmp:
        for path, text in texts.items():
            tmp[path].write_bytes(text.encode("utf-8"))
        drawn = _plot(rows, setup, {n: tmp[p] for n, p in plots.items()}, plot_layer_for(setup.params, plot_layer))
    files = {"json": out / "results.json", "markdown": out / "results.md"}
    files.update({pathlib.Path(n).stem: plots[n] for n in drawn})
    return files
