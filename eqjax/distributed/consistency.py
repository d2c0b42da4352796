"""Before calibrating together, processes check that they hold the same job.

Every process publishes short fingerprints (recipe, model weights, calibration data, settings,
software versions) in the coordinator's key-value store and reads everyone else's; any difference
is an :class:`InconsistentJobError` naming the item, the processes and both values, raised on every
process (all of them see the same table), before any work is done. Without this, processes given
different ``--seed`` values silently produce different models.

:func:`fingerprint` hashes arrays (bytes, shapes and dtypes) and any JSON-able settings.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

import jax
import numpy as np

from eqjax.core.errors import InputError
from eqjax.distributed.runtime import _STATE, DistributedError, _next_id, kv_client

__all__ = ["InconsistentJobError", "fingerprint", "check_same_job"]


class InconsistentJobError(InputError):
    """The processes of one job were given different recipes, models, data or settings."""


def _host(x: Any) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0) if x.is_fully_replicated else None
        if x is None:
            raise ValueError("fingerprint of an array sharded across processes")
    return np.asarray(x)


def fingerprint(obj: Any) -> str:
    """SHA-256 (16 hex digits) of arrays (bytes, shape, dtype) and JSON-able values, leaf by leaf."""
    h = hashlib.sha256()
    leaves, treedef = jax.tree_util.tree_flatten(obj)
    h.update(str(treedef).encode())
    for leaf in leaves:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            a = np.ascontiguousarray(_host(leaf))
            h.update(f"{a.shape}{a.dtype}".encode())
            h.update(a.tobytes())
        else:
            h.update(json.dumps(leaf, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def check_same_job(items: Mapping[str, str], *, timeout_s: float | None = None) -> None:
    """Raise :class:`InconsistentJobError` on every process unless all processes hold the same
    ``items`` (name -> fingerprint or short value); a no-op single-process.

    A process that does not publish within ``timeout_s`` (default: the job's timeout) is a
    :class:`~eqjax.distributed.runtime.DistributedError` naming it.
    """
    n = jax.process_count()
    if n == 1:
        return
    client = kv_client()
    me = jax.process_index()
    key = _next_id("agree")
    t = _STATE.timeout_s if timeout_s is None else timeout_s
    client.key_value_set(f"{key}/{me}", json.dumps(dict(items), sort_keys=True))
    tables: dict[int, dict[str, str]] = {}
    for p in range(n):
        try:
            tables[p] = json.loads(client.blocking_key_value_get(f"{key}/{p}", int(t * 1000)))
        except Exception as e:  # noqa: BLE001 - DEADLINE_EXCEEDED: the peer never got here
            raise DistributedError(
                f"process {p} of {n} did not publish its job fingerprints within {t:g} s (it failed earlier, or runs "
                f"another eqjax version): {str(e).splitlines()[0][:160]}"
            ) from None
    ref = tables[0]
    for p in range(1, n):
        for name in sorted(set(ref) | set(tables[p])):
            a, b = ref.get(name), tables[p].get(name)
            if a != b:
                raise InconsistentJobError(
                    f"the processes hold different jobs ({name}): expected every process to have process 0's "
                    f"{a!r}, found {b!r} on process {p} (give every process the same recipe, model, text and "
                    "calibration flags)"
                )
