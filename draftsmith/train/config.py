"""TrainConfig: every setting of one training run (`draftsmith train`, `draftsmith.train.train`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class TrainConfig:
    target: str = ""
    out: str = "run"
    store: str | None = None
    online: bool = False
    data: str | None = None
    steps: int | None = None
    epochs: float | None = None
    ttt_steps: int = 7
    step_weight: float = 0.8  # loss weight of TTT step k is step_weight**k
    draft_vocab_size: int | None = None  # None: min(32000, target vocab)
    num_layers: int = 1  # drafter decoder layers
    aux_layers: list[int] | None = None  # layer-output ids (online mode; offline takes the store's)
    lr: float = 1e-4
    min_lr_ratio: float = 0.0
    warmup: float = 0.015  # fraction of total steps if < 1, else a step count
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 0.5
    batch_tokens: int = 2048  # token budget of one packed micro-batch (also the max sample length)
    grad_accum: int = 1
    eval_fraction: float = 0.02
    eval_max_batches: int = 50
    eval_every: int = 0  # 0: at checkpoints and at the end
    save_every: int = 500
    keep_checkpoints: int = 2
    log_every: int = 1
    seed: int = 0
    freeze_lm_head: bool = False
    fsdp: bool = False
    device: str = "auto"
    dtype: str = "auto"  # autocast dtype: auto = bf16 on CUDA, fp32 on CPU
    target_dtype: str = "auto"  # target weights: auto = bf16 on CUDA, fp32 on CPU
    attn_backend: str = "auto"  # auto (flex on CUDA, chunked on CPU) | chunked | flex
    attn_chunk: int = 0  # chunked TTT attention query rows per chunk; 0 = sized by a memory budget (auto_chunk)
    loss_chunk: int = 16384  # tokens per checkpointed lm_head+CE chunk (0: whole row at once)
    compile: str = "auto"  # torch.compile of the TTT unroll: auto (= unroll on one CUDA process) | unroll (one graph) | step (one graph per step kind) | on (= unroll) | off
    pad_to_budget: bool | None = None  # pad each packed row to batch_tokens (static shapes); None: with flex
    max_length: int | None = None  # online: tokenizer cut (default min(batch_tokens, 2048, target's positions))
    max_time: float | None = None  # seconds: stop after the step that crosses it (checkpoint + final drafter)
    on_bad: str = "error"
    glob: str | None = None  # online, directory data: which files
    online_state_dtype: str = "bf16"  # online: round captured states like a bf16 store ("fp32": keep)
    resume: bool = False
    tensorboard: bool = True
    plot: bool = True
    progress: bool = True
    prefetch: int = 2
    save_dtype: str = "fp32"  # final drafter weights

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
