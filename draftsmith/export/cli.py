"""`draftsmith export`: write a drafter in the layout SGLang, vLLM or speculators loads."""

from __future__ import annotations

from typing import Optional

import typer

from draftsmith.common.errors import DraftsmithError


def export_cmd(
    drafter: str = typer.Argument(..., help="Drafter directory, in any layout draftsmith reads (its own, "
                                  "sglang/SpecForge/EAGLE, vllm, speculators)."),
    format: str = typer.Option(..., "--format", "-f", help="Target layout: sglang (also EAGLE/SpecForge/ModelOpt), "
                               "vllm, or speculators."),
    out: str = typer.Option(..., "--out", "-o", help="Output directory (created; an existing drafter there is "
                            "overwritten file by file)."),
    target: Optional[str] = typer.Option(None, "--target", "-t", help="Target model directory: checks the drafter "
                                         "fits (vocab, hidden size, aux layers), resolves default aux layers of "
                                         "checkpoints that do not name them, and fills speculators' verifier."),
    dtype: str = typer.Option("keep", "--dtype", help="Weights dtype in the export: keep (as loaded), bf16, fp16, "
                              "fp32."),
    speculative_tokens: int = typer.Option(3, "--speculative-tokens", help="Draft tokens per step written into "
                                           "speculators' proposal method and the printed serve command."),
) -> None:
    """Export DRAFTER to --format sglang|vllm|speculators and print the command that serves it.

    Aux layers: sglang gets layer-output ids (eagle_config.eagle_aux_hidden_state_layer_ids); vllm gets both
    those and the top-level hidden_states ids (layer-output + 1) that vLLM reads; speculators gets
    hidden_states ids. The token embedding is written only for speculators (as speculators itself does; its
    loader needs it); SGLang and vLLM take the target's.
    """
    import torch

    from draftsmith.export import export

    dtypes = {"keep": None, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
              "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
    if dtype.lower() not in dtypes:
        raise DraftsmithError(f"--dtype: unknown dtype {dtype!r} (choose from keep, bf16, fp16, fp32)")
    if speculative_tokens < 1:
        raise DraftsmithError(f"--speculative-tokens: must be >= 1, got {speculative_tokens}")
    info = export(drafter, out, format.lower(), target=target, dtype=dtypes[dtype.lower()],
                  speculative_tokens=speculative_tokens)
    typer.echo(f"exported {drafter} -> {info['out']} ({info['format']}); aux layers: layer-output ids "
               f"{info['aux_layer_ids']} = hidden_states ids {info['aux_hidden_states_ids']}")
    for note in info.get("notes", []):
        typer.secho(f"note: {note}", fg=typer.colors.YELLOW, err=True)
    typer.echo("serve with:")
    typer.echo(f"  {info['serve_command']}")
    if info.get("speculators_convert_command"):
        typer.echo("convert to the speculators layout with speculators' own tool (it needs the aux ids passed):")
        typer.echo(f"  {info['speculators_convert_command']}")


def register(app: typer.Typer) -> None:
    app.command("export")(export_cmd)
