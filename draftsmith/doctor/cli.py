"""`draftsmith doctor`: say why a drafter's acceptance is low, and prove it with measurements (docs/doctor.md)."""

from __future__ import annotations

import json
from typing import Optional

import typer

from draftsmith.common.errors import DraftsmithError
from draftsmith.doctor.report import format_report, write_plot


def doctor(
    target: str = typer.Option(..., "--target", help="The target model directory (Hugging Face format)."),
    drafter: str = typer.Option(
        ...,
        "--drafter",
        help="The drafter: any layout Drafter.from_pretrained reads "
        "(draftsmith, SGLang/SpecForge, vLLM, speculators, official EAGLE-3) or an export.",
    ),
    prompts: Optional[str] = typer.Option(
        None,
        "--prompts",
        help="Prompts (any `draftsmith eval --prompts` format). "
        "Default: a built-in set of 12 short code and prose prompts.",
    ),
    store: Optional[str] = typer.Option(
        None,
        "--store",
        help="The store the drafter was trained from: its target "
        "hashes and aux layers are checked against T and the drafter.",
    ),
    max_prompts: Optional[int] = typer.Option(None, "--max-prompts", min=1, help="Use at most N prompts."),
    json_out: bool = typer.Option(
        False,
        "--json",
        help="Print one JSON object (checks, acceptance_rate, tau, variants, likely_faults, ...) instead of the table.",
    ),
    draft_tokens: int = typer.Option(4, "--draft-tokens", min=1, help="Chain length K measured (draft tokens/round)."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=4, help="Greedy continuation per prompt."),
    raw: bool = typer.Option(
        False,
        "--raw",
        help="Prompts as plain text even when the tokenizer has a chat template "
        "(the configuration measured; the other way is a variant).",
    ),
    plot: str = typer.Option(
        "doctor_acceptance.png",
        "--plot",
        help="PNG of acceptance by position (configuration and best variant); '' for none.",
    ),
    min_ratio: float = typer.Option(
        1.15,
        "--min-ratio",
        help="A variant is a likely fault when it accepts at least "
        "this many times the configuration's rate, and its gain holds in both prompt "
        "halves above their noise.",
    ),
    device: str = typer.Option("auto", "--device", help="auto (cuda when available) | cpu | cuda[:N]."),
    dtype: str = typer.Option("auto", "--dtype", help="Target dtype: auto (fp32 on CPU, bf16 on CUDA) | fp32 | bf16."),
) -> None:
    """Static checks and measured acceptance of a drafter as configured and under each known mis-wiring (aux ids
    shifted or reordered, final norm, norm_before_residual, d2t as absolute ids, draft vocab, RoPE, chat template);
    names the likely fault and the config change that fixes it."""
    import torch  # torch-free --help

    from draftsmith.doctor.diagnosis import diagnose  # torch-free --help
    from draftsmith.target_model import load_target  # torch-free --help

    if min_ratio < 1.0:
        raise DraftsmithError(f"--min-ratio: must be >= 1.0, got {min_ratio}")
    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    dt = ("fp32" if dev == "cpu" else "bf16") if dtype == "auto" else dtype
    say = (lambda msg: None) if json_out else (lambda msg: typer.secho(msg, err=True, dim=True))
    say(f"loading target {target} ({dt} on {dev})")
    t = load_target(target, dtype=dt, device=dev)
    report = diagnose(
        t,
        drafter,
        prompts_file=prompts,
        store=store,
        max_prompts=max_prompts,
        draft_tokens=draft_tokens,
        max_new_tokens=max_new_tokens,
        raw=raw,
        progress=say,
        ratio=min_ratio,
    )
    if plot:
        report["plot"] = write_plot(report, plot)
    if json_out:
        typer.echo(json.dumps(report))
    else:
        typer.echo(format_report(report))


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)
