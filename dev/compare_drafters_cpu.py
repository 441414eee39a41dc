"""Experiment (issue 18): several drafters of the demo target side by side on the CPU, in one process, interleaved
prompt by prompt (plain, then chain K for each K, for each drafter), so the machine's drift hits all alike; prints
τ and the speedup over the same engine's plain decoding (median, min, max over the passes). Greedy outputs are
asserted equal to plain decoding.

    python dev/compare_drafters_cpu.py DRAFTER_A,DRAFTER_B [Ks=3,4] [passes=5]
"""

from __future__ import annotations

import statistics
import sys

import torch

sys.path.insert(0, ".")
from draftsmith.decode.engine import DecodeMode, SpeculativeDecoder
from draftsmith.decode.evaluate import load_prompt_ids
from draftsmith.drafter import Drafter
from draftsmith.target_model import load_target

names = sys.argv[1].split(",")
Ks = [int(k) for k in (sys.argv[2] if len(sys.argv) > 2 else "3,4").split(",")]
passes = int(sys.argv[3]) if len(sys.argv) > 3 else 5
t = load_target("assets/pycode-tiny", dtype="fp32", device="cpu")
prompts = load_prompt_ids("assets/demo_prompts.jsonl", t.tokenizer, raw=True)
engines = {}
for n in names:
    d = Drafter.from_pretrained(n, target=t).float().eval().requires_grad_(False)
    e = SpeculativeDecoder(t, d, max_len=max(len(p) for p in prompts) + 80)
    e.cpu_threads = 1
    engines[n] = e
torch.set_num_threads(1)
plain = DecodeMode("plain")
for e in engines.values():  # warm-up
    for p in prompts[:2]:
        e.generate(p, 64, mode=plain)
        for K in Ks:
            e.generate(p, 64, mode=DecodeMode("chain", draft_tokens=K))
speed: dict = {}
tau: dict = {}
for _ in range(passes):
    acc: dict = {}
    for p in prompts:
        for n, e in engines.items():
            rp = e.generate(p, 64, mode=plain)
            a = acc.setdefault((n, "plain"), [0, 0.0, 0])
            a[0] += len(rp.token_ids)
            a[1] += rp.prefill_s + rp.decode_s
            for K in Ks:
                r = e.generate(p, 64, mode=DecodeMode("chain", draft_tokens=K))
                assert r.token_ids == rp.token_ids, (n, K)
                a = acc.setdefault((n, K), [0, 0.0, 0])
                a[0] += len(r.token_ids)
                a[1] += r.prefill_s + r.decode_s
                a[2] += r.rounds
    for n in names:
        for K in Ks:
            s, pl = acc[(n, K)], acc[(n, "plain")]
            speed.setdefault((n, K), []).append((s[0] / s[1]) / (pl[0] / pl[1]))
            tau.setdefault((n, K), []).append((s[0] - len(prompts)) / s[2])  # the prefill's token is no round's
print("| drafter | K | τ | speedup median | min | max |\n|---|---|---|---|---|---|")
for n in names:
    for K in Ks:
        v = speed[(n, K)]
        print(
            f"| {n} | {K} | {statistics.median(tau[(n, K)]):.2f} | {statistics.median(v):.3f} | {min(v):.3f} | "
            f"{max(v):.3f} |"
        )
