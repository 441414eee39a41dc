"""TTT attention, teacher, shifted targets and loss vs a naive per-step reference (fp32, 1e-5)."""

from __future__ import annotations

import pytest
import torch

from draftsmith.train.batches import epoch_rows, pack_rows, split_train_eval
from draftsmith.train.ttt import (
    TTTAttention,
    chunked_ttt_attention,
    compute_teacher,
    document_ids_from_lengths,
    positions_from_doc_ids,
    reference_ttt_attention,
    ttt_unroll,
)

_MASKS: dict = {}


def _naive_mask(doc, n_steps):
    """[T, n*T] bool built element by element: causal same-document step-0 keys + diagonals."""
    key = (tuple(doc.tolist()), n_steps)
    if key not in _MASKS:
        _MASKS[key] = _naive_mask_build(doc, n_steps)
    return _MASKS[key]


def _naive_mask_build(doc, n_steps):
    T = doc.numel()
    doc = doc.tolist()
    m = torch.zeros(T, n_steps * T, dtype=torch.bool)
    for i in range(T):
        for j in range(T):
            m[i, j] = doc[i] == doc[j] and j <= i
        for s in range(1, n_steps):
            m[i, s * T + i] = True
    return m


@pytest.mark.parametrize("nh,nkv", [(4, 4), (4, 2), (6, 1)])
def test_attention_backends_match_naive(nh, nkv):
    torch.manual_seed(0)
    B, T, d = 2, 45, 8
    doc = torch.stack([document_ids_from_lengths([10, 20, 5], T), document_ids_from_lengths([45])])
    for n in (1, 2, 5):
        q = torch.randn(B, nh, T, d, dtype=torch.float64)
        ks = [torch.randn(B, nkv, T, d, dtype=torch.float64) for _ in range(n)]
        vs = [torch.randn(B, nkv, T, d, dtype=torch.float64) for _ in range(n)]
        # fully explicit reference: softmax over the masked [T, n*T] scores
        g = nh // nkv
        K = torch.cat(ks, 2).repeat_interleave(g, 1)
        V = torch.cat(vs, 2).repeat_interleave(g, 1)
        want = []
        for b in range(B):
            s = q[b] @ K[b].transpose(-1, -2) / d**0.5
            s = s.masked_fill(~_naive_mask(doc[b], n), float("-inf"))
            want.append(torch.softmax(s, -1) @ V[b])
        want = torch.stack(want)
        ref = reference_ttt_attention(q, ks, vs, doc)
        torch.testing.assert_close(ref, want, atol=1e-10, rtol=1e-10)
        for chunk in (7, 16, 64):
            got = chunked_ttt_attention(q, ks, vs, doc, chunk=chunk)
            torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_flex_backend_matches_reference():
    pytest.importorskip("torch.nn.attention.flex_attention")
    import warnings

    from draftsmith.train.ttt import flex_ttt_attention

    torch.manual_seed(1)
    B, nh, nkv, T, d = 1, 4, 2, 40, 16
    doc = document_ids_from_lengths([13, 27], T)[None]
    q = torch.randn(B, nh, T, d)
    ks = [torch.randn(B, nkv, T, d) for _ in range(3)]
    vs = [torch.randn(B, nkv, T, d) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = flex_ttt_attention(q, ks, vs, doc, block_mask_cache={})
    torch.testing.assert_close(got, reference_ttt_attention(q, ks, vs, doc), atol=1e-5, rtol=1e-5)


def test_positions_restart_per_document():
    doc = document_ids_from_lengths([3, 2, 4], 11)
    assert positions_from_doc_ids(doc).tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1]


# ---------------------------------------------------------------------------------------------------
# full unroll + loss vs a naive loop
# ---------------------------------------------------------------------------------------------------
def _tiny_drafter(num_layers=1, V=50, Vd=20, H=32):
    from draftsmith.drafter import Drafter, DrafterConfig

    cfg = DrafterConfig(
        hidden_size=H,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=V,
        draft_vocab_size=Vd,
        num_hidden_layers=num_layers,
        aux_layer_ids=[0, 1, 2],
        target_num_layers=3,
    )
    d = Drafter(cfg)
    d.set_embedding(torch.randn(V, H))
    counts = torch.randint(0, 100, (V,))
    from draftsmith.drafter import build_draft_vocab

    d2t, t2d = build_draft_vocab(counts, Vd)
    d.set_draft_vocab(d2t, t2d)
    return d.double()


