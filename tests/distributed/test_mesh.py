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
MODEL_PARALLEL_TEST = "test_model_parallel_splits_weights_and_matches_one_device"


@pytest.fixture(scope="module")
def checks(request: pytest.FixtureRequest) -> dict:
    """One run of ``_mesh_checks.py`` for the module; with ``--model-parallel=4`` (also the ``data 1 x model
    4`` mesh) when this pytest run selects :func:`test_model_parallel_splits_weights_and_matches_one_device`."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    mp = any(it.path == request.path and it.name == MODEL_PARALLEL_TEST for it in request.session.items)
    cmd = ["timeout", "-s", "KILL", str(TIMEOUT_S), sys.executable, str(HERE / "_mesh_checks.py"), ",".join(RECIPES),
           *(["--model-parallel=4"] if mp else [])]
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


@pytest.mark.slow
def test_model_parallel_splits_weights_and_matches_one_device(checks):
    """``data 1 x model 4``: each device holds about a quarter of the quantized weights, same values."""
    res = checks
    assert res["model_mesh"] == {"data": 1, "model": 4}
    for rec in RECIPES:
        assert res[f"{rec}@model"]["differ"] == 0 and res[f"{rec}@model"]["max_abs"] == 0.0, res[f"{rec}@model"]
        b = res[f"{rec}@model:bytes"]
        assert b["per_device_max"] <= 0.3 * b["total"], b  # a quarter, plus small replicated leaves


@pytest.mark.slow
def test_model_parallel_example_on_eight_devices():
    """examples/model_parallel.py: 8 forced devices, ``model 8``; a device holds <= 1/4 of the
    weights (float at rest and quantized), and the quantized params equal one device's bit for bit."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    cmd = ["timeout", "-s", "KILL", str(TIMEOUT_S), sys.executable, str(ROOT / "examples" / "model_parallel.py")]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, f"example failed (rc {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["devices"] == 8 and res["mesh"] == {"data": 1, "model": 8}
    assert res["float_per_device_max"] <= res["float_total"] / 4, res
    for rec in ("w4g128-gptq", "w8a8-smoothquant"):
        assert res[rec]["leaves"] > 0 and res[rec]["differ"] == 0, res[rec]
        assert res[rec]["per_device_max"] <= res[rec]["total"] / 4, res[rec]
    assert "P(None, 'model')" in r.stdout  # the printed shardings
