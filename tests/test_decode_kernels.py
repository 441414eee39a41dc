"""Triton decode kernels (`draftsmith.decode.kernels`, opt-in) against the torch path: the fused
norm/bias/residual GEMV alone, a one-token step of the compact forward, and greedy decoding through the engine.

Needs triton; on a machine without CUDA the kernels run in triton's interpreter (TRITON_INTERPRET=1, set below
before the kernels are compiled). Skipped where triton is not installed (the CPU torch wheel does not bring it:
`pip install triton` to run these on CPU)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from draftsmith.decode.engine import DecodeMode, SpeculativeDecoder, _lower_bound_mask  # noqa: E402
from draftsmith.decode.kernels import gemv  # noqa: E402
from draftsmith.decode.llama import LlamaFamilyForward  # noqa: E402
from draftsmith.decode.testing import random_drafter, tiny_llama, tiny_qwen3  # noqa: E402
from draftsmith.drafter.model import hf_rms_norm  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm,bias,res", [(False, False, False), (True, False, False), (True, True, False),
                                           (False, True, True), (False, False, True)])
def test_gemv_equals_torch(dtype, norm, bias, res):
    g = torch.Generator().manual_seed(0)
    K, N = 600, 203  # neither a multiple of the blocks
    x = torch.randn(1, K, generator=g).to(DEV, dtype)
    w = (torch.randn(N, K, generator=g) * 0.05).to(DEV, dtype)
    nw = (torch.rand(K, generator=g) + 0.5).to(DEV, dtype) if norm else None
    b = torch.randn(N, generator=g).to(DEV, dtype) if bias else None
    r = torch.randn(1, N, generator=g).to(DEV, dtype) if res else None
    y = gemv(x, w, nw, 1e-5, bias=b, residual=r, block_k=256)
    ref = F.linear(hf_rms_norm(x, nw, 1e-5) if norm else x, w, b)
    if res:
        ref = r + ref
    assert y.shape == (1, N) and y.dtype == dtype
    # fp32: summation order only; bf16: the same plus at most one rounding step of the output
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(y.float(), ref.float(), **tol)


def test_gemv_rejects_a_mismatched_weight():
    with pytest.raises(ValueError, match="gemv"):
        gemv(torch.randn(1, 8, device=DEV), torch.randn(4, 9, device=DEV))


@pytest.mark.parametrize("name,model", [("qwen3", tiny_qwen3()), ("qwen2-bias", tiny_llama(vocab_size=50,
                                                                                           model_type="qwen2"))],
                         ids=["qwen3", "qwen2-bias"])
def test_one_token_step_equals_torch_path(name, model):
    """A decode step (T=1) with kernels="triton" gives the torch path's logits, aux states and cache rows."""
    model = model.to(DEV)
    n = model.config.num_hidden_layers
    ref_fwd = LlamaFamilyForward.from_hf(model, [0, n - 1], 64)
    k_fwd = LlamaFamilyForward.from_hf(model, [0, n - 1], 64)
    k_fwd.kernels = "triton"
    ids = torch.randint(0, model.config.vocab_size, (9,), generator=torch.Generator().manual_seed(1)).to(DEV)
    pos = torch.arange(9, device=DEV)
    with torch.no_grad():
        for f in (ref_fwd, k_fwd):  # same prefill (T=9: the torch path in both)
            f(ids[:8], pos[:8], pos[:8], _lower_bound_mask(64, pos[:8], DEV))
        outs = [f(ids[8:], pos[8:], pos[8:], _lower_bound_mask(64, pos[8:], DEV)) for f in (ref_fwd, k_fwd)]
    (lr, ar), (lk, ak) = outs
    torch.testing.assert_close(lk, lr, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ak, ar, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k_fwd.k_cache, ref_fwd.k_cache, atol=1e-5, rtol=1e-5)


def test_greedy_equal_with_triton_kernels():
    """Plain and chain decoding through the engine with the kernels on: token for token the plain torch path's
    greedy output (tiny Qwen3, fp32, peaky logits: no near-ties)."""
    m = tiny_qwen3().to(DEV)
    d = random_drafter(m, seed=1).to(DEV)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, m.config.vocab_size, (int(torch.randint(1, 12, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(6)]
    ref = SpeculativeDecoder(m, d, max_len=64)
    eng = SpeculativeDecoder(m, d, max_len=64)
    eng.runner.kernels = "triton"
    for p in prompts:
        want = ref.generate(p, 10, mode=DecodeMode("plain")).token_ids
        for mode in (DecodeMode("plain"), DecodeMode("chain", draft_tokens=2)):
            assert eng.generate(p, 10, mode=mode).token_ids == want, (p, mode)


def test_bench_decode_kernels_triton_smoke(tmp_path):
    """bench/decode_kernels.py --gemv torch,triton runs the Triton rows and the per-matrix table (tiny shape)."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OUT=str(tmp_path), OMP_NUM_THREADS="1", DRAFTSMITH_BENCHMARKS=str(tmp_path / "B.md"))
    r = subprocess.run([sys.executable, os.path.join(root, "bench", "decode_kernels.py"), "--smoke", "--compile", "off",
                        "--impls", "sdpa", "--gemv", "torch,triton"], cwd=root, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "decode_kernels.json").read_text())
    assert {row["gemv"] for row in res["rows"]} == {"torch", "triton"}
    assert all("triton us/matrix" in m for m in res["per_matrix"])
