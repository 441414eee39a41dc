"""The decode rounds must be CUDA-graph capturable: no host syncs (item/tolist/bool/int of a tensor) and no
tensors built from Python data inside a round (a host->device copy). Checked on CPU by making those
calls raise while one round of each kind runs."""

from __future__ import annotations

import contextlib

import pytest
import torch

from draftsmith.decode.engine import DecodeMode, SpeculativeDecoder
from draftsmith.decode.sampling import SamplingParams
from draftsmith.decode.testing import random_drafter, tiny_qwen3


@contextlib.contextmanager
def no_host_sync():
    def boom(name):
        def f(*a, **k):
            raise AssertionError(f"host sync / host data inside a round: {name}")
        return f

    patched = {}
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "numpy", "cpu"):
        patched[(torch.Tensor, name)] = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, boom(f"Tensor.{name}"))
    for name in ("tensor", "as_tensor"):
        patched[(torch, name)] = getattr(torch, name)
        setattr(torch, name, boom(f"torch.{name}"))
    try:
        yield
    finally:
        for (obj, name), fn in patched.items():
            setattr(obj, name, fn)


@pytest.fixture(scope="module")
def eng():
    m = tiny_qwen3()
    return SpeculativeDecoder(m, random_drafter(m), max_len=96)


MODES = [DecodeMode("plain"), DecodeMode("chain", draft_tokens=3), DecodeMode("tree", top_k=3, depth=4, tree_tokens=10)]


@pytest.mark.parametrize("sp", [SamplingParams(), SamplingParams(0.8, top_p=0.9, top_k=20)], ids=["greedy", "sample"])
@pytest.mark.parametrize("mode", MODES, ids=[m.kind for m in MODES])
def test_round_has_no_host_sync(eng, mode, sp):
    with torch.no_grad():
        eng.prefill([1, 2, 3, 4, 5], sp)
        fn = eng._step_fn(mode, sp)
        with no_host_sync():
            for _ in range(3):
                fn()
    assert int(eng.n_emit) >= 1
