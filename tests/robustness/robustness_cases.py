"""The robustness catalogue: bad and hostile inputs tried as a new user would, and how each must end.

Every :class:`Case` is one user action (a CLI command, an API call, or a process killed while it
writes) with the outcome it must have: a *clear error* (the right exit code, one ``eqjax: error:``
line naming the cause, no traceback) or a *correct* result (exit 0 and a checked output). Each case
also checks that what existed before (a previous result, checkpoint, ONNX file) is intact.

Outcomes tallied by :func:`classify`:

* ``clear error``: refused with the expected exit code and a one-line message naming the cause;
* ``correct``: succeeded and the output checks out;
* ``silent``: exit 0 where an error was due, or an output that does not check out;
* ``loss``: a previous good artifact was damaged, or a half-written target exists;
* ``traceback``: a Python traceback, an "internal error", a wrong exit code or a message that does not
  name the cause;
* ``crash``: killed by a signal (native crash).

The cases live beside this catalogue: fixtures and the record types in robustness_fixtures, API cases
in robustness_api, kill-during-write cases in robustness_kill, running and classifying in robustness_run.

Used by ``tests/robustness/test_cases.py`` (in-process, through ``eqjax.cli.main``) and by
``bench/robustness.py`` (each CLI case in its own ``python -m eqjax.cli`` process), which writes the
tally to ``bench/results/robustness.{json,md}``.
"""

from __future__ import annotations

import json
import pathlib
import textwrap
from typing import Any, Callable

from robustness_api import (
    api_fuzz_recipes,
    api_load_other_model,
    api_ppl_bad_ids,
    api_ppl_overflow,
    api_quantize_nan,
    api_rule_from_dict,
    api_save_into_file,
    api_step_from_config,
    api_token_cache_content,
    api_write_json_nan,
    check_token_cache,
)
from robustness_fixtures import Case, Fixtures, Result, write_hf_model
from robustness_inputs import inputs_cases
from robustness_kill import (
    kill_atomic_file,
    kill_checkpoint,
    kill_json_report,
    kill_onnx,
    kill_run_sigint,
    kill_run_then_resume,
)
from robustness_outputs import outputs_cases
from robustness_recipes import recipes_cases
from robustness_run import OUTCOMES, run_case, run_cli_inprocess

__all__ = ["OUTCOMES", "Case", "Fixtures", "Result", "catalogue", "run_case"]


EVAL = ["eval", "--model", "{tiny}", "--text", "{text}", "--eval-len", "32", "--eval-tokens", "64"]


