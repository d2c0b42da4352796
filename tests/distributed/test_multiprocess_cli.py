"""The CLI on two processes x two CPU devices (127.0.0.1, gloo), each under ``timeout -s KILL``.

* ``eqjax quantize`` with ``w8a8-smoothquant``, ``w4g128-gptq`` and ``w4g128-awq`` (calibration
  windows dealt to the 4 devices of both processes): every process takes part in the Orbax save, the
  checkpoint is written once, and it loads on one process with params bitwise equal to the checkpoint
  of one process x one device (statistics are merged in global batch order: see eqjax.calibrate).
* ``eqjax eval --checkpoint`` on two processes: the same perplexity as one process; only process 0
  writes its ``--json`` (each process is given its own path, process 1's must not appear).
* Processes given different ``--seed`` values (different calibration windows) both exit 2 with one
  ``eqjax: error:`` line naming what differs, and write nothing.
* Faults: a peer killed mid-calibration ends the survivor within the ``--dist-timeout`` with one
  line naming the dead process; a coordinator nobody runs ends the process with one line naming it;
  a job killed mid-save leaves the previous checkpoint intact and the partial one detectable.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.cli.test_cli import tiny  # noqa: F401,F811 - the tiny HF model fixture

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
KILL_AFTER_S = 400
RECIPES = ("w8a8-smoothquant", "w4g128-gptq", "w4g128-awq")
CALIB = ["--calib-windows", "8", "--calib-len", "32"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int = 1, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "EQJAX_SUPERVISED")}
    env["PYTHONUNBUFFERED"] = "1"
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env.update(extra)
    return env


def _cli(*argv: str, entry: tuple[str, ...] = ("-m", "eqjax.cli")) -> list[str]:
    return ["timeout", "-s", "KILL", str(KILL_AFTER_S), sys.executable, *entry, *argv]


def _one(*argv: str) -> subprocess.CompletedProcess:
    """One process, one device."""
    return subprocess.run(_cli(*argv), capture_output=True, text=True, env=_env(), cwd=ROOT)


def _start_two(per_process, *, devices: int = 2, entry: tuple[str, ...] = ("-m", "eqjax.cli"),
               **env: str) -> list[subprocess.Popen]:
    port = _free_port()
    return [subprocess.Popen(_cli(*per_process(pid), "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                                  "--process-id", str(pid), entry=entry),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(devices, **env),
                             cwd=ROOT)
            for pid in range(2)]


def _two(per_process, devices: int = 2) -> list[tuple[int, str, str]]:
    """Run ``per_process(pid) -> argv`` as a 2-process job; [(rc, stdout, stderr)] by process."""
    procs = _start_two(per_process, devices=devices)
    outs = [p.communicate() for p in procs]
    return [(p.returncode, *o) for p, o in zip(procs, outs)]


def _show(res) -> str:
    return "\n".join(f"--- process {i} rc {rc}\n{out[-1500:]}\n{err[-3000:]}" for i, (rc, out, err) in enumerate(res))


def _leaves(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _errors(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("eqjax: error:")]


@pytest.fixture(scope="module")
def one_process(tiny, tmp_path_factory):  # noqa: F811
    """The checkpoint of each recipe from one process x one device."""
    d, text = tiny
    root = tmp_path_factory.mktemp("one")
    for rec in RECIPES:
        r = _one("quantize", "--model", str(d), "--text", str(text), "--recipe", rec, *CALIB, "--out",
                 str(root / rec))
        assert r.returncode == 0, r.stderr[-3000:]
    return root


@pytest.mark.parametrize("recipe", RECIPES)
def test_two_by_two_quantize_equals_one_device(tiny, one_process, tmp_path, recipe):  # noqa: F811
    from eqjax.io.orbax import load_quantized

    d, text = tiny
    res = _two(lambda pid: ["quantize", "--model", str(d), "--text", str(text), "--recipe", recipe, *CALIB,
                            "--out", str(tmp_path / "ck")])
    assert [rc for rc, _, _ in res] == [0, 0], _show(res)
    assert "4 devices, 2 processes" in res[0][2] + res[0][1], _show(res)  # the mesh really spans both
    assert "saved" in res[0][1] and "saved" not in res[1][1]
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # written once, no temporary directory left
    a, ma = load_quantized(one_process / recipe)
    b, mb = load_quantized(tmp_path / "ck")
    assert ma["recipe"] == mb["recipe"] == recipe
    la, lb = _leaves(a), _leaves(b)
    assert la.keys() == lb.keys() and la
    assert [k for k in la if la[k].dtype != lb[k].dtype or not np.array_equal(la[k], lb[k])] == []


def test_two_by_two_eval_equals_one_process(tiny, one_process, tmp_path):  # noqa: F811
    d, text = tiny
    ev = ["eval", "--model", str(d), "--text", str(text), "--eval-len", "32", "--eval-tokens", "192", "--batch-size", "1",
          "--checkpoint", str(one_process / "w4g128-gptq")]
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
                            *CALIB, "--seed", str(pid), "--out", str(tmp_path / "ck")])
    assert [rc for rc, _, _ in res] == [2, 2], _show(res)
    for _, _, err in res:
        lines = _errors(err)
        assert len(lines) == 1 and "different jobs (calibration windows)" in lines[0], err[-3000:]
    assert not any(tmp_path.iterdir())


def _wait_for(p: subprocess.Popen, stream: str, word: str, timeout: float = 300) -> str:
    """Read ``p``'s ``stream`` (unbuffered, \\r counts as a line end) until ``word``; what was read."""
    f = getattr(p, stream)
    seen = ""
    t0 = time.time()
    while time.time() - t0 < timeout:
        ch = f.read(1)
        if not ch:
            break
        seen += ch
        if seen.endswith(word):
            return seen
    raise AssertionError(f"never saw {word!r}: {seen[-2000:]}")


