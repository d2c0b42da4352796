"""Robustness tally: every case of ``tests/robustness/robustness_cases.py`` run as a user would, counted
by outcome (clear error / correct / silent / loss / traceback / crash); writes
``bench/results/robustness.{json,md}``.

CLI cases run as separate ``python -m eqjax.cli`` processes (so native crashes and tracebacks show as
they would for a user), ``--jobs`` at a time; API cases run in this process; kill cases start a
writer process and SIGKILL (or SIGINT) it mid-write. Inputs are tiny (a 2-layer random Llama, a 3 kB
text, a 2-layer GGUF), so the whole tally takes a few minutes on 2 CPU cores.

    python bench/robustness.py [--jobs 2] [--only SUBSTRING] [--out bench/results/robustness]
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import datetime
import os
import pathlib
import platform
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
# this script's directory holds bench/onnx.py, which would shadow the onnx package
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT / "tests" / "robustness"))
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from robustness_cases import OUTCOMES, Fixtures, catalogue, run_case  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2, help="CLI cases run in parallel (default 2)")
    ap.add_argument("--only", default=None, help="run only cases whose name contains this")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "robustness"), help="output path without suffix")
    args = ap.parse_args(argv)

    cases = [c for c in catalogue() if args.only is None or args.only in c.name]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="eqjax-robustness-") as tmp:
        root = pathlib.Path(tmp)
        os.environ["EQJAX_CACHE"] = str(root / "cache")
        fx = Fixtures(root / "fx").build()
        results: dict[int, dict] = {}

        def one(i: int) -> dict:
            c = cases[i]
            outcome, detail, secs = run_case(c, fx, root / "work" / f"{i:03d}", subprocess_cli=True)
            detail = str(detail).replace(str(root), "<tmp>")
            return {"case": c.name, "group": c.group, "kind": "cli" if c.argv else ("kill" if c.kill else "api"),
                    "expected": "clear error" if c.expect == "error" else "correct", "outcome": outcome,
                    "detail": detail, "seconds": round(secs, 2)}

        cli = [i for i, c in enumerate(cases) if c.argv is not None]
        rest = [i for i, c in enumerate(cases) if c.argv is None]
        with cf.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as ex:
            for i, row in zip(cli, ex.map(one, cli)):
                results[i] = row
                print(f"[{row['outcome']:>11}] {row['case']}  ({row['seconds']:.1f} s)", flush=True)
        for i in rest:  # API cases share this process; kill cases run their own subprocesses
            results[i] = row = one(i)
            print(f"[{row['outcome']:>11}] {row['case']}  ({row['seconds']:.1f} s)", flush=True)
    rows = [results[i] for i in range(len(cases))]
    wall = time.perf_counter() - t0
    tally = collections.Counter(r["outcome"] for r in rows)
    by_group: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in rows:
        by_group[r["group"]][r["outcome"]] += 1
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cases": len(rows),
        "wall_seconds": round(wall, 1),
        "goal": ">= 60 cases; 0 silent, 0 loss, 0 traceback (crash included)",
        "met": len(rows) >= 60 and all(tally[k] == 0 for k in ("silent", "loss", "traceback", "crash")),
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta, "tally": {k: tally[k] for k in OUTCOMES},
               "by_group": {g: {k: c[k] for k in OUTCOMES} for g, c in by_group.items()}, "cases": rows}
    from eqjax.io.atomic import write_json, write_text

    write_json(out.with_suffix(".json"), payload)
    write_text(out.with_suffix(".md"), markdown(payload))
    print(markdown(payload).split("\n\n| case")[0])
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0 if meta["met"] else 1


def markdown(p: dict) -> str:
    m, t = p["meta"], p["tally"]
    lines = [
        f"{m['date']}, {m['platform']}, Python {m['python']}: {m['cases']} cases in {m['wall_seconds']:.0f} s "
        f"(`python bench/robustness.py`; CLI cases as separate processes).",
        "",
        "| outcome | cases |",
        "|---|---:|",
        *[f"| {k} | {t[k]} |" for k in OUTCOMES],
        f"| **total** | **{m['cases']}** |",
        "",
        f"Goal: {m['goal']}: **{'met' if m['met'] else 'NOT met'}**.",
        "",
        "| group | " + " | ".join(OUTCOMES) + " |",
        "|---|" + "---:|" * len(OUTCOMES),
        *[f"| {g} | " + " | ".join(str(c[k]) for k in OUTCOMES) + " |" for g, c in p["by_group"].items()],
        "",
        "| case | expected | outcome | detail |",
        "|---|---|---|---|",
    ]
    for r in p["cases"]:
        detail = str(r["detail"]).replace("|", "\\|").replace("\n", " ")
        if len(detail) > 160:
            detail = detail[:157] + "..."
        lines.append(f"| {r['case']} | {r['expected']} | {r['outcome']} | {detail} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
