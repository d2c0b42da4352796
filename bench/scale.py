"""How quantization cost grows with the model: ``eqjax quantize --stream`` (weights read on demand, one decoder
block quantized and written at a time) on SmolLM2-135M (real weights) and random-weight checkpoints of the
Llama-3.2-1B / 3B and Llama-3-8B shapes (``bench/random_checkpoint.py``).

**Random weights: the 1B / 3B / 8B figures are time and memory only**; their quantized models mean nothing.

For each (model, recipe): the CLI run in its own process (as a user runs it), its wall time, time per billion
parameters, peak RSS (the child's ``ru_maxrss``), the calibration activations the run keeps (the CLI's own
figure) and the bytes it wrote; with ``--eval``, also ``eqjax eval --checkpoint`` of the result (its time and
peak RSS; the perplexity of a random-weight model is not reported; a model whose float32 weights exceed the free
memory is evaluated block at a time by itself), and block at a time with ``--by-block``; with ``--export``,
``eqjax export-onnx --checkpoint`` of the result (time, peak RSS, package size; its onnxruntime self-check
included). The run's own split of its time (seconds reading weights, quantizing, in the calibration forward,
writing; the rest is the process's start: imports, tokenizer, calibration windows) is kept per row. With
``--cold`` the page cache is dropped before each quantize run (root only), so every row reads its weights from
disk rather than from a cache that holds a small model whole and a large one in part. The 'vs smallest' column
divides each row's time per billion parameters by the smallest model's of the same recipe: 1.0 everywhere is
linear growth.

Writes ``bench/results/scale.{json,md}`` (``--out-name``). Checkpoints go to ``--work`` (default a temporary
directory; an 8B checkpoint is 16 GB of bfloat16).

Usage: python bench/scale.py [--shapes 135m,1b,3b,8b] [--recipes w4g128-rtn,w4g128-gptq,...]
       [--calib-windows 4] [--calib-len 512] [--eval [--by-block]] [--export] [--cold] [--work DIR] [--keep] [--out-name scale]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:] = [str(ROOT)] + [x for x in sys.path if pathlib.Path(x or ".").resolve() != ROOT / "bench"]

from eqjax.io.atomic import write_json, write_text  # noqa: E402
from eqjax.recipes.stream import PHASES, parse_phase_line  # noqa: E402

sys.path.append(str(ROOT / "bench"))
import random_checkpoint as rc  # noqa: E402

sys.path.append(str(ROOT / "bench"))  # random_checkpoint takes bench/ off the path again (its onnx.py shadows onnx)
from layouts import cpu_model  # noqa: E402

RECIPES = ("w4g128-rtn", "w4g128-gptq", "w4g128-awq", "w8a8-smoothquant")


def smollm2_dir(work: pathlib.Path) -> pathlib.Path:
    """SmolLM2-135M (the GGUF eqjax ships with) as an HF bfloat16 directory with its tokenizer."""
    from eqjax.io import load_model
    from eqjax.io.hf import save_hf_checkpoint

    out = work / "smollm2-135m"
    if not (out / "config.json").is_file():
        model, params, _ = load_model()
        save_hf_checkpoint(out, model, params, dtype="bfloat16")
        files, _ = rc._tokenizer_files(2048)
        for name, text in files.items():
            (out / name).write_text(text)
    return out


def _run(argv: list[str]) -> tuple[int, float, float, str]:
    """``(exit code, seconds, peak RSS GiB, output)`` of ``python -m eqjax.cli *argv`` in its own process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "eqjax.cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, time.perf_counter() - t0, usage.ru_maxrss / 2**20, out


def drop_page_cache() -> None:
    """Write back dirty pages and drop the kernel's page cache (Linux, root), or exit naming why not."""
    os.sync()
    try:
        pathlib.Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError as e:
        sys.exit(f"scale.py: --cold: cannot drop the page cache ({e.strerror}; it needs root on Linux)")


def _params(d: pathlib.Path) -> int:
    """Parameters of the HF directory ``d`` (from its config; a tied table counted once)."""
    import math

    import jax

    from eqjax.io.hf import stream_hf_checkpoint

    model, _ = stream_hf_checkpoint(d)
    shapes = jax.tree.leaves(model.param_shapes(), is_leaf=lambda x: isinstance(x, tuple))
    return sum(math.prod(s) for s in shapes)


