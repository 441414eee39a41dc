"""Compile draftsmith's Triton decode kernels ahead of time for a GPU architecture — no GPU needed — and report
what each variant costs the hardware: registers per thread, local memory (spills), shared memory, and whether the
weight loads are 16-byte vector loads (`ld.global.v4`).

Why: the kernels are tested for numerics in triton's interpreter on CPU, which says nothing about whether they
compile for the device, spill, or load narrowly. This answers those on the development machine, before a GPU call
(and prunes gemv tiles that spill from the sweep).

Usage:  python bench/kernels_aot.py [--arch 90] [--shape 8b|small|tiny] [--sass] [--json FILE]
(--sass: each variant's matrix instructions and their longest dependent chain, read from its disassembly)
(needs triton with its CUDA backend: the ptxas/cuobjdump it bundles; the CPU torch wheel + `pip install triton`)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import markdown_table  # noqa: E402

# the shapes of one decode step: (hidden, intermediate, heads, kv heads, head_dim, vocab)
SHAPES = {
    "8b": (4096, 14336, 32, 8, 128, 128256),
    "small": (384, 1024, 6, 2, 64, 16384),  # pycode-small
    "tiny": (192, 512, 3, 1, 64, 16384),
}


def _compile(fn, signature: dict, constexprs: dict, arch: int, num_warps: int, aligned: list[str]):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature)
    # what the JIT does at launch: pointers aligned to 16 bytes and integers divisible by 16 are marked so
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    opts = {"num_warps": num_warps}
    if constexprs.get("USE_PDL"):
        opts["launch_pdl"] = True
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def mma_chain(sass: str) -> tuple[int, int]:
    """(matrix instructions, the longest dependent chain of them) in a kernel's SASS. An `HMMA Rd, Ra, Rb, Rc` whose
    accumulator Rc is an earlier HMMA's Rd waits for it (~30 cycles on sm_90): a tl.dot over a K block of mma.sync
    tiles is such a chain of K/16, the latency a few-row kernel pays whatever its tile (`KernelConfig.rows_k_chains`).
    Hopper's asynchronous warpgroup MMAs (HGMMA) are counted, not chained."""
    depth: dict[str, int] = {}
    longest = 0
    for d, c in re.findall(r"\bHMMA\.\S+\s+(R\d+)[^,]*,[^,]+,[^,]+,\s*(R\d+|RZ)", sass):
        depth[d] = depth.get(c, 0) + 1
        longest = max(longest, depth[d])
    return len(re.findall(r"\bH(?:G)?MMA\.", sass)), longest


def _resources(compiled, sass: bool = False) -> dict:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        code = (
            subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout if sass else ""
        )
    finally:
        os.unlink(f.name)
    get = lambda key: int(m.group(1)) if (m := re.search(rf"\b{key}:(\d+)", out)) else None  # noqa: E731
    ptx = compiled.asm["ptx"]
    return {
        "regs": get("REG"),
        "local B": get("LOCAL"),
        "shared B": get("SHARED"),
        "v4 loads": len(re.findall(r"ld\.global(?:\.[a-z]+)*\.v4", ptx)),
        "scalar loads": len(re.findall(r"ld\.global(?:\.[a-z]+)*\.b16 ", ptx)),
        "griddepcontrol": len(re.findall(r"griddepcontrol\.", ptx)),
        "cp.async": len(re.findall(r"cp\.async\.(?:ca|cg)", ptx)),  # tl.dot operands pipelined via smem
        **(dict(zip(("mma", "mma chain"), mma_chain(code))) if sass else {}),
    }


