"""The exception hierarchy: every error eqjax raises on purpose is an :class:`EqjaxError`.

* :class:`InputError` (CLI exit code 2): the user's input is wrong — a file, a flag, a recipe value,
  a parameter, a model eqjax cannot use. The message names the file / parameter path / flag.
* :class:`RuntimeFailure` (CLI exit code 1): the input was fine but the work failed (a peer process
  died, a numerical breakdown that is not the input's fault).
"""

from __future__ import annotations

__all__ = ["EqjaxError", "InputError", "RuntimeFailure"]


class EqjaxError(Exception):
    """Base of every deliberate eqjax error."""

    exit_code = 1


class InputError(EqjaxError, ValueError):
    """Bad input (exit code 2)."""

    exit_code = 2


class RuntimeFailure(EqjaxError, RuntimeError):
    """The work failed for a reason other than the input (exit code 1)."""

    exit_code = 1
