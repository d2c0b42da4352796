"""Orbax's background noise kept off the terminal: its threads' logging during a save, and the failures of
writes still in flight after a save failed or was interrupted (they surface when the process exits)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from typing import Iterator

__all__ = ["orbax_quiet", "quiet_leftovers"]


@contextlib.contextmanager
def orbax_quiet() -> Iterator[None]:
    """Keep Orbax's background-thread logging (absl) and uncaught thread tracebacks off the terminal."""
    quiet = lambda record: False  # noqa: E731 - a logging filter that drops every record
    loggers = [logging.getLogger(n) for n in ("absl", "orbax", "asyncio")]
    for lg in loggers:
        lg.addFilter(quiet)
    hooks = threading.excepthook, sys.excepthook, sys.unraisablehook
    threading.excepthook = sys.excepthook = sys.unraisablehook = lambda *a: None
    try:
        yield
    finally:
        threading.excepthook, sys.excepthook, sys.unraisablehook = hooks
        for lg in loggers:
            lg.removeFilter(quiet)


def _from_orbax(exc: BaseException | None) -> bool:
    """``exc`` is an aborted Orbax write's leftover: raised in Orbax's code, or a callback on its closed loop."""
    tb = getattr(exc, "__traceback__", None)
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
        return True
    while tb is not None:
        if f"{os.sep}orbax{os.sep}" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def quiet_leftovers() -> None:
    """After a failed or interrupted save, Orbax's and tensorstore's writes still in flight fail later (when
    the process exits): keep their logging and tracebacks off the terminal from now on (installed once)."""
    if _LEFTOVERS_QUIET:
        return
    _LEFTOVERS_QUIET.append(True)
    for name in ("absl", "asyncio"):
        logging.getLogger(name).addFilter(
            lambda r: not (f"{os.sep}orbax{os.sep}" in r.pathname or _from_orbax((r.exc_info or (None, None))[1])
                           or "Task exception was never retrieved" in str(r.msg)))
    hook, thook, uhook = sys.excepthook, threading.excepthook, sys.unraisablehook
    sys.excepthook = lambda t, v, tb: None if _from_orbax(v) else hook(t, v, tb)
    threading.excepthook = lambda a: None if _from_orbax(a.exc_value) else thook(a)
    sys.unraisablehook = lambda u: None if _from_orbax(u.exc_value) else uhook(u)


_LEFTOVERS_QUIET: list[bool] = []
