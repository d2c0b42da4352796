"""Hugging Face checkpoints (``config.json`` + safetensors) to eqjax param trees and back.

:func:`load_hf_checkpoint` reads a directory holding ``config.json`` and either one
``*.safetensors`` file or shards listed in ``model.safetensors.index.json`` (never torch, never
pickle); :func:`save_hf_checkpoint` writes float weights (QArrays dequantized) that
``transformers.AutoModelForCausalLM.from_pretrained`` loads. Names map as::

    model.embed_tokens.weight                     -> embed/embedding
    model.layers.{i}.input_layernorm.weight       -> layers_{i}/attn_norm/scale
    model.layers.{i}.self_attn.q_proj.weight      -> layers_{i}/attn/q_proj/kernel   (transposed)
    model.layers.{i}.self_attn.q_norm.weight      -> layers_{i}/attn/q_norm/scale
    model.layers.{i}.post_attention_layernorm.weight -> layers_{i}/mlp_norm/scale
    model.layers.{i}.mlp.gate_proj.weight         -> layers_{i}/mlp/gate_proj/kernel (transposed)
    model.norm.weight                             -> final_norm/scale
    lm_head.weight                                -> lm_head/kernel                  (transposed)
    transformer.h.{i}.attn.c_attn.weight          -> layers_{i}/attn/c_attn/kernel   (GPT-2 Conv1D: as is)

Architectures whose HF tensors are not one-to-one with eqjax's params (loading maps, saving maps back):

* Phi-3: ``self_attn.qkv_proj.weight`` ``[(Hq + 2 Hkv) hd, D]`` is split into q/k/v_proj (rows in
  that order) and ``mlp.gate_up_proj.weight`` ``[2F, D]`` into gate_proj (first F rows) and up_proj,
  so every method sees ordinary projections; saving concatenates them again.
* Gemma: RMSNorm weights ``w`` are stored as ``scale - 1`` (``GemmaRMSNorm`` computes ``x_hat * (1 + w)``).
  eqjax's tree holds the effective ``scale = 1 + w`` (float32 arithmetic, as transformers), so its norm
  is ``x_hat * scale`` like every other norm and SmoothQuant/AWQ folds divide it directly; saving
  writes ``w' = scale - 1``, and transformers' ``1 + w'`` is then exactly eqjax's scale in float32
  whenever the scale is >= 0.5 (else within 1.2e-7). ``w'`` itself may differ from the original ``w``
  in bits below float32's ulp of 1, which ``1 + w`` never saw. With ``dtype=None`` these scales stay
  float32 (``1 + w`` is not exact in bfloat16).

Every problem raises :class:`CheckpointError` naming the file (and tensor) at fault.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from eqjax.errors import InputError
from eqjax.models import Model
from eqjax.models.config import ConfigError, GPT2Config, ModelConfig
from eqjax.models.hf_config import from_hf_config, to_hf_config
from eqjax.numerics import dequantize_leaf

__all__ = ["CheckpointError", "load_hf_checkpoint", "save_hf_checkpoint", "hf_name"]

INDEX_FILE = "model.safetensors.index.json"
_PHI3_PAD = 32000  # transformers' Phi3Config default pad_token_id
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Non-parameter buffers some exporters write; they carry no weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


class CheckpointError(InputError):
    """A checkpoint is missing, malformed, or disagrees with its config (an
    :class:`~eqjax.errors.InputError`, hence a ``ValueError``)."""


Path_ = tuple[str, ...]


# Phi-3's fused tensors; their parts in this order (rows of the HF weight)
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}
_PART_ORDER = {name: i for i, name in enumerate(_FUSED)}


def hf_name(config: ModelConfig, path: Path_) -> str:
    """The Hugging Face tensor name holding the param at ``path``, e.g. ``("layers_0", "attn", "q_proj", "kernel")``.

    For Phi-3's fused projections it is the fused tensor (``...self_attn.qkv_proj.weight``).
    """
    leaf = "weight" if path[-1] in ("kernel", "scale", "embedding") else path[-1]
    if isinstance(config, GPT2Config):
        if path[0].startswith("layers_"):
            return ".".join(("transformer", "h", path[0][len("layers_") :], *path[1:-1], leaf))
        return f"transformer.{path[0]}.{leaf}"
    top = {"embed": "model.embed_tokens", "final_norm": "model.norm", "lm_head": "lm_head"}
    if path[0] in top:
        return f"{top[path[0]]}.{leaf}"
    i = path[0][len("layers_") :]
    part = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "attn": "self_attn", "mlp": "mlp"}
    mid = path[2:-1]
    if config.model_type == "phi3" and len(mid) == 1 and mid[0] in _FUSED:
        mid = (_FUSED[mid[0]],)
    return ".".join(("model", "layers", i, part[path[1]], *mid, leaf))


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One HF tensor and the tree params it holds.

    ``paths``/``shapes``: the params, concatenated along the tree's last axis (several only for fused
    projections). ``transposed``: HF stores ``[out, in]``. ``offset``: tree value = HF value + offset
    (Gemma's norms: 1).
    """

    name: str
    hf_shape: tuple[int, ...]
    paths: tuple[Path_, ...]
    shapes: tuple[tuple[int, ...], ...]
    transposed: bool
    offset: float


