#!/usr/bin/env bash
# The GPU session in one command (run from the repo root on a CUDA machine; writes under $OUT,
# default bench/results/gpu): environment, the compiled-kernel tests, the W4A16 benchmark before /
# after a kernel change (before = the pallas_kernels package in $BASELINE, e.g. `git archive` of the
# previous commit, if set), the W4A16 block sweeps at decode and at M = 64 / 256, and the whole-model
# xla/pallas/auto run. Each step has its own time limit and a failing step does not stop the next;
# after every step the results so far are packed into $PACK (if set: one .tgz, for machines that
# return few files). The exit status is the number of failed steps.
set -u
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: the baseline step runs elsewhere
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export REPO=$PWD
fails=0
pack() { [ -n "${PACK:-}" ] && tar -C "$(dirname "$OUT")" -czf "$PACK.tmp" "$(basename "$OUT")" && mv "$PACK.tmp" "$PACK"; true; }
step() { local limit=$1; shift; echo "== $* (limit ${limit}s)"; local t0=$SECONDS
         timeout "$limit" "$@" || { echo "!! step failed (rc $?): $*"; fails=$((fails + 1)); }
         echo "== $((SECONDS - t0)) s"; pack; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import sys, jax, jaxlib, flax, optax; print(sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'optax', optax.__version__); print(jax.devices())"
} >"$OUT/env.txt" 2>&1; cat "$OUT/env.txt"
step 120 bash -c "python3 -m pytest -q -p no:cacheprovider -rs --durations=5 tests/pallas_kernels/test_pk_gpu.py >'$OUT/pytest.txt' 2>&1; rc=\$?; tail -25 '$OUT/pytest.txt'; exit \$rc"
W4=(--methods xla_bf16 xla_w4a16 pallas_w4a16 --samples 5 --ms 1 16 64 256 --ks 4096 8192)
if [ -n "${BASELINE:-}" ]; then
  # run from $BASELINE (absolute path), so that its pallas_kernels, not the working tree's, is imported
  step 75 bash -c 'cd "$1" && shift && PYTHONPATH="$PWD:$REPO" python3 -c "import pallas_kernels as p; print(\"before:\", p.__file__)" && PYTHONPATH="$PWD:$REPO" python3 "$REPO/bench/kernels.py" "$@"' _ "$BASELINE" "${W4[@]}" --out "$OUT/kernels_w4a16_before"
fi
step 75 python3 bench/kernels.py "${W4[@]}" --out "$OUT/kernels_w4a16_after"
step 80 python3 bench/kernel_tune.py --deadline-s 60 --kernels w4a16 --ms 1 --k 8192 --out "$OUT/tune_w4a16_m1_k8192"
step 90 python3 bench/gpu_model.py --deadline-s 70 --configs llama-1b-shaped --prompt-len 512 --steps 16 --samples 3 --out "$OUT/gpu_model"
step 80 python3 bench/kernel_tune.py --deadline-s 60 --kernels w4a16 --ms 64 256 --k 4096 --out "$OUT/tune_w4a16_m64_256"
echo "failed steps: $fails"
exit "$fails"
