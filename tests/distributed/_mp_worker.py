"""One process of a 2-process x 2-CPU-device job (gloo on 127.0.0.1), run by test_multiprocess.py.

    python _mp_worker.py --port P --process-id I --num-processes 2 --out DIR [--die-after-init]

Each process reads only its own calibration rows, computes data-parallel statistics, a synced EMA
step and a tensor-parallel quantization on the 4-device global mesh, blocking after every collective
step. Process 0 compares with the single-device results on its own local device and writes
``DIR/result.json`` (once). Any failure prints ``WORKER <id> FAILED: ...`` and exits 3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def _same(a, b) -> bool:
    import numpy as np

    if a is None or b is None:
        return a is None and b is None
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--die-after-init", action="store_true", help="process 1 exits right after joining")
    ap.add_argument("--timeout", type=int, default=10)
    from eqjax import distributed as D

    D.add_distributed_args(ap)
    args = ap.parse_args()
    pid = args.process_id
    t0 = time.perf_counter()
    try:
        info = D.init_distributed(f"127.0.0.1:{args.port}", args.num_processes, pid, timeout_s=args.timeout)
        if args.die_after_init and pid == 1:
            print("WORKER 1 exiting on purpose", flush=True)
            os._exit(7)
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.experimental import multihost_utils
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from eqjax.calibration.ema import EmaState, ema_absmax
        from eqjax.core.numerics import QuantSpec, quantize
        from eqjax.core.qarray import per_channel, per_group, per_tensor

        assert info.device_count == 2 * args.num_processes, info
        rng = np.random.default_rng(0)
        x = rng.standard_normal((16, 8, 32)).astype(np.float32)  # every host can make it; uses only its rows
        w = rng.standard_normal((64, 32)).astype(np.float32)
        mesh = jax.make_mesh((info.device_count,), ("data",))
        from eqjax.calibration import statistics as S

        stats = {"amax": S.absmax(), "h": S.xtx(), "n": S.count(), "s": S.abs_sum()}

        local = x[D.host_rows(x.shape[0])]
        xg = D.global_batch(local, mesh, "data")
        got = jax.block_until_ready(D.sharded_statistics(stats, mesh, "data")(xg))
        got = {k: np.asarray(v) for k, v in got.items()}

        ema = D.synced_ema_update(mesh, "data", decay=0.9)
        rep = NamedSharding(mesh, P())
        state = EmaState(*(jax.make_array_from_process_local_data(rep, np.asarray(a)) for a in ema_absmax().init()))
        for step in range(3):
            xs = x * (step + 1)
            state = jax.block_until_ready(ema(state, D.global_batch(xs[D.host_rows(x.shape[0])], mesh, "data")))
        ema_got = np.asarray(state.absmax)

        tp_mesh = jax.make_mesh((info.device_count,), ("model",))
        specs = [
            (QuantSpec(8, True, per_tensor(), "absmax"), 0),
            (QuantSpec(4, False, per_channel(1), "minmax"), 1),
            (QuantSpec(4, True, per_group(0, 32), "absmax", scale_dtype="float16"), 0),  # groups straddle shards
        ]
        tp = []
        for spec, dim in specs:
            q = D.quantize_sharded(w, spec, tp_mesh, "model", dim)
            jax.block_until_ready(q)
            fields = [multihost_utils.process_allgather(a, tiled=True) if a is not None else None
                      for a in (q.values, q.scale, q.zero_point)]
            tp.append((spec, fields))

        # local jax arrays (uncommitted, committed) and host values onto a sharding spanning both processes
        locals_ = [np.arange(6, dtype=np.float32), jnp.arange(6, dtype=jnp.float32),
                   jax.device_put(np.arange(6, dtype=np.float32), jax.local_devices()[0])]
        placed = []
        for v in locals_:
            g = D.put(v, rep)
            placed.append(all(np.array_equal(np.asarray(sh.data), np.arange(6)) for sh in g.addressable_shards)
                          and len(g.addressable_shards) == jax.local_device_count())

        # a wall-time budget: every process runs process 0's step count (1e-9 s there: 3 steps)
        from eqjax.calibration.blockfit import StepBudget, share_budget

        budget = StepBudget(1000, 1e-9 if pid == 0 else 1e6)
        for i in (1, 2, 3):
            n_steps = budget.after(i, jnp.zeros(()))
        budget_steps = [int(v) for v in np.ravel(multihost_utils.process_allgather(np.int64(n_steps)))]
        share = share_budget(10.0, time.perf_counter() - (20.0 if pid == 0 else 0.0), 2)  # process 0: spent
        budget_steps += [float(v) for v in np.ravel(multihost_utils.process_allgather(np.float64(share)))]

        def write(path):
            dev = jax.local_devices()[0]
            with jax.default_device(dev):
                ref = jax.jit(lambda a: D.compute_statistics(stats, a))(x)
                st = ema_absmax(0.9).init()
                upd = ema_absmax(0.9).update
                for step in range(3):
                    st = upd(st, jnp.asarray(x * (step + 1)))
                out = {
                    "stats": {k: _same(got[k], ref[k]) for k in stats},
                    "ema": _same(ema_got, st.absmax),
                    "tp": [],
                    "placed": placed,
                    "budget_steps": budget_steps,
                    "process_count": jax.process_count(),
                    "device_count": jax.device_count(),
                }
                for spec, (v, s, z) in tp:
                    r = quantize(jnp.asarray(w), spec)
                    out["tp"].append(_same(v, r.values) and _same(s, r.scale) and _same(z, r.zero_point))
            os.makedirs(path.parent, exist_ok=True)
            path.write_text(json.dumps(out))

        D.write_once(os.path.join(args.out, "result.json"), write)
        print(f"WORKER {pid} OK in {time.perf_counter() - t0:.1f}s", flush=True)
        D.shutdown_distributed()
        return 0
    except BaseException as e:  # noqa: BLE001 - report and exit non-zero, never hang
        print(f"WORKER {pid} FAILED after {time.perf_counter() - t0:.1f}s: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(3)  # skip atexit hooks (jax.distributed's shutdown barrier would wait for the dead peer)


if __name__ == "__main__":
    sys.exit(main())
