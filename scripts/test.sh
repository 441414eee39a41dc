#!/usr/bin/env bash
# Set up (if needed) and run the test suite on CPU. GPU-only tests skip themselves without CUDA.
# --fast: the fast tier only (pytest -m fast: representative tests of every package, listed in tests/conftest.py
# FAST; <= 3 minutes on 2 cores). Other arguments go to pytest.
set -euo pipefail
FAST=()
if [ "${1:-}" = "--fast" ]; then
    shift
    FAST=(-m fast)
fi
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export TOKENIZERS_PARALLELISM=false
WORKERS=${PYTEST_WORKERS:-2}
# the subprocesses tests start (CLI runs, servers) share the cores with the other worker too
[ "$WORKERS" = 0 ] || export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# style first (seconds): the tree is ruff-formatted and lint-clean
ruff format --check --quiet draftsmith bench tests scripts dev
ruff check --quiet draftsmith bench tests scripts dev
# two pytest workers of one intra-op thread each (tests/conftest.py): the suite is mostly small single-threaded
# forwards, so two processes use 2 cores better than one process with two threads. A file's tests stay in one
# worker (--dist loadfile): module fixtures (servers, trained drafters) are built once and run in file order.
# PYTEST_WORKERS=0: one process.
if [ "$WORKERS" = 0 ]; then
    python -m pytest -q "${FAST[@]}" "$@"
else
    python -m pytest -q -n "$WORKERS" --dist loadfile "${FAST[@]}" "$@"
fi
