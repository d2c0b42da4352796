"""Float params stored in 16 bits: the step behind a recipe's ``+f16`` / ``+bf16`` suffix.

:class:`HalfFloats` replaces every param that is still a float32 / float64 array (not quantized by an
earlier step) and whose path matches ``pattern`` by a :class:`~eqjax.core.qarray.HalfFloat`: its values
rounded to nearest float16 (or bfloat16), standing for that rounded array in the param's own dtype.
Every reader widens it (eqjax's models, the traced interpreter, the ONNX and GGUF writers), so the
model computes exactly as before on params rounded to 16 bits; only storage shrinks: norm scales,
biases and, where a recipe leaves them float, the embedding table and LM head.

A param with a value beyond float16's largest finite value (65504) is left in its dtype rather than
become Inf, and the step's report says so; bfloat16 has float32's range. Put the step last: a later
quantizing step treats a HalfFloat as already done and leaves it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from eqjax.core.errors import InputError
from eqjax.core.qarray import HalfFloat, is_quantized
from eqjax.recipes.schema import step_kwargs

__all__ = ["HalfFloats", "HALF_KINDS"]

HALF_KINDS = {"f16": "float16", "bf16": "bfloat16"}
"""Recipe suffix (``+f16``) -> storage dtype."""


def _fits(a: np.ndarray, dtype: str) -> bool:
    return dtype == "bfloat16" or not a.size or float(np.abs(a).max()) <= float(np.finfo(np.float16).max)


@dataclasses.dataclass(frozen=True)
class HalfFloats:
    """Store the float params ``pattern`` matches in ``dtype`` (``"float16"`` or ``"bfloat16"``)."""

    dtype: str = "float16"
    pattern: str = ".*"
    name: str = "half-floats"
    needs_calibration = False

    def __post_init__(self) -> None:
        if self.dtype not in HALF_KINDS.values():
            raise InputError(f"{self.name}: dtype must be one of {sorted(HALF_KINDS.values())}, got {self.dtype!r}")
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise InputError(f"{self.name}: pattern {self.pattern!r} is not a regular expression ({e})") from None

    def __call__(self, params: Mapping[str, Any], ctx: Any = None) -> dict[str, Any]:
        rx = re.compile(self.pattern)
        if not any(rx.fullmatch(p) for p in params):
            raise InputError(f"pattern matches no parameter (step {self.name!r}, pattern {self.pattern!r}): expected "
                             f"a pattern matching at least one param path, found none")
        out = dict(params)
        for path, leaf in params.items():
            if (is_quantized(leaf) or not rx.fullmatch(path) or not hasattr(leaf, "dtype")
                    or jnp.dtype(leaf.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64))):
                continue
            a = np.asarray(leaf)
            if not _fits(a, self.dtype):
                if ctx is not None:
                    ctx.report.append((path, f"{self.name}: kept {a.dtype} (|x| up to {np.abs(a).max():.4g} "
                                             "exceeds float16's 65504)"))
                continue
            out[path] = HalfFloat(jnp.asarray(a.astype(self.dtype)), jnp.dtype(leaf.dtype))
            if ctx is not None:
                ctx.report.append((path, f"{self.name}: stored as {self.dtype}"))
        return out

    @classmethod
    def from_config(cls, d: Mapping[str, Any]) -> "HalfFloats":

        return cls(**step_kwargs(cls, d, "half", exclude=()))
