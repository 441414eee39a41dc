"""Side by side (GPU): draftsmith's EAGLE-3 trainer vs speculators 0.9.0's, same data, same held-out split.

    python bench/train_compare.py --target PATH/pycode-small --store STORE --work DIR \
        [--draft-vocab-size 8192] [--ttt-steps 7] [--batch-tokens 8192] [--steps 200] [--lr 1e-4] \
        [--seed 0] [--eval-fraction 0.02] [--time-budget 540] [--dry-run]

Phases (each in try/except; what finished is reported even when a later phase fails):

1. split + export: the trainer's held-out split of STORE (`draftsmith.train.heldout.heldout_split`, i.e.
   `data.split_train_eval(n, --eval-fraction, --seed)`, the split `draftsmith train` uses). The store is
   exported with `draftsmith.export.speculators_store` (the code behind `draftsmith store export --format
   speculators`) with its rows REORDERED: training samples first (ascending), held-out samples last.
   speculators' `ArrowDataset` trains on rows `[0, int(n * --train-data-ratio))` and validates on the rest,
   so `--train-data-ratio (n_train + 0.5) / n` makes its split exactly ours. The row -> store-sample mapping
   is written to `EXPORT/draftsmith_split.json`. draftsmith's draft vocab (`build_draft_vocab` of the store's
   token counts, as the trainer builds it) is saved as `EXPORT/d2t-V.npy`, `t2d-V.npy` and passed with
   `--d2t-path/--t2d-path`, so both drafters predict over the same draft vocabulary.
2. speculators: its own CLI code (`TrainConfig.resolve(argv)` + `speculators.train.cli.main`, i.e. exactly
   `speculators train ARGV`) in a subprocess of this script (`--_runner speculators`), which also records
   its per-step metric log (the trainer's own `profile.tokens_per_s`/`step_ms`) and peak GPU memory.
3. draftsmith: `draftsmith train ARGV` in a subprocess (`--_runner draftsmith`) with matching settings.
4. both final drafters scored by `evaluate_drafter` (the trainer's eval code) on the same held-out samples.
5. table + BENCHMARKS.md entry (`bench/common.record`) with both runs' full settings and commands.

Matching settings (speculators flag <- draftsmith setting):
  --target-layer-ids = store aux layers + 1 (hidden_states ids)    --draft-vocab-size V + our d2t/t2d
  --ttt-steps K, --ttt-step-loss-decay 0.8 (our --step-weight)      --total-seq-len B (= our --batch-tokens B)
  --max-steps N + --epochs ceil so that N steps fit (speculators runs one more step per extra epoch
    after max_steps, so the epoch count is the smallest that holds N packed batches)
  --optimizer adamw (speculators 0.9.0 defaults to Muon for 2-D weights), --lr, --scheduler-type cosine,
  --scheduler-warmup-ratio 0.015 (our warmup), --weight-decay 0 (ours)
  our --grad-clip 1.0 (speculators hard-codes clip_grad_norm_ 1.0)
  architecture = ours: --num-layers 1 --no-norm-before-fc --no-norm-output --no-norm-before-residual
    --full-attention-indices 0 (speculators' eagle3 defaults add an input norm, feed normed outputs back and
    use a 2048-token sliding window; draftsmith's loader refuses the first two as unimplemented variants)
  data: --on-missing raise --mask-token-id 0 --hidden-states-dtype bfloat16; speculators' fused loss crashes
    under torch.compile on torch 2.11: --loss-implementation eager (the forward stays compiled; set
    --spec-dynamo-disable to add TORCHDYNAMO_DISABLE=1 instead/as well).
Not matched (not configurable in speculators): AdamW betas (speculators: torch defaults 0.9/0.999; ours
0.9/0.95), its packing (LPT multipack vs our greedy in-order packing; both one packed row of <= B tokens per
step), its loss (kl_div per step vs our soft CE — equal up to the teacher entropy).

Throughput: tokens/s = real (non-padding) tokens / step time, summed over steps after `--skip-steps`
(compile warm-up): speculators' own per-step profile (`tokens_per_s`, `step_ms`, including data fetch), and
draftsmith's metrics.jsonl (`tokens`, `elapsed_s` differences; the step that ran eval is excluded). Also the
end-to-end rate: all tokens trained / the subprocess wall time (start-up, loading, compiles, eval, saving).
Peak memory: torch.cuda.max_memory_allocated/reserved in each subprocess.

`--dry-run`: print the exact commands (and the split) without training; nothing is written.

Device run (one call; wheels of speculators 0.9.0 and the packages the image lacks in `.whl/`, the target in
`.carry/pycode-small`; carry both):
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site || exit; export PYTHONUNBUFFERED=1;
    python3 -m draftsmith capture --target .carry/pycode-small --data /usr/lib/python3.12 --out /tmp/store \
        --max-samples 600 --quiet && python3 bench/train_compare.py --target .carry/pycode-small --store /tmp/store \
        --work /tmp/cmp --draft-vocab-size 8192 --ttt-steps 7 --batch-tokens 8192 --steps 60 --lr 1e-3 --eval-fraction 0.05 \
        --time-budget 480 2>&1 | tee $OUT/train_compare.log
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, markdown_table, record  # noqa: E402

from draftsmith.target_model.layers import to_hidden_states_ids  # noqa: E402

SPLIT_FILE = "draftsmith_split.json"


# ---------------------------------------------------------------------------------------------------------
# split + export
# ---------------------------------------------------------------------------------------------------------
class ReorderedStore:
    """A store view whose sample r is `store[order[r]]` (for `export_speculators`)."""

    def __init__(self, store, order):
        self.store = store
        self.order = [int(i) for i in order]
        self.manifest = store.manifest
        self.path = getattr(store, "path", "")
        self.compute_dtype = getattr(store, "compute_dtype", None)

    def __len__(self):
        return len(self.order)

    def __getitem__(self, r):
        return self.store[self.order[r]]

    def token_counts(self):  # whole store, same rows: the counts do not depend on the order
        return self.store.token_counts()


def train_data_ratio(n_train: int, n: int) -> float:
    """The speculators --train-data-ratio whose split index int(n * ratio) is exactly n_train."""
    if not 0 < n_train < n:
        raise ValueError(f"need 0 < n_train < n, got {n_train}, {n}")
    r = (n_train + 0.5) / n
    assert int(n * r) == n_train
    return r


def plan_split(n: int, seed: int, eval_fraction: float) -> dict:
    from draftsmith.train.heldout import heldout_split

    train_idx, eval_idx = heldout_split(n, seed, eval_fraction)
    order = list(train_idx) + list(eval_idx)
    return {
        "num_samples": n,
        "seed": seed,
        "eval_fraction": eval_fraction,
        "train_samples": list(train_idx),
        "eval_samples": list(eval_idx),
        "row_to_sample": order,  # export row r = store sample order[r]
        "num_train_rows": len(train_idx),
        "train_data_ratio": train_data_ratio(len(train_idx), n),
    }


def export_split(store, out_dir: Path, split: dict, draft_vocab_size: int, progress: bool = True) -> dict:
    """Export `store` with held-out samples last; write the split mapping and draftsmith's draft vocab."""
    import numpy as np

    from draftsmith.drafter.vocab import build_draft_vocab
    from draftsmith.export.speculators_store import export_speculators

    summary = export_speculators(ReorderedStore(store, split["row_to_sample"]), out_dir, progress=progress)
    d2t, t2d = build_draft_vocab(store.token_counts(), draft_vocab_size)
    np.save(out_dir / f"d2t-{draft_vocab_size}.npy", d2t.numpy().astype(np.int64))
    np.save(out_dir / f"t2d-{draft_vocab_size}.npy", t2d.numpy().astype(bool))
    (out_dir / SPLIT_FILE).write_text(json.dumps(split) + "\n")
    return summary


