"""Training-time test (TTT): the attention pattern, the shifted targets, the teacher and the loss.

GUIDE §4. The drafter is unrolled K steps over a *packed* row (several documents concatenated; position
ids restart per document; attention never crosses a document). At step k the query at position i sees

* the step-0 keys of its own document at positions <= i (causal, block-diagonal over documents), and
* for every step 1 <= j <= k, only the step-j key at the same position i (a diagonal).

Nothing here builds a dense [K*T, K*T] (or even [T, T]) mask. Two exact backends:

* ``chunked`` (CPU default, any device): query chunks of ``chunk`` rows, each attending to the key range
  that its documents can reach, with the diagonal terms appended as extra score columns and one joint
  softmax. Each chunk runs under activation checkpointing, so autograd keeps only the inputs: memory is
  O(T * chunk) transient + O(T) saved per step.
* ``flex`` (CUDA default): ``flex_attention`` over the concatenation [K_0; K_1; ...; K_k] with a
  ``BlockMask`` (document-causal on the first T keys, ``kv % T == q`` on the rest), compiled.

``reference_ttt_attention`` is the naive per-step loop with a fully materialised mask; tests compare
both backends with it.

Alignment (EAGLE-3): the target state at position i has seen tokens 0..i. At step k the drafter at
position i consumes token i+k+1 and predicts token i+k+2; its teacher is the target's distribution at
position i+k+1. Position i is trained at step k only if i+k+2 is in the same document, token i+k+2 is
loss-masked in, and the target's argmax at i+k+1 is in the draft vocab.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = [
    "TTTAttention",
    "Teacher",
    "compute_teacher",
    "document_ids_from_lengths",
    "positions_from_doc_ids",
    "reference_ttt_attention",
    "shift_left",
    "step_valid_mask",
    "ttt_loss_step",
    "ttt_unroll",
    "TTTStats",
]


# ----------------------------------------------------------------------------------------------------
# Packing helpers
# ----------------------------------------------------------------------------------------------------
def document_ids_from_lengths(lengths: list[int], total: int | None = None, device=None) -> torch.Tensor:
    """[T] long: document index of each position of a packed row; padding (up to `total`) gets its own id."""
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))
    if total is not None and total > ids.numel():
        ids = torch.cat([ids, torch.full((total - ids.numel(),), len(lengths), dtype=torch.long)])
    return ids.to(device) if device is not None else ids


def positions_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """Position ids restarting at 0 at each document start. doc_ids: [..., T] -> [..., T]."""
    T = doc_ids.shape[-1]
    ar = torch.arange(T, device=doc_ids.device).expand_as(doc_ids)
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[..., 1:] = doc_ids[..., 1:] != doc_ids[..., :-1]
    start_pos = torch.where(start, ar, torch.zeros_like(ar))
    start_pos = torch.cummax(start_pos, dim=-1).values
    return ar - start_pos


def _doc_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(doc_ids.shape[-1], device=doc_ids.device) - positions_from_doc_ids(doc_ids)


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[..., i] <- x[..., i+n] along dim 1 (the time dim of [B, T, ...]); the tail is `fill`."""
    if n == 0:
        return x
    T = x.shape[1]
    out = torch.full_like(x, fill)
    if n < T:
        out[:, : T - n] = x[:, n:]
    return out


