"""What a bulk L2 prefetch of the next matmul's weights buys while latency-bound kernels run (the 8B verify's shapes).

Why: the 49-row verify spends ~25 us a layer in kernels that leave HBM idle (RoPE, attention, norms); the o projection
that follows reads 32 MB. `draftsmith.decode.experimental.l2_prefetch` asks L2 for them as RoPE starts. This measures
the mechanism outside an engine: per layer copy (enough copies that nothing survives in L2 from the last pass) a
sequence q/k/v matmul -> [prefetch] -> a window of W us (`torch.cuda._sleep` on one SM, standing for RoPE +
attention) -> o matmul -> gate/up matmul, one CUDA graph, us a layer. Rows: window x prefetch plan (in the stream,
or on a second stream beside the window; o's weights and/or the head of gate/up's; chunk sizes); `o hot` is the o matmul on one copy over and over (all in L2: the
floor a prefetch can reach), `o cold` over all copies.

    python bench/l2_prefetch.py                 # H200, ~40 s
    python bench/l2_prefetch.py --windows 0,10,20 --plans side:o:16:256:1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402

SHAPES = {k: common.LLAMA_8B_MATMULS[k] for k in ("qkv", "o", "gate_up")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=49, help="forward width (tokens)")
    ap.add_argument("--copies", type=int, default=4, help="layer copies (each ~317 MB: q/k/v, o, gate/up)")
    ap.add_argument("--windows", default="0,15", help="idle windows (us) between q/k/v and o, comma-separated")
    ap.add_argument(
        "--plans",
        default="inline:o:0:256:1,side:o:0:256:1,side:o:0:64:4,side:o:0:512:1,side:o:16:256:1,side:-:16:256:1,"
        "side:-:32:256:1",
        help="prefetch plans where:o-or-not:gate/up MB:chunk KB:chunks a program, comma-separated (inline: in the "
        "stream before the window; side: on a second stream beside it, joined before o)",
    )
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    from draftsmith.decode.experimental.l2_prefetch import l2_prefetch, supported
    from draftsmith.decode.kernels import _time_graph

    dev = torch.device("cuda")
    if not supported(dev):
        print("bulk L2 prefetch needs sm_90+ and triton")
        return 1
    torch.manual_seed(0)
    bw = common.measure_copy_bandwidth()
    m, n = args.rows, args.copies
    ws = [{k: torch.randn(*s, device=dev, dtype=torch.bfloat16) * 0.02 for k, s in SHAPES.items()} for _ in range(n)]
    x = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
    outs = {k: torch.empty(m, s[0], device=dev, dtype=torch.bfloat16) for k, s in SHAPES.items()}
    o_bytes = SHAPES["o"][0] * SHAPES["o"][1] * 2
    side = torch.cuda.Stream()

    # the sleep kernel's cycles per microsecond, from one graph of it
    per_us, _ = _time_graph(lambda: torch.cuda._sleep(100_000), 1, 5)
    cycles_us = 100_000 / per_us

    def layer_seq(window_us: float, plan: tuple | None):
        def run():
            main = torch.cuda.current_stream()
            for w in ws:
                torch.mm(x, w["qkv"].t(), out=outs["qkv"])
                if plan is not None:
                    where, with_o, gu_mb, chunk_kb, per = plan
                    ts, nb = ([w["o"]], [o_bytes]) if with_o else ([], [])
                    if gu_mb:
                        ts, nb = ts + [w["gate_up"]], nb + [gu_mb << 20]
                    if where == "side":
                        side.wait_stream(main)
                        with torch.cuda.stream(side):
                            l2_prefetch(ts, nb, pdl=False, chunk=chunk_kb << 10, per_program=per)
                    else:
                        l2_prefetch(ts, nb, chunk=chunk_kb << 10, per_program=per)
                if window_us > 0:
                    torch.cuda._sleep(int(window_us * cycles_us))
                if plan is not None and plan[0] == "side":
                    main.wait_stream(side)
                torch.mm(x, w["o"].t(), out=outs["o"])
                torch.mm(x, w["gate_up"].t(), out=outs["gate_up"])

        return run

    def only(kind: str, hot: bool):
        def run():
            for w in ws:
                torch.mm(x, (ws[0] if hot else w)[kind].t(), out=outs[kind])

        return run

    rows, notes = [], []
    o_cold, _ = _time_graph(only("o", False), n, 10)
    o_hot, _ = _time_graph(only("o", True), n, 10)
    gu_cold, _ = _time_graph(only("gate_up", False), n, 10)
    notes.append(
        f"o alone: cold {o_cold:.2f} us ({o_bytes / o_cold * 1e6 / bw:.3f} of copy bandwidth), hot (one copy, in L2) "
        f"{o_hot:.2f} us; gate/up alone cold {gu_cold:.2f} us; sleep calibration {cycles_us:.0f} cycles/us"
    )
    plans = []
    for item in args.plans.split(","):
        where, what, gu_mb, chunk_kb, per = item.split(":")
        plans.append((where, what == "o", int(gu_mb), int(chunk_kb), int(per)))
    for win in [float(v) for v in args.windows.split(",")]:
        t0, _ = _time_graph(layer_seq(win, None), n, 10)
        rows.append({"window us": win, "prefetch": "none", "layer us": t0, "saved us": 0.0})
        for plan in plans:
            where, with_o, gu_mb, chunk_kb, per = plan
            label = (
                f"{where}: "
                + " + ".join((["o"] if with_o else []) + ([f"gate/up {gu_mb} MB"] if gu_mb else []))
                + f" ({chunk_kb} KB x {per} a program)"
            )
            t, why = _time_graph(layer_seq(win, plan), n, 10)
            rows.append(
                {
                    "window us": win,
                    "prefetch": label if t is not None else f"{label} ({why})",
                    "layer us": t if t is not None else "-",
                    "saved us": (t0 - t) if t is not None else "-",
                }
            )
            print(rows[-1], flush=True)
    table = common.markdown_table(rows, ["window us", "prefetch", "layer us", "saved us"])
    body = (
        table + f"\n\n{m} rows; a layer = q/k/v matmul, [prefetch], a sleep of `window` us, o matmul, gate/up matmul "
        f"(torch.mm; a side-stream prefetch runs beside the sleep and joins before o), {n} layer copies in one CUDA graph; saved = the same window without a prefetch minus this. Copy "
        f"bandwidth {bw / 1e9:.0f} GB/s." + "".join(f"\n- note: {line}" for line in notes)
    )
    if args.no_append:
        print(body)
    else:
        common.record("l2_prefetch", "Decode: a bulk L2 prefetch of the o projection during the attention's window",
                      body, {"rows": rows, "notes": notes, "copy_bw": bw}, " ".join(sys.argv))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
