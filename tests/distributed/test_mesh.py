"""Calibration and evaluation on a data-parallel mesh (4 forced CPU devices) equal the 1-device mesh.

The checks run in a subprocess (``_mesh_checks.py``: XLA creates forced devices only if the flag
is set before JAX starts) under a hard kill timeout. The Calibrator merges statistics in global
batch order (``reduction="ordered"``), so quantized params and perplexity are bitwise identical;
X^T X is also checked against a float64 numpy oracle for both reductions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TIMEOUT_S = 420
RECIPES = ("w4g128-gptq", "w8a8-smoothquant")


@pytest.fixture(scope="module")
def checks() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    cmd = ["timeout", "-s", "KILL", str(TIMEOUT_S), sys.executable, str(HERE / "_mesh_checks.py"), ",".join(RECIPES)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, f"mesh checks failed (rc {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_four_devices_along_data(checks):
    assert checks["devices"] == 4 and checks["mesh"] == {"data": 4, "model": 1}


@pytest.mark.parametrize("recipe", RECIPES)
def test_quantized_params_bitwise_equal_one_device(checks, recipe):
    res = checks[recipe]
    assert res["leaves"] > 0
    assert res["differ"] == 0 and res["max_abs"] == 0.0, res


def test_perplexity_bitwise_equal_one_device(checks):
    assert checks["ppl_one"] == checks["ppl_four"]


@pytest.mark.parametrize("how", ["ordered", "collective"])
def test_xtx_matches_float64_oracle(checks, how):
    assert checks["xtx_paths"] > 0
    assert checks["xtx_rel_err"][how] < 1e-5
