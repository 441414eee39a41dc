"""experimental.cluster_gemm on the CPU: the shipped PTX holds every variant the launcher names (a variant added to
the .cu but not rebuilt, or named in VARIANTS but not instantiated, fails here, not on a GPU), the plans, and the
route's refusals. The kernel's numerics are GPU tests (tests/gpu/test_decode_gpu.py: test_cluster_gemm_*)."""

from __future__ import annotations

import os
import re

import pytest
import torch

if not torch.cuda.is_available():  # the fused plan's attention and RoPE kernels run in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from draftsmith.decode.experimental import cluster_gemm as cg


def test_shipped_ptx_has_every_variant_at_an_assemblable_version():
    ptx = cg.PTX.read_text()
    entries = set(re.findall(r"\.entry ((?:cluster_gemm|layer_qkv_attn_o)_\w+)\(", ptx))
    assert entries == {f"cluster_gemm_{v}" for v in cg.VARIANTS} | {f"layer_qkv_attn_o_{v}" for v in cg.LAYER}
    assert re.search(r"^\.version 8\.7$", ptx, re.M) and re.search(r"^\.target sm_90a$", ptx, re.M)
    src = (cg.PTX.parent / "cluster_gemm.cu").read_text()
    for v, (bn, wg, ntok, stages) in cg.VARIANTS.items():  # the table agrees with the instantiations
        if v in cg.LAST:
            assert re.search(rf"LASTCTA_GEMM\({bn}, {wg}, {ntok}, {stages}, {v}, \d\)", src), v
        elif v in cg.ROPE:
            assert re.search(rf"ROPE_GEMM\({bn}, {wg}, {ntok}, {stages}, {v}, \d\)", src), v
        else:
            assert re.search(rf"CLUSTER_GEMM\({bn}, {wg}, {ntok}, {stages}, \w+, \w+, {v}, \d\)", src), v
    for v in cg.LAYER:  # the layer kernel on the variant's tile, at the stages its launch sizes shared memory by
        bn, wg, ntok, _ = cg.VARIANTS[v]
        assert re.search(rf"LAYER_KERNEL\({bn}, {wg}, {ntok}, {cg.LAYER_STAGES[v]}, {v}, \d\)", src), v
        assert cg.smem_bytes(v, layer=True) <= cg.smem_bytes(v)


def test_argument_structs_match_the_kernel_source():
    """The by-value structs the launcher builds (ctypes) have the .cu structs' fields, in order, with matching types:
    a field added on one side only would shift every later argument on the GPU, silently."""
    import ctypes

    src = (cg.PTX.parent / "cluster_gemm.cu").read_text()
    kinds = {ctypes.c_void_p: "ptr", ctypes.c_longlong: "long long", ctypes.c_int: "int", ctypes.c_float: "float"}
    for name, py in (("Epi", cg._Epi), ("RopeArgs", cg._RopeArgs), ("LayerArgs", cg._LayerArgs)):
        body = re.search(rf"struct (?:alignas\(\d+\) )?{name} \{{(.*?)\n\}};", src, re.S).group(1)
        fields = []
        for line in body.splitlines():
            m = re.match(r"\s*(?:const )?([\w ]+?)\s*(\*?)\s*(\w+);", line.split("//")[0])
            if m:
                fields.append((m.group(3), "ptr" if m.group(2) else m.group(1).strip()))
        assert fields == [(f, kinds[t]) for f, t in py._fields_], name


def test_shared_memory_fits_and_half_variants_pair_up():
    static = 1024  # the folds' row scales and sums (ptxas -v: 1024 bytes of static shared memory)
    for v in cg.VARIANTS:
        assert cg.smem_bytes(v) + static <= 227 * 1024, v
        if v.endswith("_half"):
            assert 2 * (cg.smem_bytes(v) + static) <= 228 * 1024, v  # two CTAs an SM (the SM keeps 1 KiB a CTA)


