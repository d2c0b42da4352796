"""Write eqjax's quantized Llama params as a llama.cpp GGUF file: Q4_0 / Q4_1 / Q8_0 blocks of 32.

``export_gguf(params, out, source=...)`` keeps every number eqjax quantized; no weight is quantized again:

=============================================  ==============================================================
eqjax leaf (a matmul kernel or the table)      GGUF tensor
=============================================  ==============================================================
4-bit symmetric, all 16 codes (-8..7)          ``Q4_0``: ``d = scale`` (float16), nibbles ``q + 8``: exact
4-bit asymmetric (a zero point per group)      ``Q4_1``: ``d = scale``, ``m = -scale * zp`` rounded to float16
                                               (the one rounding: at most half a float16 ulp of ``m``)
8-bit symmetric (-127..127)                    ``Q8_0``: ``d = scale``, int8 codes: exact
float (norm scales, unquantized weights)       ``F32``: exact
float16 :class:`~eqjax.core.qarray.HalfFloat`        ``F16``: exact (a bfloat16 one is written ``F32``, exact)
=============================================  ==============================================================

The scale (and zero point) must be constant over every block of 32 inputs: per output channel, or
groups along the input whose size is a multiple of 32 (g32 / g64 / g128 with a short last group are
fine: a group's scale is repeated over its blocks), and representable in float16 (eqjax's group-wise
recipes store float16 scales; a per-channel float32 scale is rounded, and the read-back check reports
what that changed). Anything else (3-bit, 2-bit, W8A8's activation quantization, rotations, KV
quantization, groups of 16) is refused before the file is written, naming the param.

Metadata (architecture, hyper-parameters, tokenizer, chat template) is copied from the source GGUF the
params were loaded from, or made from a source HF directory's config.json and tokenizer as llama.cpp's
converter makes it (:func:`eqjax.io.gguf_meta.hf_gguf_metadata`); ``general.file_type`` is set from the
tensors written. Q and K rows are
permuted back to llama.cpp's interleaved-RoPE order (the inverse of :func:`eqjax.io.gguf.unpermute_qk`).
The file is written to a temporary sibling and renamed, then read back a tensor at a time (its metadata,
tokenizer, tensor names, types and shapes) and compared with eqjax's own dequantized weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from eqjax.core.numerics import dequantize_leaf
from eqjax.core.pytree import flatten
from eqjax.core.qarray import ActQuantKernel, PermutedKernel, QArray, is_quantized
from eqjax.export.graph import ExportError
from eqjax.export.qlower import blocked, half_initializer, lowered_at_use
from eqjax.io.atomic import atomic_path, check_output_file
from eqjax.io.gguf import ROPE_FREQS, GGUFError, _open, file_config, load_tokenizer, rope_freq_factors, tensor_plan
from eqjax.io.gguf_meta import hf_gguf_metadata
from eqjax.io.hf import CheckpointError, StreamedParams, read_config
from eqjax.models.llama import rope_inv_freq

__all__ = ["export_gguf", "source_metadata", "gguf_blocks", "permute_qk", "BLOCK"]

BLOCK = 32
_FILE_TYPE = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7}  # llama.cpp's LLAMA_FTYPE_ALL_F32 / MOSTLY_*


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row order from HF's: the inverse of :func:`eqjax.io.gguf.unpermute_qk` (rows ``[out, ...]``)."""
    d = w.shape[0]
    return w.reshape(n_head, 2, d // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """``[rows, nb, 32]`` codes 0..15 -> ``[rows, nb, 16]`` bytes: element j low nibble, j + 16 high."""
    q = q.astype(np.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def gguf_blocks(codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray, bits: int,
                path: str) -> tuple[str, np.ndarray]:
    """GGUF blocks of a quantized matrix in torch layout: unsigned ``codes [rows, K]`` and per-block
    ``scales`` / ``zero_points [rows, K / 32]`` (``x = (code - zp) * scale``). Returns the type name and
    the raw bytes ``[rows, K / 32 * block_bytes]`` (uint8)."""
    rows, K = codes.shape
    nb = K // BLOCK
    q = codes.reshape(rows, nb, BLOCK)
    d = scales.astype(np.float16)
    if not np.all(np.isfinite(d)):
        raise GGUFError(f"{path}: a scale does not fit float16 (|scale| up to {float(np.abs(scales).max()):.3g})")
    head = d.reshape(rows, nb, 1).view(np.uint8)  # [rows, nb, 2]
    if bits == 8:
        if np.any(zero_points != 128):
            raise GGUFError(f"{path}: 8-bit weights with a zero point (asymmetric) have no GGUF block type (Q8_0 is symmetric)")
        body = (q.astype(np.int16) - 128).astype(np.int8).view(np.uint8)
        kind = "Q8_0"
    elif bits == 4 and np.all(zero_points == 8):
        body, kind = _nibbles(q), "Q4_0"
    elif bits == 4:
        m = (-scales.astype(np.float32) * zero_points.astype(np.float32)).astype(np.float16)
        head = np.concatenate([head, m.reshape(rows, nb, 1).view(np.uint8)], axis=-1)
        body, kind = _nibbles(q), "Q4_1"
    else:
        raise GGUFError(f"{path}: {bits}-bit weights have no GGUF block type here (4-bit: Q4_0 / Q4_1, 8-bit: Q8_0)")
    return kind, np.concatenate([head, body], axis=-1).reshape(rows, -1)


def _torch_blocks(leaf: Any, linear: bool, path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Unsigned codes ``[rows, K]`` and per-32 scales / zero points of a quantized leaf, in torch layout."""

    if isinstance(leaf, PermutedKernel):
        raise GGUFError(f"{path}: activation-ordered groups (a GPTQ desc_act g_idx: inputs in another order); GGUF's "
                        "blocks run along the inputs in order, so they cannot hold it (export to ONNX, or quantize "
                        "the float model)")
    if isinstance(leaf, ActQuantKernel) or not isinstance(leaf, QArray):
        raise GGUFError(f"{path}: {type(leaf).__name__} (activation quantization / rotation) cannot be written to GGUF; "
                        "use a weight-only recipe")
    if leaf.bits not in (4, 8):
        raise GGUFError(f"{path}: {leaf.bits}-bit weights have no GGUF block type here (4 or 8 bits)")
    # eqjax kernels are [in, out]: outputs are GGUF rows; a table [V, D] already is
    contracting, free = ((0,), (1,)) if linear else ((1,), (0,))
    try:
        b = blocked(leaf, contracting, free, path=path)
    except ExportError as e:
        raise GGUFError(str(e)) from None
    if b.K % BLOCK or (b.block % BLOCK and BLOCK % b.block):
        raise GGUFError(f"{path}: {b.K} inputs in scale blocks of {b.block} cannot be laid out as GGUF blocks of {BLOCK}")
    if b.block >= BLOCK:
        rep = b.block // BLOCK
        scales, zps = np.repeat(b.scales, rep, axis=1), np.repeat(b.zero_points, rep, axis=1)
    else:  # blocks of 16: two must agree to make one of 32
        s2, z2 = b.scales.reshape(b.N, -1, 2), b.zero_points.reshape(b.N, -1, 2)
        if not (np.all(s2[..., 0] == s2[..., 1]) and np.all(z2[..., 0] == z2[..., 1])):
            raise GGUFError(f"{path}: its scales change every 16 inputs; GGUF blocks hold 32")
        scales, zps = s2[..., 0], z2[..., 0]
    return b.codes[:, :b.K], scales[:, : b.K // BLOCK], zps[:, : b.K // BLOCK], b.bits


def _get(tree: dict, path: tuple[str, ...], src: str) -> Any:
    for k in path:
        if not isinstance(tree, dict) or k not in tree:
            raise GGUFError(f"{src}: params have no {'/'.join(path)} (a Llama params tree from eqjax.io.gguf.load_gguf)")
        tree = tree[k]
    return tree


def source_metadata(source: str | os.PathLike[str]) -> tuple[Any, list[tuple[str, Any, Any, Any]]]:
    """``(LlamaConfig, [(key, value, GGUFValueType, item type)])`` of a source GGUF file (its fields but the
    architecture and file type, which the writer sets) or HF directory (:func:`hf_gguf_metadata`)."""
    import gguf

    src = os.fspath(source)
    if Path(src).is_dir():
        try:
            cfg, _ = read_config(Path(src))
        except CheckpointError as e:
            raise GGUFError(str(e)) from None
        return cfg, hf_gguf_metadata(src, cfg)
    reader = _open(src)
    cfg = file_config(reader, source=src)
    entries = []
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        entries.append((key, field.contents(), field.types[0], sub))
    return cfg, entries


def _leaf_getter(params: Any, src: str) -> tuple[set[str], Callable[[tuple[str, ...]], Any]]:
    """``(every param path, path -> leaf)`` of a nested params dict or a :class:`~eqjax.io.hf.StreamedParams`.
    Streamed params are read a unit at a time (the table, the head, the final norm, one decoder block: one read
    of the files for all its leaves) and only the last unit read is kept, so a model larger than memory is
    written a unit at a time."""
    if not isinstance(params, StreamedParams):
        return {p for p, _ in flatten(params)}, lambda where: _get(params, where, src)
    unit: dict[str, Any] = {}

    def get(where: tuple[str, ...]) -> Any:
        path = "/".join(where)
        if path not in unit:
            unit.clear()
            unit.update(params.load([p for p in params.paths if p.split("/")[0] == where[0]]))
        return unit[path]

    return set(params.paths), get


def _gguf_tensor(leaf: Any, linear: bool, heads: int | None, path: str) -> tuple[str, np.ndarray]:
    """The GGUF type name and data of one leaf (torch layout, Q/K rows in llama.cpp's order)."""
    if half_initializer(leaf):  # a float16 HalfFloat: exact, 2 bytes each
        return "F16", np.ascontiguousarray(_reference(leaf, linear, heads).astype(np.float16))
    if lowered_at_use(leaf):
        codes, scales, zps, bits = _torch_blocks(leaf, linear, path)
        if heads is not None:
            codes, scales, zps = (permute_qk(a, heads) for a in (codes, scales, zps))
        return gguf_blocks(codes, scales, zps, bits, path)
    return "F32", np.ascontiguousarray(_reference(leaf, linear, heads))


def _reference(leaf: Any, linear: bool, heads: int | None) -> np.ndarray:
    """eqjax's float32 weights of ``leaf`` in torch layout (``[rows, K]``), in llama.cpp's row order with ``heads``."""
    ref = np.asarray(dequantize_leaf(leaf) if is_quantized(leaf) else leaf, np.float32)
    ref = ref.T if linear else ref
    return ref if heads is None else permute_qk(ref, heads)


def export_gguf(params: Any, out: str | os.PathLike[str], *, source: str | os.PathLike[str],
                overwrite: bool = False, metadata: tuple[Any, list] | None = None) -> dict[str, Any]:
    """Write ``params`` (eqjax's Llama tree, quantized or not, or a :class:`~eqjax.io.hf.StreamedParams` read a
    unit at a time) as a GGUF file with the metadata of ``source`` (a GGUF file or an HF directory:
    :func:`source_metadata`; ``metadata``: its result when the caller has it already).

    Every tensor is converted (and every unsupported leaf refused) before the file is opened; converted tensors
    wait in the ``gguf`` writer's temporary file, so one unit's leaves and one converted tensor are in memory. Returns a summary: tensor
    types and counts, bytes, and the read-back check (``max_abs_diff`` of the file's dequantized weights against
    eqjax's, per tensor type).
    """
    import gguf


    src = os.fspath(source)
    out = check_output_file(out, overwrite=overwrite, what="GGUF file")
    cfg, entries = metadata if metadata is not None else source_metadata(src)
    paths, get = _leaf_getter(params, src)
    plan = {name: (where, linear, heads)
            for name, (where, _, linear, heads) in tensor_plan(cfg, tied="lm_head/kernel" not in paths).items()}
    extra = sorted(paths - {"/".join(w) for w, _, _ in plan.values()})
    if extra:
        raise GGUFError(f"{src}: params hold {extra[:3]} that a llama GGUF file has no tensor for")
    kinds: dict[str, str] = {}
    sizes: dict[str, int] = {}
    with atomic_path(out) as tmp:
        w = gguf.GGUFWriter(tmp, "llama", use_temp_file=True)
        for key, value, kind, sub in entries:
            w.add_key_value(key, value, kind, sub_type=sub)
        factors = rope_freq_factors(cfg)
        if factors is not None:  # first, as llama.cpp's converter writes it
            w.add_tensor(ROPE_FREQS, factors)
            kinds[ROPE_FREQS], sizes["F32"] = "F32", sizes.get("F32", 0) + factors.nbytes
        for name, (where, linear, heads) in plan.items():
            kind, data = _gguf_tensor(get(where), linear, heads, "/".join(where))
            w.add_tensor(name, data, raw_dtype=None if kind == "F32" else getattr(gguf.GGMLQuantizationType, kind))
            kinds[name], sizes[kind] = kind, sizes.get(kind, 0) + data.nbytes
            del data
        quant = {k: v for k, v in sizes.items() if k != "F32"}
        main = max(quant, key=quant.__getitem__) if quant else "F32"
        w.add_uint32("general.file_type", _FILE_TYPE[main])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return {"path": str(out), "bytes": Path(out).stat().st_size, "file_type": main,
            "tensor_types": {k: sum(t == k for t in kinds.values()) for k in sorted(set(kinds.values()))},
            "check": _check(out, cfg, get, plan, kinds)}


_CHECK_PIECE = 1 << 26  # bytes of a tensor's rows read back and dequantized at once


def _check(out: Path, cfg: Any, get: Callable[[tuple[str, ...]], Any], plan: dict,
           kinds: dict[str, str]) -> dict[str, float]:
    """The written file read back: its metadata parsed to ``cfg``'s config and a tokenizer, every tensor's name,
    type and shape, and max |file - eqjax| per tensor type. A tensor at a time, its rows dequantized in pieces
    read from the file (not memory-mapped), so the check holds one tensor's eqjax weights and a piece of the
    file's."""
    from gguf.quants import dequantize

    reader = _open(out)
    back = file_config(reader, source=str(out))
    if (back.hidden, back.n_layers, back.vocab) != (cfg.hidden, cfg.n_layers, cfg.vocab):
        raise GGUFError(f"{out}: read back as another model ({back.hidden} wide, {back.n_layers} layers, "
                        f"{back.vocab} tokens)")
    want, got = rope_inv_freq(cfg).astype(np.float64), rope_inv_freq(back).astype(np.float64)
    if np.any(np.abs(got - want) > 64 * np.finfo(np.float32).eps * want):  # float32 factors, recomputed
        raise GGUFError(f"{out}: read back with other RoPE frequencies ({back.rope_scaling} for {cfg.rope_scaling})")
    load_tokenizer(out)
    tensors = {t.name: t for t in reader.tensors if t.name != ROPE_FREQS}
    if set(tensors) != set(plan):
        raise GGUFError(f"{out}: read back with tensors {sorted(set(tensors) ^ set(plan))[:3]} differing from the plan")
    worst: dict[str, float] = {}
    with open(out, "rb") as f:
        for name, (where, linear, heads) in plan.items():
            t, kind = tensors[name], kinds[name]
            if t.tensor_type.name != kind:
                raise GGUFError(f"{out}: tensor {name!r} read back as {t.tensor_type.name}, written as {kind}")
            ref = _reference(get(where), linear, heads)
            if tuple(int(n) for n in reversed(t.shape)) != ref.shape:
                raise GGUFError(f"{out}: tensor {name!r} read back with shape {tuple(reversed(t.shape))}, "
                                f"written {ref.shape}")
            ref = ref.reshape(ref.shape[0], -1)
            rows = ref.shape[0]
            row_bytes = int(t.n_bytes) // rows
            step = max(1, _CHECK_PIECE // max(1, row_bytes))
            err = 0.0
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                f.seek(int(t.data_offset) + r0 * row_bytes)
                raw = np.frombuffer(f.read((r1 - r0) * row_bytes), np.uint8).reshape(r1 - r0, row_bytes)
                got = np.asarray(dequantize(raw, t.tensor_type), np.float32).reshape(r1 - r0, -1)
                err = max(err, float(np.abs(got - ref[r0:r1]).max()))
            worst[kind] = max(worst.get(kind, 0.0), err)
            del ref
    return worst


# ------------------------------------------------------------------------------------ CLI
def check_gguf_recipe(recipe: Any) -> None:
    """Refuse, before any work, recipes whose params GGUF blocks cannot hold (named by the recipe)."""
    if getattr(recipe, "kv", None) is not None:
        raise GGUFError(f"recipe {recipe.name!r} quantizes the KV cache; a GGUF file holds weights only")
    for step in getattr(recipe, "steps", ()):
        kind = type(step).__name__
        if kind in ("Rotation", "ZeroQuantLKD", "SmoothQuant"):
            raise GGUFError(f"recipe {recipe.name!r}: {kind} makes weights llama.cpp's GGUF blocks cannot hold "
                            "(rotations / activation quantization); use a weight-only recipe")
        rules = [r for r in getattr(step, "rules", ()) if getattr(r, "weight", None) is not None]
        specs = [(r.weight.bits, getattr(r.weight.granularity, "group_size", None), r.act_bits) for r in rules]
        if hasattr(step, "bits"):  # GPTQ, AWQ, SignRound, searched RTN: bits and group_size on the step
            specs.append((step.bits, getattr(step, "group_size", None), None))
        for bits, size, act in specs:
            if act is not None:
                raise GGUFError(f"recipe {recipe.name!r} quantizes activations (A{act}); use a weight-only recipe")
            if bits not in (4, 8):
                raise GGUFError(f"recipe {recipe.name!r} makes {bits}-bit weights; GGUF blocks here are 4-bit "
                                "(Q4_0 / Q4_1) or 8-bit (Q8_0)")
            if size is not None and size % BLOCK:
                raise GGUFError(f"recipe {recipe.name!r}: groups of {size} are not whole GGUF blocks of {BLOCK}")


