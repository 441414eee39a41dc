"""Split-K as a batched GEMM: the 8B verify's matmuls as s independent K-slices in one cuBLAS bmm (fp32 out), summed.

Why: at 49 rows cuBLAS's kernels for q/k/v and o run 96 and 64 CTAs on 132 SMs, and a CTA streams its weights at a
fixed rate: the o matmul with its weights already in L2 takes 9.9 us against 11.8 us from HBM (BENCHMARKS.md, "a bulk
L2 prefetch"), so the lever is more CTAs, not earlier bytes. cuBLASLt's own split-K configurations do not win
(`bench/lt_gemm.py --search`). A bmm over s K-slices is s problems of the same N with K/s, for which cuBLAS picks its
tiles afresh: s times the CTAs, each streaming 1/s of a row block. The partial sums come out in fp32 (`bmm(...,
out_dtype=float32)`), so the sum (+ the residual) rounds to bf16 once, as F.linear does; in a compiled forward the
sum would fuse into the next norm's kernel. Rows: kind x s; `bmm us` the batched GEMM alone, `+sum us` with the sum,
the residual add and the bf16 cast as one more eager kernel (the upper bound of the cost), and the error against an
fp64 reference next to F.linear's.

    python bench/split_gemm.py                  # H200, ~30 s
    python bench/split_gemm.py --kinds o,qkv --splits 2,4,8
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402

KINDS = common.LLAMA_8B_MATMULS


def split_views(x: torch.Tensor, w: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K], w [N, K] -> xs [s, M, K/s], wt [s, K/s, N]: views, no copy (batch stride K/s, leading dim K)."""
    m, k = x.shape
    n = w.shape[0]
    return x.view(m, s, k // s).transpose(0, 1), w.view(n, s, k // s).permute(1, 2, 0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=49, help="forward width (tokens)")
    ap.add_argument("--kinds", default="qkv,o,gate_up,down", help=f"weight kinds ({', '.join(KINDS)})")
    ap.add_argument("--splits", default="2,3,4,8", help="K-slices s, comma-separated (K must divide)")
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    from draftsmith.decode.kernels import _time_graph

    torch.manual_seed(0)
    bw = common.measure_copy_bandwidth()
    m = args.rows
    rows, notes = [], []
    for kind in args.kinds.split(","):
        n, k = KINDS[kind]
        wbytes = n * k * 2
        copies = max(2, math.ceil(400e6 / wbytes))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        h = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ref = (x.double() @ ws[0].double().t() + h.double()).float()

        def lin():
            for w in ws:
                torch.addmm(h, x, w.t(), out=out)

        t_lin, _ = _time_graph(lin, copies, 10)
        err_lin = (torch.addmm(h, x, ws[0].t()).float() - ref).abs().max().item()
        rows.append({"kind": kind, "rows": m, "s": 1, "us": t_lin, "bw": wbytes / t_lin * 1e6 / bw,
                     "+sum us": "-", "max err": err_lin, "vs addmm": 1.0})  # fmt: skip
        for s in [int(v) for v in args.splits.split(",")]:
            if k % s or (k // s) % 8:
                continue
            views = [split_views(x, w, s) for w in ws]

            def bmm(views=views):
                for xs, wt in views:
                    torch.bmm(xs, wt, out_dtype=torch.float32)

            def bmm_sum(views=views):
                for xs, wt in views:
                    torch.add(h, torch.bmm(xs, wt, out_dtype=torch.float32).sum(0), out=out)

            try:
                got = (torch.bmm(*views[0], out_dtype=torch.float32).sum(0) + h.float()).to(torch.bfloat16)
            except (RuntimeError, TypeError) as e:
                notes.append(f"{kind} s={s}: {type(e).__name__}: {str(e)[:160]}")
                continue
            t_b, why = _time_graph(bmm, copies, 10)
            t_bs, _ = _time_graph(bmm_sum, copies, 10)
            if t_b is None:
                notes.append(f"{kind} s={s}: graph failed ({why})")
                continue
            rows.append(
                {
                    "kind": kind,
                    "rows": m,
                    "s": s,
                    "us": t_b,
                    "bw": wbytes / t_b * 1e6 / bw,
                    "+sum us": t_bs if t_bs else "-",
                    "max err": (got.float() - ref).abs().max().item(),
                    "vs addmm": t_b / t_lin,
                }
            )
            print(rows[-1], flush=True)
        ws.clear()
        torch.cuda.empty_cache()
    table = common.markdown_table(rows, ["kind", "rows", "s", "us", "bw", "+sum us", "max err", "vs addmm"])
    body = (
        table + f"\n\ns = 1: torch.addmm (the residual in cuBLAS's epilogue, bf16 out); s > 1: torch.bmm over s "
        "K-slices (views of x and the weights, fp32 out), `+sum us` with `h + part.sum(0)` in bf16 as an eager kernel. "
        f"us a matrix, every layer copy's matrix in one CUDA graph; bw = weight bytes / time / copy bandwidth "
        f"({bw / 1e9:.0f} GB/s). max err: against fp64, weights ~N(0, 0.02)." + "".join(f"\n- note: {x}" for x in notes)
    )
    if args.no_append:
        print(body)
    else:
        common.record("split_gemm", "Decode: the 8B verify's matmuls as split-K batched GEMMs", body,
                      {"rows": rows, "notes": notes, "copy_bw": bw}, " ".join(sys.argv))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
