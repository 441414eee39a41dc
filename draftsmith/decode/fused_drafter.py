"""A decoding view of a draftsmith `Drafter`: the same weights, fewer kernels per draft step.

A bs=1 draft step replayed from a CUDA graph is launch-bound, so kernels are the cost. The training module keeps
q/k/v and gate/up as separate projections (the checkpoint layout SGLang, vLLM and speculators expect); for
decoding we concatenate each group into one matrix (3 GEMMs -> 1, 2 -> 1) and rotate q and k in one RoPE pass
(like the compact target forward, `llama.py`): 8 fewer kernels per drafter layer call. Everything else (embedding,
norms, fc, o/down projections, lm_head) is the original module, shared; the two fused copies are rebuilt by the
engine when `is_stale` says the drafter's weights changed (e.g. trained further after the engine was made).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.decode.llama import linear_add
from draftsmith.drafter.model import MLP, Attention, Drafter, apply_rope


class _FusedAttention(nn.Module):
    def __init__(self, attn: Attention):
        super().__init__()
        self.layer_idx, self.n_heads, self.n_kv, self.head_dim = attn.layer_idx, attn.n_heads, attn.n_kv, attn.head_dim
        with torch.no_grad():
            w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
            b = None if attn.q_proj.bias is None else torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
        self.register_buffer("qkv_weight", w, persistent=False)
        self.register_buffer("qkv_bias", b, persistent=False)
        self.o_proj = attn.o_proj

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_fn) -> torch.Tensor:
        bsz, t, _ = x.shape
        nh, nkv, d = self.n_heads, self.n_kv, self.head_dim
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias).view(bsz, t, nh + 2 * nkv, d).transpose(1, 2)
        qk = apply_rope(qkv[:, : nh + nkv], cos, sin)  # q and k heads rotated together
        out = attn_fn(qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv :], self.layer_idx)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, t, nh * d))


class _FusedMLP(nn.Module):
    def __init__(self, mlp: MLP):
        super().__init__()
        with torch.no_grad():
            w = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            b = None if mlp.gate_proj.bias is None else torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias])
        self.register_buffer("gate_up_weight", w, persistent=False)
        self.register_buffer("gate_up_bias", b, persistent=False)
        self.down_proj = mlp.down_proj
        self.act = mlp.act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = F.linear(x, self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)
        return self.down_proj(self.act(g) * u)


def _with_children(module: nn.Module, **children: nn.Module) -> nn.Module:
    """A shallow copy of `module` whose child modules are its own dict (the original is not touched)."""
    m = copy.copy(module)
    m._modules = dict(module._modules)
    m._modules.update(children)
    return m


def fused_for_decoding(drafter: nn.Module) -> nn.Module:
    """The decoding view of a draftsmith `Drafter` (see the module doc); any other module is returned as is."""
    if not isinstance(drafter, Drafter):
        return drafter
    layers = nn.ModuleList(
        _with_children(layer, self_attn=_FusedAttention(layer.self_attn), mlp=_FusedMLP(layer.mlp))
        for layer in drafter.layers
    )
    view = _with_children(drafter, layers=layers)
    view._fused_from = _source_versions(drafter)
    return view


def _source_versions(drafter: nn.Module) -> list[tuple[torch.Tensor, int, int]]:
    out = []
    for layer in drafter.layers:
        a, m = layer.self_attn, layer.mlp
        # o and down too: the CPU step (`CpuDraftStep`) holds transposed copies of them
        for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj):
            for t in (lin.weight, lin.bias):
                if t is not None:
                    out.append((t, t._version, t.data_ptr()))
    norms = [drafter.norm.weight] + [
        n.weight for layer in drafter.layers for n in layer.modules() if n is not layer and hasattr(n, "eps")
    ]
    out += [(t, t._version, t.data_ptr()) for t in (drafter.fc.weight, drafter.lm_head.weight, *norms)]
    return out


def _fused_layers(view: nn.Module, who: str):
    """(index, layer, fused attention, fused MLP) of `fused_for_decoding`'s view, checked: a step class built on
    another module would compute something else silently."""
    from draftsmith.drafter.model import DecoderLayer, Eagle3MidLayer

    for i, layer in enumerate(view.layers):
        a, m = layer.self_attn, layer.mlp
        if not isinstance(a, _FusedAttention) or not isinstance(m, _FusedMLP):
            raise TypeError(f"{who} needs fused_for_decoding's view")
        if not isinstance(layer, Eagle3MidLayer if i == 0 else DecoderLayer):
            raise TypeError(f"layer {i}: {type(layer).__name__} is not a draftsmith drafter layer")
        yield i, layer, a, m


class CpuDraftStep:
    """A draftsmith `Drafter`'s forward for decoding on the CPU, as one flat function over pre-transposed weights.

    On the CPU a bs=1 draft step of the demo drafter (one layer, H=192) costs ~0.45 ms, almost all of it per-op
    overhead (~150 aten ops through 10 module calls; its matmuls take ~25 us): BENCHMARKS.md "Demo target on CPU".
    This is the same computation as `Drafter.forward` over `fused_for_decoding`'s view (RMSNorms as
    `hf_rms_norm`, RoPE on q and k together, the engine's cache-writing attention), with each matmul as x @ W^T
    from a contiguous [in, out] copy (MKL runs that ~2x faster for these shapes than F.linear's x @ W.t()), the
    rotary rows given by the caller and no module dispatch. The copies are made once; `is_stale` covers them.
    `fuse` is the drafter's fc the same way; `logits` its norm + lm_head. Each norm's weight is folded into the
    matmul after it (drafts may differ from the module's in the last bits; what is accepted never does)."""

    def __init__(self, view: nn.Module):

        t = lambda w: None if w is None else w.detach().t().contiguous()  # noqa: E731
        self.embed = view.embed_tokens.weight
        self.fc_t = t(view.fc.weight)
        # each RMSNorm's weight folded into the matmul after it (rms(x) * w @ W^T == rms(x) @ (w * W)^T up to
        # rounding: only the drafts can move, never what is accepted), one multiply fewer per norm
        self.norm_eps = view.norm.eps
        w = view.norm.weight.detach()
        self.lm_head = (view.lm_head.weight.detach() * w[None, :]).contiguous()
        self.lm_head_t = self.lm_head.t().contiguous()
        self.layers = []
        for i, layer, a, m in _fused_layers(view, "CpuDraftStep"):
            nbr = bool(getattr(layer, "norm_before_residual", False))
            in_w = layer.input_layernorm.weight.detach()
            if i == 0:  # x = cat(input_layernorm(embeds), hidden_norm(hidden)); with nbr the normed hidden is the
                # residual too, so that norm keeps its weight
                hid_w = layer.hidden_norm.weight.detach()
                in_w = torch.cat([in_w, torch.ones_like(hid_w) if nbr else hid_w])
            self.layers.append(
                dict(
                    mid=i == 0,
                    nbr=nbr,
                    in_eps=layer.input_layernorm.eps,
                    hid_w=layer.hidden_norm.weight if i == 0 and nbr else None,
                    hid_eps=layer.hidden_norm.eps if i == 0 else None,
                    post_eps=layer.post_attention_layernorm.eps,
                    qkv_t=(in_w[:, None] * t(a.qkv_weight)).contiguous(),
                    qkv_b=a.qkv_bias,
                    o_t=t(a.o_proj.weight),
                    o_b=a.o_proj.bias,
                    gu_t=(layer.post_attention_layernorm.weight.detach()[:, None] * t(m.gate_up_weight)).contiguous(),
                    gu_b=m.gate_up_bias,
                    down_t=t(m.down_proj.weight),
                    down_b=m.down_proj.bias,
                    act=m.act,
                    idx=a.layer_idx,
                    heads=(a.n_heads, a.n_kv, a.head_dim),
                )
            )

    @staticmethod
    def _mm(x, wt, b):
        return torch.mm(x, wt) if b is None else torch.addmm(b, x, wt)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        return torch.mm(aux, self.fc_t)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """`Drafter.compute_logits` (fp32) for h [H] or [T, H]: one row by MKL's gemv over W [V_d, H] (as fast as
        the transposed copy there), several by the transposed copy."""
        x = F.rms_norm(h, (h.shape[-1],), eps=self.norm_eps)  # (the weight is in lm_head)
        if x.dim() == 1 or x.shape[0] == 1:
            return F.linear(x, self.lm_head).float()
        return torch.mm(x.reshape(-1, x.shape[-1]), self.lm_head_t).view(*x.shape[:-1], -1).float()

    def __call__(self, ids, hidden, cos, sin, attn_fn) -> torch.Tensor:
        """ids [T], hidden [T, H], cos/sin [T, d] -> the pre-norm output [T, H]. attn_fn(q, k, v, layer_idx) as
        `Drafter.forward` takes it (q [1, nh, T, d], k/v [1, nkv, T, d])."""
        from draftsmith.drafter.model import hf_rms_norm

        def rms(x, eps):  # hf_rms_norm's, the weight folded into the next matmul
            return F.rms_norm(x, (x.shape[-1],), eps=eps)

        T = ids.shape[0]
        mm = self._mm
        cos, sin = cos[:, None], sin[:, None]  # [T, 1, d]: over the heads
        h = hidden
        for L in self.layers:
            nh, nkv, d = L["heads"]
            if L["mid"]:
                if L["nbr"]:
                    normed = residual = hf_rms_norm(hidden, L["hid_w"], L["hid_eps"])
                else:
                    normed, residual = rms(hidden, L["hid_eps"]), hidden
                e = F.embedding(ids, self.embed)
                e = e if e.dtype == hidden.dtype else e.to(hidden.dtype)
                x = torch.cat((rms(e, L["in_eps"]), normed), -1)
            else:
                residual, x = h, rms(h, L["in_eps"])
            qkv = mm(x, L["qkv_t"], L["qkv_b"]).view(T, nh + 2 * nkv, d)
            qk = qkv[:, : nh + nkv]
            half = d // 2
            qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), -1) * sin
            q = qk[:, :nh].transpose(0, 1)[None]
            k = qk[:, nh:].transpose(0, 1)[None]
            v = qkv[:, nh + nkv :].transpose(0, 1)[None]
            o = attn_fn(q, k, v, L["idx"])  # [1, nh, T, d]
            h = residual + mm(o[0].transpose(0, 1).reshape(T, nh * d), L["o_t"], L["o_b"])
            g, u = mm(rms(h, L["post_eps"]), L["gu_t"], L["gu_b"]).chunk(2, -1)
            h = h + mm(L["act"](g) * u, L["down_t"], L["down_b"])
        return h


