"""Triton decode kernels (`draftsmith.decode.kernels`, opt-in) against the torch path: the fused
norm/bias/residual GEMV alone and the compact forward's steps and verifies through them (greedy decoding through
the engine: test_decode_kernels_engine.py).

Needs triton; on a machine without CUDA the kernels run in triton's interpreter (TRITON_INTERPRET=1, set below
before the kernels are compiled). The interpreter rounds fp32 -> bf16 by truncation (the GPU rounds to nearest),
so bf16 comparisons allow a unit in the last place; fp32 ones are tight. Skipped where triton is not installed (the CPU torch wheel does not bring it:
`pip install triton` to run these on CPU)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from decode_helpers import (  # noqa: E402
    assert_tree_verify_matches_torch,
    tiny_llama,
    tiny_qwen3,
    tree_mask,
)

from draftsmith.decode.engine import causal_mask  # noqa: E402
from draftsmith.decode.kernel_config import KernelConfig  # noqa: E402
from draftsmith.decode.kernels import decode_attention, gemv, rope_and_cache, rows_attention  # noqa: E402
from draftsmith.decode.kernels import interpreted as K_interpreted  # noqa: E402
from draftsmith.decode.llama import TRITON_OPS, LlamaFamilyForward, _rotate_half, grouped_attention  # noqa: E402
from draftsmith.drafter.model import hf_rms_norm  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


_FOLDS = [(False, False, False), (True, False, False), (True, True, False), (False, True, True), (False, False, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "norm,bias,res,prefetch,norm_block",
    [(*f, pf, None) for f in _FOLDS for pf in (0, 1)] + [(True, False, False, 1, 128)],
)
def test_gemv_equals_torch(dtype, norm, bias, res, prefetch, norm_block, monkeypatch):
    """With and without the next block's weights loaded ahead; the norm's sum of squares in one pass over x or in
    blocks (NORM_BLOCK_MAX below K)."""
    from draftsmith.decode import kernels as K

    if norm_block:
        monkeypatch.setattr(K, "NORM_BLOCK_MAX", norm_block)
    g = torch.Generator().manual_seed(0)
    K, N = 600, 203  # neither a multiple of the blocks
    x = torch.randn(1, K, generator=g).to(DEV, dtype)
    w = (torch.randn(N, K, generator=g) * 0.05).to(DEV, dtype)
    nw = (torch.rand(K, generator=g) + 0.5).to(DEV, dtype) if norm else None
    b = torch.randn(N, generator=g).to(DEV, dtype) if bias else None
    r = torch.randn(1, N, generator=g).to(DEV, dtype) if res else None
    y = gemv(x, w, nw, 1e-5, bias=b, residual=r, block_k=256, prefetch=prefetch)
    ref = F.linear(hf_rms_norm(x, nw, 1e-5) if norm else x, w, b)
    if res:
        ref = r + ref
    assert y.shape == (1, N) and y.dtype == dtype
    # fp32: summation order only; bf16: the same plus at most one rounding step of the output
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(y.float(), ref.float(), **tol)


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # (the interpreter's max over the NaN case's outputs)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_n", [4, 16, 64])
def test_gemv_argmax_is_torch_argmax_of_its_outputs(dtype, block_n):
    """gemv(argmax_map=) (a greedy draft step's lm_head, argmax and id map in one launch) returns map[torch.argmax
    of the outputs gemv stores], first index on exact ties — ties inside one program's block and across programs
    (duplicated weight rows) — launch after launch (the arrival counter resets itself), with the norm fold."""
    g = torch.Generator().manual_seed(1)
    K, N = 96, 203
    w = (torch.randn(N, K, generator=g) * 0.05).to(DEV, dtype)
    nw = (torch.rand(K, generator=g) + 0.5).to(DEV, dtype)
    id_map = torch.randperm(N, generator=g).to(DEV) + 1000
    for trial in range(6):
        x = torch.randn(1, K, generator=g).to(DEV, dtype)
        if trial >= 3:  # the winner's row copied to a later row in its own block, one in another, one before it
            top = int(torch.argmax(gemv(x, w, nw, 1e-5, block_n=block_n).float()))
            for j in {min(top + 1, N - 1), (top + 3 * block_n) % N, max(top - 2 * block_n, 0) if trial == 5 else top}:
                w[j] = w[top]
        y = gemv(x, w, nw, 1e-5, block_n=block_n)
        got = gemv(x, w, nw, 1e-5, block_n=block_n, argmax_map=id_map)
        assert got.shape == (1,) and got.dtype == torch.long
        assert int(got) == int(id_map[torch.argmax(y.float())]), trial
    with pytest.raises(ValueError, match="argmax_map"):
        gemv(x, w, nw, 1e-5, argmax_map=id_map[:-1])
    for rows in (slice(5, 9), slice(None)):  # NaN logits (a broken drafter), some or all: an id of the map, never
        w_nan = w.clone()  # a read past it
        w_nan[rows] = float("nan")
        assert int(gemv(x, w_nan, nw, 1e-5, block_n=block_n, argmax_map=id_map)) in set(id_map.tolist())
    if block_n == 4:  # more programs than one can reduce: the outputs, then torch's argmax — the same token
        from draftsmith.decode import kernels as K

        K.ARGMAX_MAX_PROGRAMS, keep = 8, K.ARGMAX_MAX_PROGRAMS
        try:
            got = gemv(x, w, nw, 1e-5, block_n=block_n, argmax_map=id_map)
        finally:
            K.ARGMAX_MAX_PROGRAMS = keep
        assert int(got) == int(id_map[torch.argmax(gemv(x, w, nw, 1e-5, block_n=block_n).float())])


@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_act_mul_equals_silu_times_up(dtype, prefetch):
    """down(silu(gate) * up) + residual with the activation folded into the gemv's prologue."""
    g = torch.Generator().manual_seed(3)
    K, N = 300, 70
    gu = torch.randn(1, 2 * K, generator=g).to(DEV, dtype)
    w = (torch.randn(N, K, generator=g) * 0.05).to(DEV, dtype)
    r = torch.randn(1, N, generator=g).to(DEV, dtype)
    y = gemv(gu, w, residual=r, act_mul=True, block_k=128, prefetch=prefetch)
    gate, up = gu.chunk(2, -1)
    ref = r + F.linear(F.silu(gate) * up, w)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(y.float(), ref.float(), **tol)
    with pytest.raises(ValueError, match="act_mul"):
        gemv(gu[:, :K], w, act_mul=True)


@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_glu_equals_silu_gate_times_up(dtype, prefetch):
    """silu(gate) * up in the gate/up gemv's epilogue (RMSNorm prologue and bias on): each program takes the same
    rows of W_gate and W_up from the fused cat(gate, up) weight."""
    g = torch.Generator().manual_seed(4)
    K, I = 300, 70  # I not a multiple of the row block
    x = torch.randn(1, K, generator=g).to(DEV, dtype)
    w = (torch.randn(2 * I, K, generator=g) * 0.05).to(DEV, dtype)
    nw = (torch.rand(K, generator=g) + 0.5).to(DEV, dtype)
    b = torch.randn(2 * I, generator=g).to(DEV, dtype)
    y = gemv(x, w, nw, 1e-5, bias=b, glu=True, block_n=16, block_k=128, prefetch=prefetch)
    gate, up = F.linear(hf_rms_norm(x, nw, 1e-5), w, b).chunk(2, -1)
    if dtype == torch.bfloat16 and K_interpreted():
        # the interpreter truncates each of the epilogue's three bf16 roundings (the GPU rounds to nearest), which
        # compounds to ~5 ulp on values ~4: the projections come from the plain gemv (tested against F.linear
        # above), so what is compared is the epilogue
        gate, up = gemv(x, w, nw, 1e-5, bias=b, block_k=128).chunk(2, -1)
    ref = F.silu(gate) * up
    assert y.shape == (1, I) and y.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(y.float(), ref.float(), **tol)
    with pytest.raises(ValueError, match="even"):
        gemv(x, w[1:], glu=True)


