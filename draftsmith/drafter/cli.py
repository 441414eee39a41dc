"""`draftsmith prune-vocab`: cut a trained drafter's draft vocab to its most frequent tokens (no retraining)."""

from __future__ import annotations

from typing import Optional

import typer

from draftsmith.common.errors import DraftsmithError


def prune_vocab_cmd(
    drafter: str = typer.Argument(..., help="Drafter directory, in any layout draftsmith reads."),
    draft_vocab_size: int = typer.Option(
        ..., "--draft-vocab-size", help="Rows to keep: the drafter's N most frequent draft tokens by --data/--store."
    ),
    out: str = typer.Option(
        ..., "--out", "-o", help="Output directory (draftsmith's own layout): new or empty unless --overwrite."
    ),
    target: str = typer.Option(
        ..., "--target", "-t", help="Target model directory: its tokenizer counts --data; the drafter must fit it."
    ),
    data: Optional[str] = typer.Option(
        None,
        "--data",
        help="Text to count tokens on, as `draftsmith train --data` reads it (JSONL records, a file, or a directory "
        "of files matching --glob). Use text like what the drafter will draft: the target's own outputs are best.",
    ),
    glob: Optional[str] = typer.Option(None, "--glob", help="Files of a --data directory (default '**/*.py')."),
    max_samples: Optional[int] = typer.Option(None, "--max-samples", help="Count on at most this many samples."),
    store: Optional[str] = typer.Option(
        None, "--store", help="Count with a capture store's token_counts instead of --data (its loss tokens)."
    ),
    save_dtype: str = typer.Option("bf16", "--save-dtype", help="Weights dtype written: bf16, fp16 or fp32."),
    on_bad: str = typer.Option("skip", "--on-bad", help="Bad --data records: skip (default) or error."),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Write into a non-empty --out (its config.json and model.safetensors are replaced)."
    ),
) -> None:
    """Keep only the --draft-vocab-size most frequent tokens of DRAFTER's draft vocab (lm_head rows, d2t, t2d).

    Where the draft head is what a round pays for (a small target, a CPU), a smaller head costs less K times a
    round; cutting a head trained at a larger size kept more acceptance than training at the small size (docs/LOG.md).
    Decoding stays lossless: the target decides every token; tokens cut from the draft vocab are never proposed.
    Prints the share of the counted tokens the kept draft vocab covers, before and after.
    """
    import torch  # torch-free --help

    from draftsmith.common.dtypes import parse_dtype
    from draftsmith.drafter import Drafter

    if (data is None) == (store is None):
        raise DraftsmithError("prune-vocab: give exactly one of --data or --store (what the token counts come from)")
    from pathlib import Path

    if Path(out).exists() and any(Path(out).iterdir()) and not overwrite:
        raise DraftsmithError(f"--out {out}: exists and is not empty; choose a new directory or pass --overwrite")
    d = Drafter.from_pretrained(drafter, target=target)
    V = d.config.vocab_size
    if store is not None:
        from draftsmith.store import HiddenStateStore

        counts = HiddenStateStore.open(store).token_counts()
    else:
        from transformers import AutoTokenizer

        from draftsmith.data import load_samples, token_counts_from_samples

        tok = AutoTokenizer.from_pretrained(target)
        samples, _ = load_samples(data, tok, on_bad=on_bad, glob=glob, max_samples=max_samples)
        if not samples:
            raise DraftsmithError(f"--data {data}: no samples read")
        counts = token_counts_from_samples(samples, V)  # loss-masked: the tokens a drafter is trained to propose
    counts = torch.as_tensor(counts).to(torch.int64)
    before = float(counts[d.draft_target_ids.cpu()].sum() / counts.sum().clamp(min=1))
    pruned = d.prune_draft_vocab(counts, draft_vocab_size)
    after = float(counts[pruned.draft_target_ids.cpu()].sum() / counts.sum().clamp(min=1))
    pruned.save_pretrained(out, dtype=parse_dtype(save_dtype, "--save-dtype", allow_auto=False))
    typer.echo(
        f"{drafter}: draft vocab {d.config.draft_vocab_size} -> {draft_vocab_size} rows -> {out}; "
        f"coverage of the counted tokens {before:.3f} -> {after:.3f}"
    )


def register(app: typer.Typer) -> None:
    app.command("prune-vocab")(prune_vocab_cmd)
