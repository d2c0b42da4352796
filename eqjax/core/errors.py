"""One exception hierarchy for everything eqjax refuses or fails at, and the CLI's exit-code contract.

::

    EqjaxError                        base of every eqjax error (``except eqjax.core.errors.EqjaxError``)
    ├── InputError (ValueError)       bad usage or input: flags, files, recipes, checkpoints -> exit 2
    │   ├── OutputError               an output path is not writable or already exists (no --overwrite)
    │   ├── NonFiniteError            a parameter holds NaN/Inf (path and first index named)
    │   ├── CompatibilityError        model / text / recipe / checkpoint do not fit each other
    │   └── RecipeError, DataError, CheckpointError, GGUFError  (subclasses, defined where they are raised)
    └── RuntimeFailure (RuntimeError) the input was fine, the work failed                       -> exit 1
        └── NonFiniteResult           a perplexity / logit came out NaN or Inf

Error classes defined next to the code raising them (``QArrayError``, ``ConfigError``, ``RuleError``,
``TokenizerError``, ``ExportError``, ``BudgetError``, ``ProgramError``, ``CalibrationError``: input;
``DistributedError``: runtime) subclass these. A plain ``ValueError`` raised by eqjax's own code (a
deliberate check not yet converted) also counts as input; any other exception is an internal error
(a bug), reported as such.

Messages are one line, ``<what> (<file or param path>): expected X, found Y`` where that shape fits;
the CLI prints ``eqjax: error: <message>`` and exits with :func:`exit_code` (``--debug`` shows the
traceback).
"""

from __future__ import annotations

import abc
import os
from typing import Any

__all__ = [
    "EqjaxError", "InputError", "OutputError", "NonFiniteError", "CompatibilityError", "RuntimeFailure",
    "NonFiniteResult", "EXIT_INPUT", "EXIT_RUNTIME", "EXIT_INTERRUPTED", "exit_code", "classify",
    "one_line", "register_known", "describe",
]

EXIT_RUNTIME = 1
EXIT_INPUT = 2
EXIT_INTERRUPTED = 130


class EqjaxError(Exception, metaclass=abc.ABCMeta):
    """Base of every error eqjax raises on purpose. ``exit_code``: what the CLI exits with."""

    exit_code: int = EXIT_RUNTIME


class InputError(EqjaxError, ValueError):
    """Bad usage or input (flags, files, recipes, checkpoints): the CLI exits with 2."""

    exit_code = EXIT_INPUT


class OutputError(InputError):
    """An output path cannot be written (missing/unwritable parent) or exists without ``--overwrite``."""


class NonFiniteError(InputError):
    """A parameter (as loaded, or as given to quantize) holds NaN or Inf; names the path and index."""


class CompatibilityError(InputError):
    """Model, text, recipe and checkpoint do not fit each other (shapes, vocabulary, context)."""


class RuntimeFailure(EqjaxError, RuntimeError):
    """The input was accepted but the work failed (numerics, I/O during the run): the CLI exits with 1."""

    exit_code = EXIT_RUNTIME


class NonFiniteResult(RuntimeFailure):
    """A result (perplexity, logits, a quantized scale) came out NaN or Inf."""


def register_known() -> None:
    """Kept for compatibility: every eqjax error class now subclasses :class:`EqjaxError` directly."""


_INPUT_OS_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)


def classify(exc: BaseException) -> str:
    """``"input"``, ``"runtime"``, ``"interrupted"`` or ``"internal"`` (an unexpected exception: a bug)."""
    register_known()
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    if isinstance(exc, InputError):
        return "input"
    if isinstance(exc, RuntimeFailure):
        return "runtime"
    if isinstance(exc, _INPUT_OS_ERRORS):
        return "input"
    if isinstance(exc, (OSError, MemoryError)) or _out_of_memory(exc):
        return "runtime"
    if isinstance(exc, ValueError) and _raised_by_eqjax(exc):
        return "input"  # a deliberate check in eqjax code that still raises a plain ValueError
    return "internal"


def _out_of_memory(exc: BaseException) -> bool:
    """An allocation XLA could not make (its runtime error's ``RESOURCE_EXHAUSTED`` status; matched by name, so
    this bottom layer does not import jax)."""
    return type(exc).__name__ in ("JaxRuntimeError", "XlaRuntimeError") and "RESOURCE_EXHAUSTED" in str(exc)


_PKG_DIRS = tuple(
    os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), d) + os.sep
    for d in ("eqjax", "pallas_kernels")
)


def _raised_by_eqjax(exc: BaseException) -> bool:
    """True when the innermost frame of ``exc``'s traceback is eqjax's own code (a ``raise`` there)."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_PKG_DIRS)


def exit_code(exc: BaseException) -> int:
    """The CLI exit code for ``exc``: 2 input/usage, 1 runtime (and internal errors), 130 interrupted."""
    kind = classify(exc)
    if kind == "input":
        return EXIT_INPUT
    if kind == "interrupted":
        return EXIT_INTERRUPTED
    return EXIT_RUNTIME


def one_line(text: str, limit: int = 600) -> str:
    """``text`` on one line (newlines folded into ``"; "``), at most ``limit`` characters."""
    parts = [p.strip() for p in str(text).splitlines() if p.strip()]
    s = "; ".join(parts)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def describe(exc: BaseException) -> str:
    """A one-line description of ``exc`` for the CLI (without the ``eqjax: error:`` prefix)."""
    kind = classify(exc)
    if kind == "interrupted":
        return "interrupted (Ctrl-C or SIGTERM)"
    if isinstance(exc, OSError) and not isinstance(exc, EqjaxError) and exc.filename is not None:
        what = exc.strerror or type(exc).__name__
        return one_line(f"{what} ({os.fsdecode(exc.filename)})")
    msg = one_line(str(exc)) or type(exc).__name__
    if _out_of_memory(exc):
        return (f"out of memory: {msg} (for models larger than memory: 'eqjax quantize --stream' quantizes one block "
                "at a time, 'eqjax eval --by-block' evaluates one block at a time)")
    if kind == "internal":
        return f"internal error {type(exc).__name__}: {msg} (a bug in eqjax; rerun with --debug for the traceback)"
    if isinstance(exc, (OSError, MemoryError)) and not isinstance(exc, EqjaxError):
        return f"{type(exc).__name__}: {msg}"
    return msg


def _expected_found(what: str, where: str, expected: Any, found: Any) -> str:
    """``<what> (<where>): expected <expected>, found <found>`` (the message shape used across eqjax)."""
    return f"{what} ({where}): expected {expected}, found {found}"


def mismatch(cls: type[EqjaxError], what: str, where: str, expected: Any, found: Any) -> EqjaxError:
    """An error of class ``cls`` with the standard message."""
    return cls(_expected_found(what, where, expected, found))


class RecipeError(InputError):
    """A recipe (file) is malformed or cannot run on the given model."""


class RuleError(InputError):
    """A rule is malformed (bad regex, unknown key, impossible setting)."""
