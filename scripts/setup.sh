#!/usr/bin/env bash
# Create .venv (if missing) and install draftsmith with its test extras. Idempotent.
# On a CUDA machine, install the torch build you serve with first; here `torch==2.13.0` is the CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
python -m pip install -q -e ".[dev]"
# Interop tests with vLLM's `speculators` 0.9.0: its pins (transformers<=5.19, torchvision, torchaudio) are
# stricter than it needs, so install it without dependencies plus the few it imports.
python -m pip install -q --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
python -m pip install -q "loguru>=0.7.2,<=0.7.3" pydantic-settings openai httpx
# Triton: the CUDA builds of torch bring it, the CPU build does not. The decode kernels' tests run in its
# interpreter on CPU (tests/unit/decode/test_decode_kernels*.py skips without it).
python -c "import triton" 2>/dev/null || python -m pip install -q triton \
  || echo "triton could not be installed: tests/unit/decode/test_decode_kernels*.py will be skipped" >&2
