"""Orbax checkpoints of (quantized) param trees, with the recipe and the model they belong to.

Layout of a checkpoint directory::

    <dir>/arrays/      Orbax StandardCheckpointer tree: a flat {"path::field": array} dict
    <dir>/eqjax.json   manifest (written last): format version, recipe (name, description, full
                       repr, KV-cache settings), model config and fingerprint, each leaf's kind, shape,
                       dtype and static metadata, and the size + SHA-256 of every file under arrays/

Saving is atomic: everything is written into a temporary sibling directory
(``.<name>.tmp-<pid>-<random>``), fsync-ed, and renamed onto ``<dir>`` only when complete (an
existing checkpoint is replaced only with ``overwrite=True``, after the new one is complete). A killed
save leaves the previous checkpoint intact; the partial one is recognisable by its name and by its
missing manifest, and :func:`load_quantized` refuses it with a clear error.

Multi-process (``jax.distributed``): every process calls :func:`save_quantized` with the same
arguments, on a filesystem all of them see. Process 0 creates the temporary directory and tells the
others its name; every process writes its own shards of the arrays into it (Orbax: replicated
arrays once, sharded arrays by the processes holding the shards); after a barrier process 0 alone
checksums the files, writes the manifest and renames the directory into place; a second barrier
returns on every process once the checkpoint exists. A process that dies mid-save leaves only the
temporary directory (the watchdog ends the others). Loading restores every array replicated on
the current mesh, so a checkpoint saved by N processes loads on 1 and vice versa.

Orbax writes from background threads; the save waits for them with their logging and tracebacks kept
off the terminal, so an interrupted save (SIGINT/SIGTERM) or a full disk ends as one error line.

Loading checks the manifest and its file table (required), every data file's size and checksum (a
truncated, altered or unlisted file is named), the finiteness of every restored parameter, and, given
``model=``, that it was made for that model (config fingerprint, every parameter's shape).

Packed codes are stored as the uint8 arrays the QArray holds (tensorstore has no uint4), so the
bytes on disk equal ``tree_nbytes``. Restoring rebuilds the same pytree (QArray / ActQuantKernel /
RotatedKernel / PermutedKernel leaves with their static metadata: a rotation's seed and axis, its inner
leaf's arrays under the same path, a permutation's order beside them), so logits are identical after a reload. A rotation's untied ``lm_head`` is
accepted for a tied model. Nothing is unpickled.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import pathlib
import re
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from eqjax.core.errors import CompatibilityError, InputError, RuntimeFailure
from eqjax.core.linear import ActQuantKernel
from eqjax.core.pytree import flatten, path_str
from eqjax.core.qarray import (
    Granularity,
    HalfFloat,
    PermutedKernel,
    QArray,
    QArrayError,
    RotatedKernel,
    validate,
    validate_half,
    validate_permuted,
)
from eqjax.core.validate import check_params
from eqjax.distributed.mesh import default_mesh, put, replicated
from eqjax.distributed.runtime import barrier, broadcast_str, is_main_process, set_stage
from eqjax.io.atomic import atomic_directory, check_output_dir, deferred_interrupts
from eqjax.io.hf import CheckpointError
from eqjax.io.orbax_quiet import orbax_quiet, quiet_leftovers
from eqjax.methods.kvquant import KVQuant
from eqjax.models import Model, to_hf_config
from eqjax.models.hf_config import from_hf_config

__all__ = ["save_quantized", "load_quantized", "read_manifest", "FORMAT_VERSION", "model_fingerprint", "check_compatible",
           "recipe_kv", "is_partial_checkpoint", "CHECKPOINT_ENTRIES"]

FORMAT_VERSION = 2
_MANIFEST = "eqjax.json"
_KV_FIELDS = ("key_bits", "value_bits", "outlier_fraction", "sink_tokens", "key_group", "value_group", "key_levels",
              "value_levels", "recent_float")


def _qarray_meta(q: QArray) -> dict[str, Any]:
    g = q.granularity
    return {
        "bits": q.bits,
        "symmetric": q.symmetric,
        "granularity": {"kind": g.kind, "axes": list(g.axes), "group_size": g.group_size},
        "shape": list(q.shape),
        "dtype": jnp.dtype(q.dtype).name,
    }


def _qarray_arrays(prefix: str, q: QArray, out: dict[str, Any]) -> None:
    out[f"{prefix}::values"] = q.values
    out[f"{prefix}::scale"] = q.scale
    if q.zero_point is not None:
        out[f"{prefix}::zero_point"] = q.zero_point


def _is_saved_leaf(x: Any) -> bool:
    return isinstance(x, (QArray, ActQuantKernel, RotatedKernel, PermutedKernel, HalfFloat))


def _encode(path: str, leaf: Any, arrays: dict[str, Any]) -> dict[str, Any]:
    """The manifest entry of one leaf; its arrays go into ``arrays`` under ``path::field`` keys."""
    if isinstance(leaf, RotatedKernel):  # the inner leaf's arrays under the same path, the seed in the manifest
        return {"kind": "rotated", "seed": int(leaf.seed), "axis": int(leaf.axis), "shape": list(leaf.shape),
                "inner": _encode(path, leaf.kernel, arrays)}
    if isinstance(leaf, PermutedKernel):  # the inner leaf's arrays under the same path, the order beside them
        arrays[f"{path}::perm"] = leaf.perm
        return {"kind": "permuted", "axis": int(leaf.axis), "inner": _encode(path, leaf.kernel, arrays)}
    if isinstance(leaf, HalfFloat):  # the 16-bit values as stored; the dtype they stand for in the manifest
        arrays[path] = leaf.values
        return {"kind": "half", "shape": list(leaf.shape), "dtype": jnp.dtype(leaf.dtype).name}
    if isinstance(leaf, QArray):
        _qarray_arrays(path, leaf, arrays)
        return {"kind": "qarray", **_qarray_meta(leaf)}
    if isinstance(leaf, ActQuantKernel):
        _qarray_arrays(path, leaf.weight, arrays)
        if leaf.act_scale is not None:
            arrays[f"{path}::act_scale"] = leaf.act_scale
        return {"kind": "act_quant", "weight": _qarray_meta(leaf.weight), "act_bits": leaf.act_bits,
                "act_granularity": leaf.act_granularity, "static_scale": leaf.act_scale is not None,
                "shape": list(leaf.weight.shape), **({"act_full_range": True} if leaf.act_full_range else {})}
    arrays[path] = leaf
    return {"kind": "array", "shape": _logical_shape(leaf), "dtype": jnp.dtype(leaf.dtype).name}


def _decode(meta: dict[str, Any], arrays: dict[str, Any], path: str, root: pathlib.Path) -> Any:
    """The leaf of one manifest entry (:func:`_encode`'s inverse)."""
    kind = meta["kind"]
    if kind == "array":
        leaf = jnp.asarray(arrays[path])
        want = meta.get("shape")
        if want is not None and list(leaf.shape) != list(want):
            raise CheckpointError(
                f"checkpoint array has the wrong shape ({root}: {path}): expected {tuple(want)}, found {tuple(leaf.shape)}"
            )
        return leaf
    if kind == "half":
        values = _decode({"kind": "array", "shape": meta.get("shape")}, arrays, path, root)
        try:
            return validate_half(HalfFloat(values, jnp.dtype(meta["dtype"])), name=path)
        except (QArrayError, TypeError) as e:
            raise CheckpointError(f"corrupt checkpoint entry ({root}: {path}): {e}") from None
    if kind == "qarray":
        return _build_qarray(meta, arrays, path)
    if kind == "act_quant":
        act = jnp.asarray(arrays[f"{path}::act_scale"]) if meta["static_scale"] else None
        return ActQuantKernel(_build_qarray(meta["weight"], arrays, path), act, int(meta["act_bits"]),
                              meta["act_granularity"], meta.get("act_full_range", False))
    if kind == "rotated" and isinstance(meta.get("inner"), dict) and meta["inner"].get("kind") != "rotated":
        inner = _decode(meta["inner"], arrays, path, root)
        axis = int(meta["axis"])
        if not 0 <= axis < len(inner.shape):
            raise CheckpointError(f"corrupt checkpoint entry ({root}: {path}): rotation axis {axis} of a "
                                  f"{len(inner.shape)}-d weight")
        return RotatedKernel(inner, int(meta["seed"]), axis)
    if kind == "permuted" and isinstance(meta.get("inner"), dict) and meta["inner"].get("kind") in ("qarray", "act_quant"):
        try:
            return validate_permuted(PermutedKernel(_decode(meta["inner"], arrays, path, root),
                                                    jnp.asarray(arrays[f"{path}::perm"]), int(meta["axis"])), name=path)
        except (QArrayError, IndexError, KeyError) as e:
            raise CheckpointError(f"corrupt checkpoint entry ({root}: {path}): {e}") from None
    raise CheckpointError(f"corrupt checkpoint manifest ({root / _MANIFEST}: {path}): unknown leaf kind {kind!r}")


def _logical_shape(leaf: Any) -> list[int]:
    if isinstance(leaf, ActQuantKernel):
        return list(leaf.weight.shape)
    return [int(s) for s in (leaf.shape if isinstance(leaf, (HalfFloat, QArray)) else np.shape(leaf))]


def model_fingerprint(model_or_config: Any) -> str:
    """SHA-256 of a model's config (as HF config.json keys) and of every parameter's path and shape."""

    model = model_or_config if isinstance(model_or_config, Model) else Model(model_or_config)
    shapes = {p: list(s) for p, s in _shape_leaves(model.param_shapes())}
    blob = json.dumps({"config": to_hf_config(model.config), "shapes": shapes}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _shape_leaves(shapes: Any) -> list[tuple[str, tuple[int, ...]]]:
    import jax


    leaves = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))[0]
    return [(path_str(k), tuple(int(d) for d in s)) for k, s in leaves]


