"""Capture benchmark (GPU): capture tokens/s vs a bare forward of the same batches, prefill MFU,
store write GB/s, and bytes/token vs SpecForge's 8H+16.

    python bench/capture.py --small PATH/pycode-small [--corpus DIR] [--tokens N] [--tokens-8b N]

Floors: capture is a prefill, FLOP-bound: 2 * params * tokens (+ attention) at ~790 TFLOP/s bf16 (H200,
measured), plus the store's bytes at the disk's write bandwidth. The ratio capture/bare shows
what hooks + device->host copies + writing cost on top of the forward the target must do anyway.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import markdown_table, record  # noqa: E402

PEAK_BF16 = 790e12  # measured 8192^3 bf16 matmul on the device


def useful_flops(n_params: int, lengths: np.ndarray, hidden: int, layers: int) -> float:
    # weights: 2 flops per param per token; causal attention: QK^T and AV, 2 * L^2 * H per layer per sample
    return 2.0 * n_params * lengths.sum() + 2.0 * layers * hidden * float((lengths.astype(np.float64) ** 2).sum())


def bare_forward(target, samples, batch_tokens: int, shard_tokens: int, pad_id: int) -> float:
    """The same right-padded batches the capture runs, without hooks, copies or writes."""
    from draftsmith.capture.job import plan_batches, plan_shards

    lengths = np.array([len(s.input_ids) for s in samples])
    batches = []
    for first, n, _ in plan_shards(lengths, shard_tokens):
        sl = lengths[first : first + n].tolist()
        for b in plan_batches(sl, batch_tokens):
            L = max(sl[j] for j in b)
            ids = torch.full((len(b), L), pad_id, dtype=torch.long)
            for r, j in enumerate(b):
                ids[r, : sl[j]] = torch.from_numpy(samples[first + j].input_ids.astype(np.int64))
            batches.append(ids)
    dec = target.decoder
    dev = target.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    with torch.no_grad():
        dec(input_ids=batches[0].to(dev), use_cache=False)  # warm-up
        sync()
        t = time.perf_counter()
        for ids in batches:
            dec(input_ids=ids.to(dev, non_blocking=True), use_cache=False)
        sync()
    return time.perf_counter() - t


def take_tokens(samples, n_tokens: int):
    out, total = [], 0
    for s in samples:
        if total >= n_tokens:
            break
        out.append(s)
        total += len(s.input_ids)
    return out


def run_model(name, target, samples, variants, batch_tokens, workdir: Path) -> list[dict]:
    from draftsmith.capture.job import CaptureConfig, run_capture
    from draftsmith.store import format as fmt

    H, N = target.hidden_size, target.num_layers
    n_params = sum(p.numel() for p in target.decoder.parameters()) - target.embed_tokens.weight.numel()
    lengths = np.array([len(s.input_ids) for s in samples])
    tokens = int(lengths.sum())
    flops = useful_flops(n_params, lengths, H, N)
    pad_id = target.tokenizer.pad_token_id or 0
    bpt_guess = fmt.bytes_per_token(H, 3, "bf16")
    shard_tokens = max(1024, int(1024 * 2**20 // bpt_guess))
    t_bare = bare_forward(target, samples, batch_tokens, shard_tokens, pad_id)
    rows = [
        {
            "model": name,
            "mode": "bare forward (no hooks)",
            "tokens": tokens,
            "tok/s": tokens / t_bare,
            "vs bare": 1.0,
            "MFU": flops / t_bare / PEAK_BF16,
        }
    ]
    specforge = 8 * H + 16
    for dtype, graphs in variants:
        out = workdir / f"{name}-{dtype}-{int(graphs)}"
        stats: dict = {}
        cfg = CaptureConfig(
            target=name,
            data="<preloaded>",
            out=str(out),
            dtype=dtype,
            batch_tokens=batch_tokens,
            device=str(target.device),
            max_length=2048,
            cuda_graphs=graphs,
            progress=False,
            shard_tokens=max(1024, int(1024 * 2**20 // fmt.bytes_per_token(H, 3, dtype))),
        )
        if dtype == "bf16":  # same shard plan as the bare forward => the same batches
            cfg.shard_tokens = shard_tokens
        m = run_capture(cfg, log=lambda *a: None, target=target, stats=stats, samples=samples)
        t = stats["capture_s"]
        rows.append(
            {
                "model": name,
                "mode": f"capture {dtype}{' +graphs' if graphs else ''}",
                "tokens": tokens,
                "tok/s": tokens / t,
                "vs bare": t_bare / t,
                "MFU": flops / t / PEAK_BF16,
                "write GB/s": stats["bytes_written"] / max(stats["write_s"], 1e-9) / 1e9,
                "bytes/token": m["bytes_per_token"],
                "vs 8H+16": m["bytes_per_token"] / specforge,
            }
        )
        shutil.rmtree(out, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", required=True, help="pycode-small directory")
    ap.add_argument("--corpus", default=sysconfig.get_paths()["stdlib"], help="directory of Python sources")
    ap.add_argument("--tokens", type=int, default=2_000_000, help="tokens captured with pycode-small")
    ap.add_argument("--tokens-8b", type=int, default=600_000, help="tokens captured with the 8B shape")
    ap.add_argument("--batch-tokens", type=int, default=32768)
    ap.add_argument("--skip-8b", action="store_true")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke test)")
    args = ap.parse_args()

    from draftsmith.data import load_samples
    from draftsmith.target_model import load_target, target_from_model

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dsbench-"))
    small = load_target(args.small, dtype="bf16" if args.device == "cuda" else "fp32", device=args.device)
    t = time.time()
    samples, rep = load_samples(args.corpus, small.tokenizer, max_length=2048, on_bad="skip")
    print(f"corpus {args.corpus}: {rep.summary()} in {time.time() - t:.1f}s", flush=True)
    rows = run_model(
        "pycode-small",
        small,
        take_tokens(samples, args.tokens),
        [("bf16", False), ("fp8", False)] + ([("bf16", True)] if args.device == "cuda" else []),
        args.batch_tokens,
        workdir,
    )
    print(markdown_table(rows, list(rows[0].keys())), flush=True)
    if not args.skip_8b:
        from models import llama31_8b_config, random_model

        del small.model
        torch.cuda.empty_cache()
        big = target_from_model(random_model(llama31_8b_config()), tokenizer=small.tokenizer, path="llama-3.1-8b-shape")
        rows += run_model(
            "llama-3.1-8B shape",
            big,
            take_tokens(samples, args.tokens_8b),
            [("bf16", False), ("fp8", False)],
            args.batch_tokens,
            workdir,
        )
    cols = ["model", "mode", "tokens", "tok/s", "vs bare", "MFU", "write GB/s", "bytes/token", "vs 8H+16"]
    body = markdown_table(rows, cols) + (
        "\n\nMFU = useful FLOPs (2·params·tokens + causal attention) ÷ time ÷ 790 TFLOP/s. 'vs bare' = capture "
        "tok/s ÷ tok/s of the same batches through the target with no hooks, copies or writes (goal ≥ 0.9). "
        "'vs 8H+16' = store bytes/token (files on disk, all headers and indexes included) ÷ SpecForge's per-token "
        "bytes (goal ≤ 1.0 bf16, ≤ 0.5 fp8). write GB/s = shard bytes ÷ time in the writer thread (serialize, "
        "sha256, write, fsync, rename), which overlaps the GPU work."
    )
    record(
        "capture",
        "Capture throughput (bench/capture.py)",
        body,
        {"rows": rows},
        "python bench/capture.py " + " ".join(sys.argv[1:]),
    )


if __name__ == "__main__":
    main()
