"""TrainConfig: every setting of one training run, declared once (`draftsmith train` flags, `--config` YAML,
`--help`, validation and `draftsmith.train.train(TrainConfig(...))` all come from it; see draftsmith.common.schema).

Groups: data (what is trained on), drafter (its shape), optim (steps and the optimizer), ttt (the unroll and its
attention), compile, runtime (devices, dtypes), output (run directory, checkpoints), logging (metrics, evaluation).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from draftsmith.common import dtypes
from draftsmith.common.errors import DraftsmithError
from draftsmith.common.schema import (
    AT_LEAST_ONE,
    DEVICE,
    NON_NEGATIVE,
    POSITIVE,
    between,
    check_fields,
    one_of,
    setting,
)


@dataclass
class TrainConfig:
    # -- data
    target: str = setting(
        "",
        group="data",
        flags=("--target", "-t"),
        required=True,
        help="Hugging Face causal LM directory the drafter is for.",
    )
    store: str | None = setting(
        None, group="data", flags=("--store", "-s"), help="Hidden-state store from `draftsmith capture` (offline mode)."
    )
    online: bool = setting(False, group="data", help="Run the target in the loop (no store); needs --data.")
    data: str | None = setting(
        None,
        group="data",
        flags=("--data", "-d"),
        help="Online mode: JSONL or a directory of source files (as for capture).",
    )
    glob: str | None = setting(
        None, group="data", default_help="'**/*.py'", help="Online mode, directory data: which files."
    )
    max_length: int | None = setting(
        None,
        group="data",
        checks=(AT_LEAST_ONE,),
        default_help="min(--batch-tokens, 2048, the target's max_position_embeddings)",
        help="Online mode: tokenizer cut; longer source files are split into windows (as `draftsmith capture`).",
    )
    max_samples: int | None = setting(
        None,
        group="data",
        checks=(AT_LEAST_ONE,),
        default_help="all",
        help="Online mode: use the first N samples (a split file's windows count one each); reading stops there.",
    )
    on_bad: str = setting(
        "error",
        group="data",
        checks=(one_of("error", "skip"),),
        help="Online mode, bad input records: 'error' stops with file:line and reason; 'skip' skips and counts them.",
    )
    online_state_dtype: str = setting(
        "bf16",
        group="data",
        checks=(one_of("bf16", "fp32"),),
        help="Online mode: round the captured states like a bf16 store (bf16) or keep them (fp32).",
    )
    batch_tokens: int = setting(
        2048,
        group="data",
        checks=(AT_LEAST_ONE,),
        help="Token budget of a packed micro-batch; also the max sample length.",
    )
    pad_to_budget: bool | None = setting(
        None,
        group="data",
        default_help="with flex attention",
        help="Pad each packed row to --batch-tokens (static shapes).",
    )
    eval_fraction: float = setting(
        0.02,
        group="data",
        checks=(between(0, 1, hi_open=True),),
        help="Held-out fraction of samples (0: no held-out split).",
    )
    seed: int = setting(0, group="data", help="Seed of the split, shuffling and init.")
    prefetch: int = setting(
        2,
        group="data",
        checks=(NON_NEGATIVE,),
        help="Micro-batches built ahead on a background thread (0: build in the loop).",
    )
    # -- drafter
    draft_vocab_size: int | None = setting(
        None,
        group="drafter",
        checks=(AT_LEAST_ONE,),
        default_help="min(32000, the target vocab)",
        help="Draft vocab V_d: the most frequent loss-masked target tokens.",
    )
    num_layers: int = setting(1, group="drafter", checks=(AT_LEAST_ONE,), help="Drafter decoder layers.")
    aux_layers: list[int] | None = setting(
        None,
        group="drafter",
        checks=(NON_NEGATIVE,),
        default_help="[1, N//2-1, N-4] (distinct <7 layers); offline: store's",
        help="Online mode: aux layers as LAYER-OUTPUT ids, e.g. '1,4,7'.",
    )
    freeze_lm_head: bool = setting(False, group="drafter", help="Keep lm_head at the target's rows of the draft vocab.")
    init_from: str | None = setting(
        None,
        group="drafter",
        help="Start from this drafter's weights (a `draftsmith train` final/, an SGLang / vLLM / speculators "
        "export, an EAGLE-3 release): fine-tune it on new data, e.g. regenerated or served traffic. Its shape "
        "(layers, aux layers, draft vocab) is kept; a fresh optimizer and LR schedule.",
    )
    # -- optim
    steps: int | None = setting(
        None, group="optim", checks=(AT_LEAST_ONE,), default_help="--epochs 1", help="Optimizer steps."
    )
    epochs: float | None = setting(
        None, group="optim", checks=(POSITIVE,), help="Passes over the training split (fractional allowed)."
    )
    lr: float = setting(1e-4, group="optim", checks=(POSITIVE,), help="Peak learning rate.")
    min_lr_ratio: float = setting(
        0.0, group="optim", checks=(between(0, 1),), help="Cosine floor as a fraction of --lr."
    )
    warmup: float = setting(
        0.015, group="optim", checks=(NON_NEGATIVE,), help="Warmup: a fraction of the steps if < 1, else a step count."
    )
    weight_decay: float = setting(0.0, group="optim", checks=(NON_NEGATIVE,), help="AdamW weight decay.")
    beta1: float = setting(0.9, group="optim", checks=(between(0, 1, hi_open=True),), help="AdamW beta1.")
    beta2: float = setting(0.95, group="optim", checks=(between(0, 1, hi_open=True),), help="AdamW beta2.")
    adam_eps: float = setting(1e-8, group="optim", checks=(POSITIVE,), help="AdamW epsilon.")
    grad_clip: float = setting(0.5, group="optim", checks=(NON_NEGATIVE,), help="Gradient-norm clip (0 = off).")
    grad_accum: int = setting(
        1, group="optim", checks=(AT_LEAST_ONE,), help="Micro-batches per optimizer step and rank."
    )
    max_time: float | None = setting(
        None,
        group="optim",
        checks=(NON_NEGATIVE,),
        help="Wall-clock seconds (0: one step): stop after the step that crosses it, "
        "saving a checkpoint and final/ (the LR schedule stays that of --steps; "
        "--resume continues it).",
    )
    # -- ttt
    ttt_steps: int = setting(
        7,
        group="ttt",
        checks=(AT_LEAST_ONE,),
        flags=("--ttt-steps", "-K"),
        aliases=("ttt",),
        help="Training-time-test unroll depth K.",
    )
    step_weight: float = setting(0.8, group="ttt", checks=(POSITIVE,), help="Loss weight of TTT step k is this**k.")
    attn_backend: str = setting(
        "auto",
        group="ttt",
        checks=(one_of("auto", "flex", "chunked", "background"),),
        help="TTT attention: auto (GPU: flex -- with --compile auto the whole unroll -- compiled in a separate "
        "process while the first steps run chunked, then switched to at a step boundary; chunked on CPU), "
        "flex (compiled before step 1), chunked, or background (experimental: the compile in a thread; "
        "torch's tracer is not thread-safe and a step can fail meanwhile).",
    )
    attn_chunk: int = setting(
        0,
        group="ttt",
        checks=(NON_NEGATIVE,),
        default_help="0 = auto: about the longest document, >= 1024 rows on GPU, within a memory budget",
        help="Chunked TTT attention: query rows per chunk.",
    )
    loss_chunk: int = setting(
        16384,
        group="ttt",
        checks=(NON_NEGATIVE,),
        help="Tokens per checkpointed lm_head + loss chunk (0 = the whole row at once).",
    )
    # -- compile
    compile: str = setting(
        "auto",
        group="compile",
        checks=(one_of("auto", "unroll", "step", "on", "off"),),
        help="torch.compile the TTT unroll (forward + backward): auto ('unroll' on one CUDA "
        "process with flex attention; off under torchrun until measured there), unroll "
        "(the K steps as one graph), step (one graph reused by every step: compile time "
        "independent of K), on (= unroll), off. Costs one compile per sequence length, "
        "then runs several times the eager tokens/s (BENCHMARKS.md).",
    )
    # -- runtime
    device: str = setting(
        "auto",
        group="runtime",
        checks=(DEVICE,),
        help="auto (GPU if present; cuda:LOCAL_RANK under torchrun), cpu, cuda.",
    )
    dtype: str = setting(
        "auto",
        group="runtime",
        checks=(one_of(*dtypes.WITH_AUTO),),
        metavar="[auto|fp32|bf16|fp16]",
        help="Autocast dtype: auto (bf16 on GPU, fp32 on CPU), fp32, bf16, fp16.",
    )
    target_dtype: str = setting(
        "auto",
        group="runtime",
        checks=(one_of(*dtypes.WITH_AUTO),),
        metavar="[auto|bf16|fp16|fp32]",
        help="Target weights: auto (bf16 on GPU, fp32 on CPU), bf16, fp16, fp32.",
    )
    fsdp: bool = setting(False, group="runtime", help="Under torchrun: FSDP2 (fully_shard) instead of DDP.")
    trust_remote_code: bool = setting(
        False,
        group="runtime",
        help="Allow running Python code shipped in the target directory (config "
        "auto_map). Off: such a target is refused (DRAFTSMITH_TRUST_REMOTE_CODE=1 "
        "also allows it).",
    )
    # -- output
    out: str = setting(
        "run",
        group="output",
        flags=("--out", "-o"),
        required=True,
        help="Run directory: checkpoints/, final/, metrics.jsonl, training.png.",
    )
    resume: bool = setting(
        False,
        group="output",
        help="Continue from the run directory's latest checkpoint (same loss sequence as an uninterrupted run).",
    )
    save_every: int = setting(
        500,
        group="output",
        checks=(NON_NEGATIVE,),
        help="Checkpoint every N steps (0: only the one always saved at the end).",
    )
    keep_checkpoints: int = setting(2, group="output", checks=(NON_NEGATIVE,), help="Checkpoints kept (0: all).")
    save_dtype: str = setting(
        "fp32", group="output", checks=(one_of("fp32", "bf16", "fp16"),), help="dtype of the final drafter's weights."
    )
    # -- logging
    log_every: int = setting(1, group="logging", checks=(AT_LEAST_ONE,), help="metrics.jsonl line every N steps.")
    eval_every: int = setting(
        0, group="logging", checks=(NON_NEGATIVE,), help="Evaluate every N steps (0: at checkpoints and at the end)."
    )
    eval_max_batches: int = setting(
        50, group="logging", checks=(AT_LEAST_ONE,), help="Held-out micro-batches per evaluation."
    )
    tensorboard: bool = setting(True, group="logging", help="Write TensorBoard events beside metrics.jsonl.")
    plot: bool = setting(True, group="logging", help="Draw training.png from metrics.jsonl at the end.")
    progress: bool = setting(True, group="logging", flags=("--quiet", "-q"), negate=True, help="No progress bar.")

    def __post_init__(self) -> None:
        check_fields(self)

    def check_together(self) -> None:
        """The rules between settings (the command line's; library callers meet the trainer's own checks)."""
        if self.online and not self.data:
            raise DraftsmithError("--online: needs --data FILE_OR_DIR")
        if not self.online and not self.store:
            raise DraftsmithError("--store: required (or --online --data FILE_OR_DIR)")
        if self.steps is not None and self.epochs is not None:
            raise DraftsmithError("--steps and --epochs: give one, not both")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
