"""Quantization-aware training on the quality protocol; writes bench/results/qat.{json,md}.

Each row is one ``eqjax eval --recipe <ptq>+qat --qat-tokens N --seed S`` process on SmolLM2-135M: the
post-training recipe runs first on the calibration windows (Wikipedia calibration split, ``--calib-windows``
x 512 tokens, drawn with the seed), then QAT trains on those same windows (the calibration split only) for
``N`` tokens, distilling from the float model; the model is then measured on the evaluation windows (32 x 1024
Wikipedia tokens) and on the news text. The table sets each row against the float model, the best
post-training recipe of its width and AutoRound's best run of its width, on the same token ids
(bench/results/quality.json, bench/results/peers.json: the same protocol, measured earlier on this machine
type; named in the table). Rows are appended as they finish; a rerun skips rows already measured.

Usage: python bench/qat.py [--recipes w3g128-gptq-search+qat,...] [--qat-tokens 131072] [--seeds 0,1,2]
       [--calib-windows 128] [--eval-tokens 32768] [--qat-lr LR] [--qat-block-iters N]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from eqjax.methods.blockqat import BlockQAT  # noqa: E402
from eqjax.methods.qat import QAT  # noqa: E402

RESULTS = ROOT / "bench" / "results"
OUT = RESULTS / "qat.json"


def machine() -> str:
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or "unknown CPU"
    return f"{cpu}, {os.cpu_count()} CPUs"


def run_one(recipe: str, seed: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = pathlib.Path(d) / "row.json"
        cmd = [sys.executable, "-m", "eqjax.cli", "eval", "--recipe", recipe, "--seed", str(seed),
               "--eval-tokens", str(args.eval_tokens), "--eval-len", "1024", "--calib-windows", str(args.calib_windows),
               "--calib-len", "512", "--also-eval", "news", "--json", str(out)]
        if recipe.endswith("+qat"):
            cmd += ["--qat-tokens", str(args.qat_tokens)]
            if args.qat_lr is not None:
                cmd += ["--qat-lr", str(args.qat_lr)]
        if "+bqat" in recipe and args.qat_block_iters is not None:
            cmd += ["--qat-block-iters", str(args.qat_block_iters)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            return {"recipe": recipe, "seed": seed, "error": (proc.stderr or proc.stdout)[-800:]}
        row = json.loads(out.read_text())
        row.pop("protocol", None)
        row.update(seed=seed, process_seconds=wall, machine=machine())
        return row


def _lr(row: dict) -> float | None:
    """The scale learning rate a row trained with (None: a row without QAT)."""
    return row.get("step_reports", {}).get("qat", {}).get("lr_scale")


def _tokens(row: dict) -> int | None:
    """The QAT training tokens of a row (0: a row without QAT; None: a failed row, which records none)."""
    if "error" in row:
        return None
    return row.get("step_reports", {}).get("qat", {}).get("tokens", 0)


def _block_iters(row: dict) -> int | None:
    """The block-wise stage's steps per block of a row (None: a row without one)."""
    return row.get("step_reports", {}).get("bqat", {}).get("iters")


def _width(recipe: str) -> str | None:
    m = re.match(r"w(\d)g(\d+)", recipe)
    return None if m is None else f"w{m.group(1)}g{m.group(2)}"


def references() -> dict:
    """Float perplexity, best post-training eqjax recipe and best AutoRound run per width (same protocol)."""
    rows = []
    for f in sorted(RESULTS.glob("quality*.json")):  # every quality table under the same protocol
        q = json.loads(f.read_text())
        proto = q.get("protocol", {}) if isinstance(q, dict) else {}
        if all(proto.get(k) == v for k, v in {"eval_tokens": 32768, "ctx": 1024, "calib_ctx": 512}.items()):
            rows += [{**r, "source": f.name} for r in q["rows"] if "ppl" in r and r.get("calib_windows", 0) in (0, 128)]
    fp = next(r for r in rows if r["recipe"] == "fp")
    ref: dict = {"fp": fp["ppl"], "fp_news": fp.get("ppl_news"), "ptq": {}, "autoround": {}}
    for r in rows:  # weight-only recipes of a width; rotated and KV recipes are other families
        w = _width(r["recipe"])
        if w is None or "rot" in r["recipe"] or str(r.get("a_bits")) not in ("None", "16", "32") or "+" in r["recipe"]:
            continue
        best = ref["ptq"].get(w)
        if best is None or r["ppl"] < best["ppl"]:
            ref["ptq"][w] = {"recipe": r["recipe"], "ppl": r["ppl"], "ppl_news": r.get("ppl_news"), "source": r["source"]}
    peers = RESULTS / "peers.json"
    for r in (json.loads(peers.read_text())["rows"] if peers.is_file() else []):
        if r.get("tool") != "auto-round" or "ppl" not in r:
            continue
        m = re.search(r"w(\d)g(\d+)", r["name"])
        w = m and f"w{m.group(1)}g{m.group(2)}"
        if w and (w not in ref["autoround"] or r["ppl"] < ref["autoround"][w]["ppl"]):
            ref["autoround"][w] = {"name": r["name"], "ppl": r["ppl"]}
    return ref


