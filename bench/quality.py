"""Quality of every recipe on SmolLM2 + Wikipedia under one protocol; writes bench/results/quality.{json,md}.

Each recipe runs as ``eqjax eval`` in its own process, so its wall time and peak RSS are its own.
Results are appended to the JSON as they finish (a re-run skips rows already measured under the same
protocol), so a partial run still gives a true, smaller table. Targets are checked against the
measured figures and printed as met / NOT met.

``size MB`` is the whole artifact (every param as stored, :func:`eqjax.core.pytree.tree_nbytes`); ``x fp16`` is
the float16 model's bytes (half the FP row's float32 bytes) over it.

Usage: python bench/quality.py [--eval-tokens 32768] [--calib-windows 128] [--only a,b] [--rerun a,b] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

MAIN = [
    "fp", "w8", "w8-absmax", "w8a8-naive", "w8a8-naive-tensor", "w8a8-smoothquant", "w8a8-smoothquant-a0.5",
    "w8a8-zeroquant", "w8a8-zeroquant-lkd", "w4g128-rtn-sym", "w4g128-rtn", "w4g128-gptq-sym", "w4g128-gptq",
    "w4g128-awq", "w4g128-awq-gptq", "w3g128-rtn", "w3g128-gptq", "w3g128-awq", "kv8", "kv4", "kv2",
    "kv2-outliers", "kv2-nuq", "kv2-nuq-recent",
    # 16-code symmetric grids (w4g128-rtn-sym, w4g128-gptq-sym above), searched grids, learned
    # rounding
    "w4g128-rtn-search", "w4g128-rtn-search-sym", "w4g128-gptq-search", "w4g128-gptq-search-sym",
    "w4g128-awq-rtn-search", "w4g128-awq-gptq-search", "w4g128-signround", "w4g128-signround-sym",
    "w4g128-awq-signround", "w3g128-rtn-search", "w3g128-gptq-search", "w3g128-awq-gptq-search", "w3g128-signround",
    "w3g128-awq-signround",
]
SWEEP = {"w8a8-smoothquant": (16, 32, 64, 128), "w4g128-gptq": (16, 32, 64, 128)}


def _key(row: dict) -> str:
    return f"{row['recipe']}@{row.get('calib_windows', 0)}"


def run_one(recipe: str, args: argparse.Namespace, calib: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = pathlib.Path(d) / "row.json"
        cmd = [sys.executable, "-m", "eqjax.cli", "eval", "--recipe", recipe, "--eval-tokens", str(args.eval_tokens),
               "--eval-len", str(args.ctx), "--calib-windows", str(calib), "--calib-len", str(args.calib_ctx),
               "--json", str(out)] + [a for t in args.also_eval for a in ("--also-eval", t)]
        t0 = time.perf_counter()
        load0 = os.getloadavg()[0]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            return {"recipe": recipe, "error": (proc.stderr or proc.stdout)[-800:], "calib_windows": calib}
        row = json.loads(out.read_text())
        row["process_seconds"] = wall
        row["load_start"], row["load_end"] = load0, os.getloadavg()[0]
        return row


def _load(path: pathlib.Path, protocol: dict) -> list[dict]:
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    if data.get("protocol") != protocol:
        return []
    return data["rows"]


def _gap_closed(rows: dict, method: str, base: str, fp: float) -> float | None:
    if method not in rows or base not in rows:
        return None
    b = rows[base]["ppl"]
    if b <= fp:
        return None
    return 100.0 * (b - rows[method]["ppl"]) / (b - fp)


def targets(rows: list[dict], key: str = "ppl") -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) for each quality target that the rows can answer, on the perplexity
    ``key`` (``ppl``: Wikipedia; ``ppl_news``: the second text, where peers' rows do not exist)."""
    by = {r["recipe"]: {**r, "ppl": r[key]} for r in rows
          if key in r and "ppl" in r and r.get("calib_windows", 0) in (0, MAIN_CALIB)}
    if "fp" not in by:
        return []
    fp = by["fp"]["ppl"]
    out: list[tuple[str, str, bool | None]] = []

    def rel(name: str, limit: float, label: str, with_kv_bytes: bool = False) -> None:
        if name in by:
            d = 100.0 * (by[name]["ppl"] / fp - 1)
            kv = f" at {by[name].get('kv_bytes_per_token', float('nan')):.0f} B/token" if with_kv_bytes else ""
            out.append((label, f"{d:+.2f} %{kv}", d <= limit))

    rel("w8", 0.3, "W8 per-channel weight-only <= FP + 0.3 %")
    rel("w8a8-smoothquant", 1.0, "W8A8 SmoothQuant <= FP + 1.0 %")
    rel("kv4", 1.0, "KV int4 <= FP + 1 %")
    rel("kv2-outliers", 8.0, "KV int2 with 1 % outliers <= FP + 8 %")
    rel("kv2-nuq", 8.0, "KV int2, non-uniform levels, 1 % outliers <= FP + 8 %")
    # the recent block is float16: its bytes stand beside the figure
    rel("kv2-nuq-recent", 8.0, "KV int2 (non-uniform, 1 % outliers) + 32-token float16 recent block <= FP + 8 %",
        with_kv_bytes=True)
    for method, base, need, label in [
        ("w4g128-gptq-sym", "w4g128-rtn-sym", 50, "W4 g128 symmetric: GPTQ closes >= 50 % of RTN's gap"),
        ("w4g128-gptq", "w4g128-rtn", 40, "W4 g128 asymmetric: GPTQ closes >= 40 % of RTN's gap"),
        ("w3g128-gptq", "w3g128-rtn", 75, "W3 g128 asymmetric: GPTQ closes >= 75 % of RTN's gap"),
    ]:
        g = _gap_closed(by, method, base, fp)
        if g is not None:
            out.append((label, f"{g:.1f} %", g >= need))
    best = [(n, _gap_closed(by, n, "w4g128-rtn", fp)) for n in ("w4g128-gptq", "w4g128-awq", "w4g128-awq-gptq")]
    best = [(n, g) for n, g in best if g is not None]
    if best:
        n, g = max(best, key=lambda t: t[1])
        out.append(("best W4 g128 asymmetric closes >= 60 % of RTN's gap", f"{g:.1f} % ({n})", g >= 60))
    if "w8a8-zeroquant-lkd" in by and "w8a8-zeroquant" in by:
        a, b = by["w8a8-zeroquant-lkd"]["ppl"], by["w8a8-zeroquant"]["ppl"]
        out.append(("ZeroQuant + LKD improves over ZeroQuant (W8A8 g64)", f"{a:.3f} vs {b:.3f}", a < b))
    out += search_and_peer_targets(by, fp, peers=key == "ppl")
    if "w4g128-gptq" in by:
        r = by["w4g128-gptq"]
        out.append(("GPTQ W4 quantize time <= 150 s (half the reference's ~300 s)", f"{r['quantize_seconds']:.0f} s", r["quantize_seconds"] <= 150))
        out.append(("GPTQ W4 peak RSS <= 0.9 GB (half the reference's 1.6-1.8 GB)",
                    f"{r['peak_rss_mb'] / 1024:.2f} GiB (whole eval process; FP row: {by['fp']['peak_rss_mb'] / 1024:.2f} GiB)",
                    r["peak_rss_mb"] <= 900))
    return out


