"""Where a speculative round's time goes on CPU for the demo target (issue 18).

For assets/pycode-tiny (fp32, batch 1), at each thread count:
- the parts of a chain round, per call, as the round runs them: the engine's plain step, a drafter step, the
  drafter's logits + argmax, the K+1-token verify (+ its argmax), the hand-off, and the whole round (`step_fn`:
  the CPU chain round, or with --generic the device-agnostic one every GPU runs, without the CPU's transposed
  weights and flat drafter step);
- the eval path: `generate()` over the demo prompts, plain and chain K back to back per prompt (what `draftsmith
  eval` times), as ms per decode round (decode_s / rounds: the host loop, emits and prefill-free), tokens/s of each
  and their ratio = the eval's speedup, median and spread over --passes passes.
`plain_steps` = ms / the plain step's ms (a round's break-even τ); the eval rows' `speedup` is the measured one.

Usage:  python bench/demo_cpu.py --drafter DIR [--threads 1,2] [--draft-tokens 3,4] [--passes 3] [--generic]
Without --drafter an untrained drafter of the demo shape is timed (the part rows do not depend on acceptance; the
eval rows then measure nothing useful and are skipped).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import markdown_table, record  # noqa: E402


def _time(fn, reps: int) -> float:
    """Seconds per call: the fastest of reps/10 blocks of 10 calls (a shared machine's other load only adds)."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(max(1, reps // 10)):
        t = time.perf_counter()
        for _ in range(10):
            fn()
        best = min(best, (time.perf_counter() - t) / 10)
    return best


def _generic(eng, on: bool) -> None:
    """Switch the engine between its CPU paths (transposed target weights, flat drafter step, host-side chain
    round) and the device-agnostic ones (what it ran before the CPU paths, and what a GPU runs)."""
    eng.set_cpu_paths(not on)


def _eval_path(eng, prompts, modes, max_new: int, passes: int):
    """Per mode: (per-pass plain tok/s, spec tok/s, plain ms/round, spec ms/round), τ, greedy-equal flag."""
    from draftsmith.decode.engine import DecodeMode

    plain = DecodeMode("plain")
    for m in modes:  # untimed: first-call costs, every prompt length
        for p in prompts:
            eng.generate(p, max_new, mode=m)
    for p in prompts:
        eng.generate(p, max_new, mode=plain)
    out = {}
    for m in modes:
        passes_ = []
        equal = True
        acc = []
        for _ in range(passes):
            agg = {"pn": 0, "pw": 0.0, "pd": 0.0, "pr": 0, "sn": 0, "sw": 0.0, "sd": 0.0, "sr": 0}
            acc = []
            for p in prompts:
                rp = eng.generate(p, max_new, mode=plain)
                rs = eng.generate(p, max_new, mode=m)
                equal &= rp.token_ids == rs.token_ids
                acc += rs.accepted
                for k, r in (("p", rp), ("s", rs)):
                    agg[k + "n"] += len(r.token_ids)
                    agg[k + "w"] += r.prefill_s + r.decode_s
                    agg[k + "d"] += r.decode_s
                    agg[k + "r"] += r.rounds
            passes_.append(agg)
        tau = (sum(acc) + len(acc)) / max(len(acc), 1)
        out[m] = (passes_, tau, equal)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="assets/pycode-tiny")
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--context", type=int, default=40, help="committed tokens before the timed part calls")
    ap.add_argument("--prompts", default="assets/demo_prompts.jsonl", help="the eval path's prompts (raw text)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--draft-tokens", default="2,3,4,5")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--passes", type=int, default=3, help="eval-path passes (median and spread reported)")
    ap.add_argument("--generic", action="store_true", help="also time the device-agnostic round (no CPU paths)")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()

    from draftsmith.decode.engine import DecodeMode, SpeculativeDecoder
    from draftsmith.decode.evaluate import load_prompt_ids
    from draftsmith.decode.sampling import SamplingParams
    from draftsmith.drafter import Drafter
    from draftsmith.target_model import load_target

    t = load_target(args.target, dtype="fp32", device="cpu")
    if args.drafter:
        d = Drafter.from_pretrained(args.drafter, target=t)
    else:
        n = int(t.config.num_hidden_layers)
        d = Drafter.from_target(t, aux_layer_ids=[1, n // 2, n - 2], draft_vocab_size=4096)
    d = d.float().eval().requires_grad_(False)
    prompts = load_prompt_ids(args.prompts, t.tokenizer, raw=True) if args.drafter else []
    Ks = [int(x) for x in args.draft_tokens.split(",")]
    max_len = max([len(p) for p in prompts] + [args.context]) + args.max_new_tokens + max(Ks) + 4
    sp = SamplingParams()
    rows = []
    paths = ["cpu", "generic"] if args.generic else ["cpu"]
    for threads in [int(x) for x in args.threads.split(",")]:
        eng = SpeculativeDecoder(t, d, max_len=max_len)
        eng.cpu_threads = threads  # the engine's own choice is what this table informs; time each setting
        for path in paths:
            _generic(eng, path == "generic")
            torch.set_num_threads(threads)

            def row(what, ms, **kw):
                rows.append({"threads": threads, "path": path, "what": what, "ms": ms, **kw})

            with torch.no_grad():
                eng.prefill(list(range(2, 2 + args.context)), sp)
                L0 = int(eng.L)
                L0_t = eng.L.clone()
                H = eng.h_last.clone()

                plain_step = eng.eager_step_fn(DecodeMode("plain"), sp)

                def plain():
                    eng.L.copy_(L0_t)
                    plain_step()

                t_plain = _time(plain, args.reps)
                p1 = torch.arange(L0, L0 + 1)
                m1 = eng.mask(p1)

                def draft_step():
                    eng.draft_forward(eng.root.view(1), H.view(1, -1), p1, p1, m1)

                def draft_logits():
                    torch.argmax(eng.draft_logits(H), -1)

                row("plain step (1 token)", 1e3 * t_plain, plain_steps=1.0)
                row("drafter step (1 token, no logits)", 1e3 * _time(draft_step, args.reps))
                row("drafter logits + argmax", 1e3 * _time(draft_logits, args.reps))
                for K in Ks:
                    mode = DecodeMode("chain", draft_tokens=K)
                    ids = torch.arange(2, 3 + K)
                    pos = torch.arange(L0, L0 + K + 1)
                    mk = eng.mask(pos)
                    aux = torch.zeros(K + 1, len(eng.aux_layers) * int(t.config.hidden_size))

                    def verify():
                        torch.argmax(eng.target_forward(ids, pos, pos, mk)[0], -1)

                    def handoff():  # all K+1 rows: every draft accepted (the CPU round forwards a+1)
                        eng.draft_forward(ids, eng.fuse(aux), pos, pos, mk)

                    step = eng.eager_step_fn(mode, sp)

                    def round_():
                        eng.L.copy_(L0_t)
                        eng.h_last.copy_(H)
                        step()

                    t_round = _time(round_, args.reps)
                    row(f"chain K={K}: verify ({K + 1} tokens) + argmax", 1e3 * _time(verify, args.reps))
                    row(f"chain K={K}: hand-off ({K + 1} tokens)", 1e3 * _time(handoff, args.reps))
                    row(f"chain K={K}: whole round", 1e3 * t_round, plain_steps=t_round / t_plain)
                if prompts:
                    res = _eval_path(
                        eng,
                        prompts,
                        [DecodeMode("chain", draft_tokens=K) for K in Ks],
                        args.max_new_tokens,
                        args.passes,
                    )
                    for m, (ps, tau, equal) in res.items():
                        ratios = [(a["sn"] / a["sw"]) / (a["pn"] / a["pw"]) for a in ps]
                        plain_ms = statistics.median([1e3 * a["pd"] / a["pr"] for a in ps])
                        spec_ms = statistics.median([1e3 * a["sd"] / a["sr"] for a in ps])
                        row(f"eval path: plain, per step (chain K={m.draft_tokens}'s pass)", plain_ms, plain_steps=1.0)
                        row(
                            f"eval path: chain K={m.draft_tokens}, per round",
                            spec_ms,
                            plain_steps=spec_ms / plain_ms,
                            tau=tau,
                            speedup=statistics.median(ratios),
                            spread=f"{min(ratios):.3f}-{max(ratios):.3f}",
                            greedy_equal=equal,
                        )
        _generic(eng, False)
    cols = ["threads", "path", "what", "ms", "plain_steps", "tau", "speedup", "spread", "greedy_equal"]
    body = markdown_table(rows, cols) + (
        "\n\nms: the part rows are the fastest of 10-call blocks at "
        f"{args.context} tokens of context; the eval rows are decode_s / rounds over the demo prompts "
        f"({args.max_new_tokens} new tokens), median of {args.passes} passes with plain and speculative decoding "
        "back to back per prompt; speedup = speculative / plain tokens/s (prefill included, as `draftsmith eval` "
        "reports it), spread = min-max over the passes. path cpu = the engine's CPU paths (transposed target "
        "weights, `CpuDraftStep`, `_chain_round_cpu`); generic = the device-agnostic round a GPU runs."
    )
    print(body)
    if not args.no_record:
        record(
            "demo_cpu",
            "Demo target on CPU: speculative round cost vs plain step (pycode-tiny, fp32)",
            body,
            {"rows": rows},
            "python bench/demo_cpu.py " + " ".join(sys.argv[1:]),
        )


if __name__ == "__main__":
    main()
