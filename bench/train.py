"""Training benchmark (GPU): TTT training tokens/s and peak memory at packed sequence lengths 2k/8k/16k, K=7.

    python bench/train.py --target PATH/pycode-small [--store STORE] [--seq 2048,8192,16384] [--ttt-steps 7]
                          [--backends compiled,flex] [--steps 10] [--draft-vocab-size 8192]

What one timed step is: the real training step of `draftsmith train` — teacher (target final norm +
lm_head over the stored pre-norm states, softmax over the draft columns), the K-step TTT unroll with the
docs/eagle3.md#training-time-test-ttt attention over a packed row (documents of <= 2048 tokens, position ids restarting per document),
soft-CE loss, backward, grad clip, AdamW step — under bf16 autocast. Data: rows from `--store` when given
(memory-mapped, as in training), otherwise synthetic rows with the target's shapes (random documents of
256..2048 tokens, random hidden states; the cost of a step does not depend on the values).

Per configuration (seq_len x backend) the table also gives `kernels_per_step` (GPU kernels of one profiled
step, torch.profiler) and `new_dynamo_graphs` (compiles it caused: flex should add a few per seq_len, never
one per TTT step). Each configuration is isolated (try/except, gc + empty_cache after it; a flex failure is
reported in `note`, not inherited by the next configuration), and configurations that would start after
`--time-budget` seconds (default 540) are reported as skipped. The compiled rows cost their compile in
`warmup_s` (155 s at 8k for the whole-unroll graph on an H200), so the default run (3 lengths x compiled, flex)
fills about 9 minutes; pick `--seq`/`--backends` for shorter calls.

Floors: the drafter is one decoder layer, so a step is ~K x (fc + layer + lm_head over V_d) forward and
twice that backward: FLOPs ~= 6 * K * T * (params of layer + H * V_d) + attention; the table prints the
model-FLOP utilisation against ~790 TFLOP/s bf16 (an H200, measured).

The side-by-side with speculators 0.9.0 (same store, split, draft vocab, K, token budget, evaluator) is
bench/train_compare.py.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import markdown_table, record  # noqa: E402

PEAK_BF16 = 790e12


def synthetic_row(T: int, H: int, k: int, V: int, rng: np.random.Generator, device):
    from draftsmith.train.batches import MicroBatch
    from draftsmith.train.ttt import document_ids_from_lengths, positions_from_doc_ids

    lens, used = [], 0
    while used < T:
        L = int(min(T - used, rng.integers(256, 2049)))
        lens.append(L)
        used += L
    doc = document_ids_from_lengths(lens, T)
    ids = torch.from_numpy(rng.integers(2, V, size=T)).long()
    mask = torch.ones(T, dtype=torch.bool)
    aux = torch.randn(T, k * H, dtype=torch.bfloat16)
    final = torch.randn(T, H, dtype=torch.bfloat16) * 3
    return MicroBatch(
        ids[None], mask[None], doc[None], positions_from_doc_ids(doc)[None], aux[None], final[None], lens, T
    ).to(device)


def store_rows(store, T: int, n: int, seed: int, device):
    from draftsmith.train.batches import build_micro_batch, epoch_rows, source_lengths

    lengths = source_lengths(store)
    rows = epoch_rows(list(range(len(store))), lengths, T, seed, 0)[:n]
    pad = -(-T // 128) * 128
    return [build_micro_batch(store, r, T, with_states=True, pad_to=pad).to(device) for r in rows]


def _kernels_per_step(step, mb, label: str = "") -> int | None:
    """GPU kernels launched by one training step (torch.profiler, CUDA activity); None if unavailable.
    With $OUT set (device runs), the step's op table (by GPU time) is appended to $OUT/train_profile.txt."""
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(mb)
            torch.cuda.synchronize()
        import os

        if os.environ.get("OUT") and label:
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
            with open(Path(os.environ["OUT"], "train_profile.txt"), "a") as f:
                f.write(f"=== {label}\n{table}\n")
        return sum(
            1
            for e in prof.events()
            if e.device_type == DeviceType.CUDA and "emcpy" not in e.name and "emset" not in e.name
        )
    except Exception:
        return None


