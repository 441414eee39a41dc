"""Training-time test (TTT): the attention pattern, the shifted targets, the teacher and the loss.

The drafter is unrolled K steps over a *packed* row (several documents concatenated; position
ids restart per document; attention never crosses a document). At step k the query at position i sees

* the step-0 keys of its own document at positions <= i (causal, block-diagonal over documents), and
* for every step 1 <= j <= k, only the step-j key at the same position i (a diagonal).

Nothing here builds a dense [K*T, K*T] (or even [T, T]) mask. Two exact backends:

* ``chunked`` (CPU default, any device): query chunks of ``chunk`` rows, each attending to the key range
  that its documents can reach, with the diagonal terms appended as extra score columns and one joint
  softmax. Each chunk runs under activation checkpointing, so autograd keeps only the inputs: memory is
  O(T * chunk) transient + O(T) saved per step. ``chunk=None`` (``auto_chunk``): about the longest document,
  >= 1024 rows on CUDA, within a memory budget — T/2048 chunks at 16k instead of T/256 (8x fewer launches).
* ``flex`` (CUDA default): ONE compiled ``flex_attention`` over the step-0 keys only (a document-causal
  ``BlockMask`` of [T, T], built once per batch and shared by all steps and layers), returning its
  log-sum-exp; the k diagonal scores q_i . k_j[i] are [T, k] elementwise terms merged into the same softmax
  through the LSE (exact: softmax over [s_0 | s_diag] = weights exp(lse_0 - M) and exp(s_j - M)). So every
  step calls the same kernel with the same shapes: one compile per sequence length (not one per KV length
  T, 2T, ..., K*T, which overflowed dynamo's recompile limit of 8 after the second sequence length and
  silently fell back to eager flex attention — dense [B, H, T, k*T] scores: 73 GiB at 8k, OOM at 16k).

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
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from draftsmith.common.compiling import RECOMPILE_LIMIT, raise_recompile_limit

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


def chunk_lower_bounds(doc_ids: torch.Tensor, chunk: int, starts: torch.Tensor | None = None) -> list[int]:
    """First key position each query chunk can see (its earliest document start), one host sync.
    `starts`: the per-position earliest document start [T] when already computed (any device)."""
    T = doc_ids.shape[-1]
    if starts is None:
        starts = _doc_starts(doc_ids).amin(0)  # [T]
    pad = (-T) % chunk
    if pad:
        starts = torch.cat([starts, starts.new_full((pad,), T)])
    return starts.view(-1, chunk).amin(-1).tolist()


# bytes of transient memory per (query row x reachable key x head) of one chunk: fp32 scores, mask,
# softmax and their grads in the checkpointed recompute (measured ~20 B; margin included)
_CHUNK_BYTES_PER_SCORE = 24
CHUNK_BUDGET_CUDA = 3 << 30
CHUNK_BUDGET_CPU = 256 << 20


def auto_chunk(
    B: int, n_heads: int, T: int, max_back: int, budget_bytes: int, multiple: int = 128, min_chunk: int = 128
) -> int:
    """Query rows per chunk: about the longest document (a chunk then reaches <= 2x its rows of keys, so the
    dense masked scores waste at most ~2x), at least `min_chunk` (few launches when documents are short),
    at most what keeps B*heads*C*(C+max_back) scores within `budget_bytes`. A multiple of `multiple`, or T.

    max_back: how far before its own position a query can see (the longest document - 1)."""
    per_row = B * n_heads * _CHUNK_BYTES_PER_SCORE
    lim = budget_bytes / per_row  # C^2 + max_back*C <= lim
    c_budget = int((-max_back + math.sqrt(max_back * max_back + 4 * lim)) / 2)
    c_target = max(min_chunk, -(-(max_back + 1) // multiple) * multiple)
    c = min(c_target, c_budget)
    c = max(multiple, c // multiple * multiple)
    return T if c >= T else c


def chunk_plan(doc_ids: torch.Tensor, chunk: int | None, n_heads: int, budget_bytes: int | None = None):
    """(chunk, lower bounds) for `chunked_ttt_attention`; chunk None = sized by the memory budget.
    One host sync (the per-position document starts come to the host once)."""
    B, T = doc_ids.shape
    starts = _doc_starts(doc_ids).amin(0).cpu()  # [T] the single host sync of the plan
    if chunk is None or chunk <= 0:
        if budget_bytes is None:
            budget_bytes = CHUNK_BUDGET_CUDA if doc_ids.is_cuda else CHUNK_BUDGET_CPU
        max_back = int((torch.arange(T) - starts).max()) if T else 0
        chunk = auto_chunk(B, n_heads, T, max_back, budget_bytes, min_chunk=1024 if doc_ids.is_cuda else 128)
    chunk = max(1, min(int(chunk), max(T, 1)))
    return chunk, chunk_lower_bounds(doc_ids, chunk, starts=starts)


def chunked_ttt_attention(
    q: torch.Tensor,
    ks: list[torch.Tensor],
    vs: list[torch.Tensor],
    doc_ids: torch.Tensor,
    chunk: int | None = 256,
    scale: float | None = None,
    use_checkpoint: bool | None = None,
    chunk_lo: list[int] | None = None,
) -> torch.Tensor:
    """TTT attention of step len(ks)-1. q [B,nh,T,d]; ks/vs: per step [B,nkv,T,d]; doc_ids [B,T].

    Returns [B,nh,T,d]. Exact (one joint softmax); memory O(T*chunk) transient. chunk None: `auto_chunk`
    (then chunk_lo, if given, must come from the same `chunk_plan`).
    """
    B, nh, T, d = q.shape
    if chunk is None or chunk <= 0 or chunk_lo is None:
        chunk, chunk_lo = chunk_plan(doc_ids, chunk, nh)
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


_FLEX: dict = {}
_FLEX_BROKEN = False  # set after flex attention failed once in this process (then: chunked)
# Past dynamo's recompile limit flex attention would run EAGER (dense [B, H, T, KV] scores): one compiled shape
# per sequence length (x grad mode) is needed here.
FLEX_RECOMPILE_LIMIT = RECOMPILE_LIMIT
_raise_recompile_limit = raise_recompile_limit

# `with torch.autocast(enabled=False)` inside a compiled graph (the fp32 LSE merge) leaves these two calls in the
# graph AOTAutograd caches; it refuses them as unknown functions ("Unsupported call_function target
# _enter_autocast"), so every process would trace the joint graph again. Their arguments (device type, dtype,
# enabled) are constants of the graph, which is what the cache key hashes: safe to mark.
_AUTOCAST_FUNCTIONS = ("torch.amp.autocast_mode._enter_autocast", "torch.amp.autocast_mode._exit_autocast")


def _compile_settings() -> None:
    """What every compile of the TTT unroll sets first (the same in every process that shares the caches)."""
    import torch._inductor.config as inductor_config

    _raise_recompile_limit()
    marked = getattr(inductor_config, "unsafe_marked_cacheable_functions", None)
    if isinstance(marked, dict):
        for name in _AUTOCAST_FUNCTIONS:
            marked.setdefault(name, "draftsmith-1")


def _flex_lse(q, k, v, block_mask, scale, enable_gqa):
    """flex_attention returning (out, natural-log LSE [B, H, T])."""
    from torch.nn.attention import flex_attention as _fa_mod

    AuxRequest = getattr(_fa_mod, "AuxRequest", None)
    if AuxRequest is not None:
        out, aux = _fa_mod.flex_attention(
            q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, return_aux=AuxRequest(lse=True)
        )
        return out, aux.lse
    return _fa_mod.flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, return_lse=True)


def _flex(compiled: bool):
    """(attention fn (q, k, v, block_mask, scale, enable_gqa) -> (out, lse), create_block_mask)."""
    if not compiled:  # looked up at call time (the raw op inside an enclosing compiled graph)
        from torch.nn.attention.flex_attention import create_block_mask

        return _flex_lse, create_block_mask
    if compiled not in _FLEX:
        from torch.nn.attention.flex_attention import create_block_mask

        fn = _flex_lse
        if compiled:
            _compile_settings()
            # fullgraph: a graph break would run flex attention eagerly (dense scores); fail loudly instead
            fn = torch.compile(_flex_lse, dynamic=False, fullgraph=True)
        _FLEX[compiled] = (fn, create_block_mask)
    return _FLEX[compiled]


def doc_causal_block_mask(doc_ids: torch.Tensor, create_block_mask=None):
    """BlockMask [B, 1, T, T]: same document and kv <= q (the step-0 part of the TTT pattern)."""
    if create_block_mask is None:
        from torch.nn.attention.flex_attention import create_block_mask
    B, T = doc_ids.shape
    docs = doc_ids

    def mask_mod(b, h, q_idx, kv_idx):
        return (docs[b, q_idx] == docs[b, kv_idx]) & (kv_idx <= q_idx)

    kw = {"_compile": True} if doc_ids.is_cuda else {}  # compiled: never materialises the [T, T] mask
    with warnings.catch_warnings():  # torch >= 2.13 deprecates the (still working) _compile flag
        warnings.simplefilter("ignore", DeprecationWarning)
        return create_block_mask(mask_mod, B, None, T, T, device=doc_ids.device, **kw)


def merge_diagonal(out0: torch.Tensor, lse0: torch.Tensor, q: torch.Tensor, kd: list, vd: list, scale: float):
    """Exact TTT attention from the step-0 part and the diagonal keys.

    out0 [B,nh,T,d] = softmax-weighted step-0 values, lse0 [B,nh,T] their log-sum-exp (natural log);
    kd/vd: per step j >= 1 [B,nkv,T,d]. Joint softmax over [lse0 | q_i . kd_j[i] * scale]: the weight of
    out0 is exp(lse0)/Z, of vd_j[i] exp(s_j)/Z. Gradients flow into out0 AND lse0 (flex supports dLSE).
    """
    B, nh, T, d = q.shape
    nkv = kd[0].shape[1]
    g = nh // nkv
    acc = torch.promote_types(q.dtype, torch.float32)
    with torch.autocast(q.device.type, enabled=False):
        qg = q.reshape(B, nkv, g, T, 1, d).to(acc)
        K = torch.stack(kd, dim=-2).to(acc)[:, :, None]  # [B,nkv,1,T,k,d]
        V = torch.stack(vd, dim=-2).to(acc)[:, :, None]
        sd = torch.matmul(qg, K.transpose(-1, -2)) * scale  # [B,nkv,g,T,1,k]
        s = torch.cat([lse0.reshape(B, nkv, g, T, 1, 1).to(acc), sd], dim=-1)
        p = torch.softmax(s, dim=-1)
        out = p[..., :1] * out0.reshape(B, nkv, g, T, 1, d).to(acc) + torch.matmul(p[..., 1:], V)
    return out.reshape(B, nh, T, d).to(q.dtype)


def flex_ttt_attention(q, ks, vs, doc_ids, scale=None, block_mask_cache: dict | None = None):
    """TTT attention: one flex_attention over the step-0 keys (document-causal BlockMask, shared by all
    steps and layers through `block_mask_cache`) + the diagonal keys merged through its LSE (exact)."""
    fa, create_block_mask = _flex(q.is_cuda and not torch.compiler.is_compiling())
    B, nh, T, d = q.shape
    nkv = ks[0].shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    bm = block_mask_cache.get("doc_causal") if block_mask_cache is not None else None
    if bm is None:
        bm = doc_causal_block_mask(doc_ids, create_block_mask)
        if block_mask_cache is not None:
            block_mask_cache["doc_causal"] = bm
    k0, v0 = ks[0].to(q.dtype), vs[0].to(q.dtype)
    out0, lse0 = fa(q, k0, v0, bm, scale, nh != nkv)
    if len(ks) == 1:
        return out0
    return merge_diagonal(out0, lse0, q, ks[1:], vs[1:], scale)


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
    calls for that layer. Create a fresh instance per batch (or call `reset()`). Everything that depends
    only on the batch (flex BlockMask, chunk plan) is built once here and shared by all steps and layers.
    chunk None: chunked backend sizes its query chunks by a memory budget (`auto_chunk`).
    """

    def __init__(
        self,
        doc_ids: torch.Tensor,
        backend: str = "auto",
        chunk: int | None = None,
        scale: float | None = None,
        block_mask=None,
    ):
        if backend == "auto":
            backend = "flex" if doc_ids.is_cuda else "chunked"
        if backend not in ("chunked", "flex", "reference"):
            raise ValueError(f"unknown TTT attention backend {backend!r}")
        self.backend = backend
        self.doc_ids = doc_ids
        self.chunk = chunk if chunk else None
        self.scale = scale
        self.cache: dict[int, tuple[list, list]] = {}
        self._bm: dict = {} if block_mask is None else {"doc_causal": block_mask}
        self._plan: tuple[int, list[int]] | None = None

    def reset(self) -> None:
        self.cache.clear()

    def _chunked(self, q, ks, vs):
        if self._plan is None:
            self._plan = chunk_plan(self.doc_ids, self.chunk, q.shape[1])
        chunk, lo = self._plan
        return chunked_ttt_attention(q, ks, vs, self.doc_ids, chunk, self.scale, chunk_lo=lo)

    def __call__(self, q, k, v, layer_idx: int = 0):
        ks, vs = self.cache.setdefault(layer_idx, ([], []))
        ks.append(k)
        vs.append(v)
        if self.backend == "chunked":
            return self._chunked(q, ks, vs)
        if self.backend == "flex":
            global _FLEX_BROKEN
            if torch.compiler.is_compiling():  # inside the compiled unroll: no fallback (a failure surfaces there)
                return flex_ttt_attention(q, ks, vs, self.doc_ids, self.scale, self._bm)
            if not _FLEX_BROKEN:
                try:
                    return flex_ttt_attention(q, ks, vs, self.doc_ids, self.scale, self._bm)
                except (ImportError, NotImplementedError, RuntimeError, AssertionError) as e:
                    if isinstance(e, torch.cuda.OutOfMemoryError):
                        raise
                    _FLEX_BROKEN = True
                    warnings.warn(
                        f"flex attention unavailable ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                        "using the chunked TTT attention backend",
                        stacklevel=2,
                    )
            return self._chunked(q, ks, vs)
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
    def from_tensor(t: torch.Tensor) -> TTTStats:
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


