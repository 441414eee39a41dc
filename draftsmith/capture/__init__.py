"""Capture: the target's aux hidden states through forward hooks (no source edits, CUDA-graph safe), written
into a checksummed, resumable store (`job.run_capture`)."""

from draftsmith.capture.hooks import AuxCapture

__all__ = ["AuxCapture"]
