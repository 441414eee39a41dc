"""Store-building helpers shared by the store, train and GPU tests: a small fixed code corpus and a capture call
with test-sized settings."""

from __future__ import annotations

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
            body.append(f"def func_{i}_{j}(x, y={j}):\n    \"\"\"Add things.\"\"\"\n    return x * {j} + y - {i}\n\n")
        (d / f"mod_{i:02d}.py").write_text("import os\n\n" + "".join(body))
    return d


def capture(tiny, data, out, **kw) -> dict:
    kw.setdefault("max_length", 128)
    kw.setdefault("batch_tokens", 512)
    kw.setdefault("shard_tokens", 700)
    kw.setdefault("progress", False)
    kw.setdefault("model_dtype", "fp32")
    return run_capture(CaptureConfig(target=str(tiny), data=str(data), out=str(out), **kw), log=lambda *a: None)
