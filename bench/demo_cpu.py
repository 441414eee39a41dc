"""Where a speculative round's time goes on CPU for the demo target (issue 18).

For assets/pycode-tiny (fp32, batch 1) times, per call, the engine's plain step and a chain round for several
--draft-tokens K, split into the round's parts (K drafter steps, one K+1-token target verify, the drafter
hand-off), at 1 and 2 threads. The break-even acceptance length of a setting is t_round / t_plain: a drafter must
reach τ above it for speculation to win; speedup = τ · t_plain / t_round.

Usage:  python bench/demo_cpu.py [--drafter DIR] [--threads 1,2] [--context 128] [--reps 200]
Without --drafter an untrained drafter of the demo shape is timed (time per call does not depend on acceptance).
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="assets/pycode-tiny")
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--context", type=int, default=64, help="committed tokens before the timed steps")
    ap.add_argument(
        "--max-len",
        type=int,
        default=160,
        help="the engine's cache capacity: the masks and attention "
        "span it (eval sizes it to the longest prompt + --max-new-tokens + a round)",
    )
    ap.add_argument("--draft-tokens", default="1,2,3,4,6")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()

    from draftsmith.decode.engine import DecodeMode, SpeculativeDecoder
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
    sp = SamplingParams()
    rows = []
    for threads in [int(x) for x in args.threads.split(",")]:
        torch.set_num_threads(threads)
        eng = SpeculativeDecoder(t, d, max_len=max(args.max_len, args.context + 16))
        prompt = list(range(2, 2 + args.context))
        with torch.no_grad():
            eng.prefill(prompt, sp)
            L0 = eng.L.clone()

            def plain():
                eng.L.copy_(L0)
                eng._plain_step(sp)

            t_plain = _time(plain, args.reps)
            # parts of a round, each as the round runs them
            H = eng.h_last.clone()

            def draft_step():
                p = L0.view(1)
                eng._draft_fwd(eng.root.view(1), H.view(1, -1), p, p, eng._mask(p))

            def draft_logits():
                torch.argmax(eng._draft_logits(H), -1)

            t_dstep, t_dlog = _time(draft_step, args.reps), _time(draft_logits, args.reps)
            rows.append({"threads": threads, "what": "plain step (1 token)", "ms": 1e3 * t_plain})
            rows.append({"threads": threads, "what": "drafter step (1 token, no logits)", "ms": 1e3 * t_dstep})
            rows.append({"threads": threads, "what": "drafter logits + argmax", "ms": 1e3 * t_dlog})
            for K in [int(x) for x in args.draft_tokens.split(",")]:
                mode = DecodeMode("chain", draft_tokens=K)
                ids = torch.arange(2, 3 + K)
                pos = L0 + torch.arange(K + 1)

                def verify():
                    eng._target(ids, pos, pos, eng._mask(pos))

                def handoff():
                    aux = torch.zeros(K + 1, len(eng.aux_layers) * int(t.config.hidden_size))
                    eng._handoff(ids, aux, torch.tensor(K))

                def round_():
                    eng.L.copy_(L0)
                    eng.h_last.copy_(H)
                    eng._chain_round(mode, sp)

                t_ver, t_hand, t_round = _time(verify, args.reps), _time(handoff, args.reps), _time(round_, args.reps)
                rows.append({"threads": threads, "what": f"chain K={K}: verify ({K + 1} tokens)", "ms": 1e3 * t_ver})
                rows.append({"threads": threads, "what": f"chain K={K}: hand-off ({K + 1} tokens)", "ms": 1e3 * t_hand})
                rows.append(
                    {
                        "threads": threads,
                        "what": f"chain K={K}: whole round",
                        "ms": 1e3 * t_round,
                        "break_even_tau": t_round / t_plain,
                        "speedup_at_tau_3": 3 * t_plain / t_round,
                    }
                )
    body = markdown_table(rows, ["threads", "what", "ms", "break_even_tau", "speedup_at_tau_3"])
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
