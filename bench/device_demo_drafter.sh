#!/usr/bin/env bash
# One device call for issue 18 (run from the repository root on the GPU machine; results under $OUT, at most 7
# files: the device returns 8; run it as `SIDE=0 bash bench/device_demo_drafter.sh > /tmp/stdout.txt 2>&1` for the
# bundled drafter alone: ~8 min with examples/pycode-tiny-bundled.yaml's --max-time 420; timeout_s 600):
#   - trains the bundled demo drafter with `draftsmith pipeline examples/pycode-tiny-bundled.yaml` (GPU, cores 4-15)
#   - meanwhile, on two pinned cores each: bench/demo_cpu.py (CPU round cost vs plain step, cores 2-3) and
#     `draftsmith demo` timed end to end (cores 0-1; the bundled drafter does not exist yet, so it is skipped)
#   - then the new drafter on CPU (cores 0-1, 1 thread) at several --draft-tokens: τ and speedup vs plain decoding,
#     while bench/regenerate.py measures regenerate vs generate() on the GPU
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export DRAFTSMITH_BENCHMARKS=$OUT/bench.md
BOUT=/tmp/bench-out; mkdir -p $BOUT
T0=$(date +%s)
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a $OUT/log.txt; }
log "start $(nproc) cores; $(python -c 'import torch,transformers;print(torch.__version__,transformers.__version__)')"
# SIDE=0 skips the side measurements (round cost, demo wall time, regenerate): the bundled drafter alone
SIDE=${SIDE:-1}
P_CPU=""; P_DEMO=""
[ "$SIDE" = 1 ] && ( OUT=$BOUT OMP_NUM_THREADS=2 taskset -c 2,3 python bench/demo_cpu.py --reps 100 --threads 1,2 \
    > $BOUT/demo_cpu.log 2>&1; echo "demo_cpu rc=$?" >> $BOUT/demo_cpu.log ) &
[ "$SIDE" = 1 ] && P_CPU=$!
[ "$SIDE" = 1 ] && ( S=$(date +%s); OMP_NUM_THREADS=2 taskset -c 0,1 python -m draftsmith demo --out /tmp/demo --fresh \
    > $BOUT/demo.log 2>&1; echo "demo rc=$? wall $(( $(date +%s) - S )) s" >> $BOUT/demo.log ) &
[ "$SIDE" = 1 ] && P_DEMO=$!
log "pipeline (GPU)"
taskset -c 4-15 python -m draftsmith pipeline examples/pycode-tiny-bundled.yaml 2>&1 | grep -v "Loading weights" \
  | tail -60 >> $OUT/log.txt
RUN=runs/pycode-tiny-bundled
mkdir -p $OUT/drafter && cp $RUN/train/final/config.json $RUN/train/final/model.safetensors $OUT/drafter/ \
  && log "drafter: $(du -b $OUT/drafter/model.safetensors)"
cp $RUN/report.md $OUT/bundled_report.md 2>/dev/null
[ "$SIDE" = 1 ] && ( OUT=$BOUT taskset -c 4-15 python bench/regenerate.py > $BOUT/regen.log 2>&1; echo "regen rc=$?" >> $BOUT/regen.log ) &
[ "$SIDE" = 1 ] && wait $P_CPU $P_DEMO
log "CPU evals of the new drafter"
for K in 1 2 3; do
  OMP_NUM_THREADS=1 taskset -c 0,1 python -m draftsmith eval --target assets/pycode-tiny --drafter $RUN/train/final \
    --prompts assets/demo_prompts.jsonl --raw --max-new-tokens 64 --temperatures 0 --draft-tokens $K --device cpu \
    --out $BOUT/cpu-k$K 2>&1 | grep -v "Loading weights" | tail -6 >> $OUT/log.txt
done
OMP_NUM_THREADS=2 taskset -c 0,1 python -m draftsmith eval --target assets/pycode-tiny --drafter $RUN/train/final \
  --prompts assets/demo_prompts.jsonl --raw --max-new-tokens 64 --temperatures 0 --draft-tokens 3 --device cpu \
  --out $BOUT/cpu-k3-2threads 2>&1 | grep -v "Loading weights" | tail -6 >> $OUT/log.txt
wait
python - <<'PY' >> $OUT/log.txt
import json, glob, os
rows = []
for d in sorted(glob.glob("/tmp/bench-out/cpu-*")):
    e = json.load(open(d + "/eval.json")); t = e["temperatures"]["0"]
    rows.append({"run": os.path.basename(d), "tau": t["speculative"]["tau"], "speedup": t["speedup"],
                 "spec_tok_s": t["speculative"]["tokens_per_s"], "plain_tok_s": t["plain"]["tokens_per_s"],
                 "greedy_mismatches": t.get("greedy_mismatches")})
json.dump(rows, open(os.environ["OUT"] + "/cpu_evals.json", "w"), indent=1)
for r in rows: print(r)
PY
[ "$SIDE" = 1 ] && cat $BOUT/demo_cpu.log $BOUT/demo.log $BOUT/regen.log > $OUT/side_logs.txt
log "end"
