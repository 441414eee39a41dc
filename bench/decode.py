"""Decode benchmarks (issue 6): one script, one device call, < ~8 minutes on an H200.

  P1  plain decode, bs=1, bf16, Llama-3.1-8B-shaped random weights, contexts 128 and 2048:
      achieved (weight + KV) bytes/s ÷ measured device copy bandwidth (goal >= 0.85).
  P2a pycode-small + a trained drafter, HumanEval code prompts, 256 new tokens: τ, acceptance rate,
      speedup vs the engine's own graph-captured plain decode and vs transformers generate()
      (dynamic cache; static cache, compiled). Best chain and tree settings.
  P2b projected speedup on the 8B shape: measured t_plain, t_round (draft + verify + hand-off, one CUDA
      graph) for an 8B-sized drafter (H=4096); speedup = τ(P2a) · t_plain / t_round. Labelled projected.

Usage (device):  python bench/decode.py --target .carry/pycode-small --drafter .carry/drafter \
                     --prompts .carry/humaneval.jsonl
CPU smoke test of every code path (tiny shapes, no graphs):  python bench/decode.py --smoke
Writes $OUT/bench_decode.json when $OUT is set and appends a section to BENCHMARKS.md.
Each section runs in try/except: a failure is recorded and the rest still runs.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (shared helpers; puts the repository on sys.path)

from draftsmith.decode.engine import DecodeMode, SpeculativeDecoder  # noqa: E402
from draftsmith.decode.kernel_config import KernelConfig  # noqa: E402
from draftsmith.decode.llama import LlamaFamilyForward  # noqa: E402
from draftsmith.decode.sampling import SamplingParams  # noqa: E402

T0 = time.perf_counter()
RESULTS: dict = {"sections": {}, "errors": {}}
LINES: list[str] = []


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def left(budget: float) -> float:
    return budget - (time.perf_counter() - T0)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


class Timer:
    """CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, dev):
        self.dev = dev

    def __enter__(self):
        if self.dev.type == "cuda":
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.t = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.dev.type == "cuda":
            self.b.record()
            torch.cuda.synchronize()
            self.s = self.a.elapsed_time(self.b) / 1e3
        else:
            self.s = time.perf_counter() - self.t


def llama8b_config(smoke: bool):
    from transformers import LlamaConfig

    if smoke:
        return LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
            max_position_embeddings=4096,
        )
    return LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )


def copy_bandwidth(dev, smoke: bool) -> float:
    """Device copy bandwidth in bytes/s, counting read + write (bench/common.py); a small CPU copy for --smoke."""
    if dev.type == "cuda":
        return common.measure_copy_bandwidth(2.0)
    a = torch.empty(1 << 20, dtype=torch.bfloat16).normal_()
    b = torch.empty_like(a)
    with Timer(dev) as t:
        for _ in range(20):
            b.copy_(a)
    return 2 * a.numel() * 2 * 20 / t.s


def time_steps(engine, fn, n, dev):
    fn()
    sync(dev)
    with Timer(dev) as t:
        for _ in range(n):
            fn()
    return t.s / n


