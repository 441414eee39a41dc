"""Capturing aux hidden states with forward hooks — never by editing model source.

`AuxCapture` registers a forward hook on each needed decoder layer; the hook copies the layer's output
(the residual stream, before any final norm) into a buffer slice. Copying into buffers — rather than
keeping Python references — is what makes the same capture work under CUDA graphs: a graph records the
`copy_` kernels when captured, and every replay refills the same static buffers. (The failure this
avoids: Python code that dumps tensors runs only while a graph is being captured, never on replay.)

Two modes:
- eager (default): fresh buffers per forward pass, sized from the first hooked output;
- static: `allocate(batch, seq_len, dtype, device)` once; hooks copy into those fixed buffers
  (required for CUDA graphs: shapes must not change between replays).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftsmith.common.errors import DraftsmithError
from draftsmith.target_model.layers import validate_aux_layers


def _layer_output(output) -> torch.Tensor:
    # Decoder layers return a tensor (transformers 5) or a tuple whose first item is the hidden state.
    return output[0] if isinstance(output, (tuple, list)) else output


class AuxCapture:
    """Capture the outputs of `aux_layers` (layer-output ids) and, optionally, of the last layer.

    After a forward inside `with cap:` — `cap.aux` is [B, T, k*H] in the order of `aux_layers`
    (duplicates allowed: a 6-layer target's default [1, 2, 2] captures layer 2 twice), and `cap.final`
    is the last layer's output [B, T, H] *before* the final norm (the teacher's input).
    """

    def __init__(self, target_or_layers, aux_layers: Sequence[int], capture_final: bool = True):
        layers = getattr(target_or_layers, "layers", target_or_layers)
        if not isinstance(layers, torch.nn.ModuleList):
            raise TypeError("AuxCapture needs a Target or the decoder's ModuleList")
        self.layers = layers
        self.num_layers = len(layers)
        self.aux_layers = validate_aux_layers(aux_layers, self.num_layers)
        self.capture_final = capture_final
        self.final_layer = self.num_layers - 1
        # layer id -> aux slot indices it fills
        self._slots: dict[int, list[int]] = {}
        for slot, lid in enumerate(self.aux_layers):
            self._slots.setdefault(lid, []).append(slot)
        self._handles: list = []
        self._static = False
        self._new_pass = True
        self.aux: torch.Tensor | None = None
        self.final: torch.Tensor | None = None
        self.hidden_size: int | None = None

    @property
    def num_aux(self) -> int:
        return len(self.aux_layers)

    @property
    def hooked_layers(self) -> list[int]:
        ids = set(self._slots)
        if self.capture_final:
            ids.add(self.final_layer)
        return sorted(ids)

    def allocate(self, batch: int, seq_len: int, dtype: torch.dtype, device, hidden_size: int | None = None) -> None:
        """Preallocate static buffers (CUDA-graph-safe mode)."""
        if hidden_size is None:
            hidden_size = self._infer_hidden_size()
        self.hidden_size = hidden_size
        self.aux = torch.zeros(batch, seq_len, self.num_aux * hidden_size, dtype=dtype, device=device)
        self.final = (
            torch.zeros(batch, seq_len, hidden_size, dtype=dtype, device=device) if self.capture_final else None
        )
        self._static = True

    def release(self) -> None:
        """Leave static mode and drop the buffers."""
        self._static = False
        self.aux = self.final = None

    def _infer_hidden_size(self) -> int:
        norm = getattr(self.layers[0], "input_layernorm", None)
        w = getattr(norm, "weight", None)
        if w is None:
            raise DraftsmithError("cannot infer hidden size from the layers; pass hidden_size= to allocate()")
        return int(w.shape[-1])

    # -- hooks ---------------------------------------------------------------------------------------
    def _pre_hook(self, module, args):
        self._new_pass = True

    def _make_hook(self, layer_id: int):
        slots = self._slots.get(layer_id, [])
        is_final = self.capture_final and layer_id == self.final_layer

        def hook(module, args, output):
            h = _layer_output(output)
            if not self._static and self._new_pass:
                self._new_pass = False
                H = h.shape[-1]
                self.hidden_size = H
                self.aux = torch.empty(*h.shape[:-1], self.num_aux * H, dtype=h.dtype, device=h.device)
                self.final = torch.empty_like(h) if self.capture_final else None
            H = self.hidden_size
            if self._static and self.aux.shape[:-1] != h.shape[:-1]:
                raise DraftsmithError(
                    f"AuxCapture static buffers are {tuple(self.aux.shape[:-1])} but layer {layer_id} produced "
                    f"{tuple(h.shape[:-1])}; allocate() with the graph's static shape"
                )
            for s in slots:
                self.aux[..., s * H : (s + 1) * H].copy_(h)
            if is_final:
                self.final.copy_(h)

        return hook

    def __enter__(self) -> AuxCapture:
        if self._handles:
            raise RuntimeError("AuxCapture is already active")
        self._handles.append(self.layers[0].register_forward_pre_hook(self._pre_hook))
        for lid in self.hooked_layers:
            self._handles.append(self.layers[lid].register_forward_hook(self._make_hook(lid)))
        self._new_pass = True
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
