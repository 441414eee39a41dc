"""User data -> tokenized samples with loss masks (the first stage of the pipeline).

    from draftsmith.data import load_samples, load_prompts, Sample, DataReport
    samples, report = load_samples(path, tokenizer, max_length=2048, on_bad="skip")

See `load_samples` for the accepted inputs and `draftsmith.data.chat` for how assistant-only loss masks
are derived from any chat template.
"""

from draftsmith.data.loader import DataReport, Sample, load_prompts, load_samples, token_counts_from_samples

__all__ = ["DataReport", "Sample", "load_prompts", "load_samples", "token_counts_from_samples"]
