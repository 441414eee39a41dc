"""Op census of decode steps (CPU proxy for kernels per CUDA-graph replay).

    python bench/decode_ops.py --target PATH [--modes plain,chain3,tree8/5/32] [--timing 1,2]

A bs=1 decode step replayed from a CUDA graph is launch-bound for small targets, so the number of kernels a round
launches is its cost. On CPU we count the non-view aten ops one round dispatches (a CUDA-graph replay launches
about one kernel per such op; fused ops such as `F.rms_norm` count as several here, one on CUDA), split by who
issues them: the target forward, the drafter forwards, the drafter logits, and the round's own bookkeeping.
The numbers in docs/LOG.md come from this script. Random drafter: op counts do not depend on its weights.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository on sys.path; tables, BENCHMARKS.md)
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

VIEWS = {
    "view",
    "_unsafe_view",
    "expand",
    "slice",
    "select",
    "t",
    "transpose",
    "unsqueeze",
    "squeeze",
    "permute",
    "alias",
    "split",
    "unbind",
    "detach",
    "as_strided",
    "split_with_sizes",
    "chunk",
    "reshape",
}


class _Census(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.by = collections.Counter()
        self.ops = collections.Counter()
        self.tag = "bookkeeping"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.by[self.tag] += 1
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def parse_mode(s: str):
    from draftsmith.decode import DecodeMode

    if s == "plain":
        return DecodeMode("plain")
    if s.startswith("chain"):
        return DecodeMode("chain", draft_tokens=int(s[5:]))
    if s.startswith("tree"):
        k, d, n = (int(x) for x in s[4:].split("/"))
        return DecodeMode("tree", top_k=k, depth=d, tree_tokens=n)
    raise SystemExit(f"--modes: unknown {s!r} (plain, chainK, treeK/D/N)")


def census(target_path: str, modes: list[str], draft_vocab: int = 2048) -> list[dict]:
    from draftsmith.decode import SpeculativeDecoder
    from draftsmith.decode.sampling import SamplingParams
    from draftsmith.drafter import Drafter
    from draftsmith.target_model import load_target

    t = load_target(target_path, dtype="fp32", device="cpu")
    torch.manual_seed(0)
    eng = SpeculativeDecoder(t, Drafter.from_target(t, draft_vocab_size=draft_vocab), max_len=256)
    c = _Census()
    for name, tag in (("_target", "target"), ("_draft_fwd", "drafter forward"), ("_draft_logits", "drafter logits")):
        fn = getattr(eng, name)

        def tagged(*a, _fn=fn, _tag=tag, **k):
            old, c.tag = c.tag, _tag
            try:
                return _fn(*a, **k)
            finally:
                c.tag = old

        setattr(eng, name, tagged)
    prompt = list(range(5, 25))
    sp = SamplingParams()
    rows = []
    for m in modes:
        mode = parse_mode(m)
        eng.prefill(prompt, sp)
        step = eng.eager_step_fn(mode, sp)
        step()  # first call: one-time work outside the measured round
        c.by.clear()
        c.ops.clear()
        with torch.no_grad(), c:
            step()
        rows.append({"mode": m, "total": sum(c.by.values()), **dict(c.by), "top": c.ops.most_common(6)})
    return rows


@torch.no_grad()
def timing(
    target_path: str, modes: list[str], threads: int, new_tokens: int = 200, reps: int = 3, draft_vocab: int = 4096
) -> list[dict]:
    """CPU wall time of a round (through `generate`, fp32) split by who spends it: the target forward, the drafter
    forwards (draft steps + hand-off), the drafter logits, and the rest (the round's bookkeeping, the fc over the
    aux states, generate's loop). Best of `reps` runs per mode; a random drafter (the cost does not depend on it)."""
    import time

    from draftsmith.decode import SpeculativeDecoder
    from draftsmith.drafter import Drafter
    from draftsmith.target_model import load_target

    torch.set_num_threads(threads)
    t = load_target(target_path, dtype="fp32", device="cpu")
    torch.manual_seed(0)
    n = int(t.config.num_hidden_layers)
    aux = [1, n // 2, n - 2]  # three distinct layers, as the demo's drafter (pycode-tiny: 1, 3, 4)
    eng = SpeculativeDecoder(t, Drafter.from_target(t, aux_layer_ids=aux, draft_vocab_size=draft_vocab), max_len=1024)
    spent = collections.Counter()
    for name in ("_target", "_draft_fwd", "_draft_logits"):
        fn = getattr(eng, name)

        def timed(*a, _fn=fn, _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                spent[_name] += time.perf_counter() - t0

        setattr(eng, name, timed)
    prompt = t.tokenizer("def fib(n):\n    if n < 2:\n        return n\n")["input_ids"]
    rows, plain_ms = [], None
    for m in modes:
        mode = parse_mode(m)
        eng.generate(prompt, 16, mode=mode)
        best = None
        for _ in range(reps):
            spent.clear()
            r = eng.generate(prompt, new_tokens, mode=mode)
            per = 1e3 * r.decode_s / r.rounds
            if best is None or per < best[0]:
                best = (per, {k: 1e3 * v / r.rounds for k, v in spent.items()})
        per, parts = best
        plain_ms = per if mode.kind == "plain" else plain_ms
        rows.append(
            {
                "threads": threads,
                "mode": m,
                "round_ms": per,
                "plain_steps": per / plain_ms if plain_ms else None,
                "target_ms": parts.get("_target", 0.0),
                "drafter_forward_ms": parts.get("_draft_fwd", 0.0),
                "drafter_logits_ms": parts.get("_draft_logits", 0.0),
                "rest_ms": per - sum(parts.values()),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="an HF Llama-family model directory (e.g. pycode-small)")
    ap.add_argument("--modes", default="plain,chain3,tree8/5/32")
    ap.add_argument(
        "--timing",
        default=None,
        metavar="THREADS",
        help="also time a round on the CPU by component, e.g. '1,2' threads (put plain first in --modes); "
        "appends the table to BENCHMARKS.md",
    )
    a = ap.parse_args()
    if a.timing:
        trows = [r for n in a.timing.split(",") for r in timing(a.target, a.modes.split(","), int(n))]
        cols = [
            "threads",
            "mode",
            "round_ms",
            "plain_steps",
            "target_ms",
            "drafter_forward_ms",
            "drafter_logits_ms",
            "rest_ms",
        ]
        body = (
            "Round wall time on the CPU by component (fp32, random drafter, 200 new tokens through `generate`, best "
            "of 3). plain_steps = the break-even tau of the setting: speedup = tau / plain_steps.\n\n"
            + common.markdown_table(trows, cols)
        )
        common.record(
            "decode_ops_cpu",
            f"Decode on the CPU: where a round's time goes ({Path(a.target).name})",
            body,
            {"rows": trows},
            "python bench/decode_ops.py " + " ".join(sys.argv[1:]),
        )
    rows = census(a.target, a.modes.split(","))
    cols = ["mode", "total", "target", "drafter forward", "drafter logits", "bookkeeping"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(k, 0)) for k in cols) + " |")
    for r in rows:
        print(f"{r['mode']}: most frequent {r['top']}")


if __name__ == "__main__":
    main()
