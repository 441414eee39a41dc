"""The EAGLE-3 draft model (docs/eagle3.md#the-drafter): `Drafter`, `DrafterConfig`, `build_draft_vocab`.

Usage (training / decoding)
---------------------------
```python
from draftsmith.drafter import Drafter, DrafterConfig, build_draft_vocab

d = Drafter.from_target("path/to/target", token_counts=store.token_counts(), draft_vocab_size=32000)
#   H = target hidden size, heads/head_dim/RoPE/eps/intermediate from the target, aux_layer_ids default
#   [1, N//2-1, N-4] (LAYER-OUTPUT ids, draftsmith's convention), target embedding attached (frozen),
#   lm_head = target lm_head rows of the draft vocab. Any DrafterConfig field can be overridden:
#   Drafter.from_target(t, aux_layer_ids=[1, 4, 7], num_hidden_layers=2, dtype=torch.bfloat16)
#   `t` may be a path or a draftsmith Target (its .config/.embed_tokens/.lm_head are used).

h = d.fuse(aux)                       # step 0: aux [B,T,k*H_t] (AuxCapture order) -> [B,T,H]
out = d(input_ids, h, position_ids)   # [B,T] ids, [B,T,H] hidden, [B,T] positions -> [B,T,H] PRE-norm output
logits = d.compute_logits(out)        # norm + lm_head -> [B,T,V_d] draft-vocab logits
out2 = d(next_ids, out, position_ids + 1)   # later steps feed the previous pre-norm output back
tok = d.draft_to_target(logits.argmax(-1))  # draft id -> target id (target = draft + d2t[draft])
d.draft_target_ids                    # int64 [V_d]: target id of every draft id (columns for the teacher)
d.t2d                                 # bool [V]: target id is in the draft vocab

d.save_pretrained(run_dir / "final")  # config.json + model.safetensors (atomic), never the embedding
d = Drafter.from_pretrained(path, target=target_path_or_Target)  # checks fit, attaches the embedding
#   (also reads SGLang/SpecForge, vLLM, speculators and official EAGLE-3 checkpoints)
d.trainable_state_dict()              # == d.state_dict(): weights + d2t/t2d, no embedding
```

The attention hook: every attention module computes q, k, v, applies RoPE at `position_ids` and calls
`attn_fn(q, k, v, layer_idx)` with q [B, n_heads, T, d], k/v [B, n_kv_heads, T, d] (GQA: NOT repeated),
expecting [B, n_heads, T, d]; layer_idx 0 is the midlayer. Default (`attn_fn=None`): causal SDPA with
kv heads repeated (`draftsmith.drafter.causal_attention`; if k is longer than q the causal mask is aligned
bottom-right, so a KV-cache attn_fn can prepend cached keys and fall back to it). TTT passes its own
(step-0 causal prefix + diagonals); decoding passes a cache/tree-mask one. See
tests/test_drafter.py::test_kv_cache_attn_fn_matches_full_forward for a 10-line KV-cache example.

Notes: the embedding is never saved, with one exception: a drafter narrower than its target
(hidden_size != target_hidden_size) cannot use the target's embedding, so its own is saved/loaded with it
(as EAGLE's cnets.py does). The embedding is a non-persistent buffer of `d.embed_tokens` (moved by `.to()`, not in
`parameters()` / `state_dict()`); with DDP pass `broadcast_buffers=False` (d2t/t2d/embedding never change).
`d.to(torch.bfloat16)` keeps d2t/t2d integer and RoPE frequencies fp32. RoPE cos/sin are computed per call;
`d.inv_freq(device)` caches the frequencies per device (call once before CUDA-graph capture).
Layer ids: `d.config.aux_layer_ids` are layer-output ids; `d.config.aux_hidden_states_ids` the same + 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from draftsmith.common.lazy import lazy_exports

if TYPE_CHECKING:
    from draftsmith.drafter.config import DrafterConfig
    from draftsmith.drafter.model import Drafter, causal_attention
    from draftsmith.drafter.vocab import build_draft_vocab

__all__ = ["Drafter", "DrafterConfig", "build_draft_vocab", "causal_attention", "inspect_drafter"]
# torch-free --help: the drafter CLI (prune-vocab) imports this package (draftsmith/common/lazy.py)
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "Drafter": "draftsmith.drafter.model",
        "causal_attention": "draftsmith.drafter.model",
        "DrafterConfig": "draftsmith.drafter.config",
        "build_draft_vocab": "draftsmith.drafter.vocab",
    },
)


def inspect_drafter(path, target=None) -> dict:
    """Format, sizes, draft vocab, aux layers in both conventions, fit with `target` (see `inspect.py`)."""
    from draftsmith.drafter.inspect import inspect_drafter as _inspect

    return _inspect(path, target)