MAIN_CALIB = 128


def _autoround_rows() -> list[tuple[str, float]]:
    """(name, ppl) of the AutoRound W4 g128 rows of bench/results/peers.json (same token ids)."""
    path = RESULTS / "peers.json"
    if not path.is_file():
        return []
    rows = json.loads(path.read_text()).get("rows", [])
    return [(r["name"], r["ppl"]) for r in rows if r.get("tool") == "auto-round" and isinstance(r.get("ppl"), float)
            and r.get("config", {}).get("bits") == 4 and r.get("config", {}).get("group") == 128]


def _weight_only(r: dict) -> bool:
    return r.get("a_bits") in (None, 16, 32, "-", "16", "32") and r.get("kv_bits") in (None, 16, 32, "-", "16", "32")


def search_and_peer_targets(by: dict, fp: float, peers: bool = True) -> list[tuple[str, str, bool | None]]:
    """The searched-grid, learned-rounding and peer targets that the rows can answer (AutoRound rows from
    peers.json, which hold Wikipedia perplexities: ``peers=False`` leaves them out)."""
    out: list[tuple[str, str, bool | None]] = []
    if "w4a8-rot-gptq" in by and "w4a8-zeroquant-lkd" in by:
        a, b = by["w4a8-rot-gptq"]["ppl"], by["w4a8-zeroquant-lkd"]["ppl"]
        out.append(("W4A8 with rotation (w4a8-rot-gptq) below W4A8 ZeroQuant-LKD", f"{a:.3f} vs {b:.3f}", a < b))
    if "w4g128-rtn" in by:
        cap = by["w4g128-rtn"]["size_bytes"]
        w4 = [(n, r) for n, r in by.items() if n.startswith("w4g128-") and _weight_only(r) and r["size_bytes"] <= cap]
        prev = by.get("w4g128-awq-gptq", {}).get("ppl")
        peers = _autoround_rows() if peers else []
        if w4 and (prev is not None or peers):  # nothing to beat: no row
            n, r = min(w4, key=lambda t: t[1]["ppl"])
            worse = [f"{pn} {pp:.3f}" for pn, pp in peers if r["ppl"] >= pp]
            ok = (prev is None or r["ppl"] < prev) and not worse
            out.append((f"best W4 g128 weight-only at <= the bytes of w4g128-rtn beats w4g128-awq-gptq"
                        f"{'' if prev is None else f' ({prev:.3f})'}"
                        + (f" and every AutoRound W4 g128 row of peers.json ({', '.join(f'{pn} {pp:.3f}' for pn, pp in peers) or 'none found'})"
                           if peers else ""),
                        f"{r['ppl']:.3f} ({n})" + (f"; not below {', '.join(worse)}" if worse else ""), ok))
    if "w3g128-rtn" in by:
        w3 = [(n, _gap_closed(by, n, "w3g128-rtn", fp)) for n in by if n.startswith("w3g128-") and n != "w3g128-rtn"]
        w3 = [(n, g) for n, g in w3 if g is not None]
        if w3:
            n, g = max(w3, key=lambda t: t[1])
            out.append(("W3 g128 asymmetric: best recipe closes >= 75 % of RTN's gap", f"{g:.1f} % ({n}, ppl "
                        f"{by[n]['ppl']:.3f})", g >= 75))
    return out


