"""Generic target runner through the stock HF module (any decoder-only architecture; slower).

The fast path is `draftsmith.decode.llama.LlamaFamilyForward`. This fallback drives the HF model with a
`DynamicCache`, a 4D additive attention mask (tree or causal) and explicit `position_ids`; the aux states
come from forward hooks on the decoder layers. It runs eagerly (no CUDA graphs) and needs one host sync
per forward (the cache is cropped to the committed length first), so it is only as fast as HF's own
eager decoding — fine for correctness on architectures the compact forward does not cover.

Requirement on the model: it must honour a custom 4D float mask and `position_ids` (Llama-like models
in transformers 5 do; sliding-window / ALiBi / learned-position models may not — their output then
differs from plain decoding, which the greedy-equality check in `draftsmith eval` would show).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftsmith.common.hf import text_config


def _layer_output(output):
    return output[0] if isinstance(output, (tuple, list)) else output


class HFGenericForward:
    """Same interface as LlamaFamilyForward: forward(ids, positions, slots, mask, logits_rows) and compact."""

    def __init__(self, model, layers: torch.nn.ModuleList, aux_layers: Sequence[int], max_len: int):
        from transformers import DynamicCache

        self.model = model
        self.layers = layers
        self.aux_layers = [int(i) for i in aux_layers]
        self.max_len = int(max_len)
        cfg = text_config(model.config)
        self.vocab_size = int(cfg.vocab_size)
        self.hidden_size = int(cfg.hidden_size)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self._cache_cls = DynamicCache
        self.cache = DynamicCache(config=model.config)
        import inspect

        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x
        self._captured: dict[int, torch.Tensor] = {}
        self._handles = []
        for lid in sorted(set(self.aux_layers)):
            self._handles.append(layers[lid].register_forward_hook(self._hook(lid)))

    def _hook(self, lid):
        def fn(_mod, _inp, out):
            self._captured[lid] = _layer_output(out)

        return fn

    def close(self):
        for h in self._handles:
            h.remove()
        self._handles = []

    def _cache_len(self) -> int:
        return int(self.cache.get_seq_length())

    def forward(self, input_ids, positions, slots, mask, logits_rows=None, want_aux=True):
        start = int(slots[0])
        cur = self._cache_len()
        if cur > start:
            self.cache.crop(start - cur)  # negative: drop that many (works across transformers 5.x)
        T = input_ids.shape[0]
        m = mask[:, : start + T]
        minv = torch.finfo(self.dtype).min
        am = torch.zeros(m.shape, dtype=self.dtype, device=self.device).masked_fill(~m, minv)[None, None]
        self._captured.clear()
        kw = {self._cache_kw: self.cache}
        out = self.model(
            input_ids=input_ids[None], position_ids=positions[None], attention_mask=am, use_cache=True, **kw
        )
        logits = out.logits[0]
        if logits_rows is not None:
            logits = logits.index_select(0, logits_rows)
        aux = torch.cat([self._captured[i][0] for i in self.aux_layers], -1) if want_aux else None
        return logits.float(), aux

    def compact(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for layer in getattr(self.cache, "layers", []):
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if t is None or t.numel() == 0:
                    continue
                n = t.shape[2]
                ok = (src < n) & (dst < n)
                s, d = src[ok], dst[ok]
                t.index_copy_(2, d, t.index_select(2, s))

    def reset(self) -> None:
        self.cache = self._cache_cls(config=self.model.config)
