"""Data-parallel calibration throughput and per-step collective overhead on CPU devices.

Usage::

    python bench/distributed.py            # 1, 2, 4, 8 forced CPU devices + 2 processes (~1-2 min)

For each configuration (a fresh subprocess, since ``--xla_force_host_platform_device_count`` must be
set before JAX starts) it measures, as the median of warmed-up runs with ``block_until_ready``:

* ``stats``: tokens/s through :func:`eqjax.distributed.sharded_statistics` computing the GPTQ /
  SmoothQuant linear statistics (per-channel absmax, ``X^T X``, token count) of a ``[tokens, K]``
  activation batch sharded over "data" (the linear-statistics step of calibration; no model).
* ``collective``: time of one synchronization step alone (``pmax`` of ``[K]`` + ``all_gather`` of the
  ``[blocks, K, K]`` partials + tree sum), i.e. the overhead a data-parallel step adds.

Forced host devices share this machine's CPU cores (and, for the 2-process run, two JAX processes
share them too and talk over gloo/TCP on 127.0.0.1): the numbers measure overhead, not scaling. On a
machine with C cores, more than C devices cannot be faster. Writes ``bench/results/distributed.json``
and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKENS, K, BLOCKS = 8192, 256, 8


def _measure(fn, arg, reps: int) -> float:
    import jax

    jax.block_until_ready(fn(arg))  # compile + warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(arg))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def worker(args: argparse.Namespace) -> None:
    """One configuration: prints a JSON line (process 0 only)."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, str(ROOT))
    from eqjax import distributed as D

    info = D.init_distributed(
        f"127.0.0.1:{args.port}" if args.processes > 1 else None,
        args.processes if args.processes > 1 else None,
        args.process_id if args.processes > 1 else None,
        timeout_s=30,
    )
    import jax
    import numpy as np
    from jax import lax
    from jax.sharding import PartitionSpec as P

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    x = np.random.default_rng(0).standard_normal((TOKENS, K)).astype(np.float32)
    xg = D.global_batch(x[D.host_rows(TOKENS)], mesh, "data")
    from eqjax import statistics as S

    stats = {"absmax": S.absmax(), "xtx": S.xtx(), "count": S.count()}
    f_stats = D.sharded_statistics(stats, mesh, "data", num_blocks=BLOCKS)
    t_stats = _measure(f_stats, xg, args.reps)

    local_blocks = BLOCKS // n

    def sync(parts):  # parts: this device's [local_blocks, K, K] partials
        amax = lax.pmax(parts[0, 0], "data")
        g = lax.all_gather(parts, "data", axis=0, tiled=True)
        return D.tree_sum([g[i] for i in range(BLOCKS)]) + amax[None, :]

    f_sync = jax.jit(jax.shard_map(sync, mesh=mesh, in_specs=P("data"), out_specs=P(), check_vma=False))
    parts = D.global_batch(np.ones((BLOCKS // info.num_processes, K, K), np.float32) * (1 + info.process_id),
                           mesh, "data")
    t_sync = _measure(f_sync, parts, args.reps)
    assert local_blocks >= 1
    if info.process_id == 0:
        print(json.dumps({
            "devices": n, "processes": info.num_processes, "tokens": TOKENS, "K": K, "num_blocks": BLOCKS,
            "stats_s": t_stats, "tokens_per_s": TOKENS / t_stats, "collective_s": t_sync,
        }), flush=True)
    D.shutdown_distributed()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(devices: int, processes: int, reps: int, kill_after: int = 240) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    port = _free_port()
    procs = []
    for pid in range(processes):
        cmd = ["timeout", "-s", "KILL", str(kill_after), sys.executable, __file__, "--worker", "--devices",
               str(devices), "--processes", str(processes), "--process-id", str(pid), "--port", str(port),
               "--reps", str(reps)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    outs = [p.communicate() for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"config devices={devices} processes={processes} failed: "
                           + " | ".join(e[-1500:] for _, e in outs))
    return json.loads(outs[0][0].strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--processes", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "distributed"))
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    rows = []
    for devices, processes in ((1, 1), (2, 1), (4, 1), (8, 1), (1, 2)):
        r = run_config(devices, processes, args.reps)
        r["config"] = f"{processes} process x {devices} device" + ("s" if devices > 1 else "")
        rows.append(r)
        print(f"{r['config']:>22}: {r['tokens_per_s']:>10.0f} tokens/s, stats {r['stats_s'] * 1e3:7.1f} ms, "
              f"collective step {r['collective_s'] * 1e3:7.2f} ms", flush=True)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "note": "forced CPU devices share the same cores; other jobs were running (see load); "
                "these figures measure overhead, not scaling",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    base = rows[0]["tokens_per_s"]
    lines = [
        "# Data-parallel calibration statistics on CPU devices",
        "",
        f"{meta['date']}, {meta['machine']}, {meta['cpu_count']} CPU cores, 1-min load average "
        f"{meta['load_avg_1m']:.1f} (shared machine). Batch {TOKENS} tokens x K={K}, statistics = per-channel "
        f"absmax + X^T X ({BLOCKS} blocks) + count, median of {args.reps} runs.",
        "",
        "| configuration | tokens/s | vs 1 device | stats step (ms) | collective step (ms) |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['config']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base:.2f}x | "
                     f"{r['stats_s'] * 1e3:.1f} | {r['collective_s'] * 1e3:.2f} |")
    lines += [
        "",
        f"Honest reading: all forced devices (and both processes) share the same {meta['cpu_count']} cores, "
        "so beyond as many devices as cores nothing can scale (a gain up to that point only means one "
        "device's ops did not use every core); the load average above makes single figures noisy. The "
        "table mostly shows what sharding and the collectives cost. "
        "cost. The collective step is a pmax of [K] plus an all_gather of the "
        f"[{BLOCKS}, K, K] float32 partials and their tree sum; across processes it goes over gloo/TCP on "
        "127.0.0.1. Real scaling needs one device (or host) per core group.",
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
