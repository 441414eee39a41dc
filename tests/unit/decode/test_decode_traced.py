"""Whole rounds traced by torch.compile with the Triton kernels (`SpeculativeDecoder.compile_rounds`): under tracing
gemv, gemm_rows, rope_and_cache and decode_attention are torch custom ops (`draftsmith.decode.kernels`). On a machine
without CUDA the kernels run in triton's interpreter (TRITON_INTERPRET=1, set before they compile). Its own file so
the test runner can balance it against test_decode_kernels.py (the interpreter is slow)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from decode_helpers import random_drafter, tiny_qwen3  # noqa: E402

from draftsmith.decode.engine import DecodeMode, SpeculativeDecoder  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_traced_rounds_with_triton_kernels():
    """compile_rounds with kernels="triton": under tracing gemv, gemm_rows, rope_and_cache (mutating the caches) and
    decode_attention are torch custom ops, so a whole round — the drafter's kernel steps, a verify all through the
    row kernels (kernel_rows), the acceptance and the hand-off — traces with no graph break (fullgraph, aot_eager
    here) and decodes exactly as plain decoding."""
    import torch._dynamo

    m = tiny_qwen3().to(DEV)
    d = random_drafter(m, seed=2).to(DEV)
    p = torch.randint(0, m.config.vocab_size, (7,), generator=torch.Generator().manual_seed(3)).tolist()
    want = SpeculativeDecoder(m, d, max_len=48).generate(p, 4, mode=DecodeMode("plain")).token_ids
    torch._dynamo.reset()
    eng = SpeculativeDecoder(m, d, max_len=48, kernels="triton", kernel_rows=4)
    assert eng._d_kern is not None and eng.runner.triton_step(4)
    eng.compile_rounds(backend="aot_eager", fullgraph=True)
    for mode in (DecodeMode("chain", draft_tokens=2), DecodeMode("tree", top_k=2, depth=2, tree_tokens=3)):
        assert eng.generate(p, 4, mode=mode).token_ids == want, mode
    torch._dynamo.reset()
