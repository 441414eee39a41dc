"""`draftsmith pipeline` and `draftsmith demo` (commands registered here; the work is in runner.py)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    pass
