"""Joining a multi-process job, and what processes do together: barriers, broadcasts, who writes.

:func:`init_distributed` runs ``jax.distributed.initialize`` (gloo collectives on CPU) with the
failure timeouts derived from one ``timeout_s`` and starts the heartbeat :class:`Watchdog`, so a
dead peer or a lost coordinator ends every survivor within about ``timeout_s`` seconds with an
eqjax error. With no coordinator configured it does nothing: one process, the same code.

Arguments come from the CLI flags :func:`add_distributed_args` adds, else the environment
(``EQJAX_COORDINATOR`` / ``EQJAX_NUM_PROCESSES`` / ``EQJAX_PROCESS_ID`` / ``EQJAX_DIST_TIMEOUT``, or
JAX's ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``).

Writes: only process 0 writes reports (:func:`is_main_process`, :func:`write_once`); checkpoints
are written by every process together (:mod:`eqjax.io.orbax`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pathlib
import time
from typing import Any, Callable, Sequence

import jax

from eqjax.core.errors import InputError, RuntimeFailure
from eqjax.distributed.watchdog import Watchdog

__all__ = [
    "DistributedError", "DistributedInfo", "init_distributed", "add_distributed_args", "init_from_args",
    "finish", "shutdown_distributed", "is_main_process", "process_count", "write_once", "barrier", "broadcast_str",
    "kv_client", "set_stage", "collective_failure", "DEFAULT_TIMEOUT_S", "check_distributed_args", "is_multi_process",
]

log = logging.getLogger("eqjax")

DEFAULT_TIMEOUT_S = 30


class DistributedError(RuntimeFailure):
    """Multi-process setup or execution failed (unreachable coordinator, a peer died or timed out)."""


@dataclasses.dataclass(frozen=True)
class DistributedInfo:
    """This process's place: ``process_id`` of ``num_processes``; ``initialized`` is False single-process."""

    process_id: int
    num_processes: int
    local_device_count: int
    device_count: int
    initialized: bool


@dataclasses.dataclass
class _State:
    coordinator: str = ""
    timeout_s: float = DEFAULT_TIMEOUT_S
    watchdog: Any = None
    counter: int = 0


_STATE = _State()

_ENV = {
    "coordinator": ("EQJAX_COORDINATOR", "JAX_COORDINATOR_ADDRESS"),
    "num_processes": ("EQJAX_NUM_PROCESSES", "JAX_NUM_PROCESSES"),
    "process_id": ("EQJAX_PROCESS_ID", "JAX_PROCESS_ID"),
    "timeout": ("EQJAX_DIST_TIMEOUT",),
}


def _env(key: str) -> str | None:
    for var in _ENV[key]:
        v = os.environ.get(var)
        if v not in (None, ""):
            return v
    return None


def _int_env(key: str) -> int | None:
    v = _env(key)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise DistributedError(f"{'/'.join(_ENV[key])} must be an integer, got {v!r}") from None


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge._backends)
    except Exception:  # pragma: no cover - internals moved
        return False


def kv_client() -> Any:
    """The JAX distributed runtime client (key-value store, barriers), or None single-process."""
    try:
        from jax._src import distributed as jd

        return jd.global_state.client
    except Exception:  # pragma: no cover - internals moved
        return None


def init_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: Sequence[int] | None = None,
    cpu_collectives: str = "gloo",
    timeout_s: int | None = None,
    initialization_timeout: int | None = None,
    watchdog: bool = True,
) -> DistributedInfo:
    """Join a multi-process JAX job or stay single-process (see the module docs); before any JAX work.

    ``timeout_s`` (default ``EQJAX_DIST_TIMEOUT`` or 30): the watchdog's limit for a silent peer, and
    the base of JAX's own timeouts (heartbeat ``2 * timeout_s + 10``, shutdown barrier, connecting
    to the coordinator ``max(timeout_s, 10)``).
    """
    coordinator_address = coordinator_address or _env("coordinator")
    num_processes = num_processes if num_processes is not None else _int_env("num_processes")
    process_id = process_id if process_id is not None else _int_env("process_id")
    if coordinator_address is None and num_processes in (None, 1) and process_id in (None, 0):
        return DistributedInfo(0, 1, jax.local_device_count(), jax.device_count(), False)
    missing = [k for k, v in (("coordinator address", coordinator_address), ("number of processes",
               num_processes), ("process id", process_id)) if v is None]
    if missing:
        raise DistributedError(
            "multi-process run needs " + ", ".join(missing) + " (arguments, --coordinator/--num-processes/"
            "--process-id, or EQJAX_COORDINATOR/EQJAX_NUM_PROCESSES/EQJAX_PROCESS_ID)"
        )
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise DistributedError(f"need 0 <= process_id < num_processes, got {process_id} of {num_processes}")
    if ":" not in coordinator_address:
        raise DistributedError(f"coordinator address must be host:port, got {coordinator_address!r}")
    if jax.distributed.is_initialized():
        raise DistributedError("jax.distributed is already initialized in this process")
    if _backend_started():
        raise DistributedError("init_distributed must run before any JAX computation (the backend is already up)")
    if timeout_s is None:
        timeout_s = _int_env("timeout") or DEFAULT_TIMEOUT_S
    if cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    backstop = 2 * int(timeout_s) + 10  # JAX's own detection: after the watchdog's
    kw: dict[str, Any] = dict(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        heartbeat_timeout_seconds=backstop,
        shutdown_timeout_seconds=backstop,
        initialization_timeout=int(initialization_timeout or max(timeout_s, 10)),
    )
    if local_device_ids is not None:
        kw["local_device_ids"] = list(local_device_ids)
    try:
        jax.distributed.initialize(**kw)
    except Exception as e:  # noqa: BLE001 - surface every failure with context
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise DistributedError(
            f"process {process_id} of {num_processes} cannot join the job at {coordinator_address} within "
            f"{kw['initialization_timeout']} s (is process 0 running there, with the same --num-processes?): {first}"
        ) from None
    _STATE.coordinator, _STATE.timeout_s, _STATE.counter = coordinator_address, float(timeout_s), 0
    if watchdog and num_processes > 1:

        _STATE.watchdog = Watchdog(kv_client(), process_id, num_processes, timeout_s=timeout_s,
                                   coordinator=coordinator_address).start()
    info = DistributedInfo(jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count(), True)
    log.info("distributed: process %d of %d, %d local / %d global devices", *dataclasses.astuple(info)[:4])
    return info


