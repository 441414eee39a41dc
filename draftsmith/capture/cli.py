"""The `capture` command: run a target over data with forward hooks and write a hidden-state store.

The options, `--config` YAML, help and checks are generated from CaptureConfig (draftsmith/capture/config.py);
`--aux-hidden-states-ids` is the one option of its own (another spelling of --aux-layers)."""

from __future__ import annotations

import inspect
from typing import Any, Optional

import typer

from draftsmith.capture.config import CaptureConfig
from draftsmith.common.errors import DraftsmithError
from draftsmith.common.schema import command_for, convert, fields_of
from draftsmith.target_model.layers import from_hidden_states_ids

DOC = """Capture the target's aux hidden states (and final pre-norm state) into a checksummed, resumable store.

Multi-GPU: `torchrun --nproc-per-node N -m draftsmith capture ...` splits shards across ranks.
Resume: rerun the exact same command after an interruption (even kill -9).
"""

_HIDDEN_STATES_IDS = inspect.Parameter(
    "aux_hidden_states_ids",
    inspect.Parameter.KEYWORD_ONLY,
    annotation=Optional[str],
    default=typer.Option(
        None,
        "--aux-hidden-states-ids",
        metavar="IDS",
        rich_help_panel="Target",
        help="The same as --aux-layers, given as HF output_hidden_states / vLLM / speculators ids "
        "(layer-output id + 1). Mutually exclusive with --aux-layers.",
    ),
)


def _aux_ids(values: dict[str, Any], extras: dict[str, Any]) -> None:
    ids = extras["aux_hidden_states_ids"]
    if ids is None:
        return

    if values.get("aux_layers") is not None:
        raise DraftsmithError("give either --aux-layers (layer-output ids) or --aux-hidden-states-ids, not both")
    layers = convert(fields_of(CaptureConfig)["aux_layers"], ids, "--aux-hidden-states-ids")
    values["aux_layers"] = from_hidden_states_ids(layers, "--aux-hidden-states-ids")


def _run(cfg: CaptureConfig) -> None:
    from draftsmith.capture.job import run_capture  # torch-free --help
    from draftsmith.target_model.load import trust_remote_code_scope  # torch-free --help

    with trust_remote_code_scope(cfg.trust_remote_code):
        run_capture(cfg, log=lambda *a: typer.echo(" ".join(str(x) for x in a), err=True))


capture = command_for(CaptureConfig, _run, stage="capture", doc=DOC, extra=[_HIDDEN_STATES_IDS], adjust=_aux_ids)


def register(app: typer.Typer) -> None:
    app.command("capture", help=DOC)(capture)
