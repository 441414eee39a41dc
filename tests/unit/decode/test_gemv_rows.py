"""`kernels.gemv` over T rows (`KernelConfig.rows_gemv`: a small verify's matmuls through the one-token step's
kernel): every row bit for bit the one-row launch's, the verify forward against the torch path, and greedy decoding
through an engine that routes its verifies and hand-offs this way against plain decoding; and `gemv`'s `embed` (a
drafter's first-layer input built in the qkv gemv) against torch's norms and cat.

On a machine without CUDA the kernels run in triton's interpreter (TRITON_INTERPRET=1, set below before the kernels
are compiled); skipped where triton is not installed."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from decode_helpers import assert_tree_verify_matches_torch, random_drafter, tiny_qwen3  # noqa: E402

from draftsmith.decode.engine import DecodeMode, SpeculativeDecoder  # noqa: E402
from draftsmith.decode.kernel_config import KernelConfig  # noqa: E402
from draftsmith.decode.kernels import GEMV_ROWS_MAX, gemv  # noqa: E402
from draftsmith.decode.llama import TRITON_OPS  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


# (dtype, fold, block_k, prefetch, T rows): every fold in both dtypes; K=300 in blocks of 128 with and without the
# pipelined loads, and in one block of 512
_CASES = [
    (dt, fold, bk, pf)
    for dt in (torch.float32, torch.bfloat16)
    for fold, (bk, pf) in zip(("norm-bias", "residual", "glu", "act_mul"), [(128, 1), (128, 0), (512, 1), (128, 1)])
] + [(torch.bfloat16, "norm-bias", 512, 1), (torch.bfloat16, "glu", 128, 1)]
_CASES = [(*c, 5) for c in _CASES] + [(torch.bfloat16, "residual", 128, 1, 11)]  # 11 rows: two unrolled chunks


@pytest.mark.parametrize("dtype,fold,block_k,prefetch,T", _CASES)
def test_gemv_rows_equal_one_row_launches(dtype, fold, block_k, prefetch, T):
    """T rows in one launch == T one-row launches, bit for bit: the same tile and code per row (K=300 in blocks of
    128: the first block held for all rows, the others re-read; in one block of 512: all of it held)."""
    g = torch.Generator().manual_seed(len(fold) + block_k + prefetch)
    K, N = 300, 40
    x = torch.randn(T, 2 * K if fold == "act_mul" else K, generator=g).to(DEV, dtype)
    w = (torch.randn(2 * N, K, generator=g) * 0.05).to(DEV, dtype)
    kw = dict(block_n=8, block_k=block_k, prefetch=prefetch)
    if fold == "norm-bias":
        kw.update(norm_weight=(torch.rand(K, generator=g) + 0.5).to(DEV, dtype), bias=torch.randn(2 * N).to(DEV, dtype))
    elif fold == "glu":
        kw.update(norm_weight=(torch.rand(K, generator=g) + 0.5).to(DEV, dtype), glu=True)
    elif fold == "act_mul":
        kw.update(act_mul=True)
    n_out = N if fold == "glu" else 2 * N
    r = torch.randn(T, n_out, generator=g).to(DEV, dtype) if fold in ("residual", "act_mul") else None
    y = gemv(x, w, residual=r, **kw)
    assert y.shape == (T, n_out) and y.dtype == dtype
    rows = [gemv(x[t], w, residual=None if r is None else r[t : t + 1], **kw) for t in range(T)]
    assert all(row.shape == (1, n_out) for row in rows)
    assert torch.equal(y, torch.cat(rows))
    if dtype == torch.float32 and fold == "norm-bias":  # and the one-row gemv is torch's linear (as tested there)
        ref = F.linear(F.rms_norm(x, (K,), kw["norm_weight"], 1e-6), w, kw["bias"])
        torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="rows"):
        gemv(torch.zeros(GEMV_ROWS_MAX + 1, x.shape[1], device=DEV, dtype=dtype), w, **kw)


def test_verify_forward_through_gemv_rows_equals_torch_path():
    """A tree-verify-shaped forward (T=7 tokens, a non-causal mask) with triton_max_rows and rows_gemv: the gemv over
    the rows for every matmul, rope_and_cache, rows_attention — logits, aux and both caches equal the torch path's."""

    def configure(kf):
        kf.kernel_config = KernelConfig(rows_gemv=True)
        kf.kernels, kf.triton_max_rows = "triton", 8
        assert kf.triton_ops_for(7) == frozenset(TRITON_OPS) and kf.triton_step(7) and not kf.triton_step(9)
        assert kf.plan(7).lin.func.__name__ == "gemv"

    assert_tree_verify_matches_torch(configure, DEV)


