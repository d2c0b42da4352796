"""A heartbeat watchdog: a dead peer ends every survivor with an eqjax error, never a hang.

JAX's own failure detection (the coordination service's heartbeat) aborts the survivors from C++
(``SIGABRT``, a stack trace, exit status 134) once ``heartbeat_timeout_seconds`` pass. The watchdog
runs first: a daemon thread in each process bumps its own counter in the coordination service's
key-value store every ``interval`` seconds and reads its peers' counters; when a peer's counter has
not moved for ``timeout`` seconds (the peer died, was killed, or hangs), the thread prints one line
``eqjax: error: process N of M stopped responding ...`` and ends the process with exit status 1
(``os._exit``: a thread cannot stop a main thread blocked inside a collective). Every output eqjax
writes is atomic (temporary file, then rename), so nothing half-written is left behind; an
interrupted checkpoint save leaves only its ``.tmp-`` directory.

A process that has finished (:meth:`Watchdog.mark_done`) is not counted as dead while the others
finish. If the key-value store itself is gone (the coordinator, process 0, died) the thread reports
that instead; usually JAX's C++ side notices first, which the CLI's supervisor
(:mod:`eqjax.distributed.supervise`) turns into the same kind of one-line error.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

__all__ = ["Watchdog"]


class Watchdog:
    """Heartbeats of ``num_processes`` processes through ``client`` (a JAX distributed client)."""

    def __init__(self, client: Any, process_id: int, num_processes: int, *, timeout_s: float,
                 interval_s: float | None = None, coordinator: str = "", exit_code: int = 1):
        self.client, self.pid, self.n = client, process_id, num_processes
        self.timeout = float(timeout_s)
        self.interval = float(interval_s if interval_s is not None else max(0.2, min(1.0, self.timeout / 10)))
        self.coordinator = coordinator
        self.exit_code = exit_code
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="eqjax-watchdog", daemon=True)
        self.stage = "starting"

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def mark_done(self) -> None:
        """This process has finished its work: peers stop expecting its heartbeat."""
        try:
            self.client.key_value_set(f"eqjax/done/{self.pid}", "1", allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the coordinator may be gone already; the watchdog reports it
            pass

    def _fail(self, message: str) -> None:
        sys.stdout.flush()
        sys.stderr.write(f"eqjax: error: {message}\n")
        sys.stderr.flush()
        os._exit(self.exit_code)

    def _try_get(self, key: str) -> str | None:
        try:
            return self.client.key_value_try_get(key)
        except Exception:  # noqa: BLE001 - NOT_FOUND: not written yet
            return None

    def _run(self) -> None:
        start = time.monotonic()
        seen: dict[int, tuple[str | None, float]] = {}
        failures = 0
        while not self._stop.is_set():
            try:
                self.client.key_value_increment(f"eqjax/hb/{self.pid}", 1)
                failures = 0
            except Exception as e:  # noqa: BLE001 - the store is on the coordinator
                failures += 1
                if failures * self.interval >= min(self.timeout, 5.0) and not self._stop.is_set():
                    self._fail(f"process {self.pid} of {self.n} lost the coordinator (process 0 at "
                               f"{self.coordinator or '?'}): {str(e).splitlines()[0][:160]} (while {self.stage})")
                time.sleep(self.interval)
                continue
            now = time.monotonic()
            for p in range(self.n):
                if p == self.pid or self._try_get(f"eqjax/done/{p}") is not None:
                    continue
                v = self._try_get(f"eqjax/hb/{p}")
                last = seen.get(p)
                if last is None or last[0] != v:
                    seen[p] = (v, now if last is not None or v is not None else start)
                elif now - last[1] > self.timeout and not self._stop.is_set():
                    what = "never sent a heartbeat" if v is None else "stopped responding"
                    self._fail(f"process {p} of {self.n} {what} for {now - last[1]:.0f} s (died, killed or hung; "
                               f"--dist-timeout {self.timeout:g}); process {self.pid} stops too (while {self.stage})")
            self._stop.wait(self.interval)