def row(name: str, d: pathlib.Path, recipe: str, args: argparse.Namespace, work: pathlib.Path) -> dict:
    """One ``eqjax quantize --stream`` run of ``recipe`` on the checkpoint ``d`` (and its eval); the output is
    deleted afterwards unless ``--keep``."""
    out = work / f"{d.name}-{recipe}"
    if args.cold:
        drop_page_cache()
    argv = ["quantize", "--model", str(d), "--recipe", recipe, "--format", "compressed-tensors", "--stream",
            "--calib-windows", str(args.calib_windows), "--calib-len", str(args.calib_len), "--out", str(out),
            "--overwrite"]
    rc_, secs, rss, text = _run(argv)
    if rc_ != 0:
        return {"model": name, "recipe": recipe, "error": text.strip().splitlines()[-1] if text.strip() else f"exit {rc_}"}
    act = re.search(r"calibration activations ([\d.]+) MiB", text)
    n = _params(d)
    r = {"model": name, "recipe": recipe, "parameters": n, "quantize_s": round(secs, 1),
         "s_per_billion": round(secs / (n / 1e9), 1), "peak_rss_gib": round(rss, 2),
         "calib_tokens": args.calib_windows * args.calib_len if "rtn" not in recipe else 0,
         "activations_mib": float(act.group(1)) if act else None,
         "bytes_written": sum(f.stat().st_size for f in out.iterdir() if f.is_file())}
    phases = parse_phase_line(text)
    if phases is not None:
        r["phases_s"] = phases
    r["units_s"] = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\s+(outer|head|layers_\d+): ([\d.]+)s$",
                                                                       text, re.M)}
    for mode in (("", []), ("by_block_", ["--by-block"]))[:1 + args.by_block] if args.eval else ():
        ev = ["eval", "--checkpoint", str(out), "--eval-len", str(args.calib_len), "--eval-tokens", str(args.calib_len),
              "--batch-size", "1", *mode[1]]
        rc_, secs, rss, text = _run(ev)
        r.update({f"{mode[0]}eval_s": round(secs, 1), f"{mode[0]}eval_peak_rss_gib": round(rss, 2)} if rc_ == 0
                 else {f"{mode[0]}eval_error": text.strip().splitlines()[-1]})
    if args.export:
        pkg = work / f"{d.name}-{recipe}-onnx"
        rc_, secs, rss, text = _run(["export-onnx", "--checkpoint", str(out), "--out", str(pkg), "--overwrite"])
        r.update({"export_s": round(secs, 1), "export_peak_rss_gib": round(rss, 2),
                  "export_bytes": sum(f.stat().st_size for f in pkg.iterdir() if f.is_file())} if rc_ == 0
                 else {"export_error": text.strip().splitlines()[-1]})
        if not args.keep and pkg.exists():
            shutil.rmtree(pkg)
    if args.export_gguf:
        gg = work / f"{d.name}-{recipe}.gguf"
        rc_, secs, rss, text = _run(["export-gguf", "--checkpoint", str(out), "--out", str(gg), "--overwrite"])
        r.update({"gguf_s": round(secs, 1), "gguf_peak_rss_gib": round(rss, 2), "gguf_bytes": gg.stat().st_size}
                 if rc_ == 0 else {"gguf_error": text.strip().splitlines()[-1]})
        if not args.keep and gg.exists():
            gg.unlink()
    if not args.keep:
        shutil.rmtree(out)
    return r


