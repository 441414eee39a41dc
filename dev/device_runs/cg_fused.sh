#!/usr/bin/env bash
# experimental.cluster_gemm with its folds (KernelConfig.cluster_gemm_fused) on the 8B verify: the kernel GPU tests
# (TESTS_K), bench/cluster_gemm.py iso over VARIANTS (its fastest plan a shape saved to $OUT/plans.json) and the
# chain with CHAIN_PLANS (the fastest glue-folded set saved to $OUT/chain_plans.json), then the P2b A/B with
# P2B_PLANS (chain_plans, or plans: iso's) (P2B: 1; BENCH_ARGS). Carry `.whl`. ~420 s + start.
set -u
. dev/device_runs/prelude.sh
L0=$(wc -l < BENCHMARKS.md)
if [ -n "${TESTS_K:-}" ]; then
  timeout "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/gpu/test_decode_gpu.py \
    -k "$TESTS_K" 2>&1 | tail -20 | tee "$OUT/tests.txt"
fi
timeout "${ISO_S:-200}" python3 bench/cluster_gemm.py --sections "${SECTIONS:-iso,chain}" --iso-no-pdl 0 \
  --variants "${VARIANTS:-bn128_half,bn128_l,bn256wg4}" --splits "${SPLITS:-1,2,4,6}" \
  --save-plans "$OUT/plans.json" --save-chain-plans "$OUT/chain_plans.json" --chain-plans "${CHAIN_PLANS:-}" 2>&1 | grep -v Warn | tail -40 | tee "$OUT/cg.txt"
cat "$OUT/plans.json" "$OUT/chain_plans.json"
if [ "${P2B:-1}" = 1 ]; then
  # shellcheck disable=SC2086
  timeout "${P2B_S:-300}" python3 bench/decode.py --sections P2b --kernels triton --attn-impls bmm --compile \
    --budget "${BUDGET:-200}" --p2b-tau "${P2B_TAU:-tree:8/6/48=6.09}" --cluster-gemm-plans "$OUT/${P2B_PLANS:-chain_plans}.json" \
    ${BENCH_ARGS:---cluster-gemm fused} 2>&1 | grep -v Warning | tail -30 | tee "$OUT/p2b.log"
fi
tail -n +$((L0 + 1)) BENCHMARKS.md > "$OUT/bench.md"