def machines(rows: list[dict]) -> str:
    """Where the rows ran: one machine, or each machine with its rows (numbered from 1)."""
    by: dict[str, list[int]] = {}
    for i, r in enumerate(rows, 1):
        by.setdefault(r.get("machine", machine()), []).append(i)
    if len(by) <= 1:
        return f"Machine: {next(iter(by), machine())}."
    return "Machines: " + "; ".join(f"{m} (row{'s' if len(ix) > 1 else ''} {', '.join(map(str, ix))})"
                                    for m, ix in by.items()) + "."


def markdown(rows: list[dict], ref: dict, protocol: dict) -> str:
    fp = ref["fp"]
    lines = ["# Quantization-aware training (SmolLM2-135M, Wikipedia)", "",
             f"Protocol: {protocol['eval_tokens']} evaluation tokens in windows of 1024; training and calibration on "
             f"{protocol['calib_windows']} x 512 tokens of the calibration split; QAT distils from the float model "
             f"(KL on the logits), batches of 2 x 512 tokens; Adam in grid units (learning rates of the latent weights and "
             f"zero points in quantization steps, of the scales relative), warmup 5 %, cosine decay to a tenth. "
             f"Float: {fp:.3f}. {machines(rows)}", "",
             "Block-wise stage (`+bqat`): per decoder block, Adam steps on one calibration batch (8 x 512 tokens) each "
             "against the float block's outputs; 'block steps / s' gives the steps per block and the stage's seconds.", "",
             "| recipe | seed | block steps / s | train tokens | steps | lr weight / scale | train s | total s | ppl "
             "| news ppl | vs float | best PTQ at width | gap closed | AutoRound best |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['recipe']} | {r['seed']} | error: {r['error'][-120:]!r} |")
            continue
        w = _width(r["recipe"])
        rep = r.get("step_reports", {}).get("qat", {})
        brep = r.get("step_reports", {}).get("bqat")
        block = "" if brep is None else f"{brep['iters']} / {brep['seconds']:.0f}"
        ptq = ref["ptq"].get(w)
        ar = ref["autoround"].get(w)
        ptq_s = "" if ptq is None else "{:.3f} ({})".format(ptq["ppl"], ptq["recipe"])
        ar_s = "" if ar is None else "{:.3f} ({})".format(ar["ppl"], ar["name"])
        gap = "" if ptq is None or ptq["ppl"] <= fp else f"{100 * (ptq['ppl'] - r['ppl']) / (ptq['ppl'] - fp):.1f} %"
        lines.append(
            f"| {r['recipe']} | {r['seed']} | {block} | {rep.get('tokens', '')} | {rep.get('steps', '')} | "
            f"{rep.get('lr_weight', '')} / {rep.get('lr_scale', '')} | "
            f"{rep.get('seconds', float('nan')):.0f} | {r['process_seconds']:.0f} | {r['ppl']:.3f} | "
            f"{r.get('ppl_news', float('nan')):.3f} | {100 * (r['ppl'] / fp - 1):+.1f} % | "
            f"{ptq_s} | {gap} | {ar_s} |")
    lines += ["", "## Targets", ""]
    for label, measured, met in targets(rows, ref):
        lines.append(f"* {label}: {measured}: {'met' if met else 'NOT met'}")
    return "\n".join(lines) + "\n"


