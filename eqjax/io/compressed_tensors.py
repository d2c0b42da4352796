"""compressed-tensors checkpoints: the Hugging Face quantized format that llm-compressor writes and vLLM,
SGLang and transformers (with the ``compressed-tensors`` package) load.

A directory holds config.json with a ``quantization_config`` (``quant_method: compressed-tensors``), the
weights in ``model.safetensors`` and, when given, the tokenizer and generation config. Each quantized
linear ``P`` (HF weight ``P.weight`` of shape ``[out, in]``) is stored as:

* ``pack-quantized`` (weight-only, 4 or 8 bits): ``P.weight_packed`` int32 ``[out, ceil(in * bits / 32)]``
  (the unsigned codes, ``32 / bits`` per word along ``in``, first in the lowest bits), ``P.weight_scale``
  ``[out, groups]`` (``[out, 1]`` per channel), ``P.weight_shape`` int64 ``[out, in]`` and, asymmetric
  only, ``P.weight_zero_point`` int32 ``[ceil(out * bits / 32), groups]`` (packed along ``out``).
* ``int-quantized`` (W8A8): ``P.weight`` int8 ``[out, in]``, ``P.weight_scale`` ``[out, 1]``; activations
  int8 per token (dynamic) or per tensor with a static ``P.input_scale`` ``[1]``.

The format's int activations are quantized by the package's rule: ``scale = absmax / 127.5`` (dynamic) and
codes ``round(x / scale)`` clipped to ``[-128, 127]``. eqjax reads every int-quantized directory onto that
grid (``ActQuantKernel(act_full_range=True)``), so its evaluation of a directory agrees with the package's.
A W8A8 model eqjax quantized on its own grid (``absmax / 127`` in ``[-127, 127]``) is written unchanged:
its weights and static scales are the same numbers, and its activations are computed on the package's grid
once the directory is read, by eqjax or by transformers.

The format's integers are signed: ``q`` in ``[-2**(b-1), 2**(b-1) - 1]`` with ``x = (q - zp) * scale``, and
packing adds ``2**(b-1)``. eqjax's unsigned codes and zero points (:mod:`eqjax.core.qarray`) are exactly the
packed unsigned values, so writing and reading move integers without a float detour.

A ``P.weight_g_idx`` (each input's group: ``actorder: group``, which older llm-compressor releases wrote and
the package dropped in 0.20) is read as a :class:`~eqjax.core.qarray.PermutedKernel` (the codes' inputs in
group order, the input gathered at use); such a weight is not written here (:mod:`eqjax.io.gptq` writes it).

Groups must divide ``in`` in this format (its loaders reshape ``in`` into whole groups). A group layout
whose last group is shorter (``576 = 4 x 128 + 64``) is written exactly with groups of ``gcd(group, in)``,
each scale repeated: the same values, more scale bytes (:func:`save_compressed_tensors` reports it).

The layout is written with numpy rather than the ``compressed-tensors`` package, which needs torch; the
tests decompress what eqjax writes with that package and load it in transformers.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping

import jax.numpy as jnp
import numpy as np

from eqjax.core.qarray import (
    ActQuantKernel,
    PermutedKernel,
    QArray,
    RotatedKernel,
    per_channel,
    per_group,
    per_tensor,
    validate,
)
from eqjax.io.hf import (
    HFTensor,
    StreamedParams,
    Taker,
    assemble_params,
    cast_float,
    float_tensors,
    hf_config_dict,
    read_checkpoint,
    stream_params,
    untied,
)
from eqjax.io.hf_quantized import (
    TOKENIZER_FILES,
    WEIGHT_BITS,
    FormatError,
    group_order,
    pack_codes,
    pack_int32,
    permuted,
    recipe_refusal,
    save_streamed,
    unpack_int32,
    unsigned_codes,
    write_directory,
)
from eqjax.io.stream_ledger import StreamLedger
from eqjax.models import Model

__all__ = ["FORMAT", "FormatError", "check_recipe", "is_compressed_tensors", "load_compressed_tensors",
           "save_compressed_tensors", "save_compressed_tensors_streamed", "TOKENIZER_FILES", "WEIGHT_BITS"]

_PIECE = 1 << 22
"""Codes of a 2..4-bit weight unpacked at a time while it is read (an LM head's 5e8 codes are never unpacked
whole)."""

FORMAT = "compressed-tensors"


def check_recipe(recipe: Any) -> None:
    """Refuse, before any work, a recipe whose result the format cannot hold, naming the recipe and why:
    KV-cache quantization, online rotations, widths other than 4 / 8 bits, activations other than int8 (with
    int8 weights), quantized embeddings, no weight quantization."""
    recipe_refusal(recipe, FORMAT, activations=True)


# ------------------------------------------------------------------------------------------- packing


# --------------------------------------------------------------------------------------------- writing


def _weight_scheme(q: QArray, where: str) -> tuple[dict[str, Any], int]:
    """The format's weight arguments for a ``[in, out]`` QArray and the group size written (0: none)."""
    g, (k, _) = q.granularity.normalized(2), q.shape
    base = {"num_bits": q.bits, "type": "int", "symmetric": bool(q.symmetric), "dynamic": False, "group_size": None,
            "actorder": None, "observer": "minmax"}
    if q.bits not in WEIGHT_BITS:
        raise FormatError(f"{where}: {q.bits}-bit weights; the {FORMAT} kernels take 4 or 8 bits")
    if g.kind == "tensor":
        return {**base, "strategy": "tensor"}, 0
    if g.kind == "channel" and g.axes == (1,):
        return {**base, "strategy": "channel"}, 0
    if g.kind == "group" and g.axes == (0,):
        size = math.gcd(g.group_size, k) if k % g.group_size else g.group_size
        return {**base, "strategy": "group", "group_size": size}, size
    raise FormatError(f"{where}: scales {q.granularity} on a [in, out] weight; the format holds per-tensor, "
                      "per-output-channel or input-group scales")


