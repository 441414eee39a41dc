"""`draftsmith train`: train an EAGLE-3 drafter with training-time test (offline from a store, or online)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from draftsmith.common.errors import DraftsmithError


def _load_yaml(path: str) -> dict:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise DraftsmithError(f"{path}: --config file not found")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise DraftsmithError(f"{path}: invalid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise DraftsmithError(f"{path}: expected a mapping of option: value")
    from draftsmith.train.trainer import TrainConfig

    out = {}
    names = TrainConfig.field_names()
    for k, v in data.items():
        key = str(k).replace("-", "_")
        if key == "ttt":
            key = "ttt_steps"
        if key not in names:
            raise DraftsmithError(f"{path}: unknown field '{k}' (known: {', '.join(sorted(names))})")
        out[key] = v
    return out


def train_command(
    target: Optional[str] = typer.Option(None, "--target", "-t", help="Hugging Face causal LM directory the drafter is for."),
    store: Optional[str] = typer.Option(None, "--store", "-s", help="Hidden-state store from `draftsmith capture` (offline mode)."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Run directory: checkpoints/, final/, metrics.jsonl, training.png."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Optimizer steps (default: --epochs 1)."),
    epochs: Optional[float] = typer.Option(None, "--epochs", help="Passes over the training split (fractional allowed)."),
    ttt_steps: Optional[int] = typer.Option(None, "--ttt-steps", "-K", help="Training-time-test unroll depth K (default 7)."),
    draft_vocab_size: Optional[int] = typer.Option(None, "--draft-vocab-size", help="Draft vocab V_d: the most frequent loss-masked target tokens (default min(32000, V))."),
    online: bool = typer.Option(False, "--online", help="Run the target in the loop (no store); needs --data."),
    data: Optional[str] = typer.Option(None, "--data", "-d", help="Online mode: JSONL or a directory of source files (as for capture)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from RUN_DIR's latest checkpoint (same loss sequence as an uninterrupted run)."),
    config: Optional[str] = typer.Option(None, "--config", "-c", help="YAML file of options (keys = long option names); flags override it."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Peak learning rate (default 1e-4)."),
    min_lr_ratio: Optional[float] = typer.Option(None, "--min-lr-ratio", help="Cosine floor as a fraction of --lr (default 0)."),
    warmup: Optional[float] = typer.Option(None, "--warmup", help="Warmup: fraction of the steps if < 1, else a step count (default 0.015)."),
    weight_decay: Optional[float] = typer.Option(None, "--weight-decay", help="AdamW weight decay (default 0)."),
    grad_clip: Optional[float] = typer.Option(None, "--grad-clip", help="Gradient-norm clip (default 0.5; 0 = off)."),
    batch_tokens: Optional[int] = typer.Option(None, "--batch-tokens", help="Token budget of a packed micro-batch; also the max sample length (default 2048)."),
    grad_accum: Optional[int] = typer.Option(None, "--grad-accum", help="Micro-batches per optimizer step and rank (default 1)."),
    step_weight: Optional[float] = typer.Option(None, "--step-weight", help="Loss weight of TTT step k is this**k (default 0.8)."),
    eval_fraction: Optional[float] = typer.Option(None, "--eval-fraction", help="Held-out fraction of samples (default 0.02)."),
    eval_every: Optional[int] = typer.Option(None, "--eval-every", help="Evaluate every N steps (default: at checkpoints and at the end)."),
    save_every: Optional[int] = typer.Option(None, "--save-every", help="Checkpoint every N steps (default 500; always at the end)."),
    keep_checkpoints: Optional[int] = typer.Option(None, "--keep-checkpoints", help="Checkpoints kept (default 2)."),
    log_every: Optional[int] = typer.Option(None, "--log-every", help="metrics.jsonl line every N steps (default 1)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed of the split, shuffling and init (default 0)."),
    num_layers: Optional[int] = typer.Option(None, "--num-layers", help="Drafter decoder layers (default 1)."),
    aux_layers: Optional[str] = typer.Option(None, "--aux-layers", help="Online mode: aux layers as LAYER-OUTPUT ids, e.g. '1,4,7' (default [1, N//2-1, N-4]). Offline: the store's."),
    freeze_lm_head: bool = typer.Option(False, "--freeze-lm-head", help="Keep lm_head at the target's rows of the draft vocab."),
    fsdp: bool = typer.Option(False, "--fsdp", help="Under torchrun: FSDP2 (fully_shard) instead of DDP."),
    device: Optional[str] = typer.Option(None, "--device", help="auto (GPU if present; cuda:LOCAL_RANK under torchrun), cpu, cuda."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Autocast dtype: auto (bf16 on GPU, fp32 on CPU), fp32, bf16."),
    attn_backend: Optional[str] = typer.Option(None, "--attn-backend", help="TTT attention: auto (flex on GPU, chunked on CPU), flex, chunked."),
    attn_chunk: Optional[int] = typer.Option(None, "--attn-chunk", help="Chunked TTT attention: query rows per chunk (default auto: about the longest document, >= 1024 rows on GPU, within a memory budget)."),
    loss_chunk: Optional[int] = typer.Option(None, "--loss-chunk", help="Tokens per checkpointed lm_head + loss chunk (default 16384; 0 = off)."),
    max_length: Optional[int] = typer.Option(None, "--max-length", help="Online mode: tokenizer cut; longer source files are split into windows (default: min(--batch-tokens, 2048, the target's max_position_embeddings), as `draftsmith capture`)."),
    max_time: Optional[float] = typer.Option(None, "--max-time", help="Wall-clock seconds: stop after the step that crosses it, saving a checkpoint and final/ (the LR schedule stays that of --steps; --resume continues it)."),
    on_bad: Optional[str] = typer.Option(None, "--on-bad", help="Online mode, bad input records: 'error' (default) stops with file:line and reason; 'skip' skips and counts them."),
    compile: Optional[str] = typer.Option(None, "--compile", help="torch.compile the TTT unroll (forward + backward): auto (default: 'unroll' on one CUDA process with flex attention; off under torchrun until measured there), unroll (the K steps as one graph), step (one graph reused by every step: compile time independent of K, ~2.5x shorter on CPU; GPU speed not yet measured), on (= unroll), off. Costs one compile per sequence length (minutes on the H200 for pycode-small at 8k), then 3.2x the eager tokens/s (335k vs 105k at 8k)."),
    glob: Optional[str] = typer.Option(None, "--glob", help="Online mode, directory data: which files (default '**/*.py')."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Train an EAGLE-3 drafter with training-time test.

    Offline: `draftsmith train --target T --store STORE --out RUN_DIR --steps N`.
    Online:  `draftsmith train --target T --online --data FILE_OR_DIR --out RUN_DIR`.
    Multi-GPU: `torchrun --nproc-per-node N -m draftsmith train ...` (DDP; `--fsdp` for FSDP2).
    """
    from draftsmith.train.trainer import TrainConfig, train

    vals: dict = {}
    if config:
        vals.update(_load_yaml(config))
    given = dict(
        target=target, store=store, out=out, steps=steps, epochs=epochs, ttt_steps=ttt_steps,
        draft_vocab_size=draft_vocab_size, data=data, lr=lr, min_lr_ratio=min_lr_ratio, warmup=warmup,
        weight_decay=weight_decay, grad_clip=grad_clip, batch_tokens=batch_tokens, grad_accum=grad_accum,
        step_weight=step_weight, eval_fraction=eval_fraction, eval_every=eval_every, save_every=save_every,
        keep_checkpoints=keep_checkpoints, log_every=log_every, seed=seed, num_layers=num_layers, device=device,
        dtype=dtype, attn_backend=attn_backend, max_length=max_length, max_time=max_time, on_bad=on_bad, compile=compile, glob=glob, attn_chunk=attn_chunk,
        loss_chunk=loss_chunk,
    )
    vals.update({k: v for k, v in given.items() if v is not None})
    for flag, name in ((online, "online"), (resume, "resume"), (freeze_lm_head, "freeze_lm_head"), (fsdp, "fsdp")):
        if flag:
            vals[name] = True
    if quiet:
        vals["progress"] = False
    if aux_layers:
        try:
            vals["aux_layers"] = [int(x) for x in aux_layers.replace(" ", "").split(",") if x]
        except ValueError:
            raise DraftsmithError(f"--aux-layers: expected comma-separated integers, got {aux_layers!r}") from None
    for req in ("target", "out"):
        if not vals.get(req):
            raise DraftsmithError(f"--{req}: required")
    if vals.get("online") and not vals.get("data"):
        raise DraftsmithError("--online: needs --data FILE_OR_DIR")
    if not vals.get("online") and not vals.get("store"):
        raise DraftsmithError("--store: required (or --online --data FILE_OR_DIR)")
    if vals.get("steps") is not None and vals.get("epochs") is not None:
        raise DraftsmithError("--steps and --epochs: give one, not both")
    cfg = TrainConfig(**vals)
    train(cfg, log=lambda s: typer.echo(s, err=True))


def register(app: typer.Typer) -> None:
    app.command("train", help=train_command.__doc__)(train_command)
