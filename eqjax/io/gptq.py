"""GPTQ-format checkpoints (AutoGPTQ / GPTQModel layout, also written by AutoRound's ``auto_gptq`` export).

A directory holds config.json with ``quantization_config: {quant_method: gptq, bits, group_size, sym,
desc_act, checkpoint_format}`` (or AutoRound's own format, ``quant_method: auto-round``, whose integer
packings are this layout: ``packing_format`` ``auto_round:auto_gptq`` as v1, ``auto_round``,
``auto_round:gptqmodel`` and ``auto_round:exllamav2`` as v2; its ``extra_config`` gives a linear, by name or pattern, other bits, group
or symmetry, as GPTQModel's ``dynamic`` does in GPTQ's own config) and, per quantized linear ``P`` (HF weight
``[out, in]``):

* ``P.qweight`` int32 ``[in * bits / 32, out]``: codes packed along ``in``, ``32 / bits`` a word, first lowest
  (AutoRound's model-free export pads ``in`` to whole groups: the padding's codes are dropped on reading);
* ``P.qzeros`` int32 ``[groups, out * bits / 32]``: zero points packed along ``out``; checkpoint format
  ``gptq`` (v1) stores ``zero - 1``, ``gptq_v2`` the zero itself;
* ``P.scales`` float16 ``[groups, out]``; ``P.g_idx`` int32 ``[in]``: each input's group.

``x = scale[g_idx[k]] * (q - zero[g_idx[k]])`` with unsigned codes: eqjax's codes and zero points are the
stored values as they are (plus v1's offset), so nothing is dequantized on the way in or out. Groups are
``g_idx = k // group_size`` (a shorter last group where ``group_size`` does not divide ``in``, as eqjax's).
Activation-ordered groups (``desc_act`` with a permuted ``g_idx``) are read as a
:class:`~eqjax.core.qarray.PermutedKernel`: the codes' rows in group order around the inputs' order, so the
input's features are gathered at use (what GPTQ kernels do with ``g_idx``), and written back the same way. Widths 4 and 8
bits (the ones packed whole into words). Written in v1 (what AutoGPTQ, transformers' GPTQ integration and
vLLM read), which cannot hold a zero point of 0: such a weight is refused, naming it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping

import jax.numpy as jnp
import numpy as np

from eqjax.core.qarray import ActQuantKernel, PermutedKernel, QArray, RotatedKernel, per_group, validate
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
    FormatError,
    group_order,
    pack_codes,
    pack_int32,
    permuted,
    recipe_refusal,
    save_streamed,
    stored_order,
    unpack_int32,
    unsigned_codes,
    write_directory,
)
from eqjax.models import Model

__all__ = ["GPTQ_FORMAT", "check_recipe", "is_gptq", "load_gptq", "save_gptq", "save_gptq_streamed"]

GPTQ_FORMAT = "gptq"
BITS = (4, 8)
DTYPE = "float16"
"""The file dtype of scales and float tensors: the layout's convention."""


def check_recipe(recipe: Any) -> None:
    """Refuse, before any work, a recipe whose weights the GPTQ layout cannot hold: anything but weight-only
    4/8-bit weights in input groups (naming the recipe and why)."""
    recipe_refusal(recipe, GPTQ_FORMAT, activations=False)


# --------------------------------------------------------------------------------------------- writing


