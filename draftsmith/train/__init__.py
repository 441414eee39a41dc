"""Training EAGLE-3 drafters with training-time test (TTT), offline from a store or online.

    from draftsmith.train import TrainConfig, train
    train(TrainConfig(target="path/to/target", store="path/to/store", out="runs/x", steps=1000))

Pieces: `ttt` (attention pattern, teacher, loss), `data` (split, packing, batches), `trainer` (loop,
DDP/FSDP2, checkpoints, resume), `checkpoint` (safetensors+JSON state), `cli` (`draftsmith train`).
"""

from draftsmith.train.trainer import TrainConfig, Trainer, train

__all__ = ["TrainConfig", "Trainer", "train"]
