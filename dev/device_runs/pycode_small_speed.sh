#!/bin/bash
# pycode-small end to end (dev/device_runs/README.md): the fastest engine with and without the graphed prefill
# (`prefill_graphs`), then the GPU tests of the lookahead and the graphed prefill. CONFIGS: the configs to compare
# (bench/decode_small.py's make_engine); TESTS_K: the tests' -k expression (over tests/gpu/test_decode_gpu.py and
# tests/unit/decode/test_decode_kernels.py; the latter's gemm_rows cases take minutes on a GPU); TESTS_S: their limit;
# SETTINGS: the decode settings (default chain6,chain7); BENCH_ARGS: more flags for the bench (e.g. --loop-profile).
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
tar xJf .carry8/small.tar.xz -C .carry8 || exit 1
python3 bench/decode_small.py --target .carry8/pycode-small --drafter .carry8/final --prompts .carry8/humaneval.jsonl \
  --sections census,speed --configs "${CONFIGS:-triton+compile+rows8,triton+compile+rows8+nopfgraph}" --settings "${SETTINGS:-chain6,chain7}" \
  --speed-prompts 12 --speed-tokens 200 ${BENCH_ARGS:-} 2>&1 | tee $OUT/bench.log | grep -v Loading
cp BENCHMARKS.md $OUT/
timeout ${TESTS_S:-150} python3 -m pytest -q --tb=short -p no:cacheprovider -m "gpu or not gpu" tests/gpu/test_decode_gpu.py \
  tests/unit/decode/test_decode_kernels.py tests/unit/decode/test_decode_kernels_engine.py -k "${TESTS_K:-graphed_prefill or warmup_captures or graph_rounds_equal or \
  sampling_reproducible}" > $OUT/tests.log 2>&1
echo "tests rc $?"; tail -15 $OUT/tests.log
