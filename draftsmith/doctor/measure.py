"""Measured chain acceptance of a drafter, simulated from one target pass per prompt.

Why simulate instead of decoding: doctor scores the configuration and a dozen mis-wired variants of it, and a
decode run per variant would cost a dozen generations. Greedy speculative decoding is deterministic given the
target's greedy continuation, so one pass is enough:

1. `trace_prompt`: greedy-generate the continuation (the HF module with its own KV cache), then run the target ONCE over
   prompt + continuation with forward hooks on every decoder layer (`draftsmith.capture.AuxCapture`: the
   residual stream after each layer, BEFORE any final norm -- what the engines capture) and keep the argmax
   of its logits at every position (the token greedy verification accepts there).
2. `chain_acceptance`: the drafter's step 0 over the whole sequence (input token j+1, fused aux state of
   position j: the engine's prefill/hand-off), then, for every round start n at once (root = token n), the
   K chain steps exactly as `draftsmith.decode`'s chain round runs them: step 1 drafts from the step-0 output
   at n-1; step j>1 runs the drafter at position n+j-2 on the previous draft with the previous output as
   hidden, attending to the step-0 keys of positions < n plus this round's earlier chain keys. A round
   accepts the longest prefix of drafts equal to the target's argmax.
3. `engine_rounds`: the rounds a greedy engine actually runs (start at the first generated token, advance
   by accepted + 1), so acceptance rate / τ / per-position numbers are those `draftsmith eval` reports.

Variants only change what goes in: which layer states form the aux input (and in what order, normed or
not), the drafter module (norm_before_residual, RoPE), the draft-id -> target-id table, the prompts' tokens.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from draftsmith.capture.hooks import AuxCapture


@dataclass
class Trace:
    """One prompt's target pass: tokens, every layer's output and the target's argmax at each position."""

    input_ids: torch.Tensor  # [T] long: prompt + greedy continuation (+ K look-ahead tokens)
    prompt_len: int
    layer_states: torch.Tensor  # [T, N, H] (target dtype, CPU): output of decoder layer k (pre-norm) at [:, k]
    target_next: torch.Tensor  # [T] long: argmax of the target's logits at each position
    max_new_tokens: int  # the continuation length a decode run of this prompt would emit

    @property
    def length(self) -> int:
        return int(self.input_ids.numel())


@torch.no_grad()
def greedy_continuation(model, prompt_ids: Sequence[int], new_tokens: int, device) -> list[int]:
    """Plain greedy decoding with the HF module and a DynamicCache (what the engine's greedy output equals)."""
    cache = DynamicCache(config=model.config)
    # the cache argument was renamed in transformers 5.2x
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    nxt = model(input_ids=ids, use_cache=True, **{kw: cache}).logits[0, -1].float().argmax()
    tokens: list[int] = []
    for _ in range(new_tokens):
        tokens.append(int(nxt))
        nxt = model(input_ids=nxt.view(1, 1), use_cache=True, **{kw: cache}).logits[0, -1].float().argmax()
    return tokens


@torch.no_grad()
def trace_prompt(target, prompt_ids: Sequence[int], max_new_tokens: int, lookahead: int) -> Trace:
    """Greedy continuation of `max_new_tokens` + `lookahead` tokens and one hooked target pass over it all."""
    model = target.model
    dev = target.device
    cont = greedy_continuation(model, prompt_ids, max_new_tokens + lookahead, dev)
    eos = _eos_ids(model)
    # a decode run stops after emitting EOS: its rounds end there
    emitted = next((i + 1 for i, t in enumerate(cont[:max_new_tokens]) if t in eos), max_new_tokens)
    seq = list(prompt_ids) + cont
    ids = torch.tensor([seq], dtype=torch.long, device=dev)
    n = target.num_layers
    cap = AuxCapture(target, list(range(n)), capture_final=False)
    with cap:
        logits = model(input_ids=ids).logits[0]
    states = cap.aux[0].view(len(seq), n, -1).cpu()  # the target's dtype: every layer of a large target is big
    return Trace(
        input_ids=ids[0].cpu(),
        prompt_len=len(prompt_ids),
        layer_states=states,
        target_next=logits.float().argmax(-1).cpu(),
        max_new_tokens=emitted,
    )


def _eos_ids(model) -> set[int]:
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


