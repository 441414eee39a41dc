#!/bin/bash
# The multi-token attention's plans with the live-key split (8B shape: T=8 tree step, T=49 verify; pycode-small's
# heads: T=5/7 verifies at a short and a long context), then the pycode-small census A/B of one- and two-warp tiles
# (CONFIGS, default A,fewwarps,A). Carry: `.carry8/small.tar.xz`, `.carry8/humaneval.jsonl`, `.whl`.
# Device time: ~4-5 min + start.
set -u
export PYTHONUNBUFFERED=1
. dev/device_runs/prelude.sh
tar xJf .carry8/small.tar.xz -C .carry8 || exit 1
timeout 150 python3 bench/decode_attention.py --tokens 8,49 --cache 880 --context 512 --top 14 2>&1 | grep -v Warn | tail -3
timeout 120 python3 bench/decode_attention.py --shape small --tokens 5,7 --cache 2048 --context 350 --top 10 2>&1 | tail -2
timeout 120 python3 bench/decode_attention.py --shape small --tokens 5,7 --cache 2048 --context 1800 --top 10 2>&1 | tail -2
python3 bench/decode_small.py --target .carry8/pycode-small --prompts .carry8/humaneval.jsonl --sections census \
  --configs "${CONFIGS:-triton+compile+rows8,triton+compile+rows8+fewwarps,triton+compile+rows8}" \
  --settings "${SETTINGS:-chain4,chain6}" ${BENCH_ARGS:-} 2>&1 | tee $OUT/bench.log | grep -v Loading | tail -40
cp BENCHMARKS.md $OUT/