def targets(rows: list[dict], ref: dict) -> list[tuple[str, str, bool]]:
    out = []
    ok = [r for r in rows if "ppl" in r]
    for w, need in (("w2g64", 50.0), ("w3g128", 50.0)):
        mine = [r for r in ok if _width(r["recipe"]) == w and r["recipe"].endswith("+qat")]
        ptq, ar = ref["ptq"].get(w), ref["autoround"].get(w)
        if not mine or ptq is None:
            continue
        best = min(mine, key=lambda r: r["ppl"])
        gap = 100 * (ptq["ppl"] - best["ppl"]) / (ptq["ppl"] - ref["fp"])
        out.append((f"{w}: QAT closes >= {need:.0f} % of the gap between the best PTQ ({ptq['recipe']}) and float",
                    f"{gap:.1f} % ({best['recipe']}, {best['ppl']:.3f})", gap >= need))
        if ar is not None:
            only = " (its round-to-nearest mode: no trained AutoRound run at this width measured)" \
                if ar["name"].endswith("-i0") else ""
            out.append((f"{w}: QAT beats AutoRound's best measured {w} run ({ar['name']} {ar['ppl']:.3f}){only}",
                        f"{best['ppl']:.3f}", best["ppl"] < ar["ppl"]))
    w4 = [r for r in ok if _width(r["recipe"]) == "w4g128" and r["recipe"].endswith("+qat")]
    by_recipe: dict[str, list[float]] = {}
    for r in w4:
        by_recipe.setdefault(r["recipe"], []).append(r["ppl"])
    ar = ref["autoround"].get("w4g128")
    for name, ppls in by_recipe.items():
        if len(ppls) >= 3 and ar is not None:
            mean, spread = statistics.mean(ppls), max(ppls) - min(ppls)
            out.append((f"w4g128: {name} beats AutoRound's best ({ar['ppl']:.3f}) by more than twice its seed spread",
                        f"mean {mean:.3f}, spread {spread:.3f} over {len(ppls)} seeds, lead {ar['ppl'] - mean:.3f}",
                        ar["ppl"] - mean > 2 * spread))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default="w3g128-gptq-search+qat")
    ap.add_argument("--qat-tokens", type=int, default=131072)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--calib-windows", type=int, default=128)
    ap.add_argument("--eval-tokens", type=int, default=32768)
    ap.add_argument("--qat-lr", type=float, default=None, help="eqjax eval --qat-lr (default: the QAT step's)")
    ap.add_argument("--qat-block-iters", type=int, default=None,
                    help="eqjax eval --qat-block-iters for +bqat recipes (default: the step's)")
    ap.add_argument("--rerun", action="store_true", help="measure rows again even if present (same learning rate)")
    args = ap.parse_args()
    protocol = {"eval_tokens": args.eval_tokens, "calib_windows": args.calib_windows, "ctx": 1024, "calib_ctx": 512}
    data = json.loads(OUT.read_text()) if OUT.is_file() else {"protocol": protocol, "rows": []}
    if data.get("protocol") != protocol:
        data = {"protocol": protocol, "rows": []}
    ref = references()
    lr = args.qat_lr if args.qat_lr is not None else QAT.lr_scale
    for recipe in [r.strip() for r in args.recipes.split(",") if r.strip()]:
        for seed in [int(s) for s in args.seeds.split(",")]:
            tokens = args.qat_tokens if recipe.endswith("+qat") else 0
            want = lr if recipe.endswith("+qat") else None
            biters = (args.qat_block_iters if args.qat_block_iters is not None else BlockQAT.iters) \
                if "+bqat" in recipe else None
            same = [r for r in data["rows"] if r["recipe"] == recipe and r["seed"] == seed and _lr(r) == want
                    and _block_iters(r) == biters and _tokens(r) in (tokens, None)]  # another budget is another row
            have = [r for r in same if "error" not in r]
            if have and not args.rerun:
                continue
            print(f"{recipe} seed {seed} ...", flush=True)
            row = run_one(recipe, seed, args)
            data["rows"] = [r for r in data["rows"] if not any(r is x for x in same)] + [row]
            OUT.write_text(json.dumps(data, indent=1))
            OUT.with_suffix(".md").write_text(markdown(data["rows"], ref, protocol))
            print(row.get("ppl", row.get("error")), flush=True)
    OUT.with_suffix(".md").write_text(markdown(data["rows"], ref, protocol))
    print(OUT.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
