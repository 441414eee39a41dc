"""`draftsmith regenerate`: replace the assistant turns of chat data with the target's own answers.

A drafter learns to predict the target, so it should be trained on what the target writes, not on what some
other model wrote into the dataset (EAGLE-3, SpecForge and speculators all regenerate). See `job.py`.
"""

from draftsmith.regenerate.job import RegenerateConfig, run_regenerate

__all__ = ["RegenerateConfig", "run_regenerate"]
