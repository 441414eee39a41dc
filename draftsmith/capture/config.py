"""CaptureConfig: every setting of one capture job (`draftsmith capture`, `draftsmith.capture.job.run_capture`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CaptureConfig:
    target: str
    data: str
    out: str
    aux_layers: list[int] | None = None  # layer-output ids; None = EAGLE-3 default [1, N//2-1, N-4]
    max_length: int | None = 2048
    dtype: str = "bf16"  # store dtype: bf16 | fp8
    batch_tokens: int = 16384  # padded tokens per forward
    on_bad: str = "error"
    shard_tokens: int | None = None  # default: ~shard_mb of payload per shard
    shard_mb: int = 512
    writers: int = 3  # shard-writing threads (hash + write + fsync overlap the GPU)
    device: str = "auto"
    model_dtype: str = "auto"  # weights: auto = bf16 on GPU, as saved on CPU
    capture_final: bool = True
    cuda_graphs: bool = False
    tp: bool = False
    glob: str | None = None
    split_long: bool | None = None
    add_bos: bool | None = None
    max_samples: int | None = None  # capture only the first N samples (a quick trial run)
    progress: bool = True
