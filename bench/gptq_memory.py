"""Peak host memory of the GPTQ calibration step against glibc's mmap threshold; writes
bench/results/gptq_memory.{json,md}.

Each cell is its own process (``--child``): load SmolLM2, draw ``windows`` calibration windows of
``--calib-len`` tokens (seed 0), run the recipe's ``quantize``, and report the process's peak RSS
(``ru_maxrss``) before and after it, the wall time of ``quantize`` and the bytes of JAX arrays still alive
after it. ``--thresholds`` lists glibc ``MALLOC_MMAP_THRESHOLD_`` values for the child's environment
(``default``: the variable removed, glibc's dynamic threshold). Peak RSS is not a figure of eqjax alone:
the allocator's fragmentation is part of it, which is what this measures.

Usage: python bench/gptq_memory.py [--windows 8,32] [--thresholds default,4194304] [--recipe w4g128-gptq]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ENV_KEY = "MALLOC_MMAP_THRESHOLD_"


def child(recipe: str, windows: int, calib_len: int) -> dict:
    """One cell, in this process: see the module docs."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from eqjax.data import calibration_windows, wikipedia_tokens
    from eqjax.evaluate import peak_rss_mb
    from eqjax.io.gguf import load_gguf
    from eqjax.models import Model
    from eqjax.recipes.apply import quantize
    from eqjax.recipes.registry import get_recipe

    cfg, params, tok = load_gguf()
    model = Model(cfg)
    cal_ids, _ = wikipedia_tokens(tok)
    cal = calibration_windows(cal_ids, windows, calib_len, 0)
    before = peak_rss_mb()
    t0 = time.perf_counter()
    qp = quantize(params, get_recipe(recipe), model=model, calibration=cal, seed=0)
    jax.block_until_ready(jax.tree_util.tree_leaves(qp))
    secs = time.perf_counter() - t0
    live = sum(a.nbytes for a in jax.live_arrays()) / 2**20
    return {"windows": windows, "maxrss_before_mb": before, "maxrss_after_mb": peak_rss_mb(), "quantize_s": secs,
            "live_arrays_after_mb": live}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", default="8,32", help="comma-separated calibration window counts")
    ap.add_argument("--thresholds", default="default,4194304", help="comma-separated MALLOC_MMAP_THRESHOLD_ values")
    ap.add_argument("--recipe", default="w4g128-gptq")
    ap.add_argument("--calib-len", type=int, default=512)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gptq_memory"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        windows = [int(w) for w in args.windows.split(",")]
        thresholds = [t if t == "default" else str(int(t)) for t in args.thresholds.split(",")]
    except ValueError:
        ap.error("--windows takes integers and --thresholds integers or 'default', comma-separated")
    if any(w < 1 for w in windows):
        ap.error("--windows: every count must be >= 1")
    if args.child:
        print(json.dumps(child(args.recipe, windows[0], args.calib_len)))
        return 0
    rows = []
    load0 = os.getloadavg()
    for t in thresholds:
        for w in windows:
            env = {k: v for k, v in os.environ.items() if k != ENV_KEY}
            if t != "default":
                env[ENV_KEY] = t
            cmd = [sys.executable, __file__, "--child", "--windows", str(w), "--recipe", args.recipe,
                   "--calib-len", str(args.calib_len)]
            r = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if r.returncode:
                print(r.stderr[-2000:], file=sys.stderr)
                raise SystemExit(f"gptq_memory: the cell threshold={t} windows={w} failed (rc {r.returncode})")
            row = {"threshold": t, **json.loads(r.stdout.strip().splitlines()[-1])}
            rows.append(row)
            print(f"[gptq_memory] {json.dumps(row)}", flush=True)
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "recipe": args.recipe, "calib_len": args.calib_len,
              "cpus": os.cpu_count(), "load_before": load0, "load_after": os.getloadavg(), "rows": rows}
    from eqjax.io.atomic import write_report

    print("[gptq_memory] wrote %s and %s" % write_report(args.out, report, markdown(report)))
    return 0


def markdown(r: dict) -> str:
    lines = [f"# GPTQ step memory against glibc's mmap threshold ({r['recipe']})", "",
             f"{r['date']}, {r['cpus']} CPUs, load average before / after {r['load_before'][0]:.1f} / "
             f"{r['load_after'][0]:.1f}; calibration windows of {r['calib_len']} tokens; one process per row.", "",
             "| MALLOC_MMAP_THRESHOLD_ | windows | peak RSS before quantize MB | peak RSS after MB | quantize s "
             "| live JAX arrays after MB |", "|---|---|---|---|---|---|"]
    for x in r["rows"]:
        lines.append(f"| {x['threshold']} | {x['windows']} | {x['maxrss_before_mb']:.0f} | {x['maxrss_after_mb']:.0f} "
                     f"| {x['quantize_s']:.0f} | {x['live_arrays_after_mb']:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
