"""What the Hugging Face quantized formats (:mod:`eqjax.io.compressed_tensors`, :mod:`eqjax.io.gptq`) share:
their error, the recipe pre-check, and the tokenizer files written beside the weights."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from eqjax.core.errors import CompatibilityError
from eqjax.core.numerics import codes, pack
from eqjax.core.pytree import nest_paths
from eqjax.core.qarray import PermutedKernel, QArray, validate_permuted
from eqjax.io.atomic import atomic_directory
from eqjax.io.hf import INDEX_FILE, float_tensors, write_safetensors
from eqjax.io.stream_ledger import StreamLedger, work_directory

__all__ = ["FormatError", "TOKENIZER_FILES", "WEIGHT_BITS", "recipe_refusal", "copy_tokenizer", "write_directory", "Shards", "shard_directory", "Encoder", "save_streamed", "pack_int32", "unpack_int32", "unsigned_codes",
           "group_order", "permuted", "stored_order"]

WEIGHT_BITS = (4, 8)
"""Weight widths written: the ones the formats' kernels (vLLM, transformers, GPTQ) take."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt")
"""Files copied from a source HF directory beside the weights."""


class FormatError(CompatibilityError):
    """A recipe, a param or a checkpoint an HF quantized format cannot hold or eqjax cannot read."""


def _steps(steps: Any) -> Iterator[Any]:
    for step in steps:
        yield step
        yield from _steps(getattr(step, "then", ()))


def recipe_refusal(recipe: Any, fmt: str, *, activations: bool) -> None:
    """Refuse, before any work, a recipe whose result ``fmt`` cannot hold, naming the recipe, the format and
    why: no weight quantization, KV-cache quantization, online rotations, quantized embeddings, widths other
    than 4 / 8 bits, and activation quantization (``activations``: int8 activations with int8 weights only)."""
    name = getattr(recipe, "name", str(recipe))
    why = f"recipe {name!r} cannot be written as {fmt}: "
    if getattr(recipe, "kv", None) is not None:
        raise FormatError(why + "it quantizes the KV cache at run time, which the format's checkpoints do not carry "
                          "for eqjax's KV scheme (write a recipe without 'kv')")
    if not getattr(recipe, "steps", ()):
        raise FormatError(why + "it quantizes no weight (the format holds quantized checkpoints; write float weights "
                          "as an HF directory with eqjax.io.hf.save_hf_checkpoint)")
    for step in _steps(getattr(recipe, "steps", ())):
        if getattr(step, "online_down", False):
            raise FormatError(why + "it rotates down_proj's input online (a Hadamard at run time), which the format "
                              "has no op for (rotations folded into the weights are fine)")
        if str(getattr(step, "name", "")).startswith("embedding-"):
            raise FormatError(why + "it quantizes the embedding table, which the format's loaders keep in float")
        specs = [(getattr(r.weight, "bits", None), r.act_bits) for r in getattr(step, "rules", ())
                 if getattr(r, "weight", None) is not None]
        if hasattr(step, "bits"):
            specs.append((step.bits, getattr(step, "act_bits", None)))
        for bits, act in specs:
            if bits is not None and bits not in WEIGHT_BITS:
                raise FormatError(why + f"it makes {bits}-bit weights; the format's kernels take 4 or 8 bits")
            if act is not None and not activations:
                raise FormatError(why + f"it quantizes activations (A{act}); the format holds weight-only quantization")
            if act is not None and act != 8:
                raise FormatError(why + f"it quantizes activations to {act} bits; the format's integer activations are int8")
            if act is not None and bits is not None and bits != 8:
                raise FormatError(why + f"it pairs {bits}-bit weights with int8 activations; the format's integer "
                                  "activation layout (int-quantized) holds int8 weights")