def _dynamo_graphs() -> int:
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:
        return -1


def bench_one(
    target,
    T: int,
    K: int,
    backend: str,
    vd: int,
    steps: int,
    warmup: int,
    rows,
    aux_layers,
    device="cuda",
    profile_kernels: bool = True,
) -> dict:
    import warnings

    from draftsmith.drafter import Drafter
    from draftsmith.train import ttt as _ttt
    from draftsmith.train.trainer import TrainConfig, TTTModel
    from draftsmith.train.ttt import compute_teacher

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    _ttt._FLEX_BROKEN = False  # every configuration gets its own try of flex (a failure is reported, not inherited)
    graphs0 = _dynamo_graphs()
    counts = torch.arange(target.vocab_size, 0, -1)
    drafter = Drafter.from_target(
        target, token_counts=counts, dtype=torch.float32, aux_layer_ids=aux_layers, draft_vocab_size=vd
    ).to(dev)
    # "compiled" = flex + the whole unroll as one torch.compile graph (the trainer's CUDA default);
    # "compiled-step" = flex + one graph reused by every TTT step (`--compile step`)
    compiled = backend.startswith("compiled")
    cfg = TrainConfig(
        ttt_steps=K, attn_backend="flex" if compiled else backend, batch_tokens=T, compile="off"
    )  # library defaults: auto chunk, loss chunk
    model = TTTModel(drafter, cfg)
    if compiled:  # "compiled-graphs": the unroll's graphs replayed as CUDA graphs (mode="reduce-overhead")
        model.enable_compile(
            granularity="step" if backend == "compiled-step" else "unroll",
            mode="reduce-overhead" if backend == "compiled-graphs" else None,
        )
    graphs = backend == "compiled-graphs"
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))
    lm_w = target.lm_head.weight
    d2t_ids = drafter.draft_target_ids.to(dev)
    t2d = drafter.t2d.to(dev)
    base_mem = torch.cuda.memory_allocated() if cuda else 0
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()

    def step(mb):
        if graphs:  # a new training step: earlier CUDA-graph outputs may be overwritten from here on
            torch.compiler.cudagraph_mark_step_begin()
        teacher = compute_teacher(mb.final_hidden, target.final_norm, lm_w, d2t_ids, t2d)
        with amp:
            loss, _ = model(
                mb.input_ids,
                mb.aux_hidden,
                mb.doc_ids,
                mb.position_ids,
                mb.loss_mask,
                teacher.probs,
                teacher.argmax,
                teacher.in_vocab,
            )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    flex_note = ""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t_compile = time.perf_counter()
        for i in range(warmup):
            step(rows[i % len(rows)])
        sync()
        t_compile = time.perf_counter() - t_compile
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        tokens = 0
        t0 = time.perf_counter()
        for i in range(steps):
            mb = rows[i % len(rows)]
            step(mb)
            tokens += mb.num_tokens
        sync()
        secs = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        kernels = _kernels_per_step(step, rows[0], f"{backend}_{T}") if (cuda and profile_kernels) else None
    for w in caught:
        msg = str(w.message)
        if "flex attention unavailable" in msg or "recompile" in msg.lower():
            flex_note = msg.splitlines()[0][:160]
            break
    H = drafter.config.hidden_size
    layer_params = sum(p.numel() for n, p in drafter.named_parameters() if n.startswith("layers."))
    flops = 6.0 * K * tokens * (layer_params + H * vd) + 2.0 * tokens * drafter.fc.weight.numel()
    used = "chunked (flex failed)" if backend == "flex" and _ttt._FLEX_BROKEN else backend
    r = {
        "seq_len": T,
        "ttt_steps": K,
        "backend": used,
        "draft_vocab": vd,
        "tokens_per_s": tokens / secs,
        "step_ms": 1e3 * secs / steps,
        "peak_mem_gib": peak / 2**30,
        "peak_over_weights_gib": (peak - base_mem) / 2**30,
        "mfu_pct": 100.0 * flops / secs / PEAK_BF16,
        "warmup_s": t_compile,
        "kernels_per_step": kernels,
        "new_dynamo_graphs": _dynamo_graphs() - graphs0,
    }
    if flex_note:
        r["note"] = flex_note
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--store", default=None)
    ap.add_argument("--seq", default="2048,8192,16384")
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument(
        "--backends",
        default="compiled,flex",
        help="compiled (flex + one torch.compile graph per unroll, the trainer's CUDA default), compiled-step "
        "(one graph reused by every TTT step), compiled-graphs (compiled, replayed as CUDA graphs), "
        "flex, chunked",
    )
    ap.add_argument("--draft-vocab-size", type=int, default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--time-budget",
        type=float,
        default=540.0,
        help="seconds: configurations that would start after this are reported as skipped",
    )
    ap.add_argument("--no-profile", action="store_true", help="skip the one profiled step (kernel count) per config")
    args = ap.parse_args()
    t_start = time.perf_counter()
    if not torch.cuda.is_available():
        sys.exit("bench/train.py needs a CUDA device")
    from draftsmith.target_model import load_target

    target = load_target(args.target, dtype="bf16", device="cuda")
    vd = args.draft_vocab_size or min(32000, target.vocab_size)
    aux_layers = list(target.default_aux_layers)
    store = None
    if args.store:
        from draftsmith.store import HiddenStateStore

        store = HiddenStateStore.open(args.store, dtype=torch.bfloat16)
        store.check_target(target)
        aux_layers = store.aux_layers
    rng = np.random.default_rng(args.seed)
    results = []
    import gc

    for T in [int(x) for x in args.seq.split(",")]:
        n_rows = max(args.steps, args.warmup)
        rows = None
        for backend in args.backends.split(","):
            base = {"seq_len": T, "ttt_steps": args.ttt_steps, "backend": backend, "draft_vocab": vd}
            if time.perf_counter() - t_start > args.time_budget:
                r = {**base, "error": f"skipped (time budget {args.time_budget:.0f} s spent)"}
            else:
                try:
                    if rows is None:
                        if store is not None:
                            rows = store_rows(store, T, n_rows, args.seed, torch.device("cuda"))
                        else:
                            rows = [
                                synthetic_row(T, target.hidden_size, len(aux_layers), target.vocab_size, rng, "cuda")
                                for _ in range(min(n_rows, 4))
                            ]
                    r = bench_one(
                        target,
                        T,
                        args.ttt_steps,
                        backend,
                        vd,
                        args.steps,
                        args.warmup,
                        rows,
                        aux_layers,
                        profile_kernels=not args.no_profile,
                    )
                except torch.cuda.OutOfMemoryError as e:
                    r = {**base, "error": f"OOM: {str(e).splitlines()[0][:80]}"}
                except Exception as e:  # keep measuring the other settings; report the failure
                    r = {**base, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
            r["elapsed_s"] = time.perf_counter() - t_start
            print(r, flush=True)
            results.append(r)
            gc.collect()
            try:  # a broken CUDA context must not hide the results measured so far
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception as e:
                print(f"cleanup after {base}: {type(e).__name__}: {e}", flush=True)
        rows = None
    cols = [
        "seq_len",
        "backend",
        "ttt_steps",
        "draft_vocab",
        "tokens_per_s",
        "step_ms",
        "peak_mem_gib",
        "peak_over_weights_gib",
        "mfu_pct",
        "kernels_per_step",
        "new_dynamo_graphs",
        "warmup_s",
        "error",
        "note",
    ]
    body = (
        f"Target {args.target} (bf16), data: {'store ' + args.store if store else 'synthetic packed rows'}, "
        f"aux layers {aux_layers} (layer-output ids), AdamW, bf16 autocast, {args.steps} timed steps after "
        f"{args.warmup} warm-up steps. One step = teacher + K-step TTT unroll + backward + AdamW on one packed "
        f"row of seq_len tokens.\n\n" + markdown_table(results, cols)
    )
    cmd = "python bench/train.py " + " ".join(sys.argv[1:])
    record("train", "Training throughput (TTT, packed rows)", body, {"results": results, "args": vars(args)}, cmd)


if __name__ == "__main__":
    main()
