"""Time to the first training step (GPU): `draftsmith train` with its default settings against the other ways to
start (draftsmith/train/warmup.py).

    python bench/train_first_step.py --target PATH/pycode-small --data draftsmith [--total 285]

Runs `draftsmith train --online` (the target in the loop, so no store has to be captured first) once per
configuration, ONE AT A TIME (each compile has the machine's cores to itself), each with its own empty torch compile
cache (TORCHINDUCTOR_CACHE_DIR; triton's cache lives under it) unless it is the second run of one:

* `default` -- the settings a user gets (`--attn-backend auto --compile auto`): the steps run the chunked attention
  from step 1 while a separate process compiles the TTT unroll into torch's compile caches; then the trainer
  compiles it from the warm caches and switches;
* `default-second-run` -- the same again on the first run's (now warm) cache: a user's next run on the machine;
* `compile-first` -- `--attn-backend flex`: the compiled unroll is compiled before step 1 (the default until the
  background compile; what an explicit `--attn-backend flex` does);
* `background-thread` -- `--attn-backend background`: the compile in a thread of the trainer (experimental: torch's
  tracer is not thread-safe).

A run is stopped (its process group killed) `--after` seconds after its steps became compiled, or at its budget.
Per configuration: seconds from the process start to "step 1:" (python start, target load and data included), the
trainer's own step-1 time, when compiled steps began, the seconds the switch step took (the in-process compile from
the warm caches), the steps done by a common horizon (the earliest stop of all runs), and the steady tokens/s (the
mean of the last steps, all compiled).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, record  # noqa: E402

# name -> (flags, cache: "own" = a fresh cache dir, or the name of the run whose cache it reuses, budget seconds)
CONFIGS = {
    "default": ([], "own", 105.0),
    "compile-first": (["--attn-backend", "flex"], "own", 80.0),
    "default-second-run": ([], "default", 45.0),
    "background-thread": (["--attn-backend", "background"], "own", 80.0),
}


def _watch(name: str, proc: subprocess.Popen, t_start: float, out: dict, log) -> None:
    """Read the trainer's stderr lines as they come, stamping the ones that matter."""
    for line in proc.stderr:
        now = time.time() - t_start
        log.write(f"[{name}] {now:8.1f} {line}")
        log.flush()
        m = re.match(r"step 1: ([0-9.]+)s", line)
        if m and "first_step_wall_s" not in out:
            out["first_step_wall_s"] = round(now, 1)
            out["first_step_trainer_s"] = float(m.group(1))
            if out["config"] == "compile-first":
                out["compiled_wall_s"] = round(now, 1)
        m = re.match(r"step (\d+): the compiled .* is ready \((\d+)s", line)
        if m and "ready_wall_s" not in out:
            out["ready_wall_s"] = round(now, 1)
            out["ready_at_step"] = int(m.group(1))
            out["compile_elsewhere_s"] = int(m.group(2))
            if out["config"] == "background-thread":
                out["compiled_wall_s"] = round(now, 1)
        m = re.match(r"step (\d+): ([0-9.]+)s \(includes compiling .* from the warm caches\)", line)
        if m:
            out["switch_step_s"] = float(m.group(2))
            out["compiled_wall_s"] = round(now, 1)
        if line.startswith("warning:") or line.startswith("error:") or "Traceback" in line:
            out.setdefault("note", line.strip()[:160])


