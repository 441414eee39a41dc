"""The decode engine with the Triton kernels (`SpeculativeDecoder(kernels="triton")`) against the torch path: greedy
output token for token (one-token steps, T-row verifies, the drafter through the kernels), compiled rounds, and the
kernel drafter's forward. The kernels alone are tests/unit/decode/test_decode_kernels.py's; these engine runs are a
file of their own so the test runner (`--dist loadfile`) can put them on the other worker.

Needs triton; on a machine without CUDA the kernels run in triton's interpreter (TRITON_INTERPRET=1, set below
before the kernels are compiled)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from decode_helpers import random_drafter, tiny_qwen3  # noqa: E402

from draftsmith.decode.engine import DecodeMode, SpeculativeDecoder  # noqa: E402
from draftsmith.decode.sampling import SamplingParams  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_engine_kernels_argument():
    """SpeculativeDecoder(kernels=...) sets the runner's path and refuses what it cannot run, in one line."""
    m = tiny_qwen3().to(DEV)
    assert SpeculativeDecoder(m, None, max_len=32, kernels="triton").runner.kernels == "triton"
    assert SpeculativeDecoder(m, None, max_len=32).runner.kernels == "torch"
    with pytest.raises(ValueError, match="kernels"):
        SpeculativeDecoder(m, None, max_len=32, kernels="cuda")
    with pytest.raises(ValueError, match="compact"):
        SpeculativeDecoder(m, None, max_len=32, backend="hf", kernels="triton")
    with pytest.raises(ValueError, match="kernel_rows 8 needs kernels='triton'"):
        SpeculativeDecoder(m, None, max_len=32, kernel_rows=8)
    assert SpeculativeDecoder(m, None, max_len=32, kernels="triton", kernel_rows=8).runner.triton_step(8)
    if DEV == "cpu":  # outside the interpreter, CPU tensors cannot reach a Triton kernel: say so up front
        from draftsmith.decode import kernels as K

        was, K._INTERPRET = K._INTERPRET, False
        try:
            with pytest.raises(ValueError, match="needs a CUDA device"):
                SpeculativeDecoder(m, None, max_len=32, kernels="triton")
        finally:
            K._INTERPRET = was


# the target of the engine tests below: three layers, not tiny_qwen3's four (each layer is a set of kernel launches,
# slow in the interpreter: a quarter less time); the drafter's aux layers stay [0, 1, 2], three distinct ones as with
# four layers
_ENGINE_LAYERS = 3


@pytest.mark.parametrize("setup", ["one-token", "rows", "built"])
def test_greedy_equal_with_triton_kernels(setup):
    """Decoding through the engine with the kernels on gives, token for token, the plain torch path's greedy output
    (tiny Qwen3, fp32, peaky logits: no near-ties). one-token: the runner's one-token steps through the kernels
    (plain, chain); rows: the verify forwards through the T-row matmul kernels too (chain, tree); built: an engine
    made with kernels="triton" — the drafter through the kernels (`KernelDraftStep`) and its tree levels' top-k
    through topk_logprobs as well (chain, tree). All in triton's interpreter on CPU, hence few prompts and three
    layers (`_ENGINE_LAYERS`)."""
    m = tiny_qwen3(layers=_ENGINE_LAYERS).to(DEV)
    d = random_drafter(m, seed=1).to(DEV)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, m.config.vocab_size, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(4)
    ]
    ref = SpeculativeDecoder(m, d, max_len=64)
    if setup == "built":
        eng = SpeculativeDecoder(m, d, max_len=64, kernels="triton")
        assert all(v > 0 for v in eng.drafter_kernel_limits.values()) and eng._d_kern is not None
        modes = (DecodeMode("chain", draft_tokens=3), DecodeMode("tree", top_k=3, depth=3, tree_tokens=6))
        prompts = prompts[:2]  # the interpreter runs the drafter's kernels too: the slowest setup
    else:
        eng = SpeculativeDecoder(m, d, max_len=64)
        eng.runner.kernels = "triton"
        modes = (DecodeMode("plain"), DecodeMode("chain", draft_tokens=2))
        prompts = prompts[:3]
        if setup == "rows":  # the experimental T-row matmuls (off by default): the slowest in the interpreter
            eng.runner.triton_max_rows = 64
            modes = (DecodeMode("chain", draft_tokens=3), DecodeMode("tree", top_k=2, depth=2, tree_tokens=4))
            prompts = prompts[:2]
    n = 8 if setup == "one-token" else 6  # rounds of 3-4 tokens: 6 still spans two rounds and a partial one
    for p in prompts:
        want = ref.generate(p, n, mode=DecodeMode("plain")).token_ids
        for mode in modes:
            got = eng.generate(p, n, mode=mode)
            assert got.token_ids == want, (p, mode)
            if setup == "built" and mode.kind == "chain":  # the drafts' argmax in the lm_head gemv or by torch
                assert eng.fused_draft_argmax
                eng.fused_draft_argmax = False
                unfused = eng.generate(p, n, mode=mode)
                eng.fused_draft_argmax = True
                assert (unfused.token_ids, unfused.accepted) == (got.token_ids, got.accepted), p


