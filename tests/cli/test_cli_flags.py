"""Every flag of the ``eqjax`` command is exercised by a test, and the flags no other test used have their
observable effect checked here (on tiny models: an HF directory and a GGUF from the robustness fixtures).

The guard walks :func:`eqjax.cli.main.build_parser` (the top-level parser and every subcommand's actions), so
a flag added without a test fails it: each (command, flag) must occur in a test file that also names the
command as a quoted argv word at most ``NEAR`` characters before it. This file names no flag in the
guard itself, only in its real tests.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import re

import jax
import pytest

from eqjax.cli.main import build_parser, main
from tests.robustness.robustness_fixtures import TEXT, write_gguf, write_hf_model

TESTS = pathlib.Path(__file__).resolve().parents[1]


def cli_flags() -> list[tuple[str, str]]:
    """(command, option string) of every option of the parser; command '' = the top-level parser."""
    p = build_parser()
    pairs = [("", o) for a in p._actions for o in a.option_strings]
    (sub,) = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    for name, sp in sub.choices.items():
        pairs += [(name, o) for a in sp._actions for o in a.option_strings]
    return [(c, o) for c, o in pairs if o not in ("-h", "--help")]


NEAR = 1000
"""How far (characters) after a quoted command word its flag must appear: within one argv list or one
helper call of it."""


def unexercised(flags: list[tuple[str, str]]) -> list[str]:
    """The (command, flag) pairs no test file under tests/ exercises (see the module docs)."""
    sources = [f.read_text(encoding="utf-8") for f in TESTS.rglob("*.py")]
    missing = []
    for cmd, flag in flags:
        fr = re.compile(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])")
        if not cmd:
            ok = any(fr.search(s) for s in sources)
        else:
            cr = re.compile(r"[\"']" + re.escape(cmd) + r"[\s\"']")
            ok = any(fr.search(s, m.start(), m.start() + NEAR) for s in sources for m in cr.finditer(s))
        if not ok:
            missing.append(f"{cmd or '(top level)'} {flag}")
    return missing


def test_every_flag_is_exercised_by_a_test():
    flags = cli_flags()
    commands = {c for c, _ in flags if c}
    assert {"run", "eval", "quantize", "search", "export-onnx", "export-gguf"} <= commands
    assert len(flags) > 60
    missing = unexercised(flags)
    assert not missing, "flags no test exercises: " + ", ".join(missing)
    new_flag = "--" + "-".join(["never"] * 3)  # built here so that no test source holds it
    assert unexercised([("run", new_flag), ("", new_flag)]) == [f"run {new_flag}", f"(top level) {new_flag}"]


# ------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    d = tmp_path_factory.mktemp("flags")
    write_hf_model(d / "tiny")
    (d / "text.txt").write_text(TEXT, encoding="utf-8")
    write_gguf(d / "tiny.gguf")
    return {"tiny": str(d / "tiny"), "text": str(d / "text.txt"), "gguf": str(d / "tiny.gguf")}


def _common(fx):
    return ["--model", fx["tiny"], "--text", fx["text"], "--eval-len", "32", "--eval-tokens", "64"]


@pytest.fixture
def pallas_calls(monkeypatch):
    """Records each dispatch to a Pallas kernel: (interpret, whether a kernel ran)."""
    lin = importlib.import_module("eqjax.core.linear")
    calls: list[tuple[bool, bool]] = []
    orig = lin._dispatch_pallas

    def rec(*a, **k):
        y = orig(*a, **k)
        calls.append((bool(k.get("interpret")), y is not None))
        return y

    monkeypatch.setattr(lin, "_dispatch_pallas", rec)
    return calls


# ------------------------------------------------------------------------------------ top level
@pytest.mark.parametrize("argv, level", [(["-v"], "INFO"), (["--verbose"], "INFO"), ([], "WARNING")])
def test_verbose_sets_the_log_level(argv, level, fx, monkeypatch, capsys):
    import logging

    seen = []
    monkeypatch.setattr(logging, "basicConfig", lambda **k: seen.append(logging.getLevelName(k["level"])))
    assert main([*argv, "eval", *_common(fx), "--recipe", "nope"]) == 2
    assert seen == [level] and "unknown recipe 'nope'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ run / eval
def test_backend_routes_quantized_matmuls_in_eval_and_run(fx, tmp_path, pallas_calls):
    """--backend pallas_interpret (eval, run): every quantized matmul of W4 g128 (7 linears x 2 blocks) is
    dispatched to the Pallas kernels (interpret mode; a kernel runs where one covers the layout, XLA
    elsewhere), and the perplexity is that of --backend xla, which dispatches nothing.

    Tolerance: tests/core/test_linear.py holds both W4A16 paths within ``(K + 4) * 2**-24`` (K <= 128: < 8e-6)
    of the float64 product, relative to ``|x| @ |w|``; over 14 matmuls the two paths differ by < 14 x 2 x
    8e-6 = 2.3e-4 of that size, carried to the final hidden state at about the same relative size
    (RMSNorm rescales; the tied head stays float). This random model's ``|h| @ |E|`` is about 3, so each
    NLL moves by < 2 x 2.3e-4 x 3 = 1.4e-3: rel 2e-3. Weight-only, so no activation code can flip (the
    W8A8 rounding band of the README does not apply).

    Dispatches are recorded while a program is traced; a program already compiled for the same model and
    backend (``eqjax.evaluate.perplexity`` keeps its jitted function) would run without tracing, so the
    caches are cleared before each command whose dispatches are counted."""
    ref = tmp_path / "xla.json"
    assert main(["eval", *_common(fx), "--recipe", "w4g128-rtn", "--backend", "xla", "--json", str(ref)]) == 0
    assert pallas_calls == []
    xla = json.loads(ref.read_text())["ppl"]
    out = tmp_path / "pallas.json"
    jax.clear_caches()
    assert main(["eval", *_common(fx), "--recipe", "w4g128-rtn", "--backend", "pallas_interpret", "--json", str(out)]) == 0
    assert len(pallas_calls) >= 14 and all(interp for interp, _ in pallas_calls) and any(ran for _, ran in pallas_calls)
    assert json.loads(out.read_text())["ppl"] == pytest.approx(xla, rel=2e-3)
    pallas_calls.clear()
    jax.clear_caches()
    assert main(["run", *_common(fx), "--recipes", "w4g128-rtn", "--backend", "pallas_interpret",
                 "--out", str(tmp_path / "o")]) == 0
    assert len(pallas_calls) >= 14 and all(interp for interp, _ in pallas_calls) and any(ran for _, ran in pallas_calls)
    row = json.loads((tmp_path / "o" / "results.json").read_text())["results"][0]
    assert row["ppl"] == pytest.approx(xla, rel=2e-3)


def test_run_calibration_flags_pick_the_windows(fx, tmp_path, monkeypatch):
    """``run --calib-windows N --calib-len C --seed S``: calibration draws N windows of C tokens with seed S
    (recorded at the call), and the protocol in results.json says so."""
    import eqjax.protocol as experiment

    seen = []
    orig = experiment.calibration_windows
    monkeypatch.setattr(experiment, "calibration_windows",
                        lambda ids, n, ctx, seed=0: seen.append((n, ctx, seed)) or orig(ids, n, ctx, seed))
    out = tmp_path / "o"
    assert main(["run", *_common(fx), "--recipes", "w8a8-smoothquant", "--calib-windows", "2", "--calib-len", "16",
                 "--seed", "3", "--out", str(out)]) == 0
    assert seen == [(2, 16, 3)]
    pr = json.loads((out / "results.json").read_text())["protocol"]
    assert (pr["calib_windows"], pr["calib_ctx"], pr["seed"]) == (2, 16, 3)


@pytest.mark.parametrize("cmd", ["run", "eval", "quantize"])
def test_model_parallel_must_divide_the_devices(cmd, fx, tmp_path, capsys):
    """--model-parallel M: the mesh's model axis; M must divide the device count (here device_count + 1
    cannot) and be >= 1; refused with exit 2 naming the flag, before any output is written."""
    out = tmp_path / "o"
    args = {"run": ["run", *_common(fx), "--recipes", "fp", "--out", str(out)],
            "eval": ["eval", *_common(fx), "--recipe", "fp", "--json", str(tmp_path / "r.json")],
            "quantize": ["quantize", "--model", fx["tiny"], "--recipe", "w8", "--out", str(out)]}[cmd]
    for m, why in ((jax.device_count() + 1, "divisor"), (0, ">= 1")):
        assert main([*args, "--model-parallel", str(m)]) == 2
        err = capsys.readouterr().err
        assert "--model-parallel" in err and why in err, err
    assert not (tmp_path / "r.json").exists() and not (out / "results.json").exists()


def test_run_dist_timeout_is_checked(fx, tmp_path, capsys):
    assert main(["run", *_common(fx), "--recipes", "fp", "--out", str(tmp_path / "o"), "--dist-timeout", "0"]) == 2
    assert "bad distributed timeout (--dist-timeout)" in capsys.readouterr().err


@pytest.mark.parametrize("old, new", [
    (["run", "--ctx", "32", "--calib-ctx", "16"], ["run", "--eval-len", "32", "--calib-len", "16"]),
    (["eval", "--recipe", "fp", "--ctx", "32", "--calib-ctx", "16"], ["eval", "--recipe", "fp", "--eval-len", "32", "--calib-len", "16"]),
    (["quantize", "--recipe", "w8", "--out", "o", "--calib-ctx", "16"], ["quantize", "--recipe", "w8", "--out", "o", "--calib-len", "16"]),
])
def test_old_flag_spellings_are_hidden_aliases(old, new, capsys):
    """``--ctx`` / ``--calib-ctx`` (the old spellings) set what ``--eval-len`` / ``--calib-len`` set, and the
    help names only the canonical flags."""
    p = build_parser()
    got = p.parse_args(old)
    assert got == p.parse_args(new) and not {"ctx", "calib_ctx"} & set(vars(got))
    with pytest.raises(SystemExit):
        p.parse_args([old[0], "--help"])
    text = capsys.readouterr().out
    assert "--calib-len" in text and "--ctx" not in text and "--calib-ctx" not in text


@pytest.mark.parametrize("argv", [["run"], ["eval", "--recipe", "fp"], ["quantize", "--recipe", "w8", "--out", "o"],
                                  ["search", "--budget-bits", "4"], ["export-onnx", "--out", "o"],
                                  ["export-gguf", "--recipe", "w8", "--out", "o.gguf"]])
def test_calibration_defaults_are_the_same_in_every_command(argv):
    args = build_parser().parse_args(argv)
    assert (args.calib_windows, args.calib_len) == (16, 512)
    assert getattr(args, "eval_len", 1024) in (1024, 512)


# ------------------------------------------------------------------------------------ export-onnx
def _onnx_levels(pkg: pathlib.Path) -> set[int]:
    import onnx

    m = onnx.load(str(pkg / "model.onnx"), load_external_data=False)
    return {a.i for n in m.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "accuracy_level"}


def test_export_onnx_target_context_length_and_no_check(fx, tmp_path):
    """--target cpu-int8: MatMulNBits accuracy_level 4 in every node and the manifest; --context-length 32:
    the package's context length (genai_config.json, manifest); --no-check: no onnxruntime check recorded."""
    pkg = tmp_path / "p"
    assert main(["export-onnx", "--model", fx["gguf"], "--recipe", "w4g128-rtn", "--out", str(pkg),
                 "--target", "cpu-int8", "--context-length", "32", "--no-check"]) == 0
    man = json.loads((pkg / "eqjax_export.json").read_text())
    assert man["target"] == "cpu-int8" and man["accuracy_level"] == 4 and _onnx_levels(pkg) == {4}
    assert man["context_length"] == 32
    assert json.loads((pkg / "genai_config.json").read_text())["model"]["context_length"] == 32
    assert "check" not in man


