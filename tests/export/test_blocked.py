"""MatMulNBits conversion of a large weight in pieces of output rows equals the conversion in one piece,
bit for bit (codes, scales, zero points), for the layouts and granularities the exporter meets; and the
packing of codes into bytes equals a brute-force bit-by-bit reference."""

import itertools

import jax
import numpy as np
import pytest

import eqjax.export.qlower as qlower
from eqjax.core.numerics import QuantSpec, quantize
from eqjax.core.qarray import per_channel, per_group

CASES = [  # (shape, contracting, free, granularity)
    ((64, 48), (0,), (1,), per_group(0, 16)),  # [K, N] kernel, groups along K
    ((64, 48), (0,), (1,), per_channel(1)),  # per output channel
    ((4, 32, 40), (0, 1), (2,), per_group((0, 1), 32)),  # [H, D, N] attention output, groups along H*D
    ((32, 6, 8), (0,), (1, 2), per_group(0, 16)),  # [D, H, Dh] einsum q kernel, two free axes
]


@pytest.mark.parametrize("case,bits,sym", list(itertools.product(range(len(CASES)), (4, 8), (True, False))))
def test_conversion_in_pieces_equals_one_piece(case, bits, sym, monkeypatch):
    shape, contracting, free, gran = CASES[case]
    w = jax.random.normal(jax.random.key(case), shape)
    q = quantize(w, QuantSpec(bits=bits, symmetric=sym, granularity=gran))
    whole = qlower.blocked(q, contracting, free)
    monkeypatch.setattr(qlower, "_PIECE", 2 * int(np.prod([shape[a] for a in contracting])) + 5)  # ~2 rows a piece
    pieces = qlower.blocked(q, contracting, free)
    for name in ("codes", "scales", "zero_points"):
        a, b = getattr(whole, name), getattr(pieces, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert (whole.N, whole.K, whole.block) == (pieces.N, pieces.K, pieces.block)


@pytest.mark.parametrize("bits,piece", [(2, 1 << 22), (4, 1 << 22), (8, 1 << 22), (4, 80), (2, 1)])
def test_pack_equals_bitwise_reference(bits, piece, monkeypatch):
    """Whole, and a few rows at a time (``piece``: codes per step)."""
    monkeypatch.setattr(qlower, "_PIECE", piece)
    rng = np.random.default_rng(bits)
    c = rng.integers(0, 2**bits, (5, 3, 37)).astype(np.uint8)
    got = qlower._pack(c, bits)
    n = 8 // bits
    padded = np.concatenate([c, np.zeros((5, 3, -37 % n), np.uint8)], -1)
    want = np.zeros(got.shape, np.uint8)
    for idx in np.ndindex(padded.shape):  # code k of a row goes to byte k // n, bits (k % n) * bits upwards
        *lead, k = idx
        want[(*lead, k // n)] |= int(padded[idx]) << (k % n) * bits
    np.testing.assert_array_equal(got, want)