def _recipe_info(recipe: Any) -> dict[str, Any]:
    """What the manifest records about the recipe: name, description, repr, KV settings."""
    if recipe is None or isinstance(recipe, str):
        return {"recipe": recipe or "", "recipe_description": "", "recipe_repr": "", "kv": None}
    kv = getattr(recipe, "kv", None)
    return {
        "recipe": recipe.name,
        "recipe_description": getattr(recipe, "description", ""),
        "recipe_repr": repr(recipe),
        "kv": None if kv is None else {f: getattr(kv, f) for f in _KV_FIELDS},
    }


def recipe_kv(manifest: dict[str, Any]) -> Any:
    """The KV-cache quantizer a checkpoint's recipe used at evaluation time (a ``KVQuant``), or None."""
    kv = manifest.get("kv")
    if not kv:
        return None

    return KVQuant(**{k: kv[k] for k in _KV_FIELDS if k in kv})


def _file_table(root: pathlib.Path) -> dict[str, dict[str, Any]]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            out[p.relative_to(root).as_posix()] = {"bytes": p.stat().st_size, "sha256": h.hexdigest()}
    return out


CHECKPOINT_ENTRIES = ("arrays", _MANIFEST)  # a checkpoint's entries besides its marker: only these may be replaced


def _check_params_arg(params: Any) -> None:
    """InputError naming the ``params`` argument unless it is a (nested) dict of arrays."""
    if isinstance(params, Mapping):
        for path, leaf in flatten(params, leaf_type=_is_saved_leaf):
            if not (_is_saved_leaf(leaf) or (hasattr(leaf, "shape") and hasattr(leaf, "dtype"))):
                raise InputError(f"cannot save these params (save_quantized: params {path}): expected an array, "
                                 f"found {type(leaf).__name__}")
        return
    kind, hint = type(params).__name__, ""
    if isinstance(getattr(params, "params", None), Mapping):
        hint = f" (pass its .params: save_quantized(directory, {kind.lower()}.params))"
    elif isinstance(params, tuple) and len(params) == 2 and isinstance(params[1], Mapping):  # quantize_model's pair
        hint = " (pass the qparams of quantize_model's (model, qparams))"
    raise InputError(f"cannot save these params (save_quantized: params): expected a nested dict of arrays, found "
                     f"{kind}{hint}")


