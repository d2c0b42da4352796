"""``pallas_kernels`` stands alone: importing and running it (entries, references, interpreted
kernels) loads nothing from eqjax. Checked in a fresh interpreter, since this test session has
eqjax loaded already."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
import jax.numpy as jnp
import pallas_kernels as pk
x = jnp.ones((3, 64), jnp.float32)
pk.w8a8_matmul(x, jnp.ones((64, 16), jnp.int8), jnp.ones((16,), jnp.float32))
pk.w8a8_matmul(x, jnp.ones((64, 16), jnp.int8), jnp.ones((16,), jnp.float32), interpret=True)
pk.w4a16_matmul(x, jnp.ones((32, 16), jnp.uint8), jnp.ones((2, 16)), None, group_size=32)
pk.w4a16_matmul(x, jnp.ones((32, 16), jnp.uint8), jnp.ones((2, 16)), None, group_size=32, interpret=True)
loaded = sorted(m for m in sys.modules if m == "eqjax" or m.startswith("eqjax."))
print("EQJAX:" + ",".join(loaded))
"""


def test_pallas_kernels_imports_nothing_from_eqjax():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "EQJAX:\n" in out.stdout, out.stdout  # printed, and empty


def test_no_eqjax_import_statement_in_the_package():
    """A static check too, so a lazy import inside a function not exercised above is caught."""
    for path in sorted((ROOT / "pallas_kernels").glob("*.py")):
        for line in path.read_text().splitlines():
            code = line.split("#")[0].strip()
            assert not (code.startswith(("import eqjax", "from eqjax"))), f"{path.name}: {line}"
