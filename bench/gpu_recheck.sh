#!/usr/bin/env bash
# A short second device call (third GPU session, 2026-11-27; README "On a GPU, third session"):
#   PACK=$OUT/x.tgz BASELINE=$PWD/<older pallas_kernels parent dir> bash bench/gpu_recheck.sh /tmp/x
# the W4A16 compiled-kernel tests, W4A16 at M = 1 and 16 (K = N = 4096, 8192, 16384) against the
# kernel in $BASELINE, the GEMV block sweep at M = 1 and the whole-model run; results packed into $PACK.
set -u
R=$1; mkdir -p "$R"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false REPO=$PWD PYTHONPATH=$PWD
pack() { tar -C "$(dirname "$R")" -czf "$PACK.tmp" "$(basename "$R")" && mv "$PACK.tmp" "$PACK"; }
step() { local limit=$1; shift; echo "== $* (limit ${limit}s)"; local t0=$SECONDS
         timeout "$limit" "$@" || echo "!! step failed (rc $?)"; echo "== $((SECONDS - t0)) s"; pack; }
step 100 bash -c "python3 -m pytest -q -p no:cacheprovider -rs -k w4a16 tests/pallas_kernels/test_pk_gpu.py > '$R/pytest.txt' 2>&1; rc=\$?; tail -5 '$R/pytest.txt'; exit \$rc"
W4=(--methods xla_bf16 pallas_w4a16 --samples 5 --ms 1 16 --ks 4096 8192 16384)
step 60 bash -c 'cd "$1" && shift && PYTHONPATH="$PWD:$REPO" python3 "$REPO/bench/kernels.py" "$@"' _ "$BASELINE" "${W4[@]}" --out "$R/kernels_w4a16_before"
step 60 python3 bench/kernels.py "${W4[@]}" --out "$R/kernels_w4a16_after"
step 100 python3 bench/kernel_tune.py --deadline-s 80 --kernels w4a16 --ms 1 --k 8192 --out "$R/tune_w4a16_m1_k8192"
step 90 python3 bench/gpu_model.py --deadline-s 70 --configs llama-1b-shaped --prompt-len 512 --steps 16 --samples 3 --out "$R/gpu_model"
