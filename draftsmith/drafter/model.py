"""The EAGLE-3 draft model (docs/eagle3.md#the-drafter), in one readable file.

Data flow for one draft step (B = batch, T = positions, H = drafter hidden, H_t = target hidden):

    aux [B,T,k*H_t] --fc--> h0 [B,T,H]                      (step 0 only: `Drafter.fuse`)
    input_ids [B,T] --target embedding (frozen)--> e [B,T,H]
    layers[0] ("midlayer"):
        a = attn(cat(input_layernorm(e), hidden_norm(h)))   q/k/v_proj take 2H inputs, RoPE at position_ids
        r = h + a                    (or hidden_norm(h) + a with norm_before_residual, speculators/vLLM flag)
        out = r + mlp(post_attention_layernorm(r))
    layers[1:] (optional): plain Llama decoder layers over H
    out [B,T,H]   = pre-norm output; fed back as `hidden` for the next draft step
    logits [B,T,V_d] = lm_head(norm(out))                  (`Drafter.compute_logits`)
    target id = draft id + d2t[draft id]                   (`Drafter.draft_to_target`)

This matches SGLang's `LlamaForCausalLMEagle3` (python/sglang/srt/models/llama_eagle3.py: residual is the
un-normalized hidden, fused add+norm before the MLP, the pre-norm sum is what is fed back), vLLM's
`Eagle3LlamaForCausalLM` (vllm/model_executor/models/llama_eagle3.py, incl. `norm_before_residual`) and
speculators' `Eagle3DraftModel` (speculators/models/eagle3/{core,model_definitions}.py).

Attention is pluggable: every attention module computes q, k, v, applies RoPE at `position_ids` and then
calls `attn_fn(q, k, v, layer_idx)` (q [B,n_heads,T,d], k/v [B,n_kv_heads,T_k,d]) -> [B,n_heads,T,d].
Training-time test passes its own (step-0 causal prefix + diagonals), decoding passes a KV-cache / tree
mask one; the default is causal SDPA with grouped-query heads.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.common.errors import DraftsmithError
from draftsmith.drafter.config import DrafterConfig
from draftsmith.drafter.vocab import build_draft_vocab, check_mappings, identity_draft_vocab, ids_to_mappings

AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]

EMBED_KEY = "embed_tokens.weight"


# --------------------------------------------------------------------------------------------- blocks
def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm outside autocast: normalise in fp32, cast back to x's dtype, then scale by the weight.

    F.rms_norm upcasts internally and returns the input dtype -- the same computation (bit-identical on CPU for
    fp32/bf16/fp16, tested) and one fused kernel on CUDA (aten::_fused_rms_norm) instead of seven small ones,
    which matters in launch-bound bs=1 decoding. The weight stays a separate multiply after the cast, as in HF."""
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


class RMSNorm(nn.Module):
    """Llama RMSNorm, computed in fp32 and cast back (same numerics as HF `LlamaRMSNorm`)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_autocast_enabled(x.device.type):
            # Decoding: `hf_rms_norm` (one fused CUDA kernel). Training runs under autocast, whose casting rules
            # for rms_norm are backend-specific: spelled out below.
            return hf_rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(cfg: DrafterConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] (fp32), with Llama-3 or linear scaling when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(torch.float32) / d))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    if rs["rope_type"] == "linear":
        return inv / float(rs["factor"])
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
    factor, lo, hi = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
    old_len = float(rs["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype):
    """cos, sin [B, T, head_dim] for integer positions [B, T] (computed in fp32, like HF)."""
    freqs = position_ids.to(torch.float32)[..., None] * inv_freq[None, None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, d]; cos/sin [B, T, d]. Rotate-half convention (HF Llama)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int = 0) -> torch.Tensor:
    """Default `attn_fn`: causal SDPA, grouped-query heads repeated. If k is longer than q (a cache
    before the queries), the causal mask is aligned bottom-right: query i sees keys 0..T_k-T_q+i."""
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    tq, tk = q.shape[2], k.shape[2]
    if tq == tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(diagonal=tk - tq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig, in_features: int, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        b = cfg.attention_bias
        self.q_proj = nn.Linear(in_features, self.n_heads * self.head_dim, bias=b)
        self.k_proj = nn.Linear(in_features, self.n_kv * self.head_dim, bias=b)
        self.v_proj = nn.Linear(in_features, self.n_kv * self.head_dim, bias=b)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=b)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_fn: AttnFn) -> torch.Tensor:
        bsz, t, _ = x.shape
        q = self.q_proj(x).view(bsz, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attn_fn(q, k, v, self.layer_idx)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, t, self.n_heads * self.head_dim))


_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


class MLP(nn.Module):
    """Llama gated MLP: down(act(gate(x)) * up(x))."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, i, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b)
        self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)
        self.act = _ACTS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Eagle3MidLayer(nn.Module):
    """EAGLE-3's first decoder layer: attention over cat(input_layernorm(embeds), hidden_norm(hidden))."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h = cfg.hidden_size
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 2 * h, layer_idx=0)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds, hidden, cos, sin, attn_fn):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)
        x = residual + self.self_attn(x, cos, sin, attn_fn)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderLayer(nn.Module):
    """A plain Llama decoder layer (drafter layers after the first)."""

    def __init__(self, cfg: DrafterConfig, layer_idx: int):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, h, layer_idx=layer_idx)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, hidden, cos, sin, attn_fn):
        x = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, attn_fn)
        return x + self.mlp(self.post_attention_layernorm(x))


def _frozen_embedding(weight: torch.Tensor) -> nn.Embedding:
    """An nn.Embedding whose weight is a non-persistent buffer: moved by .to(), frozen, never in
    state_dict() / parameters(), so no checkpoint or optimizer ever carries the target's embedding."""
    emb = nn.Embedding(1, 1)
    del emb.weight
    emb.num_embeddings, emb.embedding_dim = weight.shape
    emb.register_buffer("weight", weight.detach().requires_grad_(False), persistent=False)
    return emb


