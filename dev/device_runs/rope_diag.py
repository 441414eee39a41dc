"""Why the `_rope` instances' q differed from kernels.rope_and_cache's (the twenty-fifth session's GPU test failure):
for each case, the kernel's q and k, Triton's, and torch emulations of RoPE from y with candidate roundings — how many
values differ, by how much, at which columns. Found: triton's compiled kernel rounds as fma_a (x·cos fused into the
add), not as its source reads (double); the `_rope` instances now do the same (docs/LOG.md, twenty-fifth session)."""

import torch

from draftsmith.decode import kernels as K
from draftsmith.decode.experimental import cluster_gemm as cg


def emulate(y, pos, cos, sin, nh, nkv, d, how="double"):
    """RoPE of y's q and k heads in fp32 with the roundings `how` names: double — bf16(bf16(x c) + bf16(x' s)) (torch's
    bf16 ops); single — bf16(x c + x' s); fma_a — bf16(fma(x, c, bf16(x' s))); fma_b — bf16(fma(x', s, bf16(x c)))."""
    r = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    M = y.shape[0]
    x = y.float().view(M, nh + 2 * nkv, d)[:, : nh + nkv].double()
    half = d // 2
    x2 = torch.cat([-x[..., half:], x[..., :half]], -1)
    c, s = cos[pos].double()[:, None], sin[pos].double()[:, None]
    rd = lambda t: t.float().to(torch.bfloat16).float()  # noqa: E731  (an fp64 exact product rounded once)
    if how == "single":
        return rd((x * c).float().double() + (x2 * s).float().double())
    if how == "fma_a":
        return rd(x * c + r((x2 * s).float()).double())
    if how == "fma_b":
        return rd(x2 * s + r((x * c).float()).double())
    return r(r((x * c).float()) + r((x2 * s).float()))


def stats(name, a, b):
    a, b = a.float().flatten(), b.float().flatten()
    bad = (a != b).nonzero().flatten()
    print(
        f"{name}: {bad.numel()} of {a.numel()} differ; first cols {bad[:12].tolist()}; max |diff| "
        f"{(a - b).abs().max().item():.3g}"
    )


torch.manual_seed(3)
K_in, L, nh, nkv, eps = 448, 96, 4, 2, 1e-5
for d, plan in ((128, ("bn128_half", 1)), (128, ("bn128_half", 3)), (64, ("bn64", 1))):
    w = torch.randn((nh + 2 * nkv) * d, K_in, device="cuda", dtype=torch.bfloat16) * 0.05
    nw = (1 + 0.1 * torch.randn(K_in, device="cuda")).to(torch.bfloat16)
    ang = torch.arange(L, device="cuda")[:, None] * torch.rand(d // 2, device="cuda")[None]
    cos = torch.cat([ang.cos()] * 2, -1).to(torch.bfloat16).contiguous()
    sin = torch.cat([ang.sin()] * 2, -1).to(torch.bfloat16).contiguous()
    for M in (1, 17):
        hn, ssq = cg.norm_inputs(torch.randn(M, K_in, device="cuda", dtype=torch.bfloat16), nw)
        pos = torch.randint(0, L, (M,), device="cuda")
        slots = torch.randperm(L, device="cuda")[:M]
        caches = [torch.randn(1, nkv, L, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        kc1, vc1 = (c.clone() for c in caches)
        kc2, vc2 = (c.clone() for c in caches)
        y = cg.fused(hn, w, plan, ssq_in=ssq, eps=eps)
        q1 = K.rope_and_cache(y, pos, slots, cos, sin, kc1, vc1, nh, nkv).reshape(M, nh * d)
        q2 = cg.fused(hn, w, plan, ssq_in=ssq, eps=eps, rope=(pos, slots, cos, sin, kc2, vc2, nh, nkv))
        em = emulate(y, pos, cos, sin, nh, nkv, d)
        print(f"--- d {d} plan {plan} M {M} pos {pos[:4].tolist()}")
        stats("kernel q vs triton q", q2, q1)
        stats("emulated q vs triton q", em[:, :nh].reshape(M, -1), q1)
        for how in ("single", "fma_a", "fma_b"):
            stats(
                f"emulated ({how}) q vs triton q", emulate(y, pos, cos, sin, nh, nkv, d, how)[:, :nh].reshape(M, -1), q1
            )
        stats("emulated q vs kernel q", em[:, :nh].reshape(M, -1), q2)
        stats("kernel k vs triton k", kc2[0][:, slots], kc1[0][:, slots])
        stats("emulated k vs triton k", em[:, nh:].transpose(0, 1), kc1[0][:, slots].float())
        stats("kernel v vs triton v", vc2[0][:, slots], vc1[0][:, slots])
        stats("kernel v vs y's v", vc2[0][:, slots].transpose(0, 1).reshape(M, -1), y[:, (nh + nkv) * d :])
        # the rope variant's unrotated q: is the kernel's pre-RoPE y the same? (pos 0 rows: cos 1, sin 0)
        q0 = cg.fused(
            hn,
            w,
            plan,
            ssq_in=ssq,
            eps=eps,
            rope=(torch.zeros_like(pos), slots, cos, sin, kc2.clone(), vc2.clone(), nh, nkv),
        )
        stats("kernel q at pos 0 vs y's q", q0, y[:, : nh * d])
