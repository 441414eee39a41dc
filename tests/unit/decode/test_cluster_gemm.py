"""experimental.cluster_gemm on the CPU: the shipped PTX holds every variant the launcher names (a variant added to
the .cu but not rebuilt, or named in VARIANTS but not instantiated, fails here, not on a GPU), the plans, and the
route's refusals. The kernel's numerics are GPU tests (tests/gpu/test_decode_gpu.py: test_cluster_gemm_*)."""

from __future__ import annotations

import re

import torch

from draftsmith.decode.experimental import cluster_gemm as cg


def test_shipped_ptx_has_every_variant_at_an_assemblable_version():
    ptx = cg.PTX.read_text()
    entries = set(re.findall(r"\.entry (cluster_gemm_\w+)\(", ptx))
    assert entries == {f"cluster_gemm_{v}" for v in cg.VARIANTS}
    assert re.search(r"^\.version 8\.7$", ptx, re.M) and re.search(r"^\.target sm_90a$", ptx, re.M)
    src = (cg.PTX.parent / "cluster_gemm.cu").read_text()
    for v, (bn, wg, ntok, stages) in cg.VARIANTS.items():  # the table agrees with the instantiations
        if v in cg.LAST:
            assert re.search(rf"LASTCTA_GEMM\({bn}, {wg}, {ntok}, {stages}, {v}, \d\)", src), v
        else:
            assert re.search(rf"CLUSTER_GEMM\({bn}, {wg}, {ntok}, {stages}, \w+, \w+, {v}, \d\)", src), v


def test_shared_memory_fits_and_half_variants_pair_up():
    for v in cg.VARIANTS:
        assert cg.smem_bytes(v) <= 227 * 1024, v
        if v.endswith("_half"):
            assert 2 * cg.smem_bytes(v) <= 228 * 1024, v  # two CTAs an SM (the SM keeps 1 KiB a CTA)


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
