#!/usr/bin/env bash
# The GPU session in one command (run from the repo root on a CUDA machine; writes under $OUT,
# default bench/results/gpu): environment, the compiled-kernel tests, the W4A16 GEMV/MMA block sweep
# at decode, the kernel benchmark, the whole-model xla/pallas/auto run and the prefill block sweep.
# Each step has its own time limit and a failing step does not stop the next; after every step the
# results so far are packed into $PACK (if set: one .tgz, for machines that return few files).
# The exit status is the number of failed steps.
set -u
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fails=0
pack() { [ -n "${PACK:-}" ] && tar -C "$(dirname "$OUT")" -czf "$PACK.tmp" "$(basename "$OUT")" && mv "$PACK.tmp" "$PACK"; true; }
step() { local limit=$1; shift; echo "== $* (limit ${limit}s)"; local t0=$SECONDS
         timeout "$limit" "$@" || { echo "!! step failed (rc $?): $*"; fails=$((fails + 1)); }
         echo "== $((SECONDS - t0)) s"; pack; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import sys, jax, jaxlib, flax, optax; print(sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'optax', optax.__version__); print(jax.devices())"
} >"$OUT/env.txt" 2>&1; cat "$OUT/env.txt"
step 130 bash -c "python3 -m pytest -q -p no:cacheprovider -rs --durations=5 tests/pallas_kernels/test_pk_gpu.py tests/models/test_generate.py >'$OUT/pytest.txt' 2>&1; rc=\$?; tail -25 '$OUT/pytest.txt'; exit \$rc"
step 90 python3 bench/kernel_tune.py --deadline-s 70 --kernels w4a16 --ms 1 --k 8192 --out "$OUT/tune_decode_k8192"
step 90 python3 bench/kernels.py --samples 5 --ms 1 16 128 1024 --ks 4096 8192 --out "$OUT/kernels"
step 110 python3 bench/gpu_model.py --deadline-s 80 --configs llama-1b-shaped --prompt-len 512 --steps 16 --samples 3 --out "$OUT/gpu_model"
step 80 python3 bench/kernel_tune.py --deadline-s 55 --kernels w8a8 w4a16 --ms 2048 --k 4096 --out "$OUT/tune_prefill_k4096"
echo "failed steps: $fails"
exit "$fails"
