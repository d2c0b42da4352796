"""The CLI on two processes (127.0.0.1, gloo), each under ``timeout -s KILL``, vs one process.

* ``eqjax quantize`` (GPTQ, calibration windows dealt to both processes' devices): every process
  takes part in the Orbax save, the checkpoint is written once and loads on one process with
  params bitwise equal to the one-process checkpoint.
* ``eqjax eval --checkpoint`` on two processes: the same perplexity as one process; only process 0
  writes its ``--json`` (each process is given its own path, process 1's must not appear).
* Processes given different ``--seed`` values (different calibration windows) both exit 2 with one
  ``eqjax: error:`` line naming what differs, and write nothing.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.test_cli import tiny  # noqa: F401,F811 - the tiny HF model fixture

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
KILL_AFTER_S = 400


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _cli(*argv: str) -> list[str]:
    return ["timeout", "-s", "KILL", str(KILL_AFTER_S), sys.executable, "-m", "eqjax.cli", *argv]


def _one(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(_cli(*argv), capture_output=True, text=True, env=_env(), cwd=ROOT)


def _two(per_process) -> list[tuple[int, str, str]]:
    """Run ``per_process(pid) -> argv`` as a 2-process job; [(rc, stdout, stderr)] by process."""
    port = _free_port()
    procs = [subprocess.Popen(_cli(*per_process(pid), "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                                   "--process-id", str(pid)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
             for pid in range(2)]
    outs = [p.communicate() for p in procs]
    return [(p.returncode, *o) for p, o in zip(procs, outs)]


def _show(res) -> str:
    return "\n".join(f"--- process {i} rc {rc}\n{out[-1500:]}\n{err[-3000:]}" for i, (rc, out, err) in enumerate(res))


def _leaves(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def test_two_process_quantize_save_eval_equal_one_process(tiny, tmp_path):  # noqa: F811
    from eqjax.io.orbax import load_quantized

    d, text = tiny
    q = ["quantize", "--model", str(d), "--text", str(text), "--recipe", "w4g128-gptq", "--calib-windows", "4",
         "--calib-ctx", "32"]
    r = _one(*q, "--out", str(tmp_path / "ck1"))
    assert r.returncode == 0, r.stderr[-3000:]
    res = _two(lambda pid: [*q, "--out", str(tmp_path / "ck2")])
    assert [rc for rc, _, _ in res] == [0, 0], _show(res)
    assert "saved" in res[0][1] and "saved" not in res[1][1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck1", "ck2"]  # no temporary directory left
    a, _ = load_quantized(tmp_path / "ck1")
    b, _ = load_quantized(tmp_path / "ck2")
    la, lb = _leaves(a), _leaves(b)
    assert la.keys() == lb.keys() and la
    assert [k for k in la if la[k].dtype != lb[k].dtype or not np.array_equal(la[k], lb[k])] == []

    ev = ["eval", "--model", str(d), "--text", str(text), "--ctx", "32", "--eval-tokens", "192", "--batch-size", "1",
          "--checkpoint", str(tmp_path / "ck2")]
    r = _one(*ev, "--json", str(tmp_path / "one.json"))
    assert r.returncode == 0, r.stderr[-3000:]
    res = _two(lambda pid: [*ev, "--json", str(tmp_path / f"two{pid}.json")])
    assert [rc for rc, _, _ in res] == [0, 0], _show(res)
    assert not (tmp_path / "two1.json").exists()  # only process 0 writes
    one, two = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "two0.json"))
    assert one["ppl"] == two["ppl"] and one["eval_tokens"] == two["eval_tokens"]


def test_processes_with_different_seeds_fail_clearly(tiny, tmp_path):  # noqa: F811
    d, text = tiny
    res = _two(lambda pid: ["quantize", "--model", str(d), "--text", str(text), "--recipe", "w4g128-gptq",
                            "--calib-windows", "4", "--calib-ctx", "32", "--seed", str(pid),
                            "--out", str(tmp_path / "ck")])
    assert [rc for rc, _, _ in res] == [2, 2], _show(res)
    for _, _, err in res:
        lines = [ln for ln in err.splitlines() if ln.startswith("eqjax: error:")]
        assert len(lines) == 1 and "different jobs (calibration windows)" in lines[0], err[-3000:]
    assert not any(tmp_path.iterdir())