_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def _save_failure(e: BaseException, root: pathlib.Path) -> Exception:
    """One-line error for a failed Orbax write: a full disk or file-size limit named as such."""
    m = _OS_ERROR_CODE.search(str(e))
    code = int(m.group(1)) if m else getattr(e, "errno", None)
    if code in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        return RuntimeFailure(f"cannot write the checkpoint ({root}): expected room for its arrays, found {os.strerror(code)} "
                              "(a full disk or a file-size limit); the previous checkpoint, if any, is unchanged")
    return RuntimeFailure(f"cannot write the checkpoint arrays ({root}): {type(e).__name__}: "
                          f"{(str(e).strip().splitlines() or [''])[0][:200]}")


def _write_arrays(ocp: Any, path: pathlib.Path, arrays: dict[str, Any], root: pathlib.Path) -> None:
    """Orbax-save ``arrays`` to ``path`` and wait for its threads, quietly; on any failure or interrupt the
    threads are waited for before the error propagates (nothing writes into a directory being removed)."""
    try:
        with deferred_interrupts(), orbax_quiet():
            ck = ocp.StandardCheckpointer()
            try:
                ck.save(path, arrays)
                ck.wait_until_finished()
            finally:
                with contextlib.suppress(BaseException):
                    ck.close()  # waits for any thread still writing
    except BaseException as e:
        quiet_leftovers()
        if not isinstance(e, Exception) or isinstance(e, (InputError, RuntimeFailure)):
            raise
        raise _save_failure(e, root) from None


