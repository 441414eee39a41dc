"""The `draftsmith` CLI without a fresh interpreter (each `python -m draftsmith` pays ~5-7 s of imports on 2 cores).

`cli_here`: a command in the test process (typer's runner), for runs whose outputs a test compares: the caller holds
one intra-op thread (the `one_thread` fixture), as a subprocess with OMP_NUM_THREADS=1 would.

`fork_cli` / `wait_exit`: a command in a child forked from the test process (a process of its own, with the imports
already done), for runs that are SIGKILLed, by themselves (DRAFTSMITH_TEST_KILL_AT_STEP) or by the test. The child
sets one intra-op thread first (as torch's DataLoader workers do after a fork: the parent's OpenMP pool is not
inherited) and never returns into pytest."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path


def cli_here(args: list[str]):
    """`draftsmith ARGS` in this process: typer's `Result` (exit_code, output, stderr). The global torch RNG state
    is restored afterwards (commands seed it)."""
    import torch
    from typer.testing import CliRunner

    from draftsmith.cli import app

    rng = torch.random.get_rng_state()
    try:
        return CliRunner().invoke(app, args)
    finally:
        torch.random.set_rng_state(rng)


def fork_cli(
    args: list[str], log: Path | None, env: dict[str, str] | None = None, prepare: Callable[[], None] | None = None
) -> int:
    """Start `draftsmith ARGS` in a forked child with ENV added to its environment (the child's only) and its
    stdout/stderr in LOG (None: this process's); PREPARE runs in the child first (e.g. installs a crash point). The
    child's pid."""
    import torch

    if torch.cuda.is_initialized():  # a forked child cannot use CUDA once the parent has: a fresh interpreter then
        if prepare is not None or log is None:
            raise RuntimeError(
                "fork_cli: CUDA is initialised here; a fresh interpreter takes neither prepare nor log=None"
            )
        import subprocess

        child_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        with open(log, "w") as f:
            cmd = [sys.executable, "-m", "draftsmith", *args]
            return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env).pid
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: always ends here, by os._exit (or by a signal)
        code = 1
        try:
            if log is not None:
                f = open(log, "w", buffering=1)
                os.dup2(f.fileno(), 1)
                os.dup2(f.fileno(), 2)
                sys.stdout = sys.stderr = f
            os.environ.update(env or {})
            torch.set_num_threads(1)
            if prepare is not None:
                prepare()
            from draftsmith.cli import main

            main(args)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    return pid


def exit_code(pid: int, block: bool = True) -> int | None:
    """The forked child's return code (-9: SIGKILLed), reaping it; None if it still runs (block=False)."""
    done, status = os.waitpid(pid, 0 if block else os.WNOHANG)
    return os.waitstatus_to_exitcode(status) if done else None


def wait_exit(pid: int, timeout: float) -> int:
    """The forked child's return code once it ends; after TIMEOUT seconds it is killed (return code -9 with a
    message: an AssertionError)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = exit_code(pid, block=False)
        if code is not None:
            return code
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    exit_code(pid)
    raise AssertionError(f"the forked run {pid} did not end within {timeout} s (killed)")
