"""The progress of a streamed write, kept beside its output so that a killed run can go on (``--resume``).

A streamed quantization (:func:`eqjax.recipes.stream.stream_quantize`) with a ledger writes its output's
shards into the fixed work directory ``.<name>.partial`` beside the output (:func:`work_directory`; the
output itself appears only at the end, :func:`eqjax.io.atomic.atomic_directory`). After each unit's shard
is written, the ledger records in ``.progress/`` there: the unit, its shard, the encoder's state, the steps'
report lines and the calibration activations the next unit starts from (float32 arrays in an ``.npz``,
read back without pickle). The activations are written first under a new name, then ``ledger.json`` naming
them replaces the old one atomically: a kill at any moment leaves the last finished unit on record.

A resumed run must be the same run: ``run`` (model, recipe, seed, calibration digest, dtype) is compared
with the recorded one and any difference is an :class:`InputError` naming it, before any work.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from eqjax.core.errors import InputError, OutputError

__all__ = ["StreamLedger", "work_directory"]

_DIR = ".progress"


def work_directory(output: str | os.PathLike[str]) -> Path:
    """``.<name>.partial`` beside ``output``: where a resumable streamed write fills its shards."""
    p = Path(output).absolute()
    return p.parent / f".{p.name}.partial"


class StreamLedger:
    """The record of a streamed write in ``work`` (see the module docs).

    Args:
      work: the work directory (:func:`work_directory`); its shards are the writer's.
      run: JSON-able identity of the run; a resumed run must match it.
      resume: go on from the record in ``work`` (none there: start afresh); without it, a previous run's
        record and shards are removed first.
    """

    def __init__(self, work: Path, run: Mapping[str, Any], *, resume: bool):
        self.work, self.dir = Path(work), Path(work) / _DIR
        self.run = json.loads(json.dumps(dict(run)))
        if self.work.exists() and not self.dir.is_dir():
            raise OutputError(f"cannot resume or restart in {self.work}: it exists but holds no eqjax progress "
                              f"record ({_DIR}); move it away")
        rec = self._read() if resume and self.dir.is_dir() else None
        if rec is not None and rec["run"] != self.run:
            key = next(k for k in sorted(set(rec["run"]) | set(self.run)) if rec["run"].get(k) != self.run.get(k))
            was, now = repr(rec["run"].get(key)), repr(self.run.get(key))
            detail = f" ({was}, now {now})" if len(was) + len(now) < 120 else ""
            raise InputError(f"--resume: the interrupted run in {self.work} differs in {key}{detail}; rerun it the "
                             "same way, or without --resume to start afresh")
        if rec is None:
            shutil.rmtree(self.work, ignore_errors=True)
            self.dir.mkdir(parents=True)
            rec = {"run": self.run, "units": [], "encoder": {}, "report": [], "changed": False, "streams": None}
            self._write(rec)
        self.record = rec
        self._staged: tuple[str, Any, dict[str, Any]] | None = None

    def _read(self) -> dict[str, Any] | None:
        f = self.dir / "ledger.json"
        try:
            return json.loads(f.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise InputError(f"--resume: the progress record {f} is unreadable ({e}); rerun without --resume") from None

    def _write(self, rec: dict[str, Any]) -> None:
        tmp = self.dir / "ledger.json.tmp"
        tmp.write_text(json.dumps(rec))
        os.replace(tmp, self.dir / "ledger.json")

    def finished(self) -> list[str]:
        """The units already written, in order."""
        return [u["unit"] for u in self.record["units"]]

    def shards(self) -> list[dict[str, Any]]:
        """The written units' shard records (:meth:`eqjax.io.hf_quantized.Shards.restore`)."""
        return [u["shard"] for u in self.record["units"] if u["shard"] is not None]

    @property
    def encoder(self) -> dict[str, Any]:
        return self.record["encoder"]

    def restored(self) -> tuple[dict[int, list[np.ndarray]], list[tuple[str, str]], bool]:
        """``(activation streams by step index, report lines, whether a unit was quantized)`` as recorded."""
        streams: dict[int, list[np.ndarray]] = {}
        if self.record["streams"]:
            with np.load(self.dir / self.record["streams"], allow_pickle=False) as z:
                for key in sorted(z.files, key=lambda k: tuple(map(int, k.split("_")))):
                    step, _ = map(int, key.split("_"))
                    streams.setdefault(step, []).append(z[key])
        return streams, [tuple(r) for r in self.record["report"]], bool(self.record["changed"])

    def stage(self, unit: str, shard: Mapping[str, Any] | None, encoder: Mapping[str, Any]) -> None:
        """The writer's part of ``unit``'s record (its shard is on disk): kept until :meth:`commit`."""
        self._staged = (unit, None if shard is None else dict(shard), dict(encoder))

    def commit(self, unit: str, streams: Mapping[int, list[Any]], report: list[tuple[str, str]],
               changed: bool) -> None:
        """Record ``unit`` as finished with the activations the next unit starts from."""
        if self._staged is None or self._staged[0] != unit:
            raise ValueError(f"unit {unit!r} committed before its shard was staged")
        _, shard, encoder = self._staged
        n = len(self.record["units"])
        name = None
        if streams:
            name = f"streams-{n:05d}.npz"
            arrays = {f"{i}_{j}": np.asarray(x, np.float32) for i, xs in streams.items() for j, x in enumerate(xs)}
            with open(self.dir / name, "wb") as f:
                np.savez(f, **arrays)
        old = self.record["streams"]
        rec = {**self.record, "units": [*self.record["units"], {"unit": unit, "shard": shard}], "encoder": encoder,
               "report": [list(r) for r in report], "changed": bool(changed), "streams": name}
        self._write(rec)
        self.record, self._staged = rec, None
        if old and old != name:
            (self.dir / old).unlink(missing_ok=True)

    def close(self) -> None:
        """Remove the record (the work directory is about to become the output)."""
        shutil.rmtree(self.dir, ignore_errors=True)
