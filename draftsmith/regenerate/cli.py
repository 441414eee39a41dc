"""`draftsmith regenerate`: the target's own answers in place of a chat dataset's assistant turns."""

from __future__ import annotations

from typing import Optional

import typer


def regenerate_command(
    target: str = typer.Option(..., "--target", "-t", help="HF target model directory (needs a chat template)."),
    data: str = typer.Option(
        ...,
        "--data",
        "-d",
        help="JSONL of ShareGPT 'conversations' or OpenAI 'messages' "
        "records (a .json file holding one array also works).",
    ),
    out: str = typer.Option(
        ...,
        "--out",
        "-o",
        help="Output JSONL: the same records, assistant turns regenerated, "
        "plus a 'provenance' field. OUT.progress.json makes reruns resume.",
    ),
    max_new_tokens: int = typer.Option(
        512,
        "--max-new-tokens",
        help="Longest answer per assistant turn (tokens); cut answers are counted in provenance.truncated_turns.",
    ),
    temperature: float = typer.Option(
        0.0, "--temperature", help="0 = greedy (the distribution a drafter serving greedy requests sees); > 0 samples."
    ),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling threshold (with --temperature > 0)."),
    batch_size: int = typer.Option(
        32,
        "--batch-size",
        help="Records generated together (left-padded batch). Larger is faster on a GPU until memory runs out.",
    ),
    max_samples: Optional[int] = typer.Option(None, "--max-samples", help="Use the first N input records."),
    on_bad: str = typer.Option(
        "error",
        "--on-bad",
        help="Bad input record: 'error' stops at FILE:LINE: reason; 'skip' skips and counts it (as capture does).",
    ),
    seed: int = typer.Option(0, "--seed", help="Sampling seed."),
    device: str = typer.Option("auto", "--device", help="auto (GPU if present) | cpu | cuda[:N]."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (bf16 on GPU, fp32 on CPU) | bf16 | fp16 | fp32."),
    cache: str = typer.Option(
        "auto",
        "--cache",
        help="KV cache of generate(): auto (static on CUDA, where "
        "transformers compiles the decode step; dynamic on CPU) | dynamic | static.",
    ),
    continue_text: bool = typer.Option(
        False,
        "--continue-text",
        help="Text data (base/code models): each sample's text becomes a prefix of it plus the target's own "
        "continuation (--data: {'text'} JSONL or a directory of source files).",
    ),
    prefix_tokens: str = typer.Option(
        "16:256",
        "--prefix-tokens",
        help="--continue-text: prefix length MIN:MAX tokens, drawn per sample (seeded) at a random offset.",
    ),
    glob: Optional[str] = typer.Option(
        None, "--glob", help="--continue-text with a directory: which files (default '**/*.py')."
    ),
    max_length: int = typer.Option(
        2048, "--max-length", help="--continue-text: source files are cut into windows of this many tokens."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No per-batch progress lines."),
) -> None:
    """Replace every assistant turn with the target's own answer to the conversation before it.

    System, user and tool turns are kept exactly; earlier assistant turns are the target's own when a later one
    is generated. Rerun the same command after an interruption (even kill -9): it continues where it stopped.
    """
    from draftsmith.regenerate.job import RegenerateConfig, run_regenerate  # torch-free --help

    cfg = RegenerateConfig(
        target=target,
        data=data,
        out=out,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        batch_size=batch_size,
        max_samples=max_samples,
        on_bad=on_bad,
        seed=seed,
        device=device,
        dtype=dtype,
        cache=cache,
        continue_text=continue_text,
        prefix_tokens=prefix_tokens,
        glob=glob,
        max_length=max_length,
    )
    rep = run_regenerate(cfg, log=lambda s: typer.echo(s, err=True), progress=not quiet)
    skipped = sum(rep["skipped"].values())
    rate = f", {rep['tokens_per_s']:.0f} tok/s" if rep.get("tokens_per_s") else ""
    typer.echo(
        f"wrote {rep['records']} records to {out} ({rep['new_tokens']} new tokens{rate}; "
        f"{skipped} skipped, {rep['truncated_turns']} answers cut at --max-new-tokens)",
        err=True,
    )


def register(app: typer.Typer) -> None:
    app.command("regenerate", help=regenerate_command.__doc__)(regenerate_command)
