"""The atomic writers, the pre-flight output checks, the row log and the error contract."""

from __future__ import annotations

import json
import os

import pytest

from eqjax.core.errors import (
    CompatibilityError,
    EqjaxError,
    InputError,
    NonFiniteResult,
    OutputError,
    RuntimeFailure,
    classify,
    describe,
    exit_code,
    one_line,
)
from eqjax.io.atomic import (
    MARKER,
    JsonLines,
    artifact_kind,
    atomic_directory,
    atomic_file,
    atomic_files,
    atomic_path,
    check_not_input,
    check_output_dir,
    check_output_file,
    output_lock,
    stale_temps,
    write_bytes,
    write_json,
    write_marker,
    write_report,
    write_text,
)


def test_write_replaces_whole_files(tmp_path):
    p = tmp_path / "a" / "b.txt"
    write_text(p, "one")
    write_bytes(p, b"two")
    assert p.read_bytes() == b"two" and sorted(x.name for x in p.parent.iterdir()) == ["b.txt"]


def test_a_failing_writer_leaves_the_old_file(tmp_path):
    p = tmp_path / "r.json"
    write_json(p, {"ppl": 1.0})
    with pytest.raises(RuntimeError):
        with atomic_file(p) as f:
            f.write(b"half")
            raise RuntimeError("writer died")
    assert json.loads(p.read_text()) == {"ppl": 1.0} and sorted(x.name for x in tmp_path.iterdir()) == ["r.json"]
    with pytest.raises(OutputError, match="no file"):
        with atomic_path(p):
            pass  # a writer that wrote nothing
    assert json.loads(p.read_text()) == {"ppl": 1.0}


def test_json_refuses_nan_and_infinity(tmp_path):
    with pytest.raises(NonFiniteResult, match=r"r\.json \(results\[1\]\.ppl\)"):
        write_json(tmp_path / "r.json", {"results": [{"ppl": 1.0}, {"ppl": float("inf")}]})
    assert not (tmp_path / "r.json").exists()


def test_write_report_writes_json_and_markdown_or_neither(tmp_path):
    stem = tmp_path / "results" / "bench"
    j, m = write_report(stem, {"rows": [{"ppl": 2.5}]}, "| ppl |\n")
    assert (j, m) == (stem.with_suffix(".json"), stem.with_suffix(".md"))
    assert json.loads(j.read_text()) == {"rows": [{"ppl": 2.5}]} and m.read_text() == "| ppl |\n"
    with pytest.raises(NonFiniteResult):  # the old pair stays whole
        write_report(stem, {"rows": [{"ppl": float("nan")}]}, "new")
    assert json.loads(j.read_text()) == {"rows": [{"ppl": 2.5}]} and m.read_text() == "| ppl |\n"


def test_stale_temporaries_are_detected_and_cleaned(tmp_path):
    p = tmp_path / "x.bin"
    dead = tmp_path / ".x.bin.tmp-999999999-abcd"  # no such pid
    dead.write_bytes(b"partial")
    alive = tmp_path / f".x.bin.tmp-{os.getpid()}-abcd"
    alive.write_bytes(b"being written")
    assert stale_temps(p) == [dead]
    write_bytes(p, b"ok")
    assert not dead.exists() and alive.exists()


def test_check_output_file(tmp_path):
    p = tmp_path / "new" / "r.json"
    assert check_output_file(p) == p and not p.parent.exists()  # nothing is created by the check
    p.parent.mkdir()
    p.write_text("x")
    with pytest.raises(OutputError, match=r"exists.*--overwrite"):
        check_output_file(p)
    assert check_output_file(p, overwrite=True) == p
    with pytest.raises(OutputError, match="found a directory"):
        check_output_file(tmp_path)
    with pytest.raises(OutputError, match="expected a directory at .*found a file"):
        check_output_file(p / "under-a-file.json")
    with pytest.raises(OutputError, match="writable"):
        check_output_file("/sys/eqjax-probe/r.json")
    with pytest.raises(OutputError, match="empty"):
        check_output_file("")


def test_check_output_dir(tmp_path):
    assert check_output_dir(tmp_path / "new") == tmp_path / "new"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    with pytest.raises(OutputError, match="not empty"):
        check_output_dir(tmp_path / "full")
    with pytest.raises(OutputError, match=r"cannot replace.*eqjax wrote.*found other files \('f'\)"):
        check_output_dir(tmp_path / "full", overwrite=True)  # a user's directory: never replaced
    check_output_dir(tmp_path / "full", overwrite=True, replaceable=["f"])  # only entries a new one replaces
    check_output_dir(tmp_path / "full", allow_nonempty=True)
    write_marker(tmp_path / "full", "run")
    assert artifact_kind(tmp_path / "full") == "run"
    check_output_dir(tmp_path / "full", overwrite=True)  # eqjax's own: may be replaced
    with pytest.raises(OutputError, match="found a file"):
        check_output_dir(tmp_path / "full" / "f")


