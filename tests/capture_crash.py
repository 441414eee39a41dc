"""Test-only fault injection: run the draftsmith CLI and SIGKILL it at one commit point of the capture job.

    python tests/capture_crash.py POINT:INDEX capture --target ... --out ...

POINT is where the kill lands, INDEX the shard:
  before_shard:i    before shard i's file is written
  after_shard:i     shard i's file renamed into place, its progress record not yet written
  after_progress:i  shard i committed (file + progress record)
  before_finalize:0 every shard committed, before token_counts and the manifest
The production code has no hook for this: the capture job's write helpers (module globals of
draftsmith.capture.job) are wrapped here, in the test process only, before the CLI runs.
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


if __name__ == "__main__":
    install(sys.argv[1])
    from draftsmith.cli import main

    main(sys.argv[2:])
