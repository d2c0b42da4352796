"""Running an exported package in onnxruntime: sessions, a plain KV-cache loop, perplexity, the self-check.

The plain loop is what a user without onnxruntime-genai writes: prefill with an empty cache, then one
token at a time feeding ``present.*`` back as ``past_key_values.*``, ``attention_mask`` all ones of the
total length and ``position_ids`` continuing the positions. ``cache="grow"`` feeds the past at its
exact length (fused ``GroupQueryAttention`` appends); ``cache="buffer"`` feeds fixed ``capacity`` slots
(onnxruntime-genai's shared buffer, and what the unfused fallback graph computes).
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import time
from typing import Any

import numpy as np

from eqjax.evaluate import by_block_logits, is_streamed, ulp_bumped
from eqjax.export.graph import ExportError

__all__ = ["make_session", "Runner", "perplexity", "check_against_eqjax"]


def make_session(path: Any, *, threads: int | None = None, optimization: str = "all",
                 qdq_accuracy_level: int | None = 0) -> Any:
    """An onnxruntime CPU session for a model file / directory / ModelProto.

    ``qdq_accuracy_level`` sets ``session.qdq_matmulnbits_accuracy_level`` (onnxruntime rewrites
    DequantizeLinear -> MatMul into MatMulNBits with it; 0 keeps float activations).
    """
    import onnx
    import onnxruntime as ort

    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    so.graph_optimization_level = {"all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
                                   "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                                   "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                                   "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL}[optimization]
    if qdq_accuracy_level is not None:
        so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(qdq_accuracy_level))
    if isinstance(path, onnx.ModelProto):
        src: Any = path.SerializeToString()
    else:
        p = pathlib.Path(path)
        src = str(p / "model.onnx" if p.is_dir() else p)
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


class Runner:
    """Prefill / decode through a decoder session with genai's input names (see the module docs)."""

    def __init__(self, session: Any, head_dim: int | None = None) -> None:
        self.sess = session
        self.inputs = {i.name: i for i in session.get_inputs()}
        self.outputs = [o.name for o in session.get_outputs()]
        self.n_layers = sum(1 for n in self.inputs if n.startswith("past_key_values.") and n.endswith(".key"))
        k0 = self.inputs["past_key_values.0.key"].shape
        self.kv_heads = int(k0[1])
        self.head_dim = int(k0[3]) if isinstance(k0[3], int) else int(head_dim)  # genai's builder: symbolic
        self.simple = "attention_mask" not in self.inputs  # a bare graph: only input_ids

    def _run(self, ids: np.ndarray, past: list[np.ndarray], length: int) -> tuple[np.ndarray, list[np.ndarray]]:
        B, T = ids.shape
        feeds = {"input_ids": ids.astype(np.int64), "attention_mask": np.ones((B, length + T), np.int64),
                 "position_ids": np.broadcast_to(length + np.arange(T, dtype=np.int64), (B, T)).copy()}
        for i in range(self.n_layers):
            feeds[f"past_key_values.{i}.key"], feeds[f"past_key_values.{i}.value"] = past[2 * i], past[2 * i + 1]
        res = self.sess.run(self.outputs, {k: v for k, v in feeds.items() if k in self.inputs})
        d = dict(zip(self.outputs, res))
        pres = []
        for i in range(self.n_layers):
            pres += [d[f"present.{i}.key"], d[f"present.{i}.value"]]
        return d["logits"], pres

    def empty(self, batch: int, slots: int) -> list[np.ndarray]:
        return [np.zeros((batch, self.kv_heads, slots, self.head_dim), np.float32) for _ in range(2 * self.n_layers)]

    def logits(self, tokens: np.ndarray, *, cache: str = "grow") -> np.ndarray:
        """Prefill logits ``[B, T, V]`` of ``tokens [B, T]``."""
        tokens = np.asarray(tokens)
        past = self.empty(tokens.shape[0], 0 if cache == "grow" else tokens.shape[1])
        return self._run(tokens, past, 0)[0]

    def greedy(self, prompt: np.ndarray, new_tokens: int, *, cache: str = "grow", capacity: int | None = None,
               timing: bool = False) -> tuple[np.ndarray, dict]:
        """Greedy continuation ``[B, T0 + new_tokens]`` and timings (prefill s, decode tokens/s)."""
        prompt = np.asarray(prompt, np.int64)
        B, T0 = prompt.shape
        cap = capacity or (T0 + new_tokens)
        past = self.empty(B, 0 if cache == "grow" else cap)
        t0 = time.perf_counter()
        logits, past = self._run(prompt, past, 0)
        t1 = time.perf_counter()
        out = [np.argmax(logits[:, -1], -1)]
        length = T0
        for _ in range(new_tokens - 1):
            logits, past = self._run(out[-1][:, None], past, length)
            length += 1
            out.append(np.argmax(logits[:, -1], -1))
        t2 = time.perf_counter()
        info = {"prefill_s": t1 - t0, "decode_tokens_per_s": (new_tokens - 1) / (t2 - t1) if new_tokens > 1 else None}
        return np.concatenate([prompt, np.stack(out, 1)], 1), info


