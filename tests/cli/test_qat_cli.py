"""``+qat`` recipes from the command line: the token budget, learning rate and resumable training state flags
on ``eqjax quantize`` and ``eqjax eval``, and the refusals that come before any work."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from eqjax.cli.main import main
from eqjax.core.numerics import dequantize_leaf
from eqjax.core.pytree import flatten_with_paths
from eqjax.io import load_model
from eqjax.io.orbax import load_quantized
from eqjax.recipes.apply import quantize
from eqjax.recipes.registry import get_recipe

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import random_checkpoint as rc  # noqa: E402

SMALL = ["--calib-windows", "4", "--calib-len", "32"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("rc") / "tiny"
    rc.write_checkpoint("tiny", out, shard_mb=2.0)
    return out


def _leaves(path):
    q, _ = load_quantized(path)
    return dict(zip(*flatten_with_paths(q)[:2]))


def test_quantize_with_qat_saves_state_and_a_rerun_resumes_to_the_same_checkpoint(ckpt, tmp_path, capsys):
    state, out = tmp_path / "state", tmp_path / "q"
    argv = ["quantize", "--model", str(ckpt), "--recipe", "w4g128-rtn+qat", "--qat-tokens", "512", "--qat-lr", "1e-3",
            "--qat-state", str(state), *SMALL, "--out", str(out)]
    assert main(argv) == 0
    assert json.loads((state / "run.json").read_text())["steps"] == 8  # 512 tokens / (2 x 32)
    first = _leaves(out)
    assert main([*argv, "--overwrite"]) == 0  # the saved state is complete: nothing is trained again
    again = _leaves(out)
    for p, v in first.items():
        np.testing.assert_array_equal(np.asarray(dequantize_leaf(again[p])), np.asarray(dequantize_leaf(v)), err_msg=p)
    model, params, _ = load_model(ckpt)  # the recipe without training, in this process
    base = dict(zip(*flatten_with_paths(quantize(params, get_recipe("w4g128-rtn"), model=model))[:2]))
    moved = [p for p in base if getattr(base[p], "bits", None)
             and not np.array_equal(np.asarray(dequantize_leaf(base[p])), np.asarray(dequantize_leaf(first[p])))]
    assert moved  # training changed the stored weights


def test_eval_reports_the_training(ckpt, tmp_path):
    js = tmp_path / "row.json"
    assert main(["eval", "--model", str(ckpt), "--recipe", "w4g128-rtn+qat", "--qat-tokens", "128", "--qat-lr", "1e-3",
                 "--qat-state", str(tmp_path / "s"), *SMALL, "--eval-tokens", "64", "--eval-len", "32",
                 "--json", str(js)]) == 0
    rep = json.loads(js.read_text())["step_reports"]["qat"]
    assert rep["steps"] == 2 and rep["tokens"] == 128 and np.isfinite(rep["loss_last"])


def test_block_qat_from_the_command_line_streamed_and_in_memory(ckpt, tmp_path):
    out = tmp_path / "s"
    assert main(["quantize", "--model", str(ckpt), "--recipe", "w4g128-rtn+bqat", "--qat-block-iters", "3", *SMALL,
                 "--format", "compressed-tensors", "--stream", "--out", str(out)]) == 0
    assert (out / "config.json").is_file()
    js = tmp_path / "row.json"
    assert main(["eval", "--model", str(ckpt), "--recipe", "w4g128-rtn+bqat", "--qat-block-iters", "3", *SMALL,
                 "--eval-tokens", "64", "--eval-len", "32", "--json", str(js)]) == 0
    rep = json.loads(js.read_text())["step_reports"]["bqat"]
    assert rep["iters"] == 3 and rep["blocks"] >= 2 and np.isfinite(rep["mse_ratio_median"]), rep


@pytest.mark.parametrize("argv, match", [
    (["--recipe", "w4g128-rtn", "--qat-tokens", "64"], "--qat-tokens trains a \\+qat recipe"),
    (["--recipe", "w4g128-rtn+qat", "--qat-lr", "0"], "bad --qat-lr"),
    (["--recipe", "w4g128-rtn+qat", "--qat-tokens", "0"], "bad --qat-tokens"),
    (["--recipe", "w8a8-smoothquant+qat"], "expected a weight-only recipe"),
    (["--recipe", "w4g128-rtn+emb-int8+qat"], "expected \\+bqat / \\+qat first"),
    (["--recipe", "w4g128-rtn+qat+bqat"], "expected \\+bqat / \\+qat first"),
    (["--recipe", "w4g128-rtn+qat", "--qat-block-iters", "4"], "--qat-block-iters trains a \\+bqat recipe"),
    (["--recipe", "w4g128-rtn+bqat", "--qat-block-iters", "-1"], "bad --qat-block-iters"),
    (["--recipe", "w4g128-rtn+qat", "--format", "compressed-tensors", "--stream"], "end to end and is not streamed"),
])
def test_refusals_before_any_work(ckpt, tmp_path, capsys, argv, match):
    out = tmp_path / "q"
    assert main(["quantize", "--model", str(ckpt), *argv, *SMALL, "--out", str(out)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not out.exists()


def test_eval_refuses_qat_flags_with_a_checkpoint(ckpt, tmp_path, capsys):
    q = tmp_path / "q"
    assert main(["quantize", "--model", str(ckpt), "--recipe", "w4g128-rtn", *SMALL, "--out", str(q)]) == 0
    assert main(["eval", "--model", str(ckpt), "--checkpoint", str(q), "--qat-state", str(tmp_path / "s"),
                 "--eval-tokens", "64", "--eval-len", "32"]) == 2
    assert "--qat-state trains a +qat recipe" in capsys.readouterr().err


def test_a_qat_state_directory_eqjax_did_not_write_is_refused_before_work(ckpt, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    out = tmp_path / "q"
    assert main(["quantize", "--model", str(ckpt), "--recipe", "w4g128-rtn+qat", "--qat-state", str(mine), *SMALL,
                 "--out", str(out)]) == 2
    assert "--qat-state" in capsys.readouterr().err and not out.exists()
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
