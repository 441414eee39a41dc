"""Store-building helpers shared by the store, train and GPU tests: a small fixed code corpus and a capture call
with test-sized settings."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from pathlib import Path

import numpy as np

from draftsmith.capture.job import CaptureConfig, run_capture


def make_corpus(root: Path, n_files: int = 12) -> Path:
    """A small, fixed code corpus: files of varied length (some longer than max_length)."""
    d = root / "corpus"
    d.mkdir()
    rng = np.random.default_rng(0)
    for i in range(n_files):
        body = []
        for j in range(int(rng.integers(1, 12))):
            body.append(f'def func_{i}_{j}(x, y={j}):\n    """Add things."""\n    return x * {j} + y - {i}\n\n')
        (d / f"mod_{i:02d}.py").write_text("import os\n\n" + "".join(body))
    return d


def capture(tiny, data, out, target=None, **kw) -> dict:
    """`run_capture` with test-sized settings; `target`: an already loaded Target (saves loading it again)."""
    kw.setdefault("max_length", 128)
    kw.setdefault("batch_tokens", 512)
    kw.setdefault("shard_tokens", 700)
    kw.setdefault("progress", False)
    kw.setdefault("model_dtype", "fp32")
    return run_capture(
        CaptureConfig(target=str(tiny), data=str(data), out=str(out), **kw), log=lambda *a: None, target=target
    )


@contextlib.contextmanager
def small_tmpfs(where: Path, size_bytes: int):
    """A tmpfs of `size_bytes` mounted at `where` (a full disk on demand); skips the test where mounting is not
    permitted (not root, or a container without CAP_SYS_ADMIN)."""
    import pytest

    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({(r.stderr or r.stdout).strip()[:200]})")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


def fill_disk(root: Path, leave_bytes: int) -> Path:
    """Fill the filesystem of `root` until about `leave_bytes` are free; returns the filler file (delete it to free
    the space)."""
    filler = root / "filler"
    free = shutil.disk_usage(root).free
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free - leave_bytes))
    return filler


def resize_tmpfs(where: Path, size_bytes: int) -> None:
    """Grow (or shrink) a tmpfs mounted by `small_tmpfs`: frees space for a rerun."""
    subprocess.run(["mount", "-o", f"remount,size={size_bytes}", str(where)], check=True, capture_output=True)
