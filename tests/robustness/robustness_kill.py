"""Kill-during-write cases of the robustness catalogue: a process killed while it writes an artifact must
leave the previous one intact and its partial output detectable (or resumable)."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

from robustness_fixtures import ROOT, Fixtures

_ENV_AT_IMPORT = dict(os.environ)  # to name what earlier tests left in the environment a child inherits


_PY = [sys.executable, "-c"]


def _child(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    e = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "JAX_PLATFORMS": "cpu"}
    e.update(env or {})
    return subprocess.Popen([*_PY, textwrap.dedent(code), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=str(ROOT), env=e)


def _wait_line(p: subprocess.Popen, word: str, timeout: float = 120) -> bool:
    t0 = time.time()
    while time.time() - t0 < timeout:
        line = p.stdout.readline()
        if not line:
            return False
        if word in line:
            return True
    return False


def _kill_once(p: subprocess.Popen, word: str, what: str, delay: float = 0.0) -> str | None:
    """SIGKILL ``p`` ``delay`` s after it prints ``word``; a failure description if it never printed it."""
    if not _wait_line(p, word):
        _kill(p)
        return f"the {what} did not start: {p.stderr.read()[-300:]}"
    time.sleep(delay)
    _kill(p)
    return None


def _kill(p: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        p.send_signal(sig)
    except ProcessLookupError:
        pass
    p.wait(timeout=60)


def kill_atomic_file(fx: Fixtures, work: pathlib.Path, v: dict) -> str | None:
    from eqjax.io.atomic import stale_temps, write_bytes

    target = work / "big.bin"
    old = b"previous good artifact\n" * 1000
    write_bytes(target, old)
    p = _child("""
        import sys, time
        from eqjax.io.atomic import atomic_file
        with atomic_file(sys.argv[1], "wb") as f:
            for i in range(2000):
                f.write(b"N" * (1 << 20)); f.flush()
                if i == 3: print("writing", flush=True)
                time.sleep(0.01)
        print("done", flush=True)
    """, str(target))
    failure = _kill_once(p, "writing", "writer")
    if failure:
        return failure
    if target.read_bytes() != old:
        return "loss: the previous file was changed by a killed write"
    if not stale_temps(target):
        return "the partial write is not detectable (no temporary left)"
    write_bytes(target, b"new")  # the next write replaces it and removes the dead writer's temporary
    if target.read_bytes() != b"new" or stale_temps(target):
        return "the next write did not clean up"
    return None


def kill_checkpoint(fx: Fixtures, work: pathlib.Path, v: dict) -> str | None:
    import shutil

    from eqjax.io import load_model
    from eqjax.io.orbax import load_quantized

    ck = work / "ck"
    shutil.copytree(fx.root / "ck", ck)
    before = (ck / "eqjax.json").read_bytes()
    p = _child("""
        import sys, time
        import eqjax.io.orbax as o
        real = o._file_table
        def slow(root):
            print("saving", flush=True); time.sleep(600); return real(root)
        o._file_table = slow
        sys.path.insert(0, sys.argv[2])
        from robustness_fixtures import Fixtures
        import pathlib
        fx = Fixtures(pathlib.Path(sys.argv[3]))
        from eqjax.io import load_model
        from eqjax.io.orbax import save_quantized
        from eqjax.recipes.apply import quantize
        from eqjax.recipes.registry import get_recipe
        model, params, _ = load_model(fx.root / "tiny")
        save_quantized(sys.argv[1], quantize(params, get_recipe("w4g128-rtn"), model=model), recipe="w4g128-rtn", model=model,
                       overwrite=True)
    """, str(ck), str(pathlib.Path(__file__).parent), str(fx.root))
    failure = _kill_once(p, "saving", "save")
    if failure:
        return failure
    if (ck / "eqjax.json").read_bytes() != before:
        return "loss: the previous checkpoint's manifest changed"
    model, _, _ = load_model(fx.root / "tiny")
    try:
        _, m = load_quantized(ck, model=model)
    except Exception as e:  # noqa: BLE001
        return f"loss: the previous checkpoint no longer loads: {e}"
    if m["recipe"] != "w8":
        return "loss: the previous checkpoint was replaced by a partial one"
    partial = [q for q in work.iterdir() if q.name.startswith(".ck.tmp-")]
    if not partial:
        return "the partial checkpoint is not detectable"
    try:
        load_quantized(partial[0])
        return "a partial checkpoint loaded"
    except Exception as e:  # noqa: BLE001
        if "incomplete checkpoint" not in str(e):
            return f"a partial checkpoint gives an unclear error: {e}"
    return None


def kill_onnx(fx: Fixtures, work: pathlib.Path, v: dict) -> str | None:
    pkg = work / "pkg"
    pkg.mkdir()
    target = pkg / "model.onnx"
    old = b"previous onnx file" * 100
    target.write_bytes(old)
    p = _child("""
        import sys, time
        import onnx
        def slow_save(m, path, **kw):
            data = m.SerializeToString()
            with open(path, "wb") as f:
                for i in range(0, len(data), 256):
                    f.write(data[i:i + 256]); f.flush()
                    if i == 0: print("writing", flush=True)
                    time.sleep(0.05)
        onnx.save_model = slow_save
        from eqjax.io.gguf import load_gguf
        from eqjax.models import Model
        from eqjax.export.package import export_package
        cfg, params, tok = load_gguf(sys.argv[2])
        export_package(Model(cfg), params, sys.argv[1], tokenizer=tok, overwrite=True, check=False)
    """, str(pkg), str(fx.root / "tiny.gguf"))
    failure = _kill_once(p, "writing", "export", delay=0.2)
    if failure:
        return failure
    if target.read_bytes() != old:
        return "loss: the previous ONNX package was damaged by a killed export"
    return None


def _run_cmd(fx: Fixtures, out: pathlib.Path, recipes: str, *extra: str) -> list[str]:
    return ["-m", "eqjax.cli", "run", "--model", str(fx.root / "tiny"), "--text", str(fx.root / "text.txt"),
            "--eval-len", "32", "--eval-tokens", "64", "--recipes", recipes, "--out", str(out), *extra]


def kill_run_then_resume(fx: Fixtures, work: pathlib.Path, v: dict, sig: int = signal.SIGKILL) -> str | None:
    out = work / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    # enough recipes after the second row that the kill lands before the run ends, even on a loaded machine
    names = "fp,w8,w4g128-rtn,w8a8-naive,w8-absmax,w8-zeropoint,w4g128-rtn-sym,w8a8-zeroquant"
    # Ctrl-C as a user's shell delivers it: the child starts with SIGINT at its default and unblocked even
    # if something earlier in this test process left it ignored or blocked (both are inherited across exec)
    def as_a_shell() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    p = subprocess.Popen([sys.executable, *_run_cmd(fx, out, names)], cwd=str(ROOT),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=as_a_shell)
    rows = out / "rows.jsonl"
    t0 = time.time()
    while time.time() - t0 < 180:
        if rows.is_file() and rows.read_text().count("\n") >= 2:
            break
        if p.poll() is not None:
            return f"the run ended before it could be killed: {p.stderr.read()[-300:]}"
        time.sleep(0.05)
    masks = _signal_masks(p.pid) if sig == signal.SIGINT else ""
    _kill(p, sig)
    err = p.stderr.read()
    if sig == signal.SIGINT:
        if p.returncode != 130 or "--resume" not in err.strip().splitlines()[-1]:
            swallowed = [x for x in err.splitlines() if "Exception ignored" in x or "KeyboardInterrupt" in x][:3]
            return (f"Ctrl-C: exit {p.returncode}, last line {err.strip().splitlines()[-1:]}; "
                    f"{swallowed or 'no trace of it'}; child before the signal: {masks}; environment changed "
                    f"since import: {_env_changes()}")
    kept = [json.loads(x) for x in rows.read_text().splitlines()[1:] if x.strip().endswith("}")]
    if not kept:
        return "loss: no finished row kept after the kill"
    r = subprocess.run([sys.executable, *_run_cmd(fx, out, names, "--resume")], cwd=str(ROOT),
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        return f"--resume failed: {r.stderr.strip().splitlines()[-1:]}"
    res = json.loads((out / "results.json").read_text())["results"]
    if [x["recipe"] for x in res] != names.split(","):
        return f"resumed rows {[x['recipe'] for x in res]}"
    if res[0]["ppl"] != kept[0]["row"]["ppl"]:
        return "loss: a kept row was measured again"
    return None


def _signal_masks(pid: int) -> str:
    """The child's SIGINT state per thread from /proc (blocked / ignored / caught), for a failure message."""
    bit = 1 << (signal.SIGINT - 1)
    out = []
    try:
        tasks = sorted(pathlib.Path(f"/proc/{pid}/task").iterdir())
        for task in tasks:
            f = dict(x.split(":\t", 1) for x in (task / "status").read_text().splitlines() if ":\t" in x)
            flags = [k for k in ("SigBlk", "SigIgn", "SigCgt") if int(f.get(k, "0"), 16) & bit]
            if task.name == str(pid) or flags != ["SigCgt"]:
                out.append(f"{task.name}({f.get('Name', '?').strip()}):{'+'.join(flags) or 'default'}")
    except OSError as e:
        return f"unreadable ({e})"
    return ", ".join(out) + f" ({len(tasks)} threads)"