class _Norm(torch.nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _random_row(drafter, lens, T, mask_p=None):
    """A random packed fp32 row for `drafter` (V=50, H=32): (ids, aux, doc, loss_mask, teacher).
    mask_p: fraction of loss-masked-out tokens (None: every token is a target)."""
    V, H = drafter.config.vocab_size, drafter.config.hidden_size
    doc = document_ids_from_lengths(lens, T)[None]
    ids = torch.randint(0, V, (1, T))
    lmask = torch.ones(1, T, dtype=torch.bool) if mask_p is None else torch.rand(1, T) > mask_p
    aux = torch.randn(1, T, 3 * H)
    teacher = compute_teacher(
        torch.randn(1, T, H), _Norm(), torch.randn(V, H) * 3, drafter.draft_target_ids, drafter.t2d
    )
    return ids, aux, doc, lmask, teacher


def _naive_loss(drafter, ids, aux, doc, lmask, final, norm, W, K, w):
    """Per-step loop with the materialised mask and explicit per-position targets."""
    T = ids.shape[1]
    draft_ids = drafter.draft_target_ids
    full = torch.nn.functional.linear(norm(final[0]), W)  # [T, V]
    probs = torch.softmax(full[:, draft_ids], -1)
    in_vocab = drafter.t2d[full.argmax(-1)]
    pos = positions_from_doc_ids(doc)
    attn = TTTAttention(doc, backend="reference")
    hidden = drafter.fuse(aux)
    total = 0.0
    accs = []
    for k in range(K):
        ids_k = torch.zeros_like(ids)
        for i in range(T):
            ids_k[0, i] = ids[0, i + k + 1] if i + k + 1 < T else 0
        hidden = drafter(ids_k, hidden, pos, attn_fn=attn)
        logp = torch.log_softmax(drafter.compute_logits(hidden)[0], -1)
        ces, hits = [], []
        for i in range(T):
            t = i + k + 2  # the token predicted at step k from position i
            if t >= T or doc[0, t] != doc[0, i] or not lmask[0, t] or not in_vocab[t - 1]:
                continue
            ces.append(-(probs[t - 1] * logp[i]).sum())
            hits.append(float(logp[i].argmax() == probs[t - 1].argmax()))
        lk = torch.stack(ces).mean() if ces else logp.sum() * 0
        total = total + w**k * lk
        accs.append(sum(hits) / max(1, len(hits)))
    return total, accs


@pytest.mark.parametrize("num_layers", [1, 2])
def test_unroll_loss_and_grads_match_naive(num_layers):
    torch.manual_seed(0)
    V, Vd, H, K = 50, 20, 32, 4
    drafter = _tiny_drafter(num_layers, V, Vd, H)
    lens = [9, 14, 6]
    T = 32  # 29 real tokens + 3 padding
    doc = document_ids_from_lengths(lens, T)[None]
    ids = torch.randint(0, V, (1, T))
    lmask = torch.rand(1, T) > 0.2
    lmask[0, 29:] = False
    aux = torch.randn(1, T, 3 * H, dtype=torch.float64)
    final = torch.randn(1, T, H, dtype=torch.float64)
    W = torch.randn(V, H, dtype=torch.float64) * 3
    norm = _Norm()

    teacher = compute_teacher(final, norm, W, drafter.draft_target_ids, drafter.t2d)
    assert 0 < int(teacher.in_vocab.sum()) < T  # both cases occur
    got, stats = ttt_unroll(
        drafter, ids, aux, doc, lmask, teacher, ttt_steps=K, step_weight=0.8, backend="chunked", chunk=8
    )
    g_got = torch.autograd.grad(got, [p for p in drafter.parameters()])
    want, accs = _naive_loss(drafter, ids, aux, doc, lmask, final, norm, W, K, 0.8)
    g_want = torch.autograd.grad(want, [p for p in drafter.parameters()])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    m = stats.metrics()
    assert m["acc"] == pytest.approx(accs, abs=1e-12)
    prod, tau = 1.0, 0.0
    for a in accs:
        prod *= a
        tau += prod
    assert m["tau_sim"] == pytest.approx(tau)


def test_unroll_fp32_matches_reference_backend():
    """fp32, the production dtype on CPU: chunked backend vs the dense reference mask, 1e-5."""
    torch.manual_seed(3)
    drafter = _tiny_drafter(1).float()
    ids, aux, doc, lmask, teacher = _random_row(drafter, [12, 28], 40)
    a, _ = ttt_unroll(drafter, ids, aux, doc, lmask, teacher, ttt_steps=7, backend="chunked", chunk=16)
    b, _ = ttt_unroll(drafter, ids, aux, doc, lmask, teacher, ttt_steps=7, backend="reference")
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_packing_is_deterministic_and_within_budget():
    import numpy as np

    lengths = np.array([5, 30, 12, 7, 64, 3, 20, 9])
    tr, ev = split_train_eval(len(lengths), 0.25, seed=3)
    assert sorted(tr + ev) == list(range(8)) and len(ev) == 2
    r1 = epoch_rows(tr, lengths, 32, seed=3, epoch=0)
    assert r1 == epoch_rows(tr, lengths, 32, seed=3, epoch=0)
    assert r1 != epoch_rows(tr, lengths, 32, seed=3, epoch=1) or len(tr) < 3
    for row in r1:
        assert sum(min(int(lengths[i]), 32) for i in row) <= 32
    assert sorted(i for row in r1 for i in row) == sorted(tr)
    assert pack_rows([0, 1], lengths, 32) == [[0], [1]]


def test_chunked_attention_saved_memory_is_linear_in_length():
    """What autograd keeps for backward grows linearly with T (no [T, T] or [K*T, K*T] tensor is saved)."""

    def saved_bytes(T):
        storages = {}

        def pack(t):  # count each saved storage once (chunks save views of the same q/k/v)
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
            return t

        B, nh, nkv, d = 1, 2, 1, 8
        doc = torch.zeros(1, T, dtype=torch.long)  # one document: the densest (worst) case
        q = torch.randn(B, nh, T, d, requires_grad=True)
        ks = [torch.randn(B, nkv, T, d, requires_grad=True) for _ in range(3)]
        vs = [torch.randn(B, nkv, T, d, requires_grad=True) for _ in range(3)]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = chunked_ttt_attention(q, ks, vs, doc, chunk=64)
        out.sum().backward()
        return sum(storages.values())

    small, big = saved_bytes(256), saved_bytes(1024)
    assert big <= 4.5 * small, (small, big)  # quadratic would be ~16x


def test_chunked_loss_matches_whole_row():
    torch.manual_seed(5)
    drafter = _tiny_drafter(1)
    T = 37
    doc = document_ids_from_lengths([20, 17], T)[None]
    ids = torch.randint(0, 50, (1, T))
    lmask = torch.ones(1, T, dtype=torch.bool)
    aux = torch.randn(1, T, 96, dtype=torch.float64)
    teacher = compute_teacher(
        torch.randn(1, T, 32, dtype=torch.float64),
        _Norm(),
        torch.randn(50, 32, dtype=torch.float64) * 3,
        drafter.draft_target_ids,
        drafter.t2d,
    )
    params = list(drafter.parameters())
    a, sa = ttt_unroll(drafter, ids, aux, doc, lmask, teacher, ttt_steps=3, loss_chunk=0)
    ga = torch.autograd.grad(a, params)
    b, sb = ttt_unroll(drafter, ids, aux, doc, lmask, teacher, ttt_steps=3, loss_chunk=8)
    gb = torch.autograd.grad(b, params)
    torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(sa.as_tensor(), sb.as_tensor(), atol=1e-10, rtol=1e-10)


# ---------------------------------------------------------------------------------------------------
# throughput rewrites: flex = step-0 flex + LSE-merged diagonals, fused soft CE, budget-sized chunks
# ---------------------------------------------------------------------------------------------------
def _dense_step0(q, k0, v0, doc):
    """Differentiable dense stand-in for flex over the step-0 keys: (out0, lse0)."""
    B, nh, T, d = q.shape
    g = nh // k0.shape[1]
    K, V = k0.repeat_interleave(g, 1), v0.repeat_interleave(g, 1)
    ar = torch.arange(T)
    allowed = (doc[:, :, None] == doc[:, None, :]) & (ar[None, None, :] <= ar[None, :, None])
    s = (q @ K.transpose(-1, -2) / d**0.5).masked_fill(~allowed[:, None], float("-inf"))
    return torch.softmax(s, -1) @ V, torch.logsumexp(s, -1)


@pytest.mark.parametrize("nh,nkv", [(4, 2), (6, 6)])
def test_lse_merge_of_diagonals_is_exact_with_grads(nh, nkv):
    from draftsmith.train.ttt import merge_diagonal

    torch.manual_seed(2)
    B, T, d = 2, 30, 8
    doc = torch.stack([document_ids_from_lengths([11, 19], T), document_ids_from_lengths([30], T)])
    for n in (2, 4, 7):
        q = torch.randn(B, nh, T, d, dtype=torch.float64, requires_grad=True)
        ks = [torch.randn(B, nkv, T, d, dtype=torch.float64, requires_grad=True) for _ in range(n)]
        vs = [torch.randn(B, nkv, T, d, dtype=torch.float64, requires_grad=True) for _ in range(n)]
        out0, lse0 = _dense_step0(q, ks[0], vs[0], doc)
        got = merge_diagonal(out0, lse0, q, ks[1:], vs[1:], d**-0.5)
        want = reference_ttt_attention(q, ks, vs, doc)
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
        g = torch.randn_like(want)
        inputs = [q] + ks + vs
        for a, b in zip(torch.autograd.grad(got, inputs, g), torch.autograd.grad(want, inputs, g)):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_flex_unroll_matches_chunked_without_grad():
    """The flex backend (CPU: eager flex, forward only) in a whole K-step unroll, 2 layers: same loss/stats;
    the BlockMask is built once per batch (shared by all steps and layers)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    import warnings

    from draftsmith.train import ttt

    torch.manual_seed(4)
    drafter = _tiny_drafter(2).float()
    ids, aux, doc, lmask, teacher = _random_row(drafter, [20, 28], 48)
    calls = []
    orig = ttt.doc_causal_block_mask

    def counting(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    ttt.doc_causal_block_mask = counting
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a, sa = ttt_unroll(drafter, ids, aux, doc, lmask, teacher, ttt_steps=5, backend="flex")
            b, sb = ttt_unroll(drafter, ids, aux, doc, lmask, teacher, ttt_steps=5, backend="chunked")
    finally:
        ttt.doc_causal_block_mask = orig
    assert not ttt._FLEX_BROKEN
    assert len(calls) == 1
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sa.as_tensor(), sb.as_tensor(), atol=1e-4, rtol=1e-5)


def test_fused_soft_ce_matches_log_softmax():
    from draftsmith.train.ttt import soft_ce_sum, ttt_loss_step

    torch.manual_seed(6)
    x = torch.randn(2, 13, 40, dtype=torch.float64, requires_grad=True)
    p = torch.softmax(torch.randn(2, 13, 40, dtype=torch.float64) * 2, -1)
    valid = torch.rand(2, 13) > 0.3
    a = soft_ce_sum(x, p, valid)
    b, _ = ttt_loss_step(x, p, valid)
    torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(
        torch.autograd.grad(a * 1.7, x)[0], torch.autograd.grad(b * 1.7, x)[0], atol=1e-10, rtol=1e-10
    )
    xb = x.detach().to(torch.bfloat16).requires_grad_()  # autocast dtype: math in fp32, grad in bf16
    a = soft_ce_sum(xb, p.float(), valid)
    b, _ = ttt_loss_step(xb.float(), p.float(), valid)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)
    assert torch.autograd.grad(a, xb)[0].dtype == torch.bfloat16


def test_auto_chunk_is_exact_and_within_budget():
    from draftsmith.train.ttt import auto_chunk, chunk_plan

    torch.manual_seed(7)
    B, nh, nkv, T, d = 1, 4, 2, 300, 8
    doc = document_ids_from_lengths([50, 130, 120], T)[None]
    q = torch.randn(B, nh, T, d, dtype=torch.float64)
    ks = [torch.randn(B, nkv, T, d, dtype=torch.float64) for _ in range(3)]
    vs = [torch.randn(B, nkv, T, d, dtype=torch.float64) for _ in range(3)]
    want = reference_ttt_attention(q, ks, vs, doc)
    for budget, want_chunk in ((1 << 10, 128), (1 << 30, 256)):  # budget-bound; about the longest document
        chunk, lo = chunk_plan(doc, None, nh, budget_bytes=budget)
        assert chunk == want_chunk
        got = chunked_ttt_attention(q, ks, vs, doc, chunk=chunk, chunk_lo=lo)
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(chunked_ttt_attention(q, ks, vs, doc, chunk=None), want, atol=1e-10, rtol=1e-10)
    # H200-sized: 16k tokens, 6 heads, documents <= 2048 tokens, 3 GiB -> 8 chunks (not 64)
    assert auto_chunk(1, 6, 16384, 2047, 3 << 30, min_chunk=1024) == 2048
    assert auto_chunk(1, 6, 16384, 99, 3 << 30, min_chunk=1024) == 1024  # short documents: few launches anyway
    c = auto_chunk(1, 6, 16384, 16383, 3 << 30, min_chunk=1024)  # one long document: the budget decides
    assert c < 16384 and c % 128 == 0 and 6 * c * (c + 16383) * 24 <= 3 << 30


def test_flex_compile_raises_dynamo_recompile_limit():
    """Past dynamo's recompile limit (default 8) flex attention silently runs eagerly with dense scores; the
    compiled flex path raises it (one compiled shape per sequence length x grad mode is needed)."""
    from draftsmith.train import ttt

    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    old = getattr(cfg, name)
    try:
        setattr(cfg, name, 8)
        ttt._raise_recompile_limit()
        assert getattr(cfg, name) >= ttt.FLEX_RECOMPILE_LIMIT
    finally:
        setattr(cfg, name, old)


# ---------------------------------------------------------------------------------------------------
# the compiled unroll (GPU default): one graph, same loss, grads and statistics as the eager reference
# ---------------------------------------------------------------------------------------------------
def _dense_flex(q, k, v, mask, scale, enable_gqa):
    """Stand-in for flex attention (no CPU backward in torch): same contract, (out, natural-log LSE)."""
    g = q.shape[1] // k.shape[1]
    s = (q @ k.repeat_interleave(g, 1).transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v.repeat_interleave(g, 1), torch.logsumexp(s, -1)


def _dense_doc_causal(doc_ids, create_block_mask=None):
    ar = torch.arange(doc_ids.shape[-1])
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & (ar[None, None, :] <= ar[None, :, None]))[:, None]


@pytest.mark.parametrize("granularity", ["unroll", "step"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_unroll_is_one_graph_and_matches_reference(backend, granularity, monkeypatch):
    """`CompiledUnroll` traces the whole K-step unroll (drafter steps, the LSE merge of the diagonal keys, the fused
    soft CE and its backward, the statistics) with fullgraph=True — no graph break can silently run parts eagerly —
    and equals the dense reference. Flex attention itself is replaced by a dense function with its contract, as
    torch has no flex backward on CPU; on the GPU the real kernel runs inside the same graph."""
    import torch._dynamo

    import draftsmith.train.ttt as ttt

    monkeypatch.setattr(ttt, "_flex_lse", _dense_flex)
    monkeypatch.setattr(ttt, "doc_causal_block_mask", _dense_doc_causal)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    # inductor's compile time grows with the unrolled graph (~20 s a step on 2 cores): 3 steps still hold step 0 and a
    # reused later step; aot_eager (seconds) keeps 5
    K = 3 if backend == "inductor" else 5
    drafter = _tiny_drafter(2 if granularity == "step" else 1).float()
    ids, aux, doc, lmask, teacher = _random_row(drafter, [40, 60, 20], 128, mask_p=0.2)
    pos = positions_from_doc_ids(doc)
    params = list(drafter.parameters())
    want, st = ttt_unroll(drafter, ids, aux, doc, lmask, teacher, ttt_steps=K, backend="reference", position_ids=pos)
    g_want = torch.autograd.grad(want, params)
    cls = ttt.CompiledStepUnroll if granularity == "step" else ttt.CompiledUnroll
    got, st_got = cls(backend=backend)(drafter, ids, aux, doc, pos, lmask, teacher, K, 0.8, 0)
    g_got = torch.autograd.grad(got, params)
    # "unroll": the K steps are one graph; "step": step 0 and ONE graph reused by steps 1..K-1 (fixed-slot keys)
    assert counters["stats"]["unique_graphs"] == (2 if granularity == "step" else 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st_got, st.as_tensor(), atol=1e-4, rtol=1e-6)
    torch._dynamo.reset()