def test_export_onnx_accuracy_level_and_calibration_flags(fx, tmp_path, monkeypatch):
    """--accuracy-level 0 overrides --target cpu-int8's level 4; the check runs by default (recorded);
    --calib-windows 2 --calib-len 16: a calibrated recipe's windows (recorded at the call)."""
    import eqjax.cli.export as onnx_export

    seen = []
    orig = onnx_export.calibration_windows
    monkeypatch.setattr(onnx_export, "calibration_windows",
                        lambda ids, n, ctx, seed=0: seen.append((n, ctx)) or orig(ids, n, ctx, seed))
    pkg = tmp_path / "p"
    assert main(["export-onnx", "--model", fx["gguf"], "--recipe", "w4g128-gptq", "--out", str(pkg),
                 "--target", "cpu-int8", "--accuracy-level", "0", "--calib-windows", "2", "--calib-len", "16"]) == 0
    man = json.loads((pkg / "eqjax_export.json").read_text())
    assert man["accuracy_level"] == 0 and _onnx_levels(pkg) == {0}
    assert man["check"]["top1_agreement"] > 0 and man["check"]["max_rel_diff"] <= man["check"]["tolerance"]
    assert seen == [(2, 16)]


@pytest.mark.parametrize("argv", [["--calib-len", "1"], ["--context-length", "1"]])
def test_export_onnx_refuses_bad_values(argv, fx, tmp_path, capsys):
    rc = main(["export-onnx", "--model", fx["gguf"], "--recipe", "w8", "--out", str(tmp_path / "p"), *argv])
    assert rc == 2 and argv[0] in capsys.readouterr().err and not (tmp_path / "p").exists()


