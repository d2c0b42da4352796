"""Perplexity, throughput, model size and peak memory under one stated protocol.

Protocol (the same as the reference numbers in ``shared/REFERENCES.md``): the evaluation text is
tokenized whole (no BOS), cut into non-overlapping windows of ``ctx`` tokens; every window is scored
independently from position 0, so each window gives ``ctx - 1`` predictions; perplexity is
``exp(total NLL / total predictions)`` in float64 on the host from float32 per-window sums.
"""

from __future__ import annotations

import dataclasses
import resource
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eqjax.pytree import tree_nbytes

__all__ = ["PplResult", "perplexity", "window_nll", "peak_rss_mb", "model_size_bytes"]


@dataclasses.dataclass(frozen=True)
class PplResult:
    """Perplexity of one model on a set of windows.

    Attributes:
      ppl: perplexity.
      nll: mean negative log-likelihood per prediction (nats).
      predictions: number of scored next-token predictions (``windows * (ctx - 1)``).
      tokens: tokens fed (``windows * ctx``).
      ctx: window length.
      windows: number of windows.
      seconds: wall time of the scoring, excluding compilation.
      compile_seconds: time to trace and compile the scoring function.
      tokens_per_s: ``tokens / seconds``.
    """

    ppl: float
    nll: float
    predictions: int
    tokens: int
    ctx: int
    windows: int
    seconds: float
    compile_seconds: float
    tokens_per_s: float


def window_nll(model: Any, params: Any, tokens: jax.Array, kv_quant: Any = None) -> jax.Array:
    """Summed next-token NLL of each window: ``tokens [B, T]`` -> float32 ``[B]`` (``T - 1`` terms each)."""
    logits, _ = model.apply(params, tokens, kv_quant=kv_quant)
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    tgt = tokens[:, 1:]
    nll = -jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
    return jnp.sum(nll, axis=-1)


def perplexity(
    model: Any,
    params: Any,
    windows: np.ndarray,
    *,
    batch_size: int = 2,
    kv_quant: Any = None,
    progress: bool = False,
) -> PplResult:
    """Perplexity of ``model`` with ``params`` on ``windows`` (int32 ``[n, ctx]``), jitted and batched.

    The last batch is padded with repeats of the first window and the padding is not counted.
    """
    windows = np.asarray(windows)
    if windows.ndim != 2 or windows.shape[0] == 0 or windows.shape[1] < 2:
        raise ValueError(f"windows must be int [n >= 1, ctx >= 2], got shape {windows.shape}")
    n, ctx = windows.shape
    bs = max(1, min(batch_size, n))
    fn = jax.jit(lambda p, t: window_nll(model, p, t, kv_quant))
    t0 = time.perf_counter()
    compiled = fn.lower(params, jnp.zeros((bs, ctx), jnp.int32)).compile()
    compile_s = time.perf_counter() - t0
    sums: list[np.ndarray] = []
    batches = range(0, n, bs)
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, desc="eval", unit="batch", leave=False)
    t0 = time.perf_counter()
    for i in batches:
        chunk = windows[i : i + bs]
        real = chunk.shape[0]
        if real < bs:
            chunk = np.concatenate([chunk, np.repeat(windows[:1], bs - real, axis=0)])
        out = np.asarray(compiled(params, jnp.asarray(chunk, jnp.int32)))
        sums.append(out[:real].astype(np.float64))
    seconds = time.perf_counter() - t0
    total = float(np.sum(np.concatenate(sums)))
    preds = n * (ctx - 1)
    if not np.isfinite(total):
        raise FloatingPointError(f"non-finite NLL on {n} windows: the (quantized) model produced NaN/Inf logits")
    nll = total / preds
    return PplResult(
        ppl=float(np.exp(nll)),
        nll=nll,
        predictions=preds,
        tokens=n * ctx,
        ctx=ctx,
        windows=n,
        seconds=seconds,
        compile_seconds=compile_s,
        tokens_per_s=n * ctx / seconds if seconds > 0 else float("inf"),
    )


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, MiB (Linux ``ru_maxrss`` is KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def model_size_bytes(params: Any) -> int:
    """Stored size of a param tree: float leaves at their dtype, quantized leaves as packed."""
    return tree_nbytes(params)