def save_quantized(
    directory: str | os.PathLike[str], params: Any, *, recipe: Any = "", model_config: dict | None = None,
    model: Any = None, overwrite: bool = False,
) -> pathlib.Path:
    """Write ``params`` (nested dicts whose leaves are arrays, QArrays or ActQuantKernels) atomically.

    ``recipe``: a :class:`~eqjax.recipes.types.Recipe` (recorded in full, KV settings included) or its name.
    ``model``: the :class:`~eqjax.models.Model` the params belong to (its config and fingerprint are
    recorded so that loading into another model is refused); ``model_config`` (HF config keys) is the
    older way to record the config alone. ``directory`` must be new or empty unless ``overwrite``.
    """
    import orbax.checkpoint as ocp


    root = pathlib.Path(directory).absolute()
    _check_params_arg(params)
    check_output_dir(root, overwrite=overwrite, what="checkpoint directory", replaceable=CHECKPOINT_ENTRIES)
    check_params(params, f"params to save into {root}", allow_int=True)
    arrays: dict[str, Any] = {}
    leaves: dict[str, Any] = {}
    for path, leaf in flatten(params, leaf_type=_is_saved_leaf):
        leaves[path] = _encode(path, leaf, arrays)
    if model is not None:
        model_config = to_hf_config(model.config)
    fingerprint = model_fingerprint(model) if model is not None else None
    if fingerprint is None and model_config is not None:
        try:

            fingerprint = model_fingerprint(from_hf_config(model_config))
        except Exception:  # noqa: BLE001 - a config we cannot rebuild is recorded without a fingerprint
            fingerprint = None

    def manifest(arrays_dir: pathlib.Path) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            **_recipe_info(recipe),
            "model_config": model_config,
            "model_fingerprint": fingerprint,
            "leaves": leaves,
            "files": _file_table(arrays_dir),
        }

    import jax

    if jax.process_count() == 1:
        with atomic_directory(root, overwrite=overwrite, kind="checkpoint") as tmp:
            _write_arrays(ocp, tmp / "arrays", arrays, root)
            (tmp / _MANIFEST).write_text(json.dumps(manifest(tmp / "arrays"), indent=1, allow_nan=False))
        return root
    _save_together(root, _global(arrays), manifest, overwrite)
    return root


def _global(arrays: dict[str, Any]) -> dict[str, Any]:
    """Every array as a global jax.Array on the current mesh (host / single-device leaves replicated)."""
    import jax


    rep = replicated(default_mesh())
    out = {}
    for k, v in arrays.items():
        sh = getattr(v, "sharding", None)
        out[k] = v if isinstance(v, jax.Array) and len(getattr(sh, "device_set", ())) == jax.device_count() else (
            put(v, rep))
    return out


def _save_together(root: pathlib.Path, arrays: dict[str, Any], manifest: Any, overwrite: bool) -> None:
    """The multi-process save (see the module docs); every process calls it."""
    import orbax.checkpoint as ocp


    set_stage(f"saving {root}")

    def write(tmp: pathlib.Path) -> None:
        _write_arrays(ocp, tmp / "arrays", arrays, root)
        barrier("orbax-arrays-written")

    if is_main_process():
        with atomic_directory(root, overwrite=overwrite, kind="checkpoint") as tmp:
            broadcast_str("orbax-tmp", str(tmp))
            write(tmp)
            (tmp / _MANIFEST).write_text(json.dumps(manifest(tmp / "arrays"), indent=1, allow_nan=False))
    else:
        write(pathlib.Path(broadcast_str("orbax-tmp", None)))
    barrier("orbax-committed")
    set_stage("after saving")


