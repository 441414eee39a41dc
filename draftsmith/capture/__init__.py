"""Capture: the target's aux hidden states through forward hooks (no source edits, CUDA-graph safe), written
into a checksummed, resumable store (`job.run_capture`)."""

from __future__ import annotations

__all__ = ["AuxCapture"]


def __getattr__(name: str):
    # Lazy: `draftsmith --help` imports every stage's cli module, which must not pull in torch.
    if name == "AuxCapture":
        from draftsmith.capture.hooks import AuxCapture

        return AuxCapture
    raise AttributeError(f"module 'draftsmith.capture' has no attribute {name!r}")
