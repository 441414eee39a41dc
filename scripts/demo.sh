#!/usr/bin/env bash
# The README's first command: install (scripts/setup.sh), then `draftsmith demo` — the pipeline on the bundled demo
# target (assets/pycode-tiny) on CPU: a drafter trained in a few minutes and the bundled one, each evaluated
# against plain decoding (τ and the measured speedup). Everything lands in runs/demo/ (OUT_DIR to change it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export TOKENIZERS_PARALLELISM=false
exec draftsmith demo --out "${OUT_DIR:-runs/demo}" "$@"
