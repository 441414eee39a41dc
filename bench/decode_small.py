"""Round census on a small, launch-bound target (issue 16 section 2): what one speculative round costs in plain
steps, per engine configuration, and the bf16 greedy certificate.

    python bench/decode_small.py --target .carry/pycode-small --prompts .carry/humaneval.jsonl

Per configuration (torch kernels with CUDA graphs; --kernels triton --compile): the plain step and each setting's
round replayed from their CUDA graphs (ms), the round in plain steps, the kernels one round launches by kind
(profiler, one eager round), and a projected speedup tau * t_plain / t_round for the settings whose tau is given
(--tau, default: the taus issue 16 measured with a drafter trained for pycode-small; labelled projected). The
floor of a round: the target's weights read once plus the drafter's K times (bytes / copy bandwidth) -- on a small
target far below the launch cost, so the launch count is the number to cut.
Certificate section: a drafter overfit on the target's own greedy outputs of the prompts (so verifies accept
several tokens; its tau is inflated and not reported as a result), `draftsmith eval`'s greedy_divergences over the
prompts, torch and Triton kernels. (An fp32 final norm + lm_head in every forward was tried on 2026-12-01 and did
not reduce the near ties: BENCHMARKS.md.) Writes $OUT/decode_small.{md,json}; appends to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import common  # noqa: E402
import decode as DB  # noqa: E402  (timing and census helpers of bench/decode.py)
import torch  # noqa: E402

from draftsmith.decode.engine import DecodeMode, SpeculativeDecoder  # noqa: E402
from draftsmith.decode.experimental.gemm_rows import _k_chains  # noqa: E402
from draftsmith.decode.kernel_config import KernelConfig  # noqa: E402
from draftsmith.decode.sampling import SamplingParams  # noqa: E402

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def parse_setting(s: str) -> DecodeMode:
    if s.startswith("chain"):
        return DecodeMode("chain", draft_tokens=int(s[5:]))
    k, d, n = (int(x) for x in s[4:].split("/"))
    return DecodeMode("tree", top_k=k, depth=d, tree_tokens=n)


def name(m: DecodeMode) -> str:
    return f"chain{m.draft_tokens}" if m.kind == "chain" else f"tree{m.top_k}/{m.depth}/{m.tree_tokens}"


def weight_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


# "fewwarps": one- and two-warp tiles added to the sweeps (the default sweeps' tiles have 4-8 warps, whose programs
# reduce across warps through shared memory and a barrier; on a launch-bound target a program's latency is the cost)
FEW_WARP_ROWS = ((16, 512, 2), (16, 512, 1), (16, 256, 2), (16, 256, 1), (16, 1024, 2), (32, 512, 2), (8, 512, 2),
                 (4, 512, 2), (4, 512, 1), (2, 512, 1))  # fmt: skip
FEW_WARP_GEMV = ((8, 512, 2, 1), (8, 512, 1, 1), (4, 512, 2, 1), (4, 512, 1, 1), (16, 512, 2, 1), (8, 1024, 2, 1),
                 (4, 1024, 2, 1), (2, 1024, 1, 1), (16, 256, 2, 1), (2, 512, 1, 1))  # fmt: skip


def make_engine(t, d, config: str) -> SpeculativeDecoder:
    """config: "torch" (torch kernels, CUDA graphs), or "+"-joined parts: "triton", "compile" (greedy rounds traced
    whole, the default of compile=True), "perfwd" (only the forwards compiled, the rounds' bookkeeping eager: the
    engine before whole-round tracing), "rowsN" (kernel_rows=N: verifies of up to N tokens all through the
    kernels, experimental.gemm_rows), "noembed" (the drafter's first-layer norms and cat in torch, not
    folded into its qkv gemv: `KernelConfig.embed_fold` off), "moddrafter" (with triton: the drafter as its module, not
    `KernelDraftStep`), "nolook" (`generate` reads each round before launching the next: the engine before
    `lookahead`; only the speed section sees it), "alltail" (with the lookahead, a round always launched ahead, also
    the last of a length-bound generation: `lookahead_tail` off, the engine before 2026-12-02 thirteenth session),
    "unfused" (greedy drafts' argmax by torch after the lm_head gemv, not in its epilogue: `fused_draft_argmax` off,
    the engine before 2026-12-02 thirteenth session), "nopfgraph" (prompts prefill eagerly, not padded to a length
    bucket from one CUDA graph each: `prefill_graphs` off, the engine before 2026-12-02; the speed section's prefill_ms /
    e2e_tok_s columns), "pfgraph" (the padded prefill even without CUDA graphs, as the CPU test runs it), "ownpools" (each prefill graph its own memory pool, not one
    shared: `share_prefill_pool` off; the speed section's graph_mb column), "dotrows" (gemm_rows tuned over
    its tl.dot tiles only, not the CUDA-core ones: BLOCK_N >= 16), "ropefold" (the all-kernel forwards' q/k/v matmul
    does RoPE and the cache writes: `KernelConfig.rope_fold` on, one launch a layer fewer in plain steps and in
    verifies through the row kernels), "ropefold1" (the same in the one-row gemv only: plain and draft steps,
    `KernelConfig.rope_fold_rows` off), "chained" (the tuners time each tile as a dependent chain of launches, as a forward runs them:
    `KernelConfig.tune_chained` on), "liveN" (the attention kernels split the live keys into N chunks, not the
    cache's capacity into 64: `KernelConfig.attn_live_chunks`), "fewwarps" (one- and two-warp tiles added to both tuners' sweeps), "norowslive" (the T-row attention of a few rows
    by the width rule, not over the live keys: `KernelConfig.rows_attn_live` off, the engine before 2026-12-03), "nochains" (gemm_rows's tl.dot tiles walk K in one MMA chain, not all of K as
    independent chains of BLOCK_K: `KernelConfig.rows_k_chains` off, the engine before 2026-12-03's seventeenth session), "cg" / "cgfused" / "cgrope"
    / "cglayer" (the wide forwards' matmuls — verifies past kernel_rows, hand-offs — through experimental.cluster_gemm
    on sm_90: `KernelConfig.cluster_gemm`, with its folds, with RoPE in q/k/v's too, and with q/k/v, the attention and
    o in one launch; measured slower on pycode-small's trees with the folds, 2026-12-04). A config may appear twice in --configs (e.g. A,B,A: two engines of one code
    differ by a few % in one process, and the repeat reads that noise; its rows are labelled "#2")."""
    parts = config.split("#")[0].split("+")  # ("#2": a repeated config's label)
    kernels = "triton" if "triton" in parts else "torch"
    rows = next((int(p[4:]) for p in parts if p.startswith("rows")), 1)
    kc = kernel_config_for(parts)
    eng = SpeculativeDecoder(
        t, d, max_len=2048, kernels=kernels, compile="compile" in parts, kernel_rows=rows, kernel_config=kc
    )
    eng.lookahead = "nolook" not in parts and eng.device.type == "cuda"
    if "pfgraph" in parts or "nopfgraph" in parts:
        eng.prefill_graphs = "pfgraph" in parts
    eng.share_prefill_pool = "ownpools" not in parts
    eng.lookahead_tail = "alltail" not in parts
    eng.fused_draft_argmax = "unfused" not in parts
    if "perfwd" in parts:
        eng._c_round = None
    if "moddrafter" in parts:  # the drafter as a module (cuBLAS + elementwise kernels), not KernelDraftStep
        eng.kernel_drafter = False
        eng._build_drafter_view()
    return eng


def kernel_config_for(parts: list) -> KernelConfig:
    """The KernelConfig a config's "+"-joined parts name (`make_engine` says what each part does)."""
    kc = KernelConfig(
        embed_fold="noembed" not in parts,
        rope_fold="ropefold" in parts or "ropefold1" in parts,
        rope_fold_rows="ropefold1" not in parts,
        tune_chained="chained" in parts,
        attn_live_chunks=next((int(p[4:]) for p in parts if p.startswith("live")), 0),
        rows_attn_live="norowslive" not in parts,
        rows_k_chains="nochains" not in parts,
        cluster_gemm=any(p in parts for p in ("cg", "cgfused", "cgrope", "cglayer")),
        cluster_gemm_fused=any(p in parts for p in ("cgfused", "cgrope", "cglayer")),
        cluster_gemm_rope="cgrope" in parts or "cglayer" in parts,
        cluster_gemm_layer="cglayer" in parts,
    )
    if "dotrows" in parts:
        kc.rows_sweep = tuple(t for t in kc.rows_sweep if t[0] >= 16)
    if "fewwarps" in parts:  # tiles of one or two warps too: no cross-warp reduction or barrier in a program
        kc.rows_sweep = kc.rows_sweep + FEW_WARP_ROWS
        kc.gemv_sweep = kc.gemv_sweep + FEW_WARP_GEMV
    return kc


def tiles_chosen(eng) -> dict:
    """'N x K folds' -> 'BLOCK_N/BLOCK_K/warps[/prefetch]' of the engine's tuned gemv and gemm_rows tiles (gemm_rows
    tiles under 16 outputs run its CUDA-core products: 'fma'), with the microseconds a matrix each took when tuned, and
    how many timed tiles did not run at all."""
    cfg = getattr(eng.runner, "kernel_config", None)
    if cfg is None:
        return {}

    def label(key):
        N, K, _, *folds = key
        names = ("norm", "bias", "res", "act_mul", "glu")
        return f"{N}x{K}" + "".join(f"+{n}" for n, f in zip(names, folds) if f)

    def us(k):  # the chosen tile's microseconds a matrix at tuning time
        return f" {cfg.tuned_us[k]:.2f}us" if k in getattr(cfg, "tuned_us", {}) else ""

    out = {f"gemv {label(k)}": "/".join(map(str, v)) + us(k) for k, v in cfg.gemv_tuned.items()}
    for k, v in cfg.rows_tuned.items():
        N, K, dt, norm, bias, res, glu = k
        one_range = v[0] >= 16 and (len(v) < 4 or v[3] == 1)  # (a verify's rows: 16, bf16)
        chains = _k_chains(K, 16, v[0], v[1], glu, 2, None, cfg) if one_range else 1
        out[f"rows {label((N, K, dt, norm, bias, res, False, glu))}"] = (
            "/".join(map(str, v)) + (" fma" if v[0] < 16 else "") + (f" x{chains}" if chains > 1 else "") + us(k)
        )
    # tiles the sweep timed none of (they did not compile or run here): silently skipped by the tuner, so say it
    failed = [r for r in getattr(eng, "kernel_tuning", []) if r.get("us") is None]
    if failed:
        fma = sum(1 for r in failed if "rows" in r and r.get("BLOCK_N", 16) < 16)
        out["tiles that did not run"] = f"{len(failed)} of {len(eng.kernel_tuning)} ({fma} CUDA-core row tiles)"
    return out


@torch.no_grad()
def census(
    t, d, prompt, config: str, settings, replays: int, dev, taus: dict, bw: float, rows: list, parts: bool = True
) -> None:
    eng = make_engine(t, d, config)
    sp = SamplingParams()
    modes = [DecodeMode("plain")] + settings
    fns = {}
    for m in modes:  # capture every graph before any prefill (capture runs a round at L = 0)
        t1 = time.perf_counter()
        fns[name(m) if m.kind != "plain" else "plain"] = eng.step_fn(m, sp)
        log(f"{config}: captured {name(m) if m.kind != 'plain' else 'plain'} in {time.perf_counter() - t1:.1f} s")
    target_bytes = sum(x.numel() * x.element_size() for x in t.model.parameters())
    drafter_bytes = weight_bytes(d)
    t_plain = None
    for m in modes:
        key = name(m) if m.kind != "plain" else "plain"
        eng.prefill(prompt, sp, draft=True)
        per = DB.time_steps(eng, fns[key], replays, dev)
        cen = DB.round_census(eng.eager_step_fn(m, sp), dev)
        if m.kind == "plain":
            t_plain = per
        K = m.max_accept
        floor_s = (target_bytes + K * drafter_bytes) / bw
        row = {
            "config": config,
            "setting": key,
            "ms": per * 1e3,
            "plain_steps": per / t_plain,
            "kernels": cen["kernels"],
            "by_kind": {k: v[0] for k, v in cen["by_kind"].items()},
            "kernel_ms": cen["kernel_ms"],
            # busy = summed kernel time over the replay's wall time: the rest is launch gaps inside the graph
            "busy": cen["kernel_ms"] / (per * 1e3) if per else None,
            "floor_ms": floor_s * 1e3,
            "top": [(n, c, round(ms * 1e3, 2)) for n, c, ms in cen["top"]],  # (kernel, launches, summed us)
        }
        if key in taus:
            row["tau"] = taus[key]
            row["projected_speedup"] = taus[key] * t_plain / per
        if m.kind == "plain":  # the tiles the engine's tuning chose (which row-kernel path a verify runs)
            row["tiles"] = tiles_chosen(eng)
        pr = None
        if parts and m.kind == "chain":
            eng.prefill(prompt, sp, draft=True)
            try:
                pr = round_parts(eng, m.draft_tokens, dev)
            except Exception as e:  # noqa: BLE001 - the census row stands without its parts
                row["parts_error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
        if pr is not None:
            K = m.draft_tokens
            pr["rest"] = per * 1e6 - (K * pr["token"] + (K - 1) * pr["step"] + pr["verify"] + pr["handoff"])
            row["parts_us"] = {k: round(v, 1) for k, v in pr.items()}
            # in plain steps: the verify, the K tokens + K-1 steps (drafting), the hand-off, the rest
            ps = t_plain * 1e6
            row["parts_plain_steps"] = {
                "verify": pr["verify"] / ps,
                "drafting": (K * pr["token"] + (K - 1) * pr["step"]) / ps,
                "handoff": pr["handoff"] / ps,
                "rest": pr["rest"] / ps,
            }
            log(
                f"  parts (us): {row['parts_us']}; in plain steps: "
                + ", ".join(f"{k} {v:.2f}" for k, v in row["parts_plain_steps"].items())
            )
        rows.append(row)
        log(
            f"{config} {key}: {per * 1e3:.3f} ms = {per / t_plain:.2f} plain steps, {cen['kernels']} kernels "
            f"{row['by_kind']}"
            + (f", projected {row['projected_speedup']:.2f}x at tau {taus[key]}" if key in taus else "")
        )
        log(f"  busy {row['busy']:.2f}; top kernels (name, launches, us): {row['top']}")
    del eng
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _graph_us(fn, dev, copies: int = 16, reps: int = 20) -> float:
    """Best microseconds a call of `fn`, replayed from one CUDA graph of `copies` calls (bench/decode.py's `graphed`:
    a side-stream warm-up, then the capture; one call alone would time the graph's launch from the host); on CPU the
    calls run eagerly, once."""
    replay = DB.graphed(lambda: [fn() for _ in range(copies)], dev)
    best = float("inf")
    for _ in range(reps if dev.type == "cuda" else 1):
        with DB.Timer(dev) as t:
            replay()
        best = min(best, t.s / copies * 1e6)
    return best


@torch.no_grad()
def round_parts(eng, K: int, dev) -> dict:
    """Where a chain-K round's time goes, its parts timed one by one through the engine's public forwards (each
    replayed from a graph of its own; outside the round's trace, so without inductor's fusion of the glue): the
    verify (target forward over K+1 rows + argmax), a draft token (the drafter's lm_head + argmax + id map), a
    one-row drafter forward (a draft step: a round runs K tokens and K-1 steps) and the hand-off (fc over K+1 aux
    rows + the drafter forward over them). us each; `rest` = the round minus K tokens, K-1 steps, the verify and
    the hand-off (the acceptance, the emitted buffer, what the trace fuses or adds)."""
    L = int(eng.L)
    pos = torch.arange(L, L + K + 1, device=eng.device)
    mask = eng.mask(pos)
    ids = torch.randint(0, eng.vocab_size, (K + 1,), device=eng.device)
    aux = eng.target_forward(ids, pos, pos, mask)[1]
    hs = eng.fuse(aux)
    h = hs[:1].clone()

    def verify():
        logits, _ = eng.target_forward(ids, pos, pos, mask)
        logits.argmax(-1)

    def token():
        eng.draft_token(h[0])

    def step():
        eng.draft_forward(ids[:1], h, pos[:1], pos[:1], mask[:1])

    def handoff():
        eng.draft_forward(ids, eng.fuse(aux), pos, pos, mask)

    return {
        name: _graph_us(fn, dev)
        for name, fn in (("verify", verify), ("token", token), ("step", step), ("handoff", handoff))
    }


def graph_pool_bytes(segments: list[dict], device_index: int | None) -> int:
    """Bytes of `torch.cuda.memory_snapshot()` segments on the device that belong to a private memory pool (a CUDA
    graph's, or one shared by graphs: `segment_pool_id` not (0, 0), the caching allocator's default pool)."""
    return sum(
        int(s["total_size"])
        for s in segments
        if (device_index is None or s.get("device", device_index) == device_index)
        and tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)
    )


def loop_timeline(run, dev) -> dict:
    """One call of `run` (a generate) under the profiler -> where the GPU's time went between its first and last
    device event: busy_frac (the union of kernels and copies over that span), the idle gaps over GAP_US (count, summed
    us: the host or a dependency kept the GPU waiting), the device-to-host copies (count, summed us). {} without CUDA
    events (the CPU, or a profiler that does not see a graph's kernels)."""
    from torch.profiler import ProfilerActivity, profile

    if dev.type != "cuda":
        return {}
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return timeline_stats(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )


def timeline_stats(events) -> dict:
    """`loop_timeline`'s reading of device events (start us, end us, name), overlapping or not: span, busy_frac (their
    union over the span), gaps / gap_us (idle stretches over GAP_US), dtoh / dtoh_us (device-to-host copies)."""
    evs = sorted(events)
    if not evs:
        return {}
    busy = gaps = gap_us = 0.0
    end = evs[0][0]
    for a, b, _ in evs:
        if a > end:
            if a - end > GAP_US:
                gaps += 1
                gap_us += a - end
            busy += b - a
        elif b > end:
            busy += b - end
        end = max(end, b)
    span = end - evs[0][0]
    dtoh = [b - a for a, b, n in evs if "DtoH" in n or "Device -> Pageable" in n or "Device -> Pinned" in n]
    return {
        "span_us": span,
        "busy_frac": busy / span,
        "gaps": gaps,
        "gap_us": gap_us,
        "dtoh": len(dtoh),
        "dtoh_us": sum(dtoh),
    }


# an idle stretch of the GPU longer than this (us) counts as a gap in `loop_timeline` (PDL and graph-internal launch
# latencies are ~1 us)
GAP_US = 3.0


@torch.no_grad()
def speed(t, d, prompts, config: str, settings, new_tokens: int, rows: list, loop_profile: bool = False) -> None:
    """End-to-end greedy decoding (`generate`, CUDA graphs) of every prompt with each setting and plainly, on one
    engine: tok/s (decode only), tau, and the prompts whose output differs from plain decoding's."""
    eng = make_engine(t, d, config)
    modes = [DecodeMode("plain")] + settings
    cuda = eng.device.type == "cuda"
    for m in modes:  # every graph before the timed runs: the rounds', and every length bucket's prefill
        eng.warmup(m, prefill=True)
    # the GPU memory the graphs hold: their private pools' segments (a reserved-memory delta across the warm-up also
    # counted what tuning and compiling left cached, and a run's first engine the process's first-use allocations)
    graph_mb = graph_pool_bytes(torch.cuda.memory_snapshot(), eng.device.index) / 1e6 if cuda else None
    log(f"speed {config}: {len(eng._graphs)} round graphs, {len(eng._pf_graphs)} prefill graphs, {graph_mb} MB")
    plain_out = {}
    for m in modes:
        key = name(m) if m.kind != "plain" else "plain"
        eng.generate(prompts[0], 16, mode=m)  # warm
        toks = secs = acc = rounds = differ = pre = units = 0
        for i, p in enumerate(prompts):
            r = eng.generate(p, new_tokens, mode=m)
            toks += max(len(r.token_ids) - 1, 0)
            secs += r.decode_s
            pre += r.prefill_s
            acc += sum(r.accepted) + len(r.accepted)
            rounds += len(r.accepted)
            units += r.rounds  # rounds, plain steps for plain decoding (and a round's cache-end fallback steps)
            if m.kind == "plain":
                plain_out[i] = r.token_ids
            else:
                differ += r.token_ids != plain_out[i]
        row = {"config": config, "setting": key, "tok_s": toks / secs, "tau": acc / rounds if rounds else 1.0}
        # with the prefill (time to first token) counted too: what `draftsmith eval`'s "tok/s" reports
        row["prefill_ms"] = 1e3 * pre / len(prompts)
        row["e2e_tok_s"] = (toks + len(prompts)) / (secs + pre)
        # a round's (a plain step's) wall time in generate: against the census's graph-replay time, what the host adds
        row["ms_per_round"] = 1e3 * secs / units if units else None
        row["differ"] = differ if m.kind != "plain" else None
        row["graph_mb"] = graph_mb
        if loop_profile:  # one more generation of prompt 0, profiled (not timed above)
            got = []
            tl = loop_timeline(lambda e=eng, m=m: got.append(e.generate(prompts[0], new_tokens, mode=m)), eng.device)
            n_units = max(got[0].rounds, 1) if got else 1
            row["gpu_busy"] = tl.get("busy_frac")
            row["gaps_per_round"] = tl["gaps"] / n_units if tl else None
            row["gap_us_per_round"] = tl["gap_us"] / n_units if tl else None
            row["dtoh_us_per_round"] = tl["dtoh_us"] / n_units if tl else None
        rows.append(row)
        log(f"speed {config} {key}: {row['tok_s']:.0f} tok/s, tau {row['tau']:.2f}, differ {row['differ']}")
    del eng
    torch.cuda.empty_cache()


def certificate(t, prompts, dev, new_tokens: int, rows: list) -> None:
    from decode_helpers import overfit_drafter_ttt

    from draftsmith.decode.evaluate import run_eval
    from draftsmith.drafter import Drafter
    from draftsmith.target_model import load_target

    t32 = load_target(str(ARGS.target), dtype="fp32", device=str(dev))
    torch.manual_seed(0)
    d = Drafter.from_target(t32, draft_vocab_size=8192).to(dev)
    eng32 = SpeculativeDecoder(t32, d, max_len=512)
    seqs = [p + eng32.generate(p, new_tokens, mode=DecodeMode("plain")).token_ids for p in prompts]
    overfit_drafter_ttt(eng32, d, seqs, steps=150, ttt_steps=5)
    del eng32, t32
    d16 = copy.deepcopy(d).to(torch.bfloat16).eval()
    d16.set_embedding(t.model.get_input_embeddings().weight)
    d16.requires_grad_(False)
    for kernels in ("torch", "triton"):
        eng = SpeculativeDecoder(t, d16, max_len=512, kernels=kernels)
        for m in (DecodeMode("chain", draft_tokens=4), DecodeMode("tree", top_k=8, depth=6, tree_tokens=48)):
            e = run_eval(eng, prompts, m, [0.0], new_tokens)["temperatures"]["0"]
            gd = e["greedy_divergences"]
            rows.append(
                {
                    "kernels": kernels,
                    "setting": name(m),
                    **gd,
                    "max_real_gap": max(
                        (x["plain_gap"] or 0 for x in e["greedy_divergence_details"] if x["kind"] == "real"),
                        default=None,
                    ),
                }
            )
            log(f"certificate {kernels} {name(m)}: {gd}")
        del eng


def main() -> None:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True, help="pycode-small directory")
    ap.add_argument("--prompts", required=True, help="humaneval.jsonl (EAGLE question format)")
    ap.add_argument("--settings", default="chain2,chain3,chain4,tree4/4/16,tree8/6/48")
    ap.add_argument("--configs", default="torch,triton+compile")
    ap.add_argument(
        "--tau",
        default="chain4=3.38,tree8/6/48=5.20",
        help="setting=tau for the projection (default: issue 16's measurement, trained drafter)",
    )
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument(
        "--no-parts", action="store_true", help="census: skip timing a chain round's parts (verify, drafting, hand-off)"
    )
    ap.add_argument("--cert-prompts", type=int, default=16)
    ap.add_argument("--cert-tokens", type=int, default=96)
    ap.add_argument("--sections", default="census,certificate", help="census, speed, certificate")
    ap.add_argument(
        "--drafter", type=Path, help="a drafter trained for the target (speed section; census: its weights)"
    )
    ap.add_argument("--speed-prompts", type=int, default=24)
    ap.add_argument("--speed-tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a quick check of the code paths")
    ap.add_argument(
        "--loop-profile",
        action="store_true",
        help="speed section: profile one more generation per setting and report the GPU's idle gaps and "
        "device-to-host copies per round (gpu_busy, gaps_per_round, gap_us_per_round, dtoh_us_per_round); the "
        "profiler slows the host, so the gaps are upper bounds (plain decoding read 0.55-0.68 busy under it)",
    )
    ARGS = a = ap.parse_args()
    dev = torch.device(a.device)
    from draftsmith.drafter import Drafter
    from draftsmith.target_model import load_target

    t = load_target(str(a.target), dtype="bf16", device=str(dev))
    prompts = DB.humaneval_prompts(a.prompts, t.tokenizer, max(a.cert_prompts, a.speed_prompts, 1))
    torch.manual_seed(0)
    if a.drafter:
        d = Drafter.from_pretrained(str(a.drafter)).to(device=dev, dtype=torch.bfloat16).eval()
        d.set_embedding(t.model.get_input_embeddings().weight)
    else:
        d = Drafter.from_target(t, draft_vocab_size=8192).to(device=dev, dtype=torch.bfloat16).eval()
    d.requires_grad_(False)
    bw = common.measure_copy_bandwidth(1.0) if dev.type == "cuda" else float("inf")
    taus = {k: float(v) for k, v in (x.split("=") for x in a.tau.split(",") if x)}
    settings = [parse_setting(s) for s in a.settings.split(",")]
    rows, cert, errors = [], [], {}
    configs = []  # a config repeated in --configs is labelled "#2", "#3" (its own rows)
    for c in a.configs.split(","):
        n = sum(1 for x in configs if x.split("#")[0] == c)
        configs.append(c if n == 0 else f"{c}#{n + 1}")
    if "census" in a.sections:
        for config in configs:
            try:
                census(t, d, prompts[0], config, settings, a.replays, dev, taus, bw, rows, parts=not a.no_parts)
            except Exception as e:  # noqa: BLE001
                errors[config] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
    spd = []
    if "speed" in a.sections:
        for config in configs:
            try:
                speed(t, d, prompts[: a.speed_prompts], config, settings, a.speed_tokens, spd, a.loop_profile)
            except Exception as e:  # noqa: BLE001
                errors[f"speed {config}"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
        fastest = max((r["tok_s"] for r in spd if r["setting"] == "plain"), default=None)
        for r in spd:
            own = next(x["tok_s"] for x in spd if x["config"] == r["config"] and x["setting"] == "plain")
            r["x_own_plain"] = r["tok_s"] / own
            r["x_fastest_plain"] = r["tok_s"] / fastest
            cen = next((x for x in rows if x["config"] == r["config"] and x["setting"] == r["setting"]), None)
            if cen is not None and r["ms_per_round"]:  # both sections in this run: the host's share of a round
                r["x_census"] = r["ms_per_round"] / cen["ms"]
    if "certificate" in a.sections:
        try:
            certificate(t, prompts[: a.cert_prompts], dev, a.cert_tokens, cert)
        except Exception as e:  # noqa: BLE001
            errors["certificate"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
    body = []
    if rows:
        body += [
            f"Round census, {a.target.name} (bf16, bs=1, CUDA graphs), drafter {a.drafter or 'random'} (timings do "
            f"not depend on its weights); prompt 0 of {a.prompts}; {a.replays} replays each. Projected = tau x "
            "t_plain / t_round with tau from --tau (not measured here). floor = (target weights + K x drafter "
            "weights) / copy bandwidth.",
            "",
            common.markdown_table(
                rows,
                [
                    "config",
                    "setting",
                    "ms",
                    "plain_steps",
                    "kernels",
                    "busy",
                    "by_kind",
                    "floor_ms",
                    "tau",
                    "projected_speedup",
                ],
            ),
        ]
    parts_rows = [
        {
            "config": r["config"],
            "setting": r["setting"],
            "round_us": round(r["ms"] * 1e3, 1),
            **r["parts_us"],
            **{f"{k}_ps": v for k, v in r["parts_plain_steps"].items()},
        }
        for r in rows
        if r.get("parts_us")
    ]
    if parts_rows:
        body += [
            "",
            "Where a chain round's time goes: its parts timed one by one through the engine's public forwards, each "
            "replayed from a CUDA graph of its own (eager kernels, outside the round's trace): verify = target "
            "forward over K+1 rows + argmax; token = the drafter's lm_head + argmax + id map; step = a one-row "
            "drafter forward (a round: K tokens, K-1 steps); handoff = fc + drafter forward over K+1 rows; rest = the "
            "round minus those (acceptance, the emitted buffer, and what tracing the round whole saves or adds). "
            "us, and *_ps in plain steps.",
            "",
            common.markdown_table(
                parts_rows,
                [
                    "config",
                    "setting",
                    "round_us",
                    "verify",
                    "token",
                    "step",
                    "handoff",
                    "rest",
                    "verify_ps",
                    "drafting_ps",
                    "handoff_ps",
                    "rest_ps",
                ],
            ),
        ]
    for r in rows:
        if r.get("tiles"):
            body.append(f"\n{r['config']} tiles: " + "; ".join(f"{k} {v}" for k, v in r["tiles"].items()))
    if spd:
        body += [
            "",
            f"Measured end to end (`generate`, greedy, CUDA graphs): {a.speed_prompts} prompts x {a.speed_tokens} new "
            f"tokens, drafter {a.drafter or 'random'}; x_fastest_plain = tok/s over the fastest plain engine's of this "
            "run; differ = prompts whose output is not plain decoding's (bf16 near ties: see the certificate); every "
            "graph (rounds, each length bucket's prefill) captured before the timed runs, graph_mb the GPU memory they "
            "took (the engine's, the same on each of its rows).",
            "",
            common.markdown_table(
                spd,
                [
                    "config",
                    "setting",
                    "tok_s",
                    "tau",
                    "differ",
                    "x_own_plain",
                    "x_fastest_plain",
                    "prefill_ms",
                    "e2e_tok_s",
                    "ms_per_round",
                    "x_census",
                    "graph_mb",
                ]
                + (["gpu_busy", "gaps_per_round", "gap_us_per_round", "dtoh_us_per_round"] if a.loop_profile else []),
            ),
        ]
    if cert:
        body += [
            "",
            f"bf16 greedy certificate: {len(prompts[: a.cert_prompts])} HumanEval prompts x {a.cert_tokens} "
            "new tokens, T=0, a drafter overfit on these prompts' greedy outputs (tau inflated: not a result), "
            "default engine (CUDA graphs), kernels torch / triton (no compile):",
            "",
            common.markdown_table(cert, ["kernels", "setting", "equal", "near_tie", "real", "epsilon", "max_real_gap"]),
        ]
    if errors:
        body += ["", "errors: " + json.dumps(errors)]
    common.record(
        "decode_small",
        "Decode: small-target round census and bf16 certificate (issue 16)",
        "\n".join(body),
        {"census": rows, "speed": spd, "certificate": cert, "errors": errors},
        "python bench/decode_small.py " + " ".join(sys.argv[1:]),
    )


if __name__ == "__main__":
    main()
