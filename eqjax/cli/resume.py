"""The resumable run: :func:`run_recipes` appends each finished row to ``<out>/rows.jsonl``
(:class:`RowLog`: one fsync-ed JSON line per row after a header holding the protocol), so an interrupted
``eqjax run`` keeps its rows and ``eqjax run --resume`` continues where it stopped, refusing a log made
under another protocol, over other model or text content (:func:`content_fingerprints`, SHA-256), or by
another definition of a recipe.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
from collections.abc import Iterable
from typing import Any

import jax

import eqjax
from eqjax.core.errors import CompatibilityError
from eqjax.distributed.consistency import fingerprint
from eqjax.io.atomic import JsonLines, dumps_json, write_text
from eqjax.io.gguf import default_model_path
from eqjax.protocol import DEFAULT_PLOT_LAYER, Setup, evaluate_recipe, plot_layer_for, recipe_fingerprint
from eqjax.recipes.types import Recipe

log = logging.getLogger("eqjax")

def _sha256_files(files: list[pathlib.Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def content_fingerprints(model_path: str | os.PathLike[str] | None, text_path: str | os.PathLike[str] | None
                         ) -> dict[str, str | None]:
    """``{"model_sha256", "text_sha256"}``: SHA-256 of the model's content (a .gguf file, or an HF directory's
    .safetensors/.json files) and of the text file (None for the built-in text); streamed, one read each."""

    m = pathlib.Path(model_path) if model_path is not None else default_model_path()
    files = sorted(f for f in m.iterdir() if f.is_file() and f.suffix in (".safetensors", ".json", ".gguf")) if m.is_dir() else [m]
    return {"model_sha256": _sha256_files(files),
            "text_sha256": None if text_path is None else _sha256_files([pathlib.Path(text_path)])}


def job_fingerprints(setup: Setup, recipes: Iterable[Recipe | None]) -> dict[str, str]:
    """What every process of a multi-process job must agree on (see
    :func:`eqjax.distributed.check_same_job`): recipes, model weights, calibration and evaluation
    windows, the protocol settings and the software versions. Paths are not compared (hosts may
    keep the same files in different places); contents are."""


    proto = {k: v for k, v in setup.protocol.items() if k not in ("model", "text")}
    return {
        "recipe": ",".join("checkpoint" if r is None else f"{r.name}:{recipe_fingerprint(r)}" for r in recipes),
        "model weights": fingerprint(setup.params),
        "model config": fingerprint(repr(setup.model)),
        "calibration windows": fingerprint(setup.calib_windows),
        "evaluation windows": fingerprint(setup.eval_windows),
        "protocol": fingerprint(proto),
        "software": f"eqjax {getattr(eqjax, '__version__', '?')}, jax {jax.__version__}",
    }


ROWS_FILE = "rows.jsonl"


_ROWS_FORMAT = 1


def _canonical(obj: Any) -> Any:
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


class RowLog:
    """``<out>/rows.jsonl``: a header line ``{"eqjax_rows": 1, "protocol": ...}`` then one line per
    finished row ``{"row": ...}``, each appended and fsync-ed as soon as the row exists."""

    def __init__(self, out_dir: str | pathlib.Path) -> None:
        self.path = pathlib.Path(out_dir) / ROWS_FILE
        self._log = JsonLines(self.path)

    def exists(self) -> bool:
        return self.path.is_file() and self.path.stat().st_size > 0

    def start(self, protocol: dict[str, Any]) -> None:
        """Begin a fresh log (an existing one is replaced atomically by the header)."""
        write_text(self.path, dumps_json({"eqjax_rows": _ROWS_FORMAT, "protocol": protocol}, indent=None) + "\n")

    def append(self, row: dict[str, Any]) -> None:
        self._log.append({"row": {k: v for k, v in row.items() if k != "_params"}})

    def resume(self, protocol: dict[str, Any], recipes: list[Recipe]) -> list[dict[str, Any]]:
        """The finished rows of an earlier run under the same protocol, for recipes of this run.

        Refuses (CompatibilityError naming the log and the differing setting) a log written under
        another protocol, or a row whose recipe name now has another definition.
        """
        records, torn = self._log.read()
        if torn:
            log.warning("%s: %d torn line(s) (a run killed mid-write) skipped", self.path, torn)
        if not records or not isinstance(records[0], dict) or records[0].get("eqjax_rows") != _ROWS_FORMAT:
            raise CompatibilityError(
                f"cannot resume ({self.path}): expected a row log written by eqjax run, found "
                f"{'an empty file' if not records else 'another format'}"
            )
        old, new = _canonical(records[0].get("protocol")), _canonical(protocol)
        for k in sorted(set(old or {}) | set(new)):
            if (old or {}).get(k) != new.get(k) and k.endswith("_sha256"):
                what = k[: -len("_sha256")]
                raise CompatibilityError(f"cannot resume: the {what}'s content changed since the log was written ({self.path}: "
                                         f"protocol.{k}, {what} {new.get(what)}): expected {str(new.get(k))[:16]}... (this run), "
                                         f"found {str((old or {}).get(k))[:16]}... (the log); use --overwrite to start again")
            if (old or {}).get(k) != new.get(k):
                raise CompatibilityError(
                    f"cannot resume: the run's protocol differs ({self.path}: protocol.{k}): expected "
                    f"{new.get(k)!r} (this run), found {(old or {}).get(k)!r} (the log); use --overwrite to start again"
                )
        fps = {r.name: recipe_fingerprint(r) for r in recipes}
        rows: dict[str, dict[str, Any]] = {}
        for rec in records[1:]:
            row = rec.get("row") if isinstance(rec, dict) else None
            if not isinstance(row, dict) or row.get("recipe") not in fps:
                continue
            if row.get("recipe_fingerprint") != fps[row["recipe"]]:
                raise CompatibilityError(
                    f"cannot resume: recipe {row['recipe']!r} changed since its row was written ({self.path}): "
                    f"expected definition {fps[row['recipe']]}, found {row.get('recipe_fingerprint')}; "
                    "use --overwrite to start again"
                )
            rows[row["recipe"]] = row
        return list(rows.values())


def run_recipes(setup: Setup, recipes: Iterable[Recipe], *, progress: bool = True,
                batch_size: int = 2, row_log: RowLog | None = None, done: Iterable[dict[str, Any]] = (),
                plot_layer: str | None = DEFAULT_PLOT_LAYER) -> list[dict[str, Any]]:
    """Measure each recipe in order (``fp`` first if present, so changes are relative to it).

    ``done``: rows finished earlier (``--resume``), reused as they are. ``row_log``: each new row is
    appended to it as soon as it is measured. ``plot_layer``: record that layer's weight histogram in
    each row (the report plot), instead of keeping every quantized model in memory.
    """
    recipes = list(recipes)
    recipes.sort(key=lambda r: r.name != "fp")
    finished = {r["recipe"]: r for r in done}
    layer = plot_layer_for(setup.params, plot_layer) if plot_layer else None
    rows: list[dict[str, Any]] = []
    fp_ppl = finished["fp"]["ppl"] if "fp" in finished else None
    it: Any = recipes
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(recipes, desc="recipes", unit="recipe")
        it = bar
    for r in it:
        if bar is not None:
            bar.set_postfix_str(r.name)
        if r.name in finished:
            rows.append(finished[r.name])
            log.info("%s: ppl %.3f (from the row log)", r.name, finished[r.name]["ppl"])
            continue
        row = evaluate_recipe(setup, r, fp_ppl=fp_ppl, batch_size=batch_size, hist_layer=layer)
        if r.name == "fp":
            fp_ppl = row["ppl"]
            row["delta_pct"] = 0.0
        rows.append(row)
        if row_log is not None:
            row_log.append(row)
        log.info("%s: ppl %.3f", r.name, row["ppl"])
    return rows