def test_triton_kernels_with_compiled_rounds():
    """kernels='triton' with compile=True: on the CPU one-token steps run the kernels without dynamo (plain decoding
    compiles nothing) and the rounds' wider forwards run compiled; on CUDA steps and rounds are traced whole
    (`compile_rounds`, the kernels as custom ops) — either way the output is the plain torch path's, token for
    token."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    m = tiny_qwen3(layers=_ENGINE_LAYERS).to(DEV)
    d = random_drafter(m, seed=2).to(DEV)
    p = torch.randint(0, m.config.vocab_size, (7,), generator=torch.Generator().manual_seed(3)).tolist()
    want = SpeculativeDecoder(m, d, max_len=48).generate(p, 8, mode=DecodeMode("plain")).token_ids
    torch._dynamo.reset()
    counters.clear()
    eng = SpeculativeDecoder(m, d, max_len=48, kernels="triton", compile=True)
    assert eng.generate(p, 8, mode=DecodeMode("plain")).token_ids == want
    assert (counters["stats"]["unique_graphs"] == 0) == (DEV == "cpu")  # the Triton step traced on CUDA only
    assert eng.generate(p, 8, mode=DecodeMode("chain", draft_tokens=2)).token_ids == want
    assert counters["stats"]["unique_graphs"] > 0  # the verify and the drafter were
    torch._dynamo.reset()


@pytest.mark.parametrize("T,rows", [(1, 1), (4, 1), (4, 8)])
def test_kernel_draft_step_equals_module(T, rows, monkeypatch):
    """kernels="triton" runs the drafter through the kernels (`KernelDraftStep`: gemv / gemm_rows with the norm,
    silu*up and residual folds, rope_and_cache into the drafter cache, decode_attention / rows_attention; the first
    layer's embedding, both input norms and their cat folded into its qkv gemv for one token): its forward over T
    tokens after a prefill, its fc and its head equal the module path's (fp32, two engines on the same prompt). Its
    multi-row matmuls take the row kernels only up to the engine's kernel_rows (cuBLAS beyond)."""
    from draftsmith.decode.experimental import gemm_rows as GR

    calls = []
    real = GR.gemm_rows
    monkeypatch.setattr(GR, "gemm_rows", lambda x, *a, **k: calls.append(x.shape[0]) or real(x, *a, **k))
    m = tiny_qwen3().to(DEV)
    d = random_drafter(m, seed=4).to(DEV)
    p = torch.randint(0, m.config.vocab_size, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    outs = []
    for kernel_drafter in (True, False):
        eng = SpeculativeDecoder(m, d, max_len=48, kernels="triton", kernel_rows=rows)
        if not kernel_drafter:
            eng.kernel_drafter = False
            eng._build_drafter_view()
        assert (eng._d_kern is not None) == kernel_drafter
        if kernel_drafter:  # the embedding fold: one row (the gemv's)
            folds = eng._d_kern._embed_fold(eng._d_kern.layers[0], torch.zeros(T, 1, device=DEV), T)
            assert folds == (T == 1)
        eng.prefill(p, SamplingParams(), draft=True)
        calls.clear()
        g = torch.Generator().manual_seed(6)
        aux = torch.randn(T, d.fc.in_features, generator=g).to(DEV)
        ids = torch.randint(0, m.config.vocab_size, (T,), generator=g).to(DEV)
        pos = torch.arange(len(p), len(p) + T, device=DEV)
        h_in = eng.fuse(aux)
        h = eng.draft_forward(ids, h_in, pos, pos, eng.mask(pos))
        outs.append((h_in, h, eng.draft_logits(h), eng.dk[:, :, :, : len(p) + T].clone()))
        # fc, qkv, o, gate/up, down, head: through gemm_rows exactly when the rows fit kernel_rows
        assert calls == ([T] * 6 if kernel_drafter and 1 < T <= rows else []), calls
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
