#!/usr/bin/env bash
# The whole pipeline on the bundled demo target (assets/pycode-tiny, a 5.5M-parameter Python code LM),
# trained on this machine's own Python sources. CPU is enough; everything lands in runs/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export TOKENIZERS_PARALLELISM=false
OUT=${OUT_DIR:-runs/demo}
CORPUS=$(python -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
# a demo starts fresh each time (capture would refuse a store made with other settings, train a run dir
# that already holds checkpoints): remove only what this script writes
rm -rf "$OUT/store" "$OUT/run" "$OUT/eval" "$OUT/export-sglang" "$OUT/export-vllm"
mkdir -p "$OUT"
draftsmith inspect assets/pycode-tiny
# 1. capture: aux hidden states of layers 1,3,4 (layer-output ids) + the final pre-norm state
draftsmith capture --target assets/pycode-tiny --data "$CORPUS" --out "$OUT/store" \
  --glob "*.py" --on-bad skip --aux-layers 1,3,4 --max-length 512 --max-samples ${DEMO_SAMPLES:-400}
draftsmith store verify "$OUT/store"
draftsmith store info "$OUT/store"
# 2. train: the EAGLE-3 drafter with training-time test (K=7) from the store (a short CPU run)
draftsmith train --target assets/pycode-tiny --store "$OUT/store" --out "$OUT/run" \
  --steps ${DEMO_STEPS:-150} --batch-tokens 2048 --draft-vocab-size 4096 --lr 1e-3 --attn-chunk 1024 -q
draftsmith inspect "$OUT/run/final" --target assets/pycode-tiny
# 3. evaluate: acceptance length, acceptance rate, per-position acceptance, speed vs plain decoding
draftsmith eval --target assets/pycode-tiny --drafter "$OUT/run/final" --prompts assets/demo_prompts.jsonl \
  --raw --max-new-tokens 64 --temperatures 0 --draft-tokens 3 --out "$OUT/eval"
# 4. export for serving
draftsmith export "$OUT/run/final" --format sglang --out "$OUT/export-sglang"
draftsmith export "$OUT/run/final" --format vllm --out "$OUT/export-vllm"