class _SoftCE(torch.autograd.Function):
    """sum over valid rows of -sum_v p_v log_softmax(x)_v = lse(x) * sum(p) - <p, x>, fused.

    Saves only the logits in their own dtype (bf16 under autocast) + the [rows] LSE, instead of the fp32
    log-softmax and its intermediates; backward is one pass: (softmax(x) * sum(p) - p) * valid * g."""

    @staticmethod
    def forward(ctx, logits, probs, valid):
        acc = torch.promote_types(logits.dtype, torch.float32)
        x = logits.to(acc)
        lse = torch.logsumexp(x, dim=-1)
        psum = probs.sum(-1)
        ce = lse * psum - torch.linalg.vecdot(probs.to(acc), x)
        ce = torch.where(valid, ce, torch.zeros((), dtype=acc, device=ce.device))
        ctx.save_for_backward(logits, probs, valid, lse, psum)
        return ce.sum()

    @staticmethod
    def backward(ctx, g):
        logits, probs, valid, lse, psum = ctx.saved_tensors
        x = logits.to(lse.dtype)
        scale = torch.where(valid, g.to(lse.dtype), torch.zeros((), dtype=lse.dtype, device=lse.device))
        grad = (torch.exp(x - lse[..., None]) * psum[..., None] - probs) * scale[..., None]
        return grad.to(logits.dtype), None, None


