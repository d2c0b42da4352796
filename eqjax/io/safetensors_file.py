"""Safetensors files read and written by eqjax's own code: every header entry checked against the others and
the file size before any tensor is used (a cut or corrupt file is a :class:`CheckpointError` naming the file and
the tensor), tensors read eagerly or mapped lazily (``np.memmap``: pages are read when a tensor is used and
released when it is dropped, so a checkpoint larger than memory can be read tensor by tensor).

Why not the ``safetensors`` package: its numpy API cannot save or load bfloat16 (the dtype most HF
checkpoints hold), and its loader gives no way to check a header against the file before reading.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from eqjax.core.errors import InputError

__all__ = ["CheckpointError", "FLOAT_DTYPE_NAMES", "LazyTensors", "read_header", "read_tensors", "write_safetensors", "unique_keys",
           "DuplicateKey"]


class CheckpointError(InputError):
    """A checkpoint is missing, malformed, or disagrees with its config (an
    :class:`~eqjax.core.errors.InputError`, hence a ``ValueError``)."""


class DuplicateKey(ValueError):
    """A JSON object names one key twice (the key is the message)."""


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json`` object hook refusing a key given twice (a second entry would silently replace the first)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKey(k)
        out[k] = v
    return out


_MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header
_ST_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
              "F8_E5M2": "float8_e5m2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U64": "<u8",
              "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?"}
FLOAT_DTYPE_NAMES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")  # float dtypes numpy calls kind "V"


def _st_dtype(code: Any) -> np.dtype | None:
    """The numpy dtype of a safetensors dtype code (None for an unknown one)."""
    import ml_dtypes

    spec = _ST_DTYPES.get(code) if isinstance(code, str) else None
    if spec is None:
        return None
    return np.dtype(getattr(ml_dtypes, spec)) if spec in FLOAT_DTYPE_NAMES else np.dtype(spec)


def _not_safetensors(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"{path}: not a valid safetensors file ({why})")


def _entry(path: Path, name: str, meta: Any) -> tuple[np.dtype, tuple[int, ...], int, int]:
    """``(dtype, shape, begin, end)`` of one header entry; a malformed entry raises naming the tensor."""
    if not isinstance(meta, dict):
        raise _not_safetensors(path, f"tensor {name}: expected a header object, found {type(meta).__name__}")
    dtype, shape, offsets = _st_dtype(meta.get("dtype")), meta.get("shape"), meta.get("data_offsets")
    if dtype is None:
        raise _not_safetensors(path, f"tensor {name}: expected a dtype of {', '.join(_ST_DTYPES)}, found {meta.get('dtype')!r}")
    if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
        raise _not_safetensors(path, f"tensor {name}: expected a shape of integers >= 0, found {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise _not_safetensors(path, f"tensor {name}: expected data_offsets [begin, end] with 0 <= begin <= end, "
                                     f"found {offsets!r}")
    begin, end = offsets
    nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
    if end - begin != nbytes:
        raise _not_safetensors(path, f"tensor {name}: shape {tuple(shape)} of {meta['dtype']} needs {nbytes} bytes, "
                                     f"data_offsets span {end - begin}")
    return dtype, tuple(shape), begin, end


def read_header(path: Path) -> tuple[dict[str, tuple[np.dtype, tuple[int, ...], int, int]], int]:
    """Every tensor entry of a safetensors file and where its data starts; entries are checked against
    each other and the file size (a cut file names the first tensor it cuts)."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= min(_MAX_HEADER, size - 8):
            raise _not_safetensors(path, f"truncated or corrupt: header length {n}, file size {size} bytes")
        blob = fh.read(n)
    try:
        header = json.loads(blob, object_pairs_hook=unique_keys)
    except DuplicateKey as e:
        raise _not_safetensors(path, f"corrupt header: tensor {e} listed twice") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _not_safetensors(path, f"truncated or corrupt header: {e}") from None
    if not isinstance(header, dict):
        raise _not_safetensors(path, f"corrupt header: expected a JSON object, found {type(header).__name__}")
    header.pop("__metadata__", None)
    entries = {name: _entry(path, name, meta) for name, meta in header.items()}
    data_len, pos, prev = size - 8 - n, 0, None
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda kv: kv[1][2:]):
        if end > data_len:
            raise _not_safetensors(path, f"truncated: tensor {name} needs data bytes [{begin}, {end}), the file "
                                         f"holds {data_len}")
        if begin != pos:
            what = f"overlaps tensor {prev}" if begin < pos else f"leaves bytes [{pos}, {begin}) to no tensor"
            raise _not_safetensors(path, f"corrupt header: tensor {name} at data bytes [{begin}, {end}) {what}")
        pos, prev = end, name
    if pos != data_len:
        raise _not_safetensors(path, f"corrupt: {data_len - pos} data bytes after the last tensor belong to no tensor")
    return entries, 8 + n


class LazyTensors(Mapping[str, np.ndarray]):
    """Tensors by name, each mapped from its file when it is looked up: a fresh read-only ``np.memmap`` per
    lookup, whose pages are read as they are used and released when the array is dropped (so reading a
    checkpoint tensor by tensor keeps only the tensors in use resident). ``entries``: name -> ``(file,
    dtype, shape, byte offset)`` of headers already checked."""

    def __init__(self, entries: Mapping[str, tuple[Path, np.dtype, tuple[int, ...], int]]):
        self.entries = dict(entries)

    def __getitem__(self, name: str) -> np.ndarray:
        path, dtype, shape, offset = self.entries[name]
        if int(np.prod(shape, dtype=np.int64)) == 0:
            return np.zeros(shape, dtype)
        try:
            return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path}: cannot map tensor {name}: {type(e).__name__}: {e}") from None

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][2]


def read_tensors(path: Path, *, lazy: bool = False) -> Mapping[str, np.ndarray]:
    """All tensors of one file as numpy arrays (bfloat16 / float8 via ml_dtypes), at the header's checked
    offsets; a corrupt or cut file raises CheckpointError naming the file (and tensor).
    ``lazy``: a :class:`LazyTensors` (nothing is read until a tensor is used)."""
    try:
        entries, start = read_header(path)
        if lazy:
            return LazyTensors({name: (path, dtype, shape, start + begin)
                                for name, (dtype, shape, begin, _) in entries.items()})
        out: dict[str, np.ndarray] = {}
        with open(path, "rb") as fh:
            for name, (dtype, shape, begin, end) in entries.items():
                fh.seek(start + begin)
                buf = fh.read(end - begin)
                if len(buf) != end - begin:
                    raise _not_safetensors(path, f"truncated while reading tensor {name}")
                out[name] = np.frombuffer(buf, dtype=dtype).reshape(shape)
        return out
    except (OSError, MemoryError) as e:
        raise CheckpointError(f"{path}: cannot read the weight file: {type(e).__name__}: {e}") from None


_ST_CODES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "int8": "I8", "uint8": "U8", "int32": "I32",
             "int64": "I64"}


def write_safetensors(path: Path, tensors: Mapping[str, np.ndarray]) -> None:
    """Write a safetensors file directly (safetensors.numpy cannot save bfloat16); ``tensors`` in file order."""
    codes = _ST_CODES
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
