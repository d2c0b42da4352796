"""Helpers shared by the Pallas Triton kernels: masked 2-D tile loads/stores, exact division and
rounding, platform selection and the CUDA export used by the tests.

Nothing here (or anywhere in :mod:`pallas_kernels`) imports eqjax: the kernels take arrays.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def compiler_params(num_warps: int, num_stages: int) -> plgpu.CompilerParams:
    """Triton compiler params. Passing them is also what selects the Triton backend: in jax 0.10
    a GPU ``pallas_call`` without them goes to Mosaic GPU."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def load_tile(ref, r0, nr: int, c0, nc: int, rows: int, cols: int, other=0):
    """``ref[r0:r0+nr, c0:c0+nc]`` with out-of-bounds elements (>= rows / cols) read as ``other``.

    ``nr``/``nc`` are the (power-of-two) block sizes, ``rows``/``cols`` the static array bounds.
    Masks are only emitted along the axes that can actually run out of bounds.
    """
    mask = None
    if rows % nr:
        mask = (r0 + jnp.arange(nr) < rows)[:, None]
    if cols % nc:
        cm = (c0 + jnp.arange(nc) < cols)[None, :]
        mask = cm if mask is None else mask & cm
    view = ref.at[pl.ds(r0, nr), pl.ds(c0, nc)]
    if mask is None:
        return plgpu.load(view)
    mask = jnp.broadcast_to(mask, (nr, nc))
    return plgpu.load(view, mask=mask, other=other)


def load_vec(ref, c0, nc: int, cols: int, other=0):
    """``ref[c0:c0+nc]`` of a 1-D ref, out-of-bounds read as ``other``."""
    view = ref.at[pl.ds(c0, nc)]
    if cols % nc == 0:
        return plgpu.load(view)
    return plgpu.load(view, mask=c0 + jnp.arange(nc) < cols, other=other)


def load_row(ref, r, c0, nc: int, cols: int, other=0):
    """Row ``r`` of a 2-D ref, columns ``c0:c0+nc`` (shape ``[nc]``)."""
    view = ref.at[r, pl.ds(c0, nc)]
    if cols % nc == 0:
        return plgpu.load(view)
    return plgpu.load(view, mask=c0 + jnp.arange(nc) < cols, other=other)


def store_tile(ref, r0, nr: int, c0, nc: int, rows: int, cols: int, val, *, base=0):
    """Store a tile at rows ``base + r0 ...``; rows with ``r0 + i >= rows`` or cols ``>= cols`` are
    skipped (``base`` offsets into a stacked ``[S * rows, cols]`` array of split-K partials)."""
    mask = None
    if rows % nr:
        mask = (r0 + jnp.arange(nr) < rows)[:, None]
    if cols % nc:
        cm = (c0 + jnp.arange(nc) < cols)[None, :]
        mask = cm if mask is None else mask & cm
    view = ref.at[pl.ds(base + r0, nr), pl.ds(c0, nc)]
    if mask is None:
        plgpu.store(view, val)
    else:
        plgpu.store(view, val, mask=jnp.broadcast_to(mask, (nr, nc)))


def store_vec(ref, c0, nc: int, cols: int, val):
    view = ref.at[pl.ds(c0, nc)]
    if cols % nc == 0:
        plgpu.store(view, val)
    else:
        plgpu.store(view, val, mask=c0 + jnp.arange(nc) < cols)


def round_half_even(x: jax.Array) -> jax.Array:
    """Round half to even with floor/compare/select only (Triton has no lowering for ``jnp.round``).

    Equal to ``jnp.round`` (XLA's round-nearest-even) for every finite float32 (``|x| >= 2**23`` is
    already an integer: ``d == 0``) and for +-inf; tested against it in tests/pallas_kernels.
    """
    f = jnp.floor(x)
    d = x - f
    odd = (f - 2.0 * jnp.floor(f * 0.5)) != 0
    up = (d > 0.5) | ((d == 0.5) & odd)
    return jnp.where(up, f + 1.0, f)


