"""Draft vocabulary: the V_d most frequent target tokens, and its two mappings (docs/eagle3.md#the-drafter).

- `d2t` int64 [V_d]: offsets, `target_id = draft_id + d2t[draft_id]` (the EAGLE-3 / SGLang / vLLM /
  speculators convention; SGLang's `hot_token_id` is `d2t + arange(V_d)`).
- `t2d` bool [V]: `t2d[target_id]` is True iff the target token is in the draft vocab.
Draft ids are assigned in increasing target-id order, so `d2t` is non-decreasing and `d2t[0] >= 0`.
"""

from __future__ import annotations

import torch

from draftsmith.common.errors import DraftsmithError


def build_draft_vocab(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for the `draft_vocab_size` most frequent tokens; ties broken by the lower token id."""
    counts = torch.as_tensor(token_counts)
    if counts.dim() != 1:
        raise DraftsmithError(f"token_counts: expected a 1-D tensor [vocab_size], got shape {tuple(counts.shape)}")
    vocab_size = counts.numel()
    if not 0 < int(draft_vocab_size) <= vocab_size:
        raise DraftsmithError(
            f"draft_vocab_size: {draft_vocab_size} must be in 1..{vocab_size} (the target vocab size)"
        )
    # a stable descending sort keeps lower ids first among equal counts
    order = torch.sort(counts.to(torch.int64), descending=True, stable=True).indices
    ids = torch.sort(order[: int(draft_vocab_size)]).values
    return ids_to_mappings(ids, vocab_size)


def identity_draft_vocab(vocab_size: int, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `draft_vocab_size` target ids (used when no token statistics are given)."""
    if not 0 < int(draft_vocab_size) <= int(vocab_size):
        raise DraftsmithError(
            f"draft_vocab_size: {draft_vocab_size} must be in 1..{vocab_size} (the target vocab size)"
        )
    return ids_to_mappings(torch.arange(int(draft_vocab_size)), int(vocab_size))


def ids_to_mappings(target_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) from the sorted target ids that make up the draft vocab."""
    ids = torch.as_tensor(target_ids, dtype=torch.int64)
    d2t = ids - torch.arange(ids.numel(), dtype=torch.int64)
    t2d = torch.zeros(int(vocab_size), dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def check_mappings(d2t: torch.Tensor, t2d: torch.Tensor | None, vocab_size: int, where: str = "drafter") -> None:
    """Raise DraftsmithError unless d2t/t2d describe one consistent draft vocabulary of the target."""
    v_d = d2t.numel()
    target_ids = d2t.to(torch.int64) + torch.arange(v_d, dtype=torch.int64)
    if v_d and (int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab_size):
        raise DraftsmithError(f"{where}: field 'd2t' maps draft ids outside the target vocab 0..{vocab_size - 1}")
    if torch.unique(target_ids).numel() != v_d:
        raise DraftsmithError(f"{where}: field 'd2t' maps two draft ids to the same target id")
    if t2d is not None:
        if t2d.numel() != vocab_size:
            raise DraftsmithError(f"{where}: field 't2d' has {t2d.numel()} entries, the target vocab has {vocab_size}")
        expect = torch.zeros(vocab_size, dtype=torch.bool)
        expect[target_ids] = True
        if not torch.equal(t2d.to(torch.bool), expect):
            raise DraftsmithError(
                f"{where}: fields 't2d' and 'd2t' disagree about which target ids are in the draft vocab"
            )
