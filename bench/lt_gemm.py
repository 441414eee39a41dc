"""The 8B verify's matmuls through each of cuBLASLt's candidate algorithms, against torch's mm (cuBLAS's pick).

Why: at 49 rows cuBLAS's kernels reach ~0.7 of copy bandwidth on q/k/v and o (BENCHMARKS.md, the 8B `--anatomy`);
its heuristic ranks many algorithms (tiles, split-K, cluster shapes) and torch runs the first. If one of the others
streams the weights faster, `draftsmith.decode.experimental.cublaslt.LtLinear` can run it in the verify.

Each (kind, rows): L copies of the weights (> 400 MB together, so every call reads HBM as a verify layer does), one
CUDA graph of R passes over them per algorithm, replayed; us a call and the fraction of copy bandwidth (weights + x +
out bytes). Every candidate's output is checked against torch's (max |diff|; split-K sums in another order).

    python bench/lt_gemm.py                 # H200, ~30 s
    python bench/lt_gemm.py --rows 8,49,64 --kinds qkv,o
    python bench/lt_gemm.py --search --kinds qkv,o   # + configurations the heuristic does not list (LtLinear.search)

`--search`: beyond the heuristic's list, cuBLASLt takes any configuration its algorithms support (tile, split-K and
its reduction, cluster shape, stages, custom option) that `cublasLtMatmulAlgoCheck` accepts; TensorRT-LLM keeps a
table of such hand-picked configurations for few-row bf16 GEMMs because the heuristic's picks are weak there. The
searched ones are timed too (at most --search-max, spread over the list), and the best bit-equal one is reported
apart (what `tune_lt` could use: split-K sums in another order).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402

KINDS = common.LLAMA_8B_MATMULS


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="49", help="forward widths (tokens), comma-separated")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"weight kinds ({', '.join(KINDS)})")
    ap.add_argument("--passes", type=int, default=3, help="passes over the copies in one graph")
    ap.add_argument("--max-algos", type=int, default=64, help="candidates asked of cuBLASLt's heuristic")
    ap.add_argument("--top", type=int, default=4, help="fastest candidates listed per row")
    ap.add_argument("--search", action="store_true", help="also time configurations near the heuristic's (see above)")
    ap.add_argument("--search-max", type=int, default=600, help="searched configurations timed per row, at most")
    ap.add_argument(
        "--search-budget", type=int, default=50_000, help="cublasLtMatmulAlgoCheck calls per row (LtLinear.search)"
    )
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("lt_gemm: needs a CUDA device")
        return 1
    from draftsmith.decode.experimental.cublaslt import LtLinear
    from draftsmith.decode.kernels import _time_graph

    torch.manual_seed(0)
    bw = common.measure_copy_bandwidth()
    rows_out, notes = [], []
    for kind in args.kinds.split(","):
        n, k = KINDS[kind]
        wbytes = n * k * 2
        ws = common.weight_copies(n, k)
        copies = len(ws)
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            calls = copies * args.passes
            nbytes = wbytes + (m * k + m * n) * 2

            t_torch = common.time_torch_mm(x, ws, out, args.passes)
            ref = x @ ws[0].t()
            lt = LtLinear(m, n, k, max_algos=args.max_algos)
            order = list(range(len(lt.algos)))
            if args.search:
                t0 = time.perf_counter()
                added = lt.search(budget=args.search_budget)
                searched = list(range(lt.n_heuristic, len(lt.algos)))
                step = max(1, math.ceil(len(searched) / args.search_max))
                order += searched[::step]
                notes.append(
                    f"{kind} M={m}: search {lt.search_checks} checks in {time.perf_counter() - t0:.1f} s, {added} "
                    f"valid configurations beyond the heuristic's {lt.n_heuristic}, {len(searched[::step])} timed"
                )
            timed = []
            for i in order:
                info = lt.algos[i]
                try:
                    got = lt(x, ws[0], algo=i)
                    torch.cuda.synchronize()
                except RuntimeError as e:
                    notes.append(f"{kind} M={m} {info.label()}: {e}")
                    continue
                err = (got.float() - ref.float()).abs().max().item()

                def lt_fn(i=i):
                    for _ in range(args.passes):
                        for w in ws:
                            lt(x, w, out, algo=i)

                us, why = _time_graph(lt_fn, calls, 10)
                if us is None:
                    notes.append(f"{kind} M={m} {info.label()}: graph failed ({why})")
                    continue
                timed.append((us, info, err))
            timed.sort(key=lambda t: t[0])
            first = next((t for t in timed if t[1].index == 0), None)
            equal = next((t for t in timed if t[2] == 0.0), None)  # bit-equal to torch's output
            row = {
                "kind": kind,
                "rows": m,
                "torch us": f"{t_torch:.2f}",
                "torch bw": f"{nbytes / t_torch * 1e6 / bw:.3f}",
                "lt #0 us": f"{first[0]:.2f}" if first else "-",
                "candidates": len(lt.algos),
                "best us": f"{timed[0][0]:.2f}",
                "best bw": f"{nbytes / timed[0][0] * 1e6 / bw:.3f}",
                "best/torch": f"{timed[0][0] / t_torch:.3f}",
                "best bit-equal": f"{equal[1].label()} {equal[0]:.2f}us" if equal else "-",
                "fastest": "; ".join(f"{t[1].label()} {t[0]:.2f}us err{t[2]:.1e}" for t in timed[: args.top]),
            }
            rows_out.append(row)
            print(row, flush=True)
        ws.clear()
        torch.cuda.empty_cache()
    cols = [
        "kind",
        "rows",
        "torch us",
        "torch bw",
        "lt #0 us",
        "candidates",
        "best us",
        "best bw",
        "best/torch",
        "best bit-equal",
        "fastest",
    ]
    table = common.markdown_table(rows_out, cols)
    body = (
        table + f"\n\nCopy bandwidth {bw / 1e9:.0f} GB/s (read + write). bw = (weights + x + out bytes) / time / copy "
        "bandwidth. `tile`, `sk` (split-K), `st` (stages), `reduction`, `custom`, `cluster`, `swizzle` (when not 0) "
        "are cuBLASLt's config attributes of the algorithm, `w` its wave count, `#Ns` a configuration found by "
        "--search; err the max |diff| against torch's output." + "".join(f"\n- note: {line}" for line in notes)
    )
    if args.no_append:
        print(body)
    else:
        common.record("lt_gemm", "Decode: the 8B verify's matmuls through cuBLASLt's candidate algorithms", body,
                      {"rows": rows_out, "notes": notes, "copy_bw": bw}, " ".join(sys.argv))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
