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
mkdir -p "$OUT"
draftsmith inspect assets/pycode-tiny
# 1. capture: aux hidden states of layers 1,3,4 (layer-output ids) + the final pre-norm state
draftsmith capture --target assets/pycode-tiny --data "$CORPUS" --out "$OUT/store" \
  --glob "*.py" --on-bad skip --aux-layers 1,3,4 --max-length 512 --max-samples ${DEMO_SAMPLES:-400}
draftsmith store verify "$OUT/store"
draftsmith store info "$OUT/store"
