"""One recipe, three layouts of the same weights: eqjax's own Llama vs a gemma-style NNX model vs an
einsum linen model, all holding SmolLM2-135M's weights (examples/layout_models.py).

Writes ``bench/results/layouts.{json,md}``. For each recipe, eqjax quantizes (a) its own Llama through
``eqjax.quantize``, (b) :class:`GemmaStyleLM` (``flax.nnx``: fused kv ``[2, K, D, H]`` and gate/up
``[2, F, D]`` einsum weights, an attention output ``[N, H, D]`` contracted over two axes, no ``kernel``
names) and (c) :class:`EinsumLinenLM` (``nn.DenseGeneral`` / ``nn.Einsum``, kv fused on a leading axis,
gate/up concatenated on the output axis) through ``eqjax.quantize_model``, with the same calibration
windows; all three are evaluated on the same windows. A recipe means the same quantization whatever the
layout when the perplexities agree and the quantized params take the same bytes.

GPTQ carries every rounding decision into the later inputs of its column, so two runs whose
activations differ only in float summation order (an einsum against a matmul) end on different codes
and perplexities. ``--order-check R`` measures that spread on eqjax's own model alone: recipe ``R`` with
the same calibration windows in other orders (the same tokens; the statistics differ by summation
order only); its rows are the yardstick for the layouts' differences. (SmoothQuant's statistics are
maxima, which no order changes: its layout differences come from activations that differ in the last
bits, through smoothing factors and codes that round the other way.)

Usage: python bench/layouts.py [--eval-windows 4] [--eval-len 1024] [--calib-windows 16] [--calib-len 512]
       [--only r1,r2] [--order-check R] [--merge]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from flax_models import nll_ppl  # noqa: E402  (bench/, on the path as the script's directory)
from layout_models import einsum_linen_from_llama, gemma_style_from_llama  # noqa: E402

import eqjax  # noqa: E402
from eqjax.core.pytree import tree_nbytes  # noqa: E402
from eqjax.data import calibration_windows, token_windows, wikipedia_tokens  # noqa: E402
from eqjax.io import load_model  # noqa: E402
from eqjax.io.atomic import write_json, write_text  # noqa: E402

RECIPES = ["fp", "w4g128-rtn", "w4g128-gptq", "w4g128-awq", "w8a8-smoothquant"]
LAYOUTS = ["eqjax Llama", "gemma-style NNX", "einsum linen"]
ORDERS = {"calibration reversed": lambda c: c[::-1], "calibration rolled by one window": lambda c: np.roll(c, 1, 0)}
"""Reorderings that change which windows share a calibration batch (so the float sums differ); swapping two
whole batches would not (a sum of two terms does not depend on their order)."""


def cpu_model() -> str:
    """The CPU's model name (Linux), else the platform's processor string."""
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def run_layout(layout: str, recipe: str, config, params, calib: np.ndarray, windows: np.ndarray, model) -> dict:
    """Quantize one layout with ``recipe`` and evaluate it: perplexity, param bytes, quantize seconds."""
    batches = [(jnp.asarray(calib[i:i + 8]),) for i in range(0, len(calib), 8)]
    t0 = time.perf_counter()
    if layout == "eqjax Llama":
        q = params if recipe == "fp" else eqjax.quantize(params, recipe, model=model, calibration=calib)
        secs = time.perf_counter() - t0
        f = jax.jit(lambda p, w: model.apply(p, w)[0])
        run, nbytes = (lambda w: f(q, w)), tree_nbytes(q)
    elif layout == "gemma-style NNX":
        m = gemma_style_from_llama(config, params)
        qm = m if recipe == "fp" else eqjax.quantize_model(m, recipe, calibration=batches)
        secs = time.perf_counter() - t0
        f = nnx.jit(lambda mod, w: mod(w))
        run = lambda w: f(qm, w)  # noqa: E731
        nbytes = tree_nbytes(nnx.state(m, nnx.Param)) if recipe == "fp" else tree_nbytes(qm.params)
    else:
        lin, variables = einsum_linen_from_llama(config, params)
        if recipe == "fp":
            mod, qp = lin, variables["params"]
        else:
            mod, qp = eqjax.quantize_model(lin, recipe, params=variables, calibration=batches)
        secs = time.perf_counter() - t0
        f = jax.jit(lambda p, w: mod.apply({"params": p}, w))
        run, nbytes = (lambda w: f(qp, w)), tree_nbytes(qp)
    return {"layout": layout, "recipe": recipe, "ppl": nll_ppl(run, windows), "bytes": int(nbytes),
            "quantize_s": secs, "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "load_avg": os.getloadavg()[0]}


def table(rows: list[dict]) -> list[str]:
    """Markdown: one line per recipe, each layout's perplexity and bytes, the largest deviation."""
    lines = ["| recipe | " + " | ".join(f"ppl, {x}" for x in LAYOUTS) + " | max diff vs eqjax Llama | bytes "
             "(eqjax / gemma / linen) | quantize s (eqjax / gemma / linen) |", "|---" * 7 + "|"]
    for r in RECIPES:
        by = {x["layout"]: x for x in rows if x["recipe"] == r}
        if len(by) != len(LAYOUTS):
            continue
        base = by[LAYOUTS[0]]["ppl"]
        diff = max((abs(by[x]["ppl"] - base) / base * 100, by[x]["ppl"] - base) for x in LAYOUTS[1:])
        lines.append(f"| {r} | " + " | ".join(f"{by[x]['ppl']:.3f}" for x in LAYOUTS)
                     + f" | {'+' if diff[1] >= 0 else '-'}{diff[0]:.3f} % | "
                     + " / ".join(str(by[x]["bytes"]) for x in LAYOUTS) + " | "
                     + " / ".join(f"{by[x]['quantize_s']:.0f}" for x in LAYOUTS) + " |")
    return lines