def _env_changes() -> dict[str, str | None]:
    now = dict(os.environ)
    return {k: now.get(k) for k in sorted(set(now) | set(_ENV_AT_IMPORT))
            if now.get(k) != _ENV_AT_IMPORT.get(k) and k != "PYTEST_CURRENT_TEST"}


def kill_run_sigint(fx: Fixtures, work: pathlib.Path, v: dict) -> str | None:
    return kill_run_then_resume(fx, work, v, signal.SIGINT)


def kill_json_report(fx: Fixtures, work: pathlib.Path, v: dict) -> str | None:
    """Kill a process in the middle of write_json over an existing result: old or new, never half."""
    from eqjax.io.atomic import write_json

    target = work / "r.json"
    write_json(target, {"ppl": 1.5})
    old = target.read_bytes()
    p = _child("""
        import sys, time, os
        import eqjax.io.atomic as a
        real = os.fsync
        def slow(fd):
            print("fsync", flush=True); time.sleep(600)
        os.fsync = slow
        a.write_json(sys.argv[1], {"ppl": 2.5, "big": list(range(100000))})
    """, str(target))
    failure = _kill_once(p, "fsync", "writer")
    if failure:
        return failure
    if target.read_bytes() != old:
        return "loss: the previous JSON result was changed by a killed write"
    json.loads(target.read_text())
    return None