def _scales(q: QArray, size: int, dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
    """``(scale [out, groups], unsigned zero point [out, groups] or None)``, groups of ``size`` (0: as stored)."""
    s = np.asarray(q.scale, np.float32).T
    z = None if q.zero_point is None else np.asarray(q.zero_point).T
    if size and q.granularity.group_size != size:  # a ragged last group, written as groups of `size`
        rep, n = q.granularity.group_size // size, q.shape[0] // size
        s = np.repeat(s, rep, axis=1)[:, :n]
        z = None if z is None else np.repeat(z, rep, axis=1)[:, :n]
    if s.shape[1] == 1 and q.granularity.kind == "tensor":
        s, z = s[:1, :1].reshape(1), None if z is None else z[:1, :1].reshape(1)
    return cast_float(s, dtype), z


def _encode(name: str, parts: list[Any], dtype: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Stored tensors and scheme of one quantized HF linear from its tree parts (fused parts concatenated on out)."""
    where = f"{name} ({FORMAT})"
    if any(isinstance(p, PermutedKernel) for p in parts):
        raise FormatError(f"{where}: activation-ordered groups (inputs in another order); the compressed-tensors "
                          "package no longer reads a group index (actorder group, removed in its 0.20): write the "
                          "checkpoint as gptq, which keeps g_idx")
    act = [p for p in parts if isinstance(p, ActQuantKernel)]
    if act and len(act) != len(parts):
        raise FormatError(f"{where}: fused parts mix quantized and float activations")
    qs = [p.weight if isinstance(p, ActQuantKernel) else p for p in parts]
    schemes = [_weight_scheme(q, where) for q in qs]
    if len({json.dumps(s, sort_keys=True) for s, _ in schemes}) != 1:
        raise FormatError(f"{where}: fused parts quantized differently ({', '.join(str(q.granularity) for q in qs)})")
    weights, size = schemes[0]
    stem = name[: -len(".weight")]
    u = unsigned_codes(qs[0]).T if len(qs) == 1 else np.concatenate([unsigned_codes(q).T for q in qs], axis=0)  # [out, in]
    sz = [_scales(q, size, dtype) for q in qs]
    scale = np.concatenate([s for s, _ in sz], axis=0) if weights["strategy"] != "tensor" else sz[0][0]
    if weights["strategy"] == "tensor" and len(qs) > 1:
        raise FormatError(f"{where}: fused parts with a per-tensor scale each; the format has one scale per tensor")
    out: dict[str, np.ndarray] = {}
    scheme: dict[str, Any] = {"weights": weights, "input_activations": None, "output_activations": None}
    if act:
        a = act[0]
        if any((p.act_scale is None) != (a.act_scale is None) or p.act_granularity != a.act_granularity for p in act):
            raise FormatError(f"{where}: fused parts quantize their activations differently")
        if not weights["symmetric"] or qs[0].bits != 8:
            raise FormatError(f"{where}: int8 activations need symmetric int8 weights in the format's int-quantized layout")
        static = a.act_scale is not None
        strategy = "token" if a.act_granularity == "token" else "tensor"
        if static and strategy != "tensor":
            raise FormatError(f"{where}: static per-token activation scales; the format's static scales are per tensor")
        scheme["input_activations"] = {"num_bits": a.act_bits, "type": "int", "symmetric": True, "dynamic": not static,
                                       "strategy": strategy, "group_size": None, "actorder": None,
                                       "observer": "minmax" if static else None}
        if static:
            if len({float(np.asarray(p.act_scale)) for p in act}) != 1:
                raise FormatError(f"{where}: fused parts with different static activation scales")
            out[f"{stem}.input_scale"] = cast_float(np.asarray(a.act_scale, np.float32).reshape(1), dtype)
        out[f"{stem}.weight"] = np.ascontiguousarray(np.bitwise_xor(u, np.uint8(0x80)).view(np.int8))  # u - 128
        out[f"{stem}.weight_scale"] = scale
        return out, {**scheme, "format": "int-quantized"}
    out[f"{stem}.weight_packed"] = np.ascontiguousarray(pack_int32(u, weights["num_bits"]))
    out[f"{stem}.weight_scale"] = scale
    out[f"{stem}.weight_shape"] = np.asarray(u.shape, np.int64)
    if not weights["symmetric"] and weights["strategy"] == "tensor":  # one signed zero point, not packed
        out[f"{stem}.weight_zero_point"] = (sz[0][1].astype(np.int32) - 2 ** (qs[0].bits - 1)).astype(np.int8)
    elif not weights["symmetric"]:  # packed along out, as the format's group and channel zero points
        zp = np.concatenate([z for _, z in sz], axis=0)
        out[f"{stem}.weight_zero_point"] = np.ascontiguousarray(pack_int32(zp.T, weights["num_bits"]).T)
    return out, {**scheme, "format": "pack-quantized"}


def _module(name: str) -> str:
    return name[: -len(".weight")]


def quantization_config(schemes: Mapping[str, dict[str, Any]], ignore: list[str]) -> dict[str, Any]:
    """config.json's ``quantization_config`` for ``{module name: scheme}``: one group per distinct scheme
    (targets ``Linear`` when a single scheme covers every quantized linear, else the module names)."""
    by_scheme: dict[str, list[str]] = {}
    for module, scheme in schemes.items():
        by_scheme.setdefault(json.dumps(scheme, sort_keys=True), []).append(module)
    groups = {}
    for i, (key, modules) in enumerate(by_scheme.items()):
        scheme = json.loads(key)
        targets = ["Linear"] if len(by_scheme) == 1 else sorted(modules)
        groups[f"group_{i}"] = {"targets": targets, **scheme}
    formats = {g["format"] for g in groups.values()}
    return {"quant_method": "compressed-tensors", "format": formats.pop() if len(formats) == 1 else "mixed-precision",
            "quantization_status": "compressed", "config_groups": groups, "ignore": sorted(ignore),
            "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {}, "global_compression_ratio": None,
            "version": "0.20.0"}


class _Encoder:
    """Encodes HF tensors from eqjax leaves (:data:`eqjax.io.hf.Writer`), collecting the schemes it wrote."""

    def __init__(self) -> None:
        self.schemes: dict[str, dict[str, Any]] = {}
        self.regrouped: list[str] = []
        self.float_linears: list[str] = []

    def __call__(self, t: HFTensor, leaves: list[Any], file_dtype: str) -> dict[str, np.ndarray] | None:
        inner = [x.kernel if isinstance(x, PermutedKernel) else x for x in leaves]
        kinds = {type(x) for x in inner}
        if RotatedKernel in kinds:
            raise FormatError(f"{'/'.join(t.paths[0])}: an online rotation (RotatedKernel), which {FORMAT} cannot hold")
        if not kinds & {QArray, ActQuantKernel}:
            if t.transposed and len(t.hf_shape) == 2 and t.name.endswith(".weight") and "embed" not in t.name:
                self.float_linears.append(_module(t.name))
            return None
        if kinds - {QArray, ActQuantKernel}:
            raise FormatError(f"{t.name}: fused parts of which only some are quantized")
        if not t.transposed or len(t.hf_shape) != 2:
            raise FormatError(f"{'/'.join(t.paths[0])}: a quantized {len(t.hf_shape)}-D tensor {t.name} that is not a "
                              "linear weight; the format quantizes Linear layers only")
        tensors, scheme = _encode(t.name, leaves, file_dtype)
        self.schemes[_module(t.name)] = scheme
        q0 = inner[0].weight if isinstance(inner[0], ActQuantKernel) else inner[0]
        if scheme["weights"]["group_size"] and scheme["weights"]["group_size"] != q0.granularity.group_size:
            self.regrouped.append(_module(t.name))
        return tensors

    def config(self, config: Any, dtype: str, extra: Mapping[str, Any] | None) -> dict[str, Any]:
        """config.json's object once every tensor is encoded; :class:`FormatError` when nothing was quantized."""
        if not self.schemes:
            raise FormatError(f"no quantized linear weight in the params: {FORMAT} holds quantized checkpoints "
                              "(write float weights with eqjax.io.hf.save_hf_checkpoint)")
        hf_cfg = hf_config_dict(config, dtype, extra)
        ignore = self.float_linears + (["lm_head"] if getattr(config, "tie_word_embeddings", False) else [])
        hf_cfg["quantization_config"] = quantization_config(self.schemes, ignore)  # a tied head: the float table
        return hf_cfg

    def state(self) -> dict[str, Any]:
        """What it collected so far (JSON), for :meth:`restore` in a resumed run."""
        return {"schemes": self.schemes, "regrouped": self.regrouped, "float_linears": self.float_linears}

    def restore(self, state: Mapping[str, Any]) -> None:
        self.schemes.update(state.get("schemes", {}))
        self.regrouped += state.get("regrouped", [])
        self.float_linears += state.get("float_linears", [])

    def summary(self, root: Path, size: int) -> dict[str, Any]:
        return {"path": str(root), "bytes": size, "schemes": self.schemes, "regrouped": self.regrouped}


def save_compressed_tensors(
    directory: str | os.PathLike[str], model: Model, params: Mapping[str, Any], *, dtype: str = "bfloat16",
    files: Mapping[str, str | bytes] | None = None, copy_from: str | os.PathLike[str] | None = None,
    extra_config: Mapping[str, Any] | None = None, overwrite: bool = False,
) -> dict[str, Any]:
    """Write ``params`` (eqjax QArrays / ActQuantKernels, float elsewhere) as a compressed-tensors directory.

    Args:
      dtype: the file dtype of float tensors and scales (``bfloat16``, ``float16`` or ``float32``).
      files: extra files to write beside the weights (``{name: text or bytes}``: tokenizer files).
      copy_from: an HF directory whose tokenizer and generation config (:data:`TOKENIZER_FILES`) are copied.
      extra_config: keys added to config.json (token ids).
      overwrite: replace a directory eqjax wrote (see :func:`eqjax.io.atomic.atomic_directory`).

    Returns ``{"path", "bytes", "schemes", "regrouped"}``: ``regrouped`` lists the weights whose ragged last
    group was written as smaller groups. Raises :class:`FormatError` naming the param for a leaf the format
    cannot hold (an online rotation, a 3-bit weight, ...), before anything is written.
    """
    config = untied(model.config, params)
    enc = _Encoder()
    tensors = float_tensors(config, params, dtype, write=enc)
    hf_cfg = enc.config(config, dtype, extra_config)
    root, size = write_directory(directory, tensors, hf_cfg, kind=FORMAT, copy_from=copy_from, files=files,
                                 overwrite=overwrite)
    return enc.summary(root, size)


def save_compressed_tensors_streamed(
    directory: str | os.PathLike[str], model: Model,
    produce: Callable[[Callable[[str, dict[str, Any]], None], StreamLedger | None], None],
    *, dtype: str = "bfloat16", files: Mapping[str, str | bytes] | None = None,
    copy_from: str | os.PathLike[str] | None = None, extra_config: Mapping[str, Any] | None = None,
    overwrite: bool = False, run: Mapping[str, Any] | None = None, resume: bool = False,
) -> dict[str, Any]:
    """:func:`save_compressed_tensors` for a model quantized unit by unit (:func:`eqjax.io.hf_quantized.save_streamed`:
    ``produce(emit, ledger)``, one shard per unit, the directory appears only when every unit is written;
    ``run`` / ``resume``: a resumable write)."""
    return save_streamed(directory, model, produce, _Encoder(), kind=FORMAT, dtype=dtype, files=files,
                         copy_from=copy_from, extra_config=extra_config, overwrite=overwrite, run=run, resume=resume)


# --------------------------------------------------------------------------------------------- reading


def is_compressed_tensors(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory``'s config.json declares a compressed-tensors quantization."""
    cfg = Path(directory) / "config.json"
    try:
        qc = json.loads(cfg.read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors"


def _scheme_for(module: str, groups: Mapping[str, Any], ignore: list[str]) -> dict[str, Any] | None:
    """The config group covering the linear ``module`` (exact names, ``re:`` patterns, or ``Linear``)."""
    def hit(pattern: str) -> bool:
        if pattern.startswith("re:"):
            return re.match(pattern[3:], module) is not None
        return pattern == module or pattern == "Linear"

    if any(hit(p) and p != "Linear" for p in ignore) or "Linear" in ignore:
        return None
    exact = [g for g in groups.values() if module in g.get("targets", ())]
    found = exact or [g for g in groups.values() if any(hit(p) for p in g.get("targets", ()))]
    return found[0] if found else None


def _read_args(args: Any, where: str, *, act: bool = False) -> dict[str, Any]:
    if not isinstance(args, dict):
        raise FormatError(f"{where}: expected an object of quantization arguments, found {type(args).__name__}")
    if args.get("type", "int") != "int":
        raise FormatError(f"{where}: {args.get('type')} quantization; eqjax reads integer schemes")
    bits = args.get("num_bits")
    allowed = (8,) if act else WEIGHT_BITS
    if bits not in allowed:
        raise FormatError(f"{where}: num_bits {bits!r}; eqjax reads {' or '.join(map(str, allowed))}-bit "
                          f"{'activations' if act else 'weights'}")
    return args


def _decode(t: HFTensor, scheme: Mapping[str, Any], tensors: Mapping[str, np.ndarray], origin: Mapping[str, Path],
            fmt: str, decode: bool = True) -> tuple[list[Any], set[str]]:
    """The tree parts of one quantized HF linear (``[in, out]`` QArrays, split along out for fused tensors) and
    the stored names they use; ``decode=False`` checks the stored tensors' dtypes and shapes, gives None parts."""
    stem = _module(t.name)
    where = f"{origin.get(stem + '.weight_scale', '?')}: {stem}"
    w = _read_args(scheme.get("weights"), f"{where} (weights)")
    a = scheme.get("input_activations")
    bits, sym, strategy = int(w["num_bits"]), bool(w.get("symmetric", True)), w.get("strategy")
    n_out, n_in = t.hf_shape

    def need(name: str) -> np.ndarray:
        if f"{stem}.{name}" not in tensors:
            raise FormatError(f"{where}: tensor {stem}.{name} is missing ({fmt} layout)")
        return tensors[f"{stem}.{name}"]

    used = {f"{stem}.weight_scale"}
    if fmt in ("int-quantized", "naive-quantized"):
        raw = need("weight")
        used.add(f"{stem}.weight")
        if raw.dtype != np.int8 or raw.shape != (n_out, n_in):
            raise FormatError(f"{where}.weight: expected int8 {(n_out, n_in)}, found {raw.dtype} {raw.shape}")
        unpacked = lambda lo, hi: (raw[lo:hi].astype(np.int32) + 2 ** (bits - 1)).astype(np.uint8)  # noqa: E731
    else:
        packed = need("weight_packed")
        used |= {f"{stem}.weight_packed", f"{stem}.weight_shape"}
        want = (n_out, -(-n_in * bits // 32))
        if packed.dtype != np.int32 or packed.shape != want:
            raise FormatError(f"{where}.weight_packed: expected int32 {want}, found {packed.dtype} {packed.shape}")
        shape = tuple(int(x) for x in np.asarray(need("weight_shape")).reshape(-1))
        if shape != (n_out, n_in):
            raise FormatError(f"{where}.weight_shape: {shape}, config.json implies {(n_out, n_in)}")
        unpacked = lambda lo, hi: unpack_int32(packed[lo:hi], bits, n_in)  # noqa: E731
    stored_scale = need("weight_scale")
    groups = {"group": -(-n_in // int(w.get("group_size") or 1)), "channel": 1, "tensor": 1}.get(strategy)
    if groups is None:
        raise FormatError(f"{where}: weight strategy {strategy!r}; eqjax reads group, channel and tensor scales")
    if strategy != "tensor" and tuple(stored_scale.shape) != (n_out, groups):
        raise FormatError(f"{where}.weight_scale: expected shape {(n_out, groups)}, found {tuple(stored_scale.shape)}")
    g_idx = tensors.get(f"{stem}.weight_g_idx")
    perm = None
    if g_idx is not None:
        used.add(f"{stem}.weight_g_idx")
        if strategy != "group":
            raise FormatError(f"{where}.weight_g_idx: a group index with {strategy} scales")
        perm = group_order(g_idx, n_in, int(w["group_size"]), f"{where}.weight_g_idx")  # actorder group: gathered
    zp = None
    if not sym:
        zraw = need("weight_zero_point")
        used.add(f"{stem}.weight_zero_point")
    a = None if a is None else _read_args(a, f"{where} (input_activations)", act=True)
    static = a is not None and not a.get("dynamic", True)
    if static:
        used.add(f"{stem}.input_scale")
        need("input_scale")
    if not decode:
        return [None] * len(t.paths), used
    if perm is not None:  # the codes' input columns in group order: the groups contiguous
        stored = unpacked
        unpacked = lambda lo, hi: stored(lo, hi)[:, perm]  # noqa: E731
    scale = np.asarray(stored_scale).astype(np.float32)
    if strategy == "tensor":
        scale = np.broadcast_to(scale.reshape(-1)[:1], (n_out, 1))
    if not sym:
        if fmt == "pack-quantized" and zraw.dtype == np.int32:
            zp = unpack_int32(np.ascontiguousarray(zraw.T), bits, n_out).T
        else:
            zp = (np.asarray(zraw).astype(np.int32) + 2 ** (bits - 1)).astype(np.uint8)
        if strategy == "tensor":
            zp = np.broadcast_to(zp.reshape(-1)[:1], (n_out, 1))
        if zp.shape != (n_out, groups):
            raise FormatError(f"{where}.weight_zero_point: expected {(n_out, groups)} after unpacking, found {zp.shape}")
    gran = {"group": per_group(0, int(w.get("group_size") or 0) or 1), "channel": per_channel(1),
            "tensor": per_tensor()}[strategy]
    act_kw = None
    if a is not None:
        act_scale = jnp.asarray(np.asarray(need("input_scale"), np.float32).reshape(())) if static else None
        act_kw = {"act_scale": act_scale, "act_bits": 8, "act_granularity": "tensor" if static else "token",
                  "act_full_range": True}
    bounds = np.cumsum([0] + [s[-1] for s in t.shapes]).tolist()
    parts = []
    u = unpacked(0, n_out) if bits > 4 else None  # 2..4 bits: unpacked and packed again a piece of rows at a time
    step = max(1, _PIECE // max(1, n_in))
    for path, (a, b) in zip(t.paths, zip(bounds, bounds[1:])):
        rows = slice(a, b)  # slices: views, not copies
        codes: Any = u[rows].T if u is not None else jnp.concatenate(
            [pack_codes(unpacked(lo, min(lo + step, b)).T, bits) for lo in range(a, b, step)], axis=1)
        q = _qarray(codes, scale[rows].T, None if zp is None else zp[rows].T, bits, gran,
                    f"{'/'.join(path)} ({where})", tensor=strategy == "tensor", shape=(n_in, b - a))
        parts.append(permuted(q if act_kw is None else ActQuantKernel(q, **act_kw), perm, f"{'/'.join(path)} ({where})"))
    return parts, used


def _qarray(u: Any, scale: np.ndarray, zp: np.ndarray | None, bits: int, gran: Any, where: str, *,
            tensor: bool, shape: tuple[int, int]) -> QArray:
    """A QArray ``[in, out]`` (``shape``) from the format's unsigned codes ``u [in, out]`` (2..4 bits: already in
    eqjax's packed form, :func:`~eqjax.io.hf_quantized.pack_codes`), scales ``[groups, out]`` and zero points."""
    if tensor:
        scale = scale[:1, :1]
        zp = None if zp is None else zp[:1, :1]
    offset = 2 ** (bits - 1)
    if bits <= 4:
        values = u
        sym = zp is None
    elif zp is None and u.min(initial=offset) > 0:  # symmetric int8 values in [-127, 127]
        values, sym = (u.astype(np.int32) - offset).astype(np.int8), True
    else:  # asymmetric, or a symmetric grid using -128: unsigned codes with an explicit zero point
        values, sym = u, False
        zp = np.full(scale.shape, offset, np.uint8) if zp is None else zp
    q = QArray(jnp.asarray(values), jnp.asarray(scale), None if sym else jnp.asarray(zp.astype(np.uint8)), bits, sym,
               gran.normalized(2), tuple(shape))
    try:
        return validate(q, name=where)
    except ValueError as e:
        raise FormatError(f"{where}: {e}") from None


def _open(directory: str | os.PathLike[str], lazy: bool) -> tuple[Any, Any, dict[str, Path], Path, Taker]:
    """``(config, tensors, origin, root, take)`` of a compressed-tensors directory, its quantization_config checked."""
    root = Path(directory)
    config, raw, tensors, origin = read_checkpoint(root, lazy=lazy)
    qc = raw.get("quantization_config")
    where = f"{root / 'config.json'}: quantization_config"
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        raise FormatError(f"{where}: expected quant_method 'compressed-tensors', found "
                          f"{qc.get('quant_method') if isinstance(qc, dict) else qc!r}")
    if qc.get("sparsity_config") or qc.get("transform_config"):
        raise FormatError(f"{where}: sparsity or transform configs; eqjax reads dense integer quantization")
    if qc.get("kv_cache_scheme"):
        raise FormatError(f"{where}: kv_cache_scheme; eqjax's KV quantization is a recipe setting, not stored scales")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise FormatError(f"{where}: expected a non-empty config_groups object")
    fmt_default = qc.get("format", "pack-quantized")
    known = ("pack-quantized", "int-quantized", "naive-quantized", "mixed-precision")
    ignore = list(qc.get("ignore") or [])

    def take(t: HFTensor, decode: bool) -> tuple[list[Any], set[str]] | None:
        if not (t.transposed and len(t.hf_shape) == 2 and t.name.endswith(".weight")):
            return None
        scheme = _scheme_for(_module(t.name), groups, ignore)
        if scheme is None:
            return None
        fmt = scheme.get("format") or fmt_default
        if fmt not in known or fmt == "mixed-precision":
            raise FormatError(f"{where}: format {fmt!r} for {_module(t.name)}; eqjax reads pack-quantized and int-quantized")
        return _decode(t, scheme, tensors, origin, fmt, decode)

    return config, tensors, origin, root, take


def load_compressed_tensors(directory: str | os.PathLike[str], *, dtype: Any = jnp.float32) -> tuple[Model, dict[str, Any]]:
    """``(Model, params)`` of a compressed-tensors directory: its quantized linears as QArrays (W8A8 as
    ActQuantKernels, a group index's activation-ordered groups as PermutedKernels) built from the stored
    integers, the rest float (``dtype``).

    Raises :class:`FormatError` / :class:`~eqjax.io.hf.CheckpointError` naming the file and tensor for a
    scheme eqjax cannot hold (float8, 2/3-bit, a group index whose groups are not all of the group size,
    sparsity) or a malformed tensor.
    """
    config, tensors, origin, root, take = _open(directory, lazy=True)  # mapped: one stored tensor resident at a time
    return Model(config), assemble_params(config, tensors, origin, root, dtype=dtype, take=take)


def stream_compressed_tensors(directory: str | os.PathLike[str], *, dtype: Any = jnp.float32
                              ) -> tuple[Model, StreamedParams]:
    """``(Model, StreamedParams)`` of a compressed-tensors directory read on demand (as
    :func:`load_compressed_tensors`, one part at a time: :func:`eqjax.io.hf.stream_params`); every stored
    tensor's dtype and shape is checked before this returns, the codes when a part is read."""
    config, tensors, origin, root, take = _open(directory, lazy=True)
    return Model(config), stream_params(config, tensors, origin, root, dtype=dtype, take=take)