def speculators_batches_per_epoch(lengths, total_seq_len: int, seed: int, epochs: int = 64) -> list[int]:
    """Packed batches per epoch of speculators' sampler (single GPU) for the training rows' lengths."""
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    s = MultipackDistributedBatchSamplerV2(
        batch_max_length=total_seq_len, lengths=list(lengths), num_replicas=1, rank=0, seed=seed
    )
    return [len(s._generate_batches(e)) for e in range(epochs)]


def epochs_for_steps(steps: int, per_epoch: list[int]) -> int:
    tot = 0
    for e, b in enumerate(per_epoch):
        tot += b
        if tot >= steps:
            return e + 1
    return len(per_epoch) + math.ceil((steps - tot) / max(1, min(per_epoch)))


# ---------------------------------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------------------------------
def speculators_argv(
    a, *, export_dir: Path, target_layer_ids: list[int], ratio: float, epochs: int, save_path: Path, log_dir: Path
) -> list[str]:
    """The argument list of `speculators train` (speculators 0.9.0) matching draftsmith's settings."""
    V = a.draft_vocab_size
    return [
        "--speculator-type", "eagle3",
        "--verifier-name-or-path", str(a.target),
        "--data-path", str(export_dir),
        "--target-layer-ids", *[str(i) for i in target_layer_ids],
        "--hidden-states-dtype", "bfloat16",
        "--on-missing", "raise",
        "--mask-token-id", "0",
        "--loss-implementation", "eager",
        "--draft-vocab-size", str(V),
        "--d2t-path", str(export_dir / f"d2t-{V}.npy"),
        "--t2d-path", str(export_dir / f"t2d-{V}.npy"),
        "--ttt-steps", str(a.ttt_steps),
        "--ttt-step-loss-decay", str(a.step_weight),
        "--total-seq-len", str(a.batch_tokens),
        "--train-data-ratio", repr(ratio),
        "--epochs", str(epochs),
        "--max-steps", str(a.steps),
        "--optimizer", "adamw",
        "--lr", str(a.lr),
        "--weight-decay", "0.0",
        "--scheduler-type", "cosine",
        "--scheduler-warmup-ratio", str(a.warmup),
        "--num-layers", "1",
        "--no-norm-before-fc",
        "--no-norm-output",
        "--no-norm-before-residual",
        "--full-attention-indices", "0",
        "--num-workers", str(a.spec_workers),
        "--log-freq", "1",
        "--seed", str(a.seed),
        "--save-path", str(save_path),
        "--log-dir", str(log_dir),
        *shlex.split(a.spec_extra),
    ]  # fmt: skip


