"""`draftsmith inspect PATH`: describe a target or a drafter (auto-detected)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

DRAFTER_MARKERS = ("eagle_config", "speculators_model_type", "draft_vocab_size", "draftsmith_drafter")


def _looks_like_drafter(path: Path) -> bool:
    cfg = path / "config.json"
    if not cfg.is_file():
        return (path / "pytorch_model.bin").is_file()
    try:
        raw = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    if not isinstance(raw, dict):
        return False
    archs = " ".join(raw.get("architectures") or [])
    return any(k in raw for k in DRAFTER_MARKERS) or "Eagle" in archs


def inspect(
    path: str = typer.Argument(..., help="A target (HF model directory) or a drafter (any supported layout)."),
    target: Optional[str] = typer.Option(None, "--target", "-t", help="For a drafter: check that it fits this target."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of text."),
    trust_remote_code: bool = typer.Option(
        False,
        "--trust-remote-code",
        help="Allow transformers to run Python "
        "code shipped in the model directory (config auto_map). Off: never "
        "run, and such a config is refused in one line (also "
        "DRAFTSMITH_TRUST_REMOTE_CODE=1).",
    ),
) -> None:
    """Print architecture, layers, hidden size, vocab and aux layers in BOTH id conventions.

    For a drafter: its format, sizes, draft vocab, aux layers, and whether it fits --target (config and
    weights' shapes both checked).
    """
    from draftsmith.target_model.load import trust_remote_code_scope

    p = Path(path)
    if not p.exists():
        from draftsmith.common.errors import DraftsmithError

        raise DraftsmithError(f"{p}: not found (expected a model or drafter directory)")
    with trust_remote_code_scope(trust_remote_code):
        if _looks_like_drafter(p):
            from draftsmith.drafter import inspect_drafter
            from draftsmith.drafter.inspect import format_report

            info = inspect_drafter(str(p), target=target)
            typer.echo(json.dumps(info, indent=2, default=str) if json_out else format_report(info))
            return
        from draftsmith.target_model.inspect import format_target_info, inspect_target

        info = inspect_target(p)
        typer.echo(json.dumps(info, indent=2) if json_out else format_target_info(info))
