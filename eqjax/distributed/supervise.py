"""The CLI's supervisor for multi-process runs: a JAX abort becomes one eqjax error line.

When the coordinator (process 0) dies, JAX's C++ runtime in every other process ends it at once
with ``SIGABRT``, a ``Check failure stack trace`` and exit status 134; no Python code runs. So a
multi-process ``eqjax`` command runs its work in a child process (the same command, marked with
``EQJAX_SUPERVISED=1``) and watches it: the child's stderr passes through except the runtime's log
and stack-trace lines (all of them with ``--debug``), and when the child dies abnormally the
supervisor prints ``eqjax: error: process N of M: ...`` naming the lost process (parsed from the
runtime's last fatal message) and exits with status 1. Exit statuses the child chose itself (0, 1,
2, 130) pass through unchanged. SIGINT / SIGTERM are forwarded; the child is killed if the
supervisor dies (Linux ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from typing import Sequence

__all__ = ["SUPERVISED_ENV", "supervise", "explain_abort", "is_runtime_noise"]

SUPERVISED_ENV = "EQJAX_SUPERVISED"

_NOISE = (
    re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+:\d+\]"),  # glog lines of the C++ runtime
    re.compile(r"^\s+@\s+0x[0-9a-f]+"),  # stack frames
    re.compile(r"^\*\*\* (Check failure stack trace|SIGABRT|Aborted)"),
    re.compile(r"^\[Gloo\] "),
    re.compile(r"^(terminate called|  what\(\):)"),
    re.compile(r"^(Additional GRPC error|:UNKNOWN:Error received|RPC: /xla\.|The tasks have crashed|\d+$)"),
)


def is_runtime_noise(line: str) -> bool:
    return any(rx.match(line) for rx in _NOISE)


def explain_abort(log: str, coordinator: str = "") -> str:
    """What the JAX runtime's last messages say happened (one clause naming the process)."""
    m = re.search(r"following tasks are unhealthy \(stopped sending heartbeats\):\s*\n?((?:\s*\d+\s*\n?)+)", log)
    if m:
        ids = ", ".join(m.group(1).split())
        return f"process {ids} stopped sending heartbeats (died, killed or hung)"
    if "RegisterTask" in log:
        return (f"could not join the job: the coordinator (process 0 at {coordinator or '?'}) did not answer "
                "(is process 0 running, and is that address reachable from this host?)")
    if re.search(r"leader task was preempted/died|Failed to send RPC to coordination service|"
                 r"coordination service .*(unavailable|Socket closed)", log, re.S | re.I):
        return f"lost the coordinator (process 0 at {coordinator or '?'}): it died or is unreachable"
    m = re.search(r"/task:(\d+)", log)
    if m and "another task died" in log:
        return f"process {m.group(1)} died"
    fatal = [ln for ln in log.splitlines() if ln.startswith("F")]
    if fatal:
        return "the JAX runtime stopped: " + fatal[-1].split("] ", 1)[-1][:240]
    return "the process ended abnormally"


def _pdeathsig() -> None:  # pragma: no cover - runs in the child before exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the child may outlive a killed supervisor
        pass


def supervise(argv: Sequence[str], *, process_id: int | None, num_processes: int | None, coordinator: str | None,
              debug: bool = False) -> int:
    """Run ``python -m eqjax.cli *argv`` as a supervised child; returns the exit status to use."""
    env = dict(os.environ, **{SUPERVISED_ENV: "1", "PYTHONUNBUFFERED": "1"})
    cmd = [sys.executable, "-m", "eqjax.cli", *argv]
    child = subprocess.Popen(cmd, stderr=subprocess.PIPE, env=env, text=True, errors="replace",
                             preexec_fn=_pdeathsig if sys.platform.startswith("linux") else None)

    def forward(signum: int, frame: object) -> None:
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    tail: list[str] = []
    try:
        assert child.stderr is not None
        for line in child.stderr:
            tail.append(line)
            del tail[:-200]
            if debug or not is_runtime_noise(line):
                sys.stderr.write(line)
                sys.stderr.flush()
        rc = child.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if rc in (0, 1, 2, 130):
        return rc
    who = f"process {process_id if process_id is not None else '?'} of {num_processes or '?'}"
    how = f"killed by {signal.Signals(-rc).name}" if rc < 0 and -rc in signal.Signals._value2member_map_ else f"exit status {rc}"
    why = explain_abort("".join(tail), coordinator or "")
    sys.stderr.write(f"eqjax: error: {who} stopped ({how}): {why}; nothing half-written was left (outputs are "
                     "written atomically; an interrupted checkpoint leaves only its .tmp- directory)\n")
    return 1
