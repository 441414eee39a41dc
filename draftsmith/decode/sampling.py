"""Token choice, distribution warping and the lossless acceptance rules (all on-device, sync-free).

Sampling uses the exponential race (argmax p / E, E ~ Exp(1)), which draws exactly from p with one
`torch.rand` and no `multinomial` (no host sync; safe inside CUDA graphs with the default generator).

Capture rules for everything here (checked on CPU by tests/test_decode_syncfree.py): every tensor factory
gets an explicit `device=`; Python numbers enter only as kernel scalars (`x / t`, `masked_fill(m, v)`,
`fill_(v)`, comparisons), never through `t[...] = value` or `torch.tensor(...)`; randomness only from the
default generator of the device (`torch.rand*`, no `generator=`): CUDA graphs register it and advance its
Philox offset on every replay, so `torch.manual_seed` before a run makes replays reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 -> greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 -> off

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def canonical(self) -> SamplingParams:
        """The same choice rule with the settings that change nothing dropped: greedy ignores top_p / top_k, top_p
        >= 1 and top_k <= 0 are off. What a captured graph is keyed by (a server's clients send greedy requests
        with any top_p)."""
        if self.greedy:
            return SamplingParams()
        return SamplingParams(float(self.temperature), min(float(self.top_p), 1.0), max(int(self.top_k), 0))


def warp(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k, then top-p (HF's order); logits [..., V] -> probs fp32."""
    x = logits.float() / max(sp.temperature, 1e-6)
    if sp.top_k and 0 < sp.top_k < x.shape[-1]:
        kth = torch.topk(x, sp.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if sp.top_p < 1.0:
        sx, si = torch.sort(x, dim=-1, descending=True)
        sp_ = torch.softmax(sx, -1)
        before = torch.cumsum(sp_, -1) - sp_
        remove = before >= sp.top_p
        # always keep the top token. NOT `remove[..., 0] = False`: a Python value written through
        # __setitem__ becomes a fresh host tensor, and for a 1-D x (drafter / plain step) the 0-dim
        # destination takes `copy_` from it: a pageable host->device memcpy, which fails graph capture
        remove[..., 0].fill_(False)
        sx = sx.masked_fill(remove, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, si, sx)
    return torch.softmax(x, -1)


def sample(probs: torch.Tensor) -> torch.Tensor:
    """One draw per row of probs [..., V] (need not be normalised) -> long [...]."""
    e = -torch.log(torch.rand_like(probs).clamp_min_(1e-20))
    return torch.argmax(probs / e, dim=-1)


def choose(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """The target's token at each row: argmax (greedy) or a sample from the warped distribution."""
    if sp.greedy:
        return torch.argmax(logits, dim=-1)
    return sample(warp(logits, sp))


def leading_true(ok: torch.Tensor) -> torch.Tensor:
    """How many of ok [K]'s first elements are True before the first False (a long scalar tensor): cumprod(ok).sum()
    as a min-reduction, which torch.compile fuses into the kernel before it; a scan is a kernel of its own a round
    (aten's cumprod on the GPU: docs/LOG.md, 2026-12-02 thirteenth session)."""
    idx = torch.arange(ok.shape[0], device=ok.device)
    return torch.where(ok, ok.shape[0], idx).min()


def chain_accept(draft: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None, tgt_choice: torch.Tensor | None):
    """Acceptance for a chain of K draft tokens (target ids) verified at K+1 positions.

    Greedy (q is None): accept while draft[i] == tgt_choice[i]; bonus = tgt_choice[a].
    Sampling: standard speculative sampling — accept draft[i] with prob min(1, p_i(x)/q_i(x)); on the first
    rejection the bonus is drawn from norm(max(p_a - q_a, 0)); if all K pass, from p_K.
    p [K+1, V] target probs, q [K, V] draft probs over the *target* vocab.
    Returns (a: long scalar tensor, bonus: long scalar tensor).
    """
    K = draft.shape[0]
    if q is None:
        a = leading_true(draft == tgt_choice[:K])
        return a, tgt_choice.gather(0, a.view(1))[0]
    idx = torch.arange(K, device=draft.device)
    px = p[idx, draft]
    qx = q[idx, draft]
    u = torch.rand(K, device=p.device)
    ok = u * qx <= px  # u < p/q without dividing by q == 0
    a = leading_true(ok)
    qpad = torch.cat([q, torch.zeros_like(q[:1])], 0)
    pa = p.index_select(0, a.view(1))[0]
    qa = qpad.index_select(0, a.view(1))[0]
    resid = (pa - qa).clamp_min(0)
    # if the residual has no mass (only when p == q), fall back to p: the draw is then exact either way
    resid = torch.where(resid.sum() > 0, resid, pa)
    return a, sample(resid)
