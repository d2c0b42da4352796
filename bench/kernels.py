"""Benchmark the Pallas kernels against XLA: bf16 matmul, int8 dot_general, and the XLA W8A8/W4A16 paths.

Usage::

    python bench/kernels.py                 # GPU: full grid; CPU: small XLA-only grid (~1 min)
    python bench/kernels.py --ms 1 16 --ks 4096 --out bench/results/kernels_h100

Per (M, K = N) and method it records the median time of repeated, warmed-up runs, TFLOP/s
(``2 M N K / t``) and TB/s (bytes of weights + activations + output / t; the figure that matters at
decode, M <= 16). Each timed sample runs the op ``R`` times inside one jitted function (operands
threaded through ``lax.optimization_barrier`` so XLA neither hoists the weight-only work out of the
repetitions nor merges them), then ``block_until_ready``; time per op = sample / R. This keeps
Python dispatch out of microsecond-scale decode timings.

Methods:
  xla_bf16       jnp.matmul(x bf16, w bf16) -> bf16 (the float baseline)
  xla_int8_dot   lax.dot_general(int8, int8, preferred_element_type=int32), operands pre-quantized
  xla_w8a8       eqjax.linear(..., backend="xla") for an ActQuantKernel (dynamic per-token int8)
  pallas_w8a8    eqjax.linear(..., backend="pallas"): the fused W8A8 Triton kernel
  xla_w4a16      eqjax.linear(..., backend="xla") for an int4 asymmetric group-128 QArray
  pallas_w4a16   eqjax.linear(..., backend="pallas"): the W4A16 Triton kernel
  ref_w8a8       pallas_kernels.w8a8_matmul_xla on the same arrays: the kernel's XLA reference (what
                 backend="pallas" runs off CUDA; same arithmetic as xla_w8a8)
  ref_w4a16      pallas_kernels.w4a16_matmul_xla: the W4A16 kernel's XLA reference (group scales on
                 fp32 partial sums, one scan step per group)

Pallas kernels are timed only on a CUDA GPU. On any other platform their rows are written with
``null`` figures and the report says they were not timed -- nothing is estimated.
On a GPU each kernel's output is also compared with the XLA path (max relative difference); the
ref_* rows are compared with it everywhere.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from eqjax.core.linear import ActQuantKernel, linear, quantize_activations  # noqa: E402
from eqjax.core.numerics import QuantSpec, quantize  # noqa: E402
from eqjax.core.qarray import per_channel, per_group  # noqa: E402

GPU_MS = (1, 16, 128, 1024, 4096)
GPU_KS = (4096, 8192)
CPU_MS = (1, 16, 128)
CPU_KS = (256, 512)
GROUP = 128
METHODS = ("xla_bf16", "xla_int8_dot", "xla_w8a8", "pallas_w8a8", "ref_w8a8", "xla_w4a16", "pallas_w4a16", "ref_w4a16")


def _nbytes(*arrays) -> int:
    return int(sum(np.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(arrays)))


def _make_case(m: int, k: int, n: int, seed: int = 0):
    key = jax.random.PRNGKey(seed)
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (k, n), jnp.float32) * 0.02
    w8 = quantize(w, QuantSpec(bits=8, symmetric=True, granularity=per_channel(1)))
    w4 = quantize(w, QuantSpec(bits=4, symmetric=False, granularity=per_group(0, GROUP), scale_dtype="bfloat16"))
    qx, _ = quantize_activations(x)
    return {
        "x": x,
        "w_bf16": w.astype(jnp.bfloat16),
        "qx": qx,
        "w8": w8,
        "w4": w4,
    }


def _ops(case):
    """method -> (fn, args, bytes moved by an ideal kernel)."""
    x, m = case["x"], case["x"].shape[0]
    n = case["w_bf16"].shape[1]
    out_b = m * n * 2
    ak = ActQuantKernel(case["w8"])
    return {
        "xla_bf16": (lambda x, w: jnp.matmul(x, w), (x, case["w_bf16"]), _nbytes(x, case["w_bf16"]) + out_b),
        "xla_int8_dot": (
            lambda a, b: jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32),
            (case["qx"], case["w8"].values),
            _nbytes(case["qx"], case["w8"].values) + m * n * 4,
        ),
        "xla_w8a8": (lambda x, kk: linear(x, {"kernel": kk}, backend="xla"), (x, ak), _nbytes(x, ak) + out_b),
        "pallas_w8a8": (lambda x, kk: linear(x, {"kernel": kk}, backend="pallas"), (x, ak), _nbytes(x, ak) + out_b),
        "xla_w4a16": (
            lambda x, q: linear(x, {"kernel": q}, backend="xla"),
            (x, case["w4"]),
            _nbytes(x, case["w4"]) + out_b,
        ),
        "pallas_w4a16": (
            lambda x, q: linear(x, {"kernel": q}, backend="pallas"),
            (x, case["w4"]),
            _nbytes(x, case["w4"]) + out_b,
        ),
        "ref_w8a8": (
            lambda x, w, s: pk.w8a8_matmul_xla(x, w, s),
            (x, case["w8"].values, case["w8"].scale.reshape(-1)),
            _nbytes(x, ak) + out_b,
        ),
        "ref_w4a16": (
            lambda x, p, s, z: pk.w4a16_matmul_xla(x, p, s, z, group_size=GROUP),
            (x, case["w4"].values, case["w4"].scale, case["w4"].zero_point),
            _nbytes(x, case["w4"]) + out_b,
        ),
    }


def _repeated(fn, reps: int):
    """jit of ``reps`` back-to-back applications of ``fn`` on barrier-threaded operands."""

    def run(*args):
        acc = jnp.zeros((), jnp.float32)
        for _ in range(reps):
            args = jax.lax.optimization_barrier(args)
            y = jax.lax.optimization_barrier(fn(*args))
            acc = acc + y.reshape(-1)[0].astype(jnp.float32)
        return acc

    return jax.jit(run)


def _time(fn, args, *, reps: int, samples: int, warmup: int = 2) -> float:
    f = _repeated(fn, reps)
    for _ in range(warmup):
        f(*args).block_until_ready()
    ts = []
    for _ in range(samples):
        t0 = time.perf_counter()
        f(*args).block_until_ready()
        ts.append((time.perf_counter() - t0) / reps)
    return statistics.median(ts)


def _reps_for(m: int, k: int, on_gpu: bool) -> int:
    if not on_gpu:
        return 2
    flops = 2 * m * k * k
    return 50 if flops < 2e10 else 20 if flops < 2e11 else 5


def _is_cuda() -> bool:
    d = jax.devices()[0]
    if d.platform == "cuda":
        return True
    return d.platform == "gpu" and "rocm" not in str(getattr(d.client, "platform_version", "")).lower()


def _device_name() -> str:
    d = jax.devices()[0]
    return f"{d.platform}: {getattr(d, 'device_kind', str(d))}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ms", type=int, nargs="*", help="token counts M")
    p.add_argument("--ks", type=int, nargs="*", help="K = N sizes")
    p.add_argument("--samples", type=int, default=None, help="timed samples per point (median taken)")
    p.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "kernels"), help="output path without suffix")
    args = p.parse_args(argv)

    on_gpu = _is_cuda()
    ms = args.ms or (GPU_MS if on_gpu else CPU_MS)
    ks = args.ks or (GPU_KS if on_gpu else CPU_KS)
    samples = args.samples or (10 if on_gpu else 3)
    device = _device_name()
    print(f"device: {device}; kernels timed: {on_gpu}", flush=True)

    rows = []
    load_start = os.getloadavg()[0]  # the 1-minute load average: other jobs sharing the CPUs
    t_start = time.perf_counter()
    for k in ks:
        for m in ms:
            case = _make_case(m, k, k)
            ops = _ops(case)
            ref = {}
            for name in args.methods:
                fn, fargs, nbytes = ops[name]
                row = {"method": name, "M": m, "K": k, "N": k, "time_s": None, "tflops": None, "tbps": None,
                       "bytes": nbytes, "max_rel_diff_vs_xla": None, "note": ""}
                if name.startswith("ref"):
                    row["note"] = "XLA reference of the kernel"
                if name.startswith("pallas") and not on_gpu:
                    row["note"] = "not timed: no CUDA GPU (the kernel lowers for CUDA only)"
                    rows.append(row)
                    continue
                try:
                    t = _time(fn, fargs, reps=_reps_for(m, k, on_gpu), samples=samples)
                except Exception as e:  # record and go on: one failing kernel must not hide the rest
                    row["note"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
                    rows.append(row)
                    print(f"  {name:13s} M={m:5d} K=N={k}: {row['note']}", flush=True)
                    continue
                row["time_s"] = t
                row["tflops"] = 2.0 * m * k * k / t / 1e12
                row["tbps"] = nbytes / t / 1e12
                if name in ("xla_w8a8", "xla_w4a16"):
                    ref[name] = np.asarray(jax.jit(fn)(*fargs).astype(jnp.float32))
                if name.startswith(("pallas", "ref")):
                    want = ref.get("xla" + name[name.index("_"):])
                    if want is not None:
                        got = np.asarray(jax.jit(fn)(*fargs).astype(jnp.float32))
                        row["max_rel_diff_vs_xla"] = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
                rows.append(row)
                print(f"  {name:13s} M={m:5d} K=N={k}: {t * 1e6:10.1f} us  {row['tflops']:8.2f} TFLOP/s  "
                      f"{row['tbps']:6.3f} TB/s", flush=True)
            res = _result(device, on_gpu, samples, t_start, load_start, rows)
            _save(Path(args.out), res, _markdown(res))

    out = Path(args.out)
    res = _result(device, on_gpu, samples, t_start, load_start, rows)
    _save(out, res, _markdown(res))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0


def gpu_run_header(tool: str, **fields) -> dict | None:
    """The common head of a GPU-only benchmark's result (device, versions, date, ``fields``, empty
    rows), or None after saying on stderr that there is no CUDA GPU."""
    if not _is_cuda():
        print(f"{tool}: needs a CUDA GPU (the Triton kernels lower for CUDA only); nothing measured", file=sys.stderr)
        return None
    return {"device": _device_name(), "jax": jax.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **fields, "rows": [], "stopped_early": False}


def _result(device, on_gpu, samples, t_start, load_start, rows) -> dict:
    return {
        "device": device,
        "kernels_timed": bool(on_gpu),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "group_size_w4": GROUP,
        "samples": samples,
        "wall_s": round(time.perf_counter() - t_start, 1),
        "cpus": os.cpu_count(),
        "load_avg_1min": [round(load_start, 2), round(os.getloadavg()[0], 2)],  # at start, at end
        "rows": rows,
    }


def _save(out: Path, result: dict, markdown: str) -> None:
    """Write JSON + markdown (temp file, then rename); called after every shape, so a run stopped
    early keeps what it measured."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for suffix, text in ((".json", json.dumps(result, indent=1)), (".md", markdown)):
        tmp = out.with_suffix(suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(out.with_suffix(suffix))


def _fmt(v, spec):
    return "—" if v is None else format(v, spec)


def _markdown(r) -> str:
    lines = [
        "# Kernel benchmark",
        "",
        f"Device: **{r['device']}**; jax {r['jax']}; {r['date']}; median of {r['samples']} samples after warm-up.",
        "",
        f"Host: {r['cpus']} CPUs; 1-minute load average {r['load_avg_1min'][0]} at the start, "
        f"{r['load_avg_1min'][1]} at the end.",
        "Other jobs share the machine: with a load above the CPU count these timings are noisy and indicative only.",
        "",
    ]
    if not r["kernels_timed"]:
        lines += [
            "**The Pallas kernels were not timed**: this run had no CUDA GPU. Their rows are empty (—) on",
            "purpose; no figure is estimated. Only the XLA paths were timed, at small sizes, on this device.",
            "",
        ]
    lines += [
        "TFLOP/s = 2·M·N·K / t. TB/s = (weights + activations + output bytes) / t: the figure that matters at",
        "decode (M ≤ 16). W4A16: int4 asymmetric, group 128, bf16 scales. W8A8: int8 per-channel weights,",
        "dynamic per-token int8 activations. xla_int8_dot is the bare int8 GEMM on pre-quantized operands.",
        "ref_* are pallas_kernels' XLA references of the kernels (what backend=\"pallas\" runs off CUDA).",
        "",
        "| M | K = N | method | time (µs) | TFLOP/s | TB/s | max rel. diff vs XLA | note |",
        "|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for row in r["rows"]:
        t = None if row["time_s"] is None else row["time_s"] * 1e6
        lines.append(
            f"| {row['M']} | {row['K']} | {row['method']} | {_fmt(t, '.1f')} | {_fmt(row['tflops'], '.2f')} | "
            f"{_fmt(row['tbps'], '.3f')} | {_fmt(row['max_rel_diff_vs_xla'], '.2e')} | {row['note']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
