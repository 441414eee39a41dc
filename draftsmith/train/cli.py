"""`draftsmith train`: train an EAGLE-3 drafter with training-time test (offline from a store, or online).

The options, `--config` YAML, help and checks are generated from TrainConfig (draftsmith/train/config.py)."""

from __future__ import annotations

import typer

from draftsmith.common.schema import command_for
from draftsmith.train.config import TrainConfig

DOC = """Train an EAGLE-3 drafter with training-time test.

Offline: `draftsmith train --target T --store STORE --out RUN_DIR --steps N`.
Online:  `draftsmith train --target T --online --data FILE_OR_DIR --out RUN_DIR`.
Multi-GPU: `torchrun --nproc-per-node N -m draftsmith train ...` (DDP; `--fsdp` for FSDP2).
"""


def _run(cfg: TrainConfig) -> None:
    from draftsmith.target_model.load import trust_remote_code_scope
    from draftsmith.train.trainer import train

    with trust_remote_code_scope(cfg.trust_remote_code):
        train(cfg, log=lambda s: typer.echo(s, err=True))


train_command = command_for(TrainConfig, _run, stage="train", doc=DOC)


def register(app: typer.Typer) -> None:
    app.command("train", help=DOC)(train_command)
