#!/usr/bin/env bash
# An 8B-shape P2b A/B of decode engines: the decode GPU tests named by TESTS_K first (both kernel and engine test
# files), then bench/decode.py P2b with the triton kernels, compiled, and BENCH_ARGS (the A/B flags, e.g.
# "--lt-matmuls off,on --rows-attn-fused off,on"); BENCHMARKS.md's new section comes back as $OUT/bench.md.
# Carry: `.whl` only. Device time: TESTS_S + BUDGET + start. Env: TESTS_K (empty: no tests), TESTS_S (170),
# BUDGET (360), P2B_TAU (the twentieth session's P2a), BENCH_ARGS.
set -u
. dev/device_runs/prelude.sh
lines=$(wc -l < BENCHMARKS.md)
if [ -n "${TESTS_K:-}" ]; then
  timeout "${TESTS_S:-170}" python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" \
    tests/unit/decode/test_decode_kernels.py tests/gpu/test_decode_gpu.py -k "$TESTS_K" 2>&1 | tail -15 \
    | tee "$OUT/tests.txt"
fi
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
timeout $((${BUDGET:-360} + 90)) python3 bench/decode.py --sections P2b --kernels triton --attn-impls bmm --compile \
  --budget "${BUDGET:-360}" --p2b-tau "${P2B_TAU:-chain:4=4.08,tree:8/6/48=6.09}" ${BENCH_ARGS:-} 2>&1 \
  | grep -v Warning | tail -40 | tee "$OUT/p2b.log"
tail -n +$((lines + 1)) BENCHMARKS.md > "$OUT/bench.md"
