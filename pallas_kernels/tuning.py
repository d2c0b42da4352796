"""Block sizes per shape for the Pallas Triton kernels.

The table is keyed by the bucket of M (tokens): decode (M <= 16), small batch (<= 64), mid (<= 256)
and prefill, plus W4A16's GEMV blocks at M = 1. Measured rows come from `bench/kernel_tune.py` on an
H200 (jax 0.11.2; bench/results/kernel_tune_h200*.md): W8A8 at M = 16, 64, 256 and 2048 (K = N =
4096), W4A16 at M = 1 (K = N = 8192), 16, 64 and 2048. W4A16's M = 256 row is the usual Triton
starting point for Hopper (power-of-two tiles, 8 warps, 3 stages): its sweep stopped at its deadline
after two candidates, the table's being the faster.

Split-K: at decode there are only ``N / BN`` programs per layer (32 for N = 4096, BN = 128), far
fewer than the SMs (132 on an H100), so the K loop is split across ``split_k`` programs whose
partial sums are added by a small XLA reduction. ``split_k`` is chosen to give about
``TARGET_PROGRAMS`` programs while keeping at least ``MIN_K_BLOCKS_PER_SPLIT`` K blocks each.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels._common import cdiv, is_pow2

NUM_SMS = 132  # H100 SXM; H200 has the same count.
TARGET_PROGRAMS = 2 * NUM_SMS
MIN_K_BLOCKS_PER_SPLIT = 4
MAX_SPLIT_K = 16

# W8A8: below this M the activation quantization runs inside the GEMM kernel (first pass over K
# for the row absmax); at or above it a separate quantization kernel runs first. See w8a8_matmul.
W8A8_FUSED_MAX_M = 64


@dataclasses.dataclass(frozen=True)
class Blocks:
    bm: int
    bn: int
    bk: int  # W8A8: K elements per step. W4A16: packed rows per step (2 * bk logical K).
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    gemv: bool = False  # W4A16 only: one activation row per program, no MMA (bm must be 1)
    # GEMV only: keep a [bk, bn] float32 partial over the K loop and reduce it over K once per program,
    # instead of a cross-warp reduction every step. Not measured on a GPU yet (README).
    reduce_once: bool = False

    def __post_init__(self) -> None:
        for name in ("bm", "bn", "bk"):
            v = getattr(self, name)
            if self.gemv and name == "bm":
                if v != 1:
                    raise ValueError(f"block size bm={v}: a GEMV block takes one row (bm=1)")
            elif not is_pow2(v) or v < 16:
                raise ValueError(f"block size {name}={v} must be a power of two >= 16 (Triton dot)")
        if self.split_k < 1:
            raise ValueError("split_k must be >= 1")
        if self.reduce_once and not self.gemv:
            raise ValueError("reduce_once applies to GEMV blocks only (gemv=True)")


# (max M, bm, bn, bk, num_warps, num_stages). The first three rows are the fastest of
# bench/kernel_tune.py's grid on an H200 (K = N = 4096; bench/results/kernel_tune_h200*.md):
# 1.30x, 1.12x and 1.34x over the previous rows (16,128,256,4,4 / 64,128,128,4,4 / 128,128,128,8,3).
# The prefill row is the fastest at M = 2048 (second H200 session): 2.26x over the previous
# (128,256,128,8,3), still slower than XLA's int8 path there.
_W8A8_TABLE = (
    (16, 16, 128, 256, 4, 3),
    (64, 64, 64, 256, 4, 4),
    (256, 128, 64, 256, 8, 3),
    (1 << 62, 128, 64, 128, 8, 3),
)
# bk in packed rows (two logical K each); capped by the group size in w4a16_blocks. M = 1 takes the
# GEMV blocks: (max M, bn, bk, warps, stages), the fastest of bench/kernel_tune.py's grid at M = 1,
# K = N = 8192 on an H200: one stage, 30.0 us against 30.7 with three stages and 49.8 for the MMA row
# below. The M = 16 row was within 4 % of the sweep's best; the M = 64 row the best at K = N = 4096
# (25.4 us against 29.7 with four stages); the prefill row the best at M = 2048.
_W4A16_GEMV = (1, 512, 64, 8, 1)
_W4A16_TABLE = (
    (16, 16, 128, 64, 4, 4),
    (64, 64, 128, 64, 4, 3),
    (256, 128, 128, 64, 8, 3),
    (1 << 62, 128, 128, 64, 8, 3),
)


def _pick(table, m: int):
    for row in table:
        if m <= row[0]:
            return row[1:]
    raise AssertionError


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _fit(block: int, dim: int, lo: int = 16) -> int:
    """Shrink a block towards the dimension (next power of two >= dim), never below ``lo``."""
    need = max(lo, 1 << max(dim - 1, 0).bit_length())
    return max(lo, min(block, need))


def _split_k(programs: int, k_blocks: int) -> int:
    if programs >= TARGET_PROGRAMS // 2:
        return 1
    s = min(cdiv(TARGET_PROGRAMS, programs), k_blocks // MIN_K_BLOCKS_PER_SPLIT, MAX_SPLIT_K)
    return max(1, s)


def w8a8_blocks(m: int, n: int, k: int) -> Blocks:
    bm, bn, bk, warps, stages = _pick(_W8A8_TABLE, m)
    bm, bn, bk = _fit(bm, m), _fit(bn, n), _fit(bk, k, lo=32)
    programs = cdiv(m, bm) * cdiv(n, bn)
    return Blocks(bm, bn, bk, _split_k(programs, cdiv(k, bk)), warps, stages)


def w4a16_blocks(m: int, n: int, k: int, group_size: int) -> Blocks | None:
    """None when the group size admits no power-of-two packed block >= 16 inside one group."""
    bm, bn, bk, warps, stages = _pick(_W4A16_TABLE, m)
    half = group_size // 2
    if group_size % 2 or half % 16:
        return None
    gemv = m <= _W4A16_GEMV[0]
    if gemv:
        bm, bn, bk, warps, stages = 1, *_W4A16_GEMV[1:]
    bk = min(bk, _pow2_floor(half & -half))  # largest power of two dividing G/2, capped
    if bk < 16:
        return None
    bm, bn = (1 if gemv else _fit(bm, m)), _fit(bn, n)
    programs = cdiv(m, bm) * cdiv(n, bn)
    return Blocks(bm, bn, bk, _split_k(programs, (k // 2) // bk), warps, stages, gemv=gemv)


# Where a kernel beat eqjax's XLA path on an H200 (jax 0.11.2; bench/results/kernels_h200.md,
# kernels_w8a8_h200.md, gpu_model_h200.md). W4A16: 3.0-3.9x at M <= 16 and 1.4x at M = 128 for
# K = N = 4096 and 8192; 2-3x SLOWER at M >= 1024; slower end to end (0.78x decode) on SmolLM2's
# 576 x 1536 matrices. W8A8: tied at M = 1, K = N = 4096, slower everywhere else measured. Shapes in
# between were not measured and go to XLA.
W4A16_AUTO_MAX_M = 128
W4A16_AUTO_MIN_WEIGHTS = 4096 * 4096


def prefer_kernel(kind: str, m: int, k: int, n: int) -> bool:
    """Whether ``backend="auto"`` runs the Pallas kernel for an ``[m, k] @ [k, n]`` matmul of
    ``kind`` (``"w8a8"`` or ``"w4a16"``) on CUDA: only inside the measured winning region."""
    if kind == "w4a16":
        return m <= W4A16_AUTO_MAX_M and k * n >= W4A16_AUTO_MIN_WEIGHTS
    if kind == "w8a8":
        return False
    raise ValueError(f"unknown kernel kind {kind!r}")
