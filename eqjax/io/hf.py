"""Hugging Face checkpoints (``config.json`` + safetensors) to eqjax param trees and back.

:func:`load_hf_checkpoint` reads a directory holding ``config.json`` and either the shards listed
in ``model.safetensors.index.json`` or, without an index, every ``*.safetensors`` file (never torch,
never pickle; a tensor in two files is an error naming both; each file's header is checked against
the file before its data is read); :func:`save_hf_checkpoint` writes float weights (QArrays dequantized) that
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
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from eqjax.core.numerics import dequantize_leaf
from eqjax.io.atomic import atomic_path, write_text
from eqjax.io.safetensors_file import (
    FLOAT_DTYPE_NAMES,
    CheckpointError,
    DuplicateKey,
    LazyTensors,
    read_tensors,
    unique_keys,
    write_safetensors,
)
from eqjax.models import Model
from eqjax.models.config import ConfigError, GPT2Config, ModelConfig
from eqjax.models.hf_config import from_hf_config, to_hf_config

__all__ = ["CheckpointError", "load_hf_checkpoint", "stream_hf_checkpoint", "StreamedParams", "save_hf_checkpoint", "hf_name", "hf_layout", "HFTensor",
           "read_checkpoint", "read_config", "assemble_params", "float_tensors", "write_safetensors"]

INDEX_FILE = "model.safetensors.index.json"
_PHI3_PAD = 32000  # transformers' Phi3Config default pad_token_id
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Non-parameter buffers some exporters write; they carry no weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


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
class HFTensor:
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


def hf_layout(config: ModelConfig) -> list[HFTensor]:
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
        out.append(HFTensor(name, hf_shape, paths, pshapes, transposed, offset))
    return out


# ---------------------------------------------------------------------------------------------- loading


def read_config(root: Path) -> tuple[ModelConfig, dict[str, Any]]:
    """``(config, config.json as read)`` of the HF directory ``root``; CheckpointError naming the file when it is
    absent or bad."""
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


def _read_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a safetensors index: tensor name -> shard file name, every entry checked."""
    bad = f"bad safetensors index ({index})"
    try:
        raw = json.loads(index.read_bytes(), object_pairs_hook=unique_keys)
    except DuplicateKey as e:
        raise CheckpointError(f"{bad}: expected each tensor once, found {e} twice") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{bad}: expected JSON, found a file that is not valid JSON ({e})") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        found = type(raw).__name__ if not isinstance(raw, dict) else repr(weight_map)[:60]
        raise CheckpointError(f"{bad}: expected an object with a non-empty 'weight_map' object, found {found}")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard or not shard.endswith(".safetensors"):
            raise CheckpointError(
                f"{bad}: expected a .safetensors file name in this directory for tensor {name}, found {shard!r}"
            )
    return weight_map


def _weight_files(root: Path) -> tuple[list[Path], dict[str, Path]]:
    """``(every weight file to read, tensor name -> shard named by the index)``; the map is empty without an
    index. With an index its shards are read (a ``*.safetensors`` file it does not name is ignored with a
    warning); without one, every ``*.safetensors`` file of the directory is read."""
    found = sorted(root.glob("*.safetensors"))
    for f in found:
        if not f.is_file():
            raise CheckpointError(f"weight file ({f}): expected a regular file, found {_kind(f)}")
    index = root / INDEX_FILE
    if not index.exists():
        if found:
            return found, {}
        pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(
                f"{root}: only pickle checkpoints found ({', '.join(pickles)}); eqjax never unpickles "
                "(loading pickle can run arbitrary code). Convert them to safetensors first, e.g. "
                "`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out, safe_serialization=True)`"
            )
        raise CheckpointError(f"{root}: no *.safetensors weights found")
    if not index.is_file():
        raise CheckpointError(f"safetensors index ({index}): expected a regular file, found {_kind(index)}")
    weight_map = _read_index(index)
    shards = sorted(set(weight_map.values()))
    for name in shards:
        f = root / name
        if not f.exists():
            raise CheckpointError(f"{index} lists shard {name}, which is missing from {root}")
        if not f.is_file():
            raise CheckpointError(f"shard {name} listed in {index}: expected a regular file, found {_kind(f)}")
    unlisted = [f.name for f in found if f.name not in weight_map.values()]
    if unlisted:
        warnings.warn(
            f"{root}: ignoring {', '.join(unlisted)}: not a shard listed in {INDEX_FILE} (only listed shards are read)",
            stacklevel=3,
        )
    return [root / s for s in shards], {n: root / f for n, f in weight_map.items()}


