"""The `draftsmith` command line: one subcommand per pipeline stage.

Each stage owns its commands in `draftsmith/<stage>/cli.py`, exposing `register(app)`; this file only
wires them together, so stages can grow without touching each other. Heavy imports (torch,
transformers) happen inside the commands so that `draftsmith --help` stays fast.
"""

from __future__ import annotations

import importlib
import sys

import typer

from draftsmith import __version__
from draftsmith.common.errors import DraftsmithError

app = typer.Typer(
    name="draftsmith",
    help=(
        "Train, evaluate and ship EAGLE-3 speculative-decoding drafters for any Hugging Face causal LM.\n\n"
        "Pipeline: capture (target hidden states -> store) -> train (drafter) -> eval/generate "
        "(speculative decoding) -> export (SGLang / vLLM / speculators).\n\n"
        "Layer ids: every flag and file names its convention. 'layer-output ids' are 0-based decoder "
        "layer indices (the output of layer k); 'hidden_states ids' are HF output_hidden_states indices "
        "(0 = embeddings, k = output of layer k-1). draftsmith uses layer-output ids internally."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# Stage modules that contribute commands, in pipeline order; each exposes `register(app)`.
STAGE_CLIS = [
    "draftsmith.regenerate.cli",
    "draftsmith.capture.cli",
    "draftsmith.store.cli",
    "draftsmith.drafter.cli",
    "draftsmith.train.cli",
    "draftsmith.decode.cli",
    "draftsmith.export.cli",
    "draftsmith.pipeline.cli",
    "draftsmith.serve.cli",
    "draftsmith.doctor.cli",
]


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"draftsmith {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    pass


from draftsmith.inspect_cli import inspect as _inspect  # noqa: E402

app.command("inspect")(_inspect)

for _mod in STAGE_CLIS:
    importlib.import_module(_mod).register(app)


def main(argv: list[str] | None = None) -> None:
    try:
        app(args=argv, prog_name="draftsmith")
    except DraftsmithError as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