def test_plans_measured_first_then_one_wave():
    assert cg.plan_for(4096, 4096) == cg.PLANS[(4096, 4096)]
    for n, k in [(320, 192), (1024, 192), (6144, 4096), (3072, 1024), (11008, 4096)]:
        v, s = cg.plan_for(n, k, sms=132)
        bn = cg.VARIANTS[v][0]
        assert n % bn == 0 and 1 <= s <= min(cg.SPLIT_MAX, k // cg.BK)
        if (n, k) not in cg.PLANS:
            assert (n // bn) * s <= 132 or s == 1  # one wave when a split can give one


def test_supports_refuses_what_the_kernel_cannot_take():
    x = torch.zeros(49, 256, dtype=torch.bfloat16)
    w = torch.zeros(512, 256, dtype=torch.bfloat16)
    assert not cg.supports(x, w, "bn128")  # CPU tensors
    assert not cg.supports(x.float(), w.float(), "bn128")


def test_fused_plan_forward_on_the_cpu_matches_fp32_and_compiles(one_thread):
    """KernelConfig.cluster_gemm_fused's plumbing (ops.TritonAttnOps over FusedLayer: the producers hand h * norm weight
    and the sums of squares to the next matmul through the plan), with the custom ops' torch fallbacks (no kernel on
    the CPU): a bf16 tree-free verify as close to the fp32 model as the torch plan's, and torch.compile traces it whole
    (fullgraph) to the same logits."""
    pytest.importorskip("triton")
    from decode_helpers import tiny_llama

    from draftsmith.decode import ops as O
    from draftsmith.decode.kernel_config import KernelConfig
    from draftsmith.decode.llama import LlamaFamilyForward

    def fwd(model, **kc):
        f = LlamaFamilyForward.from_hf(model, [0, 1, 2], 48)
        f.set_cpu_transposed(False)
        f.kernels = "triton"
        f.kernel_config = KernelConfig(**kc)
        return f

    m32 = tiny_llama(vocab_size=64, hidden=64, layers=3, init=0.1)
    m16 = tiny_llama(vocab_size=64, hidden=64, layers=3, init=0.1).to(torch.bfloat16)
    torch.manual_seed(0)
    T = 7
    ids, pos = torch.randint(0, 64, (T,)), torch.arange(T)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    r32 = fwd(m32).forward(ids, pos, pos, mask)[0]
    ref = fwd(m16).forward(ids, pos, pos, mask)[0]
    f = fwd(m16, cluster_gemm=True, cluster_gemm_fused=True)
    plan = f.plan(T)
    assert type(plan) is O.TritonAttnOps and all(isinstance(L, O.FusedLayer) for L in plan.layers)
    assert [L.first for L in plan.layers] == [True, False, False] and [L.keep for L in plan.layers] == [1, 1, 0]
    got, aux = f.forward(ids, pos, pos, mask)
    assert aux.shape == (T, 3 * 64)

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert rel(got, r32) <= 1.5 * rel(ref, r32) + 1e-3, (rel(got, r32), rel(ref, r32))
    assert (got.argmax(-1) == r32.argmax(-1)).float().mean() >= 0.8
    compiled = torch.compile(f.forward, fullgraph=True)(ids, pos, pos, mask)[0]
    assert rel(compiled, got) < 2e-2
    # cluster_gemm_rope: q/k/v's op also rotates and writes the caches (torch's `rope_rows` here, rounded as
    # rope_and_cache rounds on a GPU — Triton's interpreter truncates to bf16 instead, so close, not equal: the GPU
    # test test_cluster_gemm_rope_equals_rope_and_cache checks equality): v exactly, k and the logits close
    fr = fwd(m16, cluster_gemm=True, cluster_gemm_fused=True, cluster_gemm_rope=True)
    assert fr.plan(T).rope_cache == fr.plan(T)._qkv_rope_fused
    got_r = fr.forward(ids, pos, pos, mask)[0]
    assert rel(got_r, got) < 2e-2 and rel(got_r, r32) <= 1.5 * rel(ref, r32) + 1e-3
    assert torch.equal(fr.v_cache[0, 0, ..., :T, :], f.v_cache[0, 0, ..., :T, :])  # layer 0: same inputs
    assert rel(fr.k_cache[..., :T, :].float(), f.k_cache[..., :T, :].float()) < 2e-2
    compiled_r = torch.compile(fr.forward, fullgraph=True)(ids, pos, pos, mask)[0]
    assert rel(compiled_r, got_r) < 2e-2
    # cluster_gemm_layer: q/k/v, the attention and o as one op (here its fallback: the three ops the plan runs without
    # the flag), the attention and o handed on by attention() and o_proj(); the same logits, traced fullgraph
    fl = fwd(m16, cluster_gemm=True, cluster_gemm_fused=True, cluster_gemm_rope=True, cluster_gemm_layer=True)
    pl = fl.plan(T)
    assert pl.rope_cache == pl._layer_fused and pl.attention == pl._attn_handed and pl.o_proj == pl._o_handed
    got_l = fl.forward(ids, pos, pos, mask)[0]
    assert torch.equal(got_l, got_r)
    assert torch.equal(fl.k_cache[..., :T, :], fr.k_cache[..., :T, :])
    compiled_l = torch.compile(fl.forward, fullgraph=True)(ids, pos, pos, mask)[0]
    assert rel(compiled_l, got_l) < 2e-2


def test_fused_plan_forward_wider_than_the_kernel_rows(one_thread):
    """A forward of more rows than the kernel takes (a prefill chunk: past cluster_gemm.ROWS_MAX) goes through the
    custom ops' torch fallbacks, whose producers hand the next norm the sums of squares of all their rows (a
    fixed-width hand-off broke pycode-small's prefill on a GPU, 2026-12-04): the logits as the torch plan's."""
    pytest.importorskip("triton")
    from decode_helpers import tiny_llama

    from draftsmith.decode.experimental import cluster_gemm as cg
    from draftsmith.decode.kernel_config import KernelConfig
    from draftsmith.decode.llama import LlamaFamilyForward

    T = cg.ROWS_MAX + 9
    m16 = tiny_llama(vocab_size=64, hidden=64, layers=2, init=0.1).to(torch.bfloat16)

    def run(**kc):
        f = LlamaFamilyForward.from_hf(m16, [0, 1, 1], T + 8)
        f.set_cpu_transposed(False)
        f.kernels = "triton"
        f.kernel_config = KernelConfig(**kc)
        torch.manual_seed(0)
        ids, pos = torch.randint(0, 64, (T,)), torch.arange(T)
        return f.forward(ids, pos, pos, torch.ones(T, T + 8, dtype=torch.bool).tril())[0]

    ref = run()
    got = run(cluster_gemm=True, cluster_gemm_fused=True, cluster_gemm_rope=True)
    assert torch.equal(
        run(cluster_gemm=True, cluster_gemm_fused=True, cluster_gemm_rope=True, cluster_gemm_layer=True), got
    )
    assert got.shape == ref.shape == (T, 64)
    assert ((got - ref).float().norm() / ref.float().norm()).item() < 2e-2


def test_layer_kernel_refusals():
    """`layer_refusal` names why a layer cannot take the one-launch kernel (checked before any launch; each of these
    would otherwise read the wrong tiles or wait forever): a variant without the kernel, tiles that are not one head,
    o not square over the q columns, too many rows, a mask of the wrong kind — and on the CPU, no kernel at all."""
    nh, nkv, d, M = 4, 2, 128, 9
    x = torch.zeros(M, nh * d, dtype=torch.bfloat16)
    w = torch.zeros((nh + 2 * nkv) * d, nh * d, dtype=torch.bfloat16)
    wo = torch.zeros(nh * d, nh * d, dtype=torch.bfloat16)
    kc = torch.zeros(1, nkv, 64, d, dtype=torch.bfloat16)
    rope = (None, None, torch.zeros(64, d), None, kc, kc, nh, nkv)
    mask = torch.ones(M, 64, dtype=torch.bool)
    assert "no layer kernel" in cg.layer_refusal(x, w, wo, ("bn256", 4), rope, mask)
    assert "one head a tile" in cg.layer_refusal(
        x, w, wo, ("bn128_half", 4), rope[:2] + (torch.zeros(64, 64),) + rope[3:], mask
    )
    assert "o must be" in cg.layer_refusal(x, w, wo[:, :256], ("bn128_half", 4), rope, mask)
    assert "rows" in cg.layer_refusal(
        torch.zeros(57, nh * d, dtype=torch.bfloat16), w, wo, ("bn128_half", 4), rope, mask[:1].expand(57, 64)
    )
    assert "mask" in cg.layer_refusal(x, w, wo, ("bn128_half", 4), rope, mask.float())
    assert "split 9 not in" in cg.layer_refusal(x, w, wo, ("bn128_half", 9), rope, mask)
    assert "mask wider" in cg.layer_refusal(x, w, wo, ("bn128_half", 4), rope, torch.ones(M, 65, dtype=torch.bool))
    assert "does not take" in cg.layer_refusal(x, w, wo, ("bn128_half", 4), rope, mask)  # CPU tensors


def test_layer_items_split_each_kv_head_among_its_ctas():
    """`layer_items`: a KV head's attention items (chunks x row parts) never outnumber the (G + 2) split CTAs that
    take them (an item without a CTA would leave its KV head's counters short: every o unit would wait forever), each
    part's row tiles are one round of the CTA's warps, and the chunks take what CTAs the parts leave."""
    for variant, warps in (("bn128_half", 8), ("bn64", 4)):
        for G in (1, 2, 4, 8):
            for M in (1, 9, 16, 49, 56):
                if G * M > cg.LAYER_ROWS:
                    continue
                for split in (1, 2, 4):
                    chunks, parts = cg.layer_items(variant, split, G, M)
                    row_tiles = -(-G * M // 16)
                    assert parts * warps >= row_tiles and (parts - 1) * warps < row_tiles
                    assert 1 <= chunks * parts <= (G + 2) * split < (chunks + 1) * parts
    assert cg.layer_items("bn128_half", 4, 4, 49) == (12, 2)  # the 8B verify: 196 rows, 24 CTAs a KV head
    assert cg.layer_items("bn64", 1, 1, 200)[0] == 0  # 13 row tiles on 4 warps: 4 parts, 3 CTAs