def test_dead_peer_ends_the_survivor_with_one_line(tiny, tmp_path):  # noqa: F811
    d, text = tiny
    procs = _start_two(lambda pid: ["quantize", "--model", str(d), "--text", str(text), "--recipe", "w4g128-gptq",
                                    "--calib-windows", "64", "--calib-len", "64", "--out", str(tmp_path / "ck"),
                                    "--dist-timeout", "5"])
    try:
        _wait_for(procs[0], "stderr", "gptq:")  # process 0's progress bar: calibration has started
        t0 = time.monotonic()
        os.killpg(procs[1].pid, signal.SIGKILL)  # ``timeout`` leads its own process group: all of process 1
        _, err0 = procs[0].communicate()
        took = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert procs[0].returncode == 1, err0[-3000:]
    lines = _errors(err0)
    assert len(lines) == 1 and "process 1 of 2" in lines[0], err0[-3000:]
    assert took < 60, took
    assert not (tmp_path / "ck").exists() and not any(tmp_path.iterdir())


def test_unreachable_coordinator_fails_clearly(tiny, tmp_path):  # noqa: F811
    d, text = tiny
    port = _free_port()  # nobody listens there
    t0 = time.monotonic()
    r = subprocess.run(_cli("quantize", "--model", str(d), "--text", str(text), "--recipe", "w4g128-rtn", "--out",
                            str(tmp_path / "ck"), "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                            "--process-id", "1", "--dist-timeout", "5"),
                       capture_output=True, text=True, env=_env(), cwd=ROOT)
    assert r.returncode == 1, r.stderr[-3000:]
    lines = _errors(r.stderr)
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "coordinator" in lines[0], r.stderr[-3000:]
    assert "Check failure" not in r.stderr
    assert time.monotonic() - t0 < 120
    assert not any(tmp_path.iterdir())


def test_job_killed_mid_save_keeps_the_previous_checkpoint(tiny, one_process, tmp_path):  # noqa: F811
    from eqjax.io.orbax import load_quantized

    d, text = tiny
    ck = tmp_path / "ck"
    shutil.copytree(one_process / "w4g128-awq", ck)
    before = (ck / "eqjax.json").read_bytes()
    procs = _start_two(lambda pid: ["quantize", "--model", str(d), "--text", str(text), "--recipe", "w4g128-rtn",
                                    "--out", str(ck), "--overwrite"],
                       entry=(str(HERE / "_slow_save_cli.py"),), EQJAX_SUPERVISED="1")
    try:
        _wait_for(procs[0], "stdout", "saving")  # both processes wrote their arrays; no manifest yet
    finally:
        for p in procs:  # the whole job dies (e.g. preempted)
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert (ck / "eqjax.json").read_bytes() == before
    _, m = load_quantized(ck)
    assert m["recipe"] == "w4g128-awq"
    partial = [p for p in tmp_path.iterdir() if p.name.startswith(".ck.tmp-")]
    assert len(partial) == 1 and (partial[0] / "arrays").is_dir()
    with pytest.raises(Exception, match="incomplete checkpoint"):
        load_quantized(partial[0])
