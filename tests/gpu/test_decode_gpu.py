"""GPU checks of the decode engine (skipped without CUDA): CUDA-graph rounds give the same tokens as the
eager rounds and as HF greedy decoding; capture never silently falls back to eager."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch

from draftsmith.decode.engine import DecodeMode, SpeculativeDecoder
from draftsmith.decode.sampling import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = str(Path(__file__).resolve().parents[2])
PYCODE_TINY = next(
    (
        p
        for p in (
            os.path.join(ROOT, "assets", "pycode-tiny"),
            os.path.join(ROOT, ".carry", "pycode-tiny"),
            "/work/shared/targets/pycode-tiny",
        )
        if os.path.isdir(p)
    ),
    None,
)
MODES = [DecodeMode("plain"), DecodeMode("chain", draft_tokens=4), DecodeMode("tree", top_k=4, depth=4, tree_tokens=16)]


def _prompts(tok, n=16):
    src = next(
        (
            p
            for p in (os.path.join(ROOT, ".carry", "humaneval.jsonl"), "/work/shared/data/eval/humaneval.jsonl")
            if os.path.exists(p)
        ),
        None,
    )
    out = []
    if src:
        for line in open(src):
            out.append(tok(json.loads(line)["turns"][0].split("\n", 1)[1])["input_ids"][:48])
    out += [tok(s)["input_ids"] for s in ("def ", "import os\n", "class A:\n")]
    return out[:n]


@pytest.fixture(scope="module")
def setup():
    if PYCODE_TINY is None:
        pytest.skip("pycode-tiny not available")
    from draftsmith.drafter import Drafter
    from draftsmith.target_model import load_target

    t = load_target(PYCODE_TINY, dtype="fp32", device="cuda")
    torch.manual_seed(0)
    d = Drafter.from_target(t).to("cuda").eval()
    d.requires_grad_(False)
    return t, d


@pytest.fixture(scope="module")
def refs(setup):
    t, _ = setup
    out = []
    for p in _prompts(t.tokenizer, 8):
        x = torch.tensor([p], device="cuda")
        out.append(
            (
                p,
                t.model.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    max_new_tokens=32,
                    do_sample=False,
                    eos_token_id=0,
                    pad_token_id=0,
                )[0, len(p) :].tolist(),
            )
        )
    return out


@pytest.mark.parametrize("mode", MODES, ids=[m.kind for m in MODES])
def test_graph_rounds_equal_hf_greedy(setup, refs, mode):
    t, d = setup
    eng = SpeculativeDecoder(t, d, max_len=160)
    assert eng.cuda_graphs
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a capture failure warns and falls back: make it fail here
        eng.warmup(mode)
        eng.warmup(DecodeMode("plain"))
    eager = SpeculativeDecoder(t, d, max_len=160, cuda_graphs=False)
    assert eng.lookahead  # a CUDA engine's default: the next round launched before the last is read
    for p, ref in refs:
        r = eng.generate(p, 32, mode=mode)
        assert r.token_ids == ref
        e = eager.generate(p, 32, mode=mode)
        assert e.token_ids == ref and e.accepted == r.accepted  # graph replay == eager rounds
        s = eng.generate(p, 32, mode=mode, lookahead=False)  # read before the next launch: the same rounds
        assert s.token_ids == ref and s.accepted == r.accepted and s.rounds == r.rounds


@pytest.mark.parametrize("mode", MODES, ids=[m.kind for m in MODES])
def test_graphed_prefill_equal_hf_greedy(setup, refs, mode):
    """`prefill_graphs`: prompts prefill padded to a length bucket from one captured CUDA graph each (no capture
    falls back to eager), and greedy decoding after it is HF's, token for token."""
    t, d = setup
    eng = SpeculativeDecoder(t, d, max_len=160)
    eng.prefill_graphs = True
    eager = SpeculativeDecoder(t, d, max_len=160)
    eager.prefill_graphs = False  # (on by default with CUDA graphs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for p, ref in refs:
            assert eng.generate(p, 32, mode=mode).token_ids == ref
        # shorter prompts after longer ones: each bucket's first use captures with its own prompt's length
        long = max((p for p, _ in refs), key=len)
        for n in (len(long), 40, 20, 9):
            q = long[:n]
            assert eng.generate(q, 16, mode=mode).token_ids == eager.generate(q, 16, mode=mode).token_ids
    assert eng._pf_graphs and all(isinstance(g.__self__, torch.cuda.CUDAGraph) for g in eng._pf_graphs.values())


