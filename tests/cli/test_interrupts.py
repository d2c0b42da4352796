"""A Ctrl-C / SIGTERM raised where Python drops exceptions (a gc callback, a finalizer) still stops the command."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

_CHILD = textwrap.dedent("""
    import contextlib, gc, os, signal, sys, time
    from eqjax.cli.interrupts import interrupts_stop_the_command

    signum = getattr(signal, sys.argv[1])
    # Python's own Ctrl-C handler, as in a terminal (a test runner's worker may have started this process
    # with SIGINT ignored, and then Python installs none)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    where = sys.argv[2]
    guard = interrupts_stop_the_command() if sys.argv[3] == "guarded" else contextlib.nullcontext()
    sent = []

    def send():  # the handler runs inside raise_signal, i.e. inside the ignoring context
        if not sent:
            sent.append(1)
            signal.raise_signal(signum)

    def on_gc(phase, info):
        if phase == "start":
            send()

    class Finalized:
        def __del__(self):
            send()

    if signum == signal.SIGTERM and sys.argv[3] != "guarded":
        signal.signal(signal.SIGTERM, lambda s, f: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        with guard:
            if where == "gc":
                gc.callbacks.append(on_gc)
                gc.collect()
                gc.callbacks.remove(on_gc)
            else:
                Finalized()  # dropped at once: __del__ runs here
            assert sent
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                time.sleep(0.005)
        print("ran on")
    except KeyboardInterrupt:
        print("stopped")
""")


def _child(signame: str, where: str, mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _CHILD, signame, where, mode], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("where", ["gc", "finalizer"])
@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_dropped_interrupt_is_delivered_again(signame: str, where: str) -> None:
    # The control shows the interrupt really is dropped there: without the guard the process runs on.
    control = _child(signame, where, "bare")
    assert control.stdout.strip() == "ran on", control.stderr
    assert "KeyboardInterrupt" in control.stderr  # Python's "Exception ignored in ..." report
    guarded = _child(signame, where, "guarded")
    assert guarded.stdout.strip() == "stopped", guarded.stderr
    assert "Exception ignored" not in guarded.stderr