def test_greedy_equal_with_gemv_rows(monkeypatch):
    """An engine built with kernels="triton", kernel_rows=4 and rows_gemv: the chain verifies (4 rows) and the
    drafter's hand-offs run their matmuls through the gemv over rows (never gemm_rows), and the output is plain
    greedy decoding's token for token (tiny Qwen3, fp32, interpreted on CPU; the 7-token prefill stays torch's)."""
    from draftsmith.decode.experimental import gemm_rows as GR

    def no_gemm_rows(*a, **k):
        raise AssertionError("gemm_rows called with rows_gemv on")

    monkeypatch.setattr(GR, "gemm_rows", no_gemm_rows)
    m = tiny_qwen3().to(DEV)
    d = random_drafter(m, seed=1).to(DEV)
    g = torch.Generator().manual_seed(0)
    p = torch.randint(0, m.config.vocab_size, (7,), generator=g).tolist()
    want = SpeculativeDecoder(m, d, max_len=48).generate(p, 6, mode=DecodeMode("plain")).token_ids
    eng = SpeculativeDecoder(
        m, d, max_len=48, kernels="triton", kernel_rows=4, kernel_config=KernelConfig(rows_gemv=True)
    )
    assert eng._d_kern is not None and eng.runner.triton_step(4) and not eng.runner.triton_step(7)
    assert eng.generate(p, 6, mode=DecodeMode("chain", draft_tokens=3)).token_ids == want


@pytest.mark.parametrize("dtype,T", [(torch.float32, 1), (torch.float32, 3), (torch.bfloat16, 3)])
def test_gemv_embed_fold_equals_norms_and_cat(dtype, T):
    """`embed`: the qkv of an EAGLE-3 drafter's first layer over cat(rmsnorm(E[ids]) * w1, rmsnorm(x) * w2), the gather,
    both norms and the cat in the gemv's prologue, against torch doing them first (and with bias)."""
    from draftsmith.drafter.model import hf_rms_norm

    g = torch.Generator().manual_seed(T)
    V, H, N = 50, 96, 40
    table = torch.randn(V, H, generator=g).to(DEV, dtype)
    ids = torch.randint(0, V, (T,), generator=g).to(DEV)
    x = (torch.randn(T, H, generator=g) * 3).to(DEV, dtype)
    w = (torch.randn(N, 2 * H, generator=g) * 0.05).to(DEV, dtype)
    b = torch.randn(N, generator=g).to(DEV, dtype)
    w1, w2 = ((torch.rand(H, generator=g) + 0.5).to(DEV, dtype) for _ in range(2))
    y = gemv(x, w, w1, 1e-5, bias=b, embed=(table, ids), norm_weight2=w2, block_n=8, block_k=64, prefetch=1)
    ref = F.linear(torch.cat((hf_rms_norm(table[ids], w1, 1e-5), hf_rms_norm(x, w2, 1e-5)), -1), w, b)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert y.shape == (T, N)
    torch.testing.assert_close(y.float(), ref.float(), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="embed needs"):
        gemv(x, w, None, 1e-5, embed=(table, ids), norm_weight2=w2)  # both norms are required