def _layout(config: ModelConfig) -> list[_Tensor]:
    """Every HF tensor the config implies (param-tree order; fused parts in the HF row order)."""
    shapes = Model(config).param_shapes()
    leaves = jax.tree.flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))[0]
    groups: dict[str, list[tuple[Path_, tuple[int, ...]]]] = {}
    for keypath, shape in leaves:
        path = tuple(k.key for k in keypath)
        groups.setdefault(hf_name(config, path), []).append((path, tuple(shape)))
    gemma = getattr(config, "norm_style", "llama") == "gemma"
    out = []
    for name, parts in groups.items():
        parts.sort(key=lambda ps: _PART_ORDER.get(ps[0][-2], 0))  # tree leaves come sorted by key: k < q
        paths, pshapes = tuple(p for p, _ in parts), tuple(s for _, s in parts)
        tree_shape = (*pshapes[0][:-1], sum(s[-1] for s in pshapes))
        transposed = paths[0][-1] == "kernel" and not isinstance(config, GPT2Config)
        offset = 1.0 if gemma and paths[0][-1] == "scale" else 0.0
        hf_shape = tuple(reversed(tree_shape)) if transposed else tree_shape
        out.append(_Tensor(name, hf_shape, paths, pshapes, transposed, offset))
    return out


# ---------------------------------------------------------------------------------------------- loading


def _read_config(root: Path) -> tuple[ModelConfig, dict[str, Any]]:
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{root}: no config.json (a Hugging Face checkpoint directory needs one)")
    try:
        raw = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_path}: expected a JSON object, got {type(raw).__name__}")
    try:
        return from_hf_config(raw, source=str(cfg_path)), raw
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


