"""One layer_qkv_attn_o call at the 8B verify's shape after a warm-up, for dev/device_runs/ncu_layer.sh (run from the
repository root on an sm_90 GPU)."""

import sys

import torch

sys.path.insert(0, "tests")
from decode_helpers import tree_mask

from draftsmith.decode.experimental import cluster_gemm as cg

torch.manual_seed(0)
m, ctx, nh, nkv, d, H = 49, 512, 32, 8, 128, 4096
cap = ctx + 320
N = (nh + 2 * nkv) * d
w = torch.randn(N, H, device="cuda", dtype=torch.bfloat16) * 0.02
wo = torch.randn(H, nh * d, device="cuda", dtype=torch.bfloat16) * 0.02
nw = (1 + 0.1 * torch.randn(H, device="cuda")).to(torch.bfloat16)
kc, vc = (torch.randn(1, nkv, cap, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
ang = torch.arange(cap, device="cuda")[:, None] * torch.rand(d // 2, device="cuda")[None]
cos = torch.cat([ang.cos()] * 2, -1).to(torch.bfloat16).contiguous()
sin = torch.cat([ang.sin()] * 2, -1).to(torch.bfloat16).contiguous()
pos = torch.arange(ctx, ctx + m, device="cuda")
mask = tree_mask([(t - 1) // 2 if t else -1 for t in range(m)], cap, ctx).cuda()
x0 = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
hn, ssq = cg.norm_inputs(x0, nw)
for _ in range(3):
    cg.layer_qkv_attn_o(
        hn, w, ssq, 1e-5, (pos, pos, cos, sin, kc, vc, nh, nkv), mask, d**-0.5, wo, x0, nw, ("bn128_half", 4)
    )
torch.cuda.synchronize()
print("ok")