def _run(name: str, args, work: Path, log) -> dict:
    flags, cache, budget = CONFIGS[name]
    cache_dir = work / "cache" / (name if cache == "own" else cache)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    env.pop("TRITON_CACHE_DIR", None)  # inductor puts triton's under its own
    out_dir = work / re.sub(r"\W+", "-", name)
    cmd = [sys.executable, "-m", "draftsmith", "train", "--target", args.target, "--online", "--data", args.data]
    cmd += ["--on-bad", "skip", "--out", str(out_dir), "--steps", "100000", "--save-every", "0"]
    cmd += ["--eval-fraction", "0", "--max-time", str(budget), "-q", *flags]
    res = {"config": name, "flags": " ".join(flags) or "(defaults)", "cache": "own, empty" if cache == "own" else cache}
    t_start = time.time()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    th = threading.Thread(target=_watch, args=(name, proc, t_start, res, log), daemon=True)
    th.start()
    while proc.poll() is None:
        now = time.time() - t_start
        compiled = res.get("compiled_wall_s")
        if now >= budget + 10 or (compiled is not None and now >= compiled + args.after):
            break
        time.sleep(0.2)
    res["stopped_s"] = round(time.time() - t_start, 1)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its compile process (one process group)
    proc.wait()
    th.join(timeout=5)
    child_log = out_dir / "compile_warmup.log"  # the warm start's compile process
    if child_log.is_file():
        log.write(f"[{name}] compile_warmup.log:\n{child_log.read_text(errors='replace')[-3000:]}\n")
    metrics = out_dir / "metrics.jsonl"
    recs = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.is_file() else []
    if "first_step_wall_s" in res and recs:
        offset = res["first_step_wall_s"] - res["first_step_trainer_s"]  # trainer loop start, from process start
        res["_walls"] = [offset + r["elapsed_s"] for r in recs]
        tail = recs[-min(len(recs) - 1, 30) :] if len(recs) > 1 else []
        if tail and res.get("compiled_wall_s") is not None:
            i0 = len(recs) - len(tail) - 1
            toks = sum(r["tokens"] for r in tail)
            res["steady_tokens_per_s"] = round(toks / max(1e-9, recs[-1]["elapsed_s"] - recs[i0]["elapsed_s"]))
    res["steps_done"] = len(recs)
    if "first_step_wall_s" not in res:
        res["first_step_wall_s"] = f"> {res['stopped_s']:.0f}"
    time.sleep(2)  # the killed processes' GPU memory back
    return res


def _torch_caches() -> str:
    code = (
        "import torch, torch._inductor.config as c, torch._functorch.config as f;"
        "print(torch.__version__, 'fx_graph_cache', c.fx_graph_cache, 'autograd_cache', f.enable_autograd_cache,"
        "'bundle_triton', getattr(c, 'bundle_triton_into_fx_graph_cache', None))"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", required=True, help="online training data (a directory of .py files)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--after", type=float, default=6.0, help="seconds of compiled steps before a run is stopped")
    ap.add_argument(
        "--total", type=float, default=285.0, help="seconds for all runs; a run that may not fit is skipped"
    )
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="first-step-"))
    log_dir = Path(os.environ.get("OUT", work))
    log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    rows, skipped = [], []
    caches = _torch_caches()
    with open(log_dir / "train_first_step.log", "w") as log:
        for name in args.configs.split(","):
            budget = CONFIGS[name][2]
            if time.time() - t0 + budget + 10 > args.total:  # its worst case must fit
                skipped.append(name)
                continue
            rows.append(_run(name, args, work, log))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "_walls"}), flush=True)
    horizon = min((r["_walls"][-1] for r in rows if r.get("_walls")), default=None)
    for r in rows:
        walls = r.pop("_walls", [])
        if horizon is not None:
            r[f"steps_by_{horizon:.0f}s"] = sum(w <= horizon for w in walls)
    cols = ["config", "flags", "cache", "first_step_wall_s", "first_step_trainer_s", "ready_wall_s"]
    cols += ["compile_elsewhere_s", "switch_step_s", "compiled_wall_s", "steps_done"]
    cols += ([f"steps_by_{horizon:.0f}s"] if horizon is not None else []) + ["steady_tokens_per_s", "note"]
    body = (
        markdown_table(rows, cols) + "\n\nEach configuration ran alone on the machine, one after the other, each with "
        "an empty torch compile cache except the second run (the default's cache, warm). All seconds are wall time "
        "from the trainer's process start (python start-up, the target load and tokenizing the data included), "
        "except first_step_trainer_s (from the trainer's loop start) and switch_step_s (the step that compiled the "
        "unroll in the trainer from the warm caches). ready: the compile elsewhere (a process, or the thread) was "
        "done; compiled_wall_s: from here on the steps ran compiled; a run was stopped "
        f"{args.after:g} s later. steps_by: optimizer steps done by the earliest stop of all runs. steady tokens/s: "
        f"the last steps (compiled). torch: {caches}."
        + (f" Skipped (out of time): {', '.join(skipped)}." if skipped else "")
    )
    record(
        "train_first_step",
        "Training: time to the first step (default warm start vs compile-first vs background thread)",
        body,
        {"rows": rows, "after_s": args.after, "torch_caches": caches, "skipped": skipped},
        f"python bench/train_first_step.py --target {args.target} --data {args.data} --total {args.total:g}",
    )


if __name__ == "__main__":
    main()
