"""Running the target's forward from CUDA graphs, with aux capture that survives replay.

One graph per static batch shape [B, L]. Inputs are copied into a static `input_ids` buffer before
replay; `AuxCapture` in static mode owns the output buffers, so the hooks' `copy_` kernels are part of
the graph and refill them on every replay. No attention mask is passed: batches are right-padded, and
under a causal mask a real token never attends to a pad that comes after it, so outputs at real
positions are exactly those of the unpadded sequence (and the mask-building code, which may sync with
the host, stays out of the graph).
"""

from __future__ import annotations

import torch

from draftsmith.capture.hooks import AuxCapture


class GraphedCapture:
    """Capture aux states through CUDA-graph replays of `target.decoder` for one static shape."""

    def __init__(self, target, aux_layers, batch: int, seq_len: int, capture_final: bool = True, warmup: int = 2):
        if not torch.cuda.is_available():
            raise RuntimeError("GraphedCapture needs CUDA")
        self.target = target
        self.device = target.device
        self.batch, self.seq_len = batch, seq_len
        self.cap = AuxCapture(target, aux_layers, capture_final=capture_final)
        self.cap.allocate(batch, seq_len, target.dtype, self.device, hidden_size=target.hidden_size)
        self.input_ids = torch.zeros(batch, seq_len, dtype=torch.long, device=self.device)
        self.graph = torch.cuda.CUDAGraph()
        decoder = target.decoder
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(stream), self.cap:
            for _ in range(warmup):
                decoder(input_ids=self.input_ids, use_cache=False)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.no_grad(), self.cap, torch.cuda.graph(self.graph):
            decoder(input_ids=self.input_ids, use_cache=False)

    def __call__(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replay on `input_ids` [B, L] (right-padded to the static shape). Returns the static buffers."""
        self.input_ids.copy_(input_ids, non_blocking=True)
        self.graph.replay()
        return self.cap.aux, self.cap.final


def bucket_seq_len(length: int, max_length: int, multiple: int = 128) -> int:
    """Round a batch's longest length up to a bucket (few graphs, little padding)."""
    b = multiple
    while b < length:
        b *= 2
    return min(max(b, multiple), max(max_length, length))
