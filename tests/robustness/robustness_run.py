"""Running a robustness case (in-process through ``eqjax.cli.main``, or in its own process) and classifying
how it ended (see :data:`OUTCOMES` and robustness_cases)."""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import re
import subprocess
import sys
import threading
import time

from robustness_fixtures import ROOT, Case, Fixtures, Result

MAIN_LOCK = threading.Lock()  # eqjax.cli.main in this process: one at a time (pyplot, redirected stdio)
OUTCOMES = ("clear error", "correct", "silent", "loss", "traceback", "crash")


def _fmt(args: list[str], values: dict[str, str]) -> list[str]:
    return [a.format(**values) for a in args]


def run_cli_inprocess(argv: list[str], env: dict[str, str] | None = None) -> Result:
    from eqjax.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        with MAIN_LOCK, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 2
            except BaseException:  # noqa: BLE001 - main must not raise; report it as a traceback
                import traceback

                traceback.print_exc()
                rc = 1
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return Result(rc, out.getvalue(), err.getvalue())


def run_cli_subprocess(argv: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> Result:
    e = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "JAX_PLATFORMS": "cpu",
         **(env or {})}
    try:
        r = subprocess.run([sys.executable, "-m", "eqjax.cli", *argv], capture_output=True, text=True, cwd=str(ROOT),
                           env=e, timeout=timeout)
    except subprocess.TimeoutExpired as t:
        return Result(None, str(t.stdout or ""), f"timeout after {timeout} s")
    return Result(r.returncode, r.stdout, r.stderr)


def run_case(case: Case, fx: Fixtures, work: pathlib.Path, *, subprocess_cli: bool = False) -> tuple[str, str, float]:
    """Run ``case``; returns ``(outcome, detail, seconds)``."""
    t0 = time.perf_counter()
    try:
        return _run_case(case, fx, work, subprocess_cli=subprocess_cli, t0=t0)
    except Exception as e:  # noqa: BLE001 - a broken case (setup/check) is reported, not fatal
        import traceback

        return "traceback", "case machinery failed: " + "".join(traceback.format_exception(e))[-400:], time.perf_counter() - t0


def _run_case(case: Case, fx: Fixtures, work: pathlib.Path, *, subprocess_cli: bool, t0: float) -> tuple[str, str, float]:
    work.mkdir(parents=True, exist_ok=True)
    values = fx.values()
    if case.setup is not None:
        values.update(case.setup(fx, work))
    if case.kill is not None:
        try:
            failure = case.kill(fx, work, values)
        except Exception as e:  # noqa: BLE001
            import traceback

            return "traceback", "".join(traceback.format_exception(e))[-400:], time.perf_counter() - t0
        dt = time.perf_counter() - t0
        if failure is None:
            return "correct", "previous artifact intact; partial output detectable; resumable", dt
        return ("loss" if failure.startswith("loss") else "silent"), failure, dt
    if case.api is not None:
        from eqjax.core.errors import classify as error_kind
        from eqjax.core.errors import exit_code

        res = Result(0)
        try:
            res.value = case.api(fx, work, values)
        except BaseException as e:  # noqa: BLE001
            res.exc = e
            res.rc = exit_code(e)
            res.err = f"eqjax: error: {e}" if error_kind(e) != "internal" else f"Traceback: {type(e).__name__}: {e}"
    else:
        argv = _fmt(case.argv or [], values)
        res = run_cli_subprocess(argv, case.env) if subprocess_cli else run_cli_inprocess(argv, case.env)
    outcome, detail = classify(case, fx, work, values, res)
    return outcome, detail, time.perf_counter() - t0


def classify(case: Case, fx: Fixtures, work: pathlib.Path, values: dict[str, str], res: Result) -> tuple[str, str]:
    err_lines = [x for x in res.err.strip().splitlines() if x.strip()]
    last = err_lines[-1].strip() if err_lines else ""
    last = last.split("\r")[-1]  # progress bars rewrite their line with \r
    if res.rc is None:
        return "traceback", "timed out"
    if res.rc < 0:
        return "crash", f"killed by signal {-res.rc}"
    if "Traceback" in res.err or "internal error" in res.err:
        return "traceback", last[:300]
    if case.check is not None:
        problem = case.check(fx, work, values, res)
        if problem and problem.startswith("loss"):
            return "loss", problem
    else:
        problem = None
    if case.expect == "error":
        if res.rc == 0:
            return "silent", "exit 0 where an error was due"
        if res.rc != case.code:
            return "traceback", f"exit {res.rc}, expected {case.code}: {last[:200]}"
        if not last.startswith("eqjax: error:"):
            return "traceback", f"last line is not an 'eqjax: error:' line: {last[:200]}"
        if case.cause and not re.search(case.cause, last):
            return "traceback", f"the message does not name the cause ({case.cause!r}): {last[:200]}"
        if problem:
            return "silent", problem
        return "clear error", last[len("eqjax: error: "):][:300]
    if res.rc != 0:
        return "traceback", f"exit {res.rc} where success was due: {last[:200]}"
    if problem:
        return "silent", problem
    return "correct", "ok"