def protocol_parser(doc: str) -> argparse.ArgumentParser:
    """A parser holding the SmolLM2 protocol's flags (evaluation 4 x 1024, calibration 16 x 512 tokens)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--eval-windows", type=int, default=4)
    ap.add_argument("--eval-len", "--ctx", dest="ctx", type=int, default=1024)
    ap.add_argument("--calib-windows", type=int, default=16)
    ap.add_argument("--calib-len", "--calib-ctx", dest="calib_ctx", type=int, default=512)
    return ap


def main() -> None:
    ap = protocol_parser(__doc__)
    ap.add_argument("--only", default=None, help="comma-separated recipes (default: all)")
    ap.add_argument("--order-check", default=None, metavar="R",
                    help="only eqjax's own model with recipe R on reordered calibration windows")
    ap.add_argument("--merge", action="store_true", help="keep the committed rows this run does not measure")
    args = ap.parse_args()
    model, params, tok = load_model()
    cal_ids, ev_ids = wikipedia_tokens(tok)
    windows = token_windows(ev_ids, args.ctx, args.eval_windows)
    calib = calibration_windows(cal_ids, args.calib_windows, args.calib_ctx, 0)
    load0 = os.getloadavg()[0]
    rows = []
    for order, perm in ORDERS.items() if args.order_check else ():
        row = run_layout(LAYOUTS[0], args.order_check, model.config, params, np.ascontiguousarray(perm(calib)),
                         windows, model)
        rows.append(dict(row, layout=f"{LAYOUTS[0]}, {order}"))
        print(json.dumps(rows[-1]), flush=True)
    for r in [] if args.order_check else args.only.split(",") if args.only else RECIPES:
        for layout in LAYOUTS:
            row = run_layout(layout, r, model.config, params, calib, windows, model)
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = ROOT / "bench" / "results"
    if args.merge and (out / "layouts.json").exists():
        mine = {(x["layout"], x["recipe"]) for x in rows}
        rows = [x for x in json.loads((out / "layouts.json").read_text())["rows"]
                if (x["layout"], x["recipe"]) not in mine] + rows
    meta = {"when": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": platform.platform(), "cpu": cpu_model(), "cpus": os.cpu_count(),
            "load_avg_start": load0, "load_avg_end": os.getloadavg()[0],
            "protocol": f"SmolLM2-135M-Instruct, {args.eval_windows} x {args.ctx} evaluation tokens (Wikipedia "
                        f"evaluation split, no BOS), {args.calib_windows} x {args.calib_ctx} calibration tokens (seed 0)"}
    write_json(out / "layouts.json", {"meta": meta, "rows": rows})
    spread = [x for x in rows if x["layout"].startswith(LAYOUTS[0] + ", ")]
    if spread:
        base = {x["recipe"]: x["ppl"] for x in rows if x["layout"] == LAYOUTS[0]}
        spread_lines = ["", "Spread from float summation order alone (eqjax's own model, the same calibration windows "
                        "in another order):", "", "| recipe | order | ppl | diff vs the layouts' eqjax Llama row |",
                        "|---|---|---|---|"]
        spread_lines += [f"| {x['recipe']} | {x['layout'].split(', ', 1)[1]} | {x['ppl']:.3f} | "
                         f"{100 * (x['ppl'] - base[x['recipe']]) / base[x['recipe']]:+.3f} % |" for x in spread
                         if x["recipe"] in base]
    else:
        spread_lines = []
    lines = table(rows) + spread_lines + ["", f"Last run {meta['when']}, {meta['machine']}, {meta['cpu']}, {meta['cpus']} CPUs, load average "
                               f"{load0:.1f} -> {meta['load_avg_end']:.1f}. Protocol: {meta['protocol']}. Bytes: every "
                               "param leaf (codes, scales, zero points, float leaves)."]
    write_text(out / "layouts.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
