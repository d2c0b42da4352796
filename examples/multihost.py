"""Multi-host calibration + quantization sketch: every host reads its own calibration shard.

Run one process per host (here: two processes on one machine, 2 CPU devices each)::

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python examples/multihost.py \\
        --coordinator 127.0.0.1:12345 --num-processes 2 --process-id 0 --out /tmp/q.npz &
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python examples/multihost.py \\
        --coordinator 127.0.0.1:12345 --num-processes 2 --process-id 1 --out /tmp/q.npz

(or set EQJAX_COORDINATOR / EQJAX_NUM_PROCESSES / EQJAX_PROCESS_ID; with none of them it runs
single-process). Steps: join the job, shard the calibration activations by host, compute the
SmoothQuant/GPTQ statistics with data-parallel collectives, quantize a weight tensor-parallel, and
write the result once, from process 0.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from eqjax import distributed as D


def main() -> None:
    ap = D.add_distributed_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    ap.add_argument("--out", default="multihost_out.npz")
    args = ap.parse_args()
    info = D.init_from_args(args)  # before any JAX computation

    import jax
    import numpy as np

    from eqjax.core.numerics import QuantSpec
    from eqjax.core.qarray import per_channel

    rng = np.random.default_rng(0)
    calib = rng.standard_normal((32, 16, 64)).astype(np.float32)  # stand-in for captured activations
    w = rng.standard_normal((64, 128)).astype(np.float32)

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    local = calib[D.host_rows(calib.shape[0])]  # this host's shard only
    from eqjax.calibration import statistics as S

    stats = D.sharded_statistics({"absmax": S.absmax(), "xtx": S.xtx()}, mesh)(
        D.global_batch(local, mesh)
    )
    stats = jax.block_until_ready(stats)

    tp = jax.make_mesh((jax.device_count(),), ("model",))
    q = jax.block_until_ready(D.quantize_sharded(w, QuantSpec(8, True, per_channel(1), "absmax"), tp, "model", 1))
    from jax.experimental import multihost_utils

    values = multihost_utils.process_allgather(q.values, tiled=True)
    scale = multihost_utils.process_allgather(q.scale, tiled=True)

    def write(path: Path) -> None:
        np.savez(path, absmax=np.asarray(stats["absmax"]), hessian=2 * np.asarray(stats["xtx"]),
                 values=values, scale=scale)
        print(f"process 0 of {info.num_processes} wrote {path}")

    D.write_once(args.out, write)
    D.shutdown_distributed()


if __name__ == "__main__":
    main()
