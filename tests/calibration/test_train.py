"""The resumable training loop: the batch order is a function of the step, a run killed (SIGKILL) after a save
and resumed ends with the uninterrupted run's state bit for bit, directories it did not write are refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from eqjax.calibration.train import batch_order, fit
from eqjax.core.errors import InputError
from tests.calibration._qat_tiny import digest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = "import sys; from tests.calibration._qat_tiny import main; main(sys.argv[1], int(sys.argv[2]))"


def _run(tmp_path: Path, ckpt: str, kill_at: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", SCRIPT, ckpt, str(kill_at)], capture_output=True, text=True,
                          env=env, timeout=600, cwd=tmp_path)


def _digest(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr[-2000:]
    return next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("DIGEST"))


@pytest.mark.slow
def test_a_run_killed_after_a_save_resumes_to_the_uninterrupted_result(tmp_path):
    whole = digest(None, 0)  # uninterrupted, in this process (the same compiled step as the subprocesses')
    ck = tmp_path / "state"
    killed = _run(tmp_path, str(ck), 7)  # saves at steps 4, 8, 12: killed after 4, mid-way to 8
    assert killed.returncode == -signal.SIGKILL
    assert json.loads((ck / "run.json").read_text())["steps"] == 12
    assert _digest(_run(tmp_path, str(ck), 0)) == whole


def test_batch_order_is_a_permutation_per_pass_and_depends_only_on_the_step():
    n = 5
    for p in range(3):
        assert sorted(batch_order(p * n + i, n, seed=7) for i in range(n)) == list(range(n))
    assert [batch_order(t, n, 7) for t in range(15)] == [batch_order(t, n, 7) for t in range(15)]
    assert [batch_order(t, n, 7) for t in range(15)] != [batch_order(t, n, 8) for t in range(15)]


def _step(state, batch):
    w = state["w"] - 0.1 * batch[0]
    return {"w": w}, (w**2).sum()


def test_fit_resumes_from_its_own_directory_and_refuses_others(tmp_path):
    batches = [(np.full((3,), float(i), np.float32),) for i in range(4)]
    state = {"w": np.ones((3,), np.float32)}
    whole = fit(_step, state, batches, steps=9).state
    d = tmp_path / "run"
    with pytest.raises(_Stop):  # an exception in the loop (Ctrl-C, a full disk) after the save at step 3
        fit(_step, state, batches, steps=9, checkpoint=d, save_every=3, on_step=_stop_at(5))
    rest = fit(_step, state, batches, steps=9, checkpoint=d, save_every=3)
    assert rest.first_step == 3 and len(rest.losses) == 6
    np.testing.assert_array_equal(np.asarray(rest.state["w"]), np.asarray(whole["w"]))
    with pytest.raises(InputError, match="another run .*steps"):
        fit(_step, state, batches, steps=10, checkpoint=d)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("x")
    with pytest.raises(InputError, match=r"mine\): expected an empty directory"):
        fit(_step, state, batches, steps=2, checkpoint=foreign)
    assert (foreign / "notes.txt").read_text() == "x"


class _Stop(Exception):
    pass


def _stop_at(k):
    def cb(t, loss):
        if t == k:
            raise _Stop

    return cb