# ----------------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------------
def _chunk_attn(q, k0, v0, doc_q, doc_k, qpos, kpos, diag_k, diag_v, scale):
    """One query chunk. q [B,nkv,g,C,d]; k0/v0 [B,nkv,1,S,d]; doc_q/qpos [B,C]; doc_k/kpos [B,S];
    diag_k/diag_v: [B,nkv,1,C,d] tensors for steps 1..k (may be empty)."""
    acc = torch.promote_types(q.dtype, torch.float32)  # softmax in >= fp32
    s0 = torch.matmul(q, k0.transpose(-1, -2)).to(acc) * scale  # [B,nkv,g,C,S]
    allowed = (doc_q[:, :, None] == doc_k[:, None, :]) & (kpos[:, None, :] <= qpos[:, :, None])  # [B,C,S]
    s0 = s0.masked_fill(~allowed[:, None, None], float("-inf"))
    if diag_k:
        sd = torch.stack([(q * kj).sum(-1).to(acc) * scale for kj in diag_k], dim=-1)  # [B,nkv,g,C,k]
        s = torch.cat([s0, sd], dim=-1)
    else:
        s = s0
    p = torch.softmax(s, dim=-1).to(v0.dtype)
    S = k0.shape[-2]
    out = torch.matmul(p[..., :S], v0)
    for j, vj in enumerate(diag_v):
        out = out + p[..., S + j : S + j + 1] * vj
    return out


def chunk_lower_bounds(doc_ids: torch.Tensor, chunk: int) -> list[int]:
    """First key position each query chunk can see (its earliest document start), one host sync."""
    T = doc_ids.shape[-1]
    starts = _doc_starts(doc_ids).amin(0)  # [T]
    pad = (-T) % chunk
    if pad:
        starts = torch.cat([starts, starts.new_full((pad,), T)])
    return starts.view(-1, chunk).amin(-1).tolist()


def chunked_ttt_attention(
    q: torch.Tensor,
    ks: list[torch.Tensor],
    vs: list[torch.Tensor],
    doc_ids: torch.Tensor,
    chunk: int = 256,
    scale: float | None = None,
    use_checkpoint: bool | None = None,
    chunk_lo: list[int] | None = None,
) -> torch.Tensor:
    """TTT attention of step len(ks)-1. q [B,nh,T,d]; ks/vs: per step [B,nkv,T,d]; doc_ids [B,T].

    Returns [B,nh,T,d]. Exact (one joint softmax); memory O(T*chunk) transient.
    """
    B, nh, T, d = q.shape
    nkv = ks[0].shape[1]
    g = nh // nkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if use_checkpoint is None:
        use_checkpoint = torch.is_grad_enabled() and (q.requires_grad or ks[-1].requires_grad)
    qg = q.view(B, nkv, g, T, d)
    k0 = ks[0][:, :, None]
    v0 = vs[0][:, :, None]
    kd = [k[:, :, None] for k in ks[1:]]
    vd = [v[:, :, None] for v in vs[1:]]
    pos = torch.arange(T, device=q.device).expand(B, T)
    if chunk_lo is None:
        chunk_lo = chunk_lower_bounds(doc_ids, chunk)
    outs = []
    for a, lo in zip(range(0, T, chunk), chunk_lo):
        b = min(T, a + chunk)
        args = (
            qg[..., a:b, :],
            k0[..., lo:b, :],
            v0[..., lo:b, :],
            doc_ids[:, a:b],
            doc_ids[:, lo:b],
            pos[:, a:b],
            pos[:, lo:b],
            [x[..., a:b, :] for x in kd],
            [x[..., a:b, :] for x in vd],
            scale,
        )
        if use_checkpoint:
            outs.append(checkpoint(_chunk_attn, *args, use_reentrant=False))
        else:
            outs.append(_chunk_attn(*args))
    return torch.cat(outs, dim=-2).reshape(B, nh, T, d)


_FLEX = None
_FLEX_BROKEN = False  # set after flex attention failed once in this process (then: chunked)


def _flex():
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        fa = flex_attention
        if torch.cuda.is_available():
            fa = torch.compile(flex_attention, dynamic=False)
        _FLEX = (fa, create_block_mask)
    return _FLEX


