#!/usr/bin/env bash
# The 8B-shape verify through the row kernels (split-K gemm_rows) against cuBLAS: the row-kernel GPU tests, then
# bench/decode.py P2b with the triton engine at kernel_rows 1 (cuBLAS verify) and 64 (the row kernels) side by side,
# tau from the 2026-12-01 held-out target (issue 16). Carry: `.whl` only (pydantic for the tests' imports).
# Device time: ~6-8 min + start. Env: P2B_TAU, KERNEL_ROWS (default 64), TESTS_K.
set -u
. dev/device_runs/prelude.sh
K=${TESTS_K:-"split_k or sums_of_squares or row_kernels or gemm_rows"}
timeout 170 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/unit/decode/test_decode_kernels.py \
  -k "$K" 2>&1 | tail -15 | tee "$OUT/tests.txt"
timeout 420 python3 bench/decode.py --sections P2b --kernels triton --attn-impls bmm --compile --round-census \
  --p2b-tau "${P2B_TAU:-chain:4=3.38,tree:8/6/48=5.20}" --kernel-rows "${KERNEL_ROWS:-64}" 2>&1 \
  | grep -v Warning | tail -60 | tee "$OUT/p2b.log"
