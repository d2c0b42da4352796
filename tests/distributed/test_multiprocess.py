"""Two processes x two CPU devices on 127.0.0.1 (gloo), each under ``timeout -s KILL``.

A hung JAX process ignores SIGTERM, so every worker runs under a hard KILL timeout; the worker blocks
after every collective step. If one process dies, the other must exit non-zero on its own (the JAX
coordination service notices the missing heartbeats after the worker's ``--timeout`` seconds and
aborts the process with a message naming the dead task) well before the kill timeout.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
KILL_AFTER_S = 90


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_job(out: Path, *extra: str, timeout: int = 10) -> tuple[list[int], list[str], float]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONUNBUFFERED"] = "1"
    procs = []
    t0 = time.perf_counter()
    for pid in range(2):
        cmd = ["timeout", "-s", "KILL", str(KILL_AFTER_S), sys.executable, str(HERE / "_mp_worker.py"),
               "--port", str(port), "--process-id", str(pid), "--num-processes", "2", "--out", str(out),
               "--timeout", str(timeout), *extra]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                      cwd=ROOT))
    logs = [p.communicate()[0] for p in procs]
    return [p.returncode for p in procs], logs, time.perf_counter() - t0


def test_two_processes_match_single_device(tmp_path):
    rcs, logs, _ = _run_job(tmp_path)
    assert rcs == [0, 0], "\n\n".join(f"--- process {i} rc {rc}\n{log[-3000:]}" for i, (rc, log) in
                                     enumerate(zip(rcs, logs)))
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["process_count"] == 2 and res["device_count"] == 4
    assert all(res["stats"].values()), res
    assert res["ema"] is True
    assert res["tp"] == [True, True, True]
    assert res["budget_steps"] == [3, 3, 0.0, 0.0]  # a time budget: process 0's step count and block budget
    assert res["placed"] == [True, True, True]  # eqjax.distributed.put: host and local values onto both processes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]  # written once, by process 0


def test_dead_peer_fails_fast_without_hanging(tmp_path):
    rcs, logs, took = _run_job(tmp_path, "--die-after-init", timeout=4)
    assert rcs[1] == 7, logs[1][-2000:]
    # process 0 exits on its own: non-zero, not killed by the hard timeout (SIGKILL -> -9 / 137)
    assert rcs[0] not in (0, -9, 137), (rcs, logs[0][-3000:])
    assert took < KILL_AFTER_S - 5
    # the watchdog's eqjax error names the dead process (JAX's own messages are the backstop)
    assert ("eqjax: error: process 1 of 2" in logs[0] or "unhealthy" in logs[0] or "another task died" in logs[0]), \
        logs[0][-3000:]
    assert not (tmp_path / "result.json").exists()