def _weight_files(root: Path) -> dict[str, Path]:
    """Map tensor name -> file for sharded checkpoints, or {"": file} markers for unsharded ones."""
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index (need a 'weight_map'): {e}") from None
        files = {name: root / f for name, f in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise CheckpointError(f"{index} lists shard {f.name}, which is missing from {root}")
        return files
    found = sorted(root.glob("*.safetensors"))
    if not found:
        pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(
                f"{root}: only pickle checkpoints found ({', '.join(pickles)}); eqjax never unpickles "
                "(loading pickle can run arbitrary code). Convert them to safetensors first, e.g. "
                "`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out, safe_serialization=True)`"
            )
        raise CheckpointError(f"{root}: no *.safetensors weights found")
    return {"": f for f in found}


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of one file as numpy (bfloat16 via ml_dtypes); corrupt files raise CheckpointError."""
    from safetensors import SafetensorError, safe_open

    try:
        out: dict[str, np.ndarray] = {}
        with safe_open(str(path), framework="numpy") as f:
            names = list(f.keys())
            bf16 = [n for n in names if f.get_slice(n).get_dtype() == "BF16"]
            for n in names:
                if n not in bf16:
                    out[n] = f.get_tensor(n)
        if bf16:
            out.update(_read_raw(path, bf16))
        return out
    except SafetensorError as e:
        raise CheckpointError(f"{path}: not a valid safetensors file (truncated or corrupt?): {e}") from None
    except (OSError, ValueError, KeyError, TypeError, OverflowError, MemoryError) as e:
        raise CheckpointError(
            f"{path}: not a valid safetensors file (truncated or corrupt?): {type(e).__name__}: {e}"
        ) from None


def _read_raw(path: Path, names: list[str]) -> dict[str, np.ndarray]:
    """bfloat16 tensors (numpy has no bf16 for safetensors.numpy): read from the header's offsets."""
    import ml_dtypes

    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
        base = 8 + n
        out = {}
        for name in names:
            meta = header[name]
            start, end = meta["data_offsets"]
            fh.seek(base + start)
            buf = fh.read(end - start)
            out[name] = np.frombuffer(buf, dtype=ml_dtypes.bfloat16).reshape(meta["shape"])
        return out


def _set(tree: dict[str, Any], path: Path_, value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def load_hf_checkpoint(directory: str | os.PathLike[str], *, dtype: Any = jnp.float32) -> tuple[Model, dict[str, Any]]:
    """Load a Hugging Face checkpoint directory as ``(Model, params)``.

    Args:
      directory: holds ``config.json`` and ``*.safetensors`` (single file, several files, or shards
        listed in ``model.safetensors.index.json``).
      dtype: param dtype (default float32); None keeps the stored dtype.

    Raises:
      CheckpointError: missing directory/config/shard, corrupt file, pickle-only checkpoint,
        unsupported architecture, a tensor whose shape disagrees with the config, missing or
        unexpected tensors.
    """
    root = Path(directory)
    if root.is_file() and root.suffix in PICKLE_SUFFIXES:
        raise CheckpointError(
            f"{root}: pickle checkpoint refused; eqjax never unpickles (loading pickle can run arbitrary code). "
            "Convert it to safetensors first."
        )
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    config, _ = _read_config(root)
    files = _weight_files(root)
    tensors: dict[str, np.ndarray] = {}
    origin: dict[str, Path] = {}
    for f in sorted(set(files.values())):
        for name, arr in _read_safetensors(f).items():
            if name in tensors:
                raise CheckpointError(f"tensor {name} appears in both {origin[name].name} and {f.name}")
            tensors[name], origin[name] = arr, f
    for name, f in files.items():
        if name and name not in tensors:
            raise CheckpointError(f"{root / INDEX_FILE} maps tensor {name} to {f.name}, which does not contain it")
    if isinstance(config, GPT2Config):  # the original GPT-2 upload has no "transformer." prefix
        prefixed = lambda n: n if n.startswith(("transformer.", "lm_head.")) else f"transformer.{n}"  # noqa: E731
        tensors = {prefixed(n): a for n, a in tensors.items()}
        origin = {prefixed(n): f for n, f in origin.items()}

    params: dict[str, Any] = {}
    used: set[str] = set()
    for t in _layout(config):
        name = t.name
        if name not in tensors:
            raise CheckpointError(f"{root}: tensor {name} is missing (needed for {'/'.join(t.paths[0])})")
        arr = tensors[name]
        if tuple(arr.shape) != t.hf_shape:
            raise CheckpointError(
                f"{origin[name]}: tensor {name} has shape {tuple(arr.shape)} but config.json implies {t.hf_shape}"
            )
        if arr.dtype.kind != "f" and arr.dtype.name != "bfloat16":
            raise CheckpointError(
                f"non-float tensor ({origin[name]}: {name}): expected a floating-point dtype, found {arr.dtype.name}"
            )
        used.add(name)
        value = arr.T if t.transposed else arr
        if t.offset:  # in float32, as transformers computes 1 + w.float(); kept float32 (see the module doc)
            value = value.astype(np.float32) + np.float32(t.offset)
        ends = np.cumsum([s[-1] for s in t.shapes])[:-1]
        for path, part in zip(t.paths, np.split(value, ends, axis=-1)):
            _set(params, path, jnp.asarray(part) if dtype is None else jnp.asarray(part.astype(np.float32), dtype=dtype))
    tied_head = "lm_head.weight" if config.tie_word_embeddings else None
    leftover = sorted(n for n in tensors if n not in used and n != tied_head and not n.endswith(_IGNORED_SUFFIXES))
    if leftover:
        shown = ", ".join(leftover[:5]) + (" ..." if len(leftover) > 5 else "")
        raise CheckpointError(f"{root}: {len(leftover)} unexpected tensor(s) the config does not account for: {shown}")
    return Model(config), params


# ---------------------------------------------------------------------------------------------- saving


def _to_float(x: Any) -> np.ndarray:
    """The float32 weight a leaf stands for (quantized leaves dequantized, online rotations folded in)."""
    return np.asarray(dequantize_leaf(x, jnp.float32))


def _get(tree: Mapping[str, Any], path: Path_) -> Any:
    for k in path:
        if not isinstance(tree, Mapping) or k not in tree:
            raise KeyError(k)
        tree = tree[k]
    return tree


def save_hf_checkpoint(
    directory: str | os.PathLike[str],
    model: Model,
    params: Mapping[str, Any],
    *,
    dtype: str = "float32",
    extra_config: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``params`` as ``model.safetensors`` + ``config.json`` that transformers loads.

    QArrays and ActQuantKernels are dequantized and RotatedKernels' rotations folded into the weight
    (the checkpoint is float); a tied model whose params carry an ``lm_head`` (a rotation unties it)
    is written untied. ``dtype`` is
    ``float32``, ``float16`` or ``bfloat16``; ``extra_config`` adds keys to config.json (token ids,
    ...). Returns the directory.
    """
    from safetensors.numpy import save_file

    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
    config = model.config
    if getattr(config, "tie_word_embeddings", False) and "lm_head" in params:
        config = dataclasses.replace(config, tie_word_embeddings=False)
    out: dict[str, np.ndarray] = {}
    for t in _layout(config):
        name, values = t.name, []
        for path, shape in zip(t.paths, t.shapes):
            try:
                value = _to_float(_get(params, path))
            except KeyError:
                raise CheckpointError(f"params have no {'/'.join(path)} (needed for tensor {name})") from None
            if value.shape != shape:
                raise CheckpointError(f"param {'/'.join(path)} has shape {value.shape}, config implies {shape}")
            values.append(value)
        value = np.concatenate(values, axis=-1) if len(values) > 1 else values[0]
        if t.offset:
            value = value - np.float32(t.offset)
        value = value.T if t.transposed else value
        if dtype == "bfloat16":
            import ml_dtypes

            value = value.astype(ml_dtypes.bfloat16)
        out[name] = np.ascontiguousarray(value.astype(np.float16) if dtype == "float16" else value)
    from eqjax.atomic import atomic_path, write_text  # noqa: PLC0415

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    hf_cfg = {**(extra_config or {}), **to_hf_config(config), "dtype": dtype}
    pad = hf_cfg.get("pad_token_id", _PHI3_PAD)
    if getattr(config, "model_type", None) == "phi3" and pad is not None and int(pad) >= config.vocab:
        hf_cfg["pad_token_id"] = None  # a pad id (Phi3Config's default: 32000) must index the embedding table
    # each file is replaced atomically (temporary file + fsync + rename); weights first, config last
    with atomic_path(root / "model.safetensors") as tmp:
        if dtype == "bfloat16":
            _save_raw(tmp, out)
        else:
            save_file(out, str(tmp), metadata={"format": "pt"})
    write_text(root / "config.json", json.dumps(hf_cfg, indent=2, sort_keys=True))
    return root


def _save_raw(path: Path, tensors: Mapping[str, np.ndarray]) -> None:
    """Write a safetensors file directly (needed for bfloat16, which safetensors.numpy cannot save)."""
    codes = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, arr in tensors.items():
        header[name] = {
            "dtype": codes[arr.dtype.name],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * ((-len(blob)) % 8)
    with open(path, "wb") as fh:
        fh.write(len(blob).to_bytes(8, "little"))
        fh.write(blob)
        for arr in tensors.values():
            fh.write(np.ascontiguousarray(arr).tobytes())
