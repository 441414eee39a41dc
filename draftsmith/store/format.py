"""The hidden-state store's on-disk format.

```
STORE/
  manifest.json                 what produced it + per-shard sha256 (written last: its presence = complete)
  token_counts.safetensors      int64 [V]: loss-masked token frequencies (the draft vocab comes from them)
  plan.json                     the capture settings + shard plan (resume refuses a different plan)
  shards/shard-00000.safetensors  token-packed samples, no padding
  progress/shard-00000.json     written after a shard is committed (sha256, counts): resume skips these
  .lock                         held (flock) by the capture writing the store; holds its pid
```
Each shard's safetensors metadata carries `plan_sha256`, the hash of the capture plan it was written under (the
manifest records it too): a resumed capture reuses a committed shard only if that stamp, its size and its sha256
all match. Readers validate the manifest first (`draftsmith.store.manifest`) and check a shard's sha256 the first
time they open it.

Each shard holds, for its n samples and T tokens (concatenated, no padding):
| tensor | dtype | shape | |
|---|---|---|---|
| `input_ids` | int32 | [T] | |
| `sample_offsets` | int64 | [n+1] | token offsets of each sample in the shard |
| `sample_index` | int64 | [n] | global sample index (consecutive) |
| `loss_spans` | int32 | [S, 2] | [start, end) of loss-masked runs, relative to the sample |
| `span_offsets` | int64 | [n+1] | which spans belong to sample j |
| `aux_hidden_states` | bf16 or float8_e4m3fn | [T, k*H] | aux layer outputs in `aux_layers` order |
| `aux_scale` | uint8 | [T, k] | fp8 only: power-of-two scale exponent + 127 per (token, layer) row |
| `final_hidden_states` | bf16 or float8_e4m3fn | [T, H] | last layer output before the final norm |
| `final_scale` | uint8 | [T] | fp8 only |

The loss mask is stored as runs (a chat sample has ~2 per turn, text one), which costs almost nothing per
token. fp8 rows use a power-of-two scale (e8m0, one byte): for a floating-point format this loses no
relative precision, and keeps fp8 at 4H+8 bytes/token for k=3 — half of SpecForge's 8H+16.
"""

from __future__ import annotations

import numpy as np
import torch

FORMAT_NAME = "draftsmith-hidden-state-store"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PLAN = "plan.json"
TOKEN_COUNTS = "token_counts.safetensors"
SHARD_DIR = "shards"
PROGRESS_DIR = "progress"

STORE_DTYPES = ("bf16", "fp8")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_BIAS = 127


def shard_name(index: int) -> str:
    return f"{SHARD_DIR}/shard-{index:05d}.safetensors"


def progress_name(index: int) -> str:
    return f"{PROGRESS_DIR}/shard-{index:05d}.json"


def bytes_per_token(hidden_size: int, num_aux: int, dtype: str, with_final: bool = True) -> float:
    """Payload bytes per token (ids + states + scales); the loss-mask runs are per sample, not per token."""
    rows = num_aux + (1 if with_final else 0)
    if dtype == "bf16":
        return 4 + 2 * rows * hidden_size
    return 4 + rows * hidden_size + rows


def quantize_fp8_rows(x: torch.Tensor, row_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [T, r*row_size] to fp8 e4m3 with one power-of-two scale per row of `row_size`.

    Returns (q [T, r*row_size] float8_e4m3fn, exponent+127 [T, r] uint8).
    """
    T = x.shape[0]
    xr = x.float().reshape(T, -1, row_size)
    amax = xr.abs().amax(dim=-1).clamp_min(2.0**-100)
    exp = torch.ceil(torch.log2(amax / FP8_MAX)).clamp(-SCALE_BIAS, 127)
    q = (xr * torch.exp2(-exp).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(T, -1), (exp + SCALE_BIAS).to(torch.uint8)


def dequantize_fp8_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    T = q.shape[0]
    r = scale.shape[-1]
    exp = scale.to(torch.float32) - SCALE_BIAS
    x = q.to(torch.float32).reshape(T, r, -1) * torch.exp2(exp).unsqueeze(-1)
    return x.reshape(T, -1).to(dtype)


def mask_to_spans(mask: np.ndarray) -> np.ndarray:
    """bool [L] -> int32 [S, 2] of [start, end) runs of True."""
    m = np.concatenate([[False], np.asarray(mask, dtype=bool), [False]])
    edges = np.flatnonzero(m[1:] != m[:-1])
    return edges.reshape(-1, 2).astype(np.int32)


def spans_to_mask(spans: np.ndarray, length: int) -> np.ndarray:
    out = np.zeros(length, dtype=bool)
    for a, b in np.asarray(spans).reshape(-1, 2):
        out[a:b] = True
    return out


def shard_tensors(first: int, input_ids: list, loss_masks: list, states: dict[str, torch.Tensor]) -> dict:
    """The tensors of one shard holding samples first, first+1, ...: token ids packed without padding, per-sample
    offsets, the loss masks as [start, end) runs, and `states` (aux/final hidden states and their fp8 scales, rows
    already in sample order). Capture and capture-while-serving both write shards through this."""
    n = len(input_ids)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([len(x) for x in input_ids], out=offsets[1:])
    spans = [mask_to_spans(m) for m in loss_masks]
    span_offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([len(x) for x in spans], out=span_offsets[1:])
    return {
        "input_ids": torch.from_numpy(np.concatenate(input_ids).astype(np.int32)),
        "sample_offsets": torch.from_numpy(offsets),
        "sample_index": torch.arange(first, first + n, dtype=torch.int64),
        "loss_spans": torch.from_numpy(np.concatenate(spans).reshape(-1, 2).astype(np.int32)),
        "span_offsets": torch.from_numpy(span_offsets),
        **states,
    }


def shard_record(si: int, first: int, tensors: dict, loss_masks: list, digest: str, nbytes: int) -> dict:
    """The manifest's (and the progress file's) record of shard `si`, once its file is written."""
    return {
        "file": shard_name(si),
        "sha256": digest,
        "bytes": nbytes,
        "first_sample": first,
        "num_samples": len(loss_masks),
        "num_tokens": int(tensors["sample_offsets"][-1]),
        "num_loss_tokens": int(sum(int(np.count_nonzero(m)) for m in loss_masks)),
    }