def test_warmup_captures_the_prefill_graphs(setup, refs):
    """`warmup(mode, prefill=True)` (serve's start) captures every bucket's prefill graph that fits the cache, all in
    one shared memory pool, and decoding after it is HF's greedy, token for token (prompts of several buckets, each
    replaying its graph after the others used the pool), with no capture left for the prompts."""
    t, d = setup
    mode = MODES[1]
    eng = SpeculativeDecoder(t, d, max_len=160)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eng.warmup(mode, prefill=True)
    n = len(eng._pf_graphs)
    assert n == sum(1 for b in eng.PREFILL_BUCKETS if b <= eng.max_len) and eng._pf_pool is not None
    assert all(isinstance(g.__self__, torch.cuda.CUDAGraph) for g in eng._pf_graphs.values())
    for p, ref in refs:
        assert eng.generate(p, 32, mode=mode).token_ids == ref
    assert len(eng._pf_graphs) == n


@pytest.mark.parametrize("mode", MODES[1:], ids=[m.kind for m in MODES[1:]])
def test_graph_sampling_reproducible_with_seed(setup, mode):
    t, d = setup
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50)
    g = SpeculativeDecoder(t, d, max_len=160)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # sampling rounds (and the plain fallback step) must capture, not fall back
        g.warmup(mode, sp)
        g.warmup(DecodeMode("plain"), sp)
    assert all(hasattr(r, "__self__") and isinstance(r.__self__, torch.cuda.CUDAGraph) for r in g.graphs.values())
    p = _prompts(t.tokenizer, 1)[0]
    a = g.generate(p, 40, sampling=sp, mode=mode, seed=7)
    b = g.generate(p, 40, sampling=sp, mode=mode, seed=7)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 40
    s = g.generate(p, 40, sampling=sp, mode=mode, seed=7, lookahead=False)  # the same draws, read synchronously
    assert s.token_ids == a.token_ids and s.accepted == a.accepted
    # capturing in the first call must not shift the RNG stream either (warm-up rounds draw random numbers)
    g2 = SpeculativeDecoder(t, d, max_len=160)
    c = g2.generate(p, 40, sampling=sp, mode=mode, seed=7)
    assert c.token_ids == a.token_ids


def test_bf16_greedy_mostly_equal(setup):
    """bf16: verify (T>1) and plain (T=1) forwards may round differently; report how often output differs."""
    t, d = setup
    from draftsmith.target_model import load_target

    tb = load_target(PYCODE_TINY, dtype="bf16", device="cuda")
    db = d.to(torch.bfloat16)
    eng = SpeculativeDecoder(tb, db, max_len=160)
    same = 0
    ps = _prompts(tb.tokenizer, 8)
    for p in ps:
        plain = eng.generate(p, 32, mode=DecodeMode("plain")).token_ids
        spec = eng.generate(p, 32, mode=DecodeMode("chain", draft_tokens=4)).token_ids
        same += plain == spec
    d.to(torch.float32)
    assert same >= 0.8 * len(ps), f"{same}/{len(ps)} prompts identical in bf16"


