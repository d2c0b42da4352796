"""Robustness cases: outputs. A user's directory is never replaced, an output never overlaps an input,
a failed write leaves the previous artifact set whole, two writers of one output are refused, a resumed
run over other model or text content is refused, a checkpoint without its file table is refused, and
Orbax's background threads never reach the terminal."""

from __future__ import annotations

import json
import os
import pathlib
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any, Callable

from robustness_fixtures import ROOT, Case, Fixtures, Result, write_hf_model
from robustness_run import run_cli_inprocess

RUN = ["run", "--text", "{text}", "--eval-len", "32", "--eval-tokens", "64"]
QUANT = ["quantize", "--recipe", "w8"]
REPORT = ("results.json", "results.md", "weight_histograms.png", "ppl_vs_size.png")


# ------------------------------------------------------------------------------------ setups and checks
def _project(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
    """A user's project directory: the model inside it and a file of theirs beside it."""
    proj = work / "proj"
    shutil.copytree(fx.root / "tiny", proj / "model")
    (proj / "notes.txt").write_text("mine")
    return {"proj": str(proj), "m": str(proj / "model"), "notes": str(proj / "notes.txt")}


def _user_dir(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
    v = _project(fx, work)
    (work / "link").symlink_to(v["proj"])
    return {**v, "link": str(work / "link")}


def _project_intact(fx: Fixtures, work: pathlib.Path, v: dict[str, str], res: Result) -> str | None:
    notes, model = pathlib.Path(v["notes"]), pathlib.Path(v["m"])
    if not notes.is_file() or notes.read_text() != "mine":
        return f"loss: the user's file {notes} was changed or removed"
    if not (model / "model.safetensors").is_file() or not (model / "config.json").is_file():
        return f"loss: the input model {model} was changed or removed"
    return None


def _gguf_copy(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
    """A user's copy of the tiny GGUF."""
    g = work / "model.gguf"
    g.write_bytes((fx.root / "tiny.gguf").read_bytes())
    return {"g": str(g)}


def _gguf_intact(fx: Fixtures, work: pathlib.Path, v: dict[str, str], res: Result) -> str | None:
    same = pathlib.Path(v["g"]).read_bytes() == (fx.root / "tiny.gguf").read_bytes()
    return None if same else f"loss: {v['g']} was changed"


def _empty_out(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
    (work / "empty").mkdir()
    return {"c": str(work / "empty")}


def _ck_ok(fx: Fixtures, work: pathlib.Path, v: dict[str, str], res: Result) -> str | None:
    from eqjax.io import load_model
    from eqjax.io.orbax import load_quantized

    model, _, _ = load_model(fx.root / "tiny")
    try:
        _, m = load_quantized(v["c"], model=model)
    except Exception as e:  # noqa: BLE001
        return f"the checkpoint does not load: {e}"
    return None if m.get("recipe") == "w8" else f"manifest recipe {m.get('recipe')!r}"


def _run_dir(fx: Fixtures, work: pathlib.Path, recipes: str = "fp", model: str | None = None,
             text: str | None = None) -> pathlib.Path:
    out = work / "run"
    res = run_cli_inprocess(["run", "--model", model or str(fx.root / "tiny"), "--text", text or str(fx.root / "text.txt"),
                             "--eval-len", "32", "--eval-tokens", "64", "--recipes", recipes, "--out", str(out)])
    assert res.rc == 0, res.err[-500:]
    return out


def _interrupted_run(edit: Callable[[pathlib.Path, pathlib.Path], None]) -> Callable[[Fixtures, pathlib.Path], dict[str, str]]:
    """A run over a copy of the model and text (its log kept, its report removed), then ``edit(model, text)``."""
    def setup(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
        model, text = work / "m", work / "t.txt"
        shutil.copytree(fx.root / "tiny", model)
        shutil.copy(fx.root / "text.txt", text)
        out = _run_dir(fx, work, model=str(model), text=str(text))
        for name in REPORT:
            (out / name).unlink(missing_ok=True)
        edit(model, text)
        return {"o": str(out), "m": str(model), "t": str(text)}
    return setup


def _replace_weights(model: pathlib.Path, text: pathlib.Path) -> None:
    write_hf_model(model, seed=1)  # same path, same shapes, other weights


def _edit_text(model: pathlib.Path, text: pathlib.Path) -> None:
    text.write_text(text.read_text().replace("fox", "cat"))


def _run_with_json_in_out(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
    out = _run_dir(fx, work)
    return {"o": str(out), "j": str(out / "results.json"), "old": (out / "results.json").read_text()}


def _results_unchanged(fx: Fixtures, work: pathlib.Path, v: dict[str, str], res: Result) -> str | None:
    p = pathlib.Path(v["j"])
    return None if p.is_file() and p.read_text() == v["old"] else f"loss: {p} was changed"


def _ck_strip(*, table: bool) -> Callable[[pathlib.Path], None]:
    """Flip a byte of the largest data file and drop its checksum (``table``: the whole file table)."""
    def edit(d: pathlib.Path) -> None:
        data = max((p for p in (d / "arrays").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        b = bytearray(data.read_bytes())
        b[len(b) // 2] ^= 0xFF
        data.write_bytes(bytes(b))
        m = json.loads((d / "eqjax.json").read_text())
        if table:
            del m["files"]
        else:
            del m["files"][data.relative_to(d / "arrays").as_posix()]
        (d / "eqjax.json").write_text(json.dumps(m))
    return edit


def _ck_copy(name: str, edit: Callable[[pathlib.Path], None]) -> Callable[[Fixtures, pathlib.Path], dict[str, str]]:
    def setup(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
        shutil.copytree(fx.root / "ck", work / name)
        edit(work / name)
        return {"c": str(work / name)}
    return setup


# ------------------------------------------------------------------------------------ API
def api_save_nnx_result(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    """What quantize_model returns for an NNX module, handed to save_quantized as the params."""
    import jax.numpy as jnp
    from flax import nnx

    from eqjax.api import quantize_model
    from eqjax.io.orbax import save_quantized

    q = quantize_model(nnx.Linear(64, 64, rngs=nnx.Rngs(0)), "w8", example=(jnp.ones((2, 64)),))
    return save_quantized(work / "ck", q)


def api_save_linen_pair(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    """The ``(QuantizedLinen, qparams)`` pair quantize_model returns, handed over whole."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from eqjax.api import quantize_model
    from eqjax.io.orbax import save_quantized

    x = jnp.ones((2, 64))
    params = nn.Dense(64).init(jax.random.PRNGKey(0), x)["params"]
    return save_quantized(work / "ck", quantize_model(nn.Dense(64), "w8", params=params, example=(x,)))


def api_save_string_leaf(fx: Fixtures, work: pathlib.Path, v: dict) -> Any:
    from eqjax.io.orbax import save_quantized

    return save_quantized(work / "ck", {"layer": {"kernel": "not an array"}})


# ------------------------------------------------------------------------------------ processes
def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "JAX_PLATFORMS": "cpu"}


def _one_error_line(err: str, rc: int | None, want_rc: int, cause: str) -> str | None:
    """A failure description unless the process ended with ``want_rc`` and exactly one ``eqjax: error:`` line."""
    lines = [x for x in err.splitlines() if x.startswith("eqjax: error:")]
    if "Traceback" in err or "Exception in thread" in err or "ERROR:absl" in err:
        return f"a traceback reached the user: {err.strip()[-400:]}"
    if rc != want_rc or len(lines) != 1 or cause not in lines[0]:
        return f"exit {rc} (expected {want_rc}), error lines {lines} (expected one naming {cause!r}): {err.strip()[-300:]}"
    return None


def _file_size_limit(limit: int) -> Callable[[], None]:
    def pre() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return pre


def _no_temporaries(d: pathlib.Path) -> str | None:
    left = [p.name for p in d.iterdir() if ".tmp-" in p.name]
    return f"temporaries left in {d}: {left}" if left else None


def kill_run_disk_full(fx: Fixtures, work: pathlib.Path, v: dict) -> str | None:
    """``run --overwrite`` whose report hits a file-size limit: the previous report set stays whole."""
    out = _run_dir(fx, work, recipes="fp")
    before = {n: (out / n).read_bytes() for n in REPORT}
    limit = max(len(before["results.json"]), len(before["results.md"])) * 3  # the new JSON fits, a plot does not
    if limit >= min(len(before[n]) for n in REPORT if n.endswith(".png")):
        return "the case's file-size limit does not separate the JSON from the plots"
    r = subprocess.run([sys.executable, "-m", "eqjax.cli", "run", "--model", str(fx.root / "tiny"), "--text",
                        str(fx.root / "text.txt"), "--eval-len", "32", "--eval-tokens", "64", "--recipes", "fp,w8", "--out",
                        str(out), "--overwrite"], capture_output=True, text=True, cwd=str(ROOT), env=_env(),
                       preexec_fn=_file_size_limit(limit), timeout=600)
    failure = _one_error_line(r.stderr, r.returncode, 1, "File too large")
    if failure:
        return failure
    after = {n: (out / n).read_bytes() if (out / n).exists() else None for n in REPORT}
    if after != before:
        return f"loss: the previous report set was changed by a failed run: {[n for n in REPORT if after[n] != before[n]]}"
    return _no_temporaries(out)


_QUANTIZE_CHILD = """
    import sys, time
    import orbax.checkpoint as ocp
    real = ocp.StandardCheckpointer.save
    def save(self, *a, **k):
        out = real(self, *a, **k)  # Orbax's threads now write in the background
        print("saving", flush=True)
        time.sleep(float(sys.argv[2]))
        return out
    ocp.StandardCheckpointer.save = save
    from eqjax.cli.main import main
    sys.exit(main(["quantize", "--model", sys.argv[3], "--recipe", "w4g128-rtn", "--out", sys.argv[1], "--overwrite"]))
"""


def _previous_ck_intact(fx: Fixtures, ck: pathlib.Path) -> str | None:
    failure = _ck_ok(fx, ck.parent, {"c": str(ck)}, Result(0))
    return f"loss: the previous checkpoint: {failure}" if failure else _no_temporaries(ck.parent)


def kill_checkpoint_sigterm(fx: Fixtures, work: pathlib.Path, v: dict) -> str | None:
    """SIGTERM while Orbax's threads write a checkpoint over an existing one: one line, exit 130, old one kept."""
    ck = work / "ck"
    shutil.copytree(fx.root / "ck", ck)
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_QUANTIZE_CHILD), str(ck), "3", str(fx.root / "tiny")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT), env=_env())
    t0 = time.time()
    while "saving" not in (p.stdout.readline() or "saving"):
        if time.time() - t0 > 300:
            break
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=300)
    return _one_error_line(err, p.returncode, 130, "interrupted") or _previous_ck_intact(fx, ck)


def kill_checkpoint_disk_full(fx: Fixtures, work: pathlib.Path, v: dict) -> str | None:
    """``quantize --overwrite`` under a file-size limit: one line naming it, exit 1, the old checkpoint kept."""
    ck = work / "ck"
    shutil.copytree(fx.root / "ck", ck)
    r = subprocess.run([sys.executable, "-m", "eqjax.cli", "quantize", "--model", str(fx.root / "tiny"), "--recipe",
                        "w4g128-rtn", "--out", str(ck), "--overwrite"], capture_output=True, text=True, cwd=str(ROOT),
                       env=_env(), preexec_fn=_file_size_limit(8192), timeout=600)
    return _one_error_line(r.stderr, r.returncode, 1, "File too large") or _previous_ck_intact(fx, ck)


def kill_concurrent_runs(fx: Fixtures, work: pathlib.Path, v: dict) -> str | None:
    """A second ``run`` on an --out another run is writing is refused at once; once the first is killed
    (its lock dies with it) the output is free again."""
    from eqjax.io.atomic import output_lock

    out = work / "run"
    names = "fp,w8,w4g128-rtn,w8a8-naive,w8-absmax,w8-zeropoint,w4g128-rtn-sym,w8a8-zeroquant"
    argv = ["run", "--model", str(fx.root / "tiny"), "--text", str(fx.root / "text.txt"), "--eval-len", "32",
            "--eval-tokens", "64", "--recipes", names, "--out", str(out)]
    p = subprocess.Popen([sys.executable, "-m", "eqjax.cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=str(ROOT), env=_env())
    try:
        t0 = time.time()
        while not (out / "rows.jsonl").is_file():
            if p.poll() is not None or time.time() - t0 > 300:
                return f"the first run did not start: {p.stderr.read()[-300:] if p.stderr else ''}"
            time.sleep(0.05)
        t1 = time.time()
        second = run_cli_inprocess([*argv, "--resume"])
        if p.poll() is not None:
            return "the first run ended before the second started"
        failure = _one_error_line(second.err, second.rc, 2, "in use by another eqjax process")
        if failure:
            return failure
        if time.time() - t1 > 30:
            return f"the second run was refused only after {time.time() - t1:.0f} s"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
    with output_lock(out):
        pass  # a dead holder's lock does not block
    return None


# ------------------------------------------------------------------------------------ cases
def outputs_cases() -> list[Case]:
    """The outputs cases of the catalogue."""
    T = "outputs"
    return [
        Case("outputs: quantize --out the model's parent directory, --overwrite", T,
             argv=[*QUANT, "--model", "{m}", "--out", "{proj}", "--overwrite"], cause=r"holds the input",
             setup=_project, check=_project_intact),
        Case("outputs: quantize --out the --model directory, --overwrite", T,
             argv=[*QUANT, "--model", "{m}", "--out", "{m}", "--overwrite"], cause=r"is the input",
             setup=_project, check=_project_intact),
        Case("outputs: quantize --overwrite a user's directory", T,
             argv=[*QUANT, "--model", "{tiny}", "--out", "{proj}", "--overwrite"],
             cause=r"cannot replace.*eqjax wrote.*'model', 'notes\.txt'", setup=_project, check=_project_intact),
        Case("outputs: quantize --out a symlink to a user's directory, --overwrite", T,
             argv=[*QUANT, "--model", "{tiny}", "--out", "{link}", "--overwrite"], cause=r"symbolic link",
             setup=_user_dir, check=_project_intact),
        Case("outputs: quantize into an empty directory", T, expect="ok",
             argv=[*QUANT, "--model", "{tiny}", "--out", "{c}"], setup=_empty_out, check=_ck_ok),
        Case("outputs: export-onnx --overwrite a user's directory", T,
             argv=["export-onnx", "--model", "{gguf}", "--recipe", "w8", "--out", "{proj}", "--overwrite"],
             cause=r"cannot replace.*eqjax wrote", setup=_project, check=_project_intact),
        Case("outputs: export-gguf --out is the --model file, --overwrite", T,
             argv=["export-gguf", "--model", "{g}", "--recipe", "w8", "--out", "{g}", "--overwrite"],
             cause=r"GGUF file \(--out\).*is the input", setup=_gguf_copy, check=_gguf_intact),
        Case("outputs: run --out inside the --model directory", T,
             argv=[*RUN, "--model", "{m}", "--recipes", "fp", "--out", "{m}/runs"], cause=r"lies inside the input",
             setup=_project, check=_project_intact),
        Case("outputs: run --json is the report's own results.json", T,
             argv=[*RUN, "--model", "{tiny}", "--recipes", "fp", "--out", "{o}", "--json", "{j}", "--overwrite"],
             cause=r"one of the run's own files.*results\.json", setup=_run_with_json_in_out, check=_results_unchanged),
        Case("outputs: run --json into the --model directory", T,
             argv=[*RUN, "--model", "{m}", "--recipes", "fp", "--out", "{proj}/o", "--json", "{m}/rows.json"],
             cause=r"--json file lies inside the input", setup=_project, check=_project_intact),
        Case("outputs: run --json is the --text file, --overwrite", T,
             argv=["run", "--model", "{tiny}", "--text", "{notes}", "--eval-len", "32", "--eval-tokens", "64", "--recipes",
                   "fp", "--out", "{proj}/o", "--json", "{notes}", "--overwrite"],
             cause=r"--json file is the input", setup=_project, check=_project_intact),
        Case("outputs: run --resume after the model's weights were replaced", T,
             argv=[*RUN, "--model", "{m}", "--text", "{t}", "--recipes", "fp,w8", "--out", "{o}", "--resume"],
             cause=r"model's content changed.*model_sha256", setup=_interrupted_run(_replace_weights)),
        Case("outputs: run --resume after the text was edited", T,
             argv=[*RUN, "--model", "{m}", "--text", "{t}", "--recipes", "fp,w8", "--out", "{o}", "--resume"],
             cause=r"text's content changed.*text_sha256", setup=_interrupted_run(_edit_text)),
        Case("outputs: checkpoint with a flipped byte and no file table", T,
             argv=["eval", "--model", "{tiny}", "--text", "{text}", "--eval-len", "32", "--eval-tokens", "64",
                   "--checkpoint", "{c}"], cause=r"without a file table.*eqjax\.json: files",
             setup=_ck_copy("c", _ck_strip(table=True))),
        Case("outputs: checkpoint with a flipped byte in a file dropped from its table", T,
             argv=["eval", "--model", "{tiny}", "--text", "{text}", "--eval-len", "32", "--eval-tokens", "64",
                   "--checkpoint", "{c}"], cause=r"not in its manifest", setup=_ck_copy("c", _ck_strip(table=False))),
        Case("outputs: api save_quantized(dir, <QuantizedNNX>)", T, api=api_save_nnx_result,
             cause=r"save_quantized: params.*QuantizedNNX.*\.params"),
        Case("outputs: api save_quantized(dir, (QuantizedLinen, qparams))", T, api=api_save_linen_pair,
             cause=r"save_quantized: params.*tuple.*qparams"),
        Case("outputs: api save_quantized with a string leaf", T, api=api_save_string_leaf,
             cause=r"params layer/kernel.*array.*str"),
        Case("outputs: run --overwrite stopped by a file-size limit", T, expect="ok", kill=kill_run_disk_full, slow=True),
        Case("outputs: SIGTERM while Orbax writes a checkpoint", T, expect="ok", kill=kill_checkpoint_sigterm, slow=True),
        Case("outputs: quantize --overwrite under a file-size limit", T, expect="ok", kill=kill_checkpoint_disk_full,
             slow=True),
        Case("outputs: two runs on one --out", T, expect="ok", kill=kill_concurrent_runs, slow=True),
    ]