def perplexity(runner: Runner, windows: np.ndarray) -> float:
    """exp(mean next-token NLL) over ``windows [n, T]`` (one prefill per window, float64 log-softmax)."""
    total, count = 0.0, 0
    for w in np.asarray(windows):
        lg = runner.logits(w[None])[0, :-1].astype(np.float64)
        m = lg.max(-1, keepdims=True)
        lse = np.log(np.exp(lg - m).sum(-1)) + m[:, 0]
        nll = lse - lg[np.arange(len(w) - 1), w[1:]]
        total += float(nll.sum())
        count += nll.size
    return float(math.exp(total / count))


def eqjax_reference(model: Any, params: Any, *, accuracy_level: int | None = 0, prompt_len: int = 7, seed: int = 0,
                    tokens: Any = None) -> dict:
    """What :func:`compare_with_eqjax` holds a package to: the check tokens ``[1, T]``, eqjax's logits of them
    and the tolerance (see :func:`check_against_eqjax`). Computed one decoder block at a time for eqjax's own
    models (the dequantized weights of a large model never in memory together; ``params`` may then be read on
    demand, :func:`eqjax.evaluate.is_streamed`), else with ``model.apply``."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    toks = rng.integers(0, model.config.vocab, (1, prompt_len + 1)) if tokens is None else np.asarray(tokens)[None]

    def logits(p: Any) -> np.ndarray:
        if hasattr(model, "layer_names") and hasattr(model, "block"):
            return by_block_logits(model, p, toks)
        return np.asarray(model.apply(p, jnp.asarray(toks, jnp.int32))[0])

    ref = logits(params)
    scale = float(np.abs(ref).max())
    tol, spread = 2e-3, None
    if accuracy_level:

        bumped = (dataclasses.replace(params, load=lambda paths: ulp_bumped(params.load(paths), 1))
                  if is_streamed(params) else ulp_bumped(params, 1))
        spread = float(np.abs(logits(bumped) - ref).max()) / scale
        tol = max(0.1, 2 * spread)
    return {"tokens": toks, "logits": ref, "tolerance": tol, "spread": spread}


def compare_with_eqjax(package: Any, reference: dict) -> dict:
    """Prefill and one decode step of ``reference``'s tokens in onnxruntime against its logits (from
    :func:`eqjax_reference`); raises :class:`~eqjax.export.graph.ExportError` beyond its tolerance."""
    toks, ref, tol = reference["tokens"], reference["logits"], reference["tolerance"]
    prompt_len = toks.shape[1] - 1
    r = Runner(make_session(package))
    # onnxruntime-genai's shared buffer (fixed slots), which fused and fallback graphs both take
    lg, past = r._run(toks[:, :prompt_len], r.empty(1, toks.shape[1]), 0)
    lg2, _ = r._run(toks[:, prompt_len:], past, prompt_len)
    got = np.concatenate([lg, lg2], 1)
    rel = float(np.abs(got - ref).max()) / float(np.abs(ref).max())
    top1 = float(np.mean(np.argmax(got, -1) == np.argmax(ref, -1)))
    out = {"max_rel_diff": rel, "tolerance": tol, "eqjax_one_ulp_spread": reference["spread"],
           "top1_agreement": top1, "tokens": int(toks.shape[1])}
    if not rel <= tol:
        raise ExportError(f"the exported graph's logits differ from eqjax's by {rel:.3g} of their range (> {tol}); "
                          "the package was not written")
    return out


def check_against_eqjax(model: Any, params: Any, package: Any, *, accuracy_level: int | None = 0,
                        prompt_len: int = 7, seed: int = 0, tokens: Any = None) -> dict:
    """Prefill and one decode step of a random prompt in onnxruntime vs eqjax's ``model.apply``.

    ``tokens`` (natural text, e.g. the package writer's check sentence) replace the random prompt. Tolerance
    on ``max |logits_ort - logits_eqjax| / max |logits_eqjax|``: 2e-3 with float activations (accuracy
    level 0: summation order and fused kernels only). With int8 activations (W8A8, or level 4) a float sum
    that differs in its last bit flips an activation code and the flip propagates through the layers, so
    the oracle is eqjax's own spread: the same model with every float param scaled by ``1 + 2**-23`` (one
    ulp); the tolerance is ``max(0.1, 2 x that spread)`` (on SmolLM2 W8A8 the one-ulp spread alone reaches
    0.11 of the logit range). Raises :class:`~eqjax.export.graph.ExportError` beyond.
    """
    ref = eqjax_reference(model, params, accuracy_level=accuracy_level, prompt_len=prompt_len, seed=seed,
                          tokens=tokens)
    return compare_with_eqjax(package, ref)
