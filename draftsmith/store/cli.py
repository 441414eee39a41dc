"""Commands of the store stage: `store verify`, `store info`, `store export`."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from draftsmith.common.errors import DraftsmithError

store_app = typer.Typer(
    help="Inspect, verify and export hidden-state stores written by `draftsmith capture`.",
    no_args_is_help=True,
)


@store_app.command("verify")
def verify(
    path: str = typer.Argument(..., help="Store directory."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Check every shard's sha256 against the manifest; name any missing or corrupted shard."""
    from draftsmith.store.verify import verify_store  # torch-free --help

    problems = verify_store(path, progress=not quiet)
    if problems:
        for p in problems:
            typer.secho(f"{Path(path) / p}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)
    typer.echo(f"{path}: OK")


@store_app.command("info")
def info(
    path: str = typer.Argument(..., help="Store directory."),
    json_out: bool = typer.Option(False, "--json", help="Print the manifest as JSON."),
) -> None:
    """Summarize a store: target, aux layers in both conventions, dtype, counts, bytes/token."""
    from draftsmith.store import HiddenStateStore  # torch-free --help

    s = HiddenStateStore.open(path)
    m = s.manifest
    if json_out:
        typer.echo(json.dumps(m, indent=2))
        return
    t = m.get("target", {})
    rows = [
        ("target", f"{t.get('path')} ({t.get('model_type')}, {t.get('num_layers')} layers, H={m['hidden_size']})"),
        ("aux layers", f"layer-output ids {m['aux_layers']} = hidden_states ids {m.get('aux_hidden_states_ids')}"),
        ("final state", "last layer output, pre-norm" if m.get("has_final") else "not stored"),
        ("dtype", m["dtype"]),
        ("samples", f"{m['num_samples']:,}"),
        ("tokens", f"{m['num_tokens']:,} ({m.get('num_loss_tokens', 0):,} in the loss mask)"),
        ("shards", str(len(m["shards"]))),
        ("bytes/token", str(m.get("bytes_per_token"))),
    ]
    for k, v in rows:
        typer.echo(f"{k:>12}: {v}")


@store_app.command("export")
def export(
    path: str = typer.Argument(..., help="Store directory."),
    format: str = typer.Option(
        ..., "--format", help="Output layout: 'speculators' (vLLM speculators 0.9 offline training data)."
    ),
    out: str = typer.Option(..., "--out", "-o", help="Output directory (must not exist)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Write a store in another trainer's layout (for side-by-side comparisons on identical data)."""
    from draftsmith.store import HiddenStateStore  # torch-free --help

    if format != "speculators":
        raise DraftsmithError(f"--format: {format!r} is not supported (choose: speculators)")
    from draftsmith.export.speculators_store import export_speculators, summary_lines  # torch-free --help

    summary = export_speculators(HiddenStateStore.open(path), out, progress=not quiet)
    for line in summary_lines(summary):
        typer.echo(line)


def register(app: typer.Typer) -> None:
    app.add_typer(store_app, name="store")