def _soft_ce_traced(logits: torch.Tensor, probs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`_SoftCE`'s forward as plain ops, for a compiled graph: autograd derives the same backward,
    softmax(x) * sum(p) - p, and inductor's partitioner chooses what to save (it fuses the passes anyway)."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    x = logits.to(acc)
    ce = torch.logsumexp(x, dim=-1) * probs.sum(-1) - torch.linalg.vecdot(probs.to(acc), x)
    return torch.where(valid, ce, torch.zeros((), dtype=acc, device=ce.device)).sum()


def soft_ce_sum(logits: torch.Tensor, teacher_probs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Fused `ttt_loss_step(...)[0]` (same value, less memory, fewer kernels). Inside torch.compile the plain ops:
    dynamo turns an autograd.Function into a higher-order op that AOTAutograd's persistent cache refuses
    ("Unsupported call_function target autograd_function_apply"), so every process would trace the joint graph
    again instead of loading it (train/warmup.py warms that cache in another process)."""
    if torch.compiler.is_compiling():
        return _soft_ce_traced(logits, teacher_probs, valid)
    return _SoftCE.apply(logits, teacher_probs, valid)


def _ce_block(compute_logits, h, probs, valid):
    logits = compute_logits(h)
    return soft_ce_sum(logits, probs, valid), logits.detach().argmax(-1)


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


def _windows(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    """[B, n+1, T] views: row j = x shifted left by j along dim 1 (tail = fill). One pad, no per-step copies."""
    T = x.shape[1]
    return F.pad(x, (0, n), value=fill).unfold(1, T, 1)


def _step_targets(input_ids, doc_ids, loss_mask, in_vocab, ttt_steps: int, step_weight: float, pad_token_id: int):
    """What the K steps of one unroll train on, built once per batch, vectorised over k: (ids_w [B, K+1, T]:
    ids_w[:, k+1] is the input of step k; valid [B, K, T]: positions trained at step k; n_valid [K]; inv_n [K] float64:
    step_weight**k / n_valid, the step's loss normalisation)."""
    K = ttt_steps
    ids_w = _windows(input_ids, K, pad_token_id)  # ids_w[:, k+1] = input shifted by k+1
    doc_w = _windows(doc_ids, K + 1, -1)
    lm_w = _windows(loss_mask, K + 1, False)
    iv_w = _windows(in_vocab, K + 1, False)
    valid = (doc_w[:, 2 : K + 2] == doc_ids[:, None]) & lm_w[:, 2 : K + 2] & iv_w[:, 1 : K + 1]  # [B,K,T]
    n_valid = valid.sum(dim=(0, 2))  # [K]
    weights = torch.as_tensor([step_weight**k for k in range(K)], dtype=torch.float64, device=input_ids.device)
    return ids_w, valid, n_valid, weights / n_valid.clamp(min=1)


@torch.no_grad()
def _unroll_stats(
    ce: torch.Tensor, n_valid: torch.Tensor, preds: list, teacher_argmax: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """[5, K] float64 `TTTStats` rows of one unroll: CE sums, valid counts, hits, and the chained (all earlier steps
    hit) hits and counts. preds: per step [B, T] drafter argmax (-1 where the step has no teacher)."""
    K = len(preds)
    hit = torch.stack(preds, dim=1) == _windows(teacher_argmax, K, -2)[:, 1 : K + 1]  # teacher argmax at i+k+1
    chain = torch.cat([torch.ones_like(hit[:, :1]), hit[:, :-1]], dim=1).cumprod(dim=1).bool()  # hit at all j<k
    return torch.stack(
        [
            ce.detach().double(),
            n_valid.double(),
            (hit & valid).sum(dim=(0, 2)).double(),
            (chain & hit & valid).sum(dim=(0, 2)).double(),
            (chain & valid).sum(dim=(0, 2)).double(),
        ]
    )


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
    chunk: int | None = None,
    position_ids: torch.Tensor | None = None,
    pad_token_id: int = 0,
    loss_chunk: int = 0,
    block_mask=None,
):
    """Run the K-step TTT unroll on one packed micro-batch. Returns (loss, TTTStats).

    loss = sum_k w^k * mean_{valid_k}(CE_k)  (each step normalised by its own valid-token count).
    loss_chunk > 0: norm + lm_head + soft CE run in token chunks under activation checkpointing, so the
    [T, V_d] logits of the K steps are never all alive (memory O(loss_chunk * V_d) instead of O(K*T*V_d)).

    Everything that depends only on the batch (shifted inputs, valid masks of all K steps, counts) is
    built once, vectorised over k; the statistics are computed once after the unroll — the per-step work
    is the drafter step, its loss, and nothing else (no per-step small-kernel bookkeeping, no host sync).
    """
    if position_ids is None:
        position_ids = positions_from_doc_ids(doc_ids)
    attn = TTTAttention(doc_ids, backend=backend, chunk=chunk, block_mask=block_mask)
    hidden = drafter.fuse(aux_hidden)
    K = ttt_steps
    B, T = input_ids.shape
    ids_w, valid_all, n_all, inv_n = _step_targets(
        input_ids, doc_ids, loss_mask, teacher.in_vocab, K, step_weight, pad_token_id
    )
    ce_list, pred_list = [], []
    for k in range(K):
        hidden = drafter(ids_w[:, k + 1], hidden, position_ids, attn_fn=attn)
        # position i at step k is taught by the target at i+k+1: compare views, never shifted copies
        m = max(0, T - (k + 1))
        s, pred = _step_ce(
            drafter.compute_logits, hidden[:, :m], teacher.probs[:, k + 1 :], valid_all[:, k, :m], loss_chunk
        )
        ce_list.append(s)
        pred_list.append(F.pad(pred, (0, T - m), value=-1))
    ce = torch.stack(ce_list)  # [K]
    loss = (ce * inv_n.to(ce.dtype)).sum()
    stats = _unroll_stats(ce, n_all, pred_list, teacher.argmax, valid_all)
    return loss, TTTStats(*stats.unbind(0))


# ----------------------------------------------------------------------------------------------------
# The whole unroll as one compiled graph
# ----------------------------------------------------------------------------------------------------
def _unroll_tensors(
    drafter,
    input_ids,
    aux_hidden,
    doc_ids,
    position_ids,
    loss_mask,
    t_probs,
    t_argmax,
    t_in_vocab,
    block_mask,
    ttt_steps: int,
    step_weight: float,
    loss_chunk: int,
):
    loss, stats = ttt_unroll(
        drafter,
        input_ids,
        aux_hidden,
        doc_ids,
        loss_mask,
        Teacher(t_probs, t_argmax, t_in_vocab),
        ttt_steps=ttt_steps,
        step_weight=step_weight,
        backend="flex",
        position_ids=position_ids,
        loss_chunk=loss_chunk,
        block_mask=block_mask,
    )
    return loss, stats.as_tensor()


def _warm_drafter_caches(drafter, device) -> None:
    """Fill the drafter's per-device caches (RoPE inverse frequencies) eagerly, before a compiled call: filled
    inside the first compiled call instead, the cache's new entry fails that graph's guard on the next call and
    recompiles everything (seen on the GPU: +54 s at step 2 of a 16k run; reproduced on CPU, now tested)."""
    inner = getattr(drafter, "module", drafter)  # DDP
    if hasattr(inner, "inv_freq"):
        inner.inv_freq(device)


class CompiledUnroll:
    """`ttt_unroll` (flex backend) compiled as ONE graph: the K drafter steps, the flex attention over the step-0
    keys with the exact diagonal merge, the soft-CE losses and the statistics, forward and backward.

    Why: eager, a 16k-token step of a one-layer drafter is ~2,000 kernels (small elementwise ops, dtype copies,
    the [T, V_d] soft CE in several passes), host- and launch-bound at ~5% MFU; inductor fuses the elementwise
    work and the loss passes. Shapes are static per sequence length (rows are padded to the token budget), so
    there is one compile per length. The document-causal BlockMask is built outside the graph, once per batch.

    `backend`: torch.compile backend ("inductor" on GPU; tests use "aot_eager" on CPU to prove the unroll traces
    as one graph, `fullgraph=True`). If compiling fails at the first call, `__call__` raises; the trainer then
    falls back to eager and says so.
    """

    def __init__(self, backend: str = "inductor", fullgraph: bool = True, mode: str | None = None):
        # mode="reduce-overhead": inductor replays the forward and backward graphs as CUDA graphs (the compiled
        # step is host-bound: 24 ms wall for ~16 ms of GPU work at 8k); callers must then call
        # torch.compiler.cudagraph_mark_step_begin() per step and copy outputs they keep. Benchmark-only so far.
        _compile_settings()
        self.fn = torch.compile(
            _unroll_tensors, backend=backend, dynamic=False, fullgraph=fullgraph, **({"mode": mode} if mode else {})
        )

    def __call__(
        self,
        drafter,
        input_ids,
        aux_hidden,
        doc_ids,
        position_ids,
        loss_mask,
        teacher: Teacher,
        ttt_steps: int,
        step_weight: float,
        loss_chunk: int = 0,
    ):
        _warm_drafter_caches(drafter, input_ids.device)
        bm = doc_causal_block_mask(doc_ids)
        return self.fn(
            drafter,
            input_ids,
            aux_hidden,
            doc_ids,
            position_ids,
            loss_mask,
            teacher.probs,
            teacher.argmax,
            teacher.in_vocab,
            bm,
            ttt_steps,
            step_weight,
            loss_chunk,
        )


# ----------------------------------------------------------------------------------------------------
# Per-step compiled unroll: the same graph for every TTT step >= 1 (compile time independent of K)
# ----------------------------------------------------------------------------------------------------
class _SlotAttention:
    """attn_fn for one TTT step with shape-stable state: per layer the step-0 keys/values (k0, v0) and the
    diagonal keys/values of steps 1..K-1 in fixed slots Kd/Vd [B, nkv, T, K-1, d]. `slot` (a 0-d long tensor)
    is where this step's k/v go; `bias` [K-1] is 0 for slots 1..k and -inf for later ones. Step 0
    (k0s is None) records its own k/v as k0/v0 and attends to the step-0 keys only."""

    def __init__(self, k0s, v0s, kds, vds, slot, bias, block_mask, n_slots: int):
        self.k0s, self.v0s, self.kds, self.vds = k0s, v0s, kds, vds
        self.slot, self.bias, self.bm, self.n_slots = slot, bias, block_mask, n_slots
        self.out_k0, self.out_v0, self.out_kd, self.out_vd = {}, {}, {}, {}

    def __call__(self, q, k, v, layer_idx: int = 0):
        fa, _ = _flex(False)  # the raw op: this runs inside a compiled graph (or eagerly in tests)
        B, nh, T, d = q.shape
        nkv = k.shape[1]
        scale = 1.0 / math.sqrt(d)
        if self.k0s is None:  # step 0
            self.out_k0[layer_idx], self.out_v0[layer_idx] = k, v
            # the slots start as step 0's k/v in slot 0 (masked by `bias`, overwritten by step 1, so their gradient
            # is zero): step 1 then gets slot tensors of the same kind as every later step -> one graph for k >= 1
            z = k.new_zeros(B, nkv, T, self.n_slots, d)
            self.out_kd[layer_idx] = z.index_copy(3, self.slot.view(1), k[:, :, :, None])
            self.out_vd[layer_idx] = z.to(v.dtype).index_copy(3, self.slot.view(1), v[:, :, :, None])
            out0, _ = fa(q, k.to(q.dtype), v.to(q.dtype), self.bm, scale, nh != nkv)
            return out0
        k0, v0 = self.k0s[layer_idx], self.v0s[layer_idx]
        Kd = self.kds[layer_idx].index_copy(3, self.slot.view(1), k.to(self.kds[layer_idx].dtype)[:, :, :, None])
        Vd = self.vds[layer_idx].index_copy(3, self.slot.view(1), v.to(self.vds[layer_idx].dtype)[:, :, :, None])
        self.out_kd[layer_idx], self.out_vd[layer_idx] = Kd, Vd
        out0, lse0 = fa(q, k0.to(q.dtype), v0.to(q.dtype), self.bm, scale, nh != nkv)
        return _merge_slots(out0, lse0, q, Kd, Vd, self.bias, scale)


def _merge_slots(out0, lse0, q, Kd, Vd, bias, scale):
    """`merge_diagonal` over fixed slots: Kd/Vd [B,nkv,T,S,d], bias [S] (0 = active, -inf = not yet)."""
    B, nh, T, d = q.shape
    nkv = Kd.shape[1]
    g = nh // nkv
    acc = torch.promote_types(q.dtype, torch.float32)
    with torch.autocast(q.device.type, enabled=False):
        qg = q.reshape(B, nkv, g, T, 1, d).to(acc)
        K = Kd.to(acc)[:, :, None]  # [B,nkv,1,T,S,d]
        V = Vd.to(acc)[:, :, None]
        sd = torch.matmul(qg, K.transpose(-1, -2)) * scale + bias.to(acc)  # [B,nkv,g,T,1,S]
        s = torch.cat([lse0.reshape(B, nkv, g, T, 1, 1).to(acc), sd], dim=-1)
        p = torch.softmax(s, dim=-1)
        out = p[..., :1] * out0.reshape(B, nkv, g, T, 1, d).to(acc) + torch.matmul(p[..., 1:], V)
    return out.reshape(B, nh, T, d).to(q.dtype)


def _one_step(
    drafter, ids_k, hidden, position_ids, probs_k, valid_k, k0s, v0s, kds, vds, slot, bias, block_mask, n_slots: int
):
    """One TTT step over the full row (fixed shapes): drafter step, soft CE of the valid positions, argmax.
    Returns (hidden, ce_sum, pred, (k0s, v0s, kds, vds))."""
    attn = _SlotAttention(k0s, v0s, kds, vds, slot, bias, block_mask, n_slots)
    hidden = drafter(ids_k, hidden, position_ids, attn_fn=attn)
    logits = drafter.compute_logits(hidden)
    ce = soft_ce_sum(logits, probs_k, valid_k)
    pred = logits.detach().argmax(-1)
    n = len(attn.out_kd)
    state = (
        tuple(attn.out_k0[i] for i in range(n)) if k0s is None else k0s,
        tuple(attn.out_v0[i] for i in range(n)) if v0s is None else v0s,
        tuple(attn.out_kd[i] for i in range(n)),
        tuple(attn.out_vd[i] for i in range(n)),
    )
    return hidden, ce, pred, state


class CompiledStepUnroll:
    """The TTT unroll with ONE compiled graph per step kind (step 0, and all steps >= 1), instead of one graph
    for the whole K-step unroll (`CompiledUnroll`). Why: compile time of the whole unroll grows linearly with
    K (docs/LOG.md has the measurements),
    while every step >= 1 does the same computation on the same shapes once the diagonal keys live in fixed
    slots (inactive slots masked with -inf) and the teacher rows are fixed-length views of a once-padded
    tensor. Same loss, gradients and statistics as `ttt_unroll` (tested on CPU against the reference).
    Memory: each step keeps its own [B, nkv, T, K-1, d] slot tensors (K-1 small key/value rows per token), and
    the loss runs over whole rows ([T, V_d] logits per step: `loss_chunk` is not applied)."""

    def __init__(self, backend: str = "inductor", fullgraph: bool = True):
        _compile_settings()
        self.fn = torch.compile(_one_step, backend=backend, dynamic=False, fullgraph=fullgraph)

    def __call__(
        self,
        drafter,
        input_ids,
        aux_hidden,
        doc_ids,
        position_ids,
        loss_mask,
        teacher: Teacher,
        ttt_steps: int,
        step_weight: float,
        loss_chunk: int = 0,
        pad_token_id: int = 0,
    ):
        K = ttt_steps
        B, T = input_ids.shape
        dev = input_ids.device
        _warm_drafter_caches(drafter, dev)
        bm = doc_causal_block_mask(doc_ids)
        ids_w, valid_all, n_all, inv_n = _step_targets(
            input_ids, doc_ids, loss_mask, teacher.in_vocab, K, step_weight, pad_token_id
        )
        # teacher rows of step k = probs[i + k + 1]: a [B, T, V_d] window of a once-padded tensor (fixed shape)
        probs_p = F.pad(teacher.probs, (0, 0, 0, K + 1))
        n_slots = max(1, K - 1)
        slots = torch.arange(n_slots, device=dev)
        hidden = drafter.fuse(aux_hidden)
        state = (None, None, None, None)
        ce_list, pred_list = [], []
        for k in range(K):
            slot = slots[max(k - 1, 0)]
            bias = torch.where(slots < k, 0.0, float("-inf"))
            hidden, ce, pred, state = self.fn(
                drafter,
                ids_w[:, k + 1],
                hidden,
                position_ids,
                probs_p[:, k + 1 : k + 1 + T],
                valid_all[:, k],
                *state,
                slot,
                bias,
                bm,
                n_slots,
            )
            ce_list.append(ce)
            pred_list.append(torch.where(torch.arange(T, device=dev) < T - (k + 1), pred, -1))  # as ttt_unroll
        ce = torch.stack(ce_list)
        loss = (ce * inv_n.to(ce.dtype)).sum()
        return loss, _unroll_stats(ce, n_all, pred_list, teacher.argmax, valid_all)
