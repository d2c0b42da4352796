"""Flags several ``eqjax`` commands share, under one name and default everywhere: ``--calib-windows``,
``--calib-len`` (calibration window length, tokens) and ``--eval-len`` (evaluation window length, tokens).
Older spellings (``--calib-ctx``, ``--ctx``) stay accepted as hidden aliases of the same argument."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["CALIB_LEN", "CALIB_WINDOWS", "add_aliased", "add_calibration_args", "add_eval_len"]

CALIB_WINDOWS = 16
CALIB_LEN = 512


def add_aliased(p: argparse.ArgumentParser, flag: str, aliases: tuple[str, ...] = (), **kw: Any) -> argparse.Action:
    """``p.add_argument(flag, **kw)``, plus each of ``aliases`` setting the same destination, left out of the
    help and usage text."""
    dest = kw.pop("dest", flag.lstrip("-").replace("-", "_"))
    action = p.add_argument(flag, dest=dest, **kw)
    for alias in aliases:
        p.add_argument(alias, dest=dest, type=kw.get("type"), default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return action


def add_calibration_args(p: argparse.ArgumentParser, *, what: str = "calibrated recipes",
                         aliases: bool = False) -> None:
    """``--calib-windows`` and ``--calib-len`` (``--calib-ctx`` too where ``aliases``)."""
    p.add_argument("--calib-windows", type=int, default=CALIB_WINDOWS,
                   help=f"calibration windows for {what} (default {CALIB_WINDOWS})")
    add_aliased(p, "--calib-len", ("--calib-ctx",) if aliases else (), type=int, default=CALIB_LEN,
                help=f"calibration window length in tokens (default {CALIB_LEN})")


def add_eval_len(p: argparse.ArgumentParser, default: int, *, what: str = "", aliases: bool = False) -> None:
    """``--eval-len`` (``--ctx`` too where ``aliases``)."""
    add_aliased(p, "--eval-len", ("--ctx",) if aliases else (), type=int, default=default,
                help=f"evaluation window length in tokens{what} (default {default})")
