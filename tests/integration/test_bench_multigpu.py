"""bench/multigpu.py's harness on CPU (gloo): 1 process vs torchrun x2 capture, stores compared, a table."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_multigpu_bench_capture_smoke(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), DRAFTSMITH_BENCHMARKS=str(tmp_path / "B.md"), OMP_NUM_THREADS="1")
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "multigpu.py"),
            "--small",
            str(REPO / "assets" / "pycode-tiny"),
            "--gpus",
            "2",
            "--corpus",
            str(REPO / "draftsmith" / "store"),
            "--tokens",
            "6000",
            "--batch-tokens",
            "1024",
            "--device",
            "cpu",
            "--sections",
            "capture",
            "--min-section-s",
            "1",
            "--disk-probe-gib",
            "0.0625",
            "--workdir",
            str(tmp_path / "w"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads((out / "multigpu.json").read_text())["rows"]
    assert [x["mode"] for x in rows] == ["1 GPU", "DP x2"]
    assert rows[1]["check"] == "store identical to 1 GPU"
    assert rows[0]["tokens"] == rows[1]["tokens"] >= 6000
    assert all(x["store GB/s"] > 0 and x["disk-bound tok/s"] > 0 for x in rows)
    assert "| pycode-small | DP x2 | 2 |" in (tmp_path / "B.md").read_text()
    assert sorted(p.name for p in (out / "multigpu-logs").iterdir()) == [
        "capture-pycode-small-1-gpu.log",
        "capture-pycode-small-dp-x2.log",
    ]