def draftsmith_argv(a, *, run_dir: Path) -> list[str]:
    """The argument list of `draftsmith train` matching the speculators run."""
    return [
        "train",
        "--target", str(a.target),
        "--store", str(a.store),
        "--out", str(run_dir),
        "--steps", str(a.steps),
        "--ttt-steps", str(a.ttt_steps),
        "--step-weight", str(a.step_weight),
        "--draft-vocab-size", str(a.draft_vocab_size),
        "--batch-tokens", str(a.batch_tokens),
        "--lr", str(a.lr),
        "--warmup", str(a.warmup),
        "--weight-decay", "0.0",
        "--grad-clip", "1.0",
        "--seed", str(a.seed),
        "--eval-fraction", str(a.eval_fraction),
        "--save-every", "0",
        "--num-layers", "1",
        "--attn-backend", a.attn_backend,
        "--quiet",
        *shlex.split(a.ds_extra),
    ]  # fmt: skip


def _runner_cmd(kind: str, stats: Path, argv: list[str]) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--_runner", kind, "--_stats", str(stats), "--", *argv]


def _env(dynamo_disable: bool = False) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if dynamo_disable:
        env["TORCHDYNAMO_DISABLE"] = "1"
    return env


# ---------------------------------------------------------------------------------------------------------
# runners (this script re-invoked in a subprocess)
# ---------------------------------------------------------------------------------------------------------
def _peak_memory() -> dict:
    try:
        import torch

        if torch.cuda.is_available():
            return {
                "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
            }
    except Exception:
        pass
    return {}


