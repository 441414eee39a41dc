#!/bin/bash
# pycode-small round census with each chain round's parts (verify, drafting, hand-off, rest) for CONFIGS (default:
# the fastest engine with and without the RoPE fold), a random drafter (census timings do not depend on its
# weights: no trained drafter needed), then the GPU tests TESTS_K. Carry: `.carry8/small.tar.xz`,
# `.carry8/humaneval.jsonl`, `.whl`. Device time: ~4-6 min + start.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
tar xJf .carry8/small.tar.xz -C .carry8 || exit 1
python3 bench/decode_small.py --target .carry8/pycode-small --prompts .carry8/humaneval.jsonl --sections census \
  --configs "${CONFIGS:-triton+compile+rows8,triton+compile+rows8+ropefold}" --settings "${SETTINGS:-chain4,chain6,chain7}" \
  ${BENCH_ARGS:-} 2>&1 | tee $OUT/bench.log | grep -v Loading
cp BENCHMARKS.md $OUT/
[ -n "${TESTS_K:-}" ] || exit 0
timeout ${TESTS_S:-150} python3 -m pytest -q --tb=short -p no:cacheprovider -m "gpu or not gpu" tests/gpu/test_decode_gpu.py \
  tests/unit/decode/test_decode_kernels.py tests/unit/decode/test_decode_kernels_engine.py tests/unit/decode/test_decode_traced.py -k "$TESTS_K" > $OUT/tests.log 2>&1
echo "tests rc $?"; tail -15 $OUT/tests.log
