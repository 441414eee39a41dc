"""Test-only fault injection: run the draftsmith CLI and SIGKILL it at one commit point of the capture job.

    python tests/capture_crash.py POINT:INDEX capture --target ... --out ...

POINT is where the kill lands, INDEX the shard:
  before_shard:i    before shard i's file is written
  after_shard:i     shard i's file renamed into place, its progress record not yet written
  after_progress:i  shard i committed (file + progress record)
  before_finalize:0 every shard committed, before token_counts and the manifest
The production code has no hook for this: the capture job's write helpers (module globals of
draftsmith.capture.job) are wrapped here, in the test process only, before the CLI runs.

Several points in one go (the imports, ~5 s of each run on 2 cores, paid once):

    python tests/capture_crash.py POINT:INDEX=OUT [POINT:INDEX=OUT ...] capture --target ...

imports the CLI, then forks one child per POINT=OUT: the child wraps the helpers and runs the command with
`--out OUT`, and SIGKILLs itself at its point (a process of its own: what the kill leaves on disk is what it leaves
after any start-up). One line per child on stdout, in order: POINT RETURNCODE (-9: killed).
"""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

POINTS = ("before_shard", "after_shard", "after_progress", "before_finalize")


def _shard_index(path) -> int | None:
    m = re.search(r"shard-(\d+)\.(?:safetensors|json)$", str(path))
    return int(m.group(1)) if m else None


def install(spec: str) -> None:
    from draftsmith.capture import job
    from draftsmith.store import format as fmt

    name, _, index = spec.partition(":")
    if name not in POINTS or not index.isdigit():
        raise SystemExit(f"capture_crash: bad point {spec!r} (choose one of {POINTS} with ':INDEX')")
    index = int(index)

    def kill() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    save_shard, write_json = job.atomic_save_safetensors_streaming, job.atomic_write_json
    save_file = job.atomic_save_file

    def shard_writer(tensors, path, *a, **k):
        here = _shard_index(path) == index
        if name == "before_shard" and here:
            kill()
        result = save_shard(tensors, path, *a, **k)
        if name == "after_shard" and here:
            kill()
        return result

    def json_writer(path, obj):
        write_json(path, obj)
        if name == "after_progress" and Path(path).parent.name == fmt.PROGRESS_DIR and _shard_index(path) == index:
            kill()

    def counts_writer(tensors, path, *a, **k):
        if name == "before_finalize":
            kill()
        return save_file(tensors, path, *a, **k)

    job.atomic_save_safetensors_streaming = shard_writer
    job.atomic_write_json = json_writer
    job.atomic_save_file = counts_writer


def _run_forked(point: str, argv: list[str]) -> int:
    """`draftsmith ARGV` in a forked child that installs POINT; the child's exit status as a return code."""
    from cli_helpers import exit_code, fork_cli

    return exit_code(fork_cli(argv, None, prepare=lambda: install(point)))


if __name__ == "__main__":
    specs = []
    while len(sys.argv) > 1 and sys.argv[1].startswith(POINTS) and "=" in sys.argv[1]:
        specs.append(sys.argv.pop(1).split("=", 1))
    if not specs:
        install(sys.argv[1])
        from draftsmith.cli import main

        main(sys.argv[2:])
    else:
        # what every run imports, once, before the forks (nothing has run a torch op or started a thread yet); the
        # model class is the bundled demo target's (tests/conftest.py tiny_path), another target's is imported after
        import transformers.masking_utils  # noqa: F401
        import transformers.models.llama.modeling_llama  # noqa: F401
        import transformers.tokenization_utils_tokenizers  # noqa: F401

        import draftsmith.capture.job  # noqa: F401
        import draftsmith.cli  # noqa: F401

        for point, out in specs:
            print(point, _run_forked(point, [*sys.argv[1:], "--out", out]), flush=True)
