"""Multi-GPU benchmark (issue #5): data-parallel capture, a tensor-parallel target, DDP and FSDP2 training,
each against 1 GPU of the same machine in the same run.

    python bench/multigpu.py --small PATH/pycode-small --gpus 2 [--corpus DIR] [--sections ...]

Sections (in this order; each is skipped once --time-budget would be exceeded, results so far are kept):
  capture      pycode-small, 1 GPU vs torchrun data parallel on N GPUs (same samples, same shard plan);
               the N-GPU store must be byte-identical to the 1-GPU store (same batches on the same GPU type)
  train        the pycode-small drafter from that store: 1 GPU vs DDP vs FSDP2 (`--fsdp`) on N GPUs,
               the same rows per GPU (weak scaling: N x the global batch)
  capture-8b   a Llama-3.1-8B-shaped random bf16 model: 1 GPU vs data parallel vs tensor parallel (`--tp`,
               transformers tp_plan="auto"); TP states compared with the 1-GPU store (max relative error)
  train-8b     an 8B-sized drafter (H=4096) from the 8B store: 1 GPU vs DDP vs FSDP2

Scaling efficiency = N-GPU tokens/s / (N x 1-GPU tokens/s); goal >= 0.9. Capture tokens/s = all ranks'
tokens / the slowest rank's capture time (model loading excluded, reported as wall). Training tokens/s = the
median of the per-step rates after the first steps (compile/warm-up), evaluation steps excluded.

`--device cpu --big-config tiny` is a smoke test of the whole harness with gloo processes (tests use it).
NVLink multicast stays off (NCCL_NVLS_ENABLE=0 etc. are set for every child process).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, markdown_table, record  # noqa: E402

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SECTIONS = ("capture", "train", "capture-8b", "train-8b")


# -- child processes ---------------------------------------------------------------------------------
def _env(gpus: int, device: str) -> dict:
    env = dict(os.environ, **NO_MULTICAST, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("OMP_NUM_THREADS", "1" if device == "cpu" else "4")
    if device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(gpus))
    return env


_PORT = [29600]


def _slug(*parts: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", "-".join(parts)).strip("-").lower()


def _launch(argv: list[str], procs: int, gpus: int, device: str, log: Path) -> tuple[int, float]:
    """Run `python ARGV...` as one process, or under torchrun with `procs` processes; returns (rc, wall)."""
    if procs > 1:
        _PORT[0] += 1
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(procs),
            "--master-port",
            str(_PORT[0]),
            *argv,
        ]
    else:
        cmd = [sys.executable, *argv]
    t = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, env=_env(gpus, device), stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.time() - t
    if rc != 0:
        tail = log.read_text()[-2500:]
        print(f"[multigpu] FAILED (rc {rc}): {' '.join(cmd)}\n{tail}", flush=True)
    return rc, wall


def _worker_capture(a) -> None:
    """One rank of a capture (run by torchrun or alone): run_capture with stats, one JSON per rank."""
    import numpy as np

    from draftsmith.capture.job import CaptureConfig, run_capture
    from draftsmith.data.loader import Sample

    z = np.load(a.samples, allow_pickle=False)
    ids, mask, off = z["ids"], z["mask"], z["offsets"]
    samples = [Sample(ids[off[i] : off[i + 1]], mask[off[i] : off[i + 1]], f"sample{i}") for i in range(len(off) - 1)]
    import torch

    from draftsmith.common.dist import dist_info, init_dist, resolve_device
    from draftsmith.target_model import load_target

    rank, world, local = dist_info()
    device = resolve_device("auto" if a.device == "cuda" else "cpu", local)
    if world > 1:
        init_dist(world, "nccl" if device.type == "cuda" else "gloo")
    t = time.time()
    target = load_target(
        a.target, dtype="bf16" if a.device == "cuda" else "fp32", device=device, tp_plan="auto" if a.tp else None
    )
    load_s = time.time() - t
    with torch.no_grad():  # warm-up (cuBLAS/attention kernels), so short captures time the steady state
        n = min(len(samples[0]), 512)
        target.decoder(
            input_ids=torch.from_numpy(samples[0].input_ids[:n].astype("int64"))[None].to(target.device),
            use_cache=False,
        )
    if device.type == "cuda":
        torch.cuda.synchronize()
    stats: dict = {"load_s": load_s}
    cfg = CaptureConfig(
        target=a.target,
        data=a.samples,
        out=a.out,
        dtype=a.store_dtype,
        batch_tokens=a.batch_tokens,
        device="auto" if a.device == "cuda" else "cpu",
        model_dtype="bf16" if a.device == "cuda" else "fp32",
        max_length=2048,
        tp=a.tp,
        progress=False,
    )
    run_capture(cfg, log=lambda *x, **k: None, samples=samples, stats=stats, target=target)
    rank = int(os.environ.get("RANK", 0))
    Path(a.stats_dir).mkdir(parents=True, exist_ok=True)
    (Path(a.stats_dir) / f"rank{rank}.json").write_text(json.dumps(stats))


def _worker_make_big(a) -> None:
    """Save a random-weight model of the Llama-3.1-8B shape (or a tiny one for the smoke test) as an HF dir."""
    import torch
    from models import llama31_8b_config, random_model
    from transformers import AutoTokenizer

    cfg = llama31_8b_config()
    if a.big_config == "tiny":
        cfg.update(
            dict(
                vocab_size=1024,
                hidden_size=128,
                intermediate_size=256,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=32,
            )
        )
    torch.manual_seed(0)
    dev = "cuda" if a.device == "cuda" else "cpu"
    model = random_model(cfg, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
    tok = AutoTokenizer.from_pretrained(a.tokenizer_from)
    if a.big_config == "tiny":  # keep token ids inside the tiny vocab: the smoke test's data stays valid
        cfg.vocab_size = max(cfg.vocab_size, len(tok))
        model.resize_token_embeddings(cfg.vocab_size)
    model.save_pretrained(a.out, safe_serialization=True)
    tok.save_pretrained(a.out)


# -- measurements ------------------------------------------------------------------------------------
def _capture_rate(stats_dir: Path, tp: bool) -> dict:
    ranks = [json.loads(p.read_text()) for p in sorted(stats_dir.glob("rank*.json"))]
    t = max(r["capture_s"] for r in ranks)
    tokens = ranks[0]["tokens"] if tp else sum(r["tokens"] for r in ranks)
    # the per-run fixed costs inside capture_s (pinned buffer allocation, the un-overlapped last writes) do not
    # shrink with more GPUs: on a short bench corpus they cap the measured efficiency. 'steady' leaves them out.
    fixed = max(r.get("alloc_s", 0.0) + r.get("drain_s", 0.0) for r in ranks)
    steady = max(r["capture_s"] - r.get("alloc_s", 0.0) - r.get("drain_s", 0.0) for r in ranks)
    return {
        "tokens": tokens,
        "tok/s": tokens / t,
        "capture s": t,
        "fixed s": fixed,
        "steady tok/s": tokens / steady if steady > 0 else None,
        "load s": max(r.get("load_s", 0.0) for r in ranks),
    }


def _shard_digests(store: Path) -> list:
    """(file, sha256) of every shard, as the capture recorded them in the manifest (no re-hashing of ~10 GB)."""
    return [(sh["file"], sh["sha256"]) for sh in json.loads((store / "manifest.json").read_text())["shards"]]


def _max_rel_err(a_path: Path, b_path: Path, n: int = 8) -> float:
    import torch

    from draftsmith.store import HiddenStateStore

    a = HiddenStateStore.open(a_path, dtype=torch.float32)
    b = HiddenStateStore.open(b_path, dtype=torch.float32)
    worst = 0.0
    for i in range(min(n, len(a))):
        x, y = a[i], b[i]
        for k in ("aux_hidden_states", "final_hidden_states"):
            worst = max(worst, float((x[k] - y[k]).norm() / x[k].norm().clamp_min(1e-12)))
    return worst


def _train_rate(run: Path, skip: int) -> dict:
    recs = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    steady = [r["tokens_per_s"] for r in recs[skip:] if "eval_tau_sim" not in r and "eval_loss" not in r]
    if not steady:
        steady = [r["tokens_per_s"] for r in recs]
    last = recs[-1]
    return {
        "tok/s": statistics.median(steady),
        "steps": last["step"],
        "tokens/step": last["tokens"],
        "final loss": last["loss"],
        "tau_sim": last["tau_sim"],
    }


def disk_write_gbs(where: Path, gib: float = 4.0) -> float:
    """Sequential write + fsync of `gib` GiB in 64 MiB blocks (what a store shard write does), in GB/s."""
    import numpy as np

    block = np.random.default_rng(0).integers(0, 255, 64 * 2**20, dtype=np.uint8).tobytes()
    path = Path(where) / "disk-probe.bin"
    n = max(1, round(gib * 16))
    t = time.time()
    with open(path, "wb") as f:
        for _ in range(n):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    dt = time.time() - t
    path.unlink()
    return n * len(block) / dt / 1e9


class Bench:
    def __init__(self, a):
        self.a = a
        self.work = Path(a.workdir or tempfile.mkdtemp(prefix="dsmulti-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict] = []
        self._corpus: dict = {}
        self.disk_gbs: float | None = None
        self.t0 = time.time()
        self.here = str(Path(__file__).resolve())
        out = os.environ.get("OUT")
        self.logs = Path(out) / "multigpu-logs" if out else self.work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.a.time_budget - (time.time() - self.t0)

    def add(self, row: dict) -> None:
        self.rows.append(row)
        print("[multigpu] " + json.dumps(row), flush=True)
        if os.environ.get("OUT"):
            (Path(os.environ["OUT"]) / "multigpu-partial.json").write_text(json.dumps(self.rows, indent=1))

    def _base(self, what: str, mode: str, gpus: int) -> dict:
        return {"what": what, "mode": mode, "GPUs": gpus}

    def samples_file(self, target: str, n_tokens: int, name: str) -> str:
        import numpy as np

        from draftsmith.data import load_samples
        from draftsmith.target_model.load import load_tokenizer

        path = self.work / f"{name}.npz"
        if path.is_file():
            return str(path)
        t = time.time()
        if target not in self._corpus:  # tokenized once per tokenizer
            self._corpus[target] = load_samples(self.a.corpus, load_tokenizer(target), max_length=2048, on_bad="skip")[
                0
            ]
        from capture import take_tokens  # bench/capture.py

        out = take_tokens(self._corpus[target], n_tokens)
        total = sum(len(s) for s in out)
        off = np.zeros(len(out) + 1, dtype=np.int64)
        np.cumsum([len(s) for s in out], out=off[1:])
        np.savez(
            path,
            ids=np.concatenate([s.input_ids for s in out]).astype(np.int32),
            mask=np.concatenate([s.loss_mask for s in out]),
            offsets=off,
        )
        print(
            f"[multigpu] {name}: {len(out)} samples, {total} tokens of {self.a.corpus} ({time.time() - t:.0f}s)",
            flush=True,
        )
        return str(path)

    def capture(self, what: str, target: str, samples: str, modes: list[tuple[str, int, bool]]) -> Path | None:
        """modes: (label, processes, tp). Returns the 1-GPU store (kept for training)."""
        a, ref = self.a, None
        base_rate = base_steady = None
        for label, procs, tp in modes:
            if self.left() < a.min_section_s:
                print(f"[multigpu] {what} {label}: skipped (time budget)", flush=True)
                continue
            out, sd = self.work / _slug("store", what, label), self.work / _slug("stats", what, label)
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(sd, ignore_errors=True)
            argv = [
                self.here,
                "_capture",
                "--target",
                target,
                "--samples",
                samples,
                "--out",
                str(out),
                "--stats-dir",
                str(sd),
                "--device",
                a.device,
                "--batch-tokens",
                str(a.batch_tokens),
                "--store-dtype",
                a.store_dtype,
            ]
            rc, wall = _launch(
                argv + (["--tp"] if tp else []),
                procs,
                procs,
                a.device,
                self.logs / f"{_slug('capture', what, label)}.log",
            )
            row = self._base(what, label, procs)
            if rc != 0:
                self.add({**row, "error": f"rc {rc}"})
                continue
            row.update(_capture_rate(sd, tp), wall=wall)
            bpt = json.loads((out / "manifest.json").read_text())["bytes_per_token"]
            row["store GB/s"] = row["tok/s"] * bpt / 1e9
            if self.disk_gbs:  # every rank writes to the same disk: its write rate caps the whole capture
                row["disk-bound tok/s"] = self.disk_gbs * 1e9 / bpt
            if procs == 1:
                base_rate, ref, base_steady = row["tok/s"], out, row.get("steady tok/s")
            elif base_rate:
                row["speedup"] = row["tok/s"] / base_rate
                row["efficiency"] = row["speedup"] / procs
                if base_steady and row.get("steady tok/s"):
                    row["steady efficiency"] = row["steady tok/s"] / base_steady / procs
            if ref is not None and out != ref:
                if tp:
                    row["check"] = f"max rel err vs 1 GPU {_max_rel_err(ref, out):.2e}"
                else:
                    row["check"] = (
                        "store identical to 1 GPU"
                        if _shard_digests(out) == _shard_digests(ref)
                        else "store DIFFERS from 1 GPU"
                    )
                shutil.rmtree(out, ignore_errors=True)
            self.add(row)
        return ref

    def train(self, what: str, target: str, store: Path, extra: list[str], steps: int) -> None:
        a = self.a
        base_rate = None
        for label, procs, flags in [("1 GPU", 1, []), ("DDP", a.gpus, []), ("FSDP2", a.gpus, ["--fsdp"])]:
            if self.left() < a.min_section_s:
                print(f"[multigpu] train {what} {label}: skipped (time budget)", flush=True)
                continue
            run = self.work / _slug("run", what, label)
            shutil.rmtree(run, ignore_errors=True)
            argv = [
                "-m",
                "draftsmith",
                "train",
                "--target",
                target,
                "--store",
                str(store),
                "--out",
                str(run),
                "--steps",
                str(steps),
                "--ttt-steps",
                "7",
                "--compile",
                "off",
                "--attn-backend",
                "flex" if a.device == "cuda" else "chunked",
                "--log-every",
                "1",
                "--eval-fraction",
                "0.02",
                "--eval-every",
                str(10 * steps),
                "--save-every",
                "0",
                "--warmup",
                "0.1",
                "--device",
                "auto" if a.device == "cuda" else "cpu",
                "-q",
                *extra,
                *flags,
            ]
            rc, wall = _launch(argv, procs, procs, a.device, self.logs / f"{_slug('train', what, label)}.log")
            row = self._base(what, label, procs)
            if rc != 0:
                self.add({**row, "error": f"rc {rc}"})
                continue
            row.update(_train_rate(run, skip=max(2, steps // 5)), wall=wall)
            if procs == 1:
                base_rate = row["tok/s"]
            elif base_rate:
                row["speedup"] = row["tok/s"] / base_rate
                row["efficiency"] = row["speedup"] / procs
            self.add(row)
            shutil.rmtree(run, ignore_errors=True)

    def run(self) -> None:
        a = self.a
        secs = [s.strip() for s in a.sections.split(",") if s.strip()]
        bad = [s for s in secs if s not in SECTIONS]
        if bad:
            sys.exit(f"--sections: unknown {bad}; choose from {', '.join(SECTIONS)}")
        n = a.gpus
        if any(x.startswith("capture") for x in secs):
            self.disk_gbs = disk_write_gbs(self.work, a.disk_probe_gib)
            print(
                f"[multigpu] disk write ({a.disk_probe_gib:g} GiB, fsync) {self.disk_gbs:.2f} GB/s under {self.work}",
                flush=True,
            )
        small_store = None
        if "capture" in secs or "train" in secs:
            s = self.samples_file(a.small, a.tokens, "small")
            small_store = self.capture("pycode-small", a.small, s, [("1 GPU", 1, False), (f"DP x{n}", n, False)])
        if "train" in secs and small_store is not None:
            self.train(
                "pycode-small drafter",
                a.small,
                small_store,
                ["--batch-tokens", str(a.train_batch_tokens), "--draft-vocab-size", "8192"],
                a.train_steps,
            )
        if small_store is not None:
            shutil.rmtree(small_store, ignore_errors=True)
        if ("capture-8b" in secs or "train-8b" in secs) and self.left() > a.min_section_s:
            big = self.work / "llama8b"
            if not (big / "config.json").is_file():
                t = time.time()
                rc, _ = _launch(
                    [
                        self.here,
                        "_make-big",
                        "--out",
                        str(big),
                        "--tokenizer-from",
                        a.small,
                        "--device",
                        a.device,
                        "--big-config",
                        a.big_config,
                    ],
                    1,
                    1,
                    a.device,
                    self.logs / "make-big.log",
                )
                if rc != 0:
                    return
                print(f"[multigpu] wrote the random 8B-shaped model to {big} ({time.time() - t:.0f}s)", flush=True)
            s = self.samples_file(a.small, a.tokens_8b, "big")
            modes = [("1 GPU", 1, False)]
            if "capture-8b" in secs:
                modes += [(f"DP x{n}", n, False), (f"TP x{n}", n, True)]
            big_store = self.capture("llama-3.1-8B shape", str(big), s, modes)
            if "train-8b" in secs and big_store is not None:
                self.train(
                    "8B-sized drafter (H=4096)",
                    str(big),
                    big_store,
                    ["--batch-tokens", str(a.train_batch_tokens_8b), "--draft-vocab-size", "8192"],
                    a.train_steps_8b,
                )

    def report(self) -> None:
        cols = [
            "what",
            "mode",
            "GPUs",
            "tokens",
            "tok/s",
            "speedup",
            "efficiency",
            "steady tok/s",
            "steady efficiency",
            "store GB/s",
            "disk-bound tok/s",
            "capture s",
            "fixed s",
            "load s",
            "steps",
            "tokens/step",
            "final loss",
            "tau_sim",
            "wall",
            "check",
            "error",
        ]
        cols = [c for c in cols if any(c in r for r in self.rows)]
        a = self.a
        body = markdown_table(self.rows, cols) + (
            f"\n\nSame machine, same run: 1 GPU rows ran with CUDA_VISIBLE_DEVICES=0, N-GPU rows under torchrun "
            f"(NCCL, NVLink multicast off). efficiency = speedup / GPUs (goal >= 0.9). Capture: corpus {a.corpus}, "
            f"{a.store_dtype} store; disk write {self.disk_gbs or 0:.2f} GB/s ({a.disk_probe_gib:g} GiB, fsync) -> 'disk-bound tok/s', the "
            f"most any number of GPUs writing to that one disk can capture; batch {a.batch_tokens} tokens, tok/s = all ranks' tokens / slowest rank's capture time; "
            f"'fixed s' = pinned buffer allocation + the last writes after the GPU work (per run, not per token), 'steady' = without them "
            f"(model load excluded; 'wall' includes start-up and load). Training: K=7 TTT, eager flex attention "
            f"(--compile off), {a.train_batch_tokens} (small) / {a.train_batch_tokens_8b} (8B) tokens per row and "
            f"GPU, median per-step rate after the first steps, the global batch grows with the GPUs (weak scaling)."
        )
        record(
            "multigpu",
            f"Multi-GPU scaling (bench/multigpu.py, {a.gpus} GPUs)",
            body,
            {"rows": self.rows},
            "python bench/multigpu.py " + " ".join(sys.argv[1:]),
        )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("_capture", "_make-big"):
        w = argparse.ArgumentParser()
        w.add_argument("cmd")
        w.add_argument("--target")
        w.add_argument("--samples")
        w.add_argument("--out")
        w.add_argument("--stats-dir")
        w.add_argument("--tp", action="store_true")
        w.add_argument("--device", default="cuda")
        w.add_argument("--batch-tokens", type=int, default=32768)
        w.add_argument("--tokenizer-from")
        w.add_argument("--big-config", default="8b")
        w.add_argument("--store-dtype", default="bf16")
        a = w.parse_args()
        (_worker_capture if a.cmd == "_capture" else _worker_make_big)(a)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", required=True, help="pycode-small directory")
    ap.add_argument("--gpus", type=int, default=2, help="GPUs (processes) of the data/tensor-parallel rows")
    ap.add_argument("--corpus", default=sysconfig.get_paths()["stdlib"], help="directory of Python sources")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--tokens", type=int, default=2_000_000, help="tokens captured with pycode-small")
    ap.add_argument("--tokens-8b", type=int, default=300_000, help="tokens captured with the 8B shape")
    ap.add_argument("--batch-tokens", type=int, default=32768, help="capture: padded tokens per forward")
    ap.add_argument("--train-steps", type=int, default=120)
    ap.add_argument("--train-steps-8b", type=int, default=25)
    ap.add_argument("--train-batch-tokens", type=int, default=8192)
    ap.add_argument("--train-batch-tokens-8b", type=int, default=4096)
    ap.add_argument("--big-config", choices=["8b", "tiny"], default="8b", help="tiny: smoke test")
    ap.add_argument(
        "--store-dtype",
        choices=["bf16", "fp8"],
        default="bf16",
        help="store dtype of every capture (fp8: half the bytes to write)",
    )
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: gloo smoke test")
    ap.add_argument("--time-budget", type=float, default=540, help="seconds; later sections are skipped")
    ap.add_argument("--min-section-s", type=float, default=40, help="start a measurement only with this much left")
    ap.add_argument("--disk-probe-gib", type=float, default=4.0, help="size of the disk write-rate probe")
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args()
    b = Bench(a)
    try:
        b.run()
    finally:
        if b.rows:
            b.report()


if __name__ == "__main__":
    main()
