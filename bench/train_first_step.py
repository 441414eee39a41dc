"""Time to the first training step (GPU): `draftsmith train` with its default settings, before and after the
background compile (draftsmith/train/warmup.py).

    python bench/train_first_step.py --target PATH/pycode-small --data draftsmith [--budget 110]

Runs `draftsmith train --online` (the target in the loop, so no store has to be captured first) in configurations
side by side, each as its own process, all started at once and stopped after `--budget` seconds (`--max-time`, then
killed if still running):

* `default` -- the settings a user gets (`--attn-backend auto --compile auto`): the first steps run the chunked
  attention while the compiled TTT unroll is compiled in the background, then the steps switch to it;
* `compile-first` -- `--attn-backend flex` (otherwise default): the compiled unroll is compiled before step 1, which
  is what the default did before the background compile.

Per configuration: seconds from the process start to the line "step 1:" (target load and data included), the
trainer's own step-1 time (from its loop start), when the background compile was ready (the "is ready" line), steps
done within the budget, and the tokens/s of the last logged step. The processes share the machine (16 cores for
the compiles of both), so each number is an upper bound of what the configuration takes alone.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, record  # noqa: E402

CONFIGS = {
    "default": [],
    "compile-first": ["--attn-backend", "flex"],
}


def _watch(name: str, proc: subprocess.Popen, t_start: float, out: dict, log_dir: Path) -> None:
    """Read the trainer's stderr lines as they come, stamping the ones that matter."""
    log = open(log_dir / f"{name}.log", "w")
    for line in proc.stderr:
        now = time.time() - t_start
        log.write(f"{now:8.1f} {line}")
        log.flush()
        m = re.match(r"step 1: ([0-9.]+)s", line)
        if m and "first_step_wall_s" not in out:
            out["first_step_wall_s"] = now
            out["first_step_trainer_s"] = float(m.group(1))
        if "is ready (" in line and "ready_wall_s" not in out:
            out["ready_wall_s"] = now
            out["ready_at_step"] = int(re.match(r"step (\d+)", line).group(1))
        if line.startswith("warning:") or line.startswith("error:"):
            out.setdefault("note", line.strip()[:160])
    log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", required=True, help="online training data (a directory of .py files)")
    ap.add_argument("--budget", type=float, default=110.0, help="seconds each configuration may run")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="first-step-"))
    log_dir = Path(os.environ.get("OUT", work))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    runs = {}
    t_start = time.time()
    for name in args.configs.split(","):
        cmd = [
            sys.executable,
            "-m",
            "draftsmith",
            "train",
            "--target",
            args.target,
            "--online",
            "--data",
            args.data,
            "--on-bad",
            "skip",
            "--out",
            str(work / name),
            "--steps",
            "100000",
            "--save-every",
            "0",
            "--eval-fraction",
            "0",
            "--max-time",
            str(args.budget - 15),
            "-q",
            *CONFIGS[name],
        ]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        res = {"config": name, "flags": " ".join(CONFIGS[name]) or "(defaults)"}
        th = threading.Thread(target=_watch, args=(name, proc, t_start, res, log_dir), daemon=True)
        th.start()
        runs[name] = (proc, res, th)
    deadline = t_start + args.budget
    for name, (proc, res, th) in runs.items():
        try:
            proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            res.setdefault("note", f"killed at the {args.budget:.0f} s budget")
        th.join(timeout=5)
        metrics = work / name / "metrics.jsonl"
        recs = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.is_file() else []
        res["steps_done"] = len(recs)
        if recs:
            res["last_tokens_per_s"] = recs[-1].get("tokens_per_s")
        if "first_step_wall_s" not in res:
            res["first_step_wall_s"] = f"> {args.budget:.0f}"
    rows = [r for _, r, _ in runs.values()]
    cols = [
        "config",
        "flags",
        "first_step_wall_s",
        "first_step_trainer_s",
        "ready_wall_s",
        "ready_at_step",
        "steps_done",
        "last_tokens_per_s",
        "note",
    ]
    body = (
        markdown_table(rows, cols) + "\n\nAll configurations ran at once on one GPU (the compiles share the CPU "
        "cores), `draftsmith train --online` from the target's own process start: first_step_wall_s includes "
        "python start-up, the target load and tokenizing the data; first_step_trainer_s is the trainer's own "
        "'step 1:' time (from its loop start). ready: when the background compile finished and the steps "
        "switched to the compiled unroll (default configuration only)."
    )
    record(
        "train_first_step",
        "Training: time to the first step (default settings vs compile-first)",
        body,
        {"rows": rows, "budget_s": args.budget},
        f"python bench/train_first_step.py --target {args.target} --data {args.data} --budget {args.budget:g}",
    )


if __name__ == "__main__":
    main()