def _profiled(fn, dev):
    """The profiler's events of one call of `fn`, after one unprofiled call (CUDA activity on CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    fn()
    sync(dev)
    with profile(activities=acts) as prof:
        fn()
        sync(dev)
    return prof.events()


def kernel_census(fn, dev, top: int = 0):
    """One call of `fn` under the profiler (after one unprofiled call) -> (kernels, summed kernel ms, the `top`
    kernel names by summed time as (name, count, ms)). On CUDA these are what the call's CUDA-graph replay
    launches, and ms/step minus their sum is launch gaps; on CPU (smoke) aten ops and their CPU time."""
    import collections

    events = _profiled(fn, dev)
    if dev.type == "cuda":
        evs = [
            (e.name, (getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)) / 1e3)
            for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA
        ]
    else:
        evs = [(e.name, e.cpu_time / 1e3) for e in events if e.name.startswith("aten::")]
    by = collections.defaultdict(lambda: [0, 0.0])
    for name, ms in evs:
        by[name][0] += 1
        by[name][1] += ms
    ranked = sorted(((n, c, ms) for n, (c, ms) in by.items()), key=lambda r: -r[2])[:top]
    return len(evs), sum(ms for _, ms in evs), ranked


def kernel_profile(fn, dev):
    """(kernels, summed kernel time in s or None on CPU) of one eager call of `fn`."""
    n, ms, _ = kernel_census(fn, dev)
    return n, (ms / 1e3 if dev.type == "cuda" else None)


def graphed(fn, dev):
    """`fn` captured in one CUDA graph (its replay), or `fn` itself on CPU; warmed up on a side stream first."""
    if dev.type != "cuda":
        return fn
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(st)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def kernel_kind(name: str) -> str:
    """A kernel's kind by its name: cuBLAS/CUTLASS matmuls, inductor's fused Triton kernels, draftsmith's Triton
    kernels, attention, the rest (sort/topk/index/copy/elementwise aten kernels)."""
    n = name.lower()
    if n.startswith("aten::"):  # CPU (smoke): operators, not kernels
        return "aten op (cpu)"
    if any(t in n for t in ("gemm", "nvjet", "cutlass", "cublas", "sm90_xmma", "gemv")) and "triton" not in n:
        return "matmul"
    if n.startswith("triton_"):
        return "inductor"
    if any(t in n for t in ("_gemv_kernel", "_attn", "_rope", "_norm", "_rows_kernel", "_combine")):
        return "draftsmith triton"
    if "flash" in n or "fmha" in n or "attention" in n:
        return "attention"
    if "sort" in n or "topk" in n or "radix" in n:
        return "sort/topk"
    return "other aten"


def anatomy(fn, dev, top: int = 30) -> dict:
    """One call of `fn` (a CUDA graph's replay: what a round launches, with no host in between) under the profiler,
    its kernels in launch order -> kernels, busy ms (summed durations), span ms (first start to last end), gap ms
    (span - busy: the time between kernels), and per kernel name in order of first launch (count, summed us, mean
    us), the `top` names by summed time. Where a part's time goes, kernel by kernel: `--anatomy`."""
    ks = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in _profiled(fn, dev)
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    if not ks:
        return {"kernels": 0, "busy_ms": 0.0, "span_ms": 0.0, "gap_ms": 0.0, "names": [], "by_kind": {}}
    busy = sum(b - a for a, b, _ in ks)
    span = max(b for _, b, _ in ks) - ks[0][0]
    names: dict = {}
    by_kind: dict = {}
    for a, b, name in ks:
        r = names.setdefault(name, [0, 0.0])
        r[0] += 1
        r[1] += b - a
        k = by_kind.setdefault(kernel_kind(name), [0, 0.0])
        k[0] += 1
        k[1] += (b - a) / 1e3
    keep = set(sorted(names, key=lambda n: -names[n][1])[:top])
    rows = [(n, c, us, us / c) for n, (c, us) in names.items() if n in keep]
    return {
        "kernels": len(ks),
        "busy_ms": busy / 1e3,
        "span_ms": span / 1e3,
        "gap_ms": (span - busy) / 1e3,
        "names": rows,
        "by_kind": by_kind,
    }


def anatomy_lines(title: str, a: dict) -> list[str]:
    out = [
        f"\n{title}: {a['kernels']} kernels, busy {a['busy_ms']:.3f} ms, span {a['span_ms']:.3f} ms, between "
        f"kernels {a['gap_ms']:.3f} ms; by kind: "
        + ", ".join(f"{k} {ms:.3f} ms ({n})" for k, (n, ms) in sorted(a["by_kind"].items(), key=lambda x: -x[1][1]))
        + "\n",
        "| kernel (first-launch order) | n | us | us each |",
        "|---|---|---|---|",
    ]
    out += [f"| {n[:70]} | {c} | {us:.1f} | {m:.2f} |" for n, c, us, m in a["names"]]
    return out


def round_census(fn, dev) -> dict:
    """One eager call of a round under the profiler: kernel count, summed ms, by kind, top kernels."""
    n, ms, top = kernel_census(fn, dev, top=10_000)
    by: dict = {}
    for name, cnt, kms in top:
        b = by.setdefault(kernel_kind(name), [0, 0.0])
        b[0] += cnt
        b[1] += kms
    return {"kernels": n, "kernel_ms": ms, "by_kind": by, "top": top[:12]}


def _triton_ok(dev) -> bool:
    from draftsmith.decode import kernels as K

    return dev.type == "cuda" and K.available()


@torch.no_grad()
def p1(args, dev, dtype, bw):
    cfg = llama8b_config(args.smoke)
    aux = [1, cfg.num_hidden_layers // 2 - 1, cfg.num_hidden_layers - 4]
    ctxs = [16, 64] if args.smoke else [128, 2048]
    steps = 8 if args.smoke else 64
    log("P1: building the 8B-shaped random model")
    runner = LlamaFamilyForward.random(cfg, aux, max_len=max(ctxs) + steps + 16, device=dev, dtype=dtype)
    wbytes = runner.weight_bytes()
    kvtok = runner.kv_bytes_per_token()
    rows = []
    sp = SamplingParams()
    kernels = [k for k in args.kernels if k == "torch" or _triton_ok(dev)]
    combos = [(c, i, "torch") for c in ctxs for i in args.attn_impls if "torch" in kernels]
    combos += [(c, "triton", "triton") for c in ctxs if "triton" in kernels]
    for ctx, impl, kn in combos:
        # kernels="triton": the one-token step through draftsmith.decode.kernels (tiles and attention split tuned
        # on this GPU at construction); prefill keeps the torch path and its auto attention
        eng = SpeculativeDecoder(
            runner, None, max_len=ctx + steps + 16, attn_impl="auto" if kn == "triton" else impl, kernels=kn
        )
        prompt = torch.randint(0, cfg.vocab_size, (ctx,)).tolist()
        plain = eng.step_fn(DecodeMode("plain"), sp)
        eng.prefill(prompt, sp)
        t_step = time_steps(eng, plain, steps, dev)
        L_avg = ctx + 1 + steps / 2 + 0.5
        bytes_step = wbytes + kvtok * L_avg
        ach = bytes_step / t_step
        n_k, busy = kernel_profile(eng.eager_step_fn(DecodeMode("plain"), sp), dev)
        # end-to-end through generate() (host loop, one sync per 8 steps)
        res = eng.generate(prompt, steps, sampling=sp, mode=DecodeMode("plain"), eos_ids=[])
        row = {
            "context": ctx,
            "attention": impl,
            "kernels": kn,
            "step_ms": t_step * 1e3,
            "tokens_per_s_graph": 1 / t_step,
            "tokens_per_s_generate": (len(res.token_ids) - 1) / max(res.decode_s, 1e-9),
            "weight_bytes": wbytes,
            "kv_bytes": kvtok * L_avg,
            "achieved_bytes_per_s": ach,
            "fraction_of_copy_bw": ach / bw,
            "kernels_per_step": n_k,
            "kernel_ms_per_step": None if busy is None else busy * 1e3,
        }
        rows.append(row)
        log(
            f"P1 ctx={ctx} {impl} {kn}: {t_step * 1e3:.3f} ms/step, {ach / 1e12:.2f} TB/s = {ach / bw:.3f} of copy bw, "
            f"generate() {row['tokens_per_s_generate']:.1f} tok/s"
        )
    # (no engine: --kernels triton on a machine without them)
    RESULTS["sections"]["P1"] = {"rows": rows, "cuda_graphs": eng.cuda_graphs if combos else None}
    LINES.append("### P1 — plain decode, bs=1, bf16, Llama-3.1-8B shape (random weights)")
    LINES.append(f"copy bandwidth (read+write) {bw / 1e12:.2f} TB/s; weights {wbytes / 1e9:.2f} GB\n")
    LINES.append(
        "| context | attention | step kernels | ms/step (graph) | tok/s (graph) | tok/s (generate loop) | "
        "(W+KV) TB/s | ÷ copy bw | kernels/step | kernel ms/step |"
    )
    LINES.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        km = "-" if r["kernel_ms_per_step"] is None else f"{r['kernel_ms_per_step']:.3f}"
        LINES.append(
            f"| {r['context']} | {r['attention']} | {r['kernels']} | {r['step_ms']:.3f} | {r['tokens_per_s_graph']:.1f} | "
            f"{r['tokens_per_s_generate']:.1f} | {r['achieved_bytes_per_s'] / 1e12:.2f} | "
            f"{r['fraction_of_copy_bw']:.3f} | {r['kernels_per_step']} | {km} |"
        )
    LINES.append(
        "\nkernels/step and kernel ms/step: one eager step under the profiler (what a graph replay launches; "
        "kernel ms = the sum of kernel durations, so ms/step minus it is launch gaps). step kernels: torch "
        "(cuBLAS + aten, attention as named) or triton (draftsmith.decode.kernels, 7 per layer)."
    )
    return runner, eng


@torch.no_grad()
def p1_compiled(args, dev, dtype, bw, runner):
    """P1 again with the step forward torch.compile'd (elementwise kernels fused) inside the CUDA graph."""
    cfg = llama8b_config(args.smoke)
    steps = 8 if args.smoke else 64
    ctxs = [16, 64] if args.smoke else [128, 2048]
    eng = SpeculativeDecoder(runner, None, max_len=max(ctxs) + steps + 16, compile=True)
    sp = SamplingParams()
    rows = []
    for ctx in ctxs:
        prompt = torch.randint(0, cfg.vocab_size, (ctx,)).tolist()
        t0 = time.perf_counter()
        plain = eng.step_fn(DecodeMode("plain"), sp)
        compile_s = time.perf_counter() - t0
        eng.prefill(prompt, sp)
        t_step = time_steps(eng, plain, steps, dev)
        n_k, busy = kernel_profile(eng.eager_step_fn(DecodeMode("plain"), sp), dev)
        L_avg = ctx + 1 + steps / 2 + 0.5
        ach = (runner.weight_bytes() + runner.kv_bytes_per_token() * L_avg) / t_step
        rows.append(
            {
                "context": ctx,
                "step_ms": t_step * 1e3,
                "tokens_per_s_graph": 1 / t_step,
                "achieved_bytes_per_s": ach,
                "fraction_of_copy_bw": ach / bw,
                "compile_and_capture_s": compile_s,
                "kernels_per_step": n_k,
                "kernel_ms_per_step": None if busy is None else busy * 1e3,
            }
        )
        log(f"P1c ctx={ctx}: {t_step * 1e3:.3f} ms/step, {ach / bw:.3f} of copy bw (compile {compile_s:.0f}s)")
    RESULTS["sections"]["P1_compiled"] = {"rows": rows}
    LINES.append("\n### P1 (compiled) — same, step forward torch.compile'd inside the CUDA graph")
    LINES.append("| context | ms/step | tok/s | (W+KV) TB/s | ÷ copy bw | kernels/step | kernel ms/step |")
    LINES.append("|---|---|---|---|---|---|---|")
    for r in rows:
        km = "-" if r["kernel_ms_per_step"] is None else f"{r['kernel_ms_per_step']:.3f}"
        LINES.append(
            f"| {r['context']} | {r['step_ms']:.3f} | {r['tokens_per_s_graph']:.1f} | "
            f"{r['achieved_bytes_per_s'] / 1e12:.2f} | {r['fraction_of_copy_bw']:.3f} | "
            f"{r['kernels_per_step']} | {km} |"
        )


def humaneval_prompts(path, tok, limit):
    out = []
    for line in open(path):
        text = json.loads(line)["turns"][0]
        if text.startswith("Complete the code I provided."):
            text = text.split("\n", 1)[1]
        out.append(tok(text)["input_ids"])
        if len(out) >= limit:
            break
    return out


@torch.no_grad()
def p2a(args, dev, dtype):
    from draftsmith.decode.evaluate import run_eval
    from draftsmith.drafter import Drafter
    from draftsmith.target_model import load_target

    t = load_target(args.target, dtype="bf16" if dev.type == "cuda" else "fp32", device=str(dev))
    if args.drafter == "random":  # infrastructure check only: an untrained drafter accepts ~nothing (τ≈1)
        torch.manual_seed(0)
        d = Drafter.from_target(t, draft_vocab_size=8192)
    elif args.drafter:
        d = Drafter.from_pretrained(args.drafter, target=t)
    else:
        if not args.smoke:
            raise RuntimeError("P2a needs --drafter (a drafter trained for the target)")
        torch.manual_seed(0)
        d = Drafter.from_target(t, draft_vocab_size=2048)
    d = d.to(device=dev, dtype=t.dtype).eval()
    d.requires_grad_(False)
    prompts = humaneval_prompts(args.prompts, t.tokenizer, args.num_prompts)
    new = args.new_tokens
    settings = [DecodeMode("chain", draft_tokens=k) for k in args.chain_k] + [
        DecodeMode("tree", top_k=a, depth=b, tree_tokens=c) for a, b, c in args.tree_cfgs
    ]
    rows = []
    plain_tps = {}
    max_len = max(len(p) for p in prompts) + new + 80
    for impl, mode in [(i, m) for i in args.attn_impls for m in settings]:
        if left(args.budget) < 120:
            log(f"P2a: skipping {impl} {mode} (time budget)")
            continue
        if mode is settings[0]:
            eng = SpeculativeDecoder(t, d, max_len=max_len, compile=args.compile, attn_impl=impl)
            # warm-up (graph captures, allocator, clocks): without it the first row's plain rate came out ~20%
            # low (2026-11-29: 924 tok/s vs 1,150-1,192 on every later row), inflating that row's speedup
            run_eval(eng, prompts[:2], settings[0], (0.0,), min(32, new), seed=0)
        temps = (0.0, 1.0) if (mode is settings[0] and impl == args.attn_impls[0]) or args.all_temps else (0.0,)
        rep = run_eval(eng, prompts, mode, temps, new, seed=0)
        for temp, e in rep["temperatures"].items():
            s = e["speculative"]
            plain_tps[temp] = e["plain"]["tokens_per_s"]
            row = {
                "attention": eng.attn_impl,
                "mode": mode.kind,
                "K": mode.draft_tokens if mode.kind == "chain" else None,
                "tree": [mode.top_k, mode.depth, mode.tree_tokens] if mode.kind == "tree" else None,
                "T": float(temp),
                "tau": s["tau"],
                "acceptance_rate": s["acceptance_rate"],
                "p_at_least": s["p_at_least"],
                "spec_tok_s": s["tokens_per_s"],
                "plain_tok_s": e["plain"]["tokens_per_s"],
                "speedup_vs_plain": e["speedup"],
                "greedy_mismatches": e.get("greedy_mismatches"),
            }
            rows.append(row)
            RESULTS["sections"]["P2a_rows_so_far"] = rows
            flush()
            log(
                f"P2a {impl} {mode.kind} {row['K'] or row['tree']} T={temp}: tau={s['tau']:.2f} "
                f"acc={s['acceptance_rate']:.2f} {s['tokens_per_s']:.1f} tok/s ({e['speedup']:.2f}x plain)"
            )
    # transformers generate() baselines (few prompts/tokens: they are slow)
    hf = {}
    x = torch.tensor([prompts[0]], device=dev)
    n_hf = min(64, new)
    hf_model = t.model
    for name, kw in (("dynamic", {}), ("static", {"cache_implementation": "static"})):
        if left(args.budget) < (150 if name == "static" else 60):
            log(f"P2a: skipping generate({name}) (time budget)")
            continue
        try:
            gen = lambda: hf_model.generate(  # noqa: E731
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=n_hf,  # noqa
                min_new_tokens=n_hf,
                do_sample=False,
                pad_token_id=0,
                **kw,
            )
            gen()
            sync(dev)
            t0 = time.perf_counter()
            reps = 2
            for _ in range(reps):
                gen()
            sync(dev)
            hf[name] = reps * n_hf / (time.perf_counter() - t0)
            log(f"P2a generate({name}): {hf[name]:.1f} tok/s")
        except Exception as e:  # noqa: BLE001
            hf[name] = None
            RESULTS["errors"][f"P2a_generate_{name}"] = f"{type(e).__name__}: {e}"
    # plain decode is the same workload in every row: also report against its median over the rows (per T)
    import statistics

    # ... and against the fastest plain decode of any attention implementation (the honest baseline)
    for r in rows:
        meds = [
            statistics.median(x["plain_tok_s"] for x in rows if x["T"] == r["T"] and x["attention"] == a)
            for a in {x["attention"] for x in rows if x["T"] == r["T"]}
        ]
        r["speedup_vs_plain_median"] = r["spec_tok_s"] / max(meds) if meds else None
    best = {}
    for kind in ("chain", "tree"):
        cand = [r for r in rows if r["mode"] == kind and r["T"] == 0.0]
        if cand:
            best[kind] = max(cand, key=lambda r: r["spec_tok_s"])
    best["all"] = [r for r in rows if r["T"] == 0.0]
    for r in rows:
        for name, v in hf.items():
            r[f"speedup_vs_generate_{name}"] = r["spec_tok_s"] / v if v else None
    RESULTS["sections"].pop("P2a_rows_so_far", None)
    RESULTS["sections"]["P2a"] = {
        "rows": rows,
        "generate_tok_s": hf,
        "plain_tok_s": plain_tps,
        "best": best,
        "prompts": len(prompts),
        "new_tokens": new,
        "cuda_graphs": eng.cuda_graphs,
    }
    LINES.append(
        f"\n### P2a — {Path(args.target).name} + drafter, HumanEval code prompts ({len(prompts)}), {new} new tokens"
    )
    LINES.append(
        "| setting | attention | T | τ | accept rate | spec tok/s | plain tok/s | × plain | × best plain | "
        "× generate dyn | × generate static |"
    )
    LINES.append("|---|---|---|---|---|---|---|---|---|---|---|")
    f = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    for r in rows:
        name = f"chain K={r['K']}" if r["mode"] == "chain" else "tree k={} d={} n={}".format(*r["tree"])
        LINES.append(
            f"| {name} | {r['attention']} | {r['T']:g} | {f(r['tau'])} | {f(r['acceptance_rate'])} | {f(r['spec_tok_s'], 1)} | "
            f"{f(r['plain_tok_s'], 1)} | {f(r['speedup_vs_plain'])} | {f(r['speedup_vs_plain_median'])} | "
            f"{f(r.get('speedup_vs_generate_dynamic'))} | {f(r.get('speedup_vs_generate_static'))} |"
        )
    LINES.append(
        "× plain: against the same engine's plain decode in that row; × best plain: against the median plain "
        "rate of the fastest attention implementation."
    )
    LINES.append(
        f"generate() tok/s ({n_hf} tokens, greedy): dynamic cache {f(hf.get('dynamic'), 1)}, static cache "
        f"{f(hf.get('static'), 1)} (transformers compiles the static-cache forward on CUDA by default)"
    )
    del eng, t, d
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return best


@torch.no_grad()
def row_kernel_table(eng, runner, engine_name: str) -> list[dict]:
    """Per weight kind: the row kernels' tuned tile and time (from the engine's tuning), cuBLAS at the same rows and
    the one-row gemv (no folds), each also as the matrix's bytes over the time ÷ copy bandwidth."""
    import torch.nn.functional as F

    from draftsmith.decode import kernels as K

    bw = copy_bandwidth(torch.device("cuda"), False)
    out = []
    for kind, (mats, _) in runner.gemv_kinds().items():
        mine = [r for r in eng.kernel_tuning if r.get("matrix") == kind and r.get("us") is not None]
        rows_t = [r for r in mine if "rows" in r]
        if not rows_t:
            continue
        best = min(rows_t, key=lambda r: r["us"])
        T = best["rows"]
        x = torch.randn(T, mats[0].shape[1], device=mats[0].device, dtype=mats[0].dtype)
        cublas, _ = K._time_graph(lambda: [F.linear(x, w) for w in mats], len(mats), 10)
        nbytes = mats[0].numel() * mats[0].element_size()
        # the one-row gemv (no folds) with the runner's tuned tiles: the plain step's rate for the same weights
        g, _ = K._time_graph(lambda: [K.gemv(x[:1], w, config=runner.kernel_config) for w in mats], len(mats), 10)
        frac = lambda us: nbytes / (us * 1e-6) / bw if us else None  # noqa: E731
        out.append(
            {
                "engine": engine_name,
                "matrix": kind,
                "shape": f"{mats[0].shape[0]}x{mats[0].shape[1]} x{len(mats)}",
                "rows": T,
                "rows tile": "/".join(str(best[k]) for k in ("BLOCK_N", "BLOCK_K", "warps", "split")),
                "rows us": best["us"],
                "rows ÷ bw": frac(best["us"]),
                "cuBLAS us": cublas,
                "cuBLAS ÷ bw": frac(cublas),
                "gemv 1-row us": g,
                "gemv ÷ bw": frac(g),
            }
        )
        log(f"row kernels {kind}: {out[-1]}")
    return out


def p2b(args, dev, dtype, runner, best):
    from draftsmith.drafter import Drafter, DrafterConfig

    cfg = llama8b_config(args.smoke)
    H = cfg.hidden_size
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or H // nh
    dcfg = DrafterConfig(
        hidden_size=H,
        target_hidden_size=H,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=nh,
        num_key_value_heads=nkv,
        head_dim=hd,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        vocab_size=cfg.vocab_size,
        draft_vocab_size=min(32000, cfg.vocab_size),
        num_hidden_layers=1,
        aux_layer_ids=runner.aux_layers,
        target_num_layers=cfg.num_hidden_layers,
    )
    torch.manual_seed(0)
    with torch.device(dev):
        d = Drafter(dcfg)
    d = d.to(dtype).eval()
    d.requires_grad_(False)
    d.set_embedding(runner.embed)
    ctx = 64 if args.smoke else 512
    # every T=0 setting P2a measured, with its τ (the fastest setting on a launch-bound 22M target need not be
    # the fastest on the 8B shape, where a round's drafting costs relatively less)
    settings, seen = [], set()
    for r in sorted(best.get("all", []), key=lambda r: -r["spec_tok_s"]):
        mode = (
            DecodeMode("chain", draft_tokens=r["K"])
            if r["mode"] == "chain"
            else DecodeMode("tree", top_k=r["tree"][0], depth=r["tree"][1], tree_tokens=r["tree"][2])
        )
        if mode.key() not in seen:
            seen.add(mode.key())
            settings.append((mode, r["tau"]))
    if not settings and args.p2b_tau:  # τ from an earlier P2a run (its BENCHMARKS.md section), given by hand
        for item in args.p2b_tau.split(","):
            spec, tau = item.split("=")
            kind, _, val = spec.partition(":")
            v = [int(x) for x in val.split("/")]
            settings.append(
                (
                    DecodeMode("chain", draft_tokens=v[0])
                    if kind == "chain"
                    else DecodeMode("tree", top_k=v[0], depth=v[1], tree_tokens=v[2]),
                    float(tau),
                )
            )
    if not settings:  # no P2a: report round costs of default settings with τ unknown
        settings = [
            (DecodeMode("chain", draft_tokens=4), None),
            (DecodeMode("tree", top_k=8, depth=6, tree_tokens=48), None),
        ]
    n = 8 if args.smoke else 32
    need = max(m.cache_need for m, _ in settings)
    max_acc = max(m.max_accept for m, _ in settings)
    sp = SamplingParams()
    prompt = torch.randint(0, cfg.vocab_size, (ctx,)).tolist()
    rows, t_plains = [], {}
    from draftsmith.decode.engine import causal_mask

    # every slot a timed round can touch stays in range (an out-of-range index is a fatal device assert)
    max_len = ctx + (n + 4) * (max_acc + 1) + need + 16
    # one engine per (step kernels, attention): its plain step and its rounds are measured side by side, so a
    # row's projection can also be read against its own engine's plain step (one configuration for both)
    kernels = [k for k in args.kernels if k == "torch" or _triton_ok(dev)]
    # each engine: (kernels, attention, kernel_rows, KernelConfig overrides, label); the first per attention is the
    # default engine, each option below adds one that differs from it in one setting
    combos = [(kn, impl, 1, {}, "") for kn in kernels for impl in args.attn_impls]
    tri = "triton" in kernels
    # --kernel-rows: also the triton engine whose verifies of up to N rows run through the row kernels
    combos += [
        ("triton", impl, r, {}, f" rows{r}") for r in args.kernel_rows if r > 1 and tri for impl in args.attn_impls
    ]
    # --attn-live-chunks: also the triton engine whose attention kernels split the live keys into N chunks
    combos += [
        ("triton", impl, 1, {"attn_live_chunks": n}, f" live{n}")
        for n in args.attn_live_chunks
        if n > 0 and tri
        for impl in args.attn_impls
    ]
    # --rows-attn-live off: also the triton engine whose few-row attention keeps the width rule (the engine before
    # 2026-12-03)
    if "off" in args.rows_attn_live and tri:
        combos += [("triton", impl, 1, {"rows_attn_live": False}, " norowslive") for impl in args.attn_impls]
    # --lt-matmuls on: also the triton engine whose wide forwards take the tuned cuBLASLt algorithms (experimental)
    if "on" in args.lt_matmuls and tri and dev.type == "cuda":
        combos += [("triton", impl, 1, {"lt_matmuls": True}, " lt") for impl in args.attn_impls]
    # --lt-matmuls search: the same with LtLinear.search's configurations among the candidates (KernelConfig.lt_search)
    if "search" in args.lt_matmuls and tri and dev.type == "cuda":
        combos += [
            ("triton", impl, 1, {"lt_matmuls": True, "lt_search": True}, " ltsearch") for impl in args.attn_impls
        ]
    # --cluster-gemm on / late: also the triton engine whose wide forwards' layer matmuls take our CUDA kernel
    # (experimental.cluster_gemm; late: its next kernel launches once its K loops are done)
    cg_last = ({}, "")
    tags = {"on": " cg", "late": " cglate", "fused": " cgfused", "fusedrope": " cgrope", "fusedropelayer": " cglayer"}
    if tri and dev.type == "cuda":
        for v in args.cluster_gemm:
            if v not in tags:
                continue
            files = (args.cluster_gemm_plans or "").split(",")
            for plans_file in files:
                over = {
                    "cluster_gemm": True,
                    "cluster_gemm_late": v == "late",
                    "cluster_gemm_fused": v.startswith("fused"),
                    "cluster_gemm_rope": v.startswith("fusedrope"),
                    "cluster_gemm_layer": v == "fusedropelayer",
                }
                tag = tags[v]
                if plans_file:  # bench/cluster_gemm.py --save-plans: {"N,K": [variant, split]}
                    table = json.loads(Path(plans_file).read_text())
                    over["cluster_gemm_plans"] = {
                        tuple(int(d) for d in nk.split(",")): (p[0], int(p[1])) for nk, p in table.items()
                    }
                    tag += f" {Path(plans_file).stem}" if len(files) > 1 else ""
                combos += [("triton", impl, 1, over, tag) for impl in args.attn_impls]
                cg_last = (over, tag)
    # --rows-attn-plan P: also the triton engine whose wide T-row attentions (the 8B verify's) take plan P (on top of
    # the last --cluster-gemm engine when there is one)
    if tri:
        base, base_tag = cg_last
        combos += [
            ("triton", impl, 1, {**base, "rows_attn_plan": plan}, base_tag + " attn" + "/".join(map(str, plan)))
            for plan in args.rows_attn_plan
            for impl in args.attn_impls
        ]
    n_default = len(kernels) * len(args.attn_impls)
    if args.no_default_engine and len(combos) > n_default:  # only the option engines (A/Bs among them)
        combos = combos[n_default:]
    graphs = None
    rows_kernels = []
    anatomies = []  # --anatomy: (title, anatomy()) of each engine's plain step and each setting's verify and draft step
    lt_lines = []
    for kn, impl, krows, overrides, label in combos:
        try:
            kc = KernelConfig(**overrides) if kn == "triton" else None
            eng = SpeculativeDecoder(
                runner, d, max_len=max_len, attn_impl=impl, compile=args.compile, kernels=kn, kernel_rows=krows,
                kernel_config=kc,
            )  # fmt: skip
            plain = eng.step_fn(DecodeMode("plain"), sp)
            eng.prefill(prompt, sp)
            pname = impl if kn == "torch" else f"{impl}+triton kernels{label}"
            if krows > 1 and dev.type == "cuda":
                rows_kernels += row_kernel_table(eng, runner, pname)
            t_plains[pname] = t_own = time_steps(eng, plain, n, dev)
            if args.anatomy and dev.type == "cuda":
                anatomies.append((f"{pname}: plain step", anatomy(plain, dev)))
            for mode, tau in settings:
                if left(args.budget + 60) < 15:
                    log(f"P2b: skipping {kn} {impl} {mode} (time budget)")
                    continue
                fn = eng.step_fn(mode, sp)
                eng.prefill(prompt, sp)
                t_round = time_steps(eng, fn, n, dev)  # random drafter: shapes (and cost) do not depend on acceptance
                if args.anatomy and dev.type == "cuda":  # two more rounds: max_len leaves room for them
                    anatomies.append((f"{pname}: {mode} round", anatomy(fn, dev)))
                # components, each from its own CUDA graph through the engine's own (compiled, if so) forwards: one
                # verify forward, one drafter step (forward + logits, as each tree level or chain step runs)
                T = mode.verify_tokens
                Lt = torch.tensor(ctx, device=dev)
                pos = Lt + torch.arange(T, device=dev)
                mask = causal_mask(eng.max_len, pos, dev)
                ids = torch.zeros(max(T, mode.top_k), dtype=torch.long, device=dev)
                verify = lambda: eng.target_forward(ids[:T], pos, pos, mask)  # noqa: E731, F821 (eng is bound above)
                g_verify = graphed(verify, dev)
                t_verify = time_steps(eng, g_verify, n, dev)
                Td = 1 if mode.kind == "chain" else mode.top_k
                dpos = Lt + torch.arange(Td, device=dev)
                dmask = causal_mask(eng.max_len, dpos, dev)
                hid = torch.zeros(Td, H, dtype=dtype, device=dev)
                dstep = lambda: eng.draft_logits(eng.draft_forward(ids[:Td], hid, dpos, dpos, dmask))  # noqa: E731, F821
                g_draft = graphed(dstep, dev)
                t_draft = time_steps(eng, g_draft, n, dev)
                if args.anatomy and dev.type == "cuda":
                    anatomies.append((f"{pname}: {mode} verify ({T} rows)", anatomy(g_verify, dev)))
                    anatomies.append((f"{pname}: {mode} draft step ({Td} rows)", anatomy(g_draft, dev)))
                census = round_census(eng.eager_step_fn(mode, sp), dev) if args.round_census else None
                rows.append(
                    {
                        "mode": mode.kind,
                        "setting": mode.__dict__,
                        "attention": impl,
                        "kernels": kn + label,
                        "context": ctx,
                        "cache_slots": eng.max_len,
                        "t_plain_own_ms": t_own * 1e3,
                        "t_round_ms": t_round * 1e3,
                        "t_verify_ms": t_verify * 1e3,
                        "t_draft_step_ms": t_draft * 1e3,
                        "tau_from_P2a": tau,
                        "census": census,
                    }
                )
                log(f"P2b {kn} {impl} {mode}: round {t_round * 1e3:.2f} ms (own plain {t_own * 1e3:.2f} ms)")
            graphs = eng.cuda_graphs
            lt_lines += [
                f"- {pname}: {r['rows']} rows {r['kind']} ({r['n']}x{r['k']}): F.linear {r['torch_us']} us, chosen "
                f"{r['label']} {r['us']} us ({r['bit_equal']} of {r['candidates']} candidates bit-equal)"
                for r in eng.lt_tuning
            ]
            del eng
        except Exception as e:  # an A/B engine's failure (an option's) must not cost the default engines' rows
            if not label:
                raise
            RESULTS["errors"][f"P2b{label}"] = f"{type(e).__name__}: {e}"
            log(f"P2b: the{label} engine failed: {type(e).__name__}: {e}")
    t_plain = min(t_plains.values())  # the fastest plain decode is the baseline
    for row in rows:
        tau = row["tau_from_P2a"]
        row["t_plain_ms"] = t_plain * 1e3
        row["projected_speedup"] = tau * t_plain / (row["t_round_ms"] / 1e3) if tau else None
        row["projected_speedup_own_plain"] = tau * row["t_plain_own_ms"] / row["t_round_ms"] if tau else None
        row["breakeven_tau"] = row["t_round_ms"] / 1e3 / t_plain
        log(
            f"P2b {row['attention']} {row['mode']} {row['setting']}: t_plain {t_plain * 1e3:.2f} ms, t_round "
            f"{row['t_round_ms']:.2f} ms, projected {row['projected_speedup'] or float('nan'):.2f}x (τ={tau})"
        )
    RESULTS["sections"]["P2b"] = {
        "rows": rows,
        "row_kernels": rows_kernels,
        "cuda_graphs": graphs,
        "t_plain_ms": {a: v * 1e3 for a, v in t_plains.items()},
        "anatomy": {t: a for t, a in anatomies},
        "lt_tuning": lt_lines,
    }
    LINES.append(f"\n### P2b — PROJECTED speedup, Llama-3.1-8B shape (random bf16), 8B-sized drafter, context {ctx}")
    LINES.append(f"Rounds {'torch.compiled' if args.compile else 'eager'}, replayed from CUDA graphs.")
    if args.p2b_tau and not best.get("all"):
        LINES.append(f"τ of each setting from an earlier P2a run (`--p2b-tau {args.p2b_tau}`), not this one.")
    LINES.append(
        "plain step (graph): "
        + ", ".join(f"{a} {v * 1e3:.2f} ms" for a, v in t_plains.items())
        + f"; t_plain = the fastest, {t_plain * 1e3:.2f} ms. Cache {rows[0]['cache_slots'] if rows else '-'} "
        "slots.\n"
    )
    LINES.append(
        "| setting | attention | step kernels | own plain ms | t_round ms (graph) | verify ms (graph) | "
        "draft step ms (graph) | τ (P2a) | break-even τ | projected × (fastest plain) | projected × (own plain) |"
    )
    LINES.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["setting"]
        name = (
            f"chain K={s['draft_tokens']}"
            if r["mode"] == "chain"
            else f"tree k={s['top_k']} d={s['depth']} n={s['tree_tokens']}"
        )
        tau = "-" if r["tau_from_P2a"] is None else f"{r['tau_from_P2a']:.2f}"
        proj = "-" if r["projected_speedup"] is None else f"{r['projected_speedup']:.2f}"
        own = "-" if r["projected_speedup_own_plain"] is None else f"{r['projected_speedup_own_plain']:.2f}"
        LINES.append(
            f"| {name} | {r['attention']} | {r['kernels']} | {r['t_plain_own_ms']:.2f} | {r['t_round_ms']:.2f} | "
            f"{r['t_verify_ms']:.2f} | {r['t_draft_step_ms']:.2f} | {tau} | {r['breakeven_tau']:.2f} | "
            f"{proj} | {own} |"
        )
    census_rows = [r for r in rows if r.get("census")]
    if census_rows:
        LINES.append(
            "\nOne round under the profiler (its kernels are what the round's graph replays; ms = summed kernel "
            "time by kind, so t_round minus their total is launch gaps):\n"
        )
        kinds = list(dict.fromkeys(k for r in census_rows for k in r["census"]["by_kind"]))
        LINES.append(
            "| setting | step kernels | kernels | kernel ms | " + " | ".join(f"{k} ms (n)" for k in kinds) + " |"
        )
        LINES.append("|---|---|---|---|" + "---|" * len(kinds))
        for r in census_rows:
            c, s = r["census"], r["setting"]
            name = (
                f"chain K={s['draft_tokens']}"
                if r["mode"] == "chain"
                else f"tree k={s['top_k']} d={s['depth']} n={s['tree_tokens']}"
            )
            cells = [f"{c['by_kind'][k][1]:.3f} ({c['by_kind'][k][0]})" if k in c["by_kind"] else "-" for k in kinds]
            LINES.append(
                f"| {name} | {r['kernels']} | {c['kernels']} | {c['kernel_ms']:.3f} | " + " | ".join(cells) + " |"
            )
        for r in census_rows:
            LINES.append(
                f"- {r['mode']} {r['kernels']} top: "
                + "; ".join(f"{nm[:50]} x{cnt} {ms:.3f} ms" for nm, cnt, ms in r["census"]["top"][:8])
            )
    if rows_kernels:
        LINES.append(
            "\nThe row kernels (experimental.gemm_rows) per weight kind, as the engine's tuning timed them (every "
            "layer's matrix, one CUDA graph; us a matrix at the tuned width), next to cuBLAS (F.linear) at the same "
            "rows and the one-row gemv; ÷ bw = the matrix's bytes over the time, as a fraction of copy bandwidth:\n"
        )
        cols = list(rows_kernels[0])
        LINES.append("| " + " | ".join(cols) + " |")
        LINES.append("|" + "---|" * len(cols))
        for r in rows_kernels:
            LINES.append("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
    if lt_lines:
        LINES.append(
            "\n`--lt-matmuls on` (experimental.cublaslt): the wide forwards' matmuls, per width and kind, F.linear "
            "against the fastest cuBLASLt candidate whose output equals F.linear's bit for bit (every layer's matrix "
            "in one CUDA graph, us a matrix; F.linear kept unless 1 % faster):\n"
        )
        LINES.extend(lt_lines)
    if anatomies:
        LINES.append(
            "\nEach part's CUDA graph replayed once under the profiler (`--anatomy`): kernels in launch order, "
            "summed by name (the top 30 by time), and the time between kernels (span - busy):"
        )
        for title, a in anatomies:
            LINES.extend(anatomy_lines(title, a))
    LINES.append(
        f"\nt_plain (fastest plain step of all engines above) = {t_plain * 1e3:.2f} ms; break-even τ against it. "
        "own plain: the plain step of the row's own engine (same kernels, attention, compile)."
    )


def flush(partial: bool = True) -> None:
    """Write what exists so far to $OUT (a run killed by a time limit still leaves its finished sections)."""
    out = os.environ.get("OUT")
    if not out:
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    RESULTS["partial"] = partial
    (Path(out) / "bench_decode.json").write_text(json.dumps(RESULTS, indent=2, default=str))
    (Path(out) / "BENCHMARKS.decode.md").write_text("\n".join(LINES) + "\n")


def _ints(s: str) -> list[int]:
    """'4,8' -> [4, 8] (a comma-separated flag)."""
    return [int(x) for x in s.split(",")]


def _attn_plans(text: str) -> list[tuple[int, int, int, int, int]]:
    """'16/128/1/8/3,64/32/4/4/3' -> [(16, 128, 1, 8, 3), (64, 32, 4, 4, 3)] (KernelConfig.rows_attn_plan)."""
    plans = []
    for item in filter(None, text.split(",")):
        parts = item.split("/")
        if len(parts) != 5 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"{item!r}: block_r/block_s/chunks/warps/stages, five positive integers")
        plans.append(tuple(int(p) for p in parts))
    return plans


def _on_off(s: str) -> list[str]:
    """'on,off' -> ['on', 'off']; anything else is an argparse error naming the value."""
    vals = s.split(",")
    if not vals or any(v not in ("on", "off") for v in vals):
        raise argparse.ArgumentTypeError(f"{s!r}: a comma-separated list of on / off")
    return vals


def _on_off_search(s: str) -> list[str]:
    """'off,on,search' -> ['off', 'on', 'search'] (--lt-matmuls); anything else is an argparse error."""
    vals = s.split(",")
    if not vals or any(v not in ("on", "off", "search") for v in vals):
        raise argparse.ArgumentTypeError(f"{s!r}: a comma-separated list of on / off / search")
    return vals


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="pycode-small directory (P2a)")
    ap.add_argument(
        "--drafter",
        default=None,
        help="drafter trained for --target (P2a); 'random' = an untrained one (timings only, τ≈1)",
    )
    ap.add_argument("--prompts", default=None, help="humaneval.jsonl (EAGLE question format)")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--chain-k", type=_ints, default=[2, 3, 4, 5])
    ap.add_argument(
        "--tree-cfgs",
        type=lambda s: [tuple(int(y) for y in x.split("/")) for x in s.split(",")],
        default=[(4, 4, 16), (8, 5, 32), (8, 6, 48)],
        help="top_k/depth/tokens,...",
    )
    ap.add_argument(
        "--attn-impls",
        type=lambda s: s.split(","),
        default=["sdpa", "bmm"],
        help="attention implementations measured side by side in P1, P2a and P2b (sdpa, bmm, split, auto)",
    )
    ap.add_argument(
        "--kernels",
        type=lambda s: s.split(","),
        default=["torch", "triton"],
        help="P1: step kernels to measure side by side (triton rows only where triton runs on CUDA)",
    )
    ap.add_argument(
        "--p2b-tau",
        default=None,
        help="P2b without P2a: settings and their τ measured by an earlier "
        "P2a, e.g. 'chain:4=3.51,tree:10/7/64=5.91' (the projection says so)",
    )
    ap.add_argument(
        "--kernel-rows",
        type=_ints,
        default=[1],
        help="P2b: also measure the triton engine with kernel_rows=N (verifies of up to N rows through the row "
        "kernels), e.g. 8,64",
    )
    ap.add_argument(
        "--attn-live-chunks",
        type=_ints,
        default=[0],
        help="P2b: also measure the triton engine with KernelConfig.attn_live_chunks=N (the attention kernels split "
        "the live keys into N chunks, not the cache's width), e.g. 0,4,8",
    )
    ap.add_argument(
        "--rows-attn-live",
        type=_on_off,
        default=["on"],
        help="P2b: 'on,off' also measures the triton engine with KernelConfig.rows_attn_live off (few-row attention "
        "by the width rule)",
    )
    ap.add_argument(
        "--cluster-gemm",
        type=lambda v: v.split(","),
        default=["off"],
        help="P2b: 'off,on' also measures the triton engine with KernelConfig.cluster_gemm (experimental: the wide "
        "forwards' q/k/v, o, gate/up and down through our CUDA kernel, experimental.cluster_gemm); 'late' too: with "
        "cluster_gemm_late; 'fused': with cluster_gemm_fused (the norms, silu * up and residual adds folded into it); "
        "'fusedrope': and cluster_gemm_rope (RoPE and the cache writes in q/k/v's); 'fusedropelayer': and "
        "cluster_gemm_layer (q/k/v, the attention and o in one launch; experimental.cluster_gemm.layer_qkv_attn_o)",
    )
    ap.add_argument(
        "--no-default-engine",
        action="store_true",
        help="P2b: leave out the default engine of each --kernels (only the engines the options add: an A/B among "
        "them in less device time)",
    )
    ap.add_argument(
        "--cluster-gemm-plans",
        help="with --cluster-gemm: the kernel's plan a shape from this JSON (bench/cluster_gemm.py --save-plans), "
        "not experimental.cluster_gemm.PLANS; several files comma-separated: an engine for each (tagged by its name)",
    )
    ap.add_argument(
        "--lt-matmuls",
        type=_on_off_search,
        default=["off"],
        help="P2b: 'off,on' also measures the triton engine with KernelConfig.lt_matmuls (experimental: the wide "
        "forwards' matmuls through the cuBLASLt algorithm timed fastest among those equal to F.linear bit for bit); "
        "'search' too: with the configurations past cuBLASLt's heuristic list among them (KernelConfig.lt_search)",
    )
    ap.add_argument(
        "--rows-attn-plan",
        type=_attn_plans,
        default=[],
        help="P2b: also the triton engine with KernelConfig.rows_attn_plan P for each P (block_r/block_s/chunks/warps/"
        "stages, comma-separated: e.g. 16/128/1/8/3, one chunk over the live keys and no combine launch) — the "
        "T-row attention of forwards wider than kernels.ROWS_ATTN_LIVE_MAX_ROWS tile rows (the 49-row verify)",
    )
    ap.add_argument("--all-temps", action="store_true", help="T=0 and T=1 for every setting (default: first only)")
    ap.add_argument("--sections", default="P1,P2a,P2b,P1c", help="P1c = P1 with torch.compile (runs last)")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds; later sections are skipped past it")
    ap.add_argument(
        "--compile",
        action="store_true",
        help="P2a and P2b: torch.compile the round forwards (+compile time; P2b's plain steps stay as measured)",
    )
    ap.add_argument(
        "--round-census",
        action="store_true",
        help="P2b: profile one round of each setting (kernels "
        "by kind: matmuls, inductor-fused, draftsmith Triton, sort/topk, other)",
    )
    ap.add_argument(
        "--anatomy",
        action="store_true",
        help="P2b: replay each engine's plain step and each setting's verify and draft step once under the profiler "
        "and print their kernels in launch order (summed by name) and the time between kernels",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks every code path")
    ap.add_argument("--no-benchmarks-md", action="store_true")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    args.target = args.target or next(
        (
            p
            for p in (".carry/pycode-small", "/work/shared/targets/pycode-small", "/work/shared/targets/pycode-tiny")
            if os.path.isdir(p)
        ),
        None,
    )
    if args.smoke:
        args.target = next(
            (p for p in (".carry/pycode-tiny", "/work/shared/targets/pycode-tiny") if os.path.isdir(p)), args.target
        )
    args.prompts = args.prompts or next(
        (p for p in (".carry/humaneval.jsonl", "/work/shared/data/eval/humaneval.jsonl") if os.path.exists(p)), None
    )
    if args.smoke:
        args.num_prompts, args.new_tokens = min(args.num_prompts, 2), min(args.new_tokens, 16)
        args.chain_k, args.tree_cfgs = args.chain_k[:1], args.tree_cfgs[:1]
    sections = set(args.sections.split(","))
    dev_name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    RESULTS.update(
        {
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "device": dev_name,
            "torch": torch.__version__,
            "commit": common.commit(),
            "command": " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
            "smoke": args.smoke,
        }
    )
    try:
        import transformers

        RESULTS["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001
        pass
    log(f"device {dev_name}, torch {torch.__version__}")

    def section(name, fn, need_s: float | None = None):
        """Run one section; a failure (or a spent time budget) is recorded under `name`, the rest still runs."""
        try:
            if need_s is not None and left(args.budget + 60) < need_s:
                raise RuntimeError("skipped: time budget")
            return fn()
        except Exception as e:  # noqa: BLE001
            RESULTS["errors"][name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        finally:
            flush()

    def bandwidth():
        b = copy_bandwidth(dev, args.smoke)
        RESULTS["copy_bandwidth_bytes_per_s"] = b
        log(f"copy bandwidth {b / 1e12:.3f} TB/s (read+write)")
        return b

    def p2a_section():
        if not args.target or not args.prompts:
            raise RuntimeError("P2a needs --target and --prompts")
        return p2a(args, dev, dtype)

    bw = section("bandwidth", bandwidth)
    runner = None
    best: dict = {}
    if "P1" in sections or "P2b" in sections:
        runner = (section("P1", lambda: p1(args, dev, dtype, bw or float("nan"))) or (None, None))[0]
    if "P2a" in sections:
        best = section("P2a", p2a_section) or {}
    if "P2b" in sections and runner is not None:
        section("P2b", lambda: p2b(args, dev, dtype, runner, best), need_s=30)
    if "P1c" in sections and runner is not None:
        section("P1c", lambda: p1_compiled(args, dev, dtype, bw or float("nan"), runner), need_s=150)
    RESULTS["wall_s"] = time.perf_counter() - T0
    title = f"decode{' (SMOKE, not a measurement)' if args.smoke else ''}"
    body = "\n".join(LINES)
    if RESULTS["errors"]:
        body += "\n\nerrors: " + "; ".join(f"{k}: {v}" for k, v in RESULTS["errors"].items())
    body += f"\n\n(torch {torch.__version__}, transformers {RESULTS.get('transformers')})"
    flush(partial=False)
    if args.no_benchmarks_md or args.smoke:
        print(body, flush=True)
    else:  # BENCHMARKS.md and $OUT/decode.{md,json}: date, device, commit, command (bench/common.py)
        common.record("decode", title, body, RESULTS, RESULTS["command"])
    log("done")


if __name__ == "__main__":
    main()