def write_directory(directory: str | os.PathLike[str], tensors: Mapping[str, np.ndarray], config: Mapping[str, Any], *,
                    kind: str, copy_from: str | os.PathLike[str] | None, files: Mapping[str, str | bytes] | None,
                    overwrite: bool) -> tuple[Path, int]:
    """Write an HF quantized directory atomically (model.safetensors, the tokenizer, config.json last);
    ``(its path, its bytes)``. ``kind``: the format, recorded in eqjax's artifact marker."""
    with atomic_directory(directory, overwrite=overwrite, kind=kind) as tmp:
        write_safetensors(tmp / "model.safetensors", tensors)
        copy_tokenizer(tmp, copy_from, files)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    root = Path(directory)
    return root, sum(f.stat().st_size for f in root.iterdir() if f.is_file())


class Shards:
    """Safetensors shards written one :meth:`add` at a time into a directory being filled (see
    :func:`shard_directory`); ``config``: config.json's object, set before the directory is closed."""

    def __init__(self, tmp: Path, root: Path):
        self.tmp, self.root = tmp, root
        self.files: list[Path] = []
        self.weight_map: dict[str, int] = {}
        self.total = 0
        self.size = 0
        self.config: dict[str, Any] | None = None

    def add(self, tensors: Mapping[str, np.ndarray], key: str | None = None) -> dict[str, Any] | None:
        """Write ``tensors`` (in order) as the next shard, at once (file ``.shard-<key>``: rewritten by a later
        add of the same key, as a resumed run does); returns its record for :meth:`restore`."""
        if not tensors:
            return None
        f = self.tmp / f".shard-{f'{len(self.files):05d}' if key is None else key}.safetensors"
        write_safetensors(f, tensors)
        record = {"file": f.name, "tensors": list(tensors), "bytes": sum(int(a.nbytes) for a in tensors.values())}
        self.restore([record])
        return record

    def restore(self, records: list[dict[str, Any]]) -> None:
        """Count shards already in the directory (:meth:`add`'s records) as written, in order."""
        for r in records:
            for name in r["tensors"]:
                if name in self.weight_map:
                    raise ValueError(f"tensor {name} written twice")
                self.weight_map[name] = len(self.files)
            self.total += int(r["bytes"])
            self.files.append(self.tmp / r["file"])

    def _finish(self) -> None:
        n = len(self.files)
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for f, name in zip(self.files, names):
            f.rename(self.tmp / name)
        index = {"metadata": {"total_size": self.total}, "weight_map": {k: names[i] for k, i in self.weight_map.items()}}
        (self.tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))


@contextlib.contextmanager
def shard_directory(directory: str | os.PathLike[str], *, overwrite: bool, kind: str,
                    copy_from: str | os.PathLike[str] | None, files: Mapping[str, str | bytes] | None,
                    work: Path | None = None) -> Iterator[Shards]:
    """An HF directory written shard by shard (:class:`Shards`), atomically: it appears, with its index,
    the tokenizer and config.json (last), only when the block exits normally; before that the previous
    ``directory`` is intact (:func:`eqjax.io.atomic.atomic_directory`, which ``work`` goes to)."""
    root = Path(directory)
    with atomic_directory(directory, overwrite=overwrite, kind=kind, work=work) as tmp:
        shards = Shards(tmp, root)
        yield shards
        if shards.config is None:
            raise ValueError("the shards' config.json object was not set")
        shards._finish()
        copy_tokenizer(tmp, copy_from, files)
        (tmp / "config.json").write_text(json.dumps(shards.config, indent=2, sort_keys=True))
    shards.size = sum(f.stat().st_size for f in root.iterdir() if f.is_file())


class Encoder(Protocol):
    """What a format gives :func:`save_streamed`: it encodes each HF tensor from eqjax leaves
    (:data:`eqjax.io.hf.Writer`: the file's tensors, or None for a float tensor written as is), collecting what
    config.json needs; ``state`` / ``restore`` carry that collection (JSON) across a resumed run."""

    def __call__(self, t: Any, leaves: list[Any], file_dtype: str) -> dict[str, np.ndarray] | None: ...
    def config(self, config: Any, dtype: str, extra: Mapping[str, Any] | None) -> dict[str, Any]: ...
    def state(self) -> dict[str, Any]: ...
    def restore(self, state: Mapping[str, Any]) -> None: ...
    def summary(self, root: Path, size: int) -> dict[str, Any]: ...


