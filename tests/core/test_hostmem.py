"""eqjax.core.hostmem: the fixed mmap threshold, and trimming the heap, return freed buffers to the system (glibc
only)."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from eqjax.core.hostmem import fix_mmap_threshold

ROOT = Path(__file__).resolve().parents[2]
GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# 100 buffers of 2 MiB, every other one freed, after a freed 8 MiB buffer raised glibc's dynamic
# threshold: from the heap they leave holes that stay resident; mmapped, the freed half goes back
_FRAGMENT = textwrap.dedent("""
    import sys
    import numpy as np
    from eqjax.core.hostmem import fix_mmap_threshold, release_free_memory
    if sys.argv[1] == "fixed":
        assert fix_mmap_threshold(1 << 20)
    def rss_mb():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    big = np.ones(8 << 20, np.uint8)
    del big
    base = rss_mb()
    keep = [np.ones(2 << 20, np.uint8) for _ in range(100)]
    del keep[::2]
    if sys.argv[1] == "trim":
        assert release_free_memory()
    print(rss_mb() - base)
""")


def _resident_after_freeing_half(mode: str) -> float:
    r = subprocess.run([sys.executable, "-c", _FRAGMENT, mode], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return float(r.stdout.strip())


@pytest.mark.parametrize("bad", [0, -1, (32 << 20) + 1, True, 1.5, "4M"])
def test_rejects_thresholds_glibc_cannot_take(bad):
    with pytest.raises(ValueError, match="mmap threshold"):
        fix_mmap_threshold(bad)


@pytest.mark.skipif(not GLIBC, reason="glibc's allocator only")
def test_fixed_threshold_returns_freed_buffers_that_the_dynamic_one_keeps():
    kept_default = _resident_after_freeing_half("default")
    kept_fixed = _resident_after_freeing_half("fixed")
    # 200 MiB allocated, 100 MiB freed: the heap keeps all 200 resident, mmapped buffers only the live 100
    assert kept_default > 170, kept_default
    assert kept_fixed < 130, kept_fixed


@pytest.mark.skipif(not GLIBC, reason="glibc's allocator only")
def test_release_free_memory_returns_the_heaps_holes():
    """The same holes as above (default threshold, so from the heap) go back once the heap is trimmed."""
    assert _resident_after_freeing_half("trim") < 130