def flex_ttt_attention(q, ks, vs, doc_ids, scale=None, block_mask_cache: dict | None = None):
    """TTT attention via flex_attention over cat(K_0..K_k) with a sparse block mask (exact)."""
    fa, create_block_mask = _flex()
    B, nh, T, d = q.shape
    nkv = ks[0].shape[1]
    n = len(ks)
    key = n
    bm = block_mask_cache.get(key) if block_mask_cache is not None else None
    if bm is None:
        docs = doc_ids

        def mask_mod(b, h, q_idx, kv_idx):
            first = kv_idx < T
            kv0 = torch.where(first, kv_idx, 0)
            causal = (docs[b, q_idx] == docs[b, kv0]) & (kv0 <= q_idx)
            diag = (kv_idx % T) == q_idx
            return torch.where(first, causal, diag)

        kw = {"_compile": True} if q.is_cuda else {}  # compiled: never materialises the [T, n*T] mask
        with warnings.catch_warnings():  # torch >= 2.13 deprecates the (still working) _compile flag
            warnings.simplefilter("ignore", DeprecationWarning)
            bm = create_block_mask(mask_mod, B, None, T, n * T, device=q.device, **kw)
        if block_mask_cache is not None:
            block_mask_cache[key] = bm
    K = torch.cat(ks, dim=2)
    V = torch.cat(vs, dim=2)
    return fa(q, K, V, block_mask=bm, scale=scale, enable_gqa=(nh != nkv))


def reference_ttt_attention(q, ks, vs, doc_ids, scale=None) -> torch.Tensor:
    """Naive reference: materialises the full [T, (k+1)T] mask of step k (tests only)."""
    B, nh, T, d = q.shape
    nkv = ks[0].shape[1]
    g = nh // nkv
    n = len(ks)
    K = torch.cat(ks, dim=2).repeat_interleave(g, dim=1)
    V = torch.cat(vs, dim=2).repeat_interleave(g, dim=1)
    ar = torch.arange(T, device=q.device)
    causal = (doc_ids[:, :, None] == doc_ids[:, None, :]) & (ar[None, None, :] <= ar[None, :, None])
    eye = torch.eye(T, dtype=torch.bool, device=q.device).expand(B, T, T)
    mask = torch.cat([causal] + [eye] * (n - 1), dim=-1)  # [B, T, n*T]
    return F.scaled_dot_product_attention(q, K, V, attn_mask=mask[:, None], scale=scale)