def _jsonable(x):
    try:
        json.dumps(x)
        return x
    except TypeError:
        if isinstance(x, dict):
            return {str(k): _jsonable(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [_jsonable(v) for v in x]
        return str(x)


def run_speculators_inprocess(argv: list[str], stats_path: Path) -> int:
    """`speculators train ARGV` exactly (speculators.cli.train.train_command = main(TrainConfig.resolve(args))),
    plus a handler on the 'speculators.metrics' logger that records every metric dict, and peak memory."""
    import logging

    import speculators.train.cli as scli
    from speculators.train.config import TrainConfig

    records: list = []
    t0 = time.time()
    last_write = [t0]

    def write_stats(rc, err):
        stats = {"wall_s": time.time() - t0, "rc": rc, "error": err, "metrics": records, **_peak_memory()}
        tmp = stats_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(stats))
        os.replace(tmp, stats_path)

    class _Rec(logging.Handler):
        def emit(self, record):
            if isinstance(record.msg, dict) and not getattr(record, "hparams", False):
                records.append(_jsonable(record.msg))
                # partial stats every few seconds: a run stopped by the time budget still reports its throughput
                if time.time() - last_write[0] > 5:
                    last_write[0] = time.time()
                    write_stats("running", None)
                    print(
                        f"speculators: {len(records)} metric records after {time.time() - t0:.0f}s: "
                        f"{str(records[-1])[:300]}",
                        flush=True,
                    )

    orig = scli.setup_metric_logger

    def patched(*a, **k):
        orig(*a, **k)
        logging.getLogger("speculators.metrics").addHandler(_Rec())

    scli.setup_metric_logger = patched
    rc, err = 0, None
    try:
        scli.main(TrainConfig.resolve(argv))
    except SystemExit as e:
        rc = int(e.code or 0)
    except BaseException:
        rc, err = 1, traceback.format_exc()
    write_stats(rc, err)
    if err:
        print(err, file=sys.stderr)
    return rc


def run_draftsmith_inprocess(argv: list[str], stats_path: Path) -> int:
    from draftsmith.cli import main

    t0 = time.time()
    rc, err = 0, None
    try:
        main(argv)
    except SystemExit as e:
        rc = int(e.code or 0)
    except BaseException:
        rc, err = 1, traceback.format_exc()
    stats_path.write_text(json.dumps({"wall_s": time.time() - t0, "rc": rc, "error": err, **_peak_memory()}))
    if err:
        print(err, file=sys.stderr)
    return rc


# ---------------------------------------------------------------------------------------------------------
# throughput from the logs
# ---------------------------------------------------------------------------------------------------------
def speculators_throughput(records: list, skip: int) -> dict:
    toks = secs = 0.0
    n = total_tokens = 0
    for r in records:
        prof = r.get("profile") if isinstance(r, dict) else None
        if not prof or "train" not in r:
            continue
        step_s = float(prof["step_ms"]) / 1000
        t = float(prof["tokens_per_s"]) * step_s
        total_tokens += int(round(t))
        if int(r.get("global_step", 0)) < skip:
            continue
        toks += t
        secs += step_s
        n += 1
    return {"tokens_per_s": toks / secs if secs else None, "timed_steps": n, "tokens_trained": total_tokens}


def draftsmith_throughput(metrics_path: Path, skip: int) -> dict:
    recs = [json.loads(x) for x in Path(metrics_path).read_text().splitlines() if x.strip()]
    toks = secs = 0.0
    n = 0
    prev = None
    for r in recs:
        if prev is not None and r["step"] > skip and not any(k.startswith("eval_") for k in r):
            toks += r["tokens"]
            secs += r["elapsed_s"] - prev
            n += 1
        prev = r["elapsed_s"]
    return {
        "tokens_per_s": toks / secs if secs else None,
        "timed_steps": n,
        "tokens_trained": int(sum(r["tokens"] for r in recs)),
        "final_eval_tau_sim": next((r["eval_tau_sim"] for r in reversed(recs) if "eval_tau_sim" in r), None),
    }


def latest_speculators_checkpoint(save_path: Path) -> Path | None:
    eps = (
        [d for d in Path(save_path).iterdir() if d.is_dir() and not d.is_symlink() and d.name.isdigit()]
        if Path(save_path).is_dir()
        else []
    )
    return max(eps, key=lambda d: int(d.name)) if eps else None


# ---------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target")
    p.add_argument("--store")
    p.add_argument("--work", default="runs/train_compare", help="working directory (export, runs, logs)")
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--step-weight", type=float, default=0.8)
    p.add_argument(
        "--batch-tokens", type=int, default=8192, help="token budget of a packed row (= speculators --total-seq-len)"
    )
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=float, default=0.015, help="warmup fraction of the steps (both trainers)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-fraction", type=float, default=0.02)
    p.add_argument("--eval-max-batches", type=int, default=0, help="held-out rows scored (0: all)")
    p.add_argument("--skip-steps", type=int, default=5, help="first steps excluded from tokens/s (compiles)")
    p.add_argument(
        "--time-budget",
        type=float,
        default=540.0,
        help="seconds for the whole script; each training subprocess is killed when it would pass it",
    )
    p.add_argument(
        "--score-reserve",
        type=float,
        default=90.0,
        help="seconds of --time-budget kept for scoring both drafters and the report",
    )
    p.add_argument(
        "--spec-share",
        type=float,
        default=0.5,
        help="fraction of the remaining budget speculators may use when both trainers run (it runs first)",
    )
    p.add_argument("--spec-workers", type=int, default=4, help="speculators --num-workers")
    p.add_argument("--spec-dynamo-disable", action="store_true", help="also set TORCHDYNAMO_DISABLE=1 for speculators")
    p.add_argument(
        "--attn-backend",
        default="auto",
        choices=["auto", "flex", "chunked"],
        help="draftsmith TTT attention backend (training and scoring)",
    )
    p.add_argument("--ds-extra", default="", help="extra `draftsmith train` arguments (one string)")
    p.add_argument("--spec-extra", default="", help="extra `speculators train` arguments (one string)")
    p.add_argument("--only", choices=["both", "speculators", "draftsmith"], default="both")
    p.add_argument("--no-record", action="store_true", help="do not append to BENCHMARKS.md")
    p.add_argument("--dry-run", action="store_true", help="print the split and the exact commands; run nothing")
    p.add_argument("--_runner", choices=["speculators", "draftsmith"], help=argparse.SUPPRESS)
    p.add_argument("--_stats", help=argparse.SUPPRESS)
    p.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if not a._runner:
        if not a.target or not a.store:
            p.error("--target and --store are required")
        # absolute paths: the commands run from the repository root and are recorded as printed
        a.store = str(Path(a.store).resolve())
        if Path(a.target).exists():
            a.target = str(Path(a.target).resolve())
    return a