class KernelDraftStep:
    """A draftsmith `Drafter`'s forward for decoding through `draftsmith.decode.kernels` (the engine's
    kernels="triton"): the kernels of the target's one-token step, a handful per drafter layer instead of cuBLAS plus
    ~10 elementwise kernels (a round on a small target is launch-bound: BENCHMARKS.md "Decode: small-target round
    census"). One token: `gemv` with the norm, bias, silu*up and residual folds, `rope_and_cache` into the drafter's
    cache, `decode_attention`; up to `ROWS` tokens (a hand-off, a tree level): `rows_attention`, and the matmuls
    through `experimental.gemm_rows` up to `rows` tokens (the engine's `kernel_rows`, the target verify's rule: the
    row kernels win on small shapes and lose to cuBLAS on large ones — an 8B-sized drafter's 8-row tree level took
    0.37 ms through them vs 0.22 ms for one row, BENCHMARKS.md), torch's beyond. The first layer's input,
    cat(input_layernorm(embeds), hidden_norm(hidden)), is two norms over two halves: the qkv gemv gathers the
    embedding and applies both itself (`gemv`'s `embed`, `KernelConfig.embed_fold`; torch's norms and cat where it
    cannot: norm_before_residual, a hand-off wider than the gemv's rows); every other norm is folded into the matmul
    after it with HF's rounding, so outputs equal the module's up to summation order. Needs a silu MLP and a
    power-of-two head_dim >= 16 (`supports`)."""

    ROWS = 64  # experimental.gemm_rows.ROWS_MAX (not imported here: the module loads triton)

    def __init__(self, view: nn.Module, config=None, rows: int = 1):
        self.config = config
        self.rows = max(1, min(int(rows), self.ROWS))
        self.embed = view.embed_tokens.weight
        self.fc = view.fc.weight
        self.fc_b = view.fc.bias
        self.norm_w, self.norm_eps = view.norm.weight, view.norm.eps
        self.lm_head = view.lm_head.weight
        self.layers = []
        for i, layer, a, m in _fused_layers(view, "KernelDraftStep"):
            self.layers.append(
                dict(
                    mid=i == 0,
                    nbr=bool(getattr(layer, "norm_before_residual", False)),
                    in_norm=layer.input_layernorm,
                    hid_norm=layer.hidden_norm if i == 0 else None,
                    post_w=layer.post_attention_layernorm.weight,
                    post_eps=layer.post_attention_layernorm.eps,
                    qkv=a.qkv_weight,
                    qkv_b=a.qkv_bias,
                    o=a.o_proj.weight,
                    o_b=a.o_proj.bias,
                    gu=m.gate_up_weight,
                    gu_b=m.gate_up_bias,
                    down=m.down_proj.weight,
                    down_b=m.down_proj.bias,
                    idx=a.layer_idx,
                    heads=(a.n_heads, a.n_kv, a.head_dim),
                )
            )

    @staticmethod
    def supports(view: nn.Module) -> bool:
        if not isinstance(view, Drafter) or getattr(view, "embed_tokens", None) is None:
            return False
        for layer in view.layers:
            d = layer.self_attn.head_dim
            if d < 16 or d & (d - 1) or getattr(layer.mlp, "act", None) is not F.silu:
                return False
        return True

    def _fold_rope(self, T: int, head_dim: int) -> bool:
        """Whether a T-row forward's q/k/v matmul takes RoPE and the cache writes (`KernelConfig.rope_fold`): it
        is a kernel (`_mm`'s gemv or gemm_rows) for T rows, and the head splits into rotated halves."""
        cfg = self.config
        rows_ok = T == 1 or (T <= self.rows and cfg is not None and cfg.rope_fold_rows)
        return bool(cfg is not None and cfg.rope_fold and rows_ok and head_dim % 2 == 0)

    def _mm(self, x, w, norm_weight=None, eps=1e-6, bias=None, residual=None, glu=False, rope=None):
        """x [T, K] @ w^T with the folds: gemv for one row, gemm_rows up to `rows`, else torch (`rope`: the q/k/v
        projection's RoPE and cache writes, kernels only — `_fold_rope` says when)."""
        from draftsmith.decode import kernels as K

        T = x.shape[0]
        if T == 1:
            return K.gemv(x, w, norm_weight, eps, bias=bias, residual=residual, glu=glu, config=self.config, rope=rope)
        if T <= self.rows:
            from draftsmith.decode.experimental.gemm_rows import gemm_rows

            return gemm_rows(
                x, w, norm_weight, eps, bias=bias, residual=residual, glu=glu, config=self.config, rope=rope
            )
        assert rope is None, "rope folds only into the kernels (`_fold_rope`)"
        from draftsmith.drafter.model import hf_rms_norm

        if norm_weight is not None:
            x = hf_rms_norm(x, norm_weight, eps)
        if residual is not None and not glu:
            return linear_add(residual, x, w, bias)  # no addmm under torch.compile (`llama.linear_add`)
        y = F.linear(x, w, bias)
        if glu:
            g, u = y.chunk(2, -1)
            y = F.silu(g) * u
        return y if residual is None else residual + y

    def _embed_fold(self, L: dict, hidden: torch.Tensor, T: int) -> bool:
        """Whether the first layer's qkv takes the embedding and both norms in its prologue (`kernels.gemv`'s
        `embed`): one row (the gemv's), one eps and dtype for both norms, and the residual the raw hidden state (with
        norm_before_residual the normed one is needed on its own)."""
        return (
            T == 1
            and not L["nbr"]
            and self.embed.dtype == hidden.dtype
            and L["in_norm"].eps == L["hid_norm"].eps
            and (self.config is None or self.config.embed_fold)
        )

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        return self._mm(aux.reshape(-1, aux.shape[-1]), self.fc, bias=self.fc_b)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """`Drafter.compute_logits` (fp32) for h [H] or [T, H]."""
        x = h.reshape(-1, h.shape[-1])
        y = self._mm(x, self.lm_head, self.norm_w, self.norm_eps).float()
        return y.view(*h.shape[:-1], -1)

    def greedy_token(self, h: torch.Tensor, id_map: torch.Tensor) -> torch.Tensor:
        """id_map[argmax(logits(h))] (long [1]) for one row h [H]: the norm, lm_head, argmax and draft-to-target map
        in one gemv launch (`kernels.gemv`'s argmax_map), where logits + torch.argmax + gather took two (the argmax
        over a vocabulary's outputs ~2.5 us a draft step on an H200: BENCHMARKS.md, 2026-12-02 thirteenth session).
        The same token: the argmax of the same rounded logits, first index on ties."""
        from draftsmith.decode import kernels as K

        x = h.reshape(1, h.shape[-1])
        return K.gemv(x, self.lm_head, self.norm_w, self.norm_eps, config=self.config, argmax_map=id_map)

    def __call__(self, ids, hidden, positions, slots, mask, k_layers, v_layers, cos, sin) -> torch.Tensor:
        """ids/positions/slots [T], hidden [T, H] (the drafter's dtype), mask [T, S] bool over the drafter cache's
        slots, the cache's per-layer views, cos/sin [max_len, d] (the drafter's table) -> the pre-norm output
        [T, H]."""
        from draftsmith.decode import kernels as K

        T = ids.shape[0]
        h = hidden
        if len(self.layers) > 1:  # once, not per layer's kernel calls (a traced round; `kernels.realize`)
            positions, slots, mask = K.realize(positions, slots, mask)
        for L in self.layers:
            nh, nkv, d = L["heads"]
            kc, vc = k_layers[L["idx"]], v_layers[L["idx"]]
            # `KernelConfig.rope_fold`: RoPE and the cache writes in the q/k/v matmul's epilogue (one launch fewer a
            # layer), where that matmul is a kernel (one row, or up to `rows`); `qkv` is then q itself
            rope = (positions, slots, cos, sin, kc, vc, nh, nkv) if self._fold_rope(T, d) else None
            if L["mid"] and self._embed_fold(L, hidden, T):
                # the embedding gather, both input norms and their concatenation in the qkv gemv's prologue
                residual = hidden
                qkv = K.gemv(
                    hidden,
                    L["qkv"],
                    L["in_norm"].weight,
                    L["in_norm"].eps,
                    bias=L["qkv_b"],
                    config=self.config,
                    embed=(self.embed, ids),
                    norm_weight2=L["hid_norm"].weight,
                    rope=rope,
                )
            elif L["mid"]:
                normed = L["hid_norm"](hidden)
                residual = normed if L["nbr"] else hidden
                e = F.embedding(ids, self.embed)
                x = torch.cat((L["in_norm"](e if e.dtype == hidden.dtype else e.to(hidden.dtype)), normed), -1)
                qkv = self._mm(x, L["qkv"], bias=L["qkv_b"], rope=rope)
            else:
                residual = h
                qkv = self._mm(h, L["qkv"], L["in_norm"].weight, L["in_norm"].eps, bias=L["qkv_b"], rope=rope)
            if rope is not None:
                q = qkv.view(T, nh, d)
            else:
                q = K.rope_and_cache(qkv, positions, slots, cos, sin, kc, vc, nh, nkv, config=self.config)
            if T == 1:
                o = K.decode_attention(q, kc, vc, mask[0], d**-0.5, config=self.config, slot=slots)
            else:
                o = K.rows_attention(q, kc, vc, mask, d**-0.5, slots, config=self.config)
            h = self._mm(o, L["o"], bias=L["o_b"], residual=residual)
            gu = self._mm(h, L["gu"], L["post_w"], L["post_eps"], bias=L["gu_b"], glu=True)
            h = self._mm(gu, L["down"], bias=L["down_b"], residual=h)
        return h


def is_stale(view: nn.Module) -> bool:
    """True when a weight the view copied has changed since (an optimizer step, load_state_dict, .to()): every
    in-place change bumps a tensor's version counter; a move replaces its storage."""
    src = getattr(view, "_fused_from", None)
    return src is not None and any(t._version != v or t.data_ptr() != ptr for t, v, ptr in src)


__all__ = ["CpuDraftStep", "KernelDraftStep", "fused_for_decoding", "is_stale"]