class TTTAttention:
    """The `attn_fn(q, k, v, layer_idx)` hook for one TTT unroll of a packed batch.

    Each call appends the step's k/v to the per-layer cache; the step index is the number of earlier
    calls for that layer. Create a fresh instance per batch (or call `reset()`).
    """

    def __init__(self, doc_ids: torch.Tensor, backend: str = "auto", chunk: int = 256, scale: float | None = None):
        if backend == "auto":
            backend = "flex" if doc_ids.is_cuda else "chunked"
        if backend not in ("chunked", "flex", "reference"):
            raise ValueError(f"unknown TTT attention backend {backend!r}")
        self.backend = backend
        self.doc_ids = doc_ids
        self.chunk = chunk
        self.scale = scale
        self.cache: dict[int, tuple[list, list]] = {}
        self._bm: dict = {}
        self._lo = chunk_lower_bounds(doc_ids, chunk) if backend == "chunked" else None

    def reset(self) -> None:
        self.cache.clear()

    def __call__(self, q, k, v, layer_idx: int = 0):
        ks, vs = self.cache.setdefault(layer_idx, ([], []))
        ks.append(k)
        vs.append(v)
        if self.backend == "chunked":
            return chunked_ttt_attention(q, ks, vs, self.doc_ids, self.chunk, self.scale, chunk_lo=self._lo)
        if self.backend == "flex":
            global _FLEX_BROKEN
            if not _FLEX_BROKEN:
                try:
                    return flex_ttt_attention(q, ks, vs, self.doc_ids, self.scale, self._bm)
                except (ImportError, NotImplementedError, RuntimeError, AssertionError) as e:
                    if isinstance(e, torch.cuda.OutOfMemoryError):
                        raise
                    _FLEX_BROKEN = True
                    warnings.warn(f"flex attention unavailable ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                                  "using the chunked TTT attention backend", stacklevel=2)
            self._lo = self._lo or chunk_lower_bounds(self.doc_ids, self.chunk)
            return chunked_ttt_attention(q, ks, vs, self.doc_ids, self.chunk, self.scale, chunk_lo=self._lo)
        return reference_ttt_attention(q, ks, vs, self.doc_ids, self.scale)


# ----------------------------------------------------------------------------------------------------
# Teacher and loss
# ----------------------------------------------------------------------------------------------------
@dataclass
class Teacher:
    probs: torch.Tensor  # [B,T,V_d] float32: target softmax restricted to the draft-vocab columns
    argmax: torch.Tensor  # [B,T] long: draft id of the argmax over draft columns
    in_vocab: torch.Tensor  # [B,T] bool: the full-vocab argmax is in the draft vocab


@torch.no_grad()
def compute_teacher(
    final_hidden: torch.Tensor,
    final_norm: Callable[[torch.Tensor], torch.Tensor],
    lm_head_weight: torch.Tensor,
    draft_to_target: torch.Tensor,
    t2d: torch.Tensor,
    chunk_tokens: int = 4096,
) -> Teacher:
    """Target's final norm + lm_head on the stored pre-norm final states; softmax over draft columns."""
    B, T, H = final_hidden.shape
    flat = final_hidden.reshape(B * T, H)
    probs, amax, inv = [], [], []
    W = lm_head_weight
    for a in range(0, B * T, chunk_tokens):
        h = final_norm(flat[a : a + chunk_tokens].to(W.dtype))
        full = F.linear(h, W).to(torch.promote_types(W.dtype, torch.float32))
        full_arg = full.argmax(-1)
        ld = full[:, draft_to_target]
        probs.append(torch.softmax(ld, dim=-1))
        amax.append(ld.argmax(-1))
        inv.append(t2d[full_arg])
    return Teacher(
        probs=torch.cat(probs).view(B, T, -1),
        argmax=torch.cat(amax).view(B, T),
        in_vocab=torch.cat(inv).view(B, T).bool(),
    )


def step_valid_mask(k: int, doc_ids: torch.Tensor, loss_mask: torch.Tensor, in_vocab: torch.Tensor) -> torch.Tensor:
    """[B,T] bool: positions trained at TTT step k (see module docstring)."""
    same_doc = shift_left(doc_ids, k + 2, fill=-1) == doc_ids
    lm = shift_left(loss_mask, k + 2, fill=False)
    iv = shift_left(in_vocab, k + 1, fill=False)
    return same_doc & lm & iv


@dataclass
class TTTStats:
    """Per-step sums (all [K] float64 tensors, summable across micro-batches and ranks)."""

    ce_sum: torch.Tensor
    n_valid: torch.Tensor
    correct: torch.Tensor
    cond_num: torch.Tensor
    cond_den: torch.Tensor

    def as_tensor(self) -> torch.Tensor:
        return torch.stack([self.ce_sum, self.n_valid, self.correct, self.cond_num, self.cond_den])

    @staticmethod
    def from_tensor(t: torch.Tensor) -> "TTTStats":
        return TTTStats(*t.unbind(0))

    def metrics(self, prefix: str = "") -> dict:
        n = self.n_valid.clamp(min=1)
        loss_k = (self.ce_sum / n).tolist()
        acc = (self.correct / n).tolist()
        cond = (self.cond_num / self.cond_den.clamp(min=1)).tolist()
        tau, prod = 0.0, 1.0
        for a in acc:
            prod *= a
            tau += prod
        tau_c, prod = 0.0, 1.0
        for a in cond:
            prod *= a
            tau_c += prod
        return {
            f"{prefix}loss_k": loss_k,
            f"{prefix}acc": acc,
            f"{prefix}cond_acc": cond,
            f"{prefix}tau_sim": tau,
            f"{prefix}tau_sim_cond": tau_c,
            f"{prefix}valid_tokens": [int(x) for x in self.n_valid.tolist()],
        }


def ttt_loss_step(logits: torch.Tensor, teacher_probs: torch.Tensor, valid: torch.Tensor):
    """Soft cross-entropy summed over valid positions. logits [B,T,V_d]; returns (ce_sum, per-pos ce)."""
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    ce = -(teacher_probs * logp).sum(-1)
    ce = torch.where(valid, ce, torch.zeros_like(ce))
    return ce.sum(), ce


def _ce_block(compute_logits, h, probs, valid):
    logits = compute_logits(h)
    ce_sum, _ = ttt_loss_step(logits, probs, valid)
    return ce_sum, logits.detach().argmax(-1)


def _step_ce(compute_logits, h, probs, valid, loss_chunk: int):
    """(sum of masked soft CE, drafter argmax) over [B, m] positions, chunked + checkpointed if asked."""
    m = h.shape[1]
    if loss_chunk <= 0 or m <= loss_chunk or not torch.is_grad_enabled():
        return _ce_block(compute_logits, h, probs, valid)
    total, preds = None, []
    for a in range(0, m, loss_chunk):
        b = min(m, a + loss_chunk)
        s, p = checkpoint(_ce_block, compute_logits, h[:, a:b], probs[:, a:b], valid[:, a:b], use_reentrant=False)
        total = s if total is None else total + s
        preds.append(p)
    return total, torch.cat(preds, dim=1)


def ttt_unroll(
    drafter,
    input_ids: torch.Tensor,
    aux_hidden: torch.Tensor,
    doc_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    teacher: Teacher,
    ttt_steps: int = 7,
    step_weight: float = 0.8,
    backend: str = "auto",
    chunk: int = 256,
    position_ids: torch.Tensor | None = None,
    pad_token_id: int = 0,
    loss_chunk: int = 0,
):
    """Run the K-step TTT unroll on one packed micro-batch. Returns (loss, TTTStats).

    loss = sum_k w^k * mean_{valid_k}(CE_k)  (each step normalised by its own valid-token count).
    loss_chunk > 0: norm + lm_head + soft CE run in token chunks under activation checkpointing, so the
    [T, V_d] logits of the K steps are never all alive (memory O(loss_chunk * V_d) instead of O(K*T*V_d)).
    """
    if position_ids is None:
        position_ids = positions_from_doc_ids(doc_ids)
    attn = TTTAttention(doc_ids, backend=backend, chunk=chunk)
    hidden = drafter.fuse(aux_hidden)
    K = ttt_steps
    dev = input_ids.device
    ce_sum = torch.zeros(K, dtype=torch.float64, device=dev)
    n_valid = torch.zeros_like(ce_sum)
    correct = torch.zeros_like(ce_sum)
    cond_num = torch.zeros_like(ce_sum)
    cond_den = torch.zeros_like(ce_sum)
    loss = None
    chain = torch.ones_like(loss_mask, dtype=torch.bool)
    for k in range(K):
        ids_k = shift_left(input_ids, k + 1, fill=pad_token_id)
        hidden = drafter(ids_k, hidden, position_ids, attn_fn=attn)
        # position i at step k is taught by the target at i+k+1: compare views, never shifted copies
        m = max(0, input_ids.shape[1] - (k + 1))
        valid = step_valid_mask(k, doc_ids, loss_mask, teacher.in_vocab)[:, :m]
        s, pred = _step_ce(drafter.compute_logits, hidden[:, :m], teacher.probs[:, k + 1 :], valid, loss_chunk)
        n = valid.sum()
        lk = s / n.clamp(min=1)
        w = step_weight**k
        loss = lk * w if loss is None else loss + lk * w
        with torch.no_grad():
            hit = torch.zeros_like(loss_mask, dtype=torch.bool)
            hit[:, :m] = pred == teacher.argmax[:, k + 1 :]
            valid = F.pad(valid, (0, input_ids.shape[1] - m), value=False)
            ce_sum[k] = s.detach().double()
            n_valid[k] = n.double()
            correct[k] = (hit & valid).sum().double()
            cond_den[k] = (chain & valid).sum().double()
            cond_num[k] = (chain & hit & valid).sum().double()
            chain = chain & hit
    return loss, TTTStats(ce_sum, n_valid, correct, cond_num, cond_den)
