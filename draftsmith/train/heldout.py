"""Held-out evaluation of ANY EAGLE-3 drafter with exactly the trainer's TTT/teacher code.

`evaluate_drafter(drafter, target, store, sample_ids, ...)` scores a drafter on store samples the way
`draftsmith train` scores its eval split (`Trainer._evaluate`): the same packing (`data.pack_rows` with
the token budget, at most `max_batches` rows), the same micro-batches (`data.build_micro_batch`, padded to
128-token blocks when the flex backend is used, as the trainer does), the same teacher
(`ttt.compute_teacher`: the target's final norm + lm_head on the stored pre-norm final states, softmax over
the drafter's draft-vocab columns) and the same K-step unroll (`trainer.TTTModel` -> `ttt.ttt_unroll`),
under `torch.no_grad()`. Returned keys are the trainer's eval keys without the `eval_` prefix:
`loss` (mean over rows of the weighted TTT loss), `loss_k`, `acc`, `cond_acc`, `tau_sim`
(= sum_k prod_{i<=k} acc_i), `tau_sim_cond`, `valid_tokens`, plus `num_rows`, `num_samples`.

`heldout_split(store, seed, eval_fraction)` is the trainer's own `data.split_train_eval` on the store's
sample count — the split `draftsmith train --seed S --eval-fraction F` holds out.

So a drafter trained elsewhere (e.g. by speculators, loaded with `Drafter.from_pretrained`, which detects the
speculators layout) is scored with the same code on the same samples as ours.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from draftsmith.train.batches import build_micro_batch, pack_rows, source_lengths, split_train_eval
from draftsmith.train.trainer import TrainConfig, TTTModel, amp_dtype, forward_micro_batch
from draftsmith.train.ttt import TTTStats

__all__ = ["heldout_split", "open_store", "evaluate_drafter", "eval_rows"]


def heldout_split(store_or_n, seed: int = 0, eval_fraction: float | None = None) -> tuple[list[int], list[int]]:
    """(train sample ids, held-out sample ids) exactly as `draftsmith train` splits a store of this size
    (`data.split_train_eval(len(store), eval_fraction, seed)`). eval_fraction None: the trainer's default."""
    n = store_or_n if isinstance(store_or_n, int) else len(store_or_n)
    if eval_fraction is None:
        eval_fraction = TrainConfig.eval_fraction
    return split_train_eval(n, eval_fraction, seed)


def open_store(path: str | os.PathLike, device: torch.device | str | None = None):
    """Open a store as the trainer does: fp32 on CPU, bf16 on CUDA."""
    from draftsmith.store import HiddenStateStore

    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return HiddenStateStore.open(path, dtype=torch.float32 if dev.type == "cpu" else torch.bfloat16)


def eval_rows(store, sample_ids: Sequence[int], batch_tokens: int, max_batches: int | None = None) -> list[list[int]]:
    """The trainer's packed eval rows: `pack_rows(sample_ids, lengths, batch_tokens)[:max_batches]`."""
    rows = pack_rows(list(sample_ids), source_lengths(store), batch_tokens)
    return rows[:max_batches] if max_batches is not None else rows


@torch.no_grad()
def evaluate_drafter(
    drafter,
    target,
    store,
    sample_ids: Sequence[int],
    ttt_steps: int = 7,
    batch_tokens: int = TrainConfig.batch_tokens,
    device: torch.device | str | None = None,
    *,
    step_weight: float = TrainConfig.step_weight,
    max_batches: int | None = TrainConfig.eval_max_batches,
    dtype: str = "auto",
    attn_backend: str = "auto",
    attn_chunk: int = TrainConfig.attn_chunk,
    loss_chunk: int = TrainConfig.loss_chunk,
    pad_to_budget: bool | None = None,
) -> dict:
    """Score `drafter` on the store samples `sample_ids` (see the module docstring). Returns the metrics dict.

    `target`: a loaded draftsmith Target (final_norm, lm_head). `drafter` must carry its embedding (load it with
    `Drafter.from_pretrained(path, target=target)`); it is moved to `device` and put in eval mode. The store
    should be opened as the trainer opens it (`open_store`: fp32 on CPU, bf16 on CUDA) to reproduce its numbers.
    max_batches: the trainer's `eval_max_batches` cap (None: all rows)."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = TrainConfig(
        ttt_steps=ttt_steps,
        step_weight=step_weight,
        attn_backend="flex" if attn_backend == "background" else attn_backend,
        attn_chunk=attn_chunk,
        loss_chunk=loss_chunk,
        batch_tokens=batch_tokens,
    )
    drafter = drafter.to(dev)
    model = TTTModel(drafter, cfg)
    model.eval()
    amp = amp_dtype(dtype, dev)
    backend = (
        attn_backend if attn_backend not in ("auto", "background") else ("flex" if dev.type == "cuda" else "chunked")
    )
    pad = pad_to_budget if pad_to_budget is not None else backend == "flex"
    pad_to = (-(-batch_tokens // 128) * 128) if pad else 1  # = Trainer._pad_to

    lm_w = target.lm_head.weight
    d2t_ids = drafter.draft_target_ids.to(lm_w.device)
    t2d = drafter.t2d.to(lm_w.device)
    rows = eval_rows(store, sample_ids, batch_tokens, max_batches)
    total, loss_sum, n = None, 0.0, 0
    for row in rows:
        mb = build_micro_batch(store, row, batch_tokens, with_states=True, pad_to=pad_to).to(dev)
        loss, stats = forward_micro_batch(model, mb, target, lm_w, d2t_ids, t2d, amp)
        total = stats if total is None else total + stats
        loss_sum += float(loss)
        n += 1
    if total is None:
        total = torch.zeros(5, ttt_steps, dtype=torch.float64)
    st = TTTStats.from_tensor(total.double().cpu())
    m = st.metrics()
    m["loss"] = loss_sum / max(1, n)
    m["num_rows"] = n
    m["num_samples"] = sum(len(r) for r in rows)
    m["ttt_steps"] = ttt_steps
    m["batch_tokens"] = batch_tokens
    return m


def tau_sim(acc: Sequence[float]) -> float:
    """sum_k prod_{i<=k} acc_i (the simulated acceptance length of `TTTStats.metrics`)."""
    tau, prod = 0.0, 1.0
    for a in acc:
        prod *= a
        tau += prod
    return tau
