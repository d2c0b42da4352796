"""Shared fixtures for the Pallas kernel tests (CPU, interpret mode, small shapes)."""

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the package is importable from the repo root without an install
    sys.path.insert(0, str(ROOT))


@pytest.fixture
def rng():
    return np.random.default_rng(0)
