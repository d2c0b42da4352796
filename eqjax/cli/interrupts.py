"""Ctrl-C and SIGTERM that always stop the command.

Python runs a signal handler at the next bytecode boundary of the main thread, wherever that is. When it
lands inside code whose exceptions Python ignores (a garbage-collector callback such as jax's
``_xla_gc_callback``, a ``__del__`` method, a weakref callback), the handler's ``KeyboardInterrupt`` is
reported through :data:`sys.unraisablehook` and dropped, and the command runs on as if the signal never
came. :func:`interrupts_stop_the_command` installs handlers that remember which signal they turned into
``KeyboardInterrupt`` and an unraisable hook that, on seeing that interrupt dropped, sends the same signal
again from a helper thread a moment later, when the main thread is back in ordinary code.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any, Iterator

REDELIVERY_DELAY_S = 0.05
"""Seconds between a dropped interrupt and its second delivery: long enough for the ignoring context (one
collection's callbacks, a finalizer) to end, short against a user's patience."""

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def interrupts_stop_the_command() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM raise ``KeyboardInterrupt`` in the main thread and one that
    Python drops (raised inside a gc callback or a finalizer) is raised again. Outside the main thread
    the block changes nothing (signal handlers can only be set there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised: list[int] = []  # signals whose KeyboardInterrupt is in flight, oldest first

    def handler(signum: int, frame: Any) -> None:
        raised.append(signum)
        raise KeyboardInterrupt

    previous_hook = sys.unraisablehook
    timers: list[threading.Timer] = []

    def hook(unraisable: Any) -> None:
        if not issubclass(unraisable.exc_type, KeyboardInterrupt):
            previous_hook(unraisable)
            return
        signum = raised[-1] if raised else signal.SIGINT  # a held second Ctrl-C (io.atomic) comes here bare
        timer = threading.Timer(REDELIVERY_DELAY_S, os.kill, (os.getpid(), signum))
        timer.daemon = True
        timers.append(timer)
        timer.start()

    old = {s: signal.signal(s, handler) for s in _SIGNALS}
    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous_hook
        pending = [t for t in timers if t.is_alive()]
        for t in pending:
            t.cancel()
        for s, h in old.items():
            signal.signal(s, h)
    if pending:  # the block ended before a dropped interrupt came back: it still stops the command
        raise KeyboardInterrupt
