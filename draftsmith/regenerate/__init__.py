"""`draftsmith regenerate`: replace the assistant turns of chat data with the target's own answers.

A drafter learns to predict the target, so it should be trained on what the target writes, not on what some
other model wrote into the dataset (EAGLE-3, SpecForge and speculators all regenerate). See `job.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from draftsmith.common.lazy import lazy_exports

if TYPE_CHECKING:
    from draftsmith.regenerate.job import RegenerateConfig, run_regenerate

__all__ = ["RegenerateConfig", "run_regenerate"]
# torch-free --help: the regenerate CLI imports this package (draftsmith/common/lazy.py)
__getattr__, __dir__ = lazy_exports(__name__, {n: "draftsmith.regenerate.job" for n in __all__})
