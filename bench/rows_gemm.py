"""The row kernels (`experimental.gemm_rows`) against cuBLAS on a verify's few rows, per weight kind.

Why: a verify of T = 5-64 tokens reads the target's weights once, like a plain step, so it should cost about one
plain step (issue 16 asks <= 1.15 on the 8B shape); cuBLAS's few-row kernels reach 0.64-0.87 of copy bandwidth there
(BENCHMARKS.md), the one-row gemv 0.88. This sweeps the row kernel's launch choices that the engine's tuner does not
(MMA orientation `swap`, pipeline depth `num_stages`) next to its tiles and split-K, one CUDA graph per variant over
several layers' copies of each matrix (so they stream from HBM, not L2), and prints us a matrix and the fraction of
copy bandwidth, best first, with cuBLAS (F.linear at the same rows) beside.

    python bench/rows_gemm.py --rows 49 --layers 8        # 8B shape, ~4 min on an H200 (mostly compiles)
    python bench/rows_gemm.py --smoke                      # CPU, tiny shape, interpreter: checks the code runs
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

# (BLOCK_N, BLOCK_K, num_warps): the tiles swept in both orientations and at each pipeline depth
TILES = ((64, 64, 4), (128, 64, 4), (128, 64, 8), (256, 64, 8), (128, 128, 8))
STAGES = (3, 6)
TILES_TMA = ((64, 64, 4), (128, 64, 4), (128, 64, 8), (256, 64, 8))
STAGES_TMA = (3, 5)
SPLITS = (1, 2, 4, 8)
# 8B (Llama-3.1-8B): kind -> (N rows of the weight, K, folds)
KINDS_8B = {
    "qkv": (6144, 4096, dict(norm=True)),
    "o": (4096, 4096, dict(residual=True)),
    "gate_up": (28672, 4096, dict(norm=True, glu=True)),
    "down": (4096, 14336, dict(residual=True)),
}
KINDS_SMOKE = {"qkv": (96, 64, dict(norm=True)), "gate_up": (128, 64, dict(norm=True, glu=True))}


def auto_split(n_tiles: int, k_blocks: int, sms: int) -> int:
    """The fewest K splits (of SPLITS) that give at least two programs per SM, without a range under 4 blocks."""
    for s in SPLITS:
        if n_tiles * s >= 2 * sms or k_blocks // (2 * s) < 4:
            return s
    return SPLITS[-1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=49, help="tokens of the verify (49: a tree of 48 nodes + 1)")
    ap.add_argument("--layers", type=int, default=8, help="copies of each matrix in one timed graph")
    ap.add_argument("--kinds", default="", help="comma-separated weight kinds (default: all)")
    ap.add_argument(
        "--variants",
        default="rows,tma",
        help="which kernels to sweep: rows (gemm_rows: tiles x orientation x stages x split), tma (gemm_rows_tma: "
        "TMA-fed blocks, tiles x orientation x stages x warp specialisation x split)",
    )
    ap.add_argument(
        "--tma-ws",
        choices=("both", "off"),
        default="both",
        help="tma variants with and without warp specialisation, or without only (on the H200's triton some "
        "warp-specialised launches fault with an illegal address, which ends the process's CUDA context)",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny shape on the CPU (triton's interpreter)")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import torch.nn.functional as F

    from draftsmith.decode import kernels as K
    from draftsmith.decode.experimental.gemm_rows import _splits, gemm_rows, gemm_rows_tma

    dev = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    kinds = KINDS_SMOKE if args.smoke else KINDS_8B
    if args.kinds:
        kinds = {k: v for k, v in kinds.items() if k in args.kinds.split(",")}
    sms = 4 if args.smoke else torch.cuda.get_device_properties(0).multi_processor_count
    bw = 1.0 if args.smoke else common.measure_copy_bandwidth(2.0)
    T, L = args.rows, (1 if args.smoke else args.layers)
    g = torch.Generator(device=dev).manual_seed(0)

    def timed(run, per):
        if args.smoke:
            t0 = time.perf_counter()
            run()
            return (time.perf_counter() - t0) * 1e6 / per, ""
        return K._time_graph(run, per, 10)

    rows = []
    for kind, (N, Kdim, folds) in kinds.items():
        mats = [torch.randn(N, Kdim, device=dev, dtype=dtype, generator=g) * 0.02 for _ in range(L)]
        x = torch.randn(T, Kdim, device=dev, dtype=dtype, generator=g)
        n_out = N // 2 if folds.get("glu") else N
        nw = torch.ones(Kdim, device=dev, dtype=dtype) if folds.get("norm") else None
        res = torch.randn(T, n_out, device=dev, dtype=dtype, generator=g) if folds.get("residual") else None
        ssq = (x.float().pow(2).sum(-1) / 8)[None].expand(8, T).contiguous() if nw is not None else None
        nbytes = N * Kdim * mats[0].element_size()
        us, err = timed(lambda: [F.linear(x, w) for w in mats], L)
        rows.append(
            {"kind": kind, "variant": "cuBLAS F.linear", "us": us, "÷ bw": nbytes / us / 1e-6 / bw if us else None}
        )
        ref = F.linear(x, mats[0])
        which = args.variants.split(",")
        variants = [
            ("rows", swap, bn, bk, warps, stages, split, False)
            for swap, (bn, bk, warps), stages in itertools.product((False, True), TILES, STAGES)
            for split in sorted({1, auto_split(-(-n_out // bn), -(-Kdim // bk), sms)})
            if "rows" in which and (split == 1 or _splits(Kdim, bk, split))
        ]
        # TMA-fed: the weights as the MMA's M side (cuBLAS's orientation) with and without warp specialisation, and
        # the rows' orientation; x is normed beforehand (no norm fold), so its time is the matmul's alone
        variants += [
            ("tma", swap, bn, bk, warps, stages, split, ws)
            for (swap, ws), (bn, bk, warps), stages in itertools.product(
                ((True, False), (True, True), (False, False)), TILES_TMA, STAGES_TMA
            )
            for split in sorted({1, auto_split(-(-n_out // bn), -(-Kdim // bk), sms)})
            if "tma" in which and (split == 1 or _splits(Kdim, bk, split)) and not (ws and args.tma_ws == "off")
        ]
        if args.smoke:
            variants = variants[:: max(1, len(variants) // 6)]
        for kern, swap, bn, bk, warps, stages, split, ws in variants:
            kw = dict(
                bias=None, residual=res, glu=bool(folds.get("glu")), block_n=bn, block_k=bk, num_warps=warps,
                split=split, swap=swap, num_stages=stages,
            )  # fmt: skip
            if kern == "rows":
                kw["row_ssq"] = ssq

                def launch(w, kw=kw):
                    return gemm_rows(x, w, nw, 1e-5, **kw)
            else:
                kw["warp_specialize"] = ws

                def launch(w, kw=kw):
                    return gemm_rows_tma(x, w, **kw)

            try:
                y = launch(mats[0])
                if nw is None and res is not None:  # a check of the variant: o/down's folds are a residual add
                    torch.testing.assert_close(y.float(), (ref + res).float(), atol=5e-2, rtol=5e-2)
                us, err = timed(lambda launch=launch: [launch(w) for w in mats], L)
            except Exception as e:  # noqa: BLE001 - a variant this GPU cannot run (shared memory) is a row
                us, err = None, f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:80] if str(e).strip() else ''}"
            name = (
                f"{'tma ' if kern == 'tma' else ''}{'swap ' if swap else ''}{'ws ' if ws else ''}{bn}/{bk}/{warps} "
                f"stages {stages} split {split}"
            )
            rows.append({"kind": kind, "variant": name, "us": us, "÷ bw": nbytes / us / 1e-6 / bw if us else None,
                         "error": err})  # fmt: skip
            print(rows[-1], flush=True)
    out = []
    for kind in kinds:
        mine = [r for r in rows if r["kind"] == kind]
        ok = sorted((r for r in mine if r["us"]), key=lambda r: r["us"])
        out += ok[:6] + [r for r in mine if r["variant"].startswith("cuBLAS") and r not in ok[:6]]
        out += [r for r in mine if not r["us"]][:2]
    cols = ["kind", "variant", "us", "÷ bw", "error"]
    table = common.markdown_table(out, cols)
    print(table)
    body = (
        f"T = {T} rows, {L} copies of each matrix per timed graph, bf16; copy bandwidth {bw / 1e12:.2f} TB/s. "
        "Best six variants per kind (of " + str(len(rows)) + " rows), cuBLAS beside.\n\n" + table
    )
    if not args.smoke:  # BENCHMARKS.md (and $OUT)
        common.record("rows_gemm", "Row kernels vs cuBLAS at a verify's rows", body, {"rows": rows}, " ".join(sys.argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