def markdown(rows: list[dict], meta: dict) -> str:
    base: dict[str, float] = {}
    for r in rows:
        if "s_per_billion" in r:
            base.setdefault(r["recipe"], r["s_per_billion"])
    lines = [
        "# Quantization cost against model size (`eqjax quantize --stream`)", "",
        f"{meta['cpu']}, {meta['cpus']} CPUs, {meta['memory_gib']} GiB; jax {meta['jax']}; {meta['when']}. "
        f"Calibration {meta['calib_windows']} x {meta['calib_len']} tokens (round-to-nearest needs none).", "",
        "**The 1B / 3B / 8B rows are random-weight checkpoints of those shapes: time and memory only.** "
        "SmolLM2-135M holds its real weights (bfloat16). Each row is one CLI run in its own process; "
        "'vs smallest' divides its seconds per billion parameters by the smallest model's for the same recipe "
        "(1.0 = linear growth).", "",
        "| model | recipe | parameters | quantize s | s / 1e9 params | vs smallest | peak RSS GiB | activations MiB "
        "| written GiB |" + (" eval s | eval peak RSS GiB |" if meta["eval"] else "")
        + (" eval --by-block s | eval --by-block peak RSS GiB |" if meta.get("eval_by_block") else "")
        + (" export-onnx s | export-onnx peak RSS GiB | package GiB |" if meta.get("export") else "")
        + (" export-gguf s | export-gguf peak RSS GiB | GGUF GiB |" if meta.get("export_gguf") else ""),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if meta["eval"] else "")
        + ("---:|---:|" if meta.get("eval_by_block") else "") + ("---:|---:|---:|" if meta.get("export") else "")
        + ("---:|---:|---:|" if meta.get("export_gguf") else ""),
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['recipe']} | failed: {r['error']} |")
            continue
        lines.append(
            f"| {r['model']} | {r['recipe']} | {r['parameters'] / 1e9:.3f} B | {r['quantize_s']:.1f} | "
            f"{r['s_per_billion']:.1f} | {r['s_per_billion'] / base[r['recipe']]:.2f} | {r['peak_rss_gib']:.2f} | "
            f"{r['activations_mib']} | {r['bytes_written'] / 2**30:.2f} |"
            + "".join(f" {r.get(k + 'eval_s', '-')} | {r.get(k + 'eval_peak_rss_gib', r.get(k + 'eval_error', '-'))} |"
                      for k in ("", "by_block_")[:1 + bool(meta.get("eval_by_block"))] if meta["eval"])
            + (f" {r.get('export_s', '-')} | {r.get('export_peak_rss_gib', r.get('export_error', '-'))} | "
               f"{r['export_bytes'] / 2**30:.2f} |" if "export_bytes" in r else " - | - | - |" if meta.get("export")
               else "")
            + (f" {r['gguf_s']} | {r['gguf_peak_rss_gib']} | {r['gguf_bytes'] / 2**30:.2f} |" if "gguf_bytes" in r
               else f" - | {r.get('gguf_error', '-')} | - |" if meta.get("export_gguf") else ""))
    timed = [r for r in rows if "phases_s" in r]
    if timed:
        lines += ["", "Where the time goes (seconds; per 1e9 parameters in brackets; 'start': the rest of the run):", "",
                  "| model | recipe | " + " | ".join(PHASES) + " | start |", "|---|---|" + "---:|" * (len(PHASES) + 1)]
        for r in timed:
            n = r["parameters"] / 1e9
            cells = [*(r["phases_s"][k] for k in PHASES), r["quantize_s"] - sum(r["phases_s"].values())]
            lines.append(f"| {r['model']} | {r['recipe']} | " + " | ".join(f"{c:.1f} ({c / n:.1f})" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="135m,1b,3b,8b")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--calib-windows", type=int, default=4)
    ap.add_argument("--calib-len", type=int, default=512)
    ap.add_argument("--eval", action="store_true", help="also time 'eqjax eval --checkpoint' of each result")
    ap.add_argument("--by-block", action="store_true", help="with --eval, also evaluate with 'eqjax eval --by-block' "
                                                            "(one block at a time)")
    ap.add_argument("--work", default=None, help="where checkpoints are written (default: a temporary directory)")
    ap.add_argument("--out-name", default="scale")
    ap.add_argument("--keep", action="store_true", help="keep the quantized checkpoints in --work")
    ap.add_argument("--export", action="store_true", help="also time 'eqjax export-onnx --checkpoint' of each result "
                                                          "(with its onnxruntime self-check)")
    ap.add_argument("--export-gguf", action="store_true", help="also time 'eqjax export-gguf --checkpoint' of each "
                                                               "result (with its read-back check)")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each quantize run (root only): "
                                                      "every row reads its weights from disk")
    args = ap.parse_args(argv)
    if args.cold:
        drop_page_cache()  # refused here, before any checkpoint is written, when it cannot be done
    import jax

    tmp = None if args.work else tempfile.TemporaryDirectory(prefix="eqjax-scale-")
    work = pathlib.Path(args.work or tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    meta = {"when": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "machine": platform.platform(),
            "cpu": cpu_model(), "cpus": os.cpu_count(), "jax": jax.__version__,
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "calib_windows": args.calib_windows, "calib_len": args.calib_len, "eval": args.eval,
            "eval_by_block": args.eval and args.by_block, "export": args.export, "export_gguf": args.export_gguf,
            "cold": args.cold, "note": "1B/3B/8B rows: random weights, time and memory only"}
    results = ROOT / "bench" / "results"
    rows: list[dict] = []
    for shape in args.shapes.split(","):
        if shape == "135m":
            d = smollm2_dir(work)
        else:
            d = work / f"random-{shape}"
            if not (d / rc.MARKER).is_file():
                rc.write_checkpoint(shape, d, overwrite=d.exists())
        name = ("SmolLM2-135M" if shape == "135m" else "random 8B shape, first block only" if shape == "8b1"
                else f"random {shape.upper()} shape")
        for recipe in args.recipes.split(","):
            r = row(name, d, recipe, args, work)
            print(json.dumps(r), flush=True)
            rows.append(r)
            # written after every row: a long run stopped part way keeps the rows it finished
            write_json(results / f"{args.out_name}.json", {"meta": meta, "rows": rows})
            write_text(results / f"{args.out_name}.md", markdown(rows, meta))
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