# Float dtype -> (the bit pattern of 2**m as that dtype, m, the same-width integer type). Below 2**m
# the dtype's integers are exact with spacing 1, so OR-ing an integer q < 2**m into the mantissa gives
# the float 2**m + q exactly.
_MAGIC = {
    jnp.dtype(jnp.float32): (0x4B000000, 23, jnp.int32),
    jnp.dtype(jnp.bfloat16): (0x4300, 7, jnp.int16),
    jnp.dtype(jnp.float16): (0x6400, 10, jnp.int16),
}


def _biased(q: jax.Array, dtype) -> jax.Array:
    bits, _, itype = _MAGIC[jnp.dtype(dtype)]
    return jax.lax.bitcast_convert_type((q | bits).astype(itype), dtype)


def small_int_diff(q: jax.Array, zp, dtype) -> jax.Array:
    """``q - zp`` as float ``dtype`` (float32, bfloat16 or float16), exactly, without an integer to
    float conversion.

    ``q``: int32 array with values in [0, 16) (a 4-bit code); ``zp``: int32 array broadcastable to it
    with values in [0, 16), or a Python int. Equal to ``(q - zp).astype(dtype)``. The integer -> float
    conversion (``cvt``) runs at an eighth of the float32 add rate on Hopper (16 against 128 per SM and
    clock, CUDA programming guide), and a W4A16 kernel converts two codes per weight byte; here each code is OR-ed into the mantissa of
    ``2**m`` (bitcast: ``2**m + q``) and ``2**m + zp`` is subtracted, both exact integers of the dtype.
    """
    dtype = jnp.dtype(dtype)
    _, m, _ = _MAGIC[dtype]
    off = jnp.asarray(float(2**m + zp), dtype) if isinstance(zp, int) else _biased(zp, dtype)
    return _biased(q, dtype) - off


