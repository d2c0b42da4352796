"""Orbax checkpoints of (quantized) param trees, with the recipe that made them.

Layout of a checkpoint directory::

    <dir>/arrays/      Orbax StandardCheckpointer tree: a flat {"path::field": array} dict
    <dir>/eqjax.json   manifest: format version, recipe, model config, each leaf's kind + static metadata

Packed codes are stored as the uint8 arrays the QArray holds (tensorstore has no uint4), so the
bytes on disk equal ``tree_nbytes``. Restoring rebuilds the same pytree (QArray / ActQuantKernel
leaves with their static metadata), so logits are identical after a reload. Nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import jax.numpy as jnp
import numpy as np

from eqjax.linear import ActQuantKernel
from eqjax.pytree import flatten
from eqjax.qarray import Granularity, QArray, validate

__all__ = ["save_quantized", "load_quantized", "FORMAT_VERSION"]

FORMAT_VERSION = 1
_MANIFEST = "eqjax.json"


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


def save_quantized(
    directory: str | os.PathLike[str], params: Any, *, recipe: str = "", model_config: dict | None = None
) -> pathlib.Path:
    """Write ``params`` (nested dicts whose leaves are arrays, QArrays or ActQuantKernels)."""
    import orbax.checkpoint as ocp

    root = pathlib.Path(directory).absolute()
    if root.exists() and any(root.iterdir()):
        raise FileExistsError(f"checkpoint directory {root} is not empty")
    root.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, Any] = {}
    leaves: dict[str, Any] = {}
    for path, leaf in flatten(params):
        if isinstance(leaf, QArray):
            leaves[path] = {"kind": "qarray", **_qarray_meta(leaf)}
            _qarray_arrays(path, leaf, arrays)
        elif isinstance(leaf, ActQuantKernel):
            leaves[path] = {
                "kind": "act_quant",
                "weight": _qarray_meta(leaf.weight),
                "act_bits": leaf.act_bits,
                "act_granularity": leaf.act_granularity,
                "static_scale": leaf.act_scale is not None,
            }
            _qarray_arrays(path, leaf.weight, arrays)
            if leaf.act_scale is not None:
                arrays[f"{path}::act_scale"] = leaf.act_scale
        else:
            leaves[path] = {"kind": "array"}
            arrays[path] = leaf
    ck = ocp.StandardCheckpointer()
    ck.save(root / "arrays", arrays)
    ck.wait_until_finished()
    manifest = {"format": FORMAT_VERSION, "recipe": recipe, "model_config": model_config, "leaves": leaves}
    (root / _MANIFEST).write_text(json.dumps(manifest, indent=1))
    return root


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


def load_quantized(directory: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(params, manifest)`` from :func:`save_quantized`; the manifest holds the recipe and config."""
    import orbax.checkpoint as ocp

    root = pathlib.Path(directory).absolute()
    mpath = root / _MANIFEST
    if not mpath.is_file():
        raise FileNotFoundError(f"{root} is not an eqjax checkpoint (no {_MANIFEST})")
    try:
        manifest = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{mpath}: corrupt manifest: {e}") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise ValueError(f"{mpath}: unsupported checkpoint format {manifest.get('format')!r}")
    arrays = ocp.StandardCheckpointer().restore(root / "arrays")
    params: dict[str, Any] = {}
    for path, meta in manifest["leaves"].items():
        try:
            if meta["kind"] == "array":
                leaf: Any = jnp.asarray(arrays[path])
            elif meta["kind"] == "qarray":
                leaf = _build_qarray(meta, arrays, path)
            elif meta["kind"] == "act_quant":
                act = jnp.asarray(arrays[f"{path}::act_scale"]) if meta["static_scale"] else None
                leaf = ActQuantKernel(_build_qarray(meta["weight"], arrays, path), act, int(meta["act_bits"]),
                                      meta["act_granularity"])
            else:
                raise ValueError(f"unknown leaf kind {meta['kind']!r}")
        except KeyError as e:
            raise ValueError(f"{root}: array {e} of parameter {path!r} is missing") from None
        node = params
        *heads, last = path.split("/")
        for h in heads:
            node = node.setdefault(h, {})
        node[last] = leaf
    return params, manifest


