"""The `capture` command: run a target over data with forward hooks and write a hidden-state store."""

from __future__ import annotations

from typing import Optional

import typer

from draftsmith.common.errors import DraftsmithError


def capture(
    target: str = typer.Option(..., "--target", "-t", help="Hugging Face causal LM directory (the model you serve)."),
    data: str = typer.Option(
        ...,
        "--data",
        "-d",
        help="JSONL (ShareGPT `conversations`, OpenAI `messages`, or `text` records) or a directory of source "
        "files (e.g. a Python installation: every *.py file is a sample).",
    ),
    out: str = typer.Option(..., "--out", "-o", help="Store directory to create (or to resume: rerun the same command)."),
    aux_layers: Optional[str] = typer.Option(
        None,
        "--aux-layers",
        help="Aux layers as LAYER-OUTPUT ids (0-based decoder layer whose output is captured; the HF "
        "output_hidden_states index is this + 1), e.g. '1,15,28'. Default: EAGLE-3's low/mid/high "
        "[1, N//2-1, N-4]. Any count >= 1.",
    ),
    aux_hidden_states_ids: Optional[str] = typer.Option(
        None,
        "--aux-hidden-states-ids",
        help="The same, given as HF output_hidden_states / vLLM / speculators ids (layer-output id + 1). "
        "Mutually exclusive with --aux-layers.",
    ),
    max_length: int = typer.Option(2048, "--max-length", help="Truncate (or, for source files, split) samples to this many tokens."),
    dtype: str = typer.Option(
        "bf16", "--dtype", help="Store dtype for hidden states: bf16 (8H+4 bytes/token for 3 aux layers) or fp8 "
        "(e4m3 with a power-of-two scale per row: 4H+8)."
    ),
    batch_tokens: int = typer.Option(16384, "--batch-tokens", help="Padded tokens per forward pass (batch size x longest sample)."),
    on_bad: str = typer.Option("error", "--on-bad", help="Bad input records: 'error' stops with file:line and reason; 'skip' skips and counts them."),
    shard_mb: int = typer.Option(512, "--shard-mb", help="Approximate shard size in MiB."),
    writers: int = typer.Option(3, "--writers", help="Threads writing shards while the GPU runs (host memory: (writers+1) x shard size)."),
    shard_tokens: Optional[int] = typer.Option(None, "--shard-tokens", help="Tokens per shard (overrides --shard-mb)."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda, cuda:N or auto (GPU if present; under torchrun: cuda:LOCAL_RANK)."),
    model_dtype: str = typer.Option("auto", "--model-dtype", help="Target weights dtype: auto (bf16 on GPU, as saved on CPU), bf16, fp16, fp32."),
    no_final: bool = typer.Option(False, "--no-final", help="Do not store the last layer's (pre-norm) output; training needs it for the teacher."),
    cuda_graphs: bool = typer.Option(False, "--cuda-graphs", help="Run the target from CUDA graphs (static shapes, hooks copy into static buffers)."),
    tp: bool = typer.Option(False, "--tp", help="Load the target with tensor parallelism (transformers tp_plan='auto') across torchrun ranks."),
    glob: Optional[str] = typer.Option(None, "--glob", help="For a directory: which files (default '**/*.py')."),
    max_samples: Optional[int] = typer.Option(None, "--max-samples", help="Capture only the first N samples (a quick trial)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Capture the target's aux hidden states (and final pre-norm state) into a checksummed, resumable store.

    Multi-GPU: `torchrun --nproc-per-node N -m draftsmith capture ...` splits shards across ranks.
    Resume: rerun the exact same command after an interruption (even kill -9).
    """
    from draftsmith.capture.job import CaptureConfig, run_capture
    from draftsmith.target_model.layers import from_hidden_states_ids, parse_layer_list

    if aux_layers and aux_hidden_states_ids:
        raise DraftsmithError("give either --aux-layers (layer-output ids) or --aux-hidden-states-ids, not both")
    layers = None
    if aux_layers:
        layers = parse_layer_list(aux_layers, "--aux-layers")
    elif aux_hidden_states_ids:
        layers = from_hidden_states_ids(parse_layer_list(aux_hidden_states_ids, "--aux-hidden-states-ids"))
    cfg = CaptureConfig(
        target=target, data=data, out=out, aux_layers=layers, max_length=max_length, dtype=dtype,
        batch_tokens=batch_tokens, on_bad=on_bad, shard_tokens=shard_tokens, shard_mb=shard_mb, device=device,
        model_dtype=model_dtype, capture_final=not no_final, cuda_graphs=cuda_graphs, tp=tp, glob=glob,
        max_samples=max_samples, writers=writers, progress=not quiet,
    )
    run_capture(cfg, log=lambda *a: typer.echo(" ".join(str(x) for x in a), err=True))


def register(app: typer.Typer) -> None:
    app.command("capture")(capture)