def _encode(t: HFTensor, parts: list[Any], dtype: str) -> tuple[dict[str, np.ndarray], tuple[int, int, bool]]:
    stem = t.name[: -len(".weight")]
    parts, inv = stored_order(parts, t.name)
    for q in parts:
        if not isinstance(q, QArray):
            raise FormatError(f"{'/'.join(t.paths[0])}: a {type(q).__name__}; the {GPTQ_FORMAT} layout holds weight-only "
                              "QArrays")
    q0 = parts[0]
    g = q0.granularity.normalized(2)
    if q0.bits not in BITS or g.kind != "group" or g.axes != (0,):
        raise FormatError(f"{t.name} ({GPTQ_FORMAT}): int{q0.bits} {q0.granularity}; the layout holds 4/8-bit weights "
                          "in groups along the input")
    if any((q.bits, q.symmetric, q.granularity) != (q0.bits, q0.symmetric, q0.granularity) for q in parts):
        raise FormatError(f"{t.name} ({GPTQ_FORMAT}): fused parts quantized differently")
    bits, size, k = q0.bits, g.group_size, q0.shape[0]
    u = unsigned_codes(q0) if len(parts) == 1 else np.concatenate([unsigned_codes(q) for q in parts], axis=1)  # [in, out]
    zp = np.concatenate([np.asarray(q.effective_zero_point) for q in parts], axis=1)
    if not q0.packed and q0.symmetric:
        zp = zp + 2 ** (bits - 1)
    if (zp == 0).any():
        raise FormatError(f"{t.name} ({GPTQ_FORMAT}): a zero point of 0, which the v1 layout (zero - 1) cannot hold")
    scale = np.concatenate([np.asarray(q.scale, np.float32) for q in parts], axis=1)
    g_idx = (np.arange(k) // size).astype(np.int32)
    if inv is not None:  # activation-ordered groups: rows back in input order, each input's group stored
        u, g_idx = u[inv], g_idx[inv]
    out = {f"{stem}.qweight": np.ascontiguousarray(pack_int32(u.T, bits).T),
           f"{stem}.qzeros": np.ascontiguousarray(pack_int32((zp - 1).astype(np.uint8), bits)),
           f"{stem}.scales": cast_float(scale, dtype),
           f"{stem}.g_idx": g_idx}
    return out, (bits, size, bool(q0.symmetric))


class _Encoder:
    """Encodes HF tensors from eqjax leaves (:data:`eqjax.io.hf.Writer`) in the GPTQ layout, collecting the one
    ``(bits, group size, symmetric)`` scheme the config holds (a second one is a :class:`FormatError` naming the
    tensor, at once) and the linears left in float (:class:`eqjax.io.hf_quantized.Encoder`)."""

    def __init__(self) -> None:
        self.scheme: tuple[int, int, bool] | None = None
        self.skipped: list[str] = []
        self.desc_act = False

    def __call__(self, t: HFTensor, leaves: list[Any], file_dtype: str) -> dict[str, np.ndarray] | None:
        if not any(isinstance(x, (QArray, ActQuantKernel, RotatedKernel, PermutedKernel)) for x in leaves):
            if t.transposed and len(t.hf_shape) == 2:
                self.skipped.append(t.name[: -len(".weight")])
            return None
        tensors, scheme = _encode(t, leaves, file_dtype)
        if self.scheme is not None and scheme != self.scheme:
            raise FormatError(f"{t.name} ({GPTQ_FORMAT}): {_describe(scheme)}, where earlier linears are "
                              f"{_describe(self.scheme)}; the layout's config holds one bit width, group size and "
                              "symmetry for every quantized linear")
        self.scheme = scheme
        self.desc_act |= any(isinstance(x, PermutedKernel) for x in leaves)
        return tensors

    def config(self, config: Any, dtype: str, extra: Mapping[str, Any] | None) -> dict[str, Any]:
        """config.json's object once every tensor is encoded; :class:`FormatError` when nothing was quantized."""
        if self.scheme is None:
            raise FormatError(f"{GPTQ_FORMAT}: no quantized linear weight in the params (the layout holds quantized "
                              "checkpoints; write float weights with eqjax.io.hf.save_hf_checkpoint)")
        bits, size, sym = self.scheme
        hf_cfg = hf_config_dict(config, dtype, extra)
        hf_cfg["quantization_config"] = {"quant_method": GPTQ_FORMAT, "bits": bits, "group_size": size, "sym": sym,
                                         "desc_act": self.desc_act, "checkpoint_format": "gptq", "true_sequential": True,
                                         "damp_percent": 0.01, "modules_in_block_to_quantize": None,
                                         "lm_head": "lm_head" not in self.skipped and not config.tie_word_embeddings}
        return hf_cfg

    def state(self) -> dict[str, Any]:
        """What it collected so far (JSON), for :meth:`restore` in a resumed run."""
        return {"scheme": None if self.scheme is None else list(self.scheme), "skipped": self.skipped,
                "desc_act": self.desc_act}

    def restore(self, state: Mapping[str, Any]) -> None:
        if state.get("scheme") is not None:
            bits, size, sym = state["scheme"]
            self.scheme = (int(bits), int(size), bool(sym))
        self.skipped += state.get("skipped", [])
        self.desc_act |= bool(state.get("desc_act", False))

    def summary(self, root: Path, size: int) -> dict[str, Any]:
        bits, group, sym = self.scheme or (None, None, None)
        return {"path": str(root), "bytes": size, "bits": bits, "group_size": group, "sym": sym}


def _describe(scheme: tuple[int, int, bool]) -> str:
    bits, size, sym = scheme
    return f"int{bits} g{size} {'sym' if sym else 'asym'}"


def save_gptq(directory: str | os.PathLike[str], model: Model, params: Mapping[str, Any], *,
              files: Mapping[str, str | bytes] | None = None, copy_from: str | os.PathLike[str] | None = None,
              extra_config: Mapping[str, Any] | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Write ``params`` (weight-only QArrays, one bit width, group size and symmetry for every quantized
    linear; float elsewhere) as a GPTQ directory: scales float16, float tensors float16 (the layout's
    convention). ``files`` / ``copy_from`` / ``extra_config`` / ``overwrite`` as for
    :func:`eqjax.io.compressed_tensors.save_compressed_tensors`. Returns ``{"path", "bytes", "bits",
    "group_size", "sym"}``; a leaf the layout cannot hold is a :class:`FormatError` naming it, before any write."""
    config = untied(model.config, params)
    enc = _Encoder()
    tensors = float_tensors(config, params, DTYPE, write=enc)
    hf_cfg = enc.config(config, DTYPE, extra_config)
    root, size_b = write_directory(directory, tensors, hf_cfg, kind=GPTQ_FORMAT, copy_from=copy_from, files=files,
                                   overwrite=overwrite)
    return enc.summary(root, size_b)


def save_gptq_streamed(directory: str | os.PathLike[str], model: Model,
                       produce: Callable[[Callable[[str, dict[str, Any]], None], Any], None], *,
                       files: Mapping[str, str | bytes] | None = None, copy_from: str | os.PathLike[str] | None = None,
                       extra_config: Mapping[str, Any] | None = None, overwrite: bool = False,
                       run: Mapping[str, Any] | None = None, resume: bool = False) -> dict[str, Any]:
    """:func:`save_gptq` for a model quantized unit by unit (:func:`eqjax.io.hf_quantized.save_streamed`:
    ``produce(emit, ledger)``, one shard per unit, the directory appears only when every unit is written;
    ``run`` / ``resume``: a resumable write)."""
    return save_streamed(directory, model, produce, _Encoder(), kind=GPTQ_FORMAT, dtype=DTYPE, files=files,
                         copy_from=copy_from, extra_config=extra_config, overwrite=overwrite, run=run, resume=resume)


# --------------------------------------------------------------------------------------------- reading


AUTOROUND_METHODS = ("auto-round", "intel/auto-round")
"""``quant_method`` of AutoRound's own format."""
_AUTOROUND_PACKINGS = {"auto_round:auto_gptq": "gptq", "auto_round": "gptq_v2", "auto_round:gptqmodel": "gptq_v2",
                       "auto_round:exllamav2": "gptq_v2"}
"""AutoRound's integer packings in this layout -> the GPTQ checkpoint format (zero point stored minus 1, or as is)."""


def is_gptq(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory``'s config.json declares a GPTQ quantization (or AutoRound's own format)."""
    try:
        qc = json.loads((Path(directory) / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(qc, dict) and qc.get("quant_method") in (GPTQ_FORMAT, *AUTOROUND_METHODS)


def _gptq_config(qc: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The GPTQ ``quantization_config`` that ``qc`` stands for: itself, or AutoRound's own format's as GPTQ's
    (its packing as ``checkpoint_format``); what the layout here cannot hold is refused, naming ``where``."""
    if qc.get("quant_method") not in AUTOROUND_METHODS:
        return dict(qc)
    packing = qc.get("packing_format", qc.get("backend", "auto_round:auto_gptq"))
    if packing not in _AUTOROUND_PACKINGS:
        raise FormatError(f"{where}: AutoRound packing_format {packing!r}; eqjax reads its GPTQ-layout packings "
                          f"({', '.join(_AUTOROUND_PACKINGS)})")
    act = qc.get("act_bits", 16)
    if str(qc.get("data_type", "int")) != "int" or not (act is None or (isinstance(act, int) and act >= 16)):
        raise FormatError(f"{where}: AutoRound data_type {qc.get('data_type')!r}, act_bits {qc.get('act_bits')!r}; "
                          "eqjax reads integer weight-only AutoRound checkpoints")
    transforms = sorted(k for k in qc if "rotation" in k or "spinquant" in k or "hadamard" in k)
    if transforms:
        raise FormatError(f"{where}: AutoRound {transforms[0]!r}; eqjax does not read rotated AutoRound checkpoints")
    return {**qc, "checkpoint_format": _AUTOROUND_PACKINGS[packing]}


def _layer_config(qc: Mapping[str, Any], stem: str, where: str) -> dict[str, Any]:
    """``qc`` with the overrides a checkpoint gives the linear ``stem``: AutoRound's ``extra_config`` entry (its
    name, or a pattern that matches it whole) or GPTQModel's ``dynamic`` one (``"+:pattern"`` or a bare pattern,
    matched from the start of the name, as GPTQModel does; ``"-:pattern"`` keeps a linear float, which then has
    no ``qweight`` and is not read here)."""
    extra, dynamic = qc.get("extra_config") or {}, qc.get("dynamic") or {}
    if not isinstance(extra, dict) or not isinstance(dynamic, dict) \
            or not all(isinstance(v, dict) for v in (*extra.values(), *dynamic.values())):
        raise FormatError(f"{where}: extra_config / dynamic must map layer names or patterns to objects of fields")
    own = extra.get(stem)
    if own is None:
        own = next((v for k, v in extra.items() if _matches(k, stem, whole=True)), None)
    if own is None:
        for key, value in dynamic.items():
            sign, pattern = (key[0], key[2:]) if key[:2] in ("+:", "-:") else ("+", key)
            if _matches(pattern, stem, whole=False):
                own = value if sign == "+" else None
                break
    if not own:
        return dict(qc)
    out = {**qc, **{k: v for k, v in own.items() if k in ("bits", "group_size", "sym", "data_type", "act_bits")}}
    if out.get("bits") not in BITS or str(out.get("data_type", "int")) != "int" or not isinstance(out.get("group_size"), int):
        raise FormatError(f"{where}: {'extra_config' if extra else 'dynamic'} gives {stem} bits {out.get('bits')!r}, "
                          f"group_size {out.get('group_size')!r}, data_type {out.get('data_type')!r}; eqjax reads 4- "
                          "and 8-bit integer weights in this layout")
    return out


def _matches(pattern: str, name: str, *, whole: bool) -> bool:
    try:
        return (re.fullmatch if whole else re.match)(pattern, name) is not None
    except re.error:
        return False


def _decode(t: HFTensor, qc: Mapping[str, Any], tensors: Mapping[str, np.ndarray], origin: Mapping[str, Path],
            decode: bool = True) -> tuple[list[Any], set[str]]:
    """The ``[in, out]`` QArrays of one GPTQ linear (split along out for fused tensors) and the stored names
    they use; ``decode=False`` checks every stored tensor's dtype and shape and returns None parts."""
    stem = t.name[: -len(".weight")]
    where = f"{origin.get(stem + '.qweight', '?')}: {stem}"
    bits, size = int(qc["bits"]), int(qc["group_size"])
    n_out, n_in = t.hf_shape
    size = n_in if size <= 0 else size
    groups = -(-n_in // size)
    names = {f"{stem}.{n}" for n in ("qweight", "qzeros", "scales", "g_idx")}

    def need(name: str, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        a = tensors.get(f"{stem}.{name}")
        if a is None:
            raise FormatError(f"{where}: tensor {stem}.{name} is missing ({GPTQ_FORMAT} layout)")
        if a.dtype != dtype or tuple(a.shape) != shape:
            raise FormatError(f"{where}.{name}: expected {np.dtype(dtype).name} {shape}, found {a.dtype.name} {tuple(a.shape)}")
        return a

    per = 32 // bits
    stored_in = n_in
    if tensors.get(f"{stem}.qweight", np.zeros((0,))).shape[:1] == (-(-groups * size // per),):
        stored_in = groups * size  # AutoRound's model-free export pads the inputs to whole groups
    qweight = need("qweight", np.int32, (-(-stored_in // per), n_out))
    qzeros = need("qzeros", np.int32, (groups, -(-n_out // per)))
    stored_scale = tensors.get(f"{stem}.scales", np.zeros(0))
    if tuple(stored_scale.shape) != (groups, n_out):
        raise FormatError(f"{where}.scales: expected shape {(groups, n_out)}, found {tuple(stored_scale.shape)}")
    g_idx = tensors.get(f"{stem}.g_idx")
    if g_idx is not None and stored_in > n_in and g_idx.shape == (stored_in,):
        g_idx = np.asarray(g_idx)[:n_in]  # the padding's groups
    perm = group_order(g_idx, n_in, size, f"{where}.g_idx")  # activation-ordered groups (desc_act): inputs gathered
    if not decode:
        return [None] * len(t.paths), names & set(tensors)
    u = unpack_int32(np.ascontiguousarray(qweight.T), bits, stored_in).T[:n_in]  # [in, out]: padding dropped
    if perm is not None:
        u = u[perm]  # rows in group order: the groups contiguous
    zs = unpack_int32(qzeros, bits, n_out)
    scale = np.asarray(stored_scale).astype(np.float32)
    zp = zs.astype(np.int32) + (1 if qc.get("checkpoint_format", "gptq") == "gptq" else 0)
    if zp.max(initial=0) > 2**bits - 1:
        raise FormatError(f"{where}.qzeros: a zero point of {2**bits} (a v1 checkpoint's wrapped zero of 0), outside "
                          f"the {bits}-bit codes")
    u, zp, scale = _positive_scales(u, zp, scale, size, bits)
    sym = bool(qc.get("sym", False)) and bits <= 4 and bool((zp == 2 ** (bits - 1)).all())
    gran = per_group(0, size)
    parts, ends = [], np.cumsum([s[-1] for s in t.shapes])[:-1]
    for path, cols in zip(t.paths, np.split(np.arange(n_out), ends)):
        uu, ss, zz = u[:, cols], scale[:, cols], zp[:, cols].astype(np.uint8)
        values = pack_codes(uu, bits) if bits <= 4 else uu
        q = QArray(jnp.asarray(values), jnp.asarray(ss), None if sym else jnp.asarray(zz), bits, sym, gran, uu.shape)
        try:
            parts.append(permuted(validate(q, name=f"{'/'.join(path)} ({where})"), perm, f"{'/'.join(path)} ({where})"))
        except ValueError as e:
            raise FormatError(f"{'/'.join(path)} ({where}): {e}") from None
    return parts, names & set(tensors)


def _positive_scales(u: np.ndarray, zp: np.ndarray, scale: np.ndarray, size: int, bits: int = 4
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The same values with every scale > 0, as eqjax stores them. Some writers (AutoRound's symmetric
    rounding) store negative scales: ``(q - z) s == ((m - q) - (m - z)) (-s)`` with ``m = 2**bits - 1`` flips
    the codes of such a group exactly; a zero scale (an all-zero group) becomes 1 with every code on its zero."""
    m = 2**bits - 1
    neg, zero = scale < 0, scale == 0
    if not (neg.any() or zero.any()):  # the usual case: no full-size temporaries
        return u.astype(np.uint8, copy=False), zp, scale.astype(np.float32, copy=False)
    rows = np.arange(u.shape[0]) // size
    u = np.where(neg[rows], m - u.astype(np.int32), u).astype(np.int32)
    zp = np.where(neg, m - zp, zp)
    u = np.where(zero[rows], zp[rows], u)
    return u.astype(np.uint8), zp, np.where(zero, 1.0, np.abs(scale)).astype(np.float32)


def _open(directory: str | os.PathLike[str], lazy: bool) -> tuple[Any, Any, dict[str, Path], Path, Taker]:
    """``(config, tensors, origin, root, take)`` of a GPTQ directory, its quantization_config checked."""
    root = Path(directory)
    config, raw, tensors, origin = read_checkpoint(root, lazy=lazy)
    where = f"{root / 'config.json'}: quantization_config"
    qc = _gptq_config(raw.get("quantization_config") or {}, where)
    if qc.get("bits") not in BITS:
        raise FormatError(f"{where}: bits {qc.get('bits')!r}; eqjax reads 4- and 8-bit GPTQ checkpoints")
    if qc.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
        raise FormatError(f"{where}: checkpoint_format {qc.get('checkpoint_format')!r}; eqjax reads gptq and gptq_v2")
    if not isinstance(qc.get("group_size"), int):
        raise FormatError(f"{where}: expected an integer group_size, found {qc.get('group_size')!r}")

    def take(t: HFTensor, decode: bool) -> tuple[list[Any], set[str]] | None:
        stem = t.name[: -len(".weight")]
        if not t.name.endswith(".weight") or f"{stem}.qweight" not in tensors:
            return None
        return _decode(t, _layer_config(qc, stem, where), tensors, origin, decode)

    return config, tensors, origin, root, take


def load_gptq(directory: str | os.PathLike[str], *, dtype: Any = jnp.float32) -> tuple[Model, dict[str, Any]]:
    """``(Model, params)`` of a GPTQ directory: its quantized linears as QArrays from the stored integers, the
    rest float (``dtype``; activation-ordered groups as :class:`~eqjax.core.qarray.PermutedKernel` s). Raises
    :class:`FormatError` naming the file and tensor for what eqjax cannot hold (2/3-bit, a group index whose
    groups are not all of the group size, a malformed tensor)."""
    config, tensors, origin, root, take = _open(directory, lazy=True)  # mapped: one stored tensor resident at a time
    return Model(config), assemble_params(config, tensors, origin, root, dtype=dtype, take=take)


def stream_gptq(directory: str | os.PathLike[str], *, dtype: Any = jnp.float32) -> tuple[Model, StreamedParams]:
    """``(Model, StreamedParams)`` of a GPTQ directory read on demand (as :func:`load_gptq`, one part at a
    time: :func:`eqjax.io.hf.stream_params`); every stored tensor's dtype and shape is checked before this
    returns, the codes when a part is read."""
    config, tensors, origin, root, take = _open(directory, lazy=True)
    return Model(config), stream_params(config, tensors, origin, root, dtype=dtype, take=take)
