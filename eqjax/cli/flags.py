"""Flags several ``eqjax`` commands share, under one name and default everywhere: ``--calib-windows``,
``--calib-len`` (calibration window length, tokens), ``--eval-len`` (evaluation window length, tokens) and the
quantization-aware training flags of ``+qat`` recipes (``--qat-tokens``, ``--qat-lr``, ``--qat-state``) and
``+bqat`` recipes (``--qat-block-iters``).
Older spellings (``--calib-ctx``, ``--ctx``) stay accepted as hidden aliases of the same argument."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from eqjax.core.errors import InputError
from eqjax.methods.blockqat import BlockQAT
from eqjax.methods.qat import QAT
from eqjax.recipes.types import Recipe

__all__ = ["CALIB_LEN", "CALIB_WINDOWS", "add_aliased", "add_calibration_args", "add_eval_len", "add_qat_args",
           "with_qat_args"]

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


def add_qat_args(p: argparse.ArgumentParser) -> None:
    """``--qat-tokens``, ``--qat-lr``, ``--qat-state`` (the QAT step of a ``+qat`` recipe) and ``--qat-block-iters``
    (the block-wise step of a ``+bqat`` recipe)."""
    p.add_argument("--qat-tokens", type=int, default=None,
                   help=f"training tokens of a +qat recipe (default {QAT.tokens}; from the calibration windows, cycled)")
    p.add_argument("--qat-lr", type=float, default=None,
                   help=f"learning rate of the relative scales of a +qat recipe (default {QAT.lr_scale}; latent "
                        f"weights and zero points, in grid steps: a fifth of it)")
    p.add_argument("--qat-state", default=None,
                   help="directory for the training state of a +qat recipe: saved as it trains; a rerun resumes")
    p.add_argument("--qat-block-iters", type=int, default=None,
                   help=f"optimizer steps per block of a +bqat recipe (default {BlockQAT.iters}; one calibration batch "
                        "each)")


def with_qat_args(recipe: Recipe, args: argparse.Namespace) -> Recipe:
    """``recipe`` with its QAT step set from the flags; a flag given for a recipe without one is an error."""
    recipe = _with_block_iters(recipe, getattr(args, "qat_block_iters", None))
    given = {f: getattr(args, f, None) for f in ("qat_tokens", "qat_lr", "qat_state")}
    if all(v is None for v in given.values()):
        return recipe
    flag = "--" + next(k for k, v in given.items() if v is not None).replace("_", "-")
    if not any(isinstance(s, QAT) for s in recipe.steps):
        raise InputError(f"{flag} trains a +qat recipe: expected a recipe with quantization-aware training "
                         f"(e.g. {recipe.name}+qat), found {recipe.name!r}")
    if given["qat_tokens"] is not None and given["qat_tokens"] < 1:
        raise InputError(f"bad --qat-tokens: expected >= 1, found {given['qat_tokens']}")
    if given["qat_lr"] is not None and not given["qat_lr"] > 0:
        raise InputError(f"bad --qat-lr: expected > 0, found {given['qat_lr']}")

    def setup(s: Any) -> Any:
        if not isinstance(s, QAT):
            return s
        kw: dict[str, Any] = {}
        if given["qat_tokens"] is not None:
            kw["tokens"] = given["qat_tokens"]
        if given["qat_lr"] is not None:
            kw.update(lr_scale=given["qat_lr"], lr_weight=given["qat_lr"] / 5)
        if given["qat_state"] is not None:
            kw["checkpoint"] = given["qat_state"]
        return dataclasses.replace(s, **kw)

    return dataclasses.replace(recipe, steps=tuple(setup(s) for s in recipe.steps))


def _with_block_iters(recipe: Recipe, iters: int | None) -> Recipe:
    """``recipe`` with ``--qat-block-iters`` applied to its block-wise QAT step."""
    if iters is None:
        return recipe
    if not any(isinstance(s, BlockQAT) for s in recipe.steps):
        raise InputError(f"--qat-block-iters trains a +bqat recipe: expected a recipe with block-wise training "
                         f"(e.g. {recipe.name}+bqat), found {recipe.name!r}")
    if iters < 0:
        raise InputError(f"bad --qat-block-iters: expected >= 0, found {iters}")
    steps = tuple(dataclasses.replace(s, iters=iters) if isinstance(s, BlockQAT) else s for s in recipe.steps)
    return dataclasses.replace(recipe, steps=steps)
