"""The first training steps without waiting for a compile.

On CUDA the fast paths of the TTT unroll have to be compiled before they run: flex attention's kernels (the eager
unroll) or the whole unroll (`--compile auto`) -- a minute or more before step 1 on a fresh machine. Two ways to
start at once, both running the first steps with the chunked attention, which compiles nothing:

* `CacheWarmer` (the default, `--attn-backend auto`): after step 1 a separate python process compiles the same
  graphs into torch's persistent compile caches; when it is done, the trainer compiles the fast path itself from
  the warm caches (seconds) and switches at a step boundary. No thread traces anything.
* `BackgroundCompile` (`--attn-backend background`, experimental): one forward + backward of a private copy of the
  model in a daemon thread compiles the graphs the training steps will call (torch.compile's caches are per
  function, not per module instance). Fast, but torch's tracer is not thread-safe: a training step can fail while
  the thread traces (seen once on an H200). The copy shares no state the trainer updates (its own parameters and
  gradients; the frozen target embedding shared read-only; no optimizer, no random numbers, no collectives).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

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


# ---------------------------------------------------------------------------------------------------
# The default: warm torch's compile caches in a separate process, then compile in-process from them
# ---------------------------------------------------------------------------------------------------
# Why a process and not a thread: the compile traces modules (dynamo, AOTAutograd, FX), and torch's tracing is not
# thread-safe -- a training step crashed while `BackgroundCompile` traced (docs/LOG.md). A child process shares no
# interpreter state; what it shares is torch's persistent caches on disk (inductor's FX graph cache, AOTAutograd's
# cache with the triton kernels bundled in, all on by default, under TORCHINDUCTOR_CACHE_DIR). The child builds a
# drafter of the same config, dtypes and requires_grad flags with placeholder weights, and runs one forward +
# backward (and, when the run evaluates, one no-grad forward) on placeholder inputs of the same shapes, strides and
# dtypes as the trainer's first micro-batch: the same graphs, so the same cache keys (weights and input values are
# graph inputs, not part of a key). The trainer then compiles the same function itself; the caches hit and the
# stall is seconds (dynamo's trace and the cache load) instead of the compile's minute or more.


def tensor_meta(t: torch.Tensor) -> dict:
    return {
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "dtype": str(t.dtype).replace("torch.", ""),
        "requires_grad": bool(t.requires_grad),
    }


def placeholder(meta: dict, device) -> torch.Tensor:
    """A tensor with `meta`'s shape, strides and dtype: zeros (booleans True: every position valid, which keeps
    the loss's masks non-empty; zero token ids, positions and document ids are valid indices)."""
    dtype = getattr(torch, meta["dtype"])
    t = torch.empty_strided(meta["shape"], meta["stride"], dtype=dtype, device=device)
    t.fill_(True if dtype == torch.bool else 0)
    return t.requires_grad_(meta["requires_grad"])


def warm_spec(model, inputs, amp, device, fast_path: str, granularity: str, evaluate: bool, mem_fraction) -> dict:
    """What the child needs to compile the same graphs as the trainer: `model` is the trainer's `TTTModel`,
    `inputs` the tensors of its first training forward."""
    drafter = model.drafter
    embed = getattr(drafter, "embed_tokens", None)
    return {
        "drafter_config": drafter.config.to_dict(),
        "params": {n: tensor_meta(p) for n, p in drafter.named_parameters()},
        "buffers": {n: tensor_meta(b) for n, b in drafter.named_buffers() if not n.startswith("embed_tokens.")},
        "embed": tensor_meta(embed.weight) if embed is not None else None,
        "ttt": {k: getattr(model, k) for k in ("ttt_steps", "step_weight", "chunk", "loss_chunk")},
        "fast_path": fast_path,  # "compiled" (the unroll), "flex" (flex attention's kernels), "eager" (tests)
        "granularity": granularity,
        "backend": "inductor",
        "amp": str(amp).replace("torch.", "") if amp is not None else None,
        "inputs": [tensor_meta(t) for t in inputs],
        "device": str(device),
        "evaluate": evaluate,
        "mem_fraction": mem_fraction,
        "parent_pid": os.getpid(),
    }