def variants(shape: str, dtype: str = "bf16", rows_sweep: bool = False, pdl_off_sweep: bool = False):
    """(label, kernel, signature, constexprs, num_warps, aligned args) of every kernel variant a step launches."""
    from draftsmith.decode import kernels as K
    from draftsmith.decode.experimental import gemm_rows as G

    H, inter, nh, nkv, d, V = SHAPES[shape]
    p = f"*{dtype}"
    gemv_sig = {
        "x_ptr": p,
        "w_ptr": p,
        "y_ptr": p,
        "nw_ptr": p,
        "b_ptr": p,
        "r_ptr": p,
        "N": "i32",
        "K": "i32",
        "stride_w": "i32",
        "eps": "fp32",
        "e_ptr": p,
        "id_ptr": "*i64",
        "nw2_ptr": p,
        "pv_ptr": "*fp32",
        "pi_ptr": "*i32",
        "cnt_ptr": "*i32",
        "map_ptr": "*i64",
        "HAS_NORM": "constexpr",
        "HAS_BIAS": "constexpr",
        "HAS_RES": "constexpr",
        "ACT_MUL": "constexpr",
        "BLOCK_N": "constexpr",
        "BLOCK_K": "constexpr",
        "NORM_BLOCK": "constexpr",
        "PREFETCH": "constexpr",
        "USE_PDL": "constexpr",
        "GLU": "constexpr",
        "EMBED": "constexpr",
        "ARGMAX": "constexpr",
        "P_BLOCK": "constexpr",
        "q_ptr": p,
        "kc_ptr": p,
        "vc_ptr": p,
        "cos_ptr": p,
        "sin_ptr": p,
        "pos_ptr": "*i64",
        "slot_ptr": "*i64",
        "stride_cache_h": "i32",
        "NH": "i32",
        "NKV": "i32",
        "ROPE": "constexpr",
        "HALF": "constexpr",
    }
    aligned = ["x_ptr", "w_ptr", "y_ptr", "nw_ptr", "b_ptr", "r_ptr", "N", "K", "stride_w"]
    kinds = {
        "qkv": dict(HAS_NORM=True, HAS_RES=False, ACT_MUL=False, GLU=False),
        "o": dict(HAS_NORM=False, HAS_RES=True, ACT_MUL=False, GLU=False),
        "gate_up": dict(HAS_NORM=True, HAS_RES=False, ACT_MUL=False, GLU=False),
        "gate_up glu": dict(HAS_NORM=True, HAS_RES=False, ACT_MUL=False, GLU=True),
        "down": dict(HAS_NORM=False, HAS_RES=True, ACT_MUL=False, GLU=False),
        "down act_mul": dict(HAS_NORM=False, HAS_RES=True, ACT_MUL=True, GLU=False),
        "lm_head": dict(HAS_NORM=True, HAS_RES=False, ACT_MUL=False, GLU=False),
        # a drafter's first-layer qkv: the embedding gather and both input norms folded in (default tile only)
        "qkv embed": dict(HAS_NORM=True, HAS_RES=False, ACT_MUL=False, GLU=False, EMBED=True),
        # a greedy draft step's lm_head: the argmax and the id map in the epilogue (`gemv(argmax_map=)`)
        "lm_head argmax": dict(HAS_NORM=True, HAS_RES=False, ACT_MUL=False, GLU=False, ARGMAX=True),
        # q/k/v with RoPE and the cache writes in the epilogue (`gemv(rope=)`, KernelConfig.rope_fold; default tile)
        "qkv rope": dict(HAS_NORM=True, HAS_RES=False, ACT_MUL=False, GLU=False, ROPE=True),
    }
    default_tile = K.KernelConfig().gemv_default
    for kind, flags in kinds.items():
        flags = {"EMBED": False, "ARGMAX": False, "ROPE": False, **flags}
        flags["HALF"] = d // 2 if flags["ROPE"] else 1
        for bn, bk, nw, pf in K.GEMV_CONFIGS:
            if (flags["EMBED"] or flags["ROPE"]) and (bn, bk, nw, pf) != default_tile:
                continue
            if flags["ARGMAX"] and -(-V // bn) > K.ARGMAX_MAX_PROGRAMS:  # gemv launches the plain tile then
                continue
            # programmatic dependent launch (on by default on sm_90) loads the first block before its wait: every
            # tile with it; without it (benchmarks' --pdl off) the default tile, unless --gemv-sweep-without-pdl
            pdls = (False, True) if pdl_off_sweep or (bn, bk, nw, pf) == default_tile else (True,)
            for pdl in pdls:
                yield (
                    f"gemv {kind} {bn}/{bk}/{nw}/{pf}{' pdl' if pdl else ''}",
                    K._gemv_kernel,
                    gemv_sig,
                    dict(
                        flags,
                        HAS_BIAS=False,
                        BLOCK_N=bn,
                        BLOCK_K=bk,
                        NORM_BLOCK=min(1 << (H - 1).bit_length(), K.NORM_BLOCK_MAX),
                        PREFETCH=bool(pf),
                        USE_PDL=pdl,
                        # the argmax's partials: one a program, reduced in one block (the launcher's next_power_of_2)
                        P_BLOCK=1 << (-(-V // bn) - 1).bit_length() if flags["ARGMAX"] else 1,
                    ),
                    nw,
                    aligned,
                )
    rows_sig = {
        "x_ptr": p,
        "w_ptr": p,
        "y_ptr": p,
        "nw_ptr": p,
        "b_ptr": p,
        "r_ptr": p,
        "part_ptr": "*fp32",
        "cnt_ptr": "*i32",
        "ssq_in_ptr": "*fp32",
        "ssq_out_ptr": "*fp32",
        "T": "i32",
        "N": "i32",
        "K": "i32",
        "K_SPLIT": "i32",
        "n_ssq": "i32",
        "stride_x": "i32",
        "stride_w": "i32",
        "eps": "fp32",
        "HAS_NORM": "constexpr",
        "HAS_BIAS": "constexpr",
        "HAS_RES": "constexpr",
        "GLU": "constexpr",
        "BLOCK_M": "constexpr",
        "BLOCK_N": "constexpr",
        "BLOCK_K": "constexpr",
        "IEEE": "constexpr",
        "FMA": "constexpr",
        "ONE_K": "constexpr",
        "SPLIT": "constexpr",
        "HAS_SSQ": "constexpr",
        "WANT_SSQ": "constexpr",
        "SSQ_BLOCK": "constexpr",
        "USE_PDL": "constexpr",
        "SWAP": "constexpr",
        "q_ptr": p,
        "kc_ptr": p,
        "vc_ptr": p,
        "cos_ptr": p,
        "sin_ptr": p,
        "pos_ptr": "*i64",
        "slot_ptr": "*i64",
        "stride_cache_h": "i32",
        "NH": "i32",
        "NKV": "i32",
        "ROPE": "constexpr",
        "HALF": "constexpr",
        "K_CHAINS": "constexpr",
    }
    rows_kinds = {
        "qkv": dict(HAS_NORM=True, HAS_RES=False, GLU=False),
        "o": dict(HAS_NORM=False, HAS_RES=True, GLU=False),
        "gate_up glu": dict(HAS_NORM=True, HAS_RES=False, GLU=True),
        "down": dict(HAS_NORM=False, HAS_RES=True, GLU=False),
        # q/k/v with RoPE and the cache writes in the epilogue (`gemm_rows(rope=)`; the default variants only)
        "qkv rope": dict(HAS_NORM=True, HAS_RES=False, GLU=False, ROPE=True),
    }
    rows_tile = K.KernelConfig()  # gemm_rows's default tile (the runner's unless a benchmark passes another)
    default = G._tile4((rows_tile.rows_block_n, rows_tile.rows_block_k, rows_tile.rows_num_warps))
    # the default tile at 16 and 64 rows (with and without PDL), and every tile of the sweep `tune_rows` may pick
    # at 16 rows (a chain verify's; the split-K tiles at 64, a tree verify's)
    variants = [(16, False, default), (64, False, default), (64, True, default)]
    if rows_sweep:
        variants += [(16, True, G._tile4(t)) for t in rows_tile.rows_sweep]
        if H >= G.SSQ_MIN_K:  # the tuner's rule: the split sweep for matrices of that many inputs
            variants += [(64, True, G._tile4(t)) for t in rows_tile.rows_split_sweep]
        variants = [v for i, v in enumerate(variants) if v not in variants[:i]]
    for kind, flags in rows_kinds.items():
        flags = {"ROPE": False, **flags}
        flags["HALF"] = d // 2 if flags["ROPE"] else 1
        for bm, pdl, (bn, bk, nw, sp) in variants if not flags["ROPE"] else variants[:3]:
            fma = bn < 16  # gemm_rows launches these tiles with the CUDA-core products, FMA_BLOCK_M rows a program
            bm = min(bm, G.FMA_BLOCK_M) if fma else bm
            k = inter if kind == "down" else H
            # the producer/consumer sums of squares as the rows plan passes them at this hidden size
            ssq = H >= G.SSQ_MIN_K
            # K as independent MMA chains where the launcher's rule takes them (`KernelConfig.rows_k_chains`)
            esize = 4 if dtype == "fp32" else 2
            one_range = not fma and sp == 1 and not flags["ROPE"] and not (ssq and flags["HAS_NORM"] and bk < k)
            chains = G._k_chains(k, bm, bn, bk, flags["GLU"], esize, None, rows_tile) if one_range else 1
            yield (
                f"gemm_rows {kind} M={bm} {bn}/{bk}/{nw}{f' split{sp}' if sp > 1 else ''}"
                f"{' pdl' if pdl else ''}{' fma' if fma else ''}{f' x{chains}' if chains > 1 else ''}",
                G._rows_kernel,
                rows_sig,
                dict(
                    flags,
                    HAS_BIAS=False,
                    BLOCK_M=bm,
                    BLOCK_N=bn,
                    BLOCK_K=bk,
                    IEEE=dtype == "fp32",
                    FMA=fma,
                    ONE_K=bk >= k,  # the launcher's rule for this shape's K
                    SPLIT=sp,
                    HAS_SSQ=ssq and flags["HAS_NORM"] and bk < k,
                    WANT_SSQ=ssq and flags["HAS_RES"],
                    SSQ_BLOCK=1 << (H // 16 - 1).bit_length(),
                    USE_PDL=pdl,
                    SWAP=False,
                    K_CHAINS=chains,
                ),
                nw,
                [
                    "x_ptr",
                    "w_ptr",
                    "y_ptr",
                    "nw_ptr",
                    "b_ptr",
                    "r_ptr",
                    "part_ptr",
                    "N",
                    "K",
                    "K_SPLIT",
                    "stride_x",
                    "stride_w",
                ],
            )
    rope_sig = {
        "qkv_ptr": p,
        "q_ptr": p,
        "kc_ptr": p,
        "vc_ptr": p,
        "cos_ptr": p,
        "sin_ptr": p,
        "pos_ptr": "*i64",
        "slot_ptr": "*i64",
        "qkn_ptr": p,
        "stride_t": "i32",
        "stride_cache_h": "i32",
        "eps": "fp32",
        "NH": "constexpr",
        "NKV": "constexpr",
        "D": "constexpr",
        "HAS_QKN": "constexpr",
        "USE_PDL": "constexpr",
    }
    for qkn in (False, True):
        for pdl in (False, True):
            yield (
                f"rope_and_cache qk_norm={qkn}{' pdl' if pdl else ''}",
                K._rope_cache_kernel,
                rope_sig,
                dict(NH=nh, NKV=nkv, D=d, HAS_QKN=qkn, USE_PDL=pdl),
                1,
                [n for n in rope_sig if n.endswith("_ptr")],
            )
    attn_sig = {
        "q_ptr": p,
        "kc_ptr": p,
        "vc_ptr": p,
        "mask_ptr": "*i1",
        "o_ptr": p,
        "pm_ptr": "*fp32",
        "pl_ptr": "*fp32",
        "po_ptr": "*fp32",
        "S": "i32",
        "split_len": "i32",
        "n_split": "i32",
        "stride_cache_h": "i32",
        "scale": "fp32",
        "G": "constexpr",
        "BLOCK_R": "constexpr",
        "D": "constexpr",
        "BLOCK_S": "constexpr",
        "SINGLE": "constexpr",
        "IEEE": "constexpr",
        "USE_PDL": "constexpr",
        "slot_ptr": "*i64",
        "LIVE": "constexpr",
    }
    g = nh // nkv
    # (+ 1: the split over the live keys, `KernelConfig.attn_live_chunks`, at the default plan with PDL)
    variants = [(bs, nw, single, pdl, False) for bs, nw in sorted({(bs, nw) for bs, _, nw in K.ATTN_CONFIGS})
                for single, pdl in ((True, False), (False, False), (False, True))]  # fmt: skip
    variants.append((K.ATTN_BLOCK_S, 4, False, True, True))
    for bs, nw, single, pdl, live in variants:
        yield (
            f"decode_attention split {bs}/{nw} single={single}{' live' if live else ''}{' pdl' if pdl else ''}",
            K._attn_split_kernel,
            attn_sig,
            dict(
                G=g,
                BLOCK_R=max(16, 1 << (g - 1).bit_length()),
                D=d,
                BLOCK_S=bs,
                SINGLE=single,
                IEEE=dtype == "fp32",
                USE_PDL=pdl,
                LIVE=live,
            ),
            nw,
            [n for n in attn_sig if n.endswith("_ptr")] + ["stride_cache_h"],
        )
    rattn_sig = {
        "q_ptr": p,
        "kc_ptr": p,
        "vc_ptr": p,
        "mask_ptr": "*i1",
        "slot_ptr": "*i64",
        "o_ptr": p,
        "pm_ptr": "*fp32",
        "pl_ptr": "*fp32",
        "po_ptr": "*fp32",
        "T": "i32",
        "S": "i32",
        "split_len": "i32",
        "n_split": "i32",
        "stride_qt": "i32",
        "stride_qh": "i32",
        "stride_mt": "i32",
        "stride_cache_h": "i32",
        "scale": "fp32",
        "NH": "constexpr",
        "G": "constexpr",
        "BLOCK_R": "constexpr",
        "D": "constexpr",
        "BLOCK_S": "constexpr",
        "BLOCK_T": "constexpr",
        "HAS_SLOTS": "constexpr",
        "SINGLE": "constexpr",
        "IEEE": "constexpr",
        "USE_PDL": "constexpr",
        "LIVE": "constexpr",
    }
    live_bs, live_warps = K._rows_live_tile(d)
    for br, bs, nw, single, pdl, live in (
        (K.ROWS_ATTN_BLOCK_R, K.ROWS_ATTN_BLOCK_S, K.ROWS_ATTN_WARPS, False, False, False),
        (K.ROWS_ATTN_BLOCK_R, K.ROWS_ATTN_BLOCK_S, K.ROWS_ATTN_WARPS, False, True, False),
        (K.ROWS_ATTN_BLOCK_R, K.ROWS_ATTN_BLOCK_S, K.ROWS_ATTN_WARPS, True, True, False),
        (16, K.ROWS_ATTN_BLOCK_S, K.ROWS_ATTN_WARPS, False, True, False),
        # the live-key split (few rows by default, `KernelConfig.rows_attn_live`; `attn_live_chunks`) and its tile
        (K.ROWS_ATTN_LIVE_BLOCK_R, live_bs, live_warps, False, True, True),
    ):
        yield (
            f"rows_attention {br}/{bs}/{nw} single={single}{' live' if live else ''}{' pdl' if pdl else ''}",
            K._rows_attn_kernel,
            rattn_sig,
            dict(
                NH=nh,
                G=g,
                BLOCK_R=br,
                D=d,
                BLOCK_S=bs,
                BLOCK_T=64,
                HAS_SLOTS=True,
                SINGLE=single,
                IEEE=dtype == "fp32",
                USE_PDL=pdl,
                LIVE=live,
            ),
            nw,
            # the strides the JIT sees divisible by 16 on the 8B verify (q from rope_and_cache [T, nh, d], the mask's
            # row = the cache's slots): specialised there too, so the q and mask loads vectorise as they do on the GPU
            [n for n in rattn_sig if n.endswith("_ptr")] + ["stride_cache_h", "stride_qt", "stride_qh", "stride_mt"],
        )
    topk_sig = {
        "x_ptr": p,
        "cv_ptr": "*fp32",
        "ci_ptr": "*i32",
        "bm_ptr": "*fp32",
        "bs_ptr": "*fp32",
        "V": "i32",
        "stride_x": "i32",
        "NB": "i32",
        "K": "constexpr",
        "BLOCK": "constexpr",
        "USE_PDL": "constexpr",
    }
    merge_sig = {
        "cv_ptr": "*fp32",
        "ci_ptr": "*i32",
        "bm_ptr": "*fp32",
        "bs_ptr": "*fp32",
        "ov_ptr": "*fp32",
        "oi_ptr": "*i64",
        "NB": "i32",
        "V": "i32",
        "K": "constexpr",
        "BLOCK_C": "constexpr",
        "BLOCK_B": "constexpr",
        "USE_PDL": "constexpr",
    }
    for k in (8, K.TOPK_MAX):  # a draft level's top-k over the 32k draft vocabulary
        yield (
            f"topk_logprobs block k={k} pdl",
            K._topk_block_kernel,
            topk_sig,
            dict(K=k, BLOCK=K.TOPK_BLOCK, USE_PDL=True),
            8,
            ["x_ptr", "stride_x"],
        )
        nb = -(-32000 // K.TOPK_BLOCK)
        yield (
            f"topk_logprobs merge k={k} pdl",
            K._topk_merge_kernel,
            merge_sig,
            dict(K=k, BLOCK_C=1 << (nb * k - 1).bit_length(), BLOCK_B=1 << (nb - 1).bit_length(), USE_PDL=True),
            1,
            [],
        )
    comb_sig = {
        "o_ptr": p,
        "pm_ptr": "*fp32",
        "pl_ptr": "*fp32",
        "po_ptr": "*fp32",
        "n_split": "i32",
        "D": "constexpr",
        "BLOCK_SP": "constexpr",
        "USE_PDL": "constexpr",
    }
    for bsp, pdl in ((16, False), (K.ATTN_MAX_SPLIT, False), (K.ATTN_MAX_SPLIT, True)):
        yield (
            f"decode_attention combine {bsp}{' pdl' if pdl else ''}",
            K._attn_combine_kernel,
            comb_sig,
            dict(D=d, BLOCK_SP=bsp, USE_PDL=pdl),
            K._combine_warps(bsp, d),
            [n for n in comb_sig if n.endswith("_ptr")],
        )


def report(
    shape: str = "8b",
    arch: int = 90,
    dtype: str = "bf16",
    only: str | None = None,
    rows_sweep: bool = False,
    pdl_off_sweep: bool = False,
    sass: bool = False,
) -> list[dict]:
    rows = []
    for label, fn, sig, consts, nw, aligned in variants(shape, dtype, rows_sweep, pdl_off_sweep):
        if only and only not in label:
            continue
        t0 = time.perf_counter()
        try:
            res = _resources(_compile(fn, sig, consts, arch, nw, aligned), sass)
            err = ""
        except Exception as e:  # noqa: BLE001 - a variant that does not compile is the finding
            res, err = {}, f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:160] if str(e).strip() else ''}"
        rows.append({"kernel": label, "warps": nw, **res, "compile s": time.perf_counter() - t0, "error": err})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90 = H100/H200)")
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES), help="model shape the constexprs come from")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--only", default=None, help="only variants whose label contains this")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument(
        "--rows-sweep",
        action="store_true",
        help="also every gemm_rows tile of KernelConfig.rows_sweep (16 rows, PDL) and rows_split_sweep (64 rows): what "
        "tune_rows may pick",
    )
    ap.add_argument(
        "--gemv-sweep-without-pdl",
        action="store_true",
        help="also every gemv tile without PDL (by default only the default tile: PDL is on wherever sm_90 runs)",
    )
    ap.add_argument(
        "--sass",
        action="store_true",
        help="also disassemble each variant: its matrix instructions (mma) and their longest dependent chain (mma "
        "chain: HMMAs each waiting on the last one's accumulator — latency a launch-bound kernel pays)",
    )
    args = ap.parse_args(argv)
    rows = report(args.shape, args.arch, args.dtype, args.only, args.rows_sweep, args.gemv_sweep_without_pdl, args.sass)
    cols = list(dict.fromkeys(k for r in rows for k in r))
    print(markdown_table(rows, cols))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 1 if any(r["error"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