def _build_qarray(meta: dict[str, Any], arrays: dict[str, Any], prefix: str) -> QArray:
    g = meta["granularity"]
    q = QArray(
        values=jnp.asarray(arrays[f"{prefix}::values"]),
        scale=jnp.asarray(arrays[f"{prefix}::scale"]),
        zero_point=None if meta["symmetric"] else jnp.asarray(arrays[f"{prefix}::zero_point"]),
        bits=int(meta["bits"]),
        symmetric=bool(meta["symmetric"]),
        granularity=Granularity(g["kind"], tuple(g["axes"]), int(g["group_size"])),
        shape=tuple(meta["shape"]),
        dtype=jnp.dtype(meta["dtype"]),
    )
    return validate(q, name=prefix)


def is_partial_checkpoint(directory: str | os.PathLike[str]) -> bool:
    """True for what an interrupted :func:`save_quantized` leaves: a temporary directory or no manifest."""
    root = pathlib.Path(directory)
    return ".tmp-" in root.name or (root.is_dir() and (root / "arrays").exists() and not (root / _MANIFEST).is_file())


def _verify_files(root: pathlib.Path, table: Any) -> None:
    """Every data file under ``arrays/`` is in the manifest's file table, with its size and SHA-256."""
    mpath = root / _MANIFEST
    if not isinstance(table, dict) or not table:
        raise CheckpointError(
            f"checkpoint without a file table ({mpath}: files): expected the size and SHA-256 of every data file, "
            f"found {'none' if table is None else type(table).__name__ if not isinstance(table, dict) else 'an empty table'}"
            " (re-save it with eqjax quantize)"
        )
    for rel, meta in table.items():
        if not (isinstance(meta, dict) and isinstance(meta.get("bytes"), int) and isinstance(meta.get("sha256"), str)):
            raise CheckpointError(f"corrupt checkpoint manifest ({mpath}: files[{rel!r}]): expected bytes and sha256, "
                                  f"found {meta!r}"[:300])
    arrays = root / "arrays"
    listed = set(table)
    extra = sorted(q.relative_to(arrays).as_posix() for q in arrays.rglob("*")
                   if q.is_file() and q.relative_to(arrays).as_posix() not in listed) if arrays.is_dir() else []
    if extra:
        raise CheckpointError(f"checkpoint data file not in its manifest ({arrays / extra[0]}): expected only the "
                              f"{len(table)} files listed in {_MANIFEST}, found {len(extra)} more")
    for rel, meta in table.items():
        p = arrays / rel
        if not p.is_file():
            raise CheckpointError(f"checkpoint data file missing ({p}): expected {meta['bytes']} bytes, found no file")
        size = p.stat().st_size
        if size != meta["bytes"]:
            raise CheckpointError(
                f"checkpoint data file {'truncated' if size < meta['bytes'] else 'grew'} ({p}): "
                f"expected {meta['bytes']} bytes, found {size}"
            )
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        if h.hexdigest() != meta["sha256"]:
            raise CheckpointError(
                f"checkpoint data file corrupt ({p}): expected SHA-256 {meta['sha256'][:16]}..., found {h.hexdigest()[:16]}..."
            )


def check_compatible(manifest: dict[str, Any], model: Any, *, source: str = "checkpoint") -> None:
    """Refuse a checkpoint made for another model: CompatibilityError naming the config key or the
    parameter path with the expected (model) and found (checkpoint) values."""

    want_cfg = to_hf_config(model.config)
    have_cfg = manifest.get("model_config")
    if isinstance(have_cfg, dict):
        for k in sorted(set(want_cfg) | set(have_cfg)):
            if k in ("dtype", "torch_dtype", "transformers_version"):
                continue
            if want_cfg.get(k) != have_cfg.get(k):
                raise CompatibilityError(
                    f"checkpoint made for another model ({source}: config key {k!r}): "
                    f"expected {want_cfg.get(k)!r} (the model), found {have_cfg.get(k)!r} (the checkpoint)"
                )
    expected = dict(_shape_leaves(model.param_shapes()))
    emb = expected.get("embed/embedding")
    if emb is not None and "lm_head/kernel" not in expected and "lm_head/kernel" in manifest.get("leaves", {}):
        expected["lm_head/kernel"] = tuple(reversed(emb))  # a tied head untied (a rotation does): [D, V]
    leaves = manifest.get("leaves", {})
    for path, meta in leaves.items():
        shape = meta.get("shape") or (meta.get("weight") or {}).get("shape")
        if path not in expected:
            raise CompatibilityError(
                f"checkpoint made for another model ({source}: {path}): expected no such parameter, found one of shape {shape}"
            )
        if shape is not None and tuple(shape) != expected[path]:
            raise CompatibilityError(
                f"checkpoint made for another model ({source}: {path}): expected shape {expected[path]}, found {tuple(shape)}"
            )
    missing = [p for p in expected if p not in leaves]
    if missing:
        raise CompatibilityError(
            f"checkpoint made for another model ({source}: {missing[0]}): expected shape {expected[missing[0]]}, "
            f"found no such parameter ({len(missing)} missing)"
        )
    fp = manifest.get("model_fingerprint")
    if fp and fp != model_fingerprint(model):
        raise CompatibilityError(
            f"checkpoint made for another model ({source}: model_fingerprint): expected {model_fingerprint(model)[:16]}..., "
            f"found {fp[:16]}..."
        )


