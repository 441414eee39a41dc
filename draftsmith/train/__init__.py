"""Training EAGLE-3 drafters with training-time test (TTT), offline from a store or online.

    from draftsmith.train import TrainConfig, train
    train(TrainConfig(target="path/to/target", store="path/to/store", out="runs/x", steps=1000))

Pieces: `ttt` (attention pattern, teacher, loss), `data` (split, packing, batches), `trainer` (loop,
DDP/FSDP2, checkpoints, resume), `checkpoint` (safetensors+JSON state), `cli` (`draftsmith train`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from draftsmith.common.lazy import lazy_exports

if TYPE_CHECKING:
    from draftsmith.train.trainer import TrainConfig, Trainer, train

__all__ = ["TrainConfig", "Trainer", "train"]
# torch-free --help: the train CLI imports this package (draftsmith/common/lazy.py)
__getattr__, __dir__ = lazy_exports(__name__, {n: "draftsmith.train.trainer" for n in __all__})
