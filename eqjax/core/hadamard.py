"""Hadamard matrices and the fast (randomized) Walsh-Hadamard transform, for rotations (QuaRot).

A Hadamard matrix ``H`` of order ``n`` has entries ``+-1`` and ``H H^T = n I``; ``H / sqrt(n)`` is
orthogonal. Orders built here: ``n = 2**a * b`` with ``H_n = kron(H_b, S_{2**a})`` (``S`` Sylvester's
``[[1, 1], [1, -1]]`` powers) and ``H_b`` one of

* ``b = 1`` (plain Sylvester), ``b = 2``,
* Paley I: ``b = q + 1`` for a prime ``q = 3 (mod 4)`` (12, 20, 24, 44, 48, 60, 68, 72, 80, 84, ...),
* Paley II: ``b = 2 (q + 1)`` for a prime ``q = 1 (mod 4)`` (12, 28, 36, 60, 76, 108, ...),

choosing the largest power of two (smallest ``b``). SmolLM2's widths: 576 = 36 x 16 (Paley II with
q = 17), 1536 = 12 x 128, head dim 64 = Sylvester. Widths with no such factorization (e.g. 6, 18, 92)
raise :class:`HadamardError` naming the width.

:func:`hadamard_transform` computes ``x @ H_n / sqrt(n)`` along one axis without forming ``H_n``: a
dense ``b x b`` product for ``H_b`` and ``a`` butterfly stages (the fast Walsh-Hadamard transform)
for the power of two, ``O(n (b + log2 n))`` per vector instead of ``O(n^2)``. With ``signs`` (a
``[n]`` vector of ``+-1``) it is the randomized transform ``(x * signs) @ H_n / sqrt(n)``, i.e.
``x @ Q`` with the orthogonal ``Q = diag(signs) H_n / sqrt(n)`` (:func:`rotation_matrix`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from eqjax.core.errors import InputError

__all__ = ["HadamardError", "hadamard_factors", "hadamard_matrix", "hadamard_transform", "random_signs",
           "rotation_matrix"]


class HadamardError(InputError):
    """No Hadamard matrix of the requested order is constructed here."""


def _is_prime(q: int) -> bool:
    if q < 2:
        return False
    return all(q % d for d in range(2, int(q**0.5) + 1))


def _jacobsthal(q: int) -> np.ndarray:
    """``Q[i, j] = chi(j - i)`` over GF(q) (q prime), ``chi`` the quadratic character (chi(0) = 0)."""
    squares = {(i * i) % q for i in range(1, q)}
    chi = np.array([0] + [1 if i in squares else -1 for i in range(1, q)], np.int64)
    idx = (np.arange(q)[None, :] - np.arange(q)[:, None]) % q
    return chi[idx]


def _base(b: int) -> np.ndarray | None:
    """A Hadamard matrix of order ``b`` from the constructions in the module docs, or None."""
    if b == 1:
        return np.ones((1, 1), np.int64)
    if b == 2:
        return np.array([[1, 1], [1, -1]], np.int64)
    q = b - 1
    if q % 4 == 3 and _is_prime(q):  # Paley I
        s = np.zeros((b, b), np.int64)
        s[0, 1:] = 1
        s[1:, 0] = -1
        s[1:, 1:] = _jacobsthal(q)
        return s + np.eye(b, dtype=np.int64)
    if b % 2 == 0:
        q = b // 2 - 1
        if q % 4 == 1 and _is_prime(q):  # Paley II
            c = np.zeros((q + 1, q + 1), np.int64)
            c[0, 1:] = 1
            c[1:, 0] = 1
            c[1:, 1:] = _jacobsthal(q)
            blk_zero = np.array([[1, -1], [-1, -1]], np.int64)
            blk_pm = np.array([[1, 1], [1, -1]], np.int64)
            out = np.zeros((b, b), np.int64)
            for i in range(q + 1):
                for j in range(q + 1):
                    v = c[i, j]
                    out[2 * i:2 * i + 2, 2 * j:2 * j + 2] = blk_zero if v == 0 else v * blk_pm
            return out
    return None


@functools.lru_cache(maxsize=64)
def hadamard_factors(n: int) -> tuple[int, int]:
    """``(b, 2**a)`` with ``n = b * 2**a`` and a Hadamard matrix of order ``b`` available."""
    if not isinstance(n, (int, np.integer)) or n < 1:
        raise HadamardError(f"Hadamard order must be a positive int, got {n!r}")
    p = 1
    while n % (2 * p) == 0:
        p *= 2
    while p >= 1:
        if _base(n // p) is not None:
            return n // p, p
        p //= 2
    raise HadamardError(f"no Hadamard matrix of order {n} (width {n}): eqjax builds orders 2**a * b with b = 1, 2, "
                        "a Paley I (prime q = 3 mod 4, b = q + 1) or Paley II (prime q = 1 mod 4, b = 2(q + 1)) order")


@functools.lru_cache(maxsize=64)
def _matrix(n: int) -> np.ndarray:
    b, p = hadamard_factors(n)
    syl = np.ones((1, 1), np.int64)
    while syl.shape[0] < p:
        syl = np.block([[syl, syl], [syl, -syl]])
    h = np.kron(_base(b), syl)
    h.setflags(write=False)
    return h


def hadamard_factor_matrices(n: int) -> tuple[np.ndarray, np.ndarray]:
    """``(H_b, S_p)``, int64 ``[b, b]`` and ``[p, p]`` with ``H_n = kron(H_b, S_p)`` (``S_p`` the
    symmetric Sylvester matrix): what :func:`hadamard_transform` multiplies by, for lowering it elsewhere."""
    b, p = hadamard_factors(n)
    return _base(b).copy(), _matrix(p).copy()


def hadamard_matrix(n: int) -> np.ndarray:
    """The ``+-1`` Hadamard matrix ``H_n = kron(H_b, S_{2**a})`` (int64 ``[n, n]``, ``H H^T = n I``)."""
    return _matrix(n).copy()


def random_signs(n: int, seed: int) -> np.ndarray:
    """``[n]`` float32 of ``+-1`` from ``seed`` (numpy PCG64; the same on every machine)."""
    return np.where(np.random.default_rng(seed).random(n) < 0.5, -1.0, 1.0).astype(np.float32)


def rotation_matrix(n: int, signs: np.ndarray | None = None) -> np.ndarray:
    """The orthogonal ``Q = diag(signs) H_n / sqrt(n)`` (float64 ``[n, n]``); ``x @ Q`` is
    :func:`hadamard_transform` ``(x, signs)``."""
    h = _matrix(n).astype(np.float64) / np.sqrt(n)
    return h if signs is None else np.asarray(signs, np.float64)[:, None] * h


def _fwht(x: jax.Array, p: int) -> jax.Array:
    """Unnormalized Walsh-Hadamard transform (Sylvester order) of the last axis, of length ``p``."""
    lead = x.shape[:-1]
    h = 1
    while h < p:
        y = x.reshape(lead + (p // (2 * h), 2, h))
        a, b = y[..., 0, :], y[..., 1, :]
        x = jnp.stack([a + b, a - b], axis=-2).reshape(lead + (p,))
        h *= 2
    return x


def hadamard_transform(x: jax.Array, signs: np.ndarray | jax.Array | None = None, *, axis: int = -1,
                       inverse: bool = False) -> jax.Array:
    """``x @ Q`` along ``axis`` with ``Q = diag(signs) H_n / sqrt(n)`` (``n = x.shape[axis]``); with
    ``inverse`` ``x @ Q^T``. Same shape and dtype as ``x``.

    Computed in float32 (or ``x``'s wider dtype) with the fast transform (see the module docs).
    """
    axis = axis % x.ndim
    n = x.shape[axis]
    b, p = hadamard_factors(n)
    dt = jnp.promote_types(x.dtype, jnp.float32)
    y = jnp.moveaxis(x, axis, -1).astype(dt)
    if signs is not None and not inverse:
        y = y * jnp.asarray(signs, dt)
    lead = y.shape[:-1]
    y = _fwht(y.reshape(lead + (b, p)), p)  # Sylvester matrices are symmetric
    if b > 1:
        hb = _base(b)
        hb = jnp.asarray(hb.T if inverse else hb, dt)
        y = jnp.einsum("...ip,ij->...jp", y, hb, precision=jax.lax.Precision.HIGHEST)
    y = y.reshape(lead + (n,)) * jnp.asarray(1.0 / np.sqrt(n), dt)
    if signs is not None and inverse:
        y = y * jnp.asarray(signs, dt)
    return jnp.moveaxis(y, -1, axis).astype(x.dtype)
