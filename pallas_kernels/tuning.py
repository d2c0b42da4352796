"""Block sizes per shape for the Pallas Triton kernels.

The table is keyed by the bucket of M (tokens): decode (M <= 16), small batch (<= 64), mid (<= 256)
and prefill. The values are the usual Triton matmul starting points for Hopper/Ampere (power-of-two
tiles, 4-8 warps, 3-4 pipeline stages) and have NOT been tuned on a GPU yet: `bench/kernels.py`
is the script to do that; update the table from its output.

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

    def __post_init__(self) -> None:
        for name in ("bm", "bn", "bk"):
            v = getattr(self, name)
            if not is_pow2(v) or v < 16:
                raise ValueError(f"block size {name}={v} must be a power of two >= 16 (Triton dot)")
        if self.split_k < 1:
            raise ValueError("split_k must be >= 1")


# (max M, bm, bn, bk, num_warps, num_stages)
_W8A8_TABLE = (
    (16, 16, 128, 256, 4, 4),
    (64, 64, 128, 128, 4, 4),
    (256, 128, 128, 128, 8, 3),
    (1 << 62, 128, 256, 128, 8, 3),
)
# bk in packed rows (two logical K each); capped by the group size in w4a16_blocks.
_W4A16_TABLE = (
    (16, 16, 128, 64, 4, 4),
    (64, 64, 128, 64, 4, 4),
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
    bk = min(bk, _pow2_floor(half & -half))  # largest power of two dividing G/2, capped
    if bk < 16:
        return None
    bm, bn = _fit(bm, m), _fit(bn, n)
    programs = cdiv(m, bm) * cdiv(n, bn)
    return Blocks(bm, bn, bk, _split_k(programs, (k // 2) // bk), warps, stages)
