"""`draftsmith pipeline CONFIG.yaml` and `draftsmith demo` (the work is in runner.py and demo.py)."""

from __future__ import annotations

from typing import Optional

import typer

from draftsmith.pipeline.demo import run_demo
from draftsmith.pipeline.runner import plan, run_pipeline


def pipeline_command(
    config: str = typer.Argument(
        ...,
        help="Pipeline YAML: target, out, and the sections regenerate / capture / "
        "train / eval / export (each takes its command's flags). See examples/.",
    ),
    check: bool = typer.Option(
        False, "--check", help="Validate the config and print the stages' commands; run nothing."
    ),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Run directory (overrides the config's 'out')."),
) -> None:
    """Run regenerate -> capture (or online training) -> train -> eval -> export from one config.

    Resumable: a stage whose settings and output are unchanged is skipped, a changed setting reruns that stage
    and every stage after it. Writes RUN/report.md (τ, acceptance, speedup, training curves, serve commands).
    """
    p = plan(config, overrides={"out": out} if out else None)
    log = lambda s: typer.echo(s, err=True)  # noqa: E731
    if check:
        log(f"{config}: valid; {len(p.stages)} stages into {p.run_dir}")
        for i, st in enumerate(p.stages, 1):
            log(f"  [{i}/{len(p.stages)}] draftsmith {st.command} {' '.join(st.argv)}")
        return
    run_pipeline(p, log=log)


def demo_command(
    out: str = typer.Option("runs/demo", "--out", "-o", help="Run directory of the demo."),
    config: Optional[str] = typer.Option(
        None, "--config", "-c", help="Demo recipe (default: examples/pycode-tiny-demo.yaml)."
    ),
    fresh: bool = typer.Option(
        False,
        "--fresh",
        help="Remove the run directory first (default: reuse what is up to date, as `draftsmith pipeline` does).",
    ),
) -> None:
    """The whole pipeline on the bundled demo target on CPU, then τ and the measured speedup.

    Trains a drafter for a few minutes and evaluates it next to the bundled drafter (assets/pycode-tiny-drafter,
    trained on a GPU with examples/pycode-tiny-bundled.yaml), both against the engine's plain decoding.
    """
    run_demo(out=out, config=config, fresh=fresh, log=lambda s: typer.echo(s, err=True))


def register(app: typer.Typer) -> None:
    app.command("pipeline", help=pipeline_command.__doc__)(pipeline_command)
    app.command("demo", help=demo_command.__doc__)(demo_command)
