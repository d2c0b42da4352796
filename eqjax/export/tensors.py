"""Where an ONNX graph's initializers live while it is built, and how they are written out.

A :class:`TensorStore` without a file keeps every initializer inside the ``ModelProto`` (small graphs, tests).
With a spill file, each initializer of at least ``threshold`` bytes is appended to that file the moment it is
made and the ``ModelProto`` holds only a reference (ONNX external data: location, offset, length), so building
the graph of a model holds no second copy of its weights. Graph passes that rewrite initializers (packing
sibling projections) read them back through :meth:`TensorStore.array` (a read-only memory map) and add the
rewritten ones through :meth:`TensorStore.tensor`; what they drop stays behind in the spill file until
:meth:`TensorStore.save` copies the initializers the graph still reads, in graph order, into the package's data
file, one tensor at a time.

Large tensors start at multiples of 64 KiB in the data file (the allocation granularity of every platform
onnxruntime maps files on), so onnxruntime can map them instead of reading them into its own buffers.
"""

from __future__ import annotations

import os
import pathlib
import shutil
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["TensorStore", "DATA_FILE", "external_info"]

DATA_FILE = "model.onnx.data"
_MAP_ALIGN = 1 << 16  # tensors of >= 1 MiB: mappable on every platform
_SMALL_ALIGN = 64
_COPY_CHUNK = 64 << 20


def external_info(t: TensorProto) -> dict[str, str]:
    """The ``external_data`` entries of ``t`` (location, offset, length) as a dict; empty for an inline tensor."""
    return {e.key: e.value for e in t.external_data} if t.data_location == TensorProto.EXTERNAL else {}


def _set_external(t: TensorProto, location: str, offset: int, length: int) -> None:
    del t.external_data[:]
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        e = t.external_data.add()
        e.key, e.value = k, v


def _aligned_write(f: Any, data: memoryview | bytes, nbytes: int) -> int:
    """Append ``data`` to ``f`` at the next boundary for its size; returns its offset."""
    align = _MAP_ALIGN if nbytes >= 1 << 20 else _SMALL_ALIGN
    pad = -f.tell() % align
    if pad:
        f.write(b"\0" * pad)
    offset = f.tell()
    f.write(data)
    return offset


class TensorStore:
    """Initializers of one graph: inside the ``ModelProto`` (``spill=None``) or appended to the file ``spill``.

    ``threshold``: tensors smaller than this many bytes always stay inside the ``ModelProto`` (shape vectors,
    scalars), as ``onnx.save_model``'s own ``size_threshold`` does.
    """

    def __init__(self, spill: str | os.PathLike[str] | None = None, *, threshold: int = 1024) -> None:
        self.spill = pathlib.Path(spill) if spill is not None else None
        self.threshold = int(threshold)
        self._f = open(self.spill, "w+b") if self.spill is not None else None

    def tensor(self, name: str, array: Any) -> TensorProto:
        """The initializer ``name`` holding ``array`` (written to the spill file now when it is large)."""
        arr = np.asarray(array)
        arr = np.ascontiguousarray(arr).reshape(arr.shape)  # (ascontiguousarray makes a scalar 1-d)
        if self._f is None or arr.nbytes < self.threshold or arr.dtype.kind not in "biuf" \
                or arr.dtype.byteorder == ">":
            return numpy_helper.from_array(arr, name)
        offset = _aligned_write(self._f, memoryview(arr.reshape(-1)).cast("B"), arr.nbytes)
        t = TensorProto()
        t.name, t.data_type = name, helper.np_dtype_to_tensor_dtype(arr.dtype)
        t.dims.extend(int(d) for d in arr.shape)
        _set_external(t, self.spill.name, offset, arr.nbytes)
        return t

    def array(self, t: TensorProto) -> np.ndarray:
        """The values of an initializer made by :meth:`tensor` (a read-only map of the spill file when spilled)."""
        info = external_info(t)
        if not info:
            return numpy_helper.to_array(t)
        if self._f is None or info.get("location") != self.spill.name:
            raise ValueError(f"initializer {t.name!r} lives in {info.get('location')!r}, not in this store")
        self._f.flush()
        dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
        shape = tuple(int(d) for d in t.dims)
        if not int(np.prod(shape)):
            return np.zeros(shape, dtype)
        return np.memmap(self.spill, dtype=dtype, mode="r", offset=int(info["offset"]), shape=shape)

    def save(self, model: onnx.ModelProto, path: str | os.PathLike[str], *, location: str = DATA_FILE) -> None:
        """Write ``model`` to ``path`` with every initializer of ``threshold`` bytes or more in ``location``
        beside it (spilled ones copied in chunks, in graph order); the spill file is removed."""
        path = pathlib.Path(path)
        if self._f is None:
            onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=location, size_threshold=self.threshold)
            return
        self._f.flush()
        with open(path.parent / location, "wb") as out:
            for t in model.graph.initializer:
                info = external_info(t)
                if info:
                    offset, length = int(info["offset"]), int(info["length"])
                    pad = -out.tell() % (_MAP_ALIGN if length >= 1 << 20 else _SMALL_ALIGN)
                    out.write(b"\0" * pad)
                    new = out.tell()
                    self._f.seek(offset)
                    shutil.copyfileobj(_Slice(self._f, length), out, _COPY_CHUNK)
                    _set_external(t, location, new, length)
                elif len(t.raw_data) >= self.threshold:
                    new = _aligned_write(out, t.raw_data, len(t.raw_data))
                    n = len(t.raw_data)
                    t.ClearField("raw_data")
                    _set_external(t, location, new, n)
        onnx.save_model(model, str(path))
        self.close()
        self.spill.unlink(missing_ok=True)

    def close(self) -> None:
        """Close the spill file (kept on disk until :meth:`save` or the caller removes it)."""
        if self._f is not None and not self._f.closed:
            self._f.close()


class _Slice:
    """A file object reading at most ``n`` bytes from ``f``'s position (for ``shutil.copyfileobj``)."""

    def __init__(self, f: Any, n: int) -> None:
        self.f, self.left = f, n

    def read(self, size: int = -1) -> bytes:
        size = self.left if size < 0 else min(size, self.left)
        data = self.f.read(size)
        self.left -= len(data)
        return data