def _fmt_cmd(cmd: list[str], env_extra: str = "") -> str:
    return (env_extra + " " if env_extra else "") + " ".join(shlex.quote(c) for c in cmd)


def plan(a) -> dict:
    """Everything that does not need the GPU: split, paths, commands (dry-run prints this)."""
    from draftsmith.store import HiddenStateStore

    store = HiddenStateStore.open(a.store)
    work = Path(a.work).resolve()
    split = plan_split(len(store), a.seed, a.eval_fraction)
    aux = [int(i) for i in store.manifest["aux_layers"]]
    export_dir = work / "speculators_data"
    try:
        from draftsmith.train.batches import source_lengths

        lengths = source_lengths(store)
        per_epoch = speculators_batches_per_epoch(
            [min(int(lengths[i]), a.batch_tokens) for i in split["train_samples"]], a.batch_tokens, a.seed
        )
        epochs = epochs_for_steps(a.steps, per_epoch)
    except ImportError:  # speculators not installed here: a lower bound from the token count
        per_epoch = None
        epochs = 1
    spec = speculators_argv(
        a,
        export_dir=export_dir,
        target_layer_ids=to_hidden_states_ids(aux),
        ratio=split["train_data_ratio"],
        epochs=epochs,
        save_path=work / "speculators_run",
        log_dir=work / "speculators_logs",
    )
    ds = draftsmith_argv(a, run_dir=work / "draftsmith_run")
    return {
        "store": store,
        "work": work,
        "split": split,
        "aux_layers": aux,
        "export_dir": export_dir,
        "spec_argv": spec,
        "ds_argv": ds,
        "spec_epochs": epochs,
        "spec_batches_per_epoch": per_epoch,
        "spec_cmd": _fmt_cmd(["speculators", "train", *spec], "TORCHDYNAMO_DISABLE=1" if a.spec_dynamo_disable else ""),
        "ds_cmd": _fmt_cmd(["draftsmith", *ds]),
    }