@pytest.mark.parametrize("engine", ["eager", "compiled-rows"])
@pytest.mark.parametrize("mode", MODES, ids=[m.kind for m in MODES])
def test_triton_kernels_graph_rounds_equal_hf_greedy(setup, refs, mode, engine):
    """kernels="triton" natively on the GPU (the CPU tests run them in triton's interpreter): tiles tuned, plain
    steps from CUDA graphs, token for token HF's greedy output in fp32 (pycode-tiny: MQA, 3 query heads); the
    drafter through the kernels too (`KernelDraftStep`). compiled-rows: compile=True, kernel_rows=8 — every step
    and round traced whole by inductor, the kernels as custom ops, chain verifies through the row kernels."""
    pytest.importorskip("triton")
    t, d = setup

    if engine == "eager":
        eng = SpeculativeDecoder(t, d, max_len=160, kernels="triton")
    else:
        eng = SpeculativeDecoder(t, d, max_len=160, kernels="triton", compile=True, kernel_rows=8)
        assert eng._c_round is not None
    assert eng._d_kern is not None
    # tuned on this GPU at engine build (kept in the runner's KernelConfig)
    assert eng.runner.kernels == "triton" and eng.runner.kernel_config.gemv_tuned
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a capture that falls back to eager warns: fail on it
        # (inductor's advice to allow TF32 for fp32 matmuls, which this fp32 equality test must not)
        warnings.filterwarnings("ignore", message=".*TensorFloat32.*")
        eng.warmup(mode)
        eng.warmup(DecodeMode("plain"))
    for p, ref in refs:
        assert eng.generate(p, 32, mode=mode).token_ids == ref


def test_triton_kernels_bf16_step_close_to_torch(setup):
    """bf16: one plain step through the kernels vs the torch path on the same cache — logits within bf16 noise."""
    pytest.importorskip("triton")
    from draftsmith.target_model import load_target

    tb = load_target(PYCODE_TINY, dtype="bf16", device="cuda")
    eng = SpeculativeDecoder(tb, None, max_len=160, kernels="triton")
    p = _prompts(tb.tokenizer, 1)[0]
    eng.prefill(p, SamplingParams())
    L = eng.L.view(1)
    outs = []
    for kn in ("torch", "triton"):
        eng.runner.kernels = kn
        with torch.no_grad():
            outs.append(eng.runner(eng.root.view(1), L, L, eng.mask(L), want_aux=False)[0])
    rel = float((outs[0] - outs[1]).abs().max() / outs[0].abs().max())
    assert rel < 2e-2, rel
    assert int(outs[0].argmax()) == int(outs[1].argmax())


@pytest.mark.parametrize(
    "kernels",
    [
        "torch",
        "triton",
        "triton+cluster_gemm",
        "triton+cluster_gemm_fused",
        "triton+cluster_gemm_fused_rope",
        "triton+cluster_gemm_fused_rope_layer",
    ],
)
def test_bf16_greedy_certificate_no_real_divergence(kernels):
    """bf16 on the GPU (CUDA graphs): every greedy divergence between speculative and plain decoding is a near tie
    (draftsmith.decode.certificate); one at a real margin is a bug. "triton+cluster_gemm": the verify's matmuls
    through experimental.cluster_gemm (sm_90), compiled; "_fused": with the norms, silu * up and residual adds folded
    into it (KernelConfig.cluster_gemm_fused); "_rope": RoPE and the cache writes too (cluster_gemm_rope); "_layer":
    q/k/v, the attention and o in one launch (cluster_gemm_layer: pycode-tiny's 64-wide heads take the bn64 layer
    kernel)."""
    import copy

    from decode_helpers import overfit_drafter_ttt

    from draftsmith.decode.evaluate import run_eval
    from draftsmith.drafter import Drafter
    from draftsmith.target_model import load_target

    if PYCODE_TINY is None:
        pytest.skip("pycode-tiny not available")
    kw = {}
    if kernels.startswith("triton"):
        from draftsmith.decode import kernels as K

        if not K.available():
            pytest.skip("triton not available")
    if kernels.startswith("triton+cluster_gemm"):
        if torch.cuda.get_device_capability()[0] < 9:
            pytest.skip("cluster_gemm needs sm_90")
        from draftsmith.decode.kernel_config import KernelConfig

        fused, rope, layer = "_fused" in kernels, "_rope" in kernels, kernels.endswith("_layer")
        cfg = KernelConfig(
            cluster_gemm=True, cluster_gemm_fused=fused, cluster_gemm_rope=rope, cluster_gemm_layer=layer
        )
        kw = {"kernel_config": cfg, "compile": True}
        kernels = "triton"
    t32 = load_target(PYCODE_TINY, dtype="fp32", device="cuda")
    prompts = _prompts(t32.tokenizer, 16)
    torch.manual_seed(0)
    d = Drafter.from_target(t32).to("cuda")
    eng32 = SpeculativeDecoder(t32, d, max_len=160)
    seqs = [p + eng32.generate(p, 48, mode=DecodeMode("plain")).token_ids for p in prompts]
    overfit_drafter_ttt(eng32, d, seqs, steps=60, ttt_steps=4)
    t = load_target(PYCODE_TINY, dtype="bf16", device="cuda")
    d16 = copy.deepcopy(d).to(torch.bfloat16).eval()
    d16.set_embedding(t.model.get_input_embeddings().weight)
    d16.requires_grad_(False)
    eng = SpeculativeDecoder(t, d16, max_len=160, kernels=kernels, **kw)
    if kw:  # the verify widths take the kernel (at least one launch of it in a verify's plan), fused when asked
        plans = [eng.runner.plan(m.verify_tokens) for m in MODES[1:]]
        assert any(hasattr(p, "_cg_mod") for p in plans)
        if fused:
            from draftsmith.decode.ops import FusedLayer

            assert any(isinstance(p.layers[0], FusedLayer) for p in plans)
    for mode in MODES[1:]:
        rep = run_eval(eng, prompts, mode, temperatures=[0.0], max_new_tokens=48)
        e = rep["temperatures"]["0"]
        gd = e["greedy_divergences"]
        assert gd["equal"] + gd["near_tie"] + gd["real"] == len(prompts)
        assert gd["real"] == 0, f"{mode}: greedy divergence at a real margin: {e['greedy_divergence_details']}"


