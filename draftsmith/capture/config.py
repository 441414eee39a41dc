"""CaptureConfig: every setting of one capture job, declared once (`draftsmith capture` flags, `--config` YAML,
`--help`, validation and `run_capture(CaptureConfig(...))` all come from it; see draftsmith.common.schema).

Groups: target (the model and how it runs), data (what is read), output (the store written), runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.common import dtypes
from draftsmith.common.schema import AT_LEAST_ONE, DEVICE, NON_NEGATIVE, check_fields, one_of, setting


@dataclass
class CaptureConfig:
    # -- target
    target: str = setting(
        group="target", flags=("--target", "-t"), help="Hugging Face causal LM directory (the model you serve)."
    )
    # -- data
    data: str = setting(
        group="data",
        flags=("--data", "-d"),
        help="JSONL (ShareGPT `conversations`, OpenAI `messages`, or `text` records) or a directory "
        "of source files (e.g. a Python installation: every *.py file is a sample).",
    )
    # -- output
    out: str = setting(
        group="output", flags=("--out", "-o"), help="Store directory to create (or to resume: rerun the same command)."
    )
    # -- target
    aux_layers: list[int] | None = setting(
        None,
        group="target",
        checks=(NON_NEGATIVE,),
        default_help="[1, N//2-1, N-4]; distinct below 7 layers",
        help="Aux layers as LAYER-OUTPUT ids (0-based decoder layer whose output is captured; the HF "
        "output_hidden_states index is this + 1), e.g. '1,15,28'. Any count >= 1.",
    )
    model_dtype: str = setting(
        "auto",
        group="target",
        checks=(one_of(*dtypes.WITH_AUTO),),
        metavar="[auto|bf16|fp16|fp32]",
        help="Target weights dtype: auto (bf16 on GPU, as saved on CPU), bf16, fp16, fp32.",
    )
    trust_remote_code: bool = setting(
        False,
        group="target",
        help="Allow running Python code shipped in the target directory (config "
        "auto_map). Off: such a target is refused (DRAFTSMITH_TRUST_REMOTE_CODE=1 "
        "also allows it).",
    )
    capture_final: bool = setting(
        True,
        group="output",
        flags=("--no-final",),
        negate=True,
        help="Do not store the last layer's (pre-norm) output; training needs it for the teacher.",
    )
    # -- data
    max_length: int | None = setting(
        2048,
        group="data",
        checks=(AT_LEAST_ONE,),
        help="Truncate (or, for source files, split) samples to this many tokens.",
    )
    on_bad: str = setting(
        "error",
        group="data",
        checks=(one_of("error", "skip"),),
        help="Bad input records: 'error' stops with file:line and reason; 'skip' skips and counts them.",
    )
    glob: str | None = setting(None, group="data", default_help="'**/*.py'", help="For a directory: which files.")
    split_long: bool | None = setting(
        None,
        group="data",
        default_help="on for a directory of source files, off for JSONL",
        help="Cut samples longer than --max-length into consecutive windows instead of truncating them.",
    )
    add_bos: bool | None = setting(
        None,
        group="data",
        default_help="the data loader's rule for text samples",
        help="Prepend the tokenizer's BOS token (--add-bos: also to chat samples; --no-add-bos: never).",
    )
    max_samples: int | None = setting(
        None, group="data", checks=(AT_LEAST_ONE,), help="Capture only the first N samples (a quick trial)."
    )
    follow_symlinks: bool = setting(
        False,
        group="data",
        help="For a directory: also read files whose symlinks lead outside it (by "
        "default they are skipped and counted).",
    )
    # -- output
    dtype: str = setting(
        "bf16",
        group="output",
        checks=(one_of("bf16", "fp8"),),
        help="Store dtype for hidden states: bf16 (8H+4 bytes/token for 3 aux layers) or fp8 "
        "(e4m3 with a power-of-two scale per row: 4H+8).",
    )
    shard_tokens: int | None = setting(
        None,
        group="output",
        checks=(AT_LEAST_ONE,),
        default_help="from --shard-mb",
        help="Tokens per shard (overrides --shard-mb).",
    )
    shard_mb: int = setting(512, group="output", checks=(AT_LEAST_ONE,), help="Approximate shard size in MiB.")
    writers: int = setting(
        3,
        group="output",
        checks=(AT_LEAST_ONE,),
        help="Threads writing shards while the GPU runs (host memory: (writers+1) x shard size).",
    )
    # -- runtime
    batch_tokens: int = setting(
        16384,
        group="runtime",
        checks=(AT_LEAST_ONE,),
        help="Padded tokens per forward pass (batch size x longest sample).",
    )
    device: str = setting(
        "auto",
        group="runtime",
        checks=(DEVICE,),
        help="cpu, cuda, cuda:N or auto (GPU if present; under torchrun: cuda:LOCAL_RANK).",
    )
    cuda_graphs: bool = setting(
        False, group="runtime", help="Run the target from CUDA graphs (static shapes, hooks copy into static buffers)."
    )
    tp: bool = setting(
        False,
        group="runtime",
        help="Load the target with tensor parallelism (transformers tp_plan='auto') across torchrun ranks.",
    )
    progress: bool = setting(True, group="runtime", flags=("--quiet", "-q"), negate=True, help="No progress bar.")

    def __post_init__(self) -> None:
        check_fields(self)
