"""``eqjax quantize --stream``: an HF checkpoint quantized block by block into a compressed-tensors directory
that holds the in-memory run's quantized weights, and the refusals that come before any work."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from eqjax.cli.main import main
from eqjax.core.numerics import dequantize_leaf
from eqjax.core.pytree import flatten_with_paths
from eqjax.io import load_model
from eqjax.recipes.apply import quantize
from eqjax.recipes.registry import get_recipe

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import random_checkpoint as rc  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("rc") / "tiny"
    rc.write_checkpoint("tiny", out, shard_mb=2.0)
    return out


def test_streamed_quantize_writes_the_in_memory_weights(ckpt, tmp_path, capsys):
    out = tmp_path / "ct"
    assert main(["quantize", "--model", str(ckpt), "--recipe", "w4g128-rtn", "--format", "compressed-tensors",
                 "--stream", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "one block at a time" in said and "peak RSS" in said and "saved" in said
    assert len(list(out.glob("model-*-of-*.safetensors"))) == 2 + 2  # outer, two blocks, untied head
    model, params, _ = load_model(ckpt)
    _, back, tok = load_model(out)
    assert tok is not None
    want = dict(zip(*flatten_with_paths(quantize(params, get_recipe("w4g128-rtn"), model=model))[:2]))
    got = dict(zip(*flatten_with_paths(back)[:2]))
    assert sorted(got) == sorted(want)
    for p, v in want.items():  # codes exact; scales stored as bfloat16 (--dtype): within its unit roundoff 2^-8
        np.testing.assert_allclose(np.asarray(dequantize_leaf(got[p]), np.float32),
                                   np.asarray(dequantize_leaf(v), np.float32), rtol=2.0**-8, atol=0, err_msg=p)


def test_streamed_gptq_format_writes_the_in_memory_files(ckpt, tmp_path, capsys):
    """``--stream --format gptq``: the shards hold the tensors of the in-memory ``--format gptq`` directory, bit
    for bit (round to nearest gives the same codes unit by unit), and the same quantization_config."""
    common = ["quantize", "--model", str(ckpt), "--recipe", "w4g128-rtn", "--format", "gptq"]
    assert main([*common, "--out", str(tmp_path / "mem")]) == 0
    assert main([*common, "--stream", "--out", str(tmp_path / "st")]) == 0
    assert "saved" in capsys.readouterr().out
    from safetensors.numpy import load_file

    want, got = load_file(tmp_path / "mem" / "model.safetensors"), _tensors(tmp_path / "st")
    assert sorted(got) == sorted(want) and any(k.endswith(".qweight") for k in got)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
    cfg = [json.loads((tmp_path / d / "config.json").read_text())["quantization_config"] for d in ("mem", "st")]
    assert cfg[0] == cfg[1] and cfg[0]["quant_method"] == "gptq"


@pytest.mark.parametrize("argv, match", [
    (["--format", "orbax"], "--stream writes --format compressed-tensors"),
    (["--format", "compressed-tensors", "--model", "GGUF"], "--stream reads an HF safetensors directory"),
    (["--format", "compressed-tensors", "--recipe", "kv8"], "not streamed|cannot be written"),
])
def test_stream_refusals_come_before_any_work(ckpt, tmp_path, capsys, argv, match):
    args = {"--model": str(ckpt), "--recipe": "w4g128-rtn"}
    it = iter(argv)
    for flag in it:
        args[flag] = next(it)
    if args["--model"] == "GGUF":
        args["--model"] = str(tmp_path / "m.gguf")
        (tmp_path / "m.gguf").write_bytes(b"GGUF")
    flat = [x for kv in args.items() for x in kv]
    assert main(["quantize", *flat, "--stream", "--out", str(tmp_path / "o")]) == 2
    assert re.search(match, capsys.readouterr().err)
    assert not (tmp_path / "o").exists()


def _tensors(directory: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out: dict[str, np.ndarray] = {}
    for f in sorted(directory.glob("model-*.safetensors")):
        out.update(load_file(f))
    return out


def test_a_killed_stream_run_resumes_to_the_uninterrupted_output(ckpt, tmp_path, capsys):
    """SIGKILL after the first decoder block is on record; ``--resume`` skips the finished units, restores the
    GPTQ calibration activations and ends with the uninterrupted run's tensors, bit for bit."""
    argv = ["quantize", "--model", str(ckpt), "--recipe", "w4g128-gptq", "--format", "compressed-tensors",
            "--stream", "--calib-windows", "4", "--calib-len", "32"]
    whole = tmp_path / "whole"
    assert main([*argv, "--out", str(whole)]) == 0
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "eqjax.cli", *argv, "--out", str(out)], stdout=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parents[2])
    for line in proc.stdout:
        if line.strip().startswith("layers_0:"):  # printed once the block is committed
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not out.exists()
    partial = tmp_path / ".out.partial"
    assert (partial / ".progress" / "ledger.json").is_file()
    capsys.readouterr()
    assert main([*argv, "--out", str(out), "--resume"]) == 0
    assert re.search(r"resuming after [2-9] of 4 units", capsys.readouterr().out)
    assert not partial.exists() and not (out / ".progress").exists()
    got, want = _tensors(out), _tensors(whole)
    assert sorted(got) == sorted(want)
    for name, a in want.items():
        assert np.array_equal(got[name], a), name
    assert (out / "config.json").read_text() == (whole / "config.json").read_text()


def test_resume_refuses_another_run_and_needs_stream(ckpt, tmp_path, capsys):
    argv = ["quantize", "--model", str(ckpt), "--format", "compressed-tensors", "--out", str(tmp_path / "o")]
    partial = tmp_path / ".o.partial"
    partial.mkdir()
    assert main([*argv, "--recipe", "w4g128-rtn", "--stream", "--resume"]) == 2  # not eqjax's: refused, kept
    assert "holds no eqjax progress record" in capsys.readouterr().err and partial.is_dir()
    partial.rmdir()
    (partial / ".progress").mkdir(parents=True)
    (partial / ".progress" / "ledger.json").write_text(json.dumps({"run": {"recipe": "other"}, "units": []}))
    assert main([*argv, "--recipe", "w4g128-rtn", "--stream", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--resume" in err and "differs in" in err and len(err.strip().splitlines()) == 1
    assert main([*argv, "--recipe", "w4g128-rtn", "--resume"]) == 2
    assert "--resume goes on with a killed --stream run" in capsys.readouterr().err
    assert main([*argv, "--recipe", "w4g128-rtn", "--stream"]) == 0  # without --resume: starts afresh
    assert not partial.exists() and (tmp_path / "o" / "config.json").is_file()
