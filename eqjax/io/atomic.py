"""Atomic, checked outputs: a target is either its previous version or the complete new one, never half.

Files: the data goes to a temporary sibling ``.<name>.tmp-<pid>-<random>`` in the target's directory,
is flushed and ``fsync``-ed, then ``os.replace``-d over the target and the directory is ``fsync``-ed.
A process killed mid-write leaves the previous target untouched and at most a temporary file whose
name says what it was (:func:`stale_temps`; removed by the next write to the same target once its
process is gone).

Directories (checkpoints): written into a temporary sibling directory, every file ``fsync``-ed, then
renamed onto the target (an existing target, with ``overwrite``, is first moved aside and deleted
after the swap). Only a directory eqjax wrote is ever replaced: one holding the ``.eqjax-artifact``
marker (:func:`write_marker`) or an eqjax manifest (a checkpoint's ``eqjax.json``, an ONNX package's
``eqjax_export.json``), or one whose every entry the new directory replaces by name. An output
directory that is, holds or lies inside an input (``inputs=``) is refused, and so is a symbolic link
where a directory is to be replaced.

Locks: :func:`output_lock` holds ``fcntl.flock`` on a sibling ``.<name>.eqjax-lock`` for as long as an
output is written, so a second eqjax process writing the same output is refused at once (the kernel
drops the lock when its holder dies, so a killed process never blocks the next one).

Sets of files: :func:`atomic_files` writes every file of a set to temporaries first and renames them
into place only once all are written, so a failed write (a full disk) leaves the previous set whole.

Pre-flight: :func:`check_output_file` / :func:`check_output_dir` raise :class:`~eqjax.core.errors.OutputError`
*before* any work when a target exists (without ``overwrite``) or cannot be written (its nearest
existing ancestor is not a writable directory: tested by creating a file there, so it also holds for
root and read-only mounts).

Row logs: :class:`JsonLines` appends one JSON object per line and ``fsync``-s it, so a killed run
keeps every finished row; a torn last line (killed mid-append) is dropped on reading.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import pathlib
import secrets
import shutil
import signal
import threading
from typing import IO, Any, Iterable, Iterator

from eqjax.core.errors import NonFiniteResult, OutputError

__all__ = [
    "check_output_file", "check_output_dir", "atomic_file", "atomic_path", "atomic_directory",
    "write_bytes", "write_text", "write_json", "write_report", "dumps_json", "stale_temps", "JsonLines", "fsync_tree",
    "MARKER", "write_marker", "artifact_kind", "check_not_input", "output_lock", "atomic_files", "deferred_interrupts",
]

_TMP = ".tmp-"


def _temp_sibling(path: pathlib.Path, suffix: str = "") -> pathlib.Path:
    return path.parent / f".{path.name}{_TMP}{os.getpid()}-{secrets.token_hex(4)}{suffix}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_temps(path: str | os.PathLike[str]) -> list[pathlib.Path]:
    """Leftover temporaries of ``path`` (``.<name>.tmp-<pid>-*``) whose writer process is gone."""
    p = pathlib.Path(path)
    out = []
    if not p.parent.is_dir():
        return out
    prefix = f".{p.name}{_TMP}"
    for q in p.parent.iterdir():
        if q.name.startswith(prefix):
            pid = q.name[len(prefix):].split("-", 1)[0]
            if pid.isdigit() and not _pid_alive(int(pid)):
                out.append(q)
    return sorted(out)


def _remove(p: pathlib.Path) -> None:
    try:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    except OSError:
        pass


def _clean_stale(path: pathlib.Path) -> None:
    for q in stale_temps(path):
        _remove(q)


def _fsync_dir(d: pathlib.Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike[str]) -> None:
    """``fsync`` every file and directory under ``root`` (bottom-up)."""
    root = pathlib.Path(root)
    for d, _dirs, files in os.walk(root, topdown=False):
        for f in files:
            fp = os.path.join(d, f)
            if os.path.islink(fp):
                continue
            try:
                fd = os.open(fp, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(pathlib.Path(d))


# ------------------------------------------------------------------------------------ pre-flight
def _nearest_existing(p: pathlib.Path) -> pathlib.Path:
    q = p
    while not q.exists():
        if q.parent == q:
            break
        q = q.parent
    return q


def _probe_writable(d: pathlib.Path, target: pathlib.Path, what: str) -> None:
    """Create and delete a file in the existing directory ``d``; OutputError naming ``target`` if that fails."""
    if not d.is_dir():
        raise OutputError(f"cannot write the {what} ({target}): expected a directory at {d}, found a file")
    probe = d / f".eqjax-write-probe{_TMP}{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OutputError(
            f"cannot write the {what} ({target}): expected a writable directory {d}, found {e.strerror or e}"
        ) from None


def check_output_file(path: str | os.PathLike[str], *, overwrite: bool = False, what: str = "output file") -> pathlib.Path:
    """Check, before any work, that ``path`` can be written: OutputError naming it otherwise.

    It must not be a directory; it must not exist unless ``overwrite``; its nearest existing ancestor
    must be a writable directory (missing parents are created at write time).
    """
    p = pathlib.Path(path).expanduser()
    if str(path) in ("", "."):
        raise OutputError(f"empty {what} path: expected a file name, found {str(path)!r}")
    if p.is_dir():
        raise OutputError(f"cannot write the {what} ({p}): expected a file path, found a directory")
    if p.exists() or p.is_symlink():
        if not overwrite:
            raise OutputError(f"{what} exists ({p}): expected a new path, found an existing file (pass --overwrite to replace it)")
        _probe_writable(p.parent, p, what)
        return p
    _probe_writable(_nearest_existing(p.parent), p, what)
    return p


MARKER = ".eqjax-artifact"
_LEGACY_PROOFS = (("eqjax.json", "checkpoint"), ("eqjax_export.json", "onnx-package"))


def write_marker(directory: str | os.PathLike[str], kind: str) -> pathlib.Path:
    """Mark ``directory`` as an eqjax artifact of ``kind`` (so that ``--overwrite`` may replace it)."""
    return write_text(pathlib.Path(directory) / MARKER, json.dumps({"eqjax_artifact": kind}) + "\n")


def artifact_kind(directory: str | os.PathLike[str]) -> str | None:
    """The kind of eqjax artifact ``directory`` is (from its marker or manifest), None if eqjax did not write it."""
    d = pathlib.Path(directory)
    try:
        obj = json.loads((d / MARKER).read_text(encoding="utf-8"))
        if isinstance(obj, dict) and isinstance(obj.get("eqjax_artifact"), str):
            return obj["eqjax_artifact"]
    except (OSError, ValueError):
        pass
    for name, kind in _LEGACY_PROOFS:
        try:
            obj = json.loads((d / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(obj, dict) and (kind != "checkpoint" or isinstance(obj.get("leaves"), dict)):
            return kind
    return None


def _resolved(p: str | os.PathLike[str]) -> pathlib.Path:
    return pathlib.Path(os.path.realpath(pathlib.Path(p).expanduser()))


def check_not_input(path: str | os.PathLike[str], inputs: Iterable[str | os.PathLike[str] | None], *,
                    what: str = "output", contains: bool = True) -> None:
    """Refuse an output ``path`` that is an input, lies inside one, or (``contains``) holds one."""
    out = _resolved(path)
    for src in inputs:
        if src is None or str(src) == "":
            continue
        inp = _resolved(src)
        if out == inp:
            rel = "is the input"
        elif inp in out.parents:
            rel = "lies inside the input"
        elif contains and out in inp.parents:
            rel = "holds the input"
        else:
            continue
        raise OutputError(f"the {what} {rel} ({path} vs {src}): expected a path apart from the inputs, found one "
                          f"that would write over {inp}")


def _foreign_entries(p: pathlib.Path, replaceable: Iterable[str] | None) -> list[str]:
    """Entries of directory ``p`` a replacement would lose: none if eqjax wrote ``p``."""
    if artifact_kind(p) is not None:
        return []
    keep = set(replaceable or ()) | {MARKER}
    return sorted(q.name for q in p.iterdir() if q.name not in keep)


def _refuse_foreign(p: pathlib.Path, foreign: list[str], what: str) -> None:
    if foreign:
        raise OutputError(
            f"cannot replace the {what} ({p}): expected a directory eqjax wrote (a checkpoint, ONNX package or run, "
            f"with its {MARKER} marker or manifest), found other files ({', '.join(repr(n) for n in foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}); choose a new or empty directory"
        )


def check_output_dir(
    path: str | os.PathLike[str], *, overwrite: bool = False, what: str = "output directory",
    allow_nonempty: bool = False, inputs: Iterable[str | os.PathLike[str] | None] = (),
    replaceable: Iterable[str] | None = None,
) -> pathlib.Path:
    """Check, before any work, that directory ``path`` can be created or replaced.

    An existing non-empty directory is refused unless ``overwrite`` (or ``allow_nonempty``, for
    directories whose individual files are checked separately); a file at ``path`` is always refused.
    Replacing (``overwrite`` without ``allow_nonempty``) needs a directory eqjax wrote (see
    :func:`artifact_kind`) or one whose entries are all in ``replaceable``, and no symbolic link.
    ``inputs``: paths the output must not be, lie inside, or (when replacing) hold.
    """
    p = pathlib.Path(path).expanduser()
    if str(path) == "":
        raise OutputError(f"empty {what} path: expected a directory name, found ''")
    check_not_input(p, inputs, what=what, contains=not allow_nonempty)
    if p.exists() and not p.is_dir():
        raise OutputError(f"cannot write the {what} ({p}): expected a directory, found a file")
    if p.is_dir():
        nonempty = any(p.iterdir())
        if nonempty and not (overwrite or allow_nonempty):
            raise OutputError(
                f"{what} is not empty ({p}): expected a new or empty directory, found existing files "
                "(pass --overwrite to replace it)"
            )
        if not allow_nonempty:
            _check_replace(p, nonempty, what, replaceable)
        _probe_writable(p, p, what)
        if p.parent != p:
            _probe_writable(_nearest_existing(p.parent), p, what)
        return p
    _probe_writable(_nearest_existing(p.parent), p, what)
    return p


def _check_replace(p: pathlib.Path, nonempty: bool, what: str, replaceable: Iterable[str] | None) -> None:
    if p.is_symlink():
        raise OutputError(f"cannot replace the {what} ({p}): expected a directory, found a symbolic link to "
                          f"{os.path.realpath(p)}")
    if nonempty:
        _refuse_foreign(p, _foreign_entries(p, replaceable), what)


# ------------------------------------------------------------------------------------ locks
_HELD: dict[str, list[Any]] = {}  # lock path -> [fd, depth] of the locks this process holds
_HELD_GUARD = threading.Lock()


def _lock_path(path: str | os.PathLike[str]) -> pathlib.Path:
    r = _resolved(path)
    return r.parent / f".{r.name}.eqjax-lock"


def _acquire(lp: pathlib.Path, target: pathlib.Path) -> int:
    """An fd holding an exclusive flock on ``lp`` (a file still linked at ``lp``); OutputError if held elsewhere."""
    while True:
        fd = os.open(lp, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            os.close(fd)
            raise OutputError(
                f"output in use by another eqjax process ({target}): expected no other process writing it, found "
                f"pid {holder} holding {lp}"
            ) from None
        try:
            same = os.stat(lp).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)  # the previous holder removed the file as we locked it: lock the new one


@contextlib.contextmanager
def output_lock(path: str | os.PathLike[str]) -> Iterator[pathlib.Path]:
    """Hold an exclusive lock on output ``path`` (file or directory) while the block runs.

    A second process locking the same output gets an OutputError naming it at once; the lock is
    re-entrant within a process and is dropped by the kernel when its holder dies.
    """
    lp = _lock_path(path)
    key = str(lp)
    with _HELD_GUARD:
        if key in _HELD:
            _HELD[key][1] += 1
        else:
            lp.parent.mkdir(parents=True, exist_ok=True)
            _HELD[key] = [_acquire(lp, pathlib.Path(path)), 1]
    try:
        yield lp
    finally:
        with _HELD_GUARD:
            _HELD[key][1] -= 1
            if _HELD[key][1] == 0:
                fd = _HELD.pop(key)[0]
                with contextlib.suppress(OSError):
                    os.unlink(lp)
                os.close(fd)


# ------------------------------------------------------------------------------------ files
@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], *, suffix: str | None = None) -> Iterator[pathlib.Path]:
    """Yield a temporary path next to ``path`` for a writer that takes a file name (``savefig``,
    ``onnx.save``, ``np.save``); on success it is fsync-ed and renamed onto ``path``.

    ``suffix`` (default: ``path``'s own suffix) keeps writers that pick a format by extension happy.
    On an exception the temporary is removed and ``path`` is untouched.
    """
    p = pathlib.Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale(p)
    tmp = _temp_sibling(p, p.suffix if suffix is None else suffix)
    try:
        yield tmp
        if not tmp.exists():
            raise OutputError(f"the writer produced no file ({p}): expected {tmp}, found nothing")
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, p)
        _fsync_dir(p.parent)
    except BaseException:
        _remove(tmp)
        raise


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str], mode: str = "wb", **open_kw: Any) -> Iterator[IO[Any]]:
    """``open(tmp, mode)`` for writing; on success flush + fsync + rename onto ``path``."""
    if not any(c in mode for c in "wax"):
        raise ValueError(f"atomic_file needs a write mode, got {mode!r}")
    with atomic_path(path) as tmp:
        with open(tmp, mode.replace("a", "w").replace("x", "w"), **open_kw) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())


def write_bytes(path: str | os.PathLike[str], data: bytes) -> pathlib.Path:
    """Atomically write ``data`` to ``path``."""
    with atomic_file(path, "wb") as f:
        f.write(data)
    return pathlib.Path(path)


def write_text(path: str | os.PathLike[str], text: str) -> pathlib.Path:
    """Atomically write UTF-8 ``text`` to ``path``."""
    return write_bytes(path, text.encode("utf-8"))


def _first_nonfinite(obj: Any, where: str = "") -> str | None:
    if isinstance(obj, float) and not math.isfinite(obj):
        return where or "<value>"
    if isinstance(obj, dict):
        for k, v in obj.items():
            hit = _first_nonfinite(v, f"{where}.{k}" if where else str(k))
            if hit:
                return hit
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            hit = _first_nonfinite(v, f"{where}[{i}]")
            if hit:
                return hit
    return None


def dumps_json(obj: Any, *, indent: int | None = 1, source: str = "JSON output") -> str:
    """``json.dumps`` that refuses NaN/Infinity (JSON has none) with an error naming the key."""
    try:
        return json.dumps(obj, indent=indent, allow_nan=False)
    except ValueError:
        where = _first_nonfinite(obj) or "?"
        raise NonFiniteResult(f"non-finite number in the {source} ({where}): expected a finite value, found NaN/Inf") from None


def write_json(path: str | os.PathLike[str], obj: Any, *, indent: int | None = 1) -> pathlib.Path:
    """Atomically write ``obj`` as strict JSON (no NaN/Infinity) to ``path``."""
    return write_text(path, dumps_json(obj, indent=indent, source=str(path)) + "\n")


def write_report(stem: str | os.PathLike[str], obj: Any, markdown: str) -> tuple[pathlib.Path, pathlib.Path]:
    """A bench's results: ``stem.json`` (``obj`` as strict JSON) and ``stem.md`` (``markdown``), written as
    one set (:func:`atomic_files`), the directory made if needed; returns both paths."""
    stem = pathlib.Path(stem)
    j, m = stem.with_suffix(".json"), stem.with_suffix(".md")
    body = dumps_json(obj, source=str(j)) + "\n"
    with atomic_files([j, m]) as tmp:
        tmp[j].write_bytes(body.encode("utf-8"))
        tmp[m].write_bytes(markdown.encode("utf-8"))
    return j, m


# ------------------------------------------------------------------------------------ directories
@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike[str], *, overwrite: bool = False, kind: str | None = None,
                     work: pathlib.Path | None = None) -> Iterator[pathlib.Path]:
    """Yield a temporary sibling directory to fill; on success it becomes ``path``.

    ``path`` must not exist, be an empty directory, or (with ``overwrite``) a directory eqjax wrote
    (:func:`artifact_kind`) or one whose every entry the new directory holds too: it is moved aside,
    the new one renamed into place, then the old one deleted. ``kind``: recorded in the new
    directory's :data:`MARKER`. The output is locked (:func:`output_lock`) throughout. On an exception
    (or a kill) the previous ``path`` is intact; a killed writer leaves ``.<name>.tmp-<pid>-*``,
    removed by the next write. ``work``: fill that (fixed sibling) directory instead, as it is
    (created if absent) and kept on an exception, so that a later run can go on with what it holds.
    """
    p = pathlib.Path(path).absolute()
    if p.exists() and not p.is_dir():
        raise OutputError(f"cannot write the directory ({p}): expected a directory, found a file")
    if p.is_dir() and any(p.iterdir()) and not overwrite:
        raise OutputError(
            f"directory is not empty ({p}): expected a new or empty directory, found existing files "
            "(pass --overwrite to replace it)"
        )
    if p.is_symlink():
        _check_replace(p, False, "directory", None)
    p.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(p):
        _clean_stale(p)
        tmp = _temp_sibling(p) if work is None else work
        tmp.mkdir(exist_ok=work is not None)
        try:
            yield tmp
            if kind is not None:
                write_marker(tmp, kind)
            fsync_tree(tmp)
            _swap_in(tmp, p)
        except BaseException:
            if work is None:
                _remove(tmp)
            raise


def _swap_in(tmp: pathlib.Path, p: pathlib.Path) -> None:
    """Rename the complete ``tmp`` onto ``p`` (an existing ``p`` eqjax may replace is moved aside, then deleted)."""
    if p.is_dir() and any(p.iterdir()):
        _check_replace(p, True, "directory", [q.name for q in tmp.iterdir()])
    if p.is_dir():
        old = _temp_sibling(p, ".old")
        os.rename(p, old)
        try:
            os.rename(tmp, p)
        except BaseException:
            os.rename(old, p)
            raise
        _fsync_dir(p.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, p)
    _fsync_dir(p.parent)


@contextlib.contextmanager
def atomic_files(targets: Iterable[str | os.PathLike[str]]) -> Iterator[dict[pathlib.Path, pathlib.Path]]:
    """Write a set of files as one: yields ``{target: temporary}`` (each temporary beside its target,
    with the target's suffix); once the block ends, every temporary is fsync-ed, then each is renamed
    onto its target. A target whose temporary was not written is removed (it is not in the new set).
    On an exception (a full disk, a failed plot) every temporary is removed and no target is touched.
    """
    paths = [pathlib.Path(t) for t in dict.fromkeys(os.fspath(t) for t in targets)]
    for t in paths:
        t.parent.mkdir(parents=True, exist_ok=True)
        _clean_stale(t)
    temps = {t: _temp_sibling(t, t.suffix) for t in paths}
    try:
        yield temps
        for tmp in temps.values():
            if tmp.exists():
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
    except BaseException:
        for tmp in temps.values():
            _remove(tmp)
        raise
    for t, tmp in temps.items():
        if tmp.exists():
            os.replace(tmp, t)
        else:
            t.unlink(missing_ok=True)
    for d in {t.parent for t in paths}:
        _fsync_dir(d)


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold Ctrl-C / SIGTERM while the block runs (a writer whose threads must finish before its temporary
    goes); a held signal raises KeyboardInterrupt when the block ends, a second one at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        got.append(signum)
        if len(got) > 1:
            raise KeyboardInterrupt

    old = {s: signal.signal(s, hold) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if got:
        raise KeyboardInterrupt


# ------------------------------------------------------------------------------------ row logs
class JsonLines:
    """An append-only log of JSON objects, one per line, each appended line fsync-ed."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = pathlib.Path(path)

    def append(self, obj: Any) -> None:
        line = dumps_json(obj, indent=None, source=str(self.path)) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab") as f:
            if f.tell() > 0:
                # a previous writer killed mid-line left a torn record: start on a fresh line
                with open(self.path, "rb") as r:
                    r.seek(-1, os.SEEK_END)
                    if r.read(1) != b"\n":
                        f.write(b"\n")
            f.write(line.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())

    def read(self) -> tuple[list[Any], int]:
        """``(records, torn)``: every complete record, and how many unparsable lines were skipped."""
        if not self.path.is_file():
            return [], 0
        out, torn = [], 0
        for line in self.path.read_bytes().split(b"\n"):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line.decode("utf-8")))
            except (UnicodeDecodeError, json.JSONDecodeError):
                torn += 1
        return out, torn