def test_cluster_gemm_flag_builds_the_kernel_engine():
    """--cluster-gemm fusedrope (the CLIs' `build_engine`): the engine's wide verify takes the folded kernel with RoPE,
    eval reports the setting, and no greedy divergence sits at a real margin (bf16, pycode-tiny, untrained drafter:
    short accepts, every round still a verify through the kernel)."""
    from draftsmith.decode.evaluate import run_eval
    from draftsmith.decode.ops import FusedLayer
    from draftsmith.decode.setup import build_engine, cluster_gemm_setting
    from draftsmith.drafter import Drafter
    from draftsmith.target_model import load_target

    if PYCODE_TINY is None:
        pytest.skip("pycode-tiny not available")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("cluster_gemm needs sm_90")
    t = load_target(PYCODE_TINY, dtype="bf16", device="cuda")
    torch.manual_seed(0)
    d = Drafter.from_target(t).to(device="cuda", dtype=torch.bfloat16).eval()
    d.set_embedding(t.model.get_input_embeddings().weight)
    mode = DecodeMode("tree", top_k=4, depth=4, tree_tokens=16)
    eng = build_engine(
        t, d, 160, "auto", True, kernels="triton", kernel_rows=1, modes=(mode,), cluster_gemm="fusedrope"
    )
    assert cluster_gemm_setting(eng) == "fusedrope"
    plan = eng.runner.plan(mode.verify_tokens)
    assert hasattr(plan, "_cg_mod") and isinstance(plan.layers[0], FusedLayer)
    prompts = _prompts(t.tokenizer, 8)
    rep = run_eval(eng, prompts, mode, temperatures=[0.0], max_new_tokens=32)
    assert rep["cluster_gemm"] == "fusedrope"
    gd = rep["temperatures"]["0"]["greedy_divergences"]
    assert gd["equal"] + gd["near_tie"] + gd["real"] == len(prompts) and gd["real"] == 0, gd


