"""Capture: the target's aux hidden states through forward hooks (no source edits, CUDA-graph safe), written
into a checksummed, resumable store (`job.run_capture`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from draftsmith.common.lazy import lazy_exports

if TYPE_CHECKING:
    from draftsmith.capture.hooks import AuxCapture

__all__ = ["AuxCapture"]
# torch-free --help: `draftsmith --help` imports every stage's cli module, and with it this package
__getattr__, __dir__ = lazy_exports(__name__, {"AuxCapture": "draftsmith.capture.hooks"})