_KV_FLOATS_PER_TOKEN = 30 * 2 * 3 * 64  # SmolLM2: layers x (K, V) x kv heads x head dim, for float32 rows


def markdown(rows: list[dict], protocol: dict) -> str:
    ok = [r for r in rows if "ppl" in r]
    fp = next((r["ppl"] for r in ok if r["recipe"] == "fp"), None)
    lines = [
        "| recipe | calib | W | A | KV | KV B/token | ppl | vs FP | size MB | x fp16 | quantize s | process s | peak RSS MB | load 1 min start/end |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    fp_row = next((r for r in ok if r["recipe"] == "fp"), None)
    f16 = None if fp_row is None else fp_row["size_bytes"] / 2
    extra = protocol.get("also_eval", [])
    for t in extra:
        lines[0] = lines[0].replace(" | size MB", f" | ppl {t} | vs FP ({t}) | size MB")
        lines[1] += "---|---|"
    for r in ok:
        d = "—" if fp is None else f"{100 * (r['ppl'] / fp - 1):+.2f} %"
        for t in extra:
            v, f = r.get(f"ppl_{t}"), (fp_row or {}).get(f"ppl_{t}")
            d += f" | {'—' if v is None else format(v, '.3f')} | " + ("—" if v is None or f is None else f"{100 * (v / f - 1):+.2f} %")
        lines.append(
            f"| {r['recipe']} | {r.get('calib_windows', 0)} | {r['w_bits']} | {r['a_bits']} | {r['kv_bits']} | "
            f"{r.get('kv_bytes_per_token', 4 * _KV_FLOATS_PER_TOKEN):.0f} | "
            f"{r['ppl']:.3f} | {d} | {r['size_mb']:.1f} | "
            f"{'—' if f16 is None else format(f16 / r['size_bytes'], '.2f')} | {r['quantize_seconds']:.1f} | "
            f"{r.get('process_seconds', float('nan')):.0f} | {r['peak_rss_mb']:.0f} | "
            f"{_loadavg(r)} |"
        )
    failed = [r for r in rows if "error" in r]
    text = "\n".join(lines) + "\n"
    for key, title in [("ppl", "")] + [(f"ppl_{t}", f" ({t}, the same models)") for t in extra]:
        t = targets(rows, key)
        if t:
            text += f"\n| target{title} | measured | met |\n|---|---|---|\n"
            text += "\n".join(f"| {a} | {b} | {'yes' if m else 'NOT met'} |" for a, b, m in t) + "\n"
    if failed:
        text += "\nFailed to run: " + ", ".join(f"{r['recipe']} ({r['error'].strip().splitlines()[-1][:120]})"
                                               for r in failed) + "\n"
    text += (
        f"\nProtocol: SmolLM2-135M-Instruct (GGUF Q4_1 dequantized to fp32), Wikipedia excerpt from the gensim wheel "
        f"(CC BY-SA) split by article; evaluation = first {protocol['eval_tokens']} tokens of the evaluation split in "
        f"non-overlapping windows of {protocol['ctx']} (no BOS); calibration = random windows of "
        f"{protocol['calib_ctx']} tokens from the calibration split only (seed 0; count in the 'calib' column). "
        f"'quantize s' = the recipe's quantization time in its process; 'process s' = whole process (model load, "
        f"quantize, compile, evaluation); peak RSS = the process's; 'KV B/token' of rows without KV quantization "
        f"is eqjax's float32 cache ({4 * _KV_FLOATS_PER_TOKEN}; a float16 cache would be half). "
        + "".join(f"'ppl {t}': the same quantized model on the first {protocol['eval_tokens']} tokens of gensim's Lee news "
                  f"corpus (lee_background.cor, 300 Australian news articles), same windows; calibration stays on Wikipedia. "
                  for t in protocol.get("also_eval", [])) +
        "Machine: 2-core CPU shared with other work.\n"
    )
    return text


def _loadavg(r: dict) -> str:
    a, b = r.get("load_start"), r.get("load_end")
    return "" if a is None or b is None else f"{a:.1f}/{b:.1f}"


def rewrite_markdown(path: pathlib.Path) -> None:
    """Regenerate the markdown of a results JSON (e.g. after editing the targets)."""
    from eqjax.io.atomic import write_bytes

    data = json.loads(path.read_text())
    write_bytes(path.with_suffix(".md"), markdown(data["rows"], data["protocol"]).encode())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--eval-tokens", type=int, default=32768)
    ap.add_argument("--eval-len", "--ctx", dest="ctx", type=int, default=1024)
    ap.add_argument("--calib-windows", type=int, default=MAIN_CALIB)
    ap.add_argument("--calib-len", "--calib-ctx", dest="calib_ctx", type=int, default=512)
    ap.add_argument("--only", default=None, help="comma-separated recipes (default: all that exist)")
    ap.add_argument("--rerun", default="", help="comma-separated recipes to measure again (their rows are replaced)")
    ap.add_argument("--sweep", action="store_true", help="also the calibration-size sweep (16/32/64/128)")
    ap.add_argument("--out", default=str(RESULTS / "quality.json"))
    ap.add_argument("--also-eval", action="append", default=[], choices=("news",),
                    help="also measure every row on this text (eqjax eval --also-eval): its ppl in extra columns")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from eqjax.io.atomic import write_bytes
    from eqjax.recipes.registry import RECIPES, get_recipe

    protocol = {"eval_tokens": args.eval_tokens, "ctx": args.ctx, "calib_ctx": args.calib_ctx}
    if args.also_eval:
        protocol["also_eval"] = sorted(set(args.also_eval))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = _load(out, protocol)
    rerun = set(filter(None, args.rerun.split(",")))
    rows = [r for r in rows if "ppl" in r and r["recipe"] not in rerun]
    done = {_key(r) for r in rows}
    names = args.only.split(",") if args.only else [n for n in MAIN if n in RECIPES]
    jobs = []
    for n in names:
        calib = args.calib_windows if get_recipe(n).needs_calibration else 0
        jobs.append((n, calib))
    if args.sweep:
        jobs += [(n, c) for n, cs in SWEEP.items() if n in RECIPES for c in cs]
    for n, calib in jobs:
        if f"{n}@{calib}" in done:
            continue
        print(f"[{time.strftime('%H:%M:%S')}] {n} (calibration windows: {calib}) ...", flush=True)
        row = run_one(n, args, calib)
        rows = _load(out, protocol) if out.is_file() else rows  # another run may have added rows meanwhile
        rows = [r for r in rows if _key(r) != _key(row) and r["recipe"] not in rerun] + [row]
        rerun.discard(n)
        done.add(_key(row))
        print("   ", {k: row.get(k) for k in ("ppl", "quantize_seconds", "process_seconds", "peak_rss_mb", "error")},
              flush=True)
        write_bytes(out, json.dumps({"protocol": protocol, "rows": rows}, indent=1).encode())
        write_bytes(out.with_suffix(".md"), markdown(rows, protocol).encode())
    write_bytes(out, json.dumps({"protocol": protocol, "rows": rows}, indent=1).encode())
    write_bytes(out.with_suffix(".md"), markdown(rows, protocol).encode())
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
