"""The first training steps without waiting for a compile.

On CUDA the fast paths of the TTT unroll have to be compiled before they run: flex attention's kernels (the eager
unroll) or the whole unroll (`--compile auto`) -- minutes before step 1 on a fresh machine. With
`--attn-backend auto` the trainer does not wait: `BackgroundCompile` runs one forward + backward of a private copy
of the model on the first real micro-batch in a daemon thread, which compiles exactly the graphs the training steps
will call (same shapes, dtypes and guards; torch.compile's caches are per function, not per module instance), while
the trainer's own steps run the chunked attention, which compiles nothing. At the first step boundary after the
thread finished, the trainer switches to the compiled path; if compiling failed it says so and stays eager.

The copy shares no state the trainer updates: its own parameters and gradients (the frozen target embedding is
shared, read-only), no optimizer, no random numbers, no collectives (it is taken before DDP/FSDP wrap the model).
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable

import torch
from torch import nn


def private_copy(model: nn.Module, shared: list[torch.Tensor] = ()) -> nn.Module:
    """A deep copy of `model` that shares the tensors in `shared` (frozen weights) instead of copying them."""
    return copy.deepcopy(model, memo={id(t): t for t in shared})


class BackgroundCompile:
    """Runs `probe()` (one forward + backward that triggers the compile) once in a daemon thread on `device`."""

    def __init__(self, probe: Callable[[], None], device: torch.device):
        self._probe = probe
        self._device = device
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.seconds: float | None = None
        self._thread = threading.Thread(target=self._run, name="draftsmith-compile", daemon=True)

    def start(self) -> BackgroundCompile:
        self._thread.start()
        return self

    def _run(self) -> None:
        t = time.perf_counter()
        try:
            if self._device.type == "cuda":
                torch.cuda.set_device(self._device)  # the current device is per thread
            self._probe()
            if self._device.type == "cuda":
                torch.cuda.synchronize(self._device)
        except BaseException as e:  # reported by the trainer at the next step boundary
            self.error = e
        finally:
            self._probe = None  # drop the model copy and the micro-batch
            self.seconds = time.perf_counter() - t
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)