def build_from_spec(spec: dict, device):
    """The child's `TTTModel` (placeholder weights, the spec's dtypes and flags) and placeholder inputs."""
    from types import SimpleNamespace

    from draftsmith.drafter import Drafter, DrafterConfig
    from draftsmith.train.trainer import TTTModel

    drafter = Drafter(DrafterConfig.from_dict(spec["drafter_config"]))
    if spec["embed"] is not None:
        drafter.set_embedding(placeholder(spec["embed"], "cpu"))
    with torch.no_grad():
        for name, meta in spec["params"].items():
            p = drafter.get_parameter(name)
            p.data = p.data.to(getattr(torch, meta["dtype"]))
            p.requires_grad_(meta["requires_grad"])
        for name, meta in spec["buffers"].items():
            owner, _, leaf = name.rpartition(".")
            mod = drafter.get_submodule(owner) if owner else drafter
            mod._buffers[leaf] = mod._buffers[leaf].to(getattr(torch, meta["dtype"]))
    got = {n: tensor_meta(p) for n, p in drafter.named_parameters()}
    if got != spec["params"]:
        raise RuntimeError("the rebuilt drafter's parameters differ from the trainer's")
    drafter.to(device)
    t = spec["ttt"]
    cfg = SimpleNamespace(
        ttt_steps=t["ttt_steps"],
        step_weight=t["step_weight"],
        attn_backend="chunked" if spec["fast_path"] == "eager" else "flex",
        attn_chunk=t["chunk"],
        loss_chunk=t["loss_chunk"],
    )
    model = TTTModel(drafter, cfg)
    inputs = [placeholder(m, device) for m in spec["inputs"]]
    return model, inputs


def run_spec(spec: dict) -> None:
    """The child's work: the trainer's first training forward + backward (and its evaluation forward)."""
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if spec.get("mem_fraction"):
            # the trainer's memory is reserved by its allocator already; this cap makes the child fail (and the
            # trainer train on chunked) rather than take memory the trainer may still ask for
            torch.cuda.set_per_process_memory_fraction(spec["mem_fraction"], device)
    model, inputs = build_from_spec(spec, device)
    if spec["fast_path"] == "compiled":
        model.enable_compile(backend=spec["backend"], granularity=spec["granularity"])
    amp = getattr(torch, spec["amp"]) if spec["amp"] else None
    autocast = (lambda: torch.autocast(device.type, dtype=amp)) if amp is not None else contextlib.nullcontext
    model.train()
    with autocast():
        loss, _ = model(*inputs)
    loss.backward()
    if spec["evaluate"]:
        model.eval()
        with torch.no_grad(), autocast():
            model(*inputs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _die_with_parent(parent_pid: int) -> None:
    """Linux: SIGTERM when the trainer dies (kill -9 included), so no compile outlives its run."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the child ends on its own when its compile is done
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl
        sys.exit(3)


def main(argv: list[str]) -> int:
    spec_path, done_path = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())
    _die_with_parent(int(spec["parent_pid"]))
    with contextlib.suppress(OSError):
        os.nice(5)  # the trainer's steps come first; inductor's compile workers inherit this
    t = time.perf_counter()
    run_spec(spec)
    done_path.write_text(json.dumps({"seconds": time.perf_counter() - t}))
    return 0


def inductor_cache_dir() -> str | None:
    """The directory torch's compile caches use in this process (TORCHINDUCTOR_CACHE_DIR or torch's default)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return cache_dir()
    except Exception:  # noqa: BLE001 - another torch layout: the child inherits the environment, same default
        return os.environ.get("TORCHINDUCTOR_CACHE_DIR")


class CacheWarmer:
    """The child process (`python -m draftsmith.train.warmup SPEC DONE`), polled at step boundaries.

    `poll()`: "running", "ready" (exited 0 and wrote DONE) or "failed" (`error`: one line from its log).
    `close()` ends it if still running and removes its spec. Its output goes to `log_path` (in the run directory)."""

    def __init__(self, spec: dict, log_path: Path):
        self.log_path = Path(log_path)
        self.error: str | None = None
        self.seconds: float | None = None
        self._state = "running"
        self._dir = Path(tempfile.mkdtemp(prefix="draftsmith-warm-"))
        spec_path, self._done = self._dir / "spec.json", self._dir / "done"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        cache = inductor_cache_dir()
        if cache:
            env["TORCHINDUCTOR_CACHE_DIR"] = cache  # one cache for both processes, whatever resolves it
        self._t0 = time.perf_counter()
        try:
            with open(self.log_path, "w") as log:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "draftsmith.train.warmup", str(spec_path), str(self._done)],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise

    def poll(self) -> str:
        if self._state != "running":
            return self._state
        rc = self._proc.poll()
        if rc is None:
            return "running"
        self.seconds = time.perf_counter() - self._t0
        if rc == 0 and self._done.is_file():
            self._state = "ready"
        else:
            self._state = "failed"
            self.error = f"exit code {rc}: {_last_line(self.log_path)} ({self.log_path})"
        shutil.rmtree(self._dir, ignore_errors=True)
        return self._state

    def wait(self, timeout: float | None = None) -> str:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout)
        return self.poll()

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


def _last_line(path: Path) -> str:
    try:
        lines = [x.strip() for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return "no log"
    return lines[-1][:200] if lines else "no output"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