@torch.no_grad()
def chain_drafts(
    drafter, aux: torch.Tensor, input_ids: torch.Tensor, starts: torch.Tensor, K: int, draft_to_target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(target ids, draft ids) [R, K] the chain drafts at each round start in `starts` (root = input_ids[n];
    target id -1 = a draft id with no valid target id under `draft_to_target`). aux: [T, k*H] in drafter order."""
    dev = next(drafter.parameters()).device
    dt = next(drafter.parameters()).dtype
    T = input_ids.numel()
    ids = input_ids.to(dev)
    table = draft_to_target.to(dev)
    step0_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def step0_attn(q, k, v, layer_idx):
        step0_kv[layer_idx] = (k, v)
        n_rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, _repeat_kv(k, n_rep), _repeat_kv(v, n_rep), is_causal=True)

    hidden0 = drafter.fuse(aux[: T - 1].to(dev, dt)[None])
    pos0 = torch.arange(T - 1, device=dev)[None]
    out0 = drafter(ids[None, 1:], hidden0, pos0, attn_fn=step0_attn)[0]  # [T-1, H]

    starts = starts.to(dev)
    R = starts.numel()
    key_pos = torch.arange(T - 1, device=dev)
    prefix_ok = key_pos[None, :] < starts[:, None]  # [R, T-1]: step-0 keys a round at n sees
    chain_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def chain_attn(q, k, v, layer_idx):
        if layer_idx in chain_kv:
            kc, vc = chain_kv[layer_idx]
            kc, vc = torch.cat([kc, k], 2), torch.cat([vc, v], 2)
        else:
            kc, vc = k, v
        chain_kv[layer_idx] = (kc, vc)
        k0, v0 = step0_kv[layer_idx]
        keys = torch.cat([k0.expand(R, -1, -1, -1), kc], 2)
        vals = torch.cat([v0.expand(R, -1, -1, -1), vc], 2)
        mask = torch.cat([prefix_ok, torch.ones(R, kc.shape[2], dtype=torch.bool, device=dev)], 1)
        n_rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(
            q, _repeat_kv(keys, n_rep), _repeat_kv(vals, n_rep), attn_mask=mask[:, None, None, :]
        )

    drafts = torch.empty(R, K, dtype=torch.long, device=dev)
    draft_ids = torch.empty(R, K, dtype=torch.long, device=dev)
    h = out0[starts - 1]  # [R, H]: the drafter's output at the position before the root
    for j in range(K):
        d = drafter.compute_logits(h).float().argmax(-1)
        tok = table[d]
        drafts[:, j] = tok
        draft_ids[:, j] = d
        if j < K - 1:
            pos = (starts + j)[:, None]
            h = drafter(tok.clamp(min=0)[:, None], h[:, None], pos, attn_fn=chain_attn)[:, 0]
    return drafts.cpu(), draft_ids.cpu()


def accepted_per_start(drafts: torch.Tensor, target_next: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """[R] accepted drafts per round start: longest prefix with draft j == target argmax at n + j."""
    K = drafts.shape[1]
    idx = starts[:, None] + torch.arange(K)[None]
    want = target_next[idx.clamp(max=target_next.numel() - 1)]
    ok = (drafts == want) & (idx < target_next.numel())
    return ok.long().cumprod(1).sum(1)


def round_starts(trace: Trace, K: int) -> torch.Tensor:
    """Every position a round could start at: the first generated token onwards, while the round's K targets
    exist and the continuation is not finished."""
    first = trace.prompt_len
    last = min(trace.prompt_len + trace.max_new_tokens - 2, trace.length - K)
    return torch.arange(first, max(first, last + 1))


def engine_rounds(accepted: torch.Tensor, starts: torch.Tensor) -> list[int]:
    """Accepted counts of the rounds a greedy engine runs: start at the first start, advance by accepted + 1."""
    by_start = {int(s): int(a) for s, a in zip(starts, accepted)}
    out = []
    n = int(starts[0]) if starts.numel() else 0
    while n in by_start:
        a = by_start[n]
        out.append(a)
        n += a + 1
    return out


def summarize(rounds_per_prompt: Sequence[Sequence[int]], K: int) -> dict:
    """acceptance_rate, tau, p_at_least (share of rounds accepting >= i), conditional (α_i), rounds."""
    acc = [a for r in rounds_per_prompt for a in r]
    n = len(acc)
    at_least = [sum(1 for a in acc if a >= i) / n if n else 0.0 for i in range(1, K + 1)]
    cond = [at_least[0] if at_least else 0.0] + [
        at_least[i] / at_least[i - 1] if at_least[i - 1] else 0.0 for i in range(1, K)
    ]
    return {
        "acceptance_rate": sum(acc) / (K * n) if n else 0.0,
        "tau": (sum(acc) + n) / n if n else 1.0,
        "p_at_least": at_least,
        "conditional": cond,
        "rounds": n,
    }
