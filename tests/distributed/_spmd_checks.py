"""Single-process SPMD checks on 8 forced CPU devices; run by test_distributed.py in a subprocess
(XLA_FLAGS must be set before JAX starts). Prints one JSON line ``{"check name": bool, ...}``.

Every check compares a sharded computation with the single-device one *bitwise* (same dtype, shape
and bytes): float sums against the single-device :func:`compute_statistics` with the same
``num_blocks`` (the blockwise definition), everything else against plain single-device code.
"""

from __future__ import annotations

import json
import os
import sys
import time

# on a loaded 2-core machine a device thread can reach a collective late: wait longer than XLA's 40 s default
os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 --xla_cpu_collective_call_terminate_timeout_seconds=600 "
                           "--xla_cpu_collective_timeout_seconds=600")
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from eqjax import distributed as D  # noqa: E402
from eqjax.calibration import statistics as S  # noqa: E402
from eqjax.calibration.ema import ema_absmax  # noqa: E402
from eqjax.core.numerics import QuantSpec, quantize  # noqa: E402
from eqjax.core.qarray import per_channel, per_group, per_tensor, validate  # noqa: E402

MESHES = ((1, 8), (2, 4), (8, 1))


def same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def same_q(a, b) -> bool:
    return (
        same(a.values, b.values) and same(a.scale, b.scale) and same(a.zero_point, b.zero_point)
        and (a.bits, a.symmetric, a.granularity, a.shape) == (b.bits, b.symmetric, b.granularity, b.shape)
    )


def main() -> None:
    t0 = time.perf_counter()
    out: dict[str, bool] = {"device_count_8": jax.device_count() == 8}
    rng = np.random.default_rng(0)
    K, O = 32, 16
    x = (rng.standard_normal((16, 8, K)) * rng.uniform(0.1, 8.0, K)).astype(np.float32)
    w = rng.standard_normal((K, O)).astype(np.float32)
    stats = {
        "absmax": S.absmax(),
        "min": S.minimum(),
        "max": S.maximum(),
        "abs_mean": S.abs_sum(),
        "xtx": S.xtx(),
        "count": S.count(),
    }
    ref = jax.jit(lambda a: D.compute_statistics(stats, a))(x)
    # the blockwise definition is exact on integer-valued data (every partial sum is an integer < 2**24)
    xi = rng.integers(-3, 4, (16, 8, K)).astype(np.float32)
    ref_i = jax.jit(lambda a: D.compute_statistics({"xtx": S.xtx()}, a))(xi)["xtx"]
    xr = xi.reshape(-1, K).astype(np.float64)  # 128 rows: the finalizing division by 2**7 is exact too
    out["xtx_integer_data_exact"] = same(ref_i, (xr.T @ xr / len(xr)).astype(np.float32))

    from eqjax.methods.gptq import gptq_quantize
    from eqjax.methods.smoothquant import smooth_scales

    def smoothquant_params(amax):
        s = smooth_scales(amax, np.abs(np.asarray(w)).max(axis=1), 0.5)
        return quantize(jnp.asarray(w) * s[:, None], QuantSpec(8, True, per_channel(1), "absmax"))

    def gptq_params(h):
        return gptq_quantize(w, np.asarray(h), bits=4, group_size=16, symmetric=False, act_order=False)

    sq_ref = smoothquant_params(ref["absmax"])
    gq_ref = gptq_params(ref["xtx"])

    tp_specs = [
        ("tensor_sym8", QuantSpec(8, True, per_tensor(), "absmax")),
        ("tensor_asym8", QuantSpec(8, False, per_tensor(), "minmax")),
        ("channel_asym4", QuantSpec(4, False, per_channel(1), "minmax")),
        ("group8_sym4_f16", QuantSpec(4, True, per_group(0, 8), "absmax", scale_dtype="float16")),
        ("group12_asym4_ragged", QuantSpec(4, False, per_group(0, 12), "minmax")),  # straddles, ragged
        ("channel_mse4", QuantSpec(4, True, per_channel(1), "mse")),
    ]
    tp_ref = {name: quantize(jnp.asarray(w), spec) for name, spec in tp_specs}

    ema_ref = ema_absmax(0.9).init()
    upd = jax.jit(ema_absmax(0.9).update)
    steps = [x * (i + 1) for i in range(3)]
    for xs in steps:
        ema_ref = upd(ema_ref, xs)

    for shape in MESHES:
        mesh = jax.make_mesh(shape, ("data", "model"))
        tag = f"{shape[0]}x{shape[1]}"
        for axis, feat in (("data", None), (("data", "model"), None), ("data", "model")):
            if shape != (2, 4) and axis != "data":
                continue
            got = jax.block_until_ready(D.sharded_statistics(stats, mesh, axis, feature_axis=feat)(x))
            atag = f"{tag}:{'+'.join(D._axes_tuple(axis))}" + (f":features@{feat}" if feat else "")
            for k in stats:
                out[f"stats:{atag}:{k}"] = same(got[k], ref[k])
            if feat:
                out[f"stats:{atag}:absmax_sharded"] = got["absmax"].sharding.spec == jax.sharding.PartitionSpec("model")
            if axis == "data" and feat is None:
                out[f"smoothquant:{tag}"] = same_q(smoothquant_params(got["absmax"]), sq_ref)
                out[f"gptq:{tag}"] = same_q(gptq_params(got["xtx"]), gq_ref)
        for name, spec in tp_specs:
            if shape != (2, 4) and name not in ("tensor_asym8", "group12_asym4_ragged"):
                continue  # every layout on the 2x4 mesh, the cross-shard ones on all (keeps this fast)
            for dim in (0, 1):
                q = jax.block_until_ready(D.quantize_sharded(w, spec, mesh, "model", dim))
                validate(q)
                vs, ss = D.qarray_shardings(w.shape, spec, mesh, "model", dim)
                ok = same_q(q, tp_ref[name]) and q.values.sharding.is_equivalent_to(vs, 2)
                ok = ok and q.scale.sharding.is_equivalent_to(ss, 2)
                out[f"tp:{tag}:{name}:dim{dim}"] = bool(ok)
        ema = D.synced_ema_update(mesh, ("data", "model"), decay=0.9)
        st = ema_absmax(0.9).init()
        for xs in steps:
            st = jax.block_until_ready(ema(st, xs))
        out[f"ema:{tag}"] = same(st.absmax, ema_ref.absmax) and int(st.count) == 3
    # column-parallel per-output-channel scales stay sharded; per-tensor scales are replicated
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    q = D.quantize_sharded(w, QuantSpec(8, True, per_channel(1), "absmax"), mesh, "model", 1)
    out["tp:channel_scale_sharded"] = q.scale.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    q = D.quantize_sharded(w, QuantSpec(8, True, per_tensor(), "absmax"), mesh, "model", 1)
    out["tp:tensor_scale_replicated"] = q.scale.sharding.is_fully_replicated
    out["_seconds"] = round(time.perf_counter() - t0, 1)  # type: ignore[assignment]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