def add_distributed_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--coordinator``, ``--num-processes``, ``--process-id``, ``--dist-timeout``, ``--model-parallel``."""
    g = parser.add_argument_group("multi-process / multi-device (jax.distributed)")
    g.add_argument("--coordinator", default=None, help="host:port of process 0 (env EQJAX_COORDINATOR)")
    g.add_argument("--num-processes", type=int, default=None, help="number of processes (env EQJAX_NUM_PROCESSES)")
    g.add_argument("--process-id", type=int, default=None, help="this process's id (env EQJAX_PROCESS_ID)")
    g.add_argument("--dist-timeout", type=int, default=None,
                   help=f"seconds before a silent peer fails the job (default {DEFAULT_TIMEOUT_S})")
    g.add_argument("--model-parallel", type=int, default=1, metavar="M",
                   help="shard weights M ways along the mesh's 'model' axis (default 1: data-parallel only)")
    return parser


def check_distributed_args(args: argparse.Namespace) -> None:
    """Bad multi-process flags (or EQJAX_*/JAX_* variables) are input errors, before jax.distributed starts."""
    if not hasattr(args, "num_processes"):
        return

    def env(*names: str) -> str | None:
        for n in names:
            v = os.environ.get(n)
            if v not in (None, ""):
                return v
        return None

    def as_int(value: Any, flag: str, names: tuple[str, ...]) -> int | None:
        if value is not None:
            return value
        raw = env(*names)
        if raw is None:
            return None
        try:
            return int(raw)
        except ValueError:
            raise InputError(f"bad {flag} ({'/'.join(names)}): expected an integer, found {raw!r}") from None

    coord = args.coordinator if args.coordinator is not None else env("EQJAX_COORDINATOR", "JAX_COORDINATOR_ADDRESS")
    n = as_int(args.num_processes, "--num-processes", ("EQJAX_NUM_PROCESSES", "JAX_NUM_PROCESSES"))
    pid = as_int(args.process_id, "--process-id", ("EQJAX_PROCESS_ID", "JAX_PROCESS_ID"))
    timeout = as_int(getattr(args, "dist_timeout", None), "--dist-timeout", ("EQJAX_DIST_TIMEOUT",))
    if timeout is not None and timeout < 1:
        raise InputError(f"bad distributed timeout (--dist-timeout): expected seconds >= 1, found {timeout}")
    mp = getattr(args, "model_parallel", 1)
    if mp is not None and mp < 1:
        raise InputError(f"bad model-parallel size (--model-parallel): expected an integer >= 1, found {mp}")
    if n is not None and n < 1:
        raise InputError(f"bad number of processes (--num-processes): expected an integer >= 1, found {n}")
    if pid is not None and pid < 0:
        raise InputError(f"bad process id (--process-id): expected an integer >= 0, found {pid}")
    if coord is None and n in (None, 1) and pid in (None, 0):
        return  # single process
    if n is not None and pid is not None and pid >= n:
        raise InputError(f"process id out of range (--process-id vs --num-processes {n}): expected 0..{n - 1}, found {pid}")
    missing = [f for f, v in (("--coordinator", coord), ("--num-processes", n), ("--process-id", pid)) if v is None]
    if missing:
        raise InputError(
            f"incomplete multi-process flags ({', '.join(missing)}): expected --coordinator, --num-processes and "
            "--process-id together (or EQJAX_COORDINATOR/EQJAX_NUM_PROCESSES/EQJAX_PROCESS_ID), found them missing"
        )
    host, sep, port = str(coord).rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise InputError(f"malformed coordinator address (--coordinator): expected host:port with port 1..65535, found {coord!r}")


def is_multi_process(args: argparse.Namespace) -> bool:
    """Multi-process flags or variables are given (already checked by :func:`check_distributed_args`)."""
    if not hasattr(args, "num_processes"):
        return False
    env = os.environ.get
    coord = args.coordinator or env("EQJAX_COORDINATOR") or env("JAX_COORDINATOR_ADDRESS")
    n = args.num_processes if args.num_processes is not None else (env("EQJAX_NUM_PROCESSES") or env("JAX_NUM_PROCESSES"))
    return bool(coord) or (n not in (None, "") and int(n) > 1)


def init_from_args(args: argparse.Namespace) -> DistributedInfo:
    """:func:`init_distributed` from the flags :func:`add_distributed_args` added."""
    return init_distributed(
        getattr(args, "coordinator", None),
        getattr(args, "num_processes", None),
        getattr(args, "process_id", None),
        timeout_s=getattr(args, "dist_timeout", None),
    )


def set_stage(stage: str) -> None:
    """Name what this process is doing (quoted by the watchdog if the job fails)."""
    if _STATE.watchdog is not None:
        _STATE.watchdog.stage = stage


def _next_id(name: str) -> str:
    _STATE.counter += 1
    return f"eqjax/{name}/{_STATE.counter}"


def process_count() -> int:
    return jax.process_count()


def barrier(name: str, timeout_s: float | None = None) -> None:
    """Block until every process reaches this barrier (no-op single-process); a process that does not
    arrive within ``timeout_s`` (default: 20 x the job's timeout, since a live peer may be busy, e.g.
    process 0 writing reports; dead peers are caught sooner by the watchdog) is a
    :class:`DistributedError`."""
    if jax.process_count() == 1:
        return
    client = kv_client()
    t = 20 * _STATE.timeout_s if timeout_s is None else timeout_s
    bid = _next_id("barrier/" + name)
    try:
        client.wait_at_barrier(bid, int(t * 1000))
    except Exception as e:  # noqa: BLE001 - DEADLINE_EXCEEDED / UNAVAILABLE from the coordination service
        first = str(e).strip().splitlines()[0][:200]
        raise DistributedError(f"process {jax.process_index()} of {jax.process_count()}: not every process reached "
                               f"'{name}' within {t:g} s: {first}") from None


def broadcast_str(name: str, value: str | None) -> str:
    """Process 0's ``value`` on every process (through the coordinator's key-value store)."""
    if jax.process_count() == 1:
        assert value is not None
        return value
    client = kv_client()
    key = _next_id("bcast/" + name)
    if jax.process_index() == 0:
        client.key_value_set(key, value)
        return value  # type: ignore[return-value]
    try:
        return client.blocking_key_value_get(key, int(_STATE.timeout_s * 1000))
    except Exception as e:  # noqa: BLE001
        raise DistributedError(f"process {jax.process_index()}: process 0 did not publish '{name}' within "
                               f"{_STATE.timeout_s:g} s: {str(e).splitlines()[0][:160]}") from None


def is_main_process() -> bool:
    """True on process 0 (the one that writes reports)."""
    return jax.process_index() == 0


def write_once(path: str | os.PathLike, write: Callable[[pathlib.Path], Any], *, sync: bool = True) -> Any:
    """``write(pathlib.Path(path))`` on process 0 only; with ``sync`` every process waits until it is done."""
    path = pathlib.Path(path)
    result = write(path) if is_main_process() else None
    if sync:
        barrier(f"write_once:{path}")
    return result


def finish() -> None:
    """End a multi-process job cleanly: wait for every process, stop the watchdog, shut JAX down."""
    if not jax.distributed.is_initialized():
        return
    wd = _STATE.watchdog
    if wd is not None:
        wd.stage = "finishing"
        wd.mark_done()
    try:
        barrier("finish")
    finally:
        if wd is not None:
            wd.stop()
            _STATE.watchdog = None
    shutdown_distributed()


def shutdown_distributed() -> None:
    """``jax.distributed.shutdown()`` if initialized (a no-op otherwise)."""
    if _STATE.watchdog is not None:
        _STATE.watchdog.stop()
        _STATE.watchdog = None
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()


def collective_failure(exc: BaseException) -> str | None:
    """One line for an error a collective raised in a multi-process job, after the watchdog's verdict.

    When a peer dies mid-collective, the survivors' transport fails at once (gloo: ``Connection reset
    by peer``), before the heartbeat timeout has named the dead process. This waits up to the
    watchdog's timeout so that it can end the process with its own line naming the peer; if every
    peer is still alive, the failure is the transport's: described here. ``None`` when ``exc`` is not
    a JAX runtime error or no watchdog runs (single process).
    """
    wd = _STATE.watchdog
    if wd is None or not isinstance(exc, jax.errors.JaxRuntimeError):
        return None
    wd.stage = f"{wd.stage}, then a collective failed"
    time.sleep(wd.timeout + 3 * wd.interval)  # the watchdog thread ends the process if a peer is dead
    first = " ".join(str(exc).split())[:300]
    return (f"process {jax.process_index()} of {jax.process_count()}: a collective with the other processes failed "
            f"while every peer kept its heartbeat (network or transport problem): {first}")
