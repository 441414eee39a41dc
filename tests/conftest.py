"""Shared fixtures: the bundled demo target and tiny random models of other architectures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Test helpers (tiny_models, decode_helpers) live beside this file, outside the package; tests in the tiers below
# import them by module name.
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Without a GPU, triton (if installed) can only run kernels in its interpreter, and that mode must be on before
# triton is first imported (transformers imports it early): tests/test_decode_kernels.py relies on it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "assets" / "pycode-tiny"
SHARED_TARGETS = REPO.parent / "shared" / "targets"


def _small_path() -> Path | None:
    p = SHARED_TARGETS / "pycode-small"
    return p if p.is_dir() else None


@pytest.fixture(scope="session")
def tiny_path() -> Path:
    return TINY


@pytest.fixture(scope="session")
def small_path() -> Path:
    p = _small_path()
    if p is None:
        pytest.skip("../shared/targets/pycode-small not present")
    return p


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def one_thread():
    """Run a test with one intra-op thread (small decode steps are slower with two on 2 shared cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_configure(config):
    # one intra-op thread per pytest-xdist worker (scripts/test.sh runs two), two in a single process
    threads = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
    torch.set_num_threads(max(1, min(threads, os.cpu_count() or 1)))
