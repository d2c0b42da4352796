"""The quantized array type.

A :class:`QArray` is a frozen dataclass registered as a JAX pytree. Its array fields (``values``,
``scale``, ``zero_point``) are pytree leaves; everything else is static metadata, so a QArray can be
passed through ``jax.jit``, ``shard_map``, Orbax and ``jax.tree.map`` like any other pytree.

Layouts (the :class:`Granularity` of the scale):

* ``per_tensor()``: one scale for the whole tensor.
* ``per_channel(axes)``: one scale per index of the *kept* axes (e.g. ``per_channel(1)`` on a
  ``[in, out]`` kernel is one scale per output channel; ``per_channel(0)`` on ``[tokens, features]``
  activations is per-token).
* ``per_group(axis, size)``: ``axis`` is cut into contiguous groups of ``size`` elements; one scale per
  group *and* per index of every other axis (the usual group-wise weight layout for ``axis=0`` of an
  ``[in, out]`` kernel). When ``size`` does not divide the axis the last group is shorter
  (``576 = 4 x 128 + 64``, as GPTQ/AWQ reference code does it) and has its own scale.
* ``per_group((a, ..., b), size)``: groups of ``size`` along the *flattened* (row-major) product of
  the consecutive axes ``a..b``, as a weight contracted over several axes (``[heads, head_dim, out]``)
  is grouped along its flattened input ``K``. The scale has size 1 on ``a..b-1`` and
  ``ceil(prod(shape[a..b]) / size)`` on ``b``; a single axis is the layout above.

Storage ("codes"):

* ``bits <= 4``: unsigned codes in ``[0, 2**bits - 1]`` packed densely along ``pack_axis`` (always the
  group axis for group layouts, the last one for a multi-axis group, else axis 0): ``n = 8 / gcd(bits, 8)`` consecutive codes occupy
  ``bits * n / 8`` bytes, little-endian, first code in the lowest bits. For 4 bits this is "two per
  byte, even index in the low nibble"; 2 bits four per byte; 3 bits eight codes in three bytes. The
  pack axis is zero-padded to a multiple of ``n``; ``shape`` holds the unpadded shape.
  Symmetric packed arrays use the implicit zero point ``2**(bits-1)``, so they hold all ``2**bits``
  integers ``[-2**(bits-1), 2**(bits-1) - 1]`` (code 0 is ``-2**(bits-1)``, used by full-range grids).
* ``5 <= bits <= 8``: one code per byte, unpacked. Symmetric: ``int8`` values in
  ``[-(2**(bits-1) - 1), 2**(bits-1) - 1]``, zero point 0. Asymmetric: ``uint8`` codes in
  ``[0, 2**bits - 1]``.

Value represented: ``x_hat = (code - zp) * scale`` with ``zp`` the stored zero point (asymmetric), the
implicit ``2**(bits-1)`` (symmetric, packed) or 0 (symmetric, unpacked).

Invariants (checked by :func:`validate`):

1. ``2 <= bits <= 8``.
2. ``scale.ndim == len(shape)``; ``scale.shape`` equals :func:`scale_shape` of the layout; ``scale`` is
   float32, float16 or bfloat16, finite and strictly positive.
3. ``zero_point is None`` iff ``symmetric``; when present it has ``scale``'s shape, dtype ``uint8``,
   and lies in ``[0, 2**bits - 1]``. An asymmetric array represents 0.0 exactly (code == zp).
4. ``values.dtype`` and ``values.shape`` are those :func:`storage_shape` / :func:`storage_dtype` give;
   every (unpacked) code lies in its range.
5. For group layouts the scale has ``ceil(shape[axis] / group_size)`` entries along ``axis`` (for a
   multi-axis group: ``ceil(prod(shape[axes]) / group_size)`` on the last axis, 1 on the others; the
   axes are consecutive and ascending).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from eqjax.core.errors import InputError
from eqjax.core.hadamard import hadamard_transform, random_signs

__all__ = [
    "Granularity",
    "QArray",
    "QArrayError",
    "per_tensor",
    "per_channel",
    "per_group",
    "describe_granularity",
    "per_output_channel",
    "per_input_group",
    "scale_shape",
    "storage_shape",
    "storage_dtype",
    "codes_per_word",
    "validate",
    "ActQuantKernel",
    "RotatedKernel",
    "PermutedKernel",
    "validate_permuted",
    "HalfFloat",
    "HALF_DTYPES",
    "validate_half",
    "is_quantized",
]

SUPPORTED_BITS = tuple(range(2, 9))
SCALE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


class QArrayError(InputError):
    """A quantized array (or the request to build one) breaks an invariant."""


@dataclasses.dataclass(frozen=True)
class Granularity:
    """Which elements share a scale. Static metadata; build with the helper functions below.

    ``tensor`` / ``channel`` / ``group`` name concrete axes of an array. ``output`` (one scale per
    output channel) and ``input_group`` (groups of ``group_size`` along the input) are *role-relative*:
    they name no axes and are resolved against how the model uses the weight
    (:func:`eqjax.core.roles.resolve_granularity`: a matmul's free axes / its flattened contracted axes)
    before anything is quantized; a QArray always holds a concrete granularity.
    """

    kind: Literal["tensor", "channel", "group", "output", "input_group"]
    axes: tuple[int, ...] = ()
    group_size: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("tensor", "channel", "group", "output", "input_group"):
            raise QArrayError(f"unknown granularity kind {self.kind!r}")
        if self.kind in ("output", "input_group") and self.axes:
            raise QArrayError(f"a role-relative granularity ({self.kind}) takes no axes")
        if self.kind == "input_group" and self.group_size < 1:
            raise QArrayError("an input_group granularity needs group_size >= 1")
        if self.kind == "group" and (not self.axes or self.group_size < 1):
            raise QArrayError("a group granularity needs at least one axis and group_size >= 1")
        if self.kind == "tensor" and self.axes:
            raise QArrayError("a per-tensor granularity takes no axes")

    @property
    def role_relative(self) -> bool:
        return self.kind in ("output", "input_group")

    def normalized(self, ndim: int) -> "Granularity":
        """The same granularity with non-negative axes for an array of rank ``ndim``."""
        if self.role_relative:
            raise QArrayError(f"granularity {self} must be resolved against the weight's use first")
        axes = []
        for a in self.axes:
            if not -ndim <= a < ndim:
                raise QArrayError(f"axis {a} out of range for an array of rank {ndim}")
            axes.append(a % ndim)
        if self.kind == "group" and len(axes) > 1 and axes != list(range(axes[0], axes[0] + len(axes))):
            raise QArrayError(f"a multi-axis group runs along consecutive ascending axes, got {tuple(self.axes)}")
        return dataclasses.replace(self, axes=tuple(sorted(set(axes))) if self.kind == "channel" else tuple(axes))

    def __str__(self) -> str:
        if self.kind == "tensor":
            return "per-tensor"
        if self.kind == "channel":
            return f"per-channel{self.axes}"
        if self.kind == "output":
            return "per-output-channel"
        if self.kind == "input_group":
            return f"group{self.group_size}@input"
        if len(self.axes) > 1:
            return f"group{self.group_size}@axes{self.axes[0]}-{self.axes[-1]}"
        return f"group{self.group_size}@axis{self.axes[0]}"


def describe_granularity(gran: Granularity, shape: tuple[int, ...]) -> str:
    """``str(gran)`` for an array of ``shape``, naming the group actually used where the grouped axes hold
    fewer elements than one group (``group128@axis0 (one group of 64)``)."""
    if gran.kind != "group":
        return str(gran)
    span = int(np.prod([shape[a] for a in gran.axes], dtype=np.int64))
    return f"{gran} (one group of {span})" if span < gran.group_size else str(gran)


def per_tensor() -> Granularity:
    """One scale for the whole tensor."""
    return Granularity("tensor")


def per_channel(axes: int | tuple[int, ...] = -1) -> Granularity:
    """One scale per index of the kept ``axes``."""
    return Granularity("channel", (axes,) if isinstance(axes, int) else tuple(axes))


def per_group(axis: int | tuple[int, ...], size: int) -> Granularity:
    """Contiguous groups of ``size`` along ``axis`` (or along the flattened consecutive ``axes``), one
    scale per group and per other index."""
    return Granularity("group", (axis,) if isinstance(axis, int) else tuple(axis), int(size))


def per_output_channel() -> Granularity:
    """One scale per output channel of a matmul weight (its free axes), whatever its layout."""
    return Granularity("output")


def per_input_group(size: int) -> Granularity:
    """Groups of ``size`` along a matmul weight's input (its contracted axes, flattened), whatever its layout."""
    return Granularity("input_group", (), int(size))


def scale_shape(shape: tuple[int, ...], gran: Granularity) -> tuple[int, ...]:
    """Shape of the scale (and zero point) for ``shape`` under a normalized granularity."""
    if gran.kind == "tensor":
        return (1,) * len(shape)
    if gran.kind == "channel":
        return tuple(d if i in gran.axes else 1 for i, d in enumerate(shape))
    axes = gran.axes
    n = -(-int(np.prod([shape[a] for a in axes], dtype=np.int64)) // gran.group_size)
    return tuple(n if i == axes[-1] else 1 if i in axes else d for i, d in enumerate(shape))


def codes_per_word(bits: int) -> int:
    """How many consecutive codes form one packed word (``bits * n / 8`` whole bytes)."""
    return 8 // math.gcd(bits, 8)


def is_packed(bits: int) -> bool:
    return bits <= 4


def pack_axis_for(gran: Granularity) -> int:
    return gran.axes[-1] if gran.kind == "group" else 0


def storage_shape(shape: tuple[int, ...], bits: int, pack_axis: int) -> tuple[int, ...]:
    """Shape of ``values`` for an array of logical ``shape``."""
    if not is_packed(bits) or not shape:
        return tuple(shape)
    n = codes_per_word(bits)
    length = -(-shape[pack_axis] // n) * n
    packed = length * bits // 8
    return tuple(packed if i == pack_axis else d for i, d in enumerate(shape))


def storage_dtype(bits: int, symmetric: bool) -> np.dtype:
    if is_packed(bits) or not symmetric:
        return np.dtype(np.uint8)
    return np.dtype(np.int8)


def code_range(bits: int, symmetric: bool) -> tuple[int, int]:
    """Range of the stored codes (unpacked)."""
    if symmetric and not is_packed(bits):
        q = 2 ** (bits - 1) - 1
        return -q, q
    if symmetric:  # packed: q + 2**(b-1) with q in [-2**(b-1), 2**(b-1)-1] (every code)
        return 0, 2**bits - 1
    return 0, 2**bits - 1


def implicit_zero_point(bits: int) -> int:
    """Zero point of a symmetric array (not stored)."""
    return 2 ** (bits - 1) if is_packed(bits) else 0


@dataclasses.dataclass(frozen=True)
class QArray:
    """Integer codes plus scale (and zero point) standing for a float array. See the module docs.

    Attributes:
      values: packed or unpacked codes (see module docs), ``storage_shape(shape, bits, pack_axis)``.
      scale: float32/float16/bfloat16, ``scale_shape(shape, granularity)``, > 0.
      zero_point: uint8 of the scale's shape (asymmetric) or None (symmetric).
      bits: 2..8.
      symmetric: True for a signed, zero-centred grid.
      granularity: which elements share a scale.
      shape: logical (unpacked, unpadded) shape.
      dtype: the float dtype ``dequantize`` returns by default.
    """

    values: jax.Array
    scale: jax.Array
    zero_point: jax.Array | None
    bits: int
    symmetric: bool
    granularity: Granularity
    shape: tuple[int, ...]
    dtype: Any = jnp.float32

    @property
    def pack_axis(self) -> int:
        return pack_axis_for(self.granularity)

    @property
    def packed(self) -> bool:
        return is_packed(self.bits)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """True storage size in bytes: codes + scales + zero points."""
        total = _nbytes(self.values) + _nbytes(self.scale)
        if self.zero_point is not None:
            total += _nbytes(self.zero_point)
        return total

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def effective_zero_point(self) -> jax.Array:
        """Zero point as int32 of the scale's shape (stored or implicit)."""
        if self.zero_point is not None:
            return self.zero_point.astype(jnp.int32)
        return jnp.full(self.scale.shape, implicit_zero_point(self.bits), jnp.int32)

    def __repr__(self) -> str:
        kind = "sym" if self.symmetric else "asym"
        if not all(hasattr(x, "shape") and hasattr(x, "dtype") for x in (self.values, self.scale)):
            # a tree map over the fields put other leaves there (shapes, dtypes, specs): show them as they are
            return f"QArray(int{self.bits} {kind}, {self.granularity}, values={self.values!r}, scale={self.scale!r})"
        return (
            f"QArray(int{self.bits} {kind}, {self.granularity}, shape={self.shape}, "
            f"dtype={jnp.dtype(self.dtype).name}, nbytes={self.nbytes})"
        )


def _nbytes(a: Any) -> int:
    return int(np.prod(a.shape, dtype=np.int64)) * jnp.dtype(a.dtype).itemsize


jax.tree_util.register_dataclass(
    QArray,
    data_fields=["values", "scale", "zero_point"],
    meta_fields=["bits", "symmetric", "granularity", "shape", "dtype"],
)


def validate(q: QArray, *, check_values: bool = True, name: str = "QArray") -> QArray:
    """Check every invariant of the module docs; raise :class:`QArrayError` naming ``name``.

    ``check_values`` also reads the arrays (ranges, finiteness); it is skipped under tracing.
    Returns ``q`` so it can be chained.
    """
    where = f"{name} (shape {q.shape}, int{q.bits})"
    if q.bits not in SUPPORTED_BITS:
        raise QArrayError(f"{where}: bits must be in 2..8, got {q.bits}")
    gran = q.granularity.normalized(len(q.shape))
    if gran != q.granularity:
        raise QArrayError(f"{where}: granularity {q.granularity} is not normalized")
    want_scale = scale_shape(q.shape, gran)
    if tuple(q.scale.shape) != want_scale:
        raise QArrayError(f"{where}: scale shape {tuple(q.scale.shape)} != expected {want_scale}")
    if jnp.dtype(q.scale.dtype) not in SCALE_DTYPES:
        raise QArrayError(f"{where}: scale dtype must be float32, float16 or bfloat16, got {q.scale.dtype}")
    if q.symmetric != (q.zero_point is None):
        raise QArrayError(f"{where}: zero_point must be None exactly when symmetric")
    if q.zero_point is not None:
        if tuple(q.zero_point.shape) != want_scale:
            raise QArrayError(f"{where}: zero_point shape {tuple(q.zero_point.shape)} != {want_scale}")
        if jnp.dtype(q.zero_point.dtype) != jnp.uint8:
            raise QArrayError(f"{where}: zero_point dtype must be uint8, got {q.zero_point.dtype}")
    want_values = storage_shape(q.shape, q.bits, pack_axis_for(gran))
    if tuple(q.values.shape) != want_values:
        raise QArrayError(f"{where}: values shape {tuple(q.values.shape)} != expected {want_values}")
    want_dtype = storage_dtype(q.bits, q.symmetric)
    if jnp.dtype(q.values.dtype) != want_dtype:
        raise QArrayError(f"{where}: values dtype {q.values.dtype} != expected {want_dtype}")
    if check_values and not any(isinstance(a, jax.core.Tracer) for a in (q.values, q.scale, q.zero_point)):
        scale = np.asarray(q.scale.astype(jnp.float32))
        if not np.all(np.isfinite(scale)) or not np.all(scale > 0):
            raise QArrayError(f"{where}: scale must be finite and > 0")
        lo, hi = code_range(q.bits, q.symmetric)
        if q.zero_point is not None:
            zp = np.asarray(q.zero_point)
            if zp.max(initial=0) > 2**q.bits - 1:
                raise QArrayError(f"{where}: zero point above {2**q.bits - 1}")
        if not q.packed:
            v = np.asarray(q.values)
            if v.size and (v.min() < lo or v.max() > hi):
                raise QArrayError(f"{where}: codes outside [{lo}, {hi}]")
    return q


@dataclasses.dataclass(frozen=True)
class ActQuantKernel:
    """A quantized weight whose input activations are quantized too (W8A8 and friends).

    Attributes:
      weight: QArray ``[in, out]``; symmetric per-channel/per-tensor, or group-wise along ``in``
        (ZeroQuant), any 2..8 bits.
      act_scale: None for dynamic scales, else a static float32 scale of shape ``()`` (per-tensor),
        e.g. calibrated by SmoothQuant or tracked by :mod:`eqjax.calibration.ema`.
      act_bits: activation bits (8).
      act_granularity: ``"token"`` (one scale per row of the flattened input) or ``"tensor"``.
      act_full_range: the activation grid. False (eqjax's): ``scale = absmax / qmax`` with
        ``qmax = 2**(act_bits-1) - 1``, codes in ``[-qmax, qmax]``. True (the compressed-tensors package's
        rule for int activations, which checkpoints in that format are evaluated with):
        ``scale = absmax / (qmax + 1/2)`` (127.5 at 8 bits), codes in ``[-qmax - 1, qmax]``.
    """

    weight: QArray
    act_scale: jax.Array | None = None
    act_bits: int = 8
    act_granularity: Literal["token", "tensor"] = "token"
    act_full_range: bool = False

    def __post_init__(self) -> None:
        if not 2 <= self.act_bits <= 8:
            raise ValueError(f"activation bits must be in 2..8, got {self.act_bits}")
        if self.act_granularity not in ("token", "tensor"):
            raise ValueError(f"act_granularity must be 'token' or 'tensor', got {self.act_granularity!r}")
        if not isinstance(self.act_full_range, bool):
            raise ValueError(f"act_full_range must be a bool, got {self.act_full_range!r}")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        extra = 0 if self.act_scale is None else self.act_scale.size * self.act_scale.dtype.itemsize
        return self.weight.nbytes + extra


jax.tree_util.register_dataclass(
    ActQuantKernel,
    data_fields=["weight", "act_scale"],
    meta_fields=["act_bits", "act_granularity", "act_full_range"],
)


class _InputTransformed:
    """What a weight whose input is transformed before its inner ``kernel`` shares: the inner kernel's shape, float
    dtype and stored bytes."""

    kernel: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.kernel.shape)

    @property
    def dtype(self) -> Any:
        k = self.kernel.weight if isinstance(self.kernel, ActQuantKernel) else self.kernel
        return k.dtype

    @property
    def nbytes(self) -> int:
        k = self.kernel
        return int(k.nbytes) if is_quantized(k) else int(np.prod(k.shape, dtype=np.int64)) * jnp.dtype(k.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class RotatedKernel(_InputTransformed):
    """A weight whose input is rotated online (QuaRot's Hadamard before ``down_proj``).

    The weight's use computes ``(x @ Q) . kernel`` with ``x``'s axis paired with the weight's input
    axis ``axis`` transformed by ``Q = diag(signs) H_n / sqrt(n)`` (:mod:`eqjax.core.hadamard`,
    ``signs = random_signs(n, seed)``, ``n = shape[axis]``), so it stands for the float weight
    ``Q . kernel`` (``Q`` applied along ``axis``) and nothing but the seed is stored besides
    ``kernel``.

    Attributes:
      kernel: a float array, QArray or ActQuantKernel (the rotated weight; for an ActQuantKernel the
        rotated activation is what is quantized).
      seed: the random signs' seed.
      axis: the weight's (only) contracted input axis.
    """

    kernel: Any
    seed: int = 0
    axis: int = 0

    def signs(self) -> np.ndarray:

        return random_signs(self.shape[self.axis], self.seed)

    def rotate_input(self, x: jax.Array, axis: int = -1) -> jax.Array:
        """``x @ Q`` along ``x``'s ``axis`` (the one paired with the weight's input axis)."""

        return hadamard_transform(x, self.signs(), axis=axis)


jax.tree_util.register_dataclass(RotatedKernel, data_fields=["kernel"], meta_fields=["seed", "axis"])


@dataclasses.dataclass(frozen=True)
class PermutedKernel(_InputTransformed):
    """A weight whose input features are gathered in another order before its inner kernel is applied
    (GPTQ's activation-ordered groups, ``desc_act`` with a permuted ``g_idx``).

    The weight's use computes ``x.take(perm, axis=k) . kernel`` with ``x``'s axis ``k`` paired with the
    weight's input axis ``axis``, so it stands for the float weight ``W`` with ``W[perm[j]] = kernel[j]``
    along ``axis`` (``W = kernel.take(argsort(perm), axis)``): the inner kernel's contiguous groups are
    the scattered groups of ``W``'s inputs.

    Attributes:
      kernel: a QArray (or a float array) of ``W``'s shape, its rows in ``perm``'s order.
      perm: int32 ``[shape[axis]]``, a permutation of ``0 .. shape[axis] - 1``.
      axis: the weight's (only) contracted input axis.

    Invariants (checked by :func:`validate_permuted`): ``perm`` is int32 of length ``shape[axis]`` and
    holds every index once.
    """

    kernel: Any
    perm: jax.Array
    axis: int = 0

    @property
    def nbytes(self) -> int:
        return super().nbytes + _nbytes(self.perm)

    def gather_input(self, x: jax.Array, axis: int = -1) -> jax.Array:
        """``x`` with its ``axis`` (the one paired with the weight's input axis) taken in ``perm``'s order."""
        return jnp.take(x, jnp.asarray(self.perm), axis=axis)

    def unpermute(self, w: jax.Array) -> jax.Array:
        """The float weight ``W`` from the inner kernel's float values ``w`` (rows in ``perm``'s order)."""
        return jnp.take(w, jnp.argsort(jnp.asarray(self.perm)), axis=self.axis)


jax.tree_util.register_dataclass(PermutedKernel, data_fields=["kernel", "perm"], meta_fields=["axis"])


def validate_permuted(p: PermutedKernel, *, name: str = "PermutedKernel") -> PermutedKernel:
    """``p`` if its invariants hold (see :class:`PermutedKernel`), else :class:`QArrayError` naming ``name``."""
    n = p.shape[p.axis]
    if jnp.dtype(p.perm.dtype) != jnp.int32 or tuple(p.perm.shape) != (n,):
        raise QArrayError(f"{name}: perm must be int32 [{n}], got {jnp.dtype(p.perm.dtype).name} {tuple(p.perm.shape)}")
    if not isinstance(p.perm, jax.core.Tracer) and not np.array_equal(np.sort(np.asarray(p.perm)), np.arange(n)):
        raise QArrayError(f"{name}: perm is not a permutation of 0 .. {n - 1}")
    return p


HALF_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class HalfFloat:
    """A float param stored in 16 bits, standing for ``values.astype(dtype)``.

    Storage only: every reader (eqjax's models, the traced interpreter, the exporters) computes with
    the widened array, so a model runs exactly as it would on float params that were rounded to 16
    bits. Made by :class:`eqjax.methods.halffloat.HalfFloats`.

    Attributes:
      values: float16 or bfloat16 array (finite), the param's logical shape.
      dtype: the wider float dtype it stands for (float32 or float64).

    Invariants (checked by :func:`validate_half`): ``values.dtype`` is in :data:`HALF_DTYPES`,
    ``dtype`` is a float dtype wider than it, every value is finite.
    """

    values: jax.Array
    dtype: Any = jnp.float32

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.values.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return _nbytes(self.values)

    def widen(self) -> jax.Array:
        """The float array it stands for, ``values.astype(dtype)`` (exact)."""
        return jnp.asarray(self.values).astype(self.dtype)

    def __repr__(self) -> str:
        return f"HalfFloat({jnp.dtype(self.values.dtype).name} -> {jnp.dtype(self.dtype).name}, shape={self.shape})"


jax.tree_util.register_dataclass(HalfFloat, data_fields=["values"], meta_fields=["dtype"])


def validate_half(h: HalfFloat, *, name: str = "HalfFloat") -> HalfFloat:
    """``h`` if its invariants hold (see :class:`HalfFloat`), else :class:`QArrayError` naming ``name``."""
    vd, wd = jnp.dtype(h.values.dtype), jnp.dtype(h.dtype)
    if vd not in HALF_DTYPES:
        raise QArrayError(f"{name}: values must be float16 or bfloat16, got {vd}")
    if not jnp.issubdtype(wd, jnp.floating) or wd.itemsize <= vd.itemsize:
        raise QArrayError(f"{name}: dtype must be a float wider than {vd}, got {wd}")
    if not isinstance(h.values, jax.core.Tracer) and not bool(np.isfinite(np.asarray(h.values, np.float32)).all()):
        raise QArrayError(f"{name}: values must be finite")
    return h


def is_quantized(x: Any) -> bool:
    """True for a QArray, an ActQuantKernel, a RotatedKernel, a PermutedKernel or a HalfFloat (the leaves a weight use
    must treat specially: :func:`eqjax.core.qdot.weight_dot`; any other reader widens them with
    :func:`eqjax.core.numerics.dequantize_leaf`)."""
    return isinstance(x, (QArray, ActQuantKernel, RotatedKernel, PermutedKernel, HalfFloat))
