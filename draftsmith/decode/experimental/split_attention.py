"""Experimental: flash-decoding attention in plain torch (`--attn-impl split`), opt-in, never chosen by "auto".

The keys are split into chunks so that every (KV head, chunk) pair is its own block of work, against SDPA's one
block per head at decode. On the GPU the Triton `kernels.decode_attention` / `kernels.rows_attention` do this
properly; this torch version stays for comparison (bench/decode_kernels.py measures it beside sdpa and bmm).
"""

from __future__ import annotations

import torch

from draftsmith.decode.llama import _bmm_attention


def _split_chunks(S: int) -> int:
    for c in (16, 8, 4, 2):
        if S % c == 0 and S // c >= 64:
            return c
    return 1


def split_attention(q, k, v, add_mask, scale):
    """Flash-decoding with torch ops: the S keys in C chunks of S/C; each (head, chunk) pair gets its own
    max, sum and partial output, then one rescaled sum. A chunk that is masked out entirely gets weight 0
    (its max is the mask's finfo.min, far below the real maximum). The engine's caches are sliced to their
    full length, so the chunk reshapes are views; a shorter slice would copy the cache."""
    n, R, d = q.shape
    S = k.shape[1]
    C = _split_chunks(S)
    if C == 1:
        return _bmm_attention(q, k, v, add_mask, scale)
    Sc = S // C
    qc = q[:, None].expand(n, C, R, d).reshape(n * C, R, d)
    mc = add_mask.view(R, C, Sc).transpose(0, 1)[None].expand(n, C, R, Sc).reshape(n * C, R, Sc)
    s = torch.baddbmm(mc, qc, k.reshape(n * C, Sc, d).transpose(1, 2), alpha=scale).float()
    m = s.amax(-1, keepdim=True)  # [nC, R, 1]
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    o = torch.bmm(p.to(q.dtype), v.reshape(n * C, Sc, d)).float()  # [nC, R, d]
    m, l, o = m.view(n, C, R, 1), l.view(n, C, R, 1), o.view(n, C, R, d)
    w = torch.exp(m - m.amax(1, keepdim=True))
    return ((w * o).sum(1) / (w * l).sum(1)).to(q.dtype)
