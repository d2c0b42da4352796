"""Sweep the Pallas kernels' block sizes on a CUDA GPU, one M per bucket of ``pallas_kernels.tuning``.

Usage (GPU only; on any other platform it says so and exits 2)::

    python bench/kernel_tune.py --out bench/results/kernel_tune_h200 [--k 4096] [--deadline-s 240]

For each kernel (W8A8 with dynamic per-token activations; W4A16 asymmetric group 128) and each M, it
times the current table's choice ("table") and a grid of candidates (bn x bk, warps/stages and
split-K variations), with the same timer as bench/kernels.py (median of warmed-up samples, the op
repeated inside one jit). Each candidate's output is compared with the kernel's XLA reference
(max relative difference): a fast but wrong configuration is reported, never picked. The best
per M and its speed-up over the table's choice go to the markdown table; update
``pallas_kernels/tuning.py`` from it. Results are written after every M, so a run stopped at its
deadline keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
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
from kernels import _reps_for, _save, _time, gpu_run_header  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from pallas_kernels import tuning  # noqa: E402

MS = (16, 64, 256, 2048)  # one per bucket of the tuning tables
GROUP = 128
BLOCK_FIELDS = tuple(f.name for f in dataclasses.fields(tuning.Blocks))
GEMV_MAX_M = 4  # W4A16 GEMV candidates (Blocks(gemv=True)) are tried up to this M


def _operands(m: int, k: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w8 = jnp.asarray(rng.integers(-127, 128, (k, k)), jnp.int8)
    s8 = jnp.asarray(rng.uniform(1e-3, 2e-2, (k,)), jnp.float32)
    packed = jnp.asarray(rng.integers(0, 256, (k // 2, k)), jnp.uint8)
    s4 = jnp.asarray(rng.uniform(1e-3, 2e-2, (k // GROUP, k)), jnp.bfloat16)
    z4 = jnp.asarray(rng.integers(0, 16, (k // GROUP, k)), jnp.uint8)
    return x, (w8, s8), (packed, s4, z4)


def _candidates(kind: str, m: int, k: int) -> list[tuning.Blocks]:
    """The table's choice first, then a grid around it (deduplicated)."""
    table = tuning.w8a8_blocks(m, k, k) if kind == "w8a8" else tuning.w4a16_blocks(m, k, k, GROUP)
    bks = (64, 128, 256) if kind == "w8a8" else (16, 32, 64)  # W4A16: packed rows, dividing G/2
    bns = (64, 128, 256)
    out = [table]
    if kind == "w4a16" and m <= GEMV_MAX_M:  # the MMA-free one-row blocks, first (they are the question)
        def gemv(bn, bk, split, warps, stages, once=False):
            split = tuning._split_k(m * -(-k // bn), (k // 2) // bk) if split is None else split
            return tuning.Blocks(1, bn, bk, split, warps, stages, gemv=True, reduce_once=once)

        grid = list(itertools.product((128, 256, 512), (32, 64), (4, 8)))
        out += [gemv(bn, bk, None, warps, 1, once=True) for bn, bk, warps in grid]  # one K reduction per program
        out += [gemv(bn, bk, None, warps, stages) for bn, bk, warps in grid for stages in (1, 3)]
        out += [gemv(128, 64, s, 4, 3) for s in (1, 2, 4, 8, 16)]
    bm = 16 if table.gemv else table.bm  # the MMA grid: Triton's smallest MMA M where the table is GEMV
    for bn, bk in itertools.product(bns, bks):
        progs = -(-m // bm) * -(-k // bn)
        kb = -(-k // bk) if kind == "w8a8" else (k // 2) // bk
        out.append(tuning.Blocks(bm, bn, bk, tuning._split_k(progs, kb), table.num_warps, table.num_stages))
    for warps, stages in ((4, 3), (4, 4), (8, 3), (8, 4)):
        out.append(dataclasses.replace(table, num_warps=warps, num_stages=stages))
    if m <= 64:  # split-K matters where there are few output tiles
        for s in (1, 2, 4, 8, 16):
            out.append(dataclasses.replace(table, split_k=s))
    else:
        out.append(tuning.Blocks(min(2 * table.bm, 256), table.bn, table.bk, 1, 8, 3))
    seen, uniq = set(), []
    for b in out:
        if b not in seen:
            seen.add(b)
            uniq.append(b)
    return uniq


def _fns(kind: str, x, w8args, w4args):
    if kind == "w8a8":
        w, s = w8args
        ref = jax.jit(lambda x, w, s: pk.w8a8_matmul_xla(x, w, s))

        def make(b):
            return lambda x, w, s: pk.w8a8_matmul(x, w, s, blocks=b)

        return make, (x, w, s), ref
    p, s, z = w4args
    ref = jax.jit(lambda x, p, s, z: pk.w4a16_matmul_xla(x, p, s, z, group_size=GROUP))

    def make(b):
        return lambda x, p, s, z: pk.w4a16_matmul(x, p, s, z, group_size=GROUP, blocks=b)

    return make, (x, p, s, z), ref


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(HERE / "results" / "kernel_tune"))
    ap.add_argument("--k", type=int, default=4096, help="K = N")
    ap.add_argument("--ms", type=int, nargs="*", default=list(MS))
    ap.add_argument("--kernels", nargs="*", default=["w8a8", "w4a16"], choices=["w8a8", "w4a16"])
    ap.add_argument("--samples", type=int, default=7)
    ap.add_argument("--deadline-s", type=float, default=300.0, help="stop starting new candidates after this")
    args = ap.parse_args(argv)
    result = gpu_run_header("kernel_tune", k=args.k, group_size_w4=GROUP, samples=args.samples)
    if result is None:
        return 2
    t0 = time.perf_counter()
    for m in args.ms:
        x, w8args, w4args = _operands(m, args.k)
        for kind in args.kernels:
            make, fargs, ref = _fns(kind, x, w8args, w4args)
            want = np.asarray(ref(*fargs).astype(jnp.float32))
            scale = max(float(np.max(np.abs(want))), 1e-30)
            t_ref = _time(ref, fargs, reps=_reps_for(m, args.k, True), samples=args.samples)
            for i, b in enumerate(_candidates(kind, m, args.k)):
                if time.perf_counter() - t0 > args.deadline_s:
                    result["stopped_early"] = True
                    break
                row = {"kernel": kind, "M": m, "K": args.k, "N": args.k, "table": i == 0,
                       "blocks": {f: getattr(b, f) for f in BLOCK_FIELDS},
                       "time_s": None, "xla_ref_time_s": t_ref, "max_rel_diff": None, "note": ""}
                try:
                    fn = make(b)
                    row["max_rel_diff"] = float(np.max(np.abs(np.asarray(jax.jit(fn)(*fargs).astype(jnp.float32)) - want)) / scale)
                    row["time_s"] = _time(fn, fargs, reps=_reps_for(m, args.k, True), samples=args.samples)
                except Exception as e:  # record and go on: one bad configuration must not hide the rest
                    row["note"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
                result["rows"].append(row)
                t = row["time_s"]
                print(f"{kind} M={m} {row['blocks']} {'-' if t is None else f'{t * 1e6:.1f} us'} "
                      f"diff={row['max_rel_diff']} {row['note']}", flush=True)
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        _save(Path(args.out), result, _markdown(result))
    print(f"wrote {args.out}.json and .md")
    return 0


def _markdown(r: dict) -> str:
    lines = [
        "# Pallas kernel block-size sweep",
        "",
        f"Device: **{r['device']}**; jax {r['jax']}; {r['date']}; K = N = {r['k']}; median of {r['samples']} "
        f"samples after warm-up; wall {r.get('wall_s', '?')} s{' (stopped at its deadline)' if r['stopped_early'] else ''}.",
        "W8A8: dynamic per-token int8 activations (fused below M = 64, pre-pass kernel above). W4A16: asymmetric "
        "group 128, bf16 scales. A candidate counts only if its output matches the XLA reference (rel. diff < 1e-2).",
        "",
        "| kernel | M | table blocks (bm,bn,bk,split,warps,stages[ gemv][ reduce_once]) | table µs | best blocks | best µs | speed-up | XLA ref µs |",
        "|---|---:|---|---:|---|---:|---:|---:|",
    ]

    def fmt(b):
        flags = [f for f in ("gemv", "reduce_once") if b.get(f)]
        return ",".join(str(b[f]) for f in BLOCK_FIELDS if f not in ("gemv", "reduce_once")) + "".join(" " + f for f in flags)

    keys = sorted({(row["kernel"], row["M"]) for row in r["rows"]}, key=lambda t: (t[0], t[1]))
    for kind, m in keys:
        rows = [x for x in r["rows"] if x["kernel"] == kind and x["M"] == m]
        ok = [x for x in rows if x["time_s"] is not None and x["max_rel_diff"] is not None and x["max_rel_diff"] < 1e-2]
        table = next((x for x in rows if x["table"]), None)
        if not ok or table is None or table["time_s"] is None:
            lines.append(f"| {kind} | {m} | {fmt(table['blocks']) if table else '—'} | — | — | — | — | — |")
            continue
        best = min(ok, key=lambda x: x["time_s"])
        lines.append(f"| {kind} | {m} | {fmt(table['blocks'])} | {table['time_s'] * 1e6:.1f} | {fmt(best['blocks'])} | "
                     f"{best['time_s'] * 1e6:.1f} | {table['time_s'] / best['time_s']:.2f}x | {rows[0]['xla_ref_time_s'] * 1e6:.1f} |")
    bad = [x for x in r["rows"] if x["note"] or (x["max_rel_diff"] is not None and x["max_rel_diff"] >= 1e-2)]
    if bad:
        lines += ["", f"{len(bad)} candidate(s) failed or disagreed with the reference (see the JSON)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
