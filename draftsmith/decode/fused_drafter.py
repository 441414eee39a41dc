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
        for lin in (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj):
            for t in (lin.weight, lin.bias):
                if t is not None:
                    out.append((t, t._version, t.data_ptr()))
    return out


def is_stale(view: nn.Module) -> bool:
    """True when a weight the view copied has changed since (an optimizer step, load_state_dict, .to()): every
    in-place change bumps a tensor's version counter; a move replaces its storage."""
    src = getattr(view, "_fused_from", None)
    return src is not None and any(t._version != v or t.data_ptr() != ptr for t, v, ptr in src)


__all__ = ["fused_for_decoding", "is_stale"]
