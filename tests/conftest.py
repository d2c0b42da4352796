"""Shared test setup: CPU only, float32 matmuls at full precision, hypothesis profiles.

Hypothesis profiles (``HYPOTHESIS_PROFILE``, default ``ci``):

* ``ci``: reproducible. ``derandomize=True`` seeds every test from a hash of its source (and so also
  of the hypothesis version), and implies ``database=None``: no example database is read or written, so a
  fresh clone runs exactly what CI runs. A different hypothesis version can still draw other examples;
  every counterexample found that way is pinned with ``@example`` next to its test.
* ``dev``: explores. Random seeds, more examples, and the local example database (``.hypothesis/``)
  replays earlier failures first. Run ``HYPOTHESIS_PROFILE=dev python -m pytest tests/test_numerics.py``.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from hypothesis import settings  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
settings.register_profile("ci", max_examples=30, deadline=None, derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", max_examples=100, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