def test_lt_linear_tuned_algorithms_equal_f_linear():
    """experimental.cublaslt: every candidate runs, and `tune_lt` keeps only algorithms whose output is F.linear's
    bit for bit (on fresh inputs too, not only the probe it chose with), or none."""
    from draftsmith.decode.experimental.cublaslt import lt_for, lt_linear, tune_lt

    torch.manual_seed(0)
    mats = [torch.randn(384, 256, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(3)]
    rows = tune_lt({"m": mats}, [5, 49], min_gain=-1.0)
    assert {r["rows"] for r in rows} == {5, 49}
    for r in rows:
        # min_gain < 0 keeps the fastest bit-equal candidate whatever its speed: one exactly when any is bit-equal
        assert r["candidates"] >= 1 and (r["algo"] is not None) == (r["bit_equal"] >= 1)
        x = torch.randn(r["rows"], 256, device="cuda", dtype=torch.bfloat16)
        if r["algo"] is not None:
            for w in mats:
                assert torch.equal(lt_linear(x, w, r["algo"]), torch.nn.functional.linear(x, w))
        lt = lt_for(r["rows"], 384, 256, torch.bfloat16, x.device)
        for i in range(len(lt.algos)):  # every candidate computes the product (split-K: in another order)
            torch.testing.assert_close(lt(x, mats[0], algo=i), x @ mats[0].t(), rtol=2e-2, atol=2e-2)


def test_lt_search_configurations_compute_the_product():
    """experimental.cublaslt `LtLinear.search`: configurations beyond the heuristic's list (tiles, split-K, cluster
    shapes, ... that cublasLtMatmulAlgoCheck accepts) are new ones, appended after the heuristic's, and each computes
    x @ w^T (split-K: in another order)."""
    from draftsmith.decode.experimental.cublaslt import LtLinear

    torch.manual_seed(1)
    w = torch.randn(384, 256, device="cuda", dtype=torch.bfloat16) * 0.05
    x = torch.randn(49, 256, device="cuda", dtype=torch.bfloat16)
    lt = LtLinear(49, 384, 256)
    n0 = lt.n_heuristic
    added = lt.search(budget=4000)
    assert 0 < lt.search_checks <= 4000 and len(lt.algos) == n0 + added
    assert len({bytes(a) for a in lt._algos}) == len(lt._algos)  # no configuration twice
    assert all(info.searched and info.index == n0 + i for i, info in enumerate(lt.algos[n0:]))
    for i in range(n0, len(lt.algos), max(1, added // 40)):  # a spread of them (each a launch)
        torch.testing.assert_close(lt(x, w, algo=i), x @ w.t(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("mode", MODES[1:], ids=[m.kind for m in MODES[1:]])
def test_lt_matmuls_rounds_equal_plain_decoding(setup, mode):
    """KernelConfig.lt_matmuls (experimental): compiled bf16 rounds whose verify takes the tuned cuBLASLt algorithms
    decode what the same engine without them decodes, token for token (the algorithms are F.linear's bit for bit);
    with lt_search too (the searched configurations among the candidates)."""
    pytest.importorskip("triton")
    from draftsmith.decode.kernel_config import KernelConfig
    from draftsmith.drafter import Drafter
    from draftsmith.target_model import load_target

    tb = load_target(PYCODE_TINY, dtype="bf16", device="cuda")
    torch.manual_seed(0)
    d = Drafter.from_target(tb).to("cuda", torch.bfloat16).eval()
    d.requires_grad_(False)
    outs = []
    for lt, search in ((False, False), (True, False), (True, True)):
        cfg = KernelConfig(lt_matmuls=lt, lt_search=search)
        eng = SpeculativeDecoder(tb, d, max_len=160, kernels="triton", compile=True, kernel_config=cfg)
        outs.append([eng.generate(p, 32, mode=mode).token_ids for p in _prompts(tb.tokenizer, 6)])
        if lt:
            assert eng.lt_tuning and {r["rows"] for r in eng.lt_tuning} == {mode.verify_tokens}
    assert outs[0] == outs[1] == outs[2]


def _sm90() -> bool:
    return torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.skipif(not torch.cuda.is_available() or not _sm90(), reason="needs sm_90 (TMA, wgmma, clusters)")
def test_cluster_gemm_matches_fp32_reference():
    """experimental.cluster_gemm, every variant (but the no-multiply diagnostics) and split (an uneven one too), at
    1 to 64 rows: within twice torch's own bf16 error of the fp32 product; a strided x (a column slice); rows past M
    never written."""
    from draftsmith.decode.experimental import cluster_gemm as cg

    torch.manual_seed(0)
    K = 448  # 7 K tiles: splits 2, 3 and 4 are uneven
    for N in (256, 512):
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.05
        for M in (1, 7, 49, 56, 64):
            xs = torch.randn(M, K + 64, device="cuda", dtype=torch.bfloat16)
            for x in (xs[:, :K].contiguous(), xs[:, 64:]):
                ref = x.float() @ w.float().t()
                tol = 2 * (torch.mm(x, w.t()).float() - ref).abs().max().item() + 1e-3
                for v in cg.VARIANTS:  # (the _rope instances take RoPE's arguments: their own test)
                    if "nomma" in v or v in cg.ROPE or not cg.supports(x, w, v):
                        continue
                    for s in (1, 2, 3, 4):
                        out = torch.full((M + 1, N), 7.0, device="cuda", dtype=torch.bfloat16)
                        cg.launch(x, w, out, v, s)
                        err = (out[:M].float() - ref).abs().max().item()
                        assert err <= tol, (N, M, v, s, err, tol)
                        assert bool((out[M] == 7.0).all()), (N, M, v, s)


@pytest.mark.skipif(not torch.cuda.is_available() or not _sm90(), reason="needs sm_90 (TMA, wgmma, clusters)")
def test_cluster_gemm_folds_match_references():
    """The kernel's folds (KernelConfig.cluster_gemm_fused), for cluster and last-CTA variants, split and unsplit, at
    1, 17 and 49 rows: the residual producer's h within twice torch's bf16 error of res + x @ w^T in fp32, its hn
    exactly h * nw, its tile sums of squares those of h; the norm-folding call (and its silu(gate) * up) within twice
    torch's error (HF's RMSNorm then F.linear, in bf16) of the fp32 reference."""
    from draftsmith.decode.experimental import cluster_gemm as cg
    from draftsmith.drafter.model import hf_rms_norm

    torch.manual_seed(2)
    K, N, eps = 448, 512, 1e-5
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.05
    wk = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) * 0.05  # a producer's [K out, N in]
    nw = (1 + 0.1 * torch.randn(K, device="cuda")).to(torch.bfloat16)
    plans = [("bn128_half", 1), ("bn128_half", 3), ("bn128_l", 1), ("bn128_l", 2), ("bn256wg4", 2), ("bn64", 4)]
    for M in (1, 17, 49):
        h = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        # the producer: h2 = h + x @ wk^T, its hn and sums of squares
        ref_h = h.float() + x.float() @ wk.float().t()
        tol_h = 2 * ((h + torch.mm(x, wk.t())).float() - ref_h).abs().max().item() + 1e-3
        # the normed calls
        normed = hf_rms_norm(h, nw, eps)
        hr = h.float() * torch.rsqrt(h.float().square().mean(-1, keepdim=True) + eps) * nw.float()
        ref_y = hr @ w.float().t()
        tol_y = 2 * (torch.mm(normed, w.t()).float() - ref_y).abs().max().item() + 1e-3
        g, u = ref_y.chunk(2, -1)
        ref_a = torch.nn.functional.silu(g) * u
        tg, tu = torch.mm(normed, w.t()).chunk(2, -1)
        tol_a = 2 * ((torch.nn.functional.silu(tg) * tu).float() - ref_a).abs().max().item() + 1e-3
        hn0, ssq0 = cg.norm_inputs(h, nw)
        for plan in plans:
            if cg.supports(x, wk, plan[0]):
                h2, hn, ssq = cg.fused(x, wk, plan, res=h, nw=nw)
                assert (h2.float() - ref_h).abs().max().item() <= tol_h, (M, plan)
                assert torch.equal(hn, h2 * nw), (M, plan)
                want = h2.float().square().sum(-1)
                assert torch.allclose(ssq[:, :M].sum(0), want, rtol=1e-5, atol=1e-3), (M, plan)
            y = cg.fused(hn0, w, plan, ssq_in=ssq0, eps=eps)
            assert (y.float() - ref_y).abs().max().item() <= tol_y, (M, plan)
            a = cg.fused(hn0, w, plan, ssq_in=ssq0, eps=eps, glu=True)
            assert a.shape == (M, N // 2)
            assert (a.float() - ref_a).abs().max().item() <= tol_a, (M, plan)


@pytest.mark.skipif(not torch.cuda.is_available() or not _sm90(), reason="needs sm_90 (TMA, wgmma, clusters)")
def test_cluster_gemm_rope_equals_rope_and_cache():
    """The `_rope` instances (KernelConfig.cluster_gemm_rope): q, and k and v in the caches, bit for bit what the
    same plan's norm-folded q/k/v followed by kernels.rope_and_cache gives (the same sums, the same rounding), at
    head sizes 128 and 64, split and not, 1 to 49 rows; cache slots outside the rows' untouched."""
    from draftsmith.decode import kernels as K
    from draftsmith.decode.experimental import cluster_gemm as cg

    torch.manual_seed(3)
    K_in, L, nh, nkv, eps = 448, 96, 4, 2, 1e-5
    for d, plans in ((128, [("bn128_half", 1), ("bn128_half", 3)]), (64, [("bn64", 1), ("bn64", 4)])):
        w = torch.randn((nh + 2 * nkv) * d, K_in, device="cuda", dtype=torch.bfloat16) * 0.05
        nw = (1 + 0.1 * torch.randn(K_in, device="cuda")).to(torch.bfloat16)
        ang = torch.arange(L, device="cuda")[:, None] * torch.rand(d // 2, device="cuda")[None]
        cos = torch.cat([ang.cos()] * 2, -1).to(torch.bfloat16).contiguous()
        sin = torch.cat([ang.sin()] * 2, -1).to(torch.bfloat16).contiguous()
        for M in (1, 17, 49):
            hn, ssq = cg.norm_inputs(torch.randn(M, K_in, device="cuda", dtype=torch.bfloat16), nw)
            pos = torch.randint(0, L, (M,), device="cuda")
            slots = torch.randperm(L, device="cuda")[:M]
            for plan in plans:
                caches = [torch.randn(1, nkv, L, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
                kc1, vc1 = (c.clone() for c in caches)
                kc2, vc2 = (c.clone() for c in caches)
                y = cg.fused(hn, w, plan, ssq_in=ssq, eps=eps)
                q1 = K.rope_and_cache(y, pos, slots, cos, sin, kc1, vc1, nh, nkv).reshape(M, nh * d)
                q2 = cg.fused(hn, w, plan, ssq_in=ssq, eps=eps, rope=(pos, slots, cos, sin, kc2, vc2, nh, nkv))
                assert torch.equal(q2, q1), (d, M, plan)
                assert torch.equal(kc2, kc1) and torch.equal(vc2, vc1), (d, M, plan)


@pytest.mark.skipif(not torch.cuda.is_available() or not _sm90(), reason="needs sm_90 (TMA, wgmma, clusters)")
def test_layer_qkv_attn_o_matches_three_launches():
    """`cluster_gemm.layer_qkv_attn_o` (a layer's q/k/v, RoPE and cache writes, attention and o in one launch) against
    the same three steps launched apart, at head sizes 128 (bn128_half) and 64 (bn64): q and the caches bit for bit
    the `_rope` instance's; the attention within bf16 of kernels.rows_attention and of an fp32 reference; o's outputs
    (h, the next norm's h * weight and sums of squares) bit for bit what the same plan gives on the kernel's
    attention; again (its counters reset themselves, all zero after a call), and from a CUDA graph with PDL, at 49, 9
    and 16 rows and splits 2 and 4."""
    import sys

    from draftsmith.decode import kernels as K
    from draftsmith.decode.experimental import cluster_gemm as cg
    from draftsmith.decode.llama import grouped_attention

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from decode_helpers import tree_mask

    torch.manual_seed(5)
    nh, nkv, L, eps = 8, 2, 320, 1e-5

    def check(d, variant):
        H = nh * d
        w = torch.randn((nh + 2 * nkv) * d, H, device="cuda", dtype=torch.bfloat16) * 0.03
        wo = torch.randn(H, H, device="cuda", dtype=torch.bfloat16) * 0.03
        nw_in, nw = ((1 + 0.1 * torch.randn(H, device="cuda")).to(torch.bfloat16) for _ in range(2))
        ang = torch.arange(L, device="cuda")[:, None] * torch.rand(d // 2, device="cuda")[None]
        cos = torch.cat([ang.cos()] * 2, -1).to(torch.bfloat16).contiguous()
        sin = torch.cat([ang.sin()] * 2, -1).to(torch.bfloat16).contiguous()
        scale = d**-0.5
        for M, ctx, split in ((49, 200, 4), (9, 3, 2), (16, 260, 4), (49, 230, 2)):
            h = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
            hn, ssq = cg.norm_inputs(h, nw_in)
            mask = tree_mask([(t - 1) // 2 if t else -1 for t in range(M)], L, ctx).cuda()
            pos = torch.arange(ctx, ctx + M, device="cuda")
            caches = [torch.randn(1, nkv, L, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
            kc1, vc1 = (c.clone() for c in caches)
            kc2, vc2 = (c.clone() for c in caches)
            plan = (variant, split)
            rope2 = (pos, pos, cos, sin, kc2, vc2, nh, nkv)
            assert cg.layer_refusal(hn, w, wo, plan, rope2, mask) == ""
            q1 = cg.fused(hn, w, plan, ssq_in=ssq, eps=eps, rope=(pos, pos, cos, sin, kc1, vc1, nh, nkv))
            a1 = K.rows_attention(q1.view(M, nh, d), kc1, vc1, mask, scale, pos)
            ref = grouped_attention(q1.view(M, nh, d).transpose(0, 1)[None].float(), kc1.float(), vc1.float(), mask,
                                    scale, "bmm").transpose(1, 2).reshape(M, H)  # fmt: skip
            for _ in range(2):  # twice: the counters are back at zero after a call
                q2, a2, h2, hn2, ssq2 = cg.layer_qkv_attn_o(hn, w, ssq, eps, rope2, mask, scale, wo, h, nw, plan)
                assert torch.equal(q2, q1) and torch.equal(kc2, kc1) and torch.equal(vc2, vc1), (d, M, split)
                assert float((a2.float() - ref).abs().max()) < 3e-2, (d, M, split)
                assert float((a2.float() - a1.float()).abs().max()) < 4e-2, (d, M, split)
                h3, hn3, ssq3 = cg.fused(a2, wo, plan, res=h, nw=nw)
                assert torch.equal(h2, h3) and torch.equal(hn2, hn3), (d, M, split)
                assert torch.equal(ssq2[:, :M], ssq3[:, :M]), (d, M, split)
                assert not cg.layer_workspace(w.device, nkv, (nh // nkv + 2) * split, d)[2].any()
        # from a graph, PDL on, after a kernel that writes its x
        x2 = torch.empty_like(hn)
        want = cg.layer_qkv_attn_o(hn, w, ssq, eps, rope2, mask, scale, wo, h, nw, plan)[2]
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            x2.copy_(hn)
            got = cg.layer_qkv_attn_o(x2, w, ssq, eps, rope2, mask, scale, wo, h, nw, plan, True)[2]
        x2.zero_()
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want) and not cg.layer_workspace(w.device, nkv, (nh // nkv + 2) * split, d)[2].any()

    check(128, "bn128_half")
    check(64, "bn64")


@pytest.mark.skipif(not torch.cuda.is_available() or not _sm90(), reason="needs sm_90 (TMA, wgmma, clusters)")
def test_cluster_gemm_pdl_chain_in_a_graph_equals_eager():
    """Dependent launches (each one's x the previous one's output) with PDL on, captured in a CUDA graph and
    replayed, give what the same launches give one by one without PDL: a kernel never reads its x before the
    previous kernel is done (griddepcontrol.wait)."""
    from draftsmith.decode.experimental import cluster_gemm as cg

    torch.manual_seed(1)
    ws = [torch.randn(512, 512, device="cuda", dtype=torch.bfloat16) * 512**-0.5 for _ in range(6)]
    x = torch.randn(49, 512, device="cuda", dtype=torch.bfloat16)

    def run(pdl, late=False):
        y = x
        for i, w in enumerate(ws):
            y = cg.cluster_gemm(y, w, (("bn128_half", "bn64", "bn256")[i % 3], 1 + i % 4), pdl, late)
        return y

    want = run(False)
    for late in (False, True):
        run(True, late)  # loads the module outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            got = run(True, late)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)
