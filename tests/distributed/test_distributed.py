"""Scale synchronization (eqjax.distributed).

The SPMD checks need 8 CPU devices, which XLA only creates if ``XLA_FLAGS`` is set before JAX
starts; the test process has already started JAX (tests/conftest.py), so they run once in a
subprocess (``_spmd_checks.py``) under a hard kill timeout and report one boolean per check.
"Identical" means same dtype, shape and bytes (see the eqjax.distributed module docs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqjax import distributed as D
from eqjax.calibration import statistics as S

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SPMD_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def spmd() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    cmd = ["timeout", "-s", "KILL", str(SPMD_TIMEOUT_S), sys.executable, str(HERE / "_spmd_checks.py")]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, f"spmd checks failed (rc {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def _failed(res: dict, prefix: str) -> list[str]:
    keys = [k for k in res if k.startswith(prefix)]
    assert keys, f"no {prefix!r} checks ran"
    return [k for k in keys if res[k] is not True]


@pytest.mark.parametrize(
    "prefix",
    ["device_count_8", "xtx_integer_data_exact", "stats:", "smoothquant:", "gptq:", "tp:", "ema:"],
)
def test_spmd_bitwise_identical_to_single_device(spmd, prefix):
    assert _failed(spmd, prefix) == []


def test_spmd_covers_all_meshes(spmd):
    for mesh in ("1x8", "2x4", "8x1"):
        for kind in ("stats", "smoothquant", "gptq", "tp", "ema"):
            assert any(k.startswith(f"{kind}:{mesh}") for k in spmd), (kind, mesh)


# ---- in-process (one device) -------------------------------------------------------------------


def test_tree_sum_order():
    parts = [jnp.asarray(v, jnp.float32) for v in (1e8, 1.0, -1e8, 1.0, 3.0)]
    # ((p0 + p1) + (p2 + p3)) + p4 in float32
    f32 = np.float32
    want = ((f32(1e8) + f32(1.0)) + (f32(-1e8) + f32(1.0))) + f32(3.0)
    assert float(D.tree_sum(parts)) == float(want)
    with pytest.raises(ValueError):
        D.tree_sum([])


def test_compute_statistics_values():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 4, 6)).astype(np.float32)
    stats = {"a": S.absmax(), "lo": S.minimum(), "hi": S.maximum(), "s": S.abs_sum(), "h": S.xtx(), "n": S.count()}
    got = D.compute_statistics(stats, jnp.asarray(x), num_blocks=4)
    r = x.reshape(-1, 6).astype(np.float64)
    np.testing.assert_array_equal(got["a"], np.abs(x).reshape(-1, 6).max(0))
    np.testing.assert_array_equal(got["lo"], x.reshape(-1, 6).min(0))
    np.testing.assert_array_equal(got["hi"], x.reshape(-1, 6).max(0))
    np.testing.assert_allclose(got["s"], np.abs(r).mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["h"], r.T @ r / 32, rtol=1e-5, atol=1e-5)
    assert float(got["n"]) == 32.0 and got["n"].dtype == jnp.float32


def test_compute_statistics_errors():
    x = jnp.zeros((6, 3), jnp.float32)
    with pytest.raises(ValueError, match="blocks"):
        D.compute_statistics({"h": S.xtx()}, x, num_blocks=4)
    with pytest.raises(ValueError, match="multiple"):
        D.compute_statistics({"h": S.xtx()}, x, num_blocks=3, axis_size=2)
    mean = S.Statistic("mean", S.count().init, S.count().partial, "mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="merge"):
        D.compute_statistics({"m": mean}, x, num_blocks=2)


def test_sharded_statistics_one_device_mesh():
    mesh = jax.make_mesh((1,), ("data",))
    x = np.random.default_rng(2).standard_normal((8, 5)).astype(np.float32)
    stats = {"a": S.absmax(), "h": S.xtx()}
    got = D.sharded_statistics(stats, mesh)(x)
    ref = jax.jit(lambda a: D.compute_statistics(stats, a))(x)
    for k in stats:
        assert np.asarray(got[k]).tobytes() == np.asarray(ref[k]).tobytes()
    with pytest.raises(ValueError, match="no axis"):
        D.sharded_statistics(stats, mesh, "batch")
    assert np.asarray(D.sharded_statistic(S.absmax(), mesh)(x)).tobytes() == np.asarray(ref["a"]).tobytes()


def test_quantize_sharded_rejects_bad_layouts():
    from eqjax.core.numerics import QuantSpec
    from eqjax.core.qarray import QArrayError, per_channel

    mesh = jax.make_mesh((1,), ("model",))
    with pytest.raises(TypeError):
        D.quantize_sharded(jnp.zeros((4, 4), jnp.int32), QuantSpec(), mesh)
    with pytest.raises(ValueError, match="non-finite"):
        D.quantize_sharded(jnp.full((4, 4), jnp.nan), QuantSpec(), mesh, name="w")
    # 4-bit codes pack 2 per byte along axis 0: a shard of odd length cannot be packed locally
    from eqjax.distributed import _tp_plan

    with pytest.raises(QArrayError, match="packed"):
        _tp_plan((6, 4), QuantSpec(4, True, per_channel(1), "absmax"), 2, 0)
    with pytest.raises(QArrayError, match="split"):
        _tp_plan((6, 4), QuantSpec(8, True, per_channel(1), "absmax"), 4, 0)


def test_init_distributed_single_process(monkeypatch):
    for var in ("EQJAX_COORDINATOR", "EQJAX_NUM_PROCESSES", "EQJAX_PROCESS_ID", "JAX_COORDINATOR_ADDRESS",
                "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    info = D.init_distributed()
    assert (info.process_id, info.num_processes, info.initialized) == (0, 1, False)
    assert D.is_main_process()
    assert D.init_distributed(num_processes=1).initialized is False


def test_init_distributed_argument_errors(monkeypatch):
    monkeypatch.setenv("EQJAX_COORDINATOR", "127.0.0.1:1234")
    monkeypatch.delenv("EQJAX_NUM_PROCESSES", raising=False)
    monkeypatch.delenv("EQJAX_PROCESS_ID", raising=False)
    with pytest.raises(D.DistributedError, match="number of processes"):
        D.init_distributed()
    monkeypatch.setenv("EQJAX_NUM_PROCESSES", "two")
    with pytest.raises(D.DistributedError, match="integer"):
        D.init_distributed()
    with pytest.raises(D.DistributedError, match="process_id"):
        D.init_distributed("127.0.0.1:1", 2, 5)
    with pytest.raises(D.DistributedError, match="host:port"):
        D.init_distributed("localhost", 2, 0)
    # the backend is already up in this process: refuse rather than half-initialize
    jax.devices()
    with pytest.raises(D.DistributedError, match="before any JAX computation"):
        D.init_distributed("127.0.0.1:1", 2, 0)


def test_cli_args(monkeypatch):
    for var in ("EQJAX_COORDINATOR", "EQJAX_NUM_PROCESSES", "EQJAX_PROCESS_ID", "JAX_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    p = D.add_distributed_args(argparse.ArgumentParser())
    a = p.parse_args(["--coordinator", "10.0.0.1:1234", "--num-processes", "4", "--process-id", "2"])
    assert (a.coordinator, a.num_processes, a.process_id, a.dist_timeout) == ("10.0.0.1:1234", 4, 2, None)
    assert D.init_from_args(p.parse_args([])).initialized is False


def test_host_rows_and_write_once(tmp_path):
    assert D.host_rows(12, 1, 3) == slice(4, 8)
    with pytest.raises(ValueError):
        D.host_rows(10, 0, 3)
    path = tmp_path / "out.txt"
    D.write_once(path, lambda p: p.write_text("x"))
    assert path.read_text() == "x"
    D.barrier("noop")


@pytest.mark.parametrize("log, expect", [
    ("F1124 08:06:26.835111 28553 client.h:80] Terminating process because the JAX distributed service detected "
     "fatal errors. absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded\n\nRPC: /xla.coordination.CoordinationService/"
     "RegisterTask\n*** Check failure stack trace: ***\n", "could not join the job: the coordinator (process 0 at h:1)"),
    ("E1124 coordination_service.cc:1] The following tasks are unhealthy (stopped sending heartbeats):\n 1\n",
     "process 1 stopped sending heartbeats"),
    ("F1124 x.cc:1] leader task was preempted/died\n", "lost the coordinator (process 0 at h:1)"),
    ("", "the process ended abnormally"),
])
def test_explain_abort_names_what_happened(log, expect):
    """The supervisor's reading of the JAX runtime's last lines (captured from real failed runs)."""
    from eqjax.distributed.supervise import explain_abort

    assert explain_abort(log, "h:1").startswith(expect)


def test_collective_failure_is_none_without_a_job():
    from eqjax.distributed.runtime import collective_failure

    assert collective_failure(RuntimeError("x")) is None
