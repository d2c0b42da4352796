#!/usr/bin/env bash
# The GPU session in one command (run from the repo root on a CUDA machine; writes under $OUT,
# default bench/results/gpu): environment, the compiled-kernel tests, the kernel benchmark, the
# whole-model pallas-vs-xla run and the block-size sweep. Each step has its own time limit and a
# failing step does not stop the next; the exit status is the number of failed steps.
set -u
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fails=0
step() { local limit=$1; shift; echo "== $* (limit ${limit}s)"; local t0=$SECONDS
         timeout "$limit" "$@" || { echo "!! step failed (rc $?): $*"; fails=$((fails + 1)); }
         echo "== $((SECONDS - t0)) s"; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import sys, jax, jaxlib, flax, optax; print(sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'optax', optax.__version__); print(jax.devices())"
} >"$OUT/env.txt" 2>&1; cat "$OUT/env.txt"
# first the compiled-kernel tests (they check the W8A8 tie fix), then what is still unmeasured
step 120 bash -c "python3 -m pytest -q -p no:cacheprovider -rs tests/pallas_kernels/test_pk_gpu.py tests/models/test_generate.py >'$OUT/pytest.txt' 2>&1; rc=\$?; tail -15 '$OUT/pytest.txt'; exit \$rc"
step 150 python3 bench/kernel_tune.py --deadline-s 110 --kernels w4a16 w8a8 --ms 2048 256 64 16 --out "$OUT/kernel_tune"
step 150 python3 bench/gpu_model.py --deadline-s 110 --configs llama-1b-shaped smollm2-135m-shaped --out "$OUT/gpu_model"
step 150 python3 bench/kernels.py --samples 7 --out "$OUT/kernels"
echo "failed steps: $fails"
exit "$fails"