def save_streamed(directory: str | os.PathLike[str], model: Any, produce: Callable[[Callable[[str, dict[str, Any]], None],
                  StreamLedger | None], None], enc: Encoder, *, kind: str, dtype: str,
                  files: Mapping[str, str | bytes] | None = None, copy_from: str | os.PathLike[str] | None = None,
                  extra_config: Mapping[str, Any] | None = None, overwrite: bool = False,
                  run: Mapping[str, Any] | None = None, resume: bool = False) -> dict[str, Any]:
    """An HF quantized directory (format ``kind``, tensors encoded by ``enc``) for a model quantized unit by unit:
    ``produce(emit, ledger)`` calls ``emit(unit name, {param path: leaf})`` once per unit
    (:func:`eqjax.recipes.stream.stream_quantize`); each unit is encoded and written as its own safetensors
    shard at once, so no more than one unit is held. The directory appears only when every unit is written
    (the previous one is intact until then).

    ``run`` (the run's identity, JSON) makes the write resumable: shards go to :func:`work_directory` with a
    :class:`~eqjax.io.stream_ledger.StreamLedger` (handed to ``produce``, None without ``run``), and
    ``resume`` goes on from a killed run's last finished unit. Returns ``enc.summary``."""
    config = model.config
    work = None if run is None else work_directory(directory)
    ledger = None if run is None else StreamLedger(work, {**run, "format": kind}, resume=resume)
    if ledger is not None:
        enc.restore(ledger.encoder)
    with shard_directory(directory, overwrite=overwrite, kind=kind, copy_from=copy_from, files=files,
                         work=work) as shards:
        if ledger is not None:
            shards.restore(ledger.shards())

        def emit(unit: str, leaves: dict[str, Any]) -> None:
            keep = lambda t: all("/".join(p) in leaves for p in t.paths)  # noqa: E731
            shard = shards.add(float_tensors(config, nest_paths(leaves), dtype, write=enc, only=keep),
                               key=None if ledger is None else unit)
            if ledger is not None:
                ledger.stage(unit, shard, enc.state())

        produce(emit, ledger)
        shards.config = enc.config(config, dtype, extra_config)
        if ledger is not None:
            ledger.close()
    return enc.summary(shards.root, shards.size)


def copy_tokenizer(target: Path, copy_from: str | os.PathLike[str] | None,
                   files: Mapping[str, str | bytes] | None) -> None:
    """Write the tokenizer beside the weights in ``target``: :data:`TOKENIZER_FILES` copied from the HF directory
    ``copy_from`` (those it has), then ``files`` (``{name: text or bytes}``)."""
    src = Path(copy_from) if copy_from is not None else None
    for name in TOKENIZER_FILES if src is not None else ():
        if (src / name).is_file():
            shutil.copyfile(src / name, target / name)
    for name, content in (files or {}).items():
        (target / name).write_bytes(content.encode() if isinstance(content, str) else content)


def unsigned_codes(q: QArray) -> np.ndarray:
    """Codes of a 2-D ``q`` as unsigned values (uint8, logical shape): stored codes as they are, symmetric int8
    values shifted by ``2**(bits-1)``; no copy beyond the unpacked codes themselves."""
    c = np.asarray(codes(q))
    if q.symmetric and not q.packed:  # int8 values v around 0: v + 2**(bits-1) without a wider copy
        return _offset_int8(c, q.bits)
    return c.astype(np.uint8, copy=False)


def _offset_int8(c: np.ndarray, bits: int) -> np.ndarray:
    """``c + 2**(bits-1)`` as uint8 for int8 values ``c`` in ``[-2**(bits-1), 2**(bits-1))``."""
    if bits == 8:  # two's complement: v + 128 (mod 256) is v's byte with its top bit flipped
        return np.bitwise_xor(c.view(np.uint8), np.uint8(0x80))
    return (c + np.int8(2 ** (bits - 1))).view(np.uint8)