def test_atomic_directory(tmp_path):
    d = tmp_path / "ck"
    with atomic_directory(d, kind="checkpoint") as tmp:
        (tmp / "a").write_text("1")
    assert (d / "a").read_text() == "1"
    with pytest.raises(OutputError, match="not empty"):
        with atomic_directory(d):
            pass
    with pytest.raises(ValueError, match="boom"):
        with atomic_directory(d, overwrite=True) as tmp:
            (tmp / "a").write_text("2")
            raise ValueError("boom")
    assert (d / "a").read_text() == "1" and sorted(x.name for x in tmp_path.iterdir()) == ["ck"]
    with atomic_directory(d, overwrite=True, kind="checkpoint") as tmp:
        (tmp / "b").write_text("2")
    assert sorted(x.name for x in d.iterdir()) == [MARKER, "b"] and sorted(x.name for x in tmp_path.iterdir()) == ["ck"]
    assert artifact_kind(d) == "checkpoint"


def test_atomic_directory_replaces_only_what_eqjax_wrote(tmp_path):
    """A user's directory is never replaced: one without a marker or manifest is replaced only when the new
    directory holds every one of its entries (so nothing else is lost); a symlink is never replaced."""
    user = tmp_path / "proj"
    (user / "model").mkdir(parents=True)
    (user / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match=r"cannot replace.*proj.*'model', 'notes\.txt'"):
        with atomic_directory(user, overwrite=True) as tmp:
            (tmp / "model.onnx").write_text("new")
    assert (user / "notes.txt").read_text() == "mine" and (user / "model").is_dir()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["proj"]  # no temporary, no lock file left
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "model.onnx").write_text("old")
    with atomic_directory(pkg, overwrite=True) as tmp:  # same names only: --overwrite replaces them
        (tmp / "model.onnx").write_text("new")
    assert (pkg / "model.onnx").read_text() == "new"
    link = tmp_path / "link"
    link.symlink_to(user)
    with pytest.raises(OutputError, match="symbolic link"):
        with atomic_directory(link, overwrite=True):
            pass
    assert (user / "notes.txt").read_text() == "mine"
    with pytest.raises(OutputError, match="symbolic link"):
        check_output_dir(link, overwrite=True)


def test_outputs_apart_from_inputs(tmp_path):
    model = tmp_path / "proj" / "model"
    model.mkdir(parents=True)
    for out, word in ((tmp_path / "proj", "holds"), (model, "is the input"), (model / "sub", "lies inside")):
        with pytest.raises(OutputError, match=word):
            check_output_dir(out, overwrite=True, inputs=[str(model)])
    check_output_dir(tmp_path / "proj", allow_nonempty=True, inputs=[str(model)])  # files beside the model: fine
    check_output_dir(tmp_path / "elsewhere", overwrite=True, inputs=[str(model), None])
    with pytest.raises(OutputError, match=r"--json file lies inside the input"):
        check_not_input(model / "r.json", [str(model)], what="--json file")
    (tmp_path / "alias").symlink_to(model)
    with pytest.raises(OutputError, match="is the input"):
        check_output_dir(tmp_path / "alias", inputs=[str(model)])


