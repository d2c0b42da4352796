"""onnxruntime (CPU) latency and perplexity of eqjax's ONNX exports of SmolLM2-135M.

Usage::

    python bench/onnx.py                       # ~5-10 min on 2 shared CPU cores
    python bench/onnx.py --eval-windows 2 --prefill 256 --decode-tokens 8

Variants (all exported with ``decode=True``: one graph, empty past for prefill):

  fp32            recipe ``fp``: MatMul on float32 initializers
  w8a8-sq (ours)  recipe ``w8a8-smoothquant`` (SmoothQuant alpha 0.85 folded into the norms/kernels, W8
                  per-channel symmetric + A8 per-token dynamic): hand-built per-token int8 quantization +
                  MatMulInteger
  w4 (ours)       W4 asymmetric RTN, group 128 where it divides the input (1536), else 64 (576):
                  com.microsoft MatMulNBits (accuracy_level unset = 0)
  ort-dynamic     ``onnxruntime.quantization.quantize_dynamic`` of the fp32 export (defaults: QInt8
                  weights per tensor, MatMul only; dynamic uint8 per-tensor activations ->
                  DynamicQuantizeLinear + MatMulInteger)
  w8 (ours)       weight-only W8 per-channel: DequantizeLinear -> MatMul, measured under two settings
                  of ``session.qdq_matmulnbits_accuracy_level`` (0: float activations, the default in
                  eqjax.export.onnx.make_session; 4: onnxruntime 1.32's own default, int8 activations)

Each figure: median of ``--reps`` prefill runs of ``--prefill`` tokens (batch 1) after one warm-up;
decode tokens/s: ``--decode-tokens`` single-token steps after a prefill of ``--prefill`` tokens. Perplexity
on the first ``--eval-windows`` windows of ``--eval-len`` tokens of the Wikipedia evaluation half (a small
slice, stated in the report; eqjax's own figure on the same windows is given for our exports).
Writes ``bench/results/onnx.json`` and ``onnx.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# this file is named onnx.py: keep its own directory off sys.path so `import onnx` finds the package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402


def _feeds_empty(sess, tokens):
    feeds = {"input_ids": np.asarray(tokens, np.int64)}
    for inp in sess.get_inputs():
        if inp.name.startswith("past_"):
            feeds[inp.name] = np.zeros((tokens.shape[0], inp.shape[1], 0, inp.shape[3]), np.float32)
    return feeds


def time_session(sess, tokens, reps, decode_tokens):
    outs = [o.name for o in sess.get_outputs()]
    feeds = _feeds_empty(sess, tokens)
    sess.run(outs, feeds)  # warm-up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        res = sess.run(outs, feeds)
        ts.append(time.perf_counter() - t0)
    out = {"prefill_ms": 1e3 * statistics.median(ts), "prefill_tokens_per_s": tokens.shape[1] / statistics.median(ts)}
    if decode_tokens and any(o.startswith("present_") for o in outs):
        cur = dict(zip(outs, res))
        nxt = np.argmax(cur["logits"][:, -1], -1)[:, None]
        t0 = time.perf_counter()
        for _ in range(decode_tokens):
            f = {"input_ids": nxt.astype(np.int64)}
            for name in outs:
                if name.startswith("present_"):
                    f[name.replace("present_", "past_")] = cur[name]
            cur = dict(zip(outs, sess.run(outs, f)))
            nxt = np.argmax(cur["logits"][:, -1], -1)[:, None]
        dt = time.perf_counter() - t0
        out["decode_tokens_per_s"] = decode_tokens / dt
        out["decode_context"] = int(tokens.shape[1])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eval-windows", type=int, default=4)
    ap.add_argument("--eval-len", type=int, default=512)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calib-windows", type=int, default=16)
    ap.add_argument("--only", default=None, help="comma-separated subset of variants")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "onnx"))
    args = ap.parse_args(argv)

    import jax
    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from eqjax.data import calibration_windows, token_windows, wikipedia_tokens
    from eqjax.evaluate import perplexity
    from eqjax.export.onnx import export_onnx, make_session, onnx_perplexity
    from eqjax.io.gguf import load_gguf
    from eqjax.methods.rtn import RTN
    from eqjax.models import Model
    from eqjax.pytree import tree_nbytes
    from eqjax.recipe import Recipe, quantize
    from eqjax.recipes import get_recipe
    from eqjax.rules import Rule
    from eqjax.search import Candidate

    cfg, params, tok = load_gguf()
    model = Model(cfg)
    cal_ids, eval_ids = wikipedia_tokens(tok)
    windows = token_windows(eval_ids, args.eval_len, args.eval_windows)
    cal = calibration_windows(cal_ids, args.calib_windows, 256, 0)
    prefill = token_windows(eval_ids, args.prefill, 1)
    only = set(args.only.split(",")) if args.only else None
    tmp = Path(tempfile.mkdtemp(prefix="eqjax_onnx_"))

    def w4_params():
        rules = []
        for path, leaf in _kernels(params):
            spec = Candidate(4, 128).spec(int(leaf.shape[0]))
            rules.append(Rule(_re(path), spec))
        return quantize(params, Recipe("w4", (RTN(tuple(rules)),)))

    variants = {
        "fp32": ("fp", lambda: params),
        "w8a8-sq": ("w8a8-smoothquant", lambda: quantize(params, get_recipe("w8a8-smoothquant"), model=model,
                                                          calibration=cal)),
        "w4": ("w4 asym g128 (g64 on 576-wide inputs), RTN", w4_params),
        "w8": ("w8 (per-channel symmetric, weight-only)", lambda: quantize(params, get_recipe("w8"), model=model)),
    }
    results: list[dict] = []
    fp_path = None
    for name, (desc, make) in variants.items():
        if only and name not in only and not (name == "fp32" and "ort-dynamic" in only):
            continue
        t0 = time.perf_counter()
        qp = make()
        path = export_onnx(model, qp, tmp / f"{name}.onnx", decode=True)
        export_s = time.perf_counter() - t0
        if name == "fp32":
            fp_path = path
        print(f"[onnx] exported {name} in {export_s:.0f}s ({path.stat().st_size / 2**20:.0f} MiB)", flush=True)
        jx = perplexity(model, qp, windows, batch_size=1).ppl
        settings = [0, 4] if name == "w8" else [0]
        for lvl in settings:
            sess = make_session(path, threads=args.threads, qdq_accuracy_level=lvl)
            ppl = onnx_perplexity(sess, windows)
            row = {"variant": name if name != "w8" else f"w8 (qdq level {lvl})", "description": desc,
                   "qdq_matmulnbits_accuracy_level": lvl, "file_mib": path.stat().st_size / 2**20,
                   "eqjax_tree_mib": tree_nbytes(qp) / 2**20, "ppl_onnxruntime": ppl, "ppl_eqjax": jx,
                   "ppl_rel_diff": ppl / jx - 1, **time_session(sess, prefill, args.reps, args.decode_tokens)}
            results.append(row)
            print(f"[onnx] {row}", flush=True)
            del sess
        del qp
        if name != "fp32":
            path.unlink()
    if fp_path is not None and (not only or "ort-dynamic" in only):
        qpath = tmp / "ort_dynamic.onnx"
        t0 = time.perf_counter()
        quantize_dynamic(str(fp_path), str(qpath), weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"])
        print(f"[onnx] quantize_dynamic in {time.perf_counter() - t0:.0f}s", flush=True)
        sess = make_session(qpath, threads=args.threads, qdq_accuracy_level=0)
        row = {"variant": "ort-dynamic", "description": "onnxruntime quantize_dynamic(QInt8 weights per tensor, "
               "uint8 per-tensor dynamic activations, MatMul only) of our fp32 export",
               "qdq_matmulnbits_accuracy_level": 0, "file_mib": qpath.stat().st_size / 2**20,
               "ppl_onnxruntime": onnx_perplexity(sess, windows), "ppl_eqjax": None,
               **time_session(sess, prefill, args.reps, args.decode_tokens)}
        results.append(row)
        print(f"[onnx] {row}", flush=True)
    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": args.threads,
                    "onnxruntime": ort.__version__, "jax": jax.__version__},
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized to float32)",
        "eval": {"text": "Wikipedia evaluation half (eqjax.data)", "windows": args.eval_windows, "ctx": args.eval_len,
                 "note": "small slice to keep the run to minutes; ppl differs from the full-split figure"},
        "latency": {"prefill_tokens": args.prefill, "batch": 1, "reps": args.reps, "decode_tokens": args.decode_tokens,
                    "statistic": "median prefill; decode = mean over the steps"},
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(_markdown(report))
    print(f"[onnx] wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0


def _kernels(params):
    from eqjax.pytree import flatten

    for path, leaf in flatten(params):
        if path.endswith("/kernel"):
            yield path, leaf


def _re(path):
    import re

    return re.escape(path)


def _markdown(r) -> str:
    lines = [
        "# onnxruntime CPU: SmolLM2-135M exports",
        "",
        f"{r['date']}, {r['machine']['platform']}, {r['machine']['threads']} threads (intra-op), "
        f"onnxruntime {r['machine']['onnxruntime']}. Eval: {r['eval']['windows']} x {r['eval']['ctx']} tokens of "
        f"the Wikipedia evaluation half ({r['eval']['note']}). Prefill: {r['latency']['prefill_tokens']} tokens, "
        f"batch 1, median of {r['latency']['reps']}; decode: {r['latency']['decode_tokens']} greedy steps after "
        "the prefill, through the past/present KV inputs/outputs.",
        "",
        "| variant | qdq accuracy level | file MiB | ppl (ORT) | ppl (eqjax) | rel. diff | prefill ms | prefill tok/s | decode tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for x in r["results"]:
        jx = "-" if x.get("ppl_eqjax") is None else f"{x['ppl_eqjax']:.3f}"
        rd = "-" if x.get("ppl_eqjax") is None else f"{100 * x['ppl_rel_diff']:+.3f} %"
        lines.append(
            f"| {x['variant']} | {x['qdq_matmulnbits_accuracy_level']} | {x['file_mib']:.0f} | {x['ppl_onnxruntime']:.3f} | "
            f"{jx} | {rd} | {x['prefill_ms']:.0f} | {x['prefill_tokens_per_s']:.0f} | "
            f"{x.get('decode_tokens_per_s', float('nan')):.1f} |")
    lines += ["", "Variants: see the docstring of bench/onnx.py. The qdq accuracy level is the session option "
              "`session.qdq_matmulnbits_accuracy_level` (0 = float activations; 4 = onnxruntime's default, int8 "
              "activations in the DequantizeLinear->MatMul rewrite); it only affects graphs with DequantizeLinear.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
