#!/usr/bin/env bash
# Set up (if needed) and run the test suite on CPU. GPU-only tests skip themselves without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TOKENIZERS_PARALLELISM=false
python -m pytest -q "$@"