def main(argv=None) -> int:
    a = parse_args(argv)
    if a._runner:
        fn = run_speculators_inprocess if a._runner == "speculators" else run_draftsmith_inprocess
        return fn(list(a.rest), Path(a._stats))

    t_start = time.time()
    deadline = t_start + a.time_budget
    P = plan(a)
    split = P["split"]
    print(
        f"split: {split['num_samples']} samples, {split['num_train_rows']} train / {len(split['eval_samples'])} held out "
        f"(seed {a.seed}, eval fraction {a.eval_fraction}); speculators --train-data-ratio {split['train_data_ratio']!r}"
    )
    print(
        f"aux layers {P['aux_layers']} (layer-output ids) = --target-layer-ids {to_hidden_states_ids(P['aux_layers'])}"
    )
    if P["spec_batches_per_epoch"]:
        print(
            f"speculators: {P['spec_batches_per_epoch'][0]} packed batches in epoch 0 -> --epochs {P['spec_epochs']} "
            f"--max-steps {a.steps}"
        )
    print(f"export:      draftsmith.export.speculators_store(reordered store) -> {P['export_dir']}")
    print(f"speculators: {P['spec_cmd']}")
    print(f"draftsmith:  {P['ds_cmd']}")
    if a.dry_run:
        return 0

    res: dict = {
        "settings": {k: v for k, v in vars(a).items() if not k.startswith("_") and k != "rest"},
        "speculators_cmd": P["spec_cmd"],
        "draftsmith_cmd": P["ds_cmd"],
        "errors": {},
    }
    work = P["work"]
    work.mkdir(parents=True, exist_ok=True)

    # 1. export
    try:
        if (P["export_dir"] / SPLIT_FILE).is_file() and json.loads((P["export_dir"] / SPLIT_FILE).read_text())[
            "row_to_sample"
        ] == split["row_to_sample"]:
            print(f"export: reusing {P['export_dir']}")
        else:
            t = time.time()
            s = export_split(P["store"], P["export_dir"], split, a.draft_vocab_size)
            res["export"] = {"s": time.time() - t, "tokens": s["num_tokens"], "bytes": s["hidden_states_bytes"]}
            print(f"export: {s['num_samples']} rows, {s['num_tokens']} tokens in {time.time() - t:.0f}s")
    except Exception:
        res["errors"]["export"] = traceback.format_exc()
        print(res["errors"]["export"], file=sys.stderr)

    n_phases = 2 if a.only == "both" else 1
    done_phases = [0]

    def run_phase(kind, argv, env):
        stats = work / f"{kind}_stats.json"
        if stats.exists():
            stats.unlink()
        # keep --score-reserve for scoring and the report; split the rest fairly between the trainers still to run
        left = deadline - time.time() - a.score_reserve
        if n_phases - done_phases[0] > 1:  # speculators first, with its --spec-share of what is left
            left *= a.spec_share if kind == "speculators" else 1.0 / (n_phases - done_phases[0])
        done_phases[0] += 1
        if left < 30:
            res["errors"][kind] = f"skipped: time budget ({a.time_budget:.0f}s) spent"
            return None
        t = time.time()
        try:
            cp = subprocess.run(_runner_cmd(kind, stats, argv), env=env, timeout=left, cwd=str(REPO))
            rc = cp.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        wall = time.time() - t
        st = json.loads(stats.read_text()) if stats.exists() else {}
        st["subprocess_wall_s"] = wall
        if rc != 0:
            res["errors"][kind] = f"exit {rc}: {(st.get('error') or '')[-2000:]}"
        print(f"{kind}: exit {rc} after {wall:.0f}s")
        return st

    # 2. speculators  3. draftsmith
    import shutil

    if a.only == "both" and "export" in res["errors"]:
        done_phases[0] += 1  # speculators cannot run without its data: draftsmith gets the whole budget
    if a.only in ("both", "speculators") and "export" not in res["errors"]:
        shutil.rmtree(work / "speculators_run", ignore_errors=True)
        st = run_phase("speculators", P["spec_argv"], _env(a.spec_dynamo_disable))
        if st is not None:
            try:
                thr = speculators_throughput(st.get("metrics", []), a.skip_steps)
                res["speculators"] = {
                    **thr,
                    "wall_s": st.get("subprocess_wall_s"),
                    "e2e_tokens_per_s": thr["tokens_trained"] / st["subprocess_wall_s"],
                    "peak_allocated_gib": st.get("peak_allocated_gib"),
                    "peak_reserved_gib": st.get("peak_reserved_gib"),
                    "steps": sum(1 for r in st.get("metrics", []) if "train" in r),
                }
                vals = [r["val"] for r in st.get("metrics", []) if "val" in r]
                if vals:
                    res["speculators"]["own_val_last"] = vals[-1]
            except Exception:
                res["errors"]["speculators_logs"] = traceback.format_exc()
    if a.only in ("both", "draftsmith"):
        shutil.rmtree(work / "draftsmith_run", ignore_errors=True)
        st = run_phase("draftsmith", P["ds_argv"], _env())
        if st is not None:
            try:
                thr = draftsmith_throughput(work / "draftsmith_run" / "metrics.jsonl", a.skip_steps)
                res["draftsmith"] = {
                    **thr,
                    "wall_s": st.get("subprocess_wall_s"),
                    "e2e_tokens_per_s": thr["tokens_trained"] / st["subprocess_wall_s"],
                    "peak_allocated_gib": st.get("peak_allocated_gib"),
                    "peak_reserved_gib": st.get("peak_reserved_gib"),
                }
            except Exception:
                res["errors"]["draftsmith_logs"] = traceback.format_exc()

    # 4. score both on the same held-out split with the trainer's eval code
    try:
        import torch

        from draftsmith.drafter import Drafter
        from draftsmith.target_model import load_target
        from draftsmith.train.heldout import evaluate_drafter, open_store

        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        target = load_target(a.target, dtype="bf16" if dev.type == "cuda" else "fp32", device=dev)
        store = open_store(a.store, dev)
        ckpts = {
            "draftsmith": work / "draftsmith_run" / "final",
            "speculators": latest_speculators_checkpoint(work / "speculators_run"),
        }
        for name, path in ckpts.items():
            if path is None or not Path(path).is_dir():
                continue
            try:
                d = Drafter.from_pretrained(path, target=target, dtype=torch.float32)
                m = evaluate_drafter(
                    d,
                    target,
                    store,
                    split["eval_samples"],
                    ttt_steps=a.ttt_steps,
                    batch_tokens=a.batch_tokens,
                    device=dev,
                    step_weight=a.step_weight,
                    max_batches=a.eval_max_batches or None,
                    attn_backend=a.attn_backend,
                )
                res.setdefault(name, {})["heldout"] = m
                res[name]["checkpoint"] = str(path)
                print(f"{name}: held-out tau_sim {m['tau_sim']:.3f} acc {[round(x, 3) for x in m['acc']]}")
                del d
            except Exception:
                res["errors"][f"score_{name}"] = traceback.format_exc()
                print(res["errors"][f"score_{name}"], file=sys.stderr)
    except Exception:
        res["errors"]["score"] = traceback.format_exc()
        print(res["errors"]["score"], file=sys.stderr)

    # 5. report
    rows = []
    for name in ("draftsmith", "speculators"):
        r = res.get(name, {})
        h = r.get("heldout", {})
        rows.append(
            {
                "trainer": name,
                "steps_timed": r.get("timed_steps", ""),
                "tokens/s (steady)": r.get("tokens_per_s") or "",
                "tokens/s (end-to-end)": r.get("e2e_tokens_per_s") or "",
                "peak alloc GiB": r.get("peak_allocated_gib") or "",
                "wall s": r.get("wall_s") or "",
                "held-out tau_sim": h.get("tau_sim", ""),
                "acc_0": (h.get("acc") or [""])[0],
                "held-out loss": h.get("loss", ""),
            }
        )
    ratios = {}
    try:
        ratios["tokens_per_s_ratio"] = res["draftsmith"]["tokens_per_s"] / res["speculators"]["tokens_per_s"]
    except Exception:
        pass
    try:
        ratios["tau_sim_ratio"] = res["draftsmith"]["heldout"]["tau_sim"] / res["speculators"]["heldout"]["tau_sim"]
    except Exception:
        pass
    res["ratios"] = ratios
    cols = list(rows[0].keys())
    body = markdown_table(rows, cols)
    body += (
        "\n\n" + ", ".join(f"{k} = {v:.3f}" for k, v in ratios.items()) + " (goal: >= 1.5 tokens/s, >= 1.05 tau)"
        if ratios
        else ""
    )
    body += (
        f"\n\nSame store `{a.store}` ({split['num_samples']} samples; held out: {len(split['eval_samples'])}, seed "
        f"{a.seed}, fraction {a.eval_fraction}, exported with the held-out rows last, speculators "
        f"--train-data-ratio {split['train_data_ratio']!r}); same draft vocab (draftsmith's d2t/t2d), K={a.ttt_steps}, "
        f"token budget {a.batch_tokens}, {a.steps} steps, lr {a.lr}. Both scored by `evaluate_drafter`.\n\n"
        f"- speculators: `{P['spec_cmd']}`\n- draftsmith: `{P['ds_cmd']}`\n"
    )
    if res["errors"]:
        body += (
            "\nErrors: "
            + "; ".join(
                f"{k}: {str(v).strip().splitlines()[-1][:300] if str(v).strip() else ''}"
                for k, v in res["errors"].items()
            )
            + "\n"
        )
    (work / "train_compare.json").write_text(json.dumps(_jsonable({k: v for k, v in res.items()}), indent=2))
    cmd = "python bench/train_compare.py " + " ".join(
        shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:])
    )
    if a.no_record:
        print(body)
    else:
        record(
            "train_compare",
            "Training side by side: draftsmith vs speculators 0.9.0 (EAGLE-3, TTT)",
            body,
            _jsonable(res),
            cmd,
        )
    return 0 if not res["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
