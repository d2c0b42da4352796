"""A whole quantized model on the GPU: eqjax's Llama with backend="pallas" / "auto" against "xla".

Usage (a CUDA GPU; elsewhere it says so and exits 2)::

    python bench/gpu_model.py --out bench/results/gpu_model_h200 [--deadline-s 200]

Weights are random (normal, std 0.02; this machine has no model hub), so perplexity means nothing
here; what is measured is what the kernels change: prefill time of ``[1, T]`` tokens, per-token decode
time with the KV cache (greedy, one jitted step per token), and agreement of the two backends
(max |logit difference| / max |logit|, and whether the greedy tokens are identical). Shapes:
SmolLM2-135M (the default model: 576 wide, 30 layers) and a Llama-3.2-1B-shaped model (2048 wide,
16 layers, vocabulary cut to 32000). Activations bfloat16, KV cache bfloat16.
Recipes: ``w4g128-rtn`` (W4A16 kernel) and ``w8a8-naive`` (W8A8 kernel, dynamic per-token); ``fp``
(bfloat16 weights) as the baseline. Results are written after every row.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (HERE, HERE.parent):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from kernels import _save, gpu_run_header  # noqa: E402

import eqjax  # noqa: E402
from eqjax.core.linear import use_backend  # noqa: E402
from eqjax.models import LlamaConfig, Model  # noqa: E402
from eqjax.models.generate import greedy_step  # noqa: E402

CONFIGS = {
    "smollm2-135m-shaped": LlamaConfig(vocab=49152, hidden=576, intermediate=1536, n_layers=30, n_heads=9,
                                       n_kv_heads=3, tie_word_embeddings=True, rope_theta=100000.0),
    "llama-1b-shaped": LlamaConfig(vocab=32000, hidden=2048, intermediate=8192, n_layers=16, n_heads=32,
                                   n_kv_heads=8, rope_theta=500000.0),
}
RUNS = (("fp", "xla"), ("w4g128-rtn", "xla"), ("w4g128-rtn", "pallas"), ("w4g128-rtn", "auto"),
        ("w8a8-naive", "xla"), ("w8a8-naive", "pallas"))


def _median_time(fn, n: int) -> float:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _measure(model: Model, params, backend: str, prompt: jax.Array, steps: int, samples: int) -> dict:
    def logits_fn(p, t):
        with use_backend(backend):
            return model.apply(p, t)[0]

    prefill = jax.jit(logits_fn)
    logits = prefill(params, prompt)
    t_prefill = _median_time(lambda: prefill(params, prompt), samples)
    cache = model.init_cache(prompt.shape[0], prompt.shape[1] + steps + 1, jnp.bfloat16)
    with use_backend(backend):
        tok, cache = greedy_step(model, params, prompt, cache)
        toks, times = [tok], []
        for _ in range(steps):
            t0 = time.perf_counter()
            tok, cache = greedy_step(model, params, tok[:, None], cache)
            tok.block_until_ready()
            times.append(time.perf_counter() - t0)
            toks.append(tok)
    return {"logits": np.asarray(logits[0, -64:], np.float32), "tokens": np.asarray(jnp.stack(toks, 1)).tolist(),
            "prefill_ms": t_prefill * 1e3, "decode_ms_per_token": statistics.median(times[2:]) * 1e3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(HERE / "results" / "gpu_model"))
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed (the first two are dropped)")
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--deadline-s", type=float, default=240.0, help="start no new row after this")
    args = ap.parse_args(argv)
    result = gpu_run_header("gpu_model", prompt_len=args.prompt_len, decode_steps=args.steps)
    if result is None:
        return 2
    t0 = time.perf_counter()
    for cname in args.configs:
        model = Model(CONFIGS[cname], dtype="bfloat16")
        fparams = model.init_params(jax.random.key(0))
        prompt = jax.random.randint(jax.random.key(1), (1, args.prompt_len), 0, model.config.vocab, jnp.int32)
        ref = {}
        for recipe, backend in RUNS:
            if time.perf_counter() - t0 > args.deadline_s:
                result["stopped_early"] = True
                break
            if recipe == "fp":
                params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), fparams)
            else:
                params = eqjax.quantize(fparams, eqjax.get_recipe(recipe), model=model)
            row = {"config": cname, "recipe": recipe, "backend": backend, "weights_mb": eqjax.tree_nbytes(params) / 1e6}
            try:
                m = _measure(model, params, backend, prompt, args.steps, args.samples)
            except Exception as e:  # record and go on
                row["note"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
                result["rows"].append(row)
                print(row, flush=True)
                continue
            row.update(prefill_ms=m["prefill_ms"], decode_ms_per_token=m["decode_ms_per_token"])
            if backend == "xla":
                ref[recipe] = m
            elif recipe in ref:
                want = ref[recipe]
                row["max_rel_logit_diff_vs_xla"] = float(np.max(np.abs(m["logits"] - want["logits"]))
                                                         / max(float(np.max(np.abs(want["logits"]))), 1e-30))
                row["greedy_tokens_equal_xla"] = m["tokens"] == want["tokens"]
                row["speedup_decode_vs_xla"] = want["decode_ms_per_token"] / m["decode_ms_per_token"]
                row["speedup_prefill_vs_xla"] = want["prefill_ms"] / m["prefill_ms"]
            result["rows"].append(row)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            result["wall_s"] = round(time.perf_counter() - t0, 1)
            _save(Path(args.out), result, _markdown(result))
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    _save(Path(args.out), result, _markdown(result))
    return 0


def _f(v, spec):
    return "—" if v is None else format(v, spec)


def _markdown(r: dict) -> str:
    lines = [
        "# Quantized model on the GPU: backend pallas vs xla",
        "",
        f"Device: **{r['device']}**; jax {r['jax']}; {r['date']}; prompt [1, {r['prompt_len']}]; "
        f"decode: median of {r['decode_steps'] - 2} greedy steps with a bfloat16 KV cache; wall {r.get('wall_s', '?')} s"
        f"{' (stopped at its deadline)' if r['stopped_early'] else ''}. Random weights: times and agreement only.",
        "",
        "| model shape | recipe | backend | weights MB | prefill ms | decode ms/token | decode speed-up | "
        "max rel. logit diff vs xla | greedy tokens = xla |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for x in r["rows"]:
        lines.append(
            f"| {x['config']} | {x['recipe']} | {x['backend']} | {x['weights_mb']:.1f} | {_f(x.get('prefill_ms'), '.2f')} | "
            f"{_f(x.get('decode_ms_per_token'), '.3f')} | {_f(x.get('speedup_decode_vs_xla'), '.2f')} | "
            f"{_f(x.get('max_rel_logit_diff_vs_xla'), '.1e')} | {x.get('greedy_tokens_equal_xla', '—')} |"
            + (f" {x['note']}" if x.get("note") else ""))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
