"""torch.distributed helpers shared by every stage that runs under torchrun (capture, train): the rank triple
from the environment, process-group start, barrier/all-reduce that are no-ops in one process, and the device a
rank uses."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def dist_info() -> tuple[int, int, int]:
    """(rank, world size, local rank) as torchrun sets them; (0, 1, 0) in a plain process."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def init_dist(world: int, backend: str) -> None:
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend)


def barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def all_reduce(t: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        dist.all_reduce(t)
    return t


def resolve_device(name: str, local_rank: int) -> torch.device:
    """'auto' -> this rank's GPU if there is one, else the CPU; a bare 'cuda' -> this rank's GPU."""
    if name == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device(f"cuda:{local_rank}")
    return dev