def _split_hi_lo(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``a = hi + lo`` exactly (float32), ``hi`` the top 12 significant bits (bit mask, so no
    compiler contraction can change it) and ``lo`` the rest: products of halves are exact."""
    bits = jax.lax.bitcast_convert_type(a, jnp.uint32)
    hi = jax.lax.bitcast_convert_type(bits & jnp.uint32(0xFFFFF000), jnp.float32)
    return hi, a - hi


def correct_reciprocal(s: jax.Array, r: jax.Array) -> jax.Array:
    """The IEEE round-to-nearest ``fl(1 / s)`` from an approximation ``r`` within 2 ulp of it
    (float32, ``s > 0``): the candidate among ``r`` and its 4 nearest neighbours with the smallest
    ``|1 - s * c|`` (reciprocals have no ties). Where ``s`` or ``r`` is not a positive normal
    number (zero, subnormal, inf) ``r`` is returned unchanged.

    ``1 - s * c`` is computed to ~2**-35 absolute, enough to rank candidates one ulp apart: ``s`` is
    scaled into [0.5, 1) and ``c`` by the inverse power of two (exact; keeps the low halves out of
    the subnormals), the four half products are exact and ``1 - hi*hi`` is exact by Sterbenz."""
    sm, e = jnp.frexp(s)
    sh, sl = _split_hi_lo(sm)

    def residual(c):
        ch, cl = _split_hi_lo(jnp.ldexp(c, e))
        return jnp.abs(((jnp.float32(1.0) - sh * ch) - (sh * cl + sl * ch)) - sl * cl)

    up = jnp.nextafter(r, jnp.float32(jnp.inf))
    down = jnp.nextafter(r, jnp.float32(0.0))
    best, err = r, residual(r)
    for c in (up, down, jnp.nextafter(up, jnp.float32(jnp.inf)), jnp.nextafter(down, jnp.float32(0.0))):
        ec = residual(c)
        take = ec < err
        best, err = jnp.where(take, c, best), jnp.where(take, ec, err)
    tiny = jnp.float32(jnp.finfo(jnp.float32).tiny)
    ok = (s >= tiny) & (r >= tiny) & jnp.isfinite(s) & jnp.isfinite(r)
    return jnp.where(ok, best, r)


@jax.jit
def _repaired_reciprocal(s: jax.Array) -> jax.Array:
    return correct_reciprocal(s, jnp.float32(1.0) / s)


def exact_reciprocal(s: jax.Array) -> jax.Array:
    """``fl(1 / s)`` correctly rounded on every XLA backend (float32, ``s > 0``).

    Chosen at lowering time (``lax.platform_dependent``): on CPU, whose float32 division is IEEE
    round-to-nearest, plain ``1 / s``; on every other platform ``1 / s`` repaired by
    :func:`correct_reciprocal` (XLA:GPU's division is not always correctly rounded: an H200 gave a
    reciprocal one ulp off, which moved ``x * fl(1/s)`` across a rounding tie). The repair is ~100
    elementwise ops per call, a large compile cost in a model with many W8A8 layers (README, "On a GPU
    again"), so CPU skips it; it is traced once per shape (``jax.jit``)."""
    s = jnp.asarray(s, jnp.float32)
    return jax.lax.platform_dependent(s, cpu=lambda v: jnp.float32(1.0) / v, default=_repaired_reciprocal)


def _rn_asm(op: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """``op.rn.f32`` (``div`` or ``mul``) through inline PTX, elementwise on broadcast float32 operands."""
    (out,) = plgpu.elementwise_inline_asm(
        f"{op}.rn.f32 $0, $1, $2;",
        args=[a, b],
        constraints="=r,r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)],
    )
    return out


def _f32_pair(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    a = jnp.asarray(a).astype(jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    return jnp.broadcast_to(a, shape), jnp.broadcast_to(b, shape)


def mul_rn(a: jax.Array, b: jax.Array, *, interpret: bool) -> jax.Array:
    """The float32 product rounded to nearest, never fused into a later add (as XLA's ``a * b``).

    Triton contracts ``a * b - c`` into one FMA by default, which skips the product's rounding: in
    :func:`round_half_even` of ``x * fl(1/s)`` that could move a product that rounds onto
    ``k + 0.5`` off the tie and flip a code. PTX ``mul.rn.f32`` is never contracted, so the codes
    follow the documented arithmetic whatever the compiler's contraction settings.
    """
    a, b = _f32_pair(a, b)
    return a * b if interpret else _rn_asm("mul", a, b)


def div_rn(a: jax.Array, b: jax.Array, *, interpret: bool) -> jax.Array:
    """IEEE round-to-nearest float32 division, as XLA computes ``a / b``.

    Triton lowers ``arith.divf`` on f32 to the approximate ``div.full.f32`` (up to 2 ulp off), which
    could flip a quantization code next to a rounding tie; on CUDA we emit ``div.rn.f32`` instead.
    In interpret mode the kernel runs through XLA, whose ``/`` is already correctly rounded.
    """
    a, b = _f32_pair(a, b)
    return a / b if interpret else _rn_asm("div", a, b)


def on_cuda_else(kernel_fn: Callable, fallback_fn: Callable, *args):
    """``kernel_fn(*args)`` when lowered for CUDA, ``fallback_fn(*args)`` on every other platform.

    The choice happens at lowering time (``lax.platform_dependent``), so ``jax.export`` with
    ``platforms=("cuda",)`` on a CPU machine lowers the Triton kernel, and a CPU/TPU run with
    ``backend="pallas"`` silently takes the XLA path.
    """
    return jax.lax.platform_dependent(*args, cuda=kernel_fn, default=fallback_fn)


EXPORT_TARGET_DEVICE_KIND = "NVIDIA H100"  # the GPU that export_for_cuda lowers for


def export_for_cuda(fn: Callable, *arg_specs) -> "jax.export.Exported":
    """Lower ``fn`` for CUDA on any machine (Triton lowering included); raises if a primitive has no
    Triton lowering. The Triton custom call is not on jax.export's stable list, hence the check
    is disabled for it. The lowering runs under an abstract mesh naming an H100 as its device:
    jax >= 0.11 asks the current device for the GPU generation and, on a machine without one, takes
    it only from there (jax 0.10 did not ask)."""
    target = jax.sharding.AbstractDevice(device_kind=EXPORT_TARGET_DEVICE_KIND, num_cores=None, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("_export",), abstract_device=target)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.export.export(
            jax.jit(fn),
            platforms=("cuda",),
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)],
        )(*arg_specs)