def test_export_onnx_accuracy_level_is_a_matmulnbits_level(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["export-onnx", "--recipe", "w8", "--out", str(tmp_path / "p"), "--accuracy-level", "5"])
    assert e.value.code == 2 and "--accuracy-level: invalid choice" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ errors and flags every command has
@pytest.mark.parametrize("argv", [
    ["run", "--eval-len", "0", "--out", "{o}"],
    ["quantize", "--recipe", "nope", "--out", "{o}"],
    ["search", "--budget-bits", "4", "--model", "{text}", "--out", "{o}"],
    ["export-onnx", "--recipe", "w8", "--out", "{o}.onnx"],
    ["export-gguf", "--recipe", "nope", "--out", "{o}.gguf"],
])
def test_debug_after_each_subcommand_prints_the_traceback(argv, fx, tmp_path, capsys):
    """``<command> ... --debug``: the input error (exit 2) comes with its traceback; without it, one line."""
    argv = [a.format(o=tmp_path / "o", text=fx["text"]) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("eqjax: error:")
    assert main([*argv, "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("eqjax: error:")


def test_search_overwrite_replaces_existing_results(tmp_path, capsys):
    """``search`` into a directory holding results: refused without --overwrite (exit 2, the file named);
    with --overwrite the command goes past that check to loading the model (here a broken GGUF: its own
    error), and the old results are untouched until a new search completes."""
    out = tmp_path / "o"
    out.mkdir()
    (out / "rules.json").write_text("{}")
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file")
    base = ["search", "--model", str(bad), "--budget-bits", "4", "--out", str(out)]
    assert main(base) == 2
    err = capsys.readouterr().err
    assert "rules.json" in err and "--overwrite" in err
    assert main([*base, "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "broken.gguf" in err and "rules.json" not in err
    assert (out / "rules.json").read_text() == "{}"


@pytest.mark.parametrize("cmd", ["run", "eval"])
@pytest.mark.parametrize("flags, msg", [
    (["--coordinator", "nohost", "--num-processes", "2", "--process-id", "0"], "malformed coordinator address (--coordinator)"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"], "process id out of range (--process-id"),
    (["--num-processes", "2", "--process-id", "1"], "incomplete multi-process flags (--coordinator)"),
])
def test_multi_process_flags_are_checked_before_joining(cmd, flags, msg, fx, tmp_path, capsys):
    """--coordinator / --num-processes / --process-id: checked together, before any process joins a job."""
    args = {"run": ["run", *_common(fx), "--recipes", "fp", "--out", str(tmp_path / "o")],
            "eval": ["eval", *_common(fx), "--recipe", "fp"]}[cmd]
    assert main([*args, *flags]) == 2
    assert msg in capsys.readouterr().err
