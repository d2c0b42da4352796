"""Shared test setup: CPU only, one OpenBLAS thread, float32 matmuls at full precision, hypothesis profiles.

Hypothesis profiles (``HYPOTHESIS_PROFILE``, default ``ci``):

* ``ci``: reproducible. ``derandomize=True`` seeds every test from a hash of its source (and so also
  of the hypothesis version), and implies ``database=None``: no example database is read or written, so a
  fresh clone runs exactly what CI runs. A different hypothesis version can still draw other examples;
  every counterexample found that way is pinned with ``@example`` next to its test.
* ``dev``: explores. Random seeds, more examples, and the local example database (``.hypothesis/``)
  replays earlier failures first. Run ``HYPOTHESIS_PROFILE=dev python -m pytest tests/core/test_numerics.py``.
"""

import ctypes
import gc
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One OpenBLAS thread per process (numpy's and scipy's BLAS/LAPACK; read when the library loads, so before
# numpy is imported; the CLI subprocesses of the tests inherit it). ``make test`` runs two workers on two
# cores, each beside XLA's own thread pool; OpenBLAS's threads busy-wait for each other, and with no core
# free for them a float64 Cholesky of GPTQ's 576 x 576 Hessian takes ~0.5 s instead of ~5 ms.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
settings.register_profile("ci", max_examples=30, deadline=None, derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", max_examples=100, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True, scope="module")
def _release_memory_after_module():
    """After each test module: drop JAX's compiled executables and trace caches, collect garbage, and hand
    glibc's free heap pages back to the system (``malloc_trim``; nothing where the C library is not glibc).
    ``make test`` runs two pytest-xdist workers that each live through half of the suite; without this
    their resident memory only grows, module after module."""
    yield
    jax.clear_caches()
    gc.collect()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