def _files(**content: str | bytes) -> Callable[[Fixtures, pathlib.Path], dict[str, str]]:
    """A setup writing files into the case's work dir; returns {key: path}."""
    def setup(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
        out = {}
        for key, data in content.items():
            name = key.replace("__", ".")
            p = work / name
            if isinstance(data, bytes):
                p.write_bytes(data)
            else:
                p.write_text(textwrap.dedent(data), encoding="utf-8")
            out[key.split("__")[0]] = str(p)
        return out
    return setup


def _recipe(body: str, suffix: str = "toml") -> Callable[[Fixtures, pathlib.Path], dict[str, str]]:
    return _files(**{f"recipe__{suffix}": body})


def _json_row_ok(fx: Fixtures, work: pathlib.Path, v: dict[str, str], res: Result) -> str | None:
    p = pathlib.Path(v["json_out"])
    if not p.is_file():
        return f"no result file {p}"
    row = json.loads(p.read_text())
    import math

    if not (isinstance(row.get("ppl"), (int, float)) and math.isfinite(row["ppl"]) and row["ppl"] > 1):
        return f"bad ppl {row.get('ppl')!r}"
    return None


def _with_json_out(setup: Callable | None = None) -> Callable[[Fixtures, pathlib.Path], dict[str, str]]:
    def s(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
        v = setup(fx, work) if setup else {}
        v["json_out"] = str(work / "row.json")
        return v
    return s


def _unchanged(key: str, content: bytes) -> Callable[..., str | None]:
    """Check that file ``values[key]`` still holds ``content`` (a previous artifact kept)."""
    def check(fx: Fixtures, work: pathlib.Path, v: dict[str, str], res: Result) -> str | None:
        p = pathlib.Path(v[key])
        if not p.is_file() or p.read_bytes() != content:
            return f"loss: {p} was changed or removed"
        return None
    return check


def _hf_variant(name: str, **kw: Any) -> Callable[[Fixtures, pathlib.Path], dict[str, str]]:
    def setup(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
        return {"m": str(write_hf_model(work / name, **kw))}
    return setup


def _set_param(path: str, index: tuple, value: float) -> Callable[[dict], None]:
    def mutate(params: dict) -> None:
        import numpy as np

        node = params
        *heads, last = path.split("/")
        for h in heads:
            node = node[h]
        a = np.array(node[last])
        a[index] = value
        node[last] = a
    return mutate


def _int_weights(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
    """An HF dir whose q_proj weight is stored as int32 (a bad conversion)."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    d = write_hf_model(work / "intw")
    t = load_file(str(d / "model.safetensors"))
    t["model.layers.0.self_attn.q_proj.weight"] = (t["model.layers.0.self_attn.q_proj.weight"] * 1000).astype(np.int32)
    save_file(t, str(d / "model.safetensors"))
    return {"m": str(d)}


def _copy_tiny(name: str, edit: Callable[[pathlib.Path], None]) -> Callable[[Fixtures, pathlib.Path], dict[str, str]]:
    def setup(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
        import shutil

        d = work / name
        shutil.copytree(fx.root / "tiny", d)
        edit(d)
        return {"m": str(d)}
    return setup


def _truncate(rel: str, keep: float) -> Callable[[pathlib.Path], None]:
    def edit(d: pathlib.Path) -> None:
        p = d / rel
        data = p.read_bytes()
        p.write_bytes(data[: int(len(data) * keep)])
    return edit


def _big_vocab_tokenizer(d: pathlib.Path) -> None:
    """Replace the model by one with a 200-row embedding (ids 200..255 of the tokenizer fall outside)."""
    write_hf_model(d, vocab=200, tokenizer=False)


def _ck_copy(name: str, edit: Callable[[pathlib.Path], None] | None = None) -> Callable[[Fixtures, pathlib.Path], dict[str, str]]:
    def setup(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
        import shutil

        d = work / name
        shutil.copytree(fx.root / "ck", d)
        if edit:
            edit(d)
        return {"c": str(d)}
    return setup


def _largest_data_file(d: pathlib.Path) -> pathlib.Path:
    return max((p for p in (d / "arrays").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _ck_truncate(d: pathlib.Path) -> None:
    p = _largest_data_file(d)
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _ck_flip(d: pathlib.Path) -> None:
    p = _largest_data_file(d)
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0xFF
    p.write_bytes(bytes(b))


def _ck_partial(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
    """What a save killed before its manifest leaves: a .tmp- directory with arrays/ and no eqjax.json."""
    import shutil

    d = work / ".ck.tmp-999999-dead"
    shutil.copytree(fx.root / "ck", d)
    (d / "eqjax.json").unlink()
    return {"c": str(d)}


def _existing(key: str, name: str, content: bytes) -> Callable[[Fixtures, pathlib.Path], dict[str, str]]:
    def setup(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
        p = work / name
        p.write_bytes(content)
        return {key: str(p)}
    return setup


def _ck_loads(key: str, recipe: str | None = None, kv: bool = False) -> Callable[..., str | None]:
    def check(fx: Fixtures, work: pathlib.Path, v: dict[str, str], res: Result) -> str | None:
        from eqjax.io import load_model
        from eqjax.io.orbax import load_quantized

        model, _, _ = load_model(fx.root / "tiny")
        try:
            _, manifest = load_quantized(v[key], model=model)
        except Exception as e:  # noqa: BLE001
            return f"the checkpoint does not load: {e}"
        if recipe and manifest.get("recipe") != recipe:
            return f"manifest recipe {manifest.get('recipe')!r}, expected {recipe!r}"
        if kv and not manifest.get("kv"):
            return "the KV settings are missing from the manifest"
        return None
    return check


def _run_rows(n: int, key: str = "o") -> Callable[..., str | None]:
    def check(fx: Fixtures, work: pathlib.Path, v: dict[str, str], res: Result) -> str | None:
        p = pathlib.Path(v[key]) / "results.json"
        if not p.is_file():
            return "no results.json"
        rows = json.loads(p.read_text())["results"]
        return None if len(rows) == n else f"{len(rows)} rows, expected {n}"
    return check


def _resume_setup(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
    """An interrupted run: rows.jsonl with the header and the fp row (and a torn last line)."""
    out = work / "run"
    res = run_cli_inprocess(["run", "--model", str(fx.root / "tiny"), "--text", str(fx.root / "text.txt"), "--eval-len", "32",
                             "--eval-tokens", "64", "--recipes", "fp", "--out", str(out)])
    assert res.rc == 0, res.err[-500:]
    lines = (out / "rows.jsonl").read_text().splitlines()
    (out / "rows.jsonl").write_text("\n".join(lines[:2]) + '\n{"row": {"recipe": "w8", "pp')
    for f in out.iterdir():
        if f.name != "rows.jsonl":
            f.unlink()
    return {"o": str(out), "fp_row": lines[1]}


def _resume_check(fx: Fixtures, work: pathlib.Path, v: dict[str, str], res: Result) -> str | None:
    p = pathlib.Path(v["o"]) / "results.json"
    if not p.is_file():
        return "no results.json after --resume"
    rows = json.loads(p.read_text())["results"]
    if [r["recipe"] for r in rows] != ["fp", "w8"]:
        return f"rows {[r['recipe'] for r in rows]}"
    old = json.loads(v["fp_row"])["row"]
    if rows[0]["ppl"] != old["ppl"] or rows[0]["quantize_seconds"] != old["quantize_seconds"]:
        return "loss: the finished fp row was not kept as it was"
    return None


def _existing_package(fx: Fixtures, work: pathlib.Path) -> dict[str, str]:
    (work / "pkg").mkdir()
    (work / "pkg" / "model.onnx").write_bytes(b"old onnx")
    return {"o": str(work / "pkg"), "f": str(work / "pkg" / "model.onnx")}


def _onnx_ok(fx: Fixtures, work: pathlib.Path, v: dict[str, str], res: Result) -> str | None:
    import onnx

    m = onnx.load_model(str(pathlib.Path(v["o"]) / "model.onnx"))
    onnx.checker.check_model(m)
    return None if m.graph.node else "empty graph"


# ------------------------------------------------------------------------------------ catalogue
def catalogue() -> list[Case]:
    cases: list[Case] = []
    add = cases.append
    T = "recipe"
    rule = '[[steps]]\nmethod = "rtn"\n[[steps.rules]]\npattern = ".*/kernel"\n'
    add(Case("recipe: bits = 4.7 (float for an int)", T, argv=[*EVAL, "--recipe", "{recipe}"], cause=r"bits.*integer.*4\.7",
             setup=_recipe('name = "r"\n' + rule + "bits = 4.7\n")))
    add(Case("recipe: symmetric = \"false\" (string for a bool)", T, argv=[*EVAL, "--recipe", "{recipe}"],
             cause=r"symmetric.*boolean.*'false'", setup=_recipe('name = "r"\n' + rule + 'symmetric = "false"\n')))
    add(Case("recipe: bits = true (bool for an int)", T, argv=[*EVAL, "--recipe", "{recipe}"], cause=r"bits.*integer.*True",
             setup=_recipe('name = "r"\n' + rule + "bits = true\n")))
    add(Case("recipe: steps = 5", T, argv=[*EVAL, "--recipe", "{recipe}"], cause=r"recipe\.toml: steps\).*list",
             setup=_recipe('name = "r"\nsteps = 5\n')))
    add(Case("recipe: file not UTF-8", T, argv=[*EVAL, "--recipe", "{recipe}"], cause=r"not UTF-8.*recipe\.toml.*0xff",
             setup=_files(recipe__toml=b'name = "r\xff"\nsteps = []\n')))
    add(Case("recipe: unknown key in a rule", T, argv=[*EVAL, "--recipe", "{recipe}"], cause=r"rules\[0\]\.bitz.*unknown",
             setup=_recipe('name = "r"\n' + rule + "bitz = 4\n")))
    add(Case("recipe: skip = true with bits (conflict)", T, argv=[*EVAL, "--recipe", "{recipe}"], cause=r"bits.*skip",
             setup=_recipe('name = "r"\n' + rule + "skip = true\nbits = 4\n")))
    add(Case("recipe: group_size without granularity group", T, argv=[*EVAL, "--recipe", "{recipe}"],
             cause=r"group_size.*granularity", setup=_recipe('name = "r"\n' + rule + "group_size = 32\n")))
    add(Case("recipe: group_size = 100000", T, argv=[*EVAL, "--recipe", "{recipe}"], cause=r"group_size.*1\.\.65536.*100000",
             setup=_recipe('name = "r"\n' + rule + 'granularity = "group"\ngroup_size = 100000\n')))
    add(Case("recipe: percentile with the minmax calibrator", T, argv=[*EVAL, "--recipe", "{recipe}"],
             cause=r"percentile.*calibrator", setup=_recipe('name = "r"\n' + rule + "percentile = 99.0\n")))
    add(Case("recipe: unknown method", T, argv=[*EVAL, "--recipe", "{recipe}"], cause=r"method.*unknown step method 'nope'",
             setup=_recipe('name = "r"\n[[steps]]\nmethod = "nope"\n')))
    add(Case("recipe: TOML syntax error", T, argv=[*EVAL, "--recipe", "{recipe}"], cause=r"does not parse.*recipe\.toml",
             setup=_recipe('name = \n')))
    add(Case("recipe: JSON with a duplicate key", T, argv=[*EVAL, "--recipe", "{recipe}"], cause=r"duplicate key.*bits",
             setup=_recipe('{"name": "r", "steps": [{"method": "rtn", "rules": [{"pattern": ".*", "bits": 4, "bits": 8}]}]}',
                           "json")))
    add(Case("recipe: empty file", T, argv=[*EVAL, "--recipe", "{recipe}"], cause=r"recipe\.toml: name.*required",
             setup=_recipe("")))
    add(Case("recipe: file missing", T, argv=[*EVAL, "--recipe", "/nonexistent/r.toml"], cause=r"does not exist.*r\.toml"))
    add(Case("recipe: unknown built-in name", T, argv=[*EVAL, "--recipe", "w9"], cause=r"unknown recipe 'w9'"))
    add(Case("recipe: regex that does not compile", T, argv=[*EVAL, "--recipe", "{recipe}"], cause=r"pattern.*does not compile",
             setup=_recipe('name = "r"\n[[steps]]\nmethod = "rtn"\n[[steps.rules]]\npattern = "(("\n')))
    add(Case("recipe: kv key_bits = \"4\"", T, argv=[*EVAL, "--recipe", "{recipe}"], cause=r"kv\.key_bits.*integer",
             setup=_recipe('name = "r"\nsteps = []\n[kv]\nkey_bits = "4"\n')))
    add(Case("recipe: gptq bits = 3.0", T, argv=[*EVAL, "--recipe", "{recipe}"], cause=r"steps\[0\]\.bits.*integer.*3\.0",
             setup=_recipe('name = "r"\n[[steps]]\nmethod = "gptq"\nbits = 3.0\n')))
    add(Case("recipe: path is a directory", T, argv=[*EVAL, "--recipe", "{d}"], cause=r"not a file",
             setup=lambda fx, w: (w / "r.toml").mkdir() or {"d": str(w / "r.toml")}))
    add(Case("recipe: valid TOML, group 32", T, expect="ok", argv=[*EVAL, "--recipe", "{recipe}", "--json", "{json_out}"],
             setup=_with_json_out(_recipe('name = "r"\n' + rule + 'bits = 4\nsymmetric = false\ngranularity = "group"\n'
                                          'group_size = 32\nscale_dtype = "float16"\n')), check=_json_row_ok))
    add(Case("recipe: valid JSON with a kv table", T, expect="ok", argv=[*EVAL, "--recipe", "{recipe}", "--json", "{json_out}"],
             setup=_with_json_out(_recipe('{"name": "j", "steps": [], "kv": {"key_bits": 8, "value_bits": 8}}', "json")),
             check=_json_row_ok))

    T = "model"
    add(Case("model: path missing", T, argv=["eval", "--model", "/nonexistent/m.gguf", "--text", "{text}", "--eval-len", "32",
                                                "--eval-tokens", "64", "--recipe", "fp"], cause=r"model not found.*m\.gguf"))
    add(Case("model: a text file given as the model", T, argv=["eval", "--model", "{text}", "--text", "{text}", "--eval-len", "32",
                                                                  "--eval-tokens", "64", "--recipe", "fp"], cause=r"unknown model format.*text\.txt"))
    add(Case("model: truncated GGUF", T, argv=["eval", "--model", "{g}", "--text", "{text}", "--eval-len", "32", "--eval-tokens", "64",
                                                  "--recipe", "fp"], cause=r"cut\.gguf.*(truncated|corrupt)",
             setup=lambda fx, w: (w / "cut.gguf").write_bytes((fx.root / "tiny.gguf").read_bytes()[:3000]) and {"g": str(w / "cut.gguf")}))
    add(Case("model: empty .gguf", T, argv=["eval", "--model", "{g}", "--text", "{text}", "--eval-len", "32", "--eval-tokens", "64",
                                               "--recipe", "fp"], cause=r"e\.gguf: not a GGUF file",
             setup=lambda fx, w: (w / "e.gguf").write_bytes(b"") or {"g": str(w / "e.gguf")}))
    add(Case("model: garbage after the GGUF magic", T, argv=["eval", "--model", "{g}", "--text", "{text}", "--eval-len", "32",
                                                                "--eval-tokens", "64", "--recipe", "fp"], cause=r"g\.gguf",
             setup=lambda fx, w: (w / "g.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 8) and {"g": str(w / "g.gguf")}))
    add(Case("model: HF dir without config.json", T, argv=["eval", "--model", "{m}", "--text", "{text}", "--eval-len", "32",
                                                              "--eval-tokens", "64", "--recipe", "fp"], cause=r"no config\.json",
             setup=_copy_tiny("nocfg", lambda d: (d / "config.json").unlink())))
    add(Case("model: truncated safetensors", T, argv=["eval", "--model", "{m}", "--text", "{text}", "--eval-len", "32",
                                                         "--eval-tokens", "64", "--recipe", "fp"], cause=r"model\.safetensors.*(truncated|corrupt)",
             setup=_copy_tiny("cut", _truncate("model.safetensors", 0.5))))
    add(Case("model: corrupt config.json", T, argv=["eval", "--model", "{m}", "--text", "{text}", "--eval-len", "32",
                                                       "--eval-tokens", "64", "--recipe", "fp"], cause=r"config\.json.*not valid JSON",
             setup=_copy_tiny("badcfg", lambda d: (d / "config.json").write_text("{nope"))))
    add(Case("model: int32 weights (ppl would be Infinity)", T, argv=["eval", "--model", "{m}", "--text", "{text}", "--eval-len", "32",
                                                                         "--eval-tokens", "64", "--recipe", "fp"],
             cause=r"q_proj.*floating-point.*int32", setup=_int_weights))
    add(Case("model: NaN in a norm", T, argv=["eval", "--model", "{m}", "--text", "{text}", "--eval-len", "32", "--eval-tokens", "64",
                                                 "--recipe", "w8"], cause=r"non-finite.*layers_0/mlp_norm/scale.*\(3,\)",
             setup=_hf_variant("nan", mutate=_set_param("layers_0/mlp_norm/scale", (3,), float("nan")))))
    add(Case("model: Inf in the embedding", T, argv=["eval", "--model", "{m}", "--text", "{text}", "--eval-len", "32",
                                                        "--eval-tokens", "64", "--recipe", "fp"], cause=r"non-finite.*embed/embedding.*\(7, 2\)",
             setup=_hf_variant("inf", mutate=_set_param("embed/embedding", (7, 2), float("inf")))))
    add(Case("model: HF dir without tokenizer.json", T, argv=["eval", "--model", "{m}", "--text", "{text}", "--eval-len", "32",
                                                                 "--eval-tokens", "64", "--recipe", "fp"], cause=r"tokenizer\.json",
             setup=_copy_tiny("notok", lambda d: (d / "tokenizer.json").unlink())))
    add(Case("model: corrupt tokenizer.json", T, argv=["eval", "--model", "{m}", "--text", "{text}", "--eval-len", "32",
                                                          "--eval-tokens", "64", "--recipe", "fp"], cause=r"tokenizer\.json",
             setup=_copy_tiny("badtok", lambda d: (d / "tokenizer.json").write_text('{"model": 1}'))))
    add(Case("model: token ids beyond the vocabulary", T, argv=["eval", "--model", "{m}", "--text", "{text}", "--eval-len", "32",
                                                                   "--eval-tokens", "64", "--recipe", "fp"],
             cause=r"outside the model's vocabulary.*tokenizer\.json.*\[0, 200\)", setup=_copy_tiny("v200", _big_vocab_tokenizer)))
    add(Case("model: pickle-only checkpoint", T, argv=["eval", "--model", "{m}", "--text", "{text}", "--eval-len", "32",
                                                          "--eval-tokens", "64", "--recipe", "fp"], cause=r"pickle",
             setup=_copy_tiny("pkl", lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"))))
    add(Case("model: tiny GGUF evaluates", T, expect="ok",
             argv=["eval", "--model", "{gguf}", "--text", "{text}", "--eval-len", "32", "--eval-tokens", "64", "--recipe", "w8",
                   "--json", "{json_out}"], setup=_with_json_out(), check=_json_row_ok))

    T = "text"
    add(Case("text: missing", T, argv=["eval", "--model", "{tiny}", "--text", "/nonexistent.txt", "--recipe", "fp", "--eval-len", "32",
                                          "--eval-tokens", "64"], cause=r"nonexistent\.txt: no such file"))
    add(Case("text: not UTF-8", T, argv=["eval", "--model", "{tiny}", "--text", "{t}", "--recipe", "fp", "--eval-len", "32",
                                            "--eval-tokens", "64"], cause=r"t\.txt: not UTF-8.*0xe9",
             setup=_files(t__txt="caf\xe9 ".encode("latin-1") * 200)))
    add(Case("text: empty", T, argv=["eval", "--model", "{tiny}", "--text", "{t}", "--recipe", "fp", "--eval-len", "32",
                                        "--eval-tokens", "64"], cause=r"t\.txt: the file is empty", setup=_files(t__txt="  \n")))
    add(Case("text: too short for the windows", T, argv=["eval", "--model", "{tiny}", "--text", "{t}", "--recipe", "fp",
                                                            "--eval-len", "32", "--eval-tokens", "64"], cause=r"t\.txt.*tokens",
             setup=_files(t__txt="too short")))
    add(Case("text: a directory", T, argv=["eval", "--model", "{tiny}", "--text", "{d}", "--recipe", "fp", "--eval-len", "32",
                                              "--eval-tokens", "64"], cause=r"not a regular file",
             setup=lambda fx, w: (w / "d").mkdir() or {"d": str(w / "d")}))

    T = "flags"
    base = ["eval", "--model", "{tiny}", "--text", "{text}", "--recipe", "fp"]
    add(Case("flags: --eval-len 0", T, argv=[*base, "--eval-len", "0"], cause=r"--eval-len.*>= 2.*0"))
    add(Case("flags: --eval-len -5", T, argv=[*base, "--eval-len", "-5"], cause=r"--eval-len.*-5"))
    add(Case("flags: --eval-tokens below --eval-len", T, argv=[*base, "--eval-len", "32", "--eval-tokens", "10"],
             cause=r"--eval-tokens.*>= 32.*10"))
    add(Case("flags: --eval-len above the model's max positions", T, argv=[*base, "--eval-len", "512", "--eval-tokens", "512"],
             cause=r"max_position_embeddings.*<= 128.*512"))
    add(Case("flags: --batch-size 0", T, argv=[*base, "--eval-len", "32", "--eval-tokens", "64", "--batch-size", "0"],
             cause=r"--batch-size"))
    add(Case("flags: --calib-windows -1", T, argv=[*base, "--eval-len", "32", "--eval-tokens", "64", "--calib-windows", "-1"],
             cause=r"--calib-windows"))
    add(Case("flags: --eval-len abc", T, argv=[*base, "--eval-len", "abc"], cause=r"--eval-len.*invalid int"))
    add(Case("flags: --recipe and --checkpoint together", T, argv=[*base, "--checkpoint", "{ck}"], cause=r"not allowed with"))
    add(Case("flags: unknown subcommand", T, argv=["evaluate"], cause=r"invalid choice"))

    T = "distributed"
    add(Case("distributed: --num-processes 0", T, argv=[*EVAL, "--recipe", "fp", "--num-processes", "0"],
             cause=r"--num-processes.*>= 1.*0"))
    add(Case("distributed: process id out of range", T, argv=[*EVAL, "--recipe", "fp", "--num-processes", "2", "--process-id", "5",
                                                            "--coordinator", "localhost:1234"], cause=r"--process-id.*0\.\.1.*5"))
    add(Case("distributed: coordinator without a port", T, argv=[*EVAL, "--recipe", "fp", "--num-processes", "2",
                                                                   "--process-id", "0", "--coordinator", "localhost"],
             cause=r"coordinator.*host:port.*'localhost'"))
    add(Case("distributed: coordinator port 99999", T, argv=[*EVAL, "--recipe", "fp", "--num-processes", "2", "--process-id",
                                                               "0", "--coordinator", "h:99999"], cause=r"port 1\.\.65535"))
    add(Case("distributed: EQJAX_NUM_PROCESSES=abc", T, argv=[*EVAL, "--recipe", "fp"], env={"EQJAX_NUM_PROCESSES": "abc"},
             cause=r"EQJAX_NUM_PROCESSES.*integer.*'abc'"))
    add(Case("distributed: --process-id without the others", T, argv=[*EVAL, "--recipe", "fp", "--process-id", "1"],
             cause=r"--coordinator.*--num-processes"))

    T = "outputs"
    add(Case("outputs: --json under an unwritable directory", T, argv=[*EVAL, "--recipe", "fp", "--json", "/sys/eqjax-r.json"],
             cause=r"/sys/eqjax-r\.json.*writable"))
    add(Case("outputs: --json exists, no --overwrite", T, argv=[*EVAL, "--recipe", "fp", "--json", "{j}"],
             cause=r"exists.*--overwrite", setup=_existing("j", "r.json", b'{"old": 1}'), check=_unchanged("j", b'{"old": 1}')))
    add(Case("outputs: --json exists, --overwrite", T, expect="ok",
             argv=[*EVAL, "--recipe", "fp", "--json", "{json_out}", "--overwrite"],
             setup=lambda fx, w: (w / "row.json").write_text("{}") and {"json_out": str(w / "row.json")}, check=_json_row_ok))
    add(Case("outputs: --json is a directory", T, argv=[*EVAL, "--recipe", "fp", "--json", "{d}"], cause=r"directory",
             setup=lambda fx, w: (w / "d").mkdir() or {"d": str(w / "d")}))
    add(Case("outputs: --json parent is a file", T, argv=[*EVAL, "--recipe", "fp", "--json", "{f}/r.json"], cause=r"r\.json",
             setup=_existing("f", "f", b"x")))
    add(Case("quantize: --out is a non-empty directory", T, argv=["quantize", "--model", "{tiny}", "--recipe", "w8", "--out", "{d}"],
             cause=r"not empty.*--overwrite", setup=lambda fx, w: ((w / "d").mkdir(), (w / "d" / "keep").write_bytes(b"k")) and {"d": str(w / "d"), "k": str(w / "d" / "keep")},
             check=_unchanged("k", b"k")))
    add(Case("quantize: --out is a file", T, argv=["quantize", "--model", "{tiny}", "--recipe", "w8", "--out", "{f}"],
             cause=r"directory.*file", setup=_existing("f", "f", b"x"), check=_unchanged("f", b"x")))
    add(Case("quantize: new checkpoint", T, expect="ok", argv=["quantize", "--model", "{tiny}", "--recipe", "w4g128-rtn",
                                                                "--out", "{c}"],
             setup=lambda fx, w: {"c": str(w / "c")}, check=_ck_loads("c", "w4g128-rtn")))
    add(Case("quantize: --overwrite an existing checkpoint", T, expect="ok",
             argv=["quantize", "--model", "{tiny}", "--recipe", "w4g128-rtn", "--out", "{c}", "--overwrite"],
             setup=_ck_copy("c"), check=_ck_loads("c", "w4g128-rtn")))
    add(Case("quantize: NaN in a norm", T, argv=["quantize", "--model", "{m}", "--recipe", "w8", "--out", "{c}"],
             cause=r"non-finite.*layers_1/attn_norm/scale",
             setup=lambda fx, w: {**_hf_variant("nan", mutate=_set_param("layers_1/attn_norm/scale", (0,), float("nan")))(fx, w),
                                  "c": str(w / "c")},
             check=lambda fx, w, v, r: "a checkpoint was written" if pathlib.Path(v["c"]).exists() else None))
    add(Case("quantize: --recipe kv4 records the KV settings", T, expect="ok",
             argv=["quantize", "--model", "{tiny}", "--recipe", "kv4", "--out", "{c}"],
             setup=lambda fx, w: {"c": str(w / "c")}, check=_ck_loads("c", "kv4", kv=True)))
    add(Case("run: --out holds a previous run's results", T, argv=["run", "--model", "{tiny}", "--text", "{text}", "--eval-len", "32",
                                                                   "--eval-tokens", "64", "--recipes", "fp", "--out", "{o}"],
             cause=r"results exist.*--overwrite",
             setup=lambda fx, w: ((w / "o").mkdir(), (w / "o" / "results.json").write_text("{}")) and {"o": str(w / "o"), "r": str(w / "o" / "results.json")},
             check=_unchanged("r", b"{}")))
    add(Case("run: --resume keeps the finished rows", T, expect="ok",
             argv=["run", "--model", "{tiny}", "--text", "{text}", "--eval-len", "32", "--eval-tokens", "64", "--recipes", "fp,w8",
                   "--out", "{o}", "--resume"], setup=_resume_setup, check=_resume_check))
    add(Case("run: --resume under another protocol", T,
             argv=["run", "--model", "{tiny}", "--text", "{text}", "--eval-len", "16", "--eval-tokens", "64", "--recipes", "fp,w8",
                   "--out", "{o}", "--resume"], setup=_resume_setup, cause=r"protocol\.ctx.*16.*32"))
    add(Case("run: two recipes with one name", T, argv=["run", "--model", "{tiny}", "--text", "{text}", "--eval-len", "32",
                                                        "--eval-tokens", "64", "--recipes", "fp,fp", "--out", "{o}"],
             cause=r"listed twice", setup=lambda fx, w: {"o": str(w / "o")}))
    add(Case("export-onnx: --recipe kv4", T, argv=["export-onnx", "--model", "{gguf}", "--recipe", "kv4", "--out", "{o}"],
             cause=r"kv4.*KV", setup=lambda fx, w: {"o": str(w / "pkg")},
             check=lambda fx, w, v, r: "a float graph was written" if pathlib.Path(v["o"]).exists() else None))
    add(Case("export-onnx: unwritable output", T, argv=["export-onnx", "--model", "{gguf}", "--recipe", "w8", "--out",
                                                          "/sys/eqjax_pkg"], cause=r"/sys/eqjax_pkg.*writable"))
    add(Case("export-onnx: output exists, no --overwrite", T, argv=["export-onnx", "--model", "{gguf}", "--recipe", "w8",
                                                                     "--out", "{o}"], cause=r"not empty.*--overwrite",
             setup=_existing_package, check=_unchanged("f", b"old onnx")))
    add(Case("export-onnx: HF directory as the model", T, expect="ok", argv=["export-onnx", "--model", "{tiny}", "--recipe",
                                                                              "w8", "--out", "{o}"],
             setup=lambda fx, w: {"o": str(w / "pkg")}, check=_onnx_ok))
    add(Case("export-onnx: tiny GGUF, w8", T, expect="ok", argv=["export-onnx", "--model", "{gguf}", "--recipe", "w8",
                                                                  "--out", "{o}"], setup=lambda fx, w: {"o": str(w / "pkg")},
             check=_onnx_ok))

    T = "export-gguf"
    add(Case("export-gguf: --recipe w8a8-smoothquant", T, argv=["export-gguf", "--model", "{gguf}", "--recipe",
                                                                 "w8a8-smoothquant", "--out", "{o}"],
             cause=r"SmoothQuant.*weight-only", setup=lambda fx, w: {"o": str(w / "m.gguf")},
             check=lambda fx, w, v, r: "a file was written" if pathlib.Path(v["o"]).exists() else None))
    add(Case("export-gguf: widths not multiples of 32", T, argv=["export-gguf", "--model", "{gguf}", "--recipe", "w8",
                                                                  "--out", "{o}"],
             cause=r"tiny\.gguf.*hidden 8.*multiple of 32", setup=lambda fx, w: {"o": str(w / "m.gguf")}))
    add(Case("export-gguf: output exists, no --overwrite", T, argv=["export-gguf", "--model", "{gguf}", "--recipe", "w8",
                                                                     "--out", "{o}"], cause=r"m\.gguf.*--overwrite",
             setup=lambda fx, w: (w / "m.gguf").write_bytes(b"old gguf") and {"o": str(w / "m.gguf")},
             check=_unchanged("o", b"old gguf")))
    add(Case("export-gguf: HF directory whose tokenizer has no merges", T,
             argv=["export-gguf", "--model", "{tiny}", "--recipe", "w8", "--out", "{o}"],
             cause=r"tokenizer\.json: no merges", setup=lambda fx, w: {"o": str(w / "m.gguf")},
             check=lambda fx, w, v, r: "a file was written" if pathlib.Path(v["o"]).exists() else None))

    T = "checkpoint"
    ev = ["eval", "--model", "{tiny}", "--text", "{text}", "--eval-len", "32", "--eval-tokens", "64"]
    add(Case("checkpoint: evaluates", T, expect="ok", argv=[*ev, "--checkpoint", "{ck}", "--json", "{json_out}"],
             setup=_with_json_out(), check=_json_row_ok))
    add(Case("checkpoint: into a model of another shape", T, argv=["eval", "--model", "{other}", "--text", "{text}", "--eval-len", "32",
                                                                    "--eval-tokens", "64", "--checkpoint", "{ck}"],
             cause=r"another model.*config key.*expected.*found"))
    add(Case("checkpoint: truncated data file", T, argv=[*ev, "--checkpoint", "{c}"], cause=r"truncated.*expected \d+ bytes",
             setup=_ck_copy("c", _ck_truncate)))
    add(Case("checkpoint: one flipped byte in a data file", T, argv=[*ev, "--checkpoint", "{c}"], cause=r"corrupt.*SHA-256",
             setup=_ck_copy("c", _ck_flip)))
    add(Case("checkpoint: corrupt manifest", T, argv=[*ev, "--checkpoint", "{c}"], cause=r"eqjax\.json",
             setup=_ck_copy("c", lambda d: (d / "eqjax.json").write_text('{"format": 2, "leav'))))
    add(Case("checkpoint: partial (save killed)", T, argv=[*ev, "--checkpoint", "{c}"], cause=r"incomplete checkpoint",
             setup=_ck_partial))
    add(Case("checkpoint: missing directory", T, argv=[*ev, "--checkpoint", "/nonexistent/ck"], cause=r"checkpoint not found"))
    add(Case("checkpoint: data file deleted", T, argv=[*ev, "--checkpoint", "{c}"], cause=r"missing",
             setup=_ck_copy("c", lambda d: _largest_data_file(d).unlink())))

    T = "api"
    add(Case("api: quantize params with a NaN norm", T, api=api_quantize_nan, cause=r"layers_1/mlp_norm/scale.*\(5,\)"))
    add(Case("api: perplexity with ids beyond the vocabulary", T, api=api_ppl_bad_ids, cause=r"\[0, 256\).*300"))
    add(Case("api: perplexity of a model whose logits blow up", T, api=api_ppl_overflow, code=1, cause=r"(perplexity overflows|non-finite loss)"))
    add(Case("api: load a checkpoint into another model", T, api=api_load_other_model, cause=r"another model"))
    add(Case("api: write_json with Infinity", T, api=api_write_json_nan, code=1, cause=r"x\.json.*ppl"))
    add(Case("api: GPTQ.from_config bits = \"4\"", T, api=api_step_from_config, cause=r"bits.*integer"))
    add(Case("api: rule_from_dict axis with tensor granularity", T, api=api_rule_from_dict, cause=r"axis.*tensor"))
    add(Case("api: token cache with a changed tokenizer.json", T, expect="ok", api=api_token_cache_content,
             check=check_token_cache))
    add(Case("api: save a checkpoint onto a file", T, api=api_save_into_file, cause=r"file"))
    add(Case("api: 200 random recipe dicts (fuzz)", T, expect="ok", api=api_fuzz_recipes))

    T = "kill"
    add(Case("kill: SIGKILL during an atomic file write", T, expect="ok", kill=kill_atomic_file))
    add(Case("kill: SIGKILL during a checkpoint save (--overwrite)", T, expect="ok", kill=kill_checkpoint, slow=True))
    add(Case("kill: SIGKILL during an ONNX write", T, expect="ok", kill=kill_onnx, slow=True))
    add(Case("kill: SIGKILL during a JSON result write", T, expect="ok", kill=kill_json_report))
    add(Case("kill: SIGKILL during eqjax run, then --resume", T, expect="ok", kill=kill_run_then_resume, slow=True))
    add(Case("kill: Ctrl-C during eqjax run, then --resume", T, expect="ok", kill=kill_run_sigint, slow=True))
    return cases + outputs_cases() + inputs_cases() + recipes_cases()