def pack_int32(u: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes ``[rows, n]`` -> int32 words ``[rows, ceil(n * bits / 32)]``, first code lowest; one
    field at a time (temporaries of the words' size, not a uint32 copy of every code)."""
    per = 32 // bits
    rows, n = u.shape
    words = np.zeros((rows, -(-n // per)), np.uint32)
    for j in range(min(per, n)):
        field = u[:, j::per]  # the j-th code of every word (the last words may lack it)
        words[:, :field.shape[1]] |= field.astype(np.uint32) << np.uint32(bits * j)
    return words.view(np.int32)


def unpack_int32(words: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Inverse of :func:`pack_int32`: unsigned codes ``[rows, n]`` (uint8), written field by field into the
    result (one ``[rows, words]`` uint32 temporary at a time: an LM head's 128k rows would otherwise need
    eight, and their uint32 stack)."""
    per = 32 // bits
    w = words.view(np.uint32)
    out = np.empty((w.shape[0], w.shape[1] * per), np.uint8)
    for j in range(per):
        out[:, j::per] = (w >> np.uint32(bits * j)) & np.uint32(2**bits - 1)
    return out[:, :n]


def pack_codes(u: np.ndarray, bits: int) -> jax.Array:
    """eqjax's packed form (:func:`eqjax.core.numerics.pack` along axis 0) of unsigned ``bits``-bit codes
    ``u [in, out]``, computed as one compiled program (eagerly, each step would hold a uint32 copy of ``u``)."""
    return _pack_axis0(jnp.asarray(u), bits)


_pack_axis0 = jax.jit(lambda c, bits: pack(c, bits, 0), static_argnums=1)


def group_order(g_idx: np.ndarray | None, n_in: int, size: int, where: str) -> np.ndarray | None:
    """The input order in which a stored group index ``g_idx [in]`` (each input's group) becomes contiguous
    groups of ``size`` (the last one shorter): None where it already is (or there is none), else the stable
    permutation ``perm`` with ``g_idx[perm] == arange(in) // size`` (activation-ordered groups, ``desc_act``).
    :class:`FormatError` naming ``where`` when no such order exists (a group of another size)."""
    if g_idx is None:
        return None
    g = np.asarray(g_idx)
    contiguous = np.arange(n_in) // size
    if g.ndim != 1 or g.shape[0] != n_in or not np.issubdtype(g.dtype, np.integer):
        raise FormatError(f"{where}: expected an integer group index of {n_in} inputs, found {g.dtype.name} {g.shape}")
    if np.array_equal(g, contiguous):
        return None
    perm = np.argsort(g, kind="stable").astype(np.int32)
    if not np.array_equal(g[perm], contiguous):
        raise FormatError(f"{where}: groups of other sizes than the group size {size} (each group must hold {size} "
                          "inputs, the last one the rest)")
    return perm


def permuted(part: Any, perm: np.ndarray | None, where: str) -> Any:
    """``part`` (an ``[in, out]`` QArray whose rows are in ``perm``'s order) as the weight it stands for: a
    :class:`~eqjax.core.qarray.PermutedKernel` when ``perm`` is given, else ``part`` itself."""
    if perm is None:
        return part
    return validate_permuted(PermutedKernel(part, jnp.asarray(perm, jnp.int32), 0), name=where)


def stored_order(parts: list[Any], name: str) -> tuple[list[Any], np.ndarray | None]:
    """``(inner parts, inverse order)`` of the parts of one tensor to be written: PermutedKernels' inner kernels
    and the order that puts their rows back in input order (``argsort(perm)``; the stored group index is then
    ``(arange(in) // size)[inverse]``), or ``(parts, None)`` when none is permuted. Fused parts in different
    input orders are a :class:`FormatError` naming ``name``."""
    perms = [np.asarray(p.perm) if isinstance(p, PermutedKernel) else None for p in parts]
    if all(p is None for p in perms):
        return parts, None
    if any(p is None or not np.array_equal(p, perms[0]) for p in perms):
        raise FormatError(f"{name}: fused parts whose inputs are in different orders (activation-ordered groups)")
    return [p.kernel for p in parts], np.argsort(perms[0]).astype(np.int32)