def _rope_reference(qkv, pos, slots, cos, sin, kc, vc, nh, nkv, qkn, eps):
    T, d = qkv.shape[0], cos.shape[1]
    x = qkv.view(1, T, nh + 2 * nkv, d)
    qk, v = x[:, :, : nh + nkv], x[:, :, nh + nkv :]
    if qkn is not None:
        qk = hf_rms_norm(qk, qkn, eps)
    qk = qk * cos[pos][None, :, None] + _rotate_half(qk) * sin[pos][None, :, None]
    kc.index_copy_(2, slots, qk[:, :, nh:].transpose(1, 2))
    vc.index_copy_(2, slots, v.transpose(1, 2))
    return qk[0, :, :nh]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3-qk-norm"])
def test_rope_and_cache_equals_torch(dtype, qk_norm):
    """q returned and k/v written at their slots (other slots untouched) as the torch ops of the compact forward."""
    g = torch.Generator().manual_seed(4)
    nh, nkv, d, T, M = 6, 2, 32, 3, 40
    qkv = torch.randn(T, (nh + 2 * nkv) * d, generator=g).to(DEV, dtype)
    cos = torch.randn(M, d, generator=g).to(DEV, dtype)
    sin = torch.randn(M, d, generator=g).to(DEV, dtype)
    pos = torch.tensor([5, 7, 39], device=DEV)
    slots = torch.tensor([1, 30, 2], device=DEV)
    qkn = (torch.rand(nh + nkv, d, generator=g) + 0.5).to(DEV, dtype) if qk_norm else None
    kc = torch.randn(1, nkv, M, d, generator=g).to(DEV, dtype)
    vc = torch.randn(1, nkv, M, d, generator=g).to(DEV, dtype)
    kr, vr = kc.clone(), vc.clone()
    q = rope_and_cache(qkv, pos, slots, cos, sin, kc, vc, nh, nkv, qkn, 1e-6)
    qr = _rope_reference(qkv, pos, slots, cos, sin, kr, vr, nh, nkv, qkn, 1e-6)
    tol = dict(atol=2e-6, rtol=2e-6) if dtype == torch.float32 else dict(atol=0.13, rtol=2e-2)
    assert q.shape == (T, nh, d)
    torch.testing.assert_close(q.float(), qr.float(), **tol)
    torch.testing.assert_close(kc.float(), kr.float(), **tol)
    assert torch.equal(vc, vr)  # v is copied, not computed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "nh,nkv,d,S,M,split,bs",
    [
        (4, 2, 16, 37, 64, None, None),
        (8, 2, 32, 200, 256, 64, None),
        (4, 4, 16, 130, 160, None, None),
        (3, 1, 64, 600, 640, None, None),
        (3, 1, 64, 600, 640, 128, None),
        (32, 8, 128, 208, 208, None, None),
        (4, 2, 32, 1100, 1152, 32, 32),
    ],
    ids=["gqa2", "split-masked-chunk", "mha", "g3-long", "g3-split", "8b-heads", "35-chunks"],
)
def test_decode_attention_equals_reference(dtype, nh, nkv, d, S, M, split, bs):
    """One query token over the first S cache slots with a random mask, one program per KV head or the keys split
    over programs (a chunk with every key masked included), against the compact forward's attention in fp32."""
    g = torch.Generator().manual_seed(S + nh)
    q = torch.randn(nh, d, generator=g).to(DEV, dtype)
    kc = torch.randn(1, nkv, M, d, generator=g).to(DEV, dtype)
    vc = torch.randn(1, nkv, M, d, generator=g).to(DEV, dtype)
    mask = (torch.rand(S, generator=g) < 0.5).to(DEV)
    mask[-1] = True
    if split:
        mask[:split] = False  # the whole first chunk masked: its weight must be 0, not NaN
    o = decode_attention(q, kc, vc, mask, d**-0.5, split_len=split, block_s=bs)
    ref = grouped_attention(
        q.view(1, nh, 1, d).float(), kc[:, :, :S].float(), vc[:, :, :S].float(), mask[None], d**-0.5, "bmm"
    ).reshape(1, nh * d)
    assert o.shape == (1, nh * d) and o.dtype == dtype
    tol = dict(atol=2e-6, rtol=2e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(o.float(), ref, **tol)


class _GridSpy:
    """Wraps a triton kernel: records each launch's grid (`kernel[grid](...)`) and launches it."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return self.kernel[grid]


def _causal_rows(T: int, L: int, nh: int, kc, vc, g):
    """T query tokens of a chain verify whose causal rows end at slot L -> (q [T, nh, d], slots, mask over the cache's
    width, the compact forward's attention in fp32 [T, nh * d])."""
    d, M = kc.shape[-1], kc.shape[2]
    q = torch.randn(T, nh, d, generator=g).to(DEV)
    slots = torch.arange(L - T + 1, L + 1, device=DEV)
    rmask = torch.arange(M, device=DEV)[None] <= slots[:, None]
    ref = grouped_attention(q.transpose(0, 1)[None], kc.float(), vc.float(), rmask, d**-0.5, "bmm")
    return q, slots, rmask, ref.transpose(1, 2).reshape(T, nh * d)


@pytest.mark.parametrize("chunks", [1, 3, 8])
def test_attention_live_chunks_equal_the_reference(chunks, monkeypatch):
    """`KernelConfig.attn_live_chunks`: the one-token and the T-row attention split the live keys (up to the slot
    the forward wrote, read on the device) into a fixed number of chunks — contexts shorter than the chunks' blocks
    (empty chunks), longer, and a cache far wider than the context — against the compact forward's attention
    (fp32); the torch operators (what a traced round calls) take the setting from the config."""
    from draftsmith.decode import kernels as K

    g = torch.Generator().manual_seed(chunks)
    nh, nkv, d, M = 6, 2, 16, 256
    cfg = K.KernelConfig(attn_live_chunks=chunks)
    spies = {n: _GridSpy(getattr(K, n)) for n in ("_attn_split_kernel", "_rows_attn_kernel", "_attn_combine_kernel")}
    for n, spy in spies.items():
        monkeypatch.setattr(K, n, spy)
    kc = torch.randn(1, nkv, M, d, generator=g).to(DEV)
    vc = torch.randn(1, nkv, M, d, generator=g).to(DEV)
    for L in (5, 37, 200):  # the token's slot; the mask is the cache's width, as under CUDA graphs
        q = torch.randn(nh, d, generator=g).to(DEV)
        mask = torch.arange(M, device=DEV) <= L
        mask[L // 3] = False  # a masked key inside the live range
        ref = grouped_attention(q.view(1, nh, 1, d), kc.float(), vc.float(), mask[None], d**-0.5, "bmm").reshape(
            1, nh * d
        )
        slot = torch.tensor([L], device=DEV)
        got = decode_attention(q, kc, vc, mask, d**-0.5, config=cfg, slot=slot)
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=2e-6)
        got_op = K._decode_attention_op(q, kc, vc, mask, d**-0.5, K.config_key(cfg), slot)
        torch.testing.assert_close(got_op, ref, atol=2e-6, rtol=2e-6)
        # T rows (a chain verify's causal rows ending at slot L)
        qr, slots, rmask, ref_r = _causal_rows(4, L, nh, kc, vc, g)
        got_r = rows_attention(qr, kc, vc, rmask, d**-0.5, slots, config=cfg)
        torch.testing.assert_close(got_r, ref_r, atol=2e-6, rtol=2e-6)
    # the grids: `chunks` programs per KV head whatever the context; a combine launch only with more than one
    assert {gr[1] for gr in spies["_attn_split_kernel"].grids} == {chunks}
    assert {gr[1] for gr in spies["_rows_attn_kernel"].grids} == {chunks}
    assert len(spies["_attn_combine_kernel"].grids) == (0 if chunks == 1 else 9)
    # without the slot, the rule on the mask's width as before (64 chunks at most)
    torch.testing.assert_close(decode_attention(q, kc, vc, mask, d**-0.5, config=cfg), ref, atol=2e-6, rtol=2e-6)
    assert spies["_attn_split_kernel"].grids[-1][1] == M // K.ATTN_BLOCK_S


def test_rows_attention_splits_live_keys_for_few_rows(monkeypatch):
    """The T-row attention's default (`KernelConfig.rows_attn_live`): a forward of at most ROWS_ATTN_LIVE_MAX_ROWS
    tile rows (a chain verify, a hand-off) splits the live keys into ROWS_ATTN_LIVE_CHUNKS chunks, a wider one (an 8B
    tree verify) and a forward without slots keep the width rule, and the setting off restores it; every result
    against the compact forward's attention (fp32)."""
    from draftsmith.decode import kernels as K

    g = torch.Generator().manual_seed(11)
    nh, nkv, d, M, L = 6, 2, 16, 512, 300
    spy = _GridSpy(K._rows_attn_kernel)
    monkeypatch.setattr(K, "_rows_attn_kernel", spy)
    kc = torch.randn(1, nkv, M, d, generator=g).to(DEV)
    vc = torch.randn(1, nkv, M, d, generator=g).to(DEV)
    few = K.ROWS_ATTN_LIVE_MAX_ROWS // (nh // nkv)  # the most tokens that still take the live split
    for T, cfg, live in (
        (few, None, True),
        (few, K.KernelConfig(), True),
        (few + 1, None, False),
        (few, K.KernelConfig(rows_attn_live=False), False),
    ):
        q, slots, rmask, ref = _causal_rows(T, L, nh, kc, vc, g)
        torch.testing.assert_close(
            rows_attention(q, kc, vc, rmask, d**-0.5, slots, config=cfg), ref, atol=2e-6, rtol=2e-6
        )
        n_rb = spy.grids[-1][2]
        live_chunks = min(K.ROWS_ATTN_LIVE_CHUNKS, M // K.ROWS_ATTN_BLOCK_S)  # (d=16: the narrow heads' key block)
        expect = live_chunks if live else -(-M // K._rows_attn_plan(M, n_rb, None, None)[0])
        assert spy.grids[-1][1] == expect, (T, cfg, spy.grids[-1])
    # a short cache (the tests' engines: 64 slots): no more chunks than its key blocks
    q, slots, rmask, ref = _causal_rows(3, 40, nh, kc[:, :, :64], vc[:, :, :64], g)
    torch.testing.assert_close(
        rows_attention(q, kc[:, :, :64], vc[:, :, :64], rmask, d**-0.5, slots), ref, atol=2e-6, rtol=2e-6
    )
    assert spy.grids[-1][1] == 64 // K.ROWS_ATTN_BLOCK_S
    # no slots: the width rule whatever the rows
    q = torch.randn(2, nh, d, generator=g).to(DEV)
    rows_attention(q, kc, vc, torch.ones(2, M, dtype=torch.bool, device=DEV), d**-0.5)
    assert spy.grids[-1][1] == -(-M // K._rows_attn_plan(M, spy.grids[-1][2], None, None)[0])


def test_decode_attention_uses_the_tuned_plan():
    """A plan kept for this shape in the KernelConfig is what decode_attention launches (split_len not a multiple
    of the default key block: the call fails if the plan is ignored), and only under that config; without one, the
    default rule's chunks stay within ATTN_TARGET_CHUNKS."""
    from draftsmith.decode import kernels as K

    g = torch.Generator().manual_seed(5)
    nh, nkv, d, S = 4, 2, 16, 200
    q = torch.randn(nh, d, generator=g).to(DEV)
    kc, vc = torch.randn(1, nkv, S, d, generator=g).to(DEV), torch.randn(1, nkv, S, d, generator=g).to(DEV)
    mask = torch.rand(S, generator=g).to(DEV) < 0.7
    ref = decode_attention(q, kc, vc, mask, 0.25)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(q, kc, vc, mask, 0.25, split_len=80)
    cfg = K.KernelConfig(attn_plans={K._attn_key(S, nkv, nh // nkv, d, q.dtype): (80, 16, 2)})
    assert K._attn_plan(S, nkv, nh // nkv, d, q.dtype, q.device, None, None, None, cfg.attn_plans) == (80, 16, 2)
    assert K._attn_plan(S, nkv, nh // nkv, d, q.dtype, q.device, None, None, None) != (80, 16, 2)
    torch.testing.assert_close(decode_attention(q, kc, vc, mask, 0.25, config=cfg), ref, atol=2e-6, rtol=2e-6)
    # decode_attention launches what the config keeps: a plan of 80 keys in 32-key blocks is refused
    bad = K.KernelConfig(attn_plans={K._attn_key(S, nkv, nh // nkv, d, q.dtype): (80, 32, 2)})
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(q, kc, vc, mask, 0.25, config=bad)
    for S_ in (208, 2128, 8192):
        sl, bs, _ = K._attn_plan(S_, 8, 4, 128, torch.bfloat16, q.device, None, None, None)
        assert (
            sl % bs == 0
            and -(-S_ // sl) <= K.ATTN_TARGET_CHUNKS
            and (sl == bs or -(-S_ // (sl // 2)) > K.ATTN_TARGET_CHUNKS)
        )


def test_decode_attention_skips_unmasked_tail():
    """Slots past the last visible one are never read: garbage (NaN) there changes nothing."""
    g = torch.Generator().manual_seed(9)
    nh, nkv, d, M = 4, 2, 16, 256
    q = torch.randn(nh, d, generator=g).to(DEV)
    kc, vc = torch.randn(1, nkv, M, d, generator=g).to(DEV), torch.randn(1, nkv, M, d, generator=g).to(DEV)
    mask = torch.arange(M, device=DEV) <= 70
    want = decode_attention(q, kc, vc, mask, 0.25)
    kc[:, :, 128:], vc[:, :, 128:] = float("nan"), float("nan")
    torch.testing.assert_close(decode_attention(q, kc, vc, mask, 0.25), want, atol=0, rtol=0)


def _tree_mask(T: int, S: int, ctx: int, g: torch.Generator) -> torch.Tensor:
    """`testing.tree_mask` of a random tree of T nodes."""
    return tree_mask([-1] + [int(torch.randint(-1, t, (1,), generator=g)) for t in range(1, T)], S, ctx)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "T,nh,nkv,d,ctx,M,split,bs,br",
    [
        (7, 4, 2, 16, 30, 64, None, None, None),
        (49, 8, 2, 32, 150, 256, None, None, None),
        (5, 3, 1, 64, 40, 64, 32, 16, 16),
        (33, 4, 4, 16, 200, 256, 64, 32, 32),
        (2, 32, 8, 128, 60, 128, None, None, None),
        (1, 4, 2, 16, 20, 32, None, None, None),
    ],
    ids=["gqa2", "verify-49", "mqa-split-rows", "mha-row-blocks", "8b-heads", "one-token"],
)
def test_rows_attention_equals_reference(dtype, T, nh, nkv, d, ctx, M, split, bs, br):
    """T query tokens with a tree mask each (rows of several tiles, keys split over programs, chunks that some or
    all rows of a tile cannot see), q a strided view as the compact forward passes it, against the compact forward's
    attention in fp32."""
    g = torch.Generator().manual_seed(T * 7 + nh)
    S = ctx + T + 3  # the mask covers 3 tail slots nobody sees
    qkv = torch.randn(T, nh + 2 * nkv, d, generator=g).to(DEV, dtype)
    q = qkv[:, :nh]  # strides (nh + 2 nkv) d, d, 1
    kc = torch.randn(1, nkv, M, d, generator=g).to(DEV, dtype)
    vc = torch.randn(1, nkv, M, d, generator=g).to(DEV, dtype)
    mask = _tree_mask(T, S, ctx, g).to(DEV)
    if split:
        mask[: T // 2, :split] = False  # a chunk that half the rows (in the same tile as the rest) do not see
    o = rows_attention(q, kc, vc, mask, d**-0.5, split_len=split, block_s=bs, block_r=br)
    # the slots this forward wrote (ctx..ctx+T-1): no visible key lies past them, so the bound changes nothing but
    # the kernel's specialisation (another compiled loop: on an H200 fp32 results moved by one ulp, 1.2e-7)
    # (the width rule's plan: with slots and few rows the default splits the live keys instead, checked below)
    slots = torch.arange(ctx, ctx + T, device=DEV)
    width = KernelConfig(rows_attn_live=False)
    o_slots = rows_attention(q, kc, vc, mask, d**-0.5, slots, split_len=split, block_s=bs, block_r=br, config=width)
    tol = 2e-6 if dtype == torch.float32 else 0
    torch.testing.assert_close(o_slots, o, atol=tol, rtol=tol)
    ref = (
        grouped_attention(
            q.transpose(0, 1)[None].float(), kc[:, :, :S].float(), vc[:, :, :S].float(), mask, d**-0.5, "bmm"
        )
        .transpose(1, 2)
        .reshape(T, nh * d)
    )
    assert o.shape == (T, nh * d) and o.dtype == dtype
    tol = dict(atol=2e-6, rtol=2e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(o.float(), ref, **tol)
    if split is None:  # the default plan through the torch operator gives the same
        torch.testing.assert_close(rows_attention(q, kc, vc, mask, d**-0.5), o, atol=0, rtol=0)
        # with the slots: the live-key split for few rows (`KernelConfig.rows_attn_live`), else the width rule
        torch.testing.assert_close(rows_attention(q, kc, vc, mask, d**-0.5, slots).float(), ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "T,nh,nkv,d,ctx,M,plan",
    [
        (49, 8, 2, 32, 150, 256, (16, 32, 1, 4, 2)),  # one chunk over the live keys: no combine launch
        (33, 8, 2, 16, 200, 256, (32, 32, 3, 4, 3)),  # several row blocks, 3 live chunks of whole key blocks
        (20, 8, 2, 128, 100, 256, (64, 64, 2, 8, 2)),  # 128-wide heads, a 64-row tile
    ],
    ids=["single-chunk", "row-blocks", "wide-heads"],
)
def test_rows_attention_plan_equals_width_rule(dtype, T, nh, nkv, d, ctx, M, plan):
    """`KernelConfig.rows_attn_plan` (the wide verify's tile and live chunks): the same attention as the width rule
    (fp32: summation order only) and the compact forward's; one chunk makes no `_attn_combine_kernel` launch. A
    forward the few-row live rule takes ignores the plan (the same bits)."""
    from draftsmith.decode import kernels as K

    g = torch.Generator().manual_seed(T * 3 + nh)
    S = ctx + T + 3
    q = torch.randn(T, nh + 2 * nkv, d, generator=g).to(DEV, dtype)[:, :nh]
    kc = torch.randn(1, nkv, M, d, generator=g).to(DEV, dtype)
    vc = torch.randn(1, nkv, M, d, generator=g).to(DEV, dtype)
    mask = _tree_mask(T, S, ctx, g).to(DEV)
    slots = torch.arange(ctx, ctx + T, device=DEV)
    assert T * (nh // nkv) > K.ROWS_ATTN_LIVE_MAX_ROWS  # (wide: the live rule does not take it)
    want = rows_attention(q, kc, vc, mask, d**-0.5, slots, config=KernelConfig())
    cfg = KernelConfig(rows_attn_plan=plan)
    combine = K._attn_combine_kernel
    try:
        if plan[2] == 1:
            K._attn_combine_kernel = None  # a combine launch would fail: one chunk needs none
        got = rows_attention(q, kc, vc, mask, d**-0.5, slots, config=cfg)
    finally:
        K._attn_combine_kernel = combine
    tol = dict(atol=2e-6, rtol=2e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    ref = (
        grouped_attention(
            q.transpose(0, 1)[None].float(), kc[:, :, :S].float(), vc[:, :, :S].float(), mask, d**-0.5, "bmm"
        )
        .transpose(1, 2)
        .reshape(T, nh * d)
    )
    torch.testing.assert_close(got.float(), ref, **tol)
    few = 64 // (nh // nkv) // 4  # few tokens: the live rule's forward, not the plan's
    args = (q[:few], kc, vc, mask[:few], d**-0.5, slots[:few])
    torch.testing.assert_close(rows_attention(*args, config=cfg), rows_attention(*args), atol=0, rtol=0)


def test_rows_attention_skips_unseen_keys_and_checks_shapes():
    """Keys no row sees (the unused cache tail, and a block every row's mask excludes) are never read: NaN there
    changes nothing; with `slots`, keys past the highest slot written are not read either. A mask with the wrong number of rows,
    slots not one per token, or a non-power-of-two head_dim, is a one-line error."""
    g = torch.Generator().manual_seed(4)
    T, nh, nkv, d, M = 6, 4, 2, 16, 256
    q = torch.randn(T, nh, d, generator=g).to(DEV)
    kc, vc = torch.randn(1, nkv, M, d, generator=g).to(DEV), torch.randn(1, nkv, M, d, generator=g).to(DEV)
    mask = _tree_mask(T, 100, 80, g).to(DEV)
    mask[:, 32:64] = False
    want = rows_attention(q, kc, vc, mask, 0.25)
    kc[:, :, 100:], vc[:, :, 100:] = float("nan"), float("nan")
    kc[:, :, 32:64], vc[:, :, 32:64] = float("nan"), float("nan")
    torch.testing.assert_close(rows_attention(q, kc, vc, mask, 0.25), want, atol=0, rtol=0)
    # with the slots written (80..85), keys past slot 85 are not read and count as masked, whatever the mask says;
    # masked keys below them are read (a cache holds finite values) and weigh nothing
    slots = torch.arange(80, 86, device=DEV)
    wide = mask.clone()
    wide[:, 86:100] = True
    kc[:, :, 32:64], vc[:, :, 32:64] = 3e4, -3e4
    kc[:, :, 86:100], vc[:, :, 86:100] = float("nan"), float("nan")
    # (another kernel specialisation: on an H200 fp32 results moved by one ulp)
    torch.testing.assert_close(rows_attention(q, kc, vc, wide, 0.25, slots), want, atol=2e-6, rtol=2e-6)
    with pytest.raises(ValueError, match="rows_attention"):
        rows_attention(q, kc, vc, mask, 0.25, slots[:3])
    with pytest.raises(ValueError, match="rows_attention"):
        rows_attention(q, kc, vc, mask[:5], 0.25)
    with pytest.raises(ValueError, match="rows_attention"):
        rows_attention(
            torch.randn(T, nh, 24, device=DEV),
            torch.randn(1, nkv, M, 24, device=DEV),
            torch.randn(1, nkv, M, 24, device=DEV),
            mask,
            0.25,
        )


@pytest.mark.parametrize(
    "R,V,k,dtype",
    [
        (1, 50, 3, torch.float32),
        (8, 5000, 8, torch.float32),
        (8, 200, 8, torch.bfloat16),
        (3, 2049, 16, torch.float32),
        (2, 16, 16, torch.float32),
    ],
    ids=["one-row", "draft-level", "bf16", "block-edge", "k-equals-V"],
)
def test_topk_logprobs_equals_torch(R, V, k, dtype):
    """log-softmax + top-k in two kernels against torch's: the same columns in the same order, the same log-probs;
    ties go to the lower column (torch leaves their order open, so a tie is checked on its own)."""
    from draftsmith.decode.kernels import topk_logprobs

    g = torch.Generator().manual_seed(V + k)
    x = torch.randn(R, V, generator=g) * 3
    if dtype == torch.bfloat16:  # distinct values a bf16 holds exactly (random bf16 logits tie)
        x = torch.stack([torch.randperm(V, generator=g) * 0.25 for _ in range(R)])
    x = x.to(DEV, dtype)
    v, i = topk_logprobs(x, k)
    rv, ri = torch.topk(torch.log_softmax(x.float(), -1), k, dim=-1)
    assert v.dtype == torch.float32 and i.dtype == torch.int64 and v.shape == (R, k)
    assert torch.equal(i, ri)
    torch.testing.assert_close(v, rv, atol=2e-5, rtol=1e-5)
    v1, i1 = topk_logprobs(x[0], k)  # one row, no batch dimension
    assert v1.shape == (k,) and torch.equal(i1, ri[0])
    tie = torch.zeros(1, V, device=DEV)
    tie[0, [7, 3, V - 1]] = 5.0
    assert topk_logprobs(tie, min(k, 3))[1][0].tolist() == [3, 7, V - 1][: min(k, 3)]
    with pytest.raises(ValueError, match="topk_logprobs"):
        topk_logprobs(x, 17)


def test_runner_kernel_config_reaches_the_launches():
    """The runner's KernelConfig is what its one-token step launches with: another gemv tile (and PDL off) gives
    the torch path's logits, and a tile no kernel can take fails the step (the setting is not ignored)."""
    from draftsmith.decode.kernel_config import KernelConfig

    model = tiny_qwen3().to(DEV)
    n = model.config.num_hidden_layers
    ref, kf = LlamaFamilyForward.from_hf(model, [0, n - 1], 32), LlamaFamilyForward.from_hf(model, [0, n - 1], 32)
    kf.kernels = "triton"
    kf.kernel_config = KernelConfig(block_n=8, block_k=32, pdl=False)
    ids = torch.randint(0, model.config.vocab_size, (6,), generator=torch.Generator().manual_seed(3)).to(DEV)
    pos = torch.arange(6, device=DEV)
    with torch.no_grad():
        for f in (ref, kf):
            f(ids[:5], pos[:5], pos[:5], causal_mask(32, pos[:5], DEV))
        p = pos[5:]
        (lr, _), (lk, _) = (f(ids[5:], p, p, causal_mask(32, p, DEV)) for f in (ref, kf))
        torch.testing.assert_close(lk, lr, atol=1e-4, rtol=1e-4)
        kf.kernel_config = KernelConfig(block_n=3)  # tl.arange needs a power of two
        with pytest.raises(Exception):  # noqa: B017 - triton's error type differs between versions
            kf(ids[5:], p, p, causal_mask(32, p, DEV))


def test_sweep_tiles_keeps_the_fastest_that_ran(monkeypatch):
    """The tile sweep of tune_gemv / tune_rows (`kernels.sweep_tiles`), its timer faked: every tile is launched, one
    row each, the fastest tile that ran is kept for the key, a failing tile never wins, and nothing is kept when none
    ran."""
    from draftsmith.decode import kernels as K

    times = {(16, 64): 3.0, (32, 64): 1.5, (8, 64): None, (64, 64): 2.0}
    launched = []
    monkeypatch.setattr(K, "_time_graph", lambda run, per, reps: (run(), (times[launched[-1]], "boom"))[1])
    table = {}
    rows = K.sweep_tiles(list(times), ("BLOCK_N", "BLOCK_K"), launched.append, 2, 1, table, "k")
    assert launched == list(times) and [r["BLOCK_N"] for r in rows] == [16, 32, 8, 64]
    assert table == {"k": (32, 64)} and rows[1]["us"] == 1.5 and rows[2]["us"] is None
    times = {(8, 64): None}
    assert len(K.sweep_tiles(list(times), ("BLOCK_N", "BLOCK_K"), launched.append, 2, 1, table, "j")) == 1
    assert "j" not in table


def test_gemm_rows_tuned_tiles():
    """The row kernels' tuned table (`KernelConfig.rows_tuned`, filled by `tune_rows` on a GPU) is what a launch
    uses: each tile of the sweep gives the torch result (fp32), and a tile no kernel can take, put in the table for
    this shape, fails the launch (the table is not ignored)."""
    from draftsmith.decode.experimental.gemm_rows import _rows_key, gemm_rows, tune_rows
    from draftsmith.decode.kernel_config import ROWS_CONFIGS, KernelConfig

    g = torch.Generator().manual_seed(11)
    T, K, N = 5, 96, 48
    x = torch.randn(T, K, generator=g).to(DEV)
    w = (torch.randn(N, K, generator=g) * 0.05).to(DEV)
    ref = F.linear(x, w)
    for tile in (ROWS_CONFIGS[0], ROWS_CONFIGS[4], ROWS_CONFIGS[-1]):
        cfg = KernelConfig(rows_tuned={_rows_key(N, K, x.dtype, None, None, None, False): tile})
        torch.testing.assert_close(gemm_rows(x, w, config=cfg), ref, atol=1e-5, rtol=1e-5)
    bad = KernelConfig(rows_tuned={_rows_key(N, K, x.dtype, None, None, None, False): (24, 64, 4)})
    with pytest.raises(Exception):  # noqa: B017 - triton's error type differs between versions
        gemm_rows(x, w, config=bad)
    if DEV == "cpu":
        assert tune_rows([w], T, config=bad) == []  # nothing timed off the GPU


def test_out_buffers_and_the_tuners_chained_io():
    """`gemv(out=)` / `gemm_rows(out=)` write the launch's outputs where given (the same values as a fresh buffer);
    `chained_io`'s x and out share one buffer, so each timed launch reads what the previous one wrote (the tuners'
    dependent chain, `KernelConfig.tune_chained`), for outputs wider and narrower than the inputs; bad buffers fail."""
    from draftsmith.decode import kernels as K
    from draftsmith.decode.experimental.gemm_rows import gemm_rows

    g = torch.Generator().manual_seed(5)
    for T, Kd, N in ((1, 64, 96), (1, 96, 32), (5, 64, 96), (5, 96, 32)):
        w = (torch.randn(N, Kd, generator=g) * 0.05).to(DEV)
        nw = (torch.rand(Kd, generator=g) + 0.5).to(DEV)
        x = torch.randn(T, Kd, generator=g).to(DEV)
        fn = gemv if T == 1 else gemm_rows
        ref = fn(x, w, nw)
        out = torch.full((T, N), float("nan"), device=DEV)
        assert fn(x, w, nw, out=out).data_ptr() == out.data_ptr()
        torch.testing.assert_close(out, ref, atol=0, rtol=0)
        xc, oc = K.chained_io(T, Kd, N, x)
        assert xc.shape == (T, Kd) and oc.shape == (T, N) and xc.data_ptr() == oc.data_ptr()
        assert xc.untyped_storage().data_ptr() == oc.untyped_storage().data_ptr()
        x0 = xc.clone()
        fn(xc, w, nw, out=oc)
        m = T * min(N, Kd)  # the outputs landed on the inputs the next launch reads
        assert not torch.equal(xc.flatten()[:m], x0.flatten()[:m])
        with pytest.raises(ValueError, match="out"):
            fn(x, w, nw, out=torch.empty(T, N + 1, device=DEV))
    with pytest.raises(ValueError, match="out"):
        gemv(x[:1], w, argmax_map=torch.arange(N, device=DEV), out=torch.empty(1, N, device=DEV))


@pytest.mark.parametrize("plan", [None, (16, 32, 1, 4, 2)], ids=["width-rule", "attn-plan"])
def test_verify_forward_through_rows_attention_equals_torch_path(plan, monkeypatch):
    """kernels="triton" without the T-row matmuls: a tree-verify forward (T=7) takes only rows_attention (torch
    matmuls, norms and RoPE) — logits, aux and both caches equal the torch path's; prefill-length forwards past
    ROWS_ATTN_MAX keep torch's attention. attn-plan: `KernelConfig.rows_attn_plan` (one chunk over the live keys;
    the few-row live rule off so the plan takes the forward; no combine launch, so the plan was used)."""
    from draftsmith.decode import kernels as K

    model = tiny_qwen3().to(DEV)
    n = model.config.num_hidden_layers
    ref, kf = LlamaFamilyForward.from_hf(model, [0, n - 1], 48), LlamaFamilyForward.from_hf(model, [0, n - 1], 48)
    kf.kernels = "triton"
    kf.kernel_config = KernelConfig() if plan is None else KernelConfig(rows_attn_live=False, rows_attn_plan=plan)
    assert kf.triton_ops_for(7) == frozenset({"attn", "rope"}) and not kf.triton_step(7) and kf.triton_step(1)
    assert kf.triton_ops_for(K.ROWS_ATTN_MAX + 1) == frozenset()
    if plan is not None:
        monkeypatch.setattr(K, "_attn_combine_kernel", None)  # a combine launch would fail: one chunk needs none
    ids = torch.randint(0, model.config.vocab_size, (16,), generator=torch.Generator().manual_seed(8)).to(DEV)
    pos = torch.arange(16, device=DEV)
    tree = _tree_mask(7, 48, 9, torch.Generator().manual_seed(2)).to(DEV)
    with torch.no_grad():
        for f in (ref, kf):
            f(ids[:9], pos[:9], pos[:9], causal_mask(48, pos[:9], DEV))
        depth = tree[:, 9:16].sum(-1) - 1
        (lr, ar_), (lk, ak) = (f(ids[9:], 9 + depth, pos[9:], tree) for f in (ref, kf))
    torch.testing.assert_close(lk, lr, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ak, ar_, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kf.k_cache, ref.k_cache, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T", [1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "norm,bias,res,glu",
    [(False, False, False, False), (True, True, False, False), (False, True, True, False), (True, True, False, True)],
    ids=["plain", "norm-bias", "bias-res", "norm-glu"],
)
def test_gemm_rows_equals_torch(T, dtype, norm, bias, res, glu):
    """T rows (a verify's tokens) as one tl.dot tile: fp32 against F.linear (+ folds); bf16 against the one-row
    gemv row by row (the same roundings: gemv is checked against torch above), since the interpreter's
    truncating fp32 -> bf16 makes a bf16 torch reference differ by a few ulp after three roundings."""
    from draftsmith.decode.experimental.gemm_rows import gemm_rows

    g = torch.Generator().manual_seed(T)
    K, N = 300, 70
    x = torch.randn(T, K, generator=g).to(DEV, dtype)
    w = (torch.randn(2 * N, K, generator=g) * 0.05).to(DEV, dtype)
    nw = (torch.rand(K, generator=g) + 0.5).to(DEV, dtype) if norm else None
    b = torch.randn(2 * N, generator=g).to(DEV, dtype) if bias else None
    n_out = N if glu else 2 * N
    r = torch.randn(T, n_out, generator=g).to(DEV, dtype) if res else None
    y = gemm_rows(x, w, nw, 1e-5, bias=b, residual=r, glu=glu)
    assert y.shape == (T, n_out) and y.dtype == dtype
    if dtype == torch.float32:
        ref = F.linear(hf_rms_norm(x, nw, 1e-5) if norm else x, w, b)
        if glu:
            gate, up = ref.chunk(2, -1)
            ref = F.silu(gate) * up
        if res:
            ref = r + ref
        torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    else:
        rows = [
            gemv(x[t : t + 1], w, nw, 1e-5, bias=b, residual=None if r is None else r[t : t + 1], glu=glu)
            for t in range(T)
        ]
        torch.testing.assert_close(y.float(), torch.cat(rows).float(), atol=1e-2, rtol=1e-2)
    # one K block (a small target's wide tile: the whole weight tile is the prefetched block) sums the same products
    # (in fp32 a 64-row tile with both gate and up blocks of 512 would ask a GPU for 256 KB of shared memory)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    if DEV == "cpu" or dtype != torch.float32 or T < 33:
        y1 = gemm_rows(x, w, nw, 1e-5, bias=b, residual=r, glu=glu, block_k=512)
        torch.testing.assert_close(y1.float(), y.float(), atol=tol, rtol=tol)
    if T == 5 or (T == 33 and glu):  # (interpreted, this kernel is slow: the cases that cover its branches)
        # a gemv-like tile (fewer than 16 outputs: the CUDA-core kernel, rows in blocks of 8, K in three blocks)
        y2 = gemm_rows(x, w, nw, 1e-5, bias=b, residual=r, glu=glu, block_n=8, block_k=128)
        torch.testing.assert_close(y2.float(), y.float(), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="gemm_rows"):
        gemm_rows(torch.randn(65, K, device=DEV, dtype=dtype), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_rows_k_chains_equals_torch(dtype):
    """K as independent MMA chains (`gemm_rows(k_chains=)`, `KernelConfig.rows_k_chains`: one batched dot over all
    of K, its blocks summed once): fp32 against F.linear with each fold (norm, bias, residual, silu(gate) * up),
    bf16 against the K loop's launch of the same tile (the products summed in another order); blocks past K (8
    chains of 64 over 300 inputs) add nothing. The config's rule, and chain counts that cannot cover K, fail."""
    from draftsmith.decode.experimental import gemm_rows as G

    g = torch.Generator().manual_seed(17)
    T, K, N = 5, 300, 40
    x = torch.randn(T, K, generator=g).to(DEV, dtype)
    w = (torch.randn(2 * N, K, generator=g) * 0.05).to(DEV, dtype)
    nw = (torch.rand(K, generator=g) + 0.5).to(DEV, dtype)
    b = torch.randn(2 * N, generator=g).to(DEV, dtype)
    r = torch.randn(T, 2 * N, generator=g).to(DEV, dtype)
    for norm, bias, res, glu, chains, bk in ((True, True, False, False, 8, 64), (False, True, True, False, 4, 128),
                                             (True, False, False, True, 4, 128)):  # fmt: skip
        kw = dict(bias=b if bias else None, residual=r if res else None, glu=glu, block_n=16, block_k=bk)
        y = G.gemm_rows(x, w, nw if norm else None, 1e-5, **kw, k_chains=chains)
        if dtype == torch.float32:
            ref = F.linear(hf_rms_norm(x, nw, 1e-5) if norm else x, w, b if bias else None)
            if glu:
                gate, up = ref.chunk(2, -1)
                ref = F.silu(gate) * up
            torch.testing.assert_close(y, ref + r if res else ref, atol=1e-5, rtol=1e-5)
        else:
            y1 = G.gemm_rows(x, w, nw if norm else None, 1e-5, **kw, k_chains=1)
            torch.testing.assert_close(y.float(), y1.float(), atol=1e-2, rtol=1e-2)
    on, off = KernelConfig(), KernelConfig(rows_k_chains=False)
    rule = [G._k_chains(300, 16, 16, bk, False, 2, None, on) for bk in (64, 128, 256, 512, 32)]
    assert rule == [8, 4, 2, 1, 1]  # 32: 10 blocks
    assert G._k_chains(300, 16, 16, 64, False, 2, None, off) == 1
    assert G._k_chains(4096, 64, 32, 512, False, 2, None, on) == 1  # 768 KB of x and weight blocks: the K loop
    for bad in (3, 2, 16):  # not a power of two; 2 x 64 < 300; past ROWS_MAX_CHAINS
        with pytest.raises(ValueError, match="k_chains"):
            G.gemm_rows(x, w, k_chains=bad, block_n=16, block_k=64)


@pytest.mark.parametrize("split,dtype", [(2, torch.float32), (3, torch.bfloat16)], ids=["fp32-split2", "bf16-split3"])
@pytest.mark.parametrize("glu", [False, True], ids=["norm-bias-res", "norm-glu"])
def test_gemm_rows_split_k_equals_torch(split, dtype, glu):
    """Split-K (K in ranges over programs, the last program of an output tile adding the fp32 partials in range
    order): fp32 against F.linear with the folds; bf16 against the unsplit launch of the same tile (the same
    roundings, the products summed in another order), also with the weights as the MMA's M side (swap). A second
    launch gives the same outputs (every tile's
    arrival counter is back at zero), and splits that K's blocks cannot fill are launched as fewer."""
    from draftsmith.decode.experimental import gemm_rows as G

    g = torch.Generator().manual_seed(split)
    T, K, N = 33, 300, 40
    x = torch.randn(T, K, generator=g).to(DEV, dtype)
    w = (torch.randn(2 * N, K, generator=g) * 0.05).to(DEV, dtype)
    nw = (torch.rand(K, generator=g) + 0.5).to(DEV, dtype)
    b = torch.randn(2 * N, generator=g).to(DEV, dtype)
    n_out = N if glu else 2 * N
    r = None if glu else torch.randn(T, n_out, generator=g).to(DEV, dtype)
    kw = dict(bias=b, residual=r, glu=glu, block_n=16, block_k=64)
    y = G.gemm_rows(x, w, nw, 1e-5, **kw, split=split)
    assert y.shape == (T, n_out) and y.dtype == dtype
    if dtype == torch.float32:
        ref = F.linear(hf_rms_norm(x, nw, 1e-5), w, b)
        if glu:
            gate, up = ref.chunk(2, -1)
            ref = F.silu(gate) * up
        else:
            ref = r + ref
        torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(y.float(), G.gemm_rows(x, w, nw, 1e-5, **kw, split=1).float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(G.gemm_rows(x, w, nw, 1e-5, **kw, split=split), y)
    # the weights as the MMA's M side (swap) and a deeper pipeline: the same sums
    ys = G.gemm_rows(x, w, nw, 1e-5, **kw, split=split, swap=True, num_stages=4)
    torch.testing.assert_close(ys.float(), y.float(), atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=2e-2)
    assert not G._rows_counters(x.device).any()
    assert G._splits(K, 64, 5) and not G._splits(K, 64, 4)  # 5 blocks: 4 ranges would be 2+2+1, i.e. 3
    torch.testing.assert_close(G.gemm_rows(x, w, nw, 1e-5, **kw, split=4).float(), y.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("swap", [False, True])
def test_gemm_rows_tma_equals_torch(swap):
    """The TMA-fed row kernel (`gemm_rows_tma`, for bench/rows_gemm.py): rows past T and inputs past K read as zeros
    from the descriptors, split-K and the residual / glu epilogues as gemm_rows — fp32 against F.linear."""
    pytest.importorskip("triton.tools.tensor_descriptor")  # (triton >= 3.4)
    from draftsmith.decode.experimental.gemm_rows import gemm_rows_tma

    g = torch.Generator().manual_seed(4)
    T, K, N = 33, 200, 40
    x = torch.randn(T, K, generator=g).to(DEV)
    w = (torch.randn(2 * N, K, generator=g) * 0.05).to(DEV)
    b = torch.randn(2 * N, generator=g).to(DEV)
    r = torch.randn(T, 2 * N, generator=g).to(DEV)
    for split in (1, 3):
        y = gemm_rows_tma(x, w, bias=b, residual=r, block_n=16, block_k=32, split=split, swap=swap, num_stages=2)
        torch.testing.assert_close(y, F.linear(x, w, b) + r, atol=1e-5, rtol=1e-5)
    gate, up = F.linear(x, w, b).chunk(2, -1)
    y = gemm_rows_tma(x, w, bias=b, glu=True, block_n=16, block_k=64, split=2, swap=swap)
    torch.testing.assert_close(y, F.silu(gate) * up, atol=1e-5, rtol=1e-5)


def test_gemm_rows_row_sums_of_squares():
    """want_ssq: a producer's per-tile sums of squares of its stored rows add up to each row's sum of squares; a
    norm-folding consumer given them (row_ssq) equals one that reads its rows whole, split or not, and one K block
    (the rows' norm from the same load) ignores them."""
    from draftsmith.decode.experimental.gemm_rows import gemm_rows

    g = torch.Generator().manual_seed(3)
    T, H, N = 9, 96, 40
    o = torch.randn(T, H, generator=g).to(DEV)
    wo = (torch.randn(H, H, generator=g) * 0.1).to(DEV)
    h0 = torch.randn(T, H, generator=g).to(DEV)
    h, ssq = gemm_rows(o, wo, residual=h0, block_n=16, block_k=32, split=2, want_ssq=True)
    assert ssq.shape == (H // 16, T) and ssq.dtype == torch.float32
    torch.testing.assert_close(ssq.sum(0), h.pow(2).sum(-1), atol=1e-4, rtol=1e-5)
    nw = (torch.rand(H, generator=g) + 0.5).to(DEV)
    w = (torch.randn(N, H, generator=g) * 0.1).to(DEV)
    ref = F.linear(hf_rms_norm(h, nw, 1e-5), w)
    for split in (1, 3):
        y = gemm_rows(h, w, nw, 1e-5, block_n=16, block_k=32, split=split, row_ssq=ssq)
        torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    wrong = torch.ones_like(ssq)  # not this x's: a one-block tile must not read them
    torch.testing.assert_close(gemm_rows(h, w, nw, 1e-5, block_n=16, block_k=128, row_ssq=wrong), ref)
    with pytest.raises(ValueError, match="row_ssq"):
        gemm_rows(h, w, nw, 1e-5, row_ssq=ssq[:, :4])


def test_verify_forward_through_split_k_row_kernels_equals_torch_path(monkeypatch):
    """The T-row step with split-K tiles and the norms' sums of squares handed from producer to consumer (forced on
    for a tiny hidden size): the tree-verify forward equals the torch path, and the q/k/v of layers past the first,
    every gate/up and the prefill's lm_head took the producer's sums."""
    from draftsmith.decode.experimental import gemm_rows as G
    from draftsmith.decode.kernel_config import KernelConfig

    calls = []
    real = G.gemm_rows

    def spy(*a, **kw):
        calls.append(kw.get("row_ssq") is not None)
        return real(*a, **kw)

    monkeypatch.setattr(G, "SSQ_MIN_K", 1)
    monkeypatch.setattr(G, "gemm_rows", spy)

    def configure(kf):
        kf.kernel_config = KernelConfig(rows_block_n=16, rows_block_k=32, rows_split=2)
        kf.kernels, kf.triton_max_rows = "triton", 64
        assert kf.plan(7).ssq_on

    assert_tree_verify_matches_torch(configure, DEV)
    # per forward: layers x (qkv, o, gate/up, down) + lm_head; sums given to all norms but the first layer's q/k/v
    # and the verify's lm_head over selected rows
    n_layers = (len(calls) - 2) // 8
    per = [True] * (4 * n_layers + 1)
    for i in range(n_layers):
        per[4 * i + 1] = per[4 * i + 3] = False  # o and down produce
    per[0] = False
    prefill, verify = calls[: len(per)], calls[len(per) :]
    assert prefill == per and verify == per[:-1] + [False]


def test_verify_forward_through_row_kernels_equals_torch_path():
    """A tree-verify-shaped forward (T=7 tokens, a non-causal mask) with triton_max_rows on: gemm_rows for the
    matmuls, rope_and_cache per token, rows_attention — logits, aux and both caches equal the torch path's."""

    def configure(kf):
        kf.kernels, kf.triton_max_rows = "triton", 64
        assert kf.triton_ops_for(7) == frozenset(TRITON_OPS) and kf.triton_ops_for(65) == frozenset({"attn", "rope"})
        assert kf.triton_ops_for(257) == frozenset() and kf.triton_step(7) and not kf.triton_step(65)

    assert_tree_verify_matches_torch(configure, DEV)


def test_gemv_rejects_a_mismatched_weight():
    with pytest.raises(ValueError, match="gemv"):
        gemv(torch.randn(1, 8, device=DEV), torch.randn(4, 9, device=DEV))


@pytest.mark.parametrize(
    "name,model",
    [("qwen3", tiny_qwen3()), ("qwen2-bias", tiny_llama(vocab_size=50, model_type="qwen2"))],
    ids=["qwen3", "qwen2-bias"],
)
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
        for f in (ref_fwd, k_fwd):  # the same prefill up to the attention kernel (rows_attention in k_fwd)
            f(ids[:8], pos[:8], pos[:8], causal_mask(64, pos[:8], DEV))
        outs = [f(ids[8:], pos[8:], pos[8:], causal_mask(64, pos[8:], DEV)) for f in (ref_fwd, k_fwd)]
    (lr, ar), (lk, ak) = outs
    torch.testing.assert_close(lk, lr, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ak, ar, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k_fwd.k_cache, ref_fwd.k_cache, atol=1e-5, rtol=1e-5)


def _assert_rows_rope_fold(model):
    """A 7-token verify with a tree mask after a 9-token prefill, both through the row kernels: rope_fold on equals
    off (logits, aux, caches; fp32, the pairs' tile sums in another order)."""
    n = model.config.num_hidden_layers
    fwds = [LlamaFamilyForward.from_hf(model, [0, n - 1], 48) for _ in range(2)]
    for f in fwds:
        f.kernels, f.triton_max_rows = "triton", 64
    fwds[1].kernel_config.rope_fold = True
    ids = torch.randint(0, model.config.vocab_size, (16,), generator=torch.Generator().manual_seed(6)).to(DEV)
    pos = torch.arange(16, device=DEV)
    tree = _tree_mask(7, 48, 9, torch.Generator().manual_seed(2)).to(DEV)
    with torch.no_grad():
        for f in fwds:
            f(ids[:9], pos[:9], pos[:9], causal_mask(48, pos[:9], DEV))
        depth = tree[:, 9:16].sum(-1) - 1
        (l0, a0), (l1, a1) = (f(ids[9:], 9 + depth, pos[9:], tree) for f in fwds)
    torch.testing.assert_close(l1, l0, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a1, a0, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fwds[1].k_cache, fwds[0].k_cache, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fwds[1].v_cache, fwds[0].v_cache, atol=1e-4, rtol=1e-4)


def test_rope_fold_rows_off_folds_the_one_row_step_only(monkeypatch):
    """`KernelConfig.rope_fold_rows` off: a verify through the row kernels keeps rope_and_cache (its q/k/v launch
    takes no rope), the one-token step still folds it into the gemv — and both give the unfolded forward's logits."""
    from draftsmith.decode import kernels as K
    from draftsmith.decode.experimental import gemm_rows as GR

    model = tiny_llama(vocab_size=50).to(DEV)
    n = model.config.num_hidden_layers
    fwds = [LlamaFamilyForward.from_hf(model, [0, n - 1], 48) for _ in range(2)]
    for f in fwds:
        f.kernels, f.triton_max_rows = "triton", 64
    fwds[1].kernel_config.rope_fold, fwds[1].kernel_config.rope_fold_rows = True, False
    calls = {"rows": 0, "gemv": 0}
    rows_rope, gemv_rope = GR._gemm_rows_rope, K._gemv_rope

    def count(kind, fn):
        def wrapped(*a, **k):
            calls[kind] += 1
            return fn(*a, **k)

        return wrapped

    monkeypatch.setattr(GR, "_gemm_rows_rope", count("rows", rows_rope))
    monkeypatch.setattr(K, "_gemv_rope", count("gemv", gemv_rope))
    ids = torch.randint(0, model.config.vocab_size, (10,), generator=torch.Generator().manual_seed(3)).to(DEV)
    pos = torch.arange(10, device=DEV)
    with torch.no_grad():
        outs = []
        for f in fwds:
            a = f(ids[:9], pos[:9], pos[:9], causal_mask(48, pos[:9], DEV))[0]
            b = f(ids[9:], pos[9:], pos[9:], causal_mask(48, pos[9:], DEV))[0]
            outs.append((a, b))
    assert calls == {"rows": 0, "gemv": n}
    for x, y in zip(outs[0], outs[1]):
        torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "name,model",
    [("llama", tiny_llama(vocab_size=50)), ("qwen2-bias", tiny_llama(vocab_size=50, model_type="qwen2"))],
    ids=["llama", "qwen2-bias"],
)
def test_rope_fold_equals_separate_rope_kernel(name, model):
    """`KernelConfig.rope_fold`: the one-token step's q/k/v gemv rotates q and k and writes both caches itself
    (`gemv(rope=)`, one launch a layer fewer) — logits, aux states and both caches bit-identical to the gemv +
    rope_and_cache pair, over three steps; a q/k-normed model (Qwen3) keeps the pair (nothing to fold into)."""
    from draftsmith.decode import kernels as K

    model = model.to(DEV)
    n = model.config.num_hidden_layers
    fwds = [LlamaFamilyForward.from_hf(model, [0, n - 1], 64) for _ in range(2)]
    for f in fwds:
        f.kernels = "triton"
    fwds[1].kernel_config.rope_fold = True
    assert fwds[1].plan(1)._can_fold_rope
    ids = torch.randint(0, model.config.vocab_size, (11,), generator=torch.Generator().manual_seed(3)).to(DEV)
    pos = torch.arange(11, device=DEV)
    with torch.no_grad():
        for f in fwds:
            f(ids[:8], pos[:8], pos[:8], causal_mask(64, pos[:8], DEV))
        for t in range(8, 11):
            (l0, a0), (l1, a1) = (f(ids[t : t + 1], pos[t : t + 1], pos[t : t + 1], causal_mask(64, pos[t : t + 1], DEV))
                                  for f in fwds)  # fmt: skip
            assert torch.equal(l0, l1) and torch.equal(a0, a1)
    assert torch.equal(fwds[0].k_cache, fwds[1].k_cache) and torch.equal(fwds[0].v_cache, fwds[1].v_cache)
    if name == "llama":  # the T-row step too: a tree-verify-shaped forward through gemm_rows(rope=)
        _assert_rows_rope_fold(model)
    q3 = LlamaFamilyForward.from_hf(tiny_qwen3().to(DEV), [0], 64)
    q3.kernels = "triton"
    assert not q3.plan(1)._can_fold_rope
    with pytest.raises(ValueError, match="rope"):  # a weight that is not a fused q/k/v of these heads
        f = fwds[1]
        K.gemv(torch.randn(1, f.hidden_size, device=DEV), f.layers[0].o, rope=(pos[:1], pos[:1], f.cos, f.sin,
               f.k_layers[0], f.v_layers[0], f.n_heads, f.n_kv))  # fmt: skip


def _gelu_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(2)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        hidden_act="gelu",
        max_position_embeddings=128,
        initializer_range=0.3,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


@pytest.mark.parametrize("leave_out", [None, *TRITON_OPS])
@pytest.mark.parametrize("name", ["qwen3", "llama-gelu-mqa"])
def test_one_token_step_routes_each_op(name, leave_out):
    """Every mix of Triton and torch ops (each op left to torch in turn) gives the torch path's step: logits, aux
    and both caches. Covers q/k norm (Qwen3), GQA and MQA, and a non-silu MLP (the activation stays a torch op)."""
    model = (tiny_qwen3() if name == "qwen3" else _gelu_llama()).to(DEV)
    n = model.config.num_hidden_layers
    ref, kf = LlamaFamilyForward.from_hf(model, [0, n - 1], 48), LlamaFamilyForward.from_hf(model, [0, n - 1], 48)
    kf.kernels = "triton"
    kf.triton_ops = set(TRITON_OPS) - {leave_out}
    assert kf.triton_ops_for(1) == frozenset(kf.triton_ops)
    assert kf.triton_ops_for(2) == (frozenset({"attn", "rope"} - {leave_out}) if leave_out != "attn" else frozenset())
    ids = torch.randint(0, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(5)).to(DEV)
    pos = torch.arange(12, device=DEV)
    with torch.no_grad():
        for f in (ref, kf):
            f(ids[:9], pos[:9], pos[:9], causal_mask(48, pos[:9], DEV))
        for t in range(9, 12):  # three one-token steps: each reads the cache rows the previous ones wrote
            p = pos[t : t + 1]
            (lr, ar), (lk, ak) = (f(ids[t : t + 1], p, p, causal_mask(48, p, DEV)) for f in (ref, kf))
            torch.testing.assert_close(lk, lr, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(ak, ar, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kf.k_cache, ref.k_cache, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kf.v_cache, ref.v_cache, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_embed_fold_equals_norms_and_cat(dtype):
    """`embed`: the qkv of an EAGLE-3 drafter's first layer over cat(rmsnorm(E[id]) * w1, rmsnorm(x) * w2), the gather,
    both norms and the cat in the gemv's prologue, against torch doing them first (and with bias); the gemv takes
    one token and says so for more (a verify's rows are gemm_rows')."""
    g = torch.Generator().manual_seed(3)
    V, H, N = 50, 96, 40
    table = torch.randn(V, H, generator=g).to(DEV, dtype)
    ids = torch.randint(0, V, (1,), generator=g).to(DEV)
    x = (torch.randn(1, H, generator=g) * 3).to(DEV, dtype)
    w = (torch.randn(N, 2 * H, generator=g) * 0.05).to(DEV, dtype)
    b = torch.randn(N, generator=g).to(DEV, dtype)
    w1, w2 = ((torch.rand(H, generator=g) + 0.5).to(DEV, dtype) for _ in range(2))
    y = gemv(x, w, w1, 1e-5, bias=b, embed=(table, ids), norm_weight2=w2, block_n=8, block_k=64, prefetch=1)
    ref = F.linear(torch.cat((hf_rms_norm(table[ids], w1, 1e-5), hf_rms_norm(x, w2, 1e-5)), -1), w, b)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert y.shape == (1, N)
    torch.testing.assert_close(y.float(), ref.float(), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="embed needs"):
        gemv(x, w, None, 1e-5, embed=(table, ids), norm_weight2=w2)  # both norms are required
    with pytest.raises(ValueError, match="one token, not 3 rows"):
        gemv(torch.randn(3, 2 * H, device=DEV, dtype=dtype), w)
