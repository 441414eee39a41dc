"""experimental.cluster_attention on the CPU: the shipped PTX holds both head sizes' kernels at an assemblable version,
the launcher's struct matches the kernel's, the chunk rule, the refusals, and the route's fallback (a config that asks
for the kernel where it cannot run decodes through `kernels.rows_attention`). Its numerics are GPU tests
(tests/gpu/test_decode_gpu.py: test_cluster_attention_matches_fp32_reference, the bf16 certificate)."""

from __future__ import annotations

import os
import re

import pytest
import torch

if not torch.cuda.is_available():  # the wide plan's attention and RoPE kernels run in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from draftsmith.decode.experimental import cluster_attention as ca


def test_shipped_ptx_has_every_instance_and_the_struct_agrees():
    ptx = ca.PTX.read_text()
    assert set(re.findall(r"\.entry (cluster_attention_\w+)\(", ptx)) == {
        f"cluster_attention_d{d}_k{k}" for d in ca.HEAD_DIMS for k in ca.KSPLITS
    }
    assert re.search(r"^\.version 8\.7$", ptx, re.M) and re.search(r"^\.target sm_90a$", ptx, re.M)
    src = (ca.PTX.parent / "cluster_attention.cu").read_text()
    body = src[src.index("struct AttnArgs {") : src.index("};", src.index("struct AttnArgs {"))]
    body = re.sub(r"//[^\n]*", "", body.split("{", 1)[1])
    names = [piece.split()[-1].lstrip("*") for stmt in body.split(";") if stmt.strip() for piece in stmt.split(",")]
    assert names == [f for f, _ in ca._AttnArgs._fields_]
    assert f"#define ROWS {ca.ROWS}" in src and f"#define BS {ca.BS}" in src
    for d in ca.HEAD_DIMS:  # Q, the ring, the merge buffer, and the inbox (the ring's bytes reused) fit one CTA
        for k in ca.KSPLITS:
            assert f"ATTN_KERNEL({d}, {k})" in src
            assert ca.smem_bytes(d, k) + 4096 <= 227 * 1024 and ca.ROWS * d * 4 <= 2 * 2 * ca.BS * d * 2


def test_chunk_rule_one_wave_and_no_more_chunks_than_key_blocks():
    assert ca.chunks_for(49, 4, 8, 832) == 4  # the 8B verify: 8 KV heads x 4 row blocks x 4 = 128 CTAs
    assert ca.chunks_for(8, 4, 8, 832) == 8  # one row block a head: the cluster's most
    assert ca.chunks_for(49, 4, 8, 100) == 1  # a short mask: one key block
    assert ca.chunks_for(64, 8, 32, 4096) == 1  # 256 blocks already past a wave
    for T, G, nkv, S in ((49, 4, 8, 832), (5, 3, 1, 600), (17, 2, 4, 70)):
        c = ca.chunks_for(T, G, nkv, S)
        assert c in ca.CHUNKS and (c == 1 or nkv * -(-(T * G) // ca.ROWS) * c <= 132)


def test_refusals_on_the_cpu_and_shapes():
    q = torch.zeros(5, 8, 128, dtype=torch.bfloat16)
    kc = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16)
    mask = torch.ones(5, 64, dtype=torch.bool)
    slots = torch.arange(5)
    assert ca.refusal(q, kc, kc, mask, slots) == "not CUDA sm_90+"


def test_route_falls_back_where_the_kernel_cannot_run(one_thread):
    """KernelConfig(cluster_attention=True) on the CPU (bf16, the wide plan): the attention is rows_attention's, the
    logits those of the same forward without the flag, bit for bit."""
    pytest.importorskip("triton")
    from decode_helpers import tiny_llama

    from draftsmith.decode import ops as O
    from draftsmith.decode.kernel_config import KernelConfig
    from draftsmith.decode.llama import LlamaFamilyForward

    m16 = tiny_llama(vocab_size=64, hidden=64, layers=2, init=0.1).to(torch.bfloat16)
    torch.manual_seed(0)
    T = 7
    ids, pos = torch.randint(0, 64, (T,)), torch.arange(T)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    outs = []
    for flag in (False, True):
        f = LlamaFamilyForward.from_hf(m16, [0, 1], 48)
        f.set_cpu_transposed(False)
        f.kernels = "triton"
        f.kernel_config = KernelConfig(cluster_attention=flag)
        assert type(f.plan(T)) is O.TritonAttnOps
        outs.append(f.forward(ids, pos, pos, mask)[0])
    assert torch.equal(outs[0], outs[1])