def _kind(p: Path) -> str:
    """What ``p`` is, for messages: ``a directory``, ``a special file``, ``nothing``."""
    return "a directory" if p.is_dir() else "nothing" if not p.exists() else "a special file"


def _set(tree: dict[str, Any], path: Path_, value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def read_checkpoint(directory: str | os.PathLike[str], *, lazy: bool = False
                    ) -> tuple[ModelConfig, dict[str, Any], dict[str, np.ndarray], dict[str, Path]]:
    """``(config, config.json as read, tensors by HF name, tensor name -> file)`` of an HF directory, every
    file and index entry checked (see :func:`load_hf_checkpoint`); tensors keep their stored dtype.
    ``lazy``: the tensors are memory-mapped (:func:`eqjax.io.safetensors_file.read_tensors`); every header
    is still checked before this returns."""
    root = Path(directory)
    if root.is_file() and root.suffix in PICKLE_SUFFIXES:
        raise CheckpointError(
            f"{root}: pickle checkpoint refused; eqjax never unpickles (loading pickle can run arbitrary code). "
            "Convert it to safetensors first."
        )
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    config, raw = read_config(root)
    files, index_map = _weight_files(root)
    tensors: dict[str, Any] = {}  # an array, or (lazy) a LazyTensors entry
    origin: dict[str, Path] = {}
    for f in files:
        read = read_tensors(f, lazy=lazy)
        for name in read:
            if name in tensors:
                raise CheckpointError(
                    f"duplicate tensor ({origin[name]}, {f}): expected each tensor in one weight file, "
                    f"found {name} in both"
                )
            tensors[name], origin[name] = (read.entries[name] if lazy else read[name]), f
    for name, f in index_map.items():
        if origin.get(name) != f:
            where = f"found it in {origin[name].name}" if name in origin else "found it in no shard"
            raise CheckpointError(f"tensor {name} ({root / INDEX_FILE}): expected in {f.name}, {where}")
    if isinstance(config, GPT2Config):  # the original GPT-2 upload has no "transformer." prefix
        prefixed = lambda n: n if n.startswith(("transformer.", "lm_head.")) else f"transformer.{n}"  # noqa: E731
        tensors = {prefixed(n): a for n, a in tensors.items()}
        origin = {prefixed(n): f for n, f in origin.items()}
    return config, raw, (LazyTensors(tensors) if lazy else tensors), origin


Taker = Callable[["HFTensor", bool], "tuple[list[Any], set[str]] | None"]
"""Decodes one HF tensor itself: ``(the tree params it holds, in the tensor's part order; the stored names
it consumed)``, or None to read it as a float tensor. With its second argument False it only checks the
stored tensors (names, dtypes, shapes) and gives None parts."""


def assemble_params(config: ModelConfig, tensors: Mapping[str, np.ndarray], origin: Mapping[str, Path], root: Path,
                    *, dtype: Any = jnp.float32, take: Taker | None = None,
                    only: Callable[["HFTensor"], bool] | None = None) -> dict[str, Any]:
    """The param tree of ``config`` from HF ``tensors`` (float, transposed and split as the layout says);
    ``take`` decodes the tensors it recognises itself (quantized formats). Every tensor must be used.
    ``only``: read (or decode) just the tensors it accepts; every tensor is still checked against the config."""
    params: dict[str, Any] = {}
    used: set[str] = set()
    for t in hf_layout(config):
        taken = take(t, only is None or only(t)) if take is not None else None
        if taken is not None:
            parts, names = taken
            used |= names
            for path, part in zip(t.paths, parts):
                _set(params, path, part)
            continue
        name = t.name
        if name not in tensors:
            raise CheckpointError(f"{root}: tensor {name} is missing (needed for {'/'.join(t.paths[0])})")
        arr = tensors[name]
        if tuple(arr.shape) != t.hf_shape:
            raise CheckpointError(
                f"{origin[name]}: tensor {name} has shape {tuple(arr.shape)} but config.json implies {t.hf_shape}"
            )
        if arr.dtype.kind != "f" and arr.dtype.name not in FLOAT_DTYPE_NAMES:
            raise CheckpointError(
                f"non-float tensor ({origin[name]}: {name}): expected a floating-point dtype, found {arr.dtype.name}"
            )
        used.add(name)
        if only is not None and not only(t):
            continue
        value = arr.T if t.transposed else arr
        if t.offset:  # in float32, as transformers computes 1 + w.float(); kept float32 (see the module doc)
            value = value.astype(np.float32) + np.float32(t.offset)
        ends = np.cumsum([s[-1] for s in t.shapes])[:-1]
        for path, part in zip(t.paths, np.split(value, ends, axis=-1)):
            x = jnp.asarray(part)  # converted by XLA: no float32 numpy copy beside the stored and the final arrays
            _set(params, path, x if dtype is None else x.astype(dtype))
        arr = value = part = x = None  # a memory-mapped tensor's pages go now, not at the next float tensor
    tied_head = "lm_head.weight" if config.tie_word_embeddings else None
    leftover = sorted(n for n in tensors if n not in used and n != tied_head and not n.endswith(_IGNORED_SUFFIXES))
    if leftover:
        shown = ", ".join(leftover[:5]) + (" ..." if len(leftover) > 5 else "")
        raise CheckpointError(f"{root}: {len(leftover)} unexpected tensor(s) the config does not account for: {shown}")
    return params


def load_hf_checkpoint(directory: str | os.PathLike[str], *, dtype: Any = jnp.float32) -> tuple[Model, dict[str, Any]]:
    """Load a Hugging Face float checkpoint directory as ``(Model, params)``.

    Args:
      directory: holds ``config.json`` and ``*.safetensors`` (single file, several files, or shards
        listed in ``model.safetensors.index.json``).
      dtype: param dtype (default float32); None keeps the stored dtype.

    Raises:
      CheckpointError: missing directory/config/shard, corrupt file, pickle-only checkpoint,
        unsupported architecture, a tensor whose shape disagrees with the config, missing or
        unexpected tensors, a quantized checkpoint (``quantization_config``: read those with
        :func:`eqjax.io.load.load_model`).
    """
    # memory-mapped: each stored tensor is read as it is converted and released after, so loading holds the
    # params and one tensor, not a second copy of the checkpoint
    config, raw, tensors, origin = read_checkpoint(directory, lazy=True)
    _refuse_quantized(directory, raw)
    return Model(config), assemble_params(config, tensors, origin, Path(directory), dtype=dtype)


def _refuse_quantized(directory: str | os.PathLike[str], raw: Mapping[str, Any]) -> None:
    qc = raw.get("quantization_config")
    if isinstance(qc, dict):
        raise CheckpointError(f"quantized checkpoint ({Path(directory) / 'config.json'}: quantization_config, "
                              f"quant_method {qc.get('quant_method')!r}): expected float weights here; load it with "
                              "eqjax.io.load_model (or 'eqjax eval --checkpoint')")


@dataclasses.dataclass(frozen=True)
class StreamedParams:
    """A model's params read on demand: every param ``paths`` and ``load(paths) -> {path: array}``."""

    paths: tuple[str, ...]
    load: Callable[[Any], dict[str, Any]]
    nbytes: int = 0
    """Bytes of the stored tensors."""


def stream_hf_checkpoint(directory: str | os.PathLike[str], *, dtype: Any = jnp.float32
                         ) -> tuple[Model, StreamedParams]:
    """``(Model, StreamedParams)`` of an HF float checkpoint read on demand: ``load(paths)`` returns those
    params (``dtype``) read from the memory-mapped files, nothing else resident. Every file, header, index
    entry and tensor shape is checked against the config before this returns (the errors of
    :func:`load_hf_checkpoint`), so a bad checkpoint is refused before any work."""
    root = Path(directory)
    config, raw, tensors, origin = read_checkpoint(root, lazy=True)
    _refuse_quantized(root, raw)
    return Model(config), stream_params(config, tensors, origin, root, dtype=dtype)


def stream_params(config: ModelConfig, tensors: Any, origin: Mapping[str, Path], root: Path, *, dtype: Any = jnp.float32,
                  take: Taker | None = None) -> StreamedParams:
    """:func:`assemble_params` on demand over memory-mapped ``tensors`` (``read_checkpoint(lazy=True)``):
    every tensor is checked now, none read; ``load(paths)`` reads (``take``: decodes) just the tensors
    holding those paths."""
    assemble_params(config, tensors, origin, root, take=take, only=lambda t: False)  # checks every tensor, reads none
    paths = ["/".join(p) for t in hf_layout(config) for p in t.paths]

    def load(wanted: Any) -> dict[str, Any]:
        want = set(wanted)
        tree = assemble_params(config, tensors, origin, root, dtype=dtype, take=take,
                               only=lambda t: any("/".join(p) in want for p in t.paths))
        return {p: _get(tree, tuple(p.split("/"))) for p in wanted}

    nbytes = sum(int(np.prod(tensors.shape(n), dtype=np.int64)) * tensors.entries[n][1].itemsize for n in tensors)
    return StreamedParams(tuple(paths), load, nbytes)


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


Writer = Callable[[HFTensor, list[Any], str], "dict[str, np.ndarray] | None"]
"""Encodes one HF tensor itself from its tree params (in part order) and the file dtype: ``{stored name:
array}``, or None to write it as a float tensor."""

FILE_DTYPES = ("float32", "float16", "bfloat16")


def cast_float(value: np.ndarray, dtype: str) -> np.ndarray:
    """``value`` as the float file dtype ``dtype`` (one of :data:`FILE_DTYPES`), C-contiguous."""
    import ml_dtypes

    target = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    return np.ascontiguousarray(np.asarray(value, np.float32).astype(target))


def float_tensors(config: ModelConfig, params: Mapping[str, Any], dtype: str = "float32", *,
                  write: Writer | None = None, only: Callable[[HFTensor], bool] | None = None) -> dict[str, np.ndarray]:
    """``{HF name: array}`` for every tensor of ``config``'s layout (``only``: those it accepts): float
    (quantized leaves dequantized, rotations folded in) unless ``write`` encodes the tensor itself."""
    if dtype not in FILE_DTYPES:
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
    out: dict[str, np.ndarray] = {}
    for t in hf_layout(config):
        if only is not None and not only(t):
            continue
        leaves = []
        for path, shape in zip(t.paths, t.shapes):
            try:
                leaf = _get(params, path)
            except KeyError:
                raise CheckpointError(f"params have no {'/'.join(path)} (needed for tensor {t.name})") from None
            if tuple(leaf.shape) != shape:
                raise CheckpointError(f"param {'/'.join(path)} has shape {tuple(leaf.shape)}, config implies {shape}")
            leaves.append(leaf)
        encoded = write(t, leaves, dtype) if write is not None else None
        if encoded is not None:
            out.update(encoded)
            continue
        values = [_to_float(x) for x in leaves]
        value = np.concatenate(values, axis=-1) if len(values) > 1 else values[0]
        if t.offset:
            value = value - np.float32(t.offset)
        out[t.name] = cast_float(value.T if t.transposed else value, dtype)
    return out


def untied(config: ModelConfig, params: Mapping[str, Any]) -> ModelConfig:
    """``config``, untied where the params carry their own ``lm_head`` (a rotation unties a tied model)."""
    if getattr(config, "tie_word_embeddings", False) and "lm_head" in params:
        return dataclasses.replace(config, tie_word_embeddings=False)
    return config


def hf_config_dict(config: ModelConfig, dtype: str, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """config.json's object for ``config`` with ``dtype`` and the ``extra`` keys."""
    hf_cfg = {**(extra or {}), **to_hf_config(config), "dtype": dtype}
    pad = hf_cfg.get("pad_token_id", _PHI3_PAD)
    if getattr(config, "model_type", None) == "phi3" and pad is not None and int(pad) >= config.vocab:
        hf_cfg["pad_token_id"] = None  # a pad id (Phi3Config's default: 32000) must index the embedding table
    return hf_cfg


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
    config = untied(model.config, params)
    out = float_tensors(config, params, dtype)
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    # each file is replaced atomically (temporary file + fsync + rename); weights first, config last
    with atomic_path(root / "model.safetensors") as tmp:
        write_safetensors(tmp, out)
    write_text(root / "config.json", json.dumps(hf_config_dict(config, dtype, extra_config), indent=2, sort_keys=True))
    return root
