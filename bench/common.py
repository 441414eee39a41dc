"""Shared helpers for benchmark scripts: environment description, tables, BENCHMARKS.md entries."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# the Llama-3.1-8B shape's matrices (out features, in features), as the decode benchmarks' matmuls read them: q/k/v and
# gate/up fused, as the compact forward keeps them
LLAMA_8B_MATMULS = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}


def commit() -> str:
    if os.environ.get("DRAFTSMITH_COMMIT"):
        return os.environ["DRAFTSMITH_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:
        return "unknown"


def device_description() -> str:
    import torch

    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        return f"{p.name} ({p.total_memory / 2**30:.0f} GiB), torch {torch.__version__}"
    return f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}, torch {torch.__version__}"


def measure_copy_bandwidth(gib: float = 2.0) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written."""
    import torch

    n = int(gib * 2**30)
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    reps = 10
    for _ in range(reps):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    return 2 * n * reps / (start.elapsed_time(end) / 1e3)


def weight_copies(n: int, k: int, total_bytes: float = 400e6) -> list:
    """Enough random bf16 [n, k] weight copies (at least 2) to pass `total_bytes` together: a graph that walks them
    reads each from HBM, as a verify's layers do, not from the 50 MB L2."""
    import torch

    copies = max(2, math.ceil(total_bytes / (n * k * 2)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]


def time_torch_mm(x, ws: list, out, passes: int) -> float:
    """Best us a call of torch.mm(x, w^T) over the copies `ws`, `passes` times in one CUDA graph (cuBLAS's pick)."""
    import torch

    from draftsmith.decode.kernels import _time_graph

    def run():
        for _ in range(passes):
            for w in ws:
                torch.mm(x, w.t(), out=out)

    return _time_graph(run, len(ws) * passes, 10)[0]


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        out.append("| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |")
    return "\n".join(out)


def _fmt(v) -> str:
    if isinstance(v, float):
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.3f}"
    return str(v)


def record(name: str, title: str, body_md: str, data: dict, command: str) -> None:
    """Print the section, append it to BENCHMARKS.md, and drop JSON + markdown into $OUT if set."""
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = (
        f"\n## {title}\n\n- date: {when}\n- device: {device_description()}\n- commit: {commit()}\n"
        f"- command: `{command}`\n\n{body_md}\n"
    )
    print(section)
    path = Path(os.environ.get("DRAFTSMITH_BENCHMARKS", REPO / "BENCHMARKS.md"))
    with open(path, "a") as f:
        f.write(section)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.md").write_text(section)
        (Path(out) / f"{name}.json").write_text(
            json.dumps({**data, "date": when, "commit": commit(), "device": device_description()}, indent=2)
        )