def read_manifest(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of a checkpoint directory, checked (cheap: no array is read).

    CheckpointError naming the directory for a missing directory, an interrupted save (no manifest),
    a corrupt manifest or an unknown format.
    """
    root = pathlib.Path(directory).absolute()
    if not root.exists():
        raise CheckpointError(f"checkpoint not found ({root}): expected a directory written by eqjax quantize, found nothing")
    if not root.is_dir():
        raise CheckpointError(f"not an eqjax checkpoint ({root}): expected a directory, found a file")
    mpath = root / _MANIFEST
    if not mpath.is_file():
        if is_partial_checkpoint(root):
            raise CheckpointError(
                f"incomplete checkpoint ({root}): expected {_MANIFEST}, found none (the save was interrupted; "
                "the previous checkpoint, if any, is the directory without the .tmp- suffix)"
            )
        raise CheckpointError(f"not an eqjax checkpoint ({root}): expected {_MANIFEST}, found none")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"corrupt checkpoint manifest ({mpath}): {e}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("leaves"), dict):
        raise CheckpointError(f"corrupt checkpoint manifest ({mpath}): expected an object with 'leaves', found {type(manifest).__name__}")
    if manifest.get("format") not in (1, FORMAT_VERSION):
        raise CheckpointError(
            f"unsupported checkpoint format ({mpath}): expected 1 or {FORMAT_VERSION}, found {manifest.get('format')!r}"
        )
    return manifest


def _restore(ocp: Any, path: pathlib.Path) -> dict[str, Any]:
    """The arrays, each replicated on the current mesh (whatever mesh or process count saved them)."""
    import jax


    ck = ocp.StandardCheckpointer()
    tree = ck.metadata(path).item_metadata.tree
    rep = replicated(default_mesh())
    target = {k: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=rep) for k, m in tree.items()}
    return ck.restore(path, target)


def load_quantized(directory: str | os.PathLike[str], *, model: Any = None, verify: bool = True
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(params, manifest)`` from :func:`save_quantized`; the manifest holds the recipe and config.

    ``verify`` checks every data file's size and SHA-256 against the manifest's file table before
    restoring (a manifest without one is refused: a format-1 checkpoint loads only with ``verify=False``); with
    ``model`` the checkpoint must have been made for that model (see :func:`check_compatible`).
    Every problem is a :class:`~eqjax.io.hf.CheckpointError` (or CompatibilityError) naming the file.
    """
    import orbax.checkpoint as ocp


    root = pathlib.Path(directory).absolute()
    manifest = read_manifest(root)
    if model is not None:
        check_compatible(manifest, model, source=str(root))
    if verify:  # a manifest without its file table is refused, never loaded unchecked
        _verify_files(root, manifest.get("files"))
    try:
        arrays = _restore(ocp, root / "arrays")
    except Exception as e:  # noqa: BLE001 - tensorstore/orbax raise many types on damaged data
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot restore the checkpoint arrays ({root / 'arrays'}): {type(e).__name__}: {first}") from None
    params: dict[str, Any] = {}
    for path, meta in manifest["leaves"].items():
        try:
            leaf = _decode(meta, arrays, path, root)
        except KeyError as e:
            raise CheckpointError(f"checkpoint array missing ({root}: {path}): expected {e}, found nothing") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"corrupt checkpoint entry ({root}: {path}): {e}") from None
        node = params
        *heads, last = path.split("/")
        for h in heads:
            node = node.setdefault(h, {})
        node[last] = leaf
    check_params(params, str(root), allow_int=True)
    return params, manifest
