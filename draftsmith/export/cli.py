"""`draftsmith export`: write a drafter in the layout SGLang, vLLM or speculators loads."""

from __future__ import annotations

import warnings
from typing import Optional

import typer

from draftsmith.common.errors import DraftsmithError


def export_cmd(
    drafter: str = typer.Argument(
        ...,
        help="Drafter directory, in any layout draftsmith reads (its own, sglang/SpecForge/EAGLE, vllm, speculators).",
    ),
    format: str = typer.Option(
        ..., "--format", "-f", help="Target layout: sglang (also EAGLE/SpecForge/ModelOpt), vllm, or speculators."
    ),
    out: str = typer.Option(
        ...,
        "--out",
        "-o",
        help="Output directory: new, empty, or an earlier draftsmith export "
        "of the same --format (recognised by its draftsmith_export.json); anything else is "
        "refused without --overwrite.",
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Write into a non-empty --out that is not an earlier "
        "export of this format, replacing its config.json and model.safetensors (other "
        "files stay).",
    ),
    target: Optional[str] = typer.Option(
        None,
        "--target",
        "-t",
        help="Target model directory: checks the drafter "
        "fits (vocab, hidden size, aux layers), resolves default aux layers of "
        "checkpoints that do not name them, gives --dtype auto its dtype, and fills "
        "speculators' verifier (default: the target the drafter records).",
    ),
    dtype: str = typer.Option(
        "auto",
        "--dtype",
        help="Weights dtype in the export, also written as the config's "
        "dtype: auto (the target's, from its config: engines build the drafter in the dtype "
        "the config names), fp32, bf16, fp16, or keep (as loaded).",
    ),
    speculative_tokens: int = typer.Option(
        3,
        "--speculative-tokens",
        help="Draft tokens per step written into speculators' proposal method and the printed serve command.",
    ),
    trust_remote_code: bool = typer.Option(
        False,
        "--trust-remote-code",
        help="Allow running Python code shipped "
        "in the target directory (config auto_map) when its weights must be "
        "loaded through transformers. Off: such a target is refused.",
    ),
) -> None:
    """Export DRAFTER to --format sglang|vllm|speculators and print the command that serves it.

    Aux layers: every layout carries both conventions, the nested layer-output ids SGLang reads
    (eagle_config.eagle_aux_hidden_state_layer_ids) and the top-level hidden_states ids (layer-output + 1)
    vLLM and speculators read. Repeated aux ids are refused (SGLang captures by membership, vLLM
    de-duplicates). The token embedding is written only for speculators (as speculators itself does; its
    loader needs it); SGLang and vLLM take the target's.
    """
    from draftsmith.export import export  # torch-free --help
    from draftsmith.target_model.load import trust_remote_code_scope  # torch-free --help

    if speculative_tokens < 1:
        raise DraftsmithError(f"--speculative-tokens: must be >= 1, got {speculative_tokens}")
    with warnings.catch_warnings(record=True) as caught, trust_remote_code_scope(trust_remote_code):
        warnings.simplefilter("always", UserWarning)
        try:
            info = export(
                drafter,
                out,
                format.lower(),
                target=target,
                dtype=dtype.lower(),
                speculative_tokens=speculative_tokens,
                overwrite=overwrite,
            )
        finally:  # shown before an error too: a warning may explain it
            for w in caught:  # one line each (Python's own format adds the source line)
                typer.secho(f"warning: {w.message}", fg=typer.colors.YELLOW, err=True)
    typer.echo(
        f"exported {drafter} -> {info['out']} ({info['format']}, {info['dtype']}); aux layers: layer-output "
        f"ids {info['aux_layer_ids']} = hidden_states ids {info['aux_hidden_states_ids']}"
    )
    for note in info.get("notes", []):
        typer.secho(f"note: {note}", fg=typer.colors.YELLOW, err=True)
    typer.echo("serve with:")
    typer.echo(f"  {info['serve_command']}")
    if info.get("speculators_convert_command"):
        typer.echo("convert to the speculators layout with speculators' own tool (it needs the aux ids passed):")
        typer.echo(f"  {info['speculators_convert_command']}")


def register(app: typer.Typer) -> None:
    app.command("export")(export_cmd)