def test_output_lock_refuses_a_second_process_and_not_a_dead_one(tmp_path):
    import signal
    import subprocess
    import sys

    out = tmp_path / "run"
    code = ("import sys, time\nfrom eqjax.io.atomic import output_lock\nwith output_lock(sys.argv[1]):\n"
            "    print('locked', flush=True); time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        with pytest.raises(OutputError, match=rf"in use by another eqjax process \({out}\).*pid {p.pid}"):
            with output_lock(out):
                pass
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    with output_lock(out) as lp:  # the dead holder's lock is gone with it
        with output_lock(out):  # re-entrant within a process
            assert lp.is_file()
    assert not lp.exists()


def test_atomic_files_replace_a_set_or_nothing(tmp_path):
    a, b, c = tmp_path / "a.json", tmp_path / "b.md", tmp_path / "c.png"
    for p in (a, b, c):
        p.write_text("old")
    with pytest.raises(OSError):
        with atomic_files([a, b, c]) as tmp:
            tmp[a].write_text("new")
            raise OSError(27, "File too large")  # the second file fails: nothing is replaced
    assert [p.read_text() for p in (a, b, c)] == ["old"] * 3
    assert sorted(x.name for x in tmp_path.iterdir()) == ["a.json", "b.md", "c.png"]
    with atomic_files([a, b, c]) as tmp:
        tmp[a].write_text("new")
        tmp[b].write_text("new")  # c is not in the new set: removed
    assert [a.read_text(), b.read_text(), c.exists()] == ["new", "new", False]


def test_json_lines_survive_a_torn_line(tmp_path):
    log = JsonLines(tmp_path / "rows.jsonl")
    log.append({"row": 1})
    with open(log.path, "ab") as f:
        f.write(b'{"row": 2, "pp')  # killed mid-append
    log.append({"row": 3})
    rows, torn = log.read()
    assert rows == [{"row": 1}, {"row": 3}] and torn == 1
    with pytest.raises(NonFiniteResult):
        log.append({"ppl": float("nan")})


def test_exit_codes_and_one_line_messages():
    from eqjax.core.errors import RecipeError, RuleError
    from eqjax.core.qarray import QArrayError
    from eqjax.data import DataError
    from eqjax.io.gguf import GGUFError
    from eqjax.io.hf import CheckpointError

    for cls in (RecipeError, DataError, CheckpointError, GGUFError, OutputError, CompatibilityError):
        e = cls("x")
        assert isinstance(e, InputError) and isinstance(e, EqjaxError) and isinstance(e, ValueError)
        assert exit_code(e) == 2
    for cls in (QArrayError, RuleError):  # defined elsewhere: registered as virtual subclasses
        assert classify(cls("x")) == "input" and exit_code(cls("x")) == 2
    assert exit_code(NonFiniteResult("x")) == 1 and isinstance(NonFiniteResult("x"), RuntimeFailure)
    assert exit_code(KeyboardInterrupt()) == 130
    assert exit_code(PermissionError(13, "Permission denied", "/x")) == 2
    assert describe(PermissionError(13, "Permission denied", "/x")) == "Permission denied (/x)"
    assert exit_code(OSError(28, "No space left on device")) == 1
    assert classify(TypeError("bug")) == "internal" and "--debug" in describe(TypeError("bug"))
    assert one_line("a\n\n b \nc") == "a; b; c"
    oom = type("JaxRuntimeError", (RuntimeError,), {})("RESOURCE_EXHAUSTED: Out of memory allocating 30037835776 bytes.")
    assert exit_code(oom) == 1 and describe(oom).startswith("out of memory: RESOURCE_EXHAUSTED")
    assert "--by-block" in describe(oom) and "--debug" not in describe(oom)
    assert classify(type("JaxRuntimeError", (RuntimeError,), {})("INTERNAL: x")) == "internal"


def test_plain_value_errors_raised_by_eqjax_count_as_input():
    from eqjax.data import split_documents

    try:
        import eqjax.methods.kvquant as kq

        kq.KVQuant.from_config({"nope": 1})
    except ValueError as e:
        assert classify(e) == "input"
    try:
        int("x")
    except ValueError as e:
        assert classify(e) == "internal"  # raised outside eqjax's code
    with pytest.raises(InputError):
        split_documents(["one"])


def test_token_cache_follows_the_tokenizer_file(tmp_path, monkeypatch):
    """Same size, same vocabulary size, other content: a different cache entry (content-addressed)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from eqjax.data import cache_path, encode_cached
    from eqjax.io import HFTokenizer

    monkeypatch.setenv("EQJAX_CACHE", str(tmp_path / "cache"))
    vocab = {c: i for i, c in enumerate("abcdefgh")}
    paths = []
    for name, v in (("a", vocab), ("b", {c: 7 - i for c, i in vocab.items()})):
        t = Tokenizer(models.BPE(vocab=v, merges=[]))
        t.pre_tokenizer = pre_tokenizers.Whitespace()
        (tmp_path / name).mkdir()
        t.save(str(tmp_path / name / "tokenizer.json"))
        paths.append(tmp_path / name / "tokenizer.json")
    ta, tb = HFTokenizer(paths[0]), HFTokenizer(paths[1])
    assert ta.vocab_size == tb.vocab_size and ta.fingerprint != tb.fingerprint
    assert cache_path(ta, "abc") != cache_path(tb, "abc")
    assert encode_cached(ta, "abc").tolist() == [0, 1, 2]
    assert encode_cached(tb, "abc").tolist() == [7, 6, 5]
    assert encode_cached(ta, "abc").tolist() == [0, 1, 2]
    assert len(list((tmp_path / "cache").glob("tokens-*.npy"))) == 2
    assert not [p for p in (tmp_path / "cache").iterdir() if ".tmp-" in p.name]