# --------------------------------------------------------------------------------------------- model
class Drafter(nn.Module):
    """EAGLE-3 drafter. See the module docstring for the data flow and `draftsmith.drafter` for usage."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        config.validate()
        self.config = config
        c = config
        self.fc = nn.Linear(c.fc_in_features, c.hidden_size, bias=False)
        layers: list[nn.Module] = [Eagle3MidLayer(c)]
        layers += [DecoderLayer(c, i) for i in range(1, c.num_hidden_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        d2t, t2d = identity_draft_vocab(c.vocab_size, c.draft_vocab_size)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        self._inv_freq = rope_inv_freq(c)  # fp32, kept out of buffers so .to(bf16) cannot round it
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}
        self.embed_tokens: nn.Embedding | None = None
        self.reset_parameters()

    # ------------------------------------------------------------------ init / embedding / vocab
    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def set_embedding(self, weight: torch.Tensor | nn.Embedding) -> None:
        """Attach the target's token embedding [V, H] (shared, not copied, when dtype/device agree)."""
        if isinstance(weight, nn.Module):
            weight = weight.weight
        shape, want = tuple(weight.shape), (self.config.vocab_size, self.config.hidden_size)
        if shape != want:
            field = "vocab_size" if shape[0] != want[0] else "hidden_size"
            raise DraftsmithError(
                f"drafter field '{field}': the target embedding is {list(shape)}, the drafter needs "
                f"[vocab_size={want[0]}, hidden_size={want[1]}]"
            )
        self.embed_tokens = _frozen_embedding(weight.to(self.fc.weight.device))

    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor | None = None) -> None:
        """Install a draft vocab (d2t offsets; t2d derived when not given)."""
        d2t = torch.as_tensor(d2t, dtype=torch.int64)
        if d2t.numel() != self.config.draft_vocab_size:
            raise DraftsmithError(
                f"drafter field 'draft_vocab_size': d2t has {d2t.numel()} entries, "
                f"the drafter has {self.config.draft_vocab_size}"
            )
        check_mappings(d2t, t2d, self.config.vocab_size)
        if t2d is None:
            t2d = torch.zeros(self.config.vocab_size, dtype=torch.bool)
            t2d[d2t + torch.arange(d2t.numel())] = True
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d.to(torch.bool))

    @property
    def draft_target_ids(self) -> torch.Tensor:
        """int64 [V_d]: the target id of every draft id (SGLang's `hot_token_id`)."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def prune_draft_vocab(self, token_counts: torch.Tensor, draft_vocab_size: int) -> Drafter:
        """A copy of this drafter whose draft vocab keeps only its `draft_vocab_size` most frequent tokens by
        `token_counts` [V] (ties: the lower target id), with their lm_head rows; nothing is retrained.

        Why (docs/LOG.md, 2026-12-01): where the draft head is a round's bandwidth bill (small targets, CPU), a
        smaller head is cheaper K times a round, and cutting a trained head keeps more acceptance than training a
        small one: the demo drafter trained at 8,192 and cut to 4,096 kept τ 3.62 of 3.73 at K=4 (demo prompts),
        the same recipe trained at 4,096 reached 3.44. Draft tokens outside the kept set can no longer be proposed; the target still
        decides every token, so decoding stays lossless."""
        counts = torch.as_tensor(token_counts).to(torch.int64).cpu()
        c = self.config
        if counts.dim() != 1 or counts.numel() != c.vocab_size:
            raise DraftsmithError(
                f"token_counts: expected [{c.vocab_size}] (the target vocab), got shape {tuple(counts.shape)}"
            )
        n = int(draft_vocab_size)
        if not 0 < n <= c.draft_vocab_size:
            raise DraftsmithError(
                f"draft_vocab_size: {n} must be in 1..{c.draft_vocab_size} (the drafter's draft vocab size)"
            )
        tids = self.draft_target_ids.cpu()
        order = torch.sort(counts[tids], descending=True, stable=True).indices[:n]
        keep = torch.sort(order).values  # draft ids kept, in increasing target-id order (the d2t convention)
        cfg = c.replace(draft_vocab_size=n)
        out = type(self)(cfg).to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)
        sd = {k: v for k, v in self.trainable_state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
        out.load_state_dict(sd, strict=False)
        with torch.no_grad():
            out.lm_head.weight.copy_(self.lm_head.weight[keep.to(self.lm_head.weight.device)])
        d2t, t2d = ids_to_mappings(tids[keep], c.vocab_size)
        out.set_draft_vocab(d2t, t2d)
        if self.embed_tokens is not None:
            out.set_embedding(self.embed_tokens.weight)
        return out

    # ------------------------------------------------------------------ forward
    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[.., k*H_t] concatenated aux states (in aux_layer_ids order) -> [.., H]."""
        return self.fc(aux)

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """RoPE inverse frequencies on `device` (fp32, cached per device: call once before CUDA-graph capture)."""
        t = self._inv_freq_by_device.get(device)
        if t is None:
            t = self._inv_freq_by_device[device] = self._inv_freq.to(device)
        return t

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is None:
            raise DraftsmithError(
                "drafter has no token embedding: call set_embedding(target embedding) or "
                "load with Drafter.from_pretrained(path, target=...)"
            )
        return self.embed_tokens(input_ids)

    def rope_table(self, max_len: int, device: torch.device, dtype: torch.dtype):
        """(cos, sin) [max_len, head_dim] for positions 0..max_len-1: rows equal what `forward` computes for
        those positions (same fp32 arithmetic), so a decoder can index them instead (fewer kernels per step)."""
        pos = torch.arange(max_len, device=device)[None]
        cos, sin = rope_cos_sin(self.inv_freq(device), pos, dtype)
        return cos[0], sin[0]

    def forward(
        self,
        input_ids: torch.Tensor | None,
        hidden: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attn_fn: AttnFn | None = None,
        inputs_embeds: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One draft step. input_ids [B,T] (or inputs_embeds [B,T,H]); hidden [B,T,H] = fused aux at
        step 0 or the previous step's output; position_ids [B,T] (default 0..T-1); rope: precomputed
        (cos, sin) [B,T,head_dim] for those positions (rows of `rope_table`), else computed here.
        Returns the pre-norm output [B,T,H]."""
        embeds = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        embeds = embeds.to(hidden.dtype)
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).expand(hidden.shape[0], -1)
        elif position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0).expand(hidden.shape[0], -1)
        if rope is not None:
            cos, sin = rope
        else:
            cos, sin = rope_cos_sin(self.inv_freq(hidden.device), position_ids, hidden.dtype)
        attn_fn = attn_fn or causal_attention
        h = self.layers[0](embeds, hidden, cos, sin, attn_fn)
        for layer in self.layers[1:]:
            h = layer(h, cos, sin, attn_fn)
        return h

    def compute_logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """norm + lm_head: [.., H] -> [.., V_d] draft-vocab logits."""
        return self.lm_head(self.norm(hidden_out))

    # ------------------------------------------------------------------ target fit
    def fit_problems(self, target: Any) -> list[str]:
        """Reasons this drafter cannot serve `target` (a path, a draftsmith Target or a HF config); [] = fits."""
        from draftsmith.target_model.facts import target_facts

        return fit_problems(self.config, target_facts(target))

    def check_fits(self, target: Any) -> None:
        problems = self.fit_problems(target)
        if problems:
            raise DraftsmithError("drafter does not fit the target: " + "; ".join(problems))

    # ------------------------------------------------------------------ io
    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights + d2t/t2d (the embedding is never part of it)."""
        return {k: v for k, v in self.state_dict().items() if k != EMBED_KEY}

    def save_pretrained(self, path: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
        """config.json + model.safetensors in `path` (each written atomically); no embedding."""
        from draftsmith.drafter.formats import save_native

        return save_native(self, path, dtype=dtype)

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, target: Any = None, dtype: torch.dtype | None = None, format: str | None = None
    ) -> Drafter:
        """Load a drafter in any supported layout (draftsmith, sglang/SpecForge/EAGLE, vllm, speculators,
        the official EAGLE-3 release). With `target` (path or Target), check it fits and attach its embedding."""
        from draftsmith.drafter.formats import load_drafter

        return load_drafter(cls, path, target=target, dtype=dtype, format=format)

    @classmethod
    def from_target(
        cls, target: Any, token_counts: torch.Tensor | None = None, dtype: torch.dtype = torch.float32, **overrides: Any
    ) -> Drafter:
        """An untrained drafter sized for `target` (path or Target). H = H_t unless overridden; heads,
        head_dim, RoPE, eps, intermediate size from the target; the target's embedding attached; lm_head
        rows copied from the target's lm_head for the draft vocab (the V_d most frequent ids of
        `token_counts`, or the first V_d ids). Overrides: any DrafterConfig field."""
        from draftsmith.target_model.facts import target_facts, target_tensors

        facts = target_facts(target)
        fields: dict[str, Any] = dict(
            hidden_size=facts["hidden_size"],
            target_hidden_size=facts["hidden_size"],
            intermediate_size=facts["intermediate_size"],
            num_attention_heads=facts["num_attention_heads"],
            num_key_value_heads=facts["num_key_value_heads"],
            head_dim=facts["head_dim"],
            rms_norm_eps=facts["rms_norm_eps"],
            rope_theta=facts["rope_theta"],
            rope_scaling=facts["rope_scaling"],
            max_position_embeddings=facts["max_position_embeddings"],
            hidden_act=facts["hidden_act"],
            vocab_size=facts["vocab_size"],
            draft_vocab_size=min(32000, facts["vocab_size"]),
            num_hidden_layers=1,
            aux_layer_ids=default_aux_layers(facts["num_layers"]),
            target_num_layers=facts["num_layers"],
            target_model_type=facts["model_type"],
            target_name_or_path=facts["name_or_path"],
        )
        if "aux_layer_ids" in overrides and "num_aux" not in overrides:
            fields["num_aux"] = None
        fields.update(overrides)
        cfg = DrafterConfig(**fields)
        problems = fit_problems(cfg, facts)
        if problems:
            raise DraftsmithError("drafter does not fit the target: " + "; ".join(problems))
        model = cls(cfg)
        if token_counts is not None:
            d2t, t2d = build_draft_vocab(token_counts, cfg.draft_vocab_size)
            if t2d.numel() != cfg.vocab_size:
                raise DraftsmithError(f"token_counts: {t2d.numel()} entries, the target vocab has {cfg.vocab_size}")
            model.set_draft_vocab(d2t, t2d)
        embed, head = target_tensors(target)
        model.to(dtype)
        if cfg.hidden_size == facts["hidden_size"]:
            with torch.no_grad():
                model.lm_head.weight.copy_(head[model.draft_target_ids.to(head.device)])
            model.set_embedding(embed)  # shared with the target (its dtype), not copied
        else:
            warnings.warn(
                f"drafter hidden_size {cfg.hidden_size} != target hidden size {facts['hidden_size']}: the "
                "target embedding cannot be used and lm_head stays randomly initialised; attach an "
                "embedding of the drafter's width with set_embedding()",
                stacklevel=2,
            )
        return model

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"H={c.hidden_size}, H_t={c.target_hidden_size}, V={c.vocab_size}, V_d={c.draft_vocab_size}, "
            f"aux_layer_ids(layer-output)={c.aux_layer_ids}, layers={c.num_hidden_layers}"
        )


def default_aux_layers(num_layers: int) -> list[int]:
    from draftsmith.target_model.layers import default_aux_layers as _d

    return _d(num_layers)


def fit_problems(cfg: DrafterConfig, facts: dict[str, Any]) -> list[str]:
    """Compare a drafter config with a target's facts (from `formats.target_facts`)."""
    out = []
    if cfg.vocab_size != facts["vocab_size"]:
        out.append(f"field 'vocab_size': drafter {cfg.vocab_size} != target {facts['vocab_size']}")
    if cfg.target_hidden_size != facts["hidden_size"]:
        out.append(
            f"field 'target_hidden_size': drafter fc expects {cfg.target_hidden_size}-wide aux states, "
            f"target hidden size is {facts['hidden_size']}"
        )
    if cfg.aux_layer_ids is not None:
        n = facts["num_layers"]
        bad = [i for i in cfg.aux_layer_ids if not 0 <= i < n]
        if bad:
            out.append(f"field 'aux_layer_ids': layer-output ids {bad} do not exist in a target with {n} layers")
    return out
