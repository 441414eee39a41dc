"""Where a plain decode step's time goes (issue 6, P1): kernels by name, per attention implementation,
eager and compiled, against the floor of the step's matmuls alone.

For the Llama-3.1-8B shape (random bf16 weights), bs=1, each (attention impl, eager/compiled, cache length):
  ms/step from a CUDA-graph replay, kernels per step, summed kernel time, and the top kernels by summed
  time; plus 'matmuls only' — the same weight matrices through F.linear and the lm_head in one graph, no
  attention or elementwise work — the floor this step's cuBLAS GEMVs set, next to the copy bandwidth floor.

With `--gemv triton` the step runs through draftsmith.decode.kernels (the engine's kernels="triton": Triton gemv
tiles tuned per weight kind first, printed as a table); `--triton-ops` lists which ops take the kernels, several
routings separated by '/', so one run can say which op is faster where. Each Triton row also reports the step's
largest logit difference from the torch path's step on the same cache (a GPU-side correctness check).

Usage (device):  python bench/decode_kernels.py [--impls sdpa,bmm,split] [--compile off,on,autotune] [--cache 208,2128]
                     [--gemv torch,triton] [--triton-ops all/qkv,o,down]
CPU smoke (tiny shape, no graphs, aten ops instead of kernels):  python bench/decode_kernels.py --smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import markdown_table, record  # noqa: E402
from bench.decode import copy_bandwidth, kernel_census, llama8b_config, sync, time_steps  # noqa: E402
from draftsmith.decode import kernels as K  # noqa: E402  (imports without triton; kernels need it)
from draftsmith.decode.engine import DecodeMode, SpeculativeDecoder  # noqa: E402
from draftsmith.decode.kernel_config import KernelConfig  # noqa: E402
from draftsmith.decode.llama import ATTENTION_IMPLS, LlamaFamilyForward  # noqa: E402
from draftsmith.decode.sampling import SamplingParams  # noqa: E402


def matmul_floor(runner, dev, reps: int) -> float:
    """Seconds per step of only the step's weight matmuls (bs=1) and the lm_head, from one CUDA graph."""
    mats = []
    for L in runner.layers:
        mats += [*L.qkv, L.o, *L.gate_up, L.down]
    mats.append(runner.lm_head)
    ins = {}
    for w in mats:  # one input per in-feature size (the GEMV reads w once whatever x holds)
        ins.setdefault(w.shape[1], torch.randn(1, w.shape[1], device=dev, dtype=runner.dtype))

    def step():
        for w in mats:
            F.linear(ins[w.shape[1]], w)

    return time_steps(None, _graphed(step, dev), reps, dev)


def _graphed(step, dev):
    """`step` captured in one CUDA graph (its replay), or `step` itself on CPU."""
    if dev.type != "cuda":
        return step
    step()
    sync(dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    return g.replay


def per_matrix(runner, dev, reps: int, gemvs: list[str], bw: float) -> list[dict]:
    """Each weight kind (every layer's copy, so nothing sits in L2) through cuBLAS F.linear and, when asked, the
    Triton gemv with what the step folds into it for that kind (norm, residual, silu(gate)*up) and its tuned tile,
    one CUDA graph per (kind, path): which matmuls the Triton kernel should take."""
    rows = []
    for kind, (mats, kw) in runner.gemv_kinds().items():
        x = torch.randn(1, mats[0].shape[1], device=dev, dtype=runner.dtype)
        nbytes = sum(w.numel() * w.element_size() for w in mats)
        row = {"matrix": kind, "shape": f"{mats[0].shape[0]}x{mats[0].shape[1]}", "count": len(mats)}
        for path in ["torch"] + [g for g in gemvs if g == "triton"]:
            if path == "triton":
                xk = torch.randn(1, 2 * x.shape[1], device=dev, dtype=runner.dtype) if kw.get("act_mul") else x
                res = torch.randn(1, mats[0].shape[0], device=dev, dtype=runner.dtype) if kw.get("residual") else None

                def step(mats=mats, xk=xk, res=res, kw=kw, gemv=K.gemv):
                    for w in mats:
                        gemv(
                            xk,
                            w,
                            kw.get("norm_weight"),
                            bias=kw.get("bias"),
                            residual=res,
                            act_mul=kw.get("act_mul", False),
                            glu=kw.get("glu", False),
                            config=runner.kernel_config,
                        )
            else:

                def step(mats=mats, x=x):
                    for w in mats:
                        F.linear(x, w)

            t = time_steps(None, _graphed(step, dev), reps, dev)
            row[f"{path} us/matrix"] = t / len(mats) * 1e6
            row[f"{path} ÷ copy bw"] = nbytes / t / bw
        rows.append(row)
        print(row, flush=True)
    return rows


def tuning_summary(rows: list[dict], default: tuple[int, int, int, int]) -> list[dict]:
    """Per weight kind: the fastest and the slowest tile of the sweep, and the default tile's time (`default`: the
    (BLOCK_N, BLOCK_K, warps, prefetch) of an untuned gemv)."""
    out = []
    for kind in dict.fromkeys(r["matrix"] for r in rows):
        ok = [r for r in rows if r["matrix"] == kind and r["us"] is not None]
        if not ok:
            continue
        best, worst = min(ok, key=lambda r: r["us"]), max(ok, key=lambda r: r["us"])
        dflt = next(
            (r["us"] for r in ok if (r["BLOCK_N"], r["BLOCK_K"], r["warps"], r["prefetch"]) == default),
            None,
        )
        nopf = [r["us"] for r in ok if not r["prefetch"]]
        out.append(
            {
                "matrix": kind,
                "best tile (N/K/warps/prefetch)": f"{best['BLOCK_N']}/{best['BLOCK_K']}/{best['warps']}/{best['prefetch']}",
                "best us": best["us"],
                "best without prefetch us": min(nopf) if nopf else None,
                "default us": dflt,
                "worst us": worst["us"],
                "tiles failed": sum(1 for r in rows if r["matrix"] == kind and r["us"] is None),
            }
        )
    return out


def sweep_attention_in_step(eng, runner, prompt, sp, S, reps, dev, bw, wbytes, ctx, pdl, smoke=False) -> list[dict]:
    """ms/step of the plain step with each attention plan forced in place of the tuned one (graphs recaptured): the
    runner runs under a copy of its kernel config with that plan kept for this shape, then gets its own back.
    `smoke`: the default plan and one other (the interpreter takes ~7 s a plan)."""
    key = K._attn_key(S, runner.n_kv, runner.n_heads // runner.n_kv, runner.head_dim, runner.dtype)
    base = runner.kernel_config
    default = K._attn_plan(
        S,
        runner.n_kv,
        runner.n_heads // runner.n_kv,
        runner.head_dim,
        runner.dtype,
        dev,
        None,
        None,
        None,
        base.attn_plans,
    )
    out = []
    try:
        plans = K.attention_plans(S)
        if smoke:
            plans = [default] + [p for p in plans if p != default][:1]
        for plan in plans:
            runner.kernel_config = dataclasses.replace(base, attn_plans={**base.attn_plans, key: plan})
            eng.drop_graphs()
            plain = eng.step_fn(DecodeMode("plain"), sp)
            eng.prefill(prompt, sp)
            t = time_steps(eng, plain, reps, dev)
            ach = (wbytes + runner.kv_bytes_per_token() * (ctx + reps / 2)) / t
            out.append(
                {
                    "cache S": S,
                    "pdl": pdl,
                    "split_len": plan[0],
                    "BLOCK_S": plan[1],
                    "warps": plan[2],
                    "chunks": -(-S // plan[0]),
                    "ms/step": t * 1e3,
                    "÷ copy bw": ach / bw,
                    "default": "*" if plan == default else "",
                }
            )
            print(out[-1], flush=True)
    finally:
        runner.kernel_config = base
        eng.drop_graphs()
    return out


def verify_census(runner, T: int, S: int, impl: str, dev, reps: int, bw: float, wbytes: int, top: int) -> dict:
    """One T-token verify forward of the torch path (what a speculative round's verify runs), from a CUDA graph:
    ms, ÷ copy bw of the weight + KV bytes, kernels, the top kernels, and the step's matmuls alone at T rows."""
    ctx = S - T - 8
    ids = torch.randint(
        0, runner.vocab_size if hasattr(runner, "vocab_size") else runner.embed.shape[0], (T,), device=dev
    )
    pos = torch.arange(ctx, ctx + T, device=dev)
    ar = torch.arange(S, device=dev)
    # a tree-ish mask: every node sees the context and the nodes before it with an even offset (not just causal)
    rel = ar[None, :] - pos[:, None]
    mask = (ar[None, :] < ctx) | ((rel <= 0) & (ar[None, :] >= ctx) & (rel % 2 == 0))
    runner.attn_impl = impl

    def fwd():
        runner.forward(ids, pos, pos, mask, want_aux=True)

    t = time_steps(None, _graphed(fwd, dev), reps, dev)
    n, kms, top_k = kernel_census(fwd, dev, top)
    mats = []
    for L in runner.layers:
        mats += [*L.qkv, L.o, *L.gate_up, L.down]
    ins = {}
    for w in mats + [runner.lm_head]:
        ins.setdefault(w.shape[1], torch.randn(T, w.shape[1], device=dev, dtype=runner.dtype))

    def mm():
        for w in mats:
            F.linear(ins[w.shape[1]], w)
        F.linear(ins[runner.lm_head.shape[1]], runner.lm_head)  # all T rows' logits, as a tree verify needs

    t_mm = time_steps(None, _graphed(mm, dev), reps, dev)
    kv = runner.kv_bytes_per_token() * (ctx + T)
    return {
        "T": T,
        "attention": impl,
        "cache S": S,
        "ms": t * 1e3,
        "÷ copy bw": (wbytes + kv) / t / bw,
        "matmuls alone ms": t_mm * 1e3,
        "matmuls ÷ copy bw": wbytes / t_mm / bw,
        "kernels": n,
        "kernel ms": kms,
        "error": "",
        "top": top_k,
    }


def logits_gap(eng, runner) -> float:
    """Largest |logit difference| of one plain step through the Triton kernels vs the torch path, same cache."""
    L = eng.L.view(1)
    mask = eng.mask(L)
    outs = []
    for kn in ("torch", "triton"):
        runner.kernels = kn
        outs.append(runner(eng.root.view(1), L, L, mask, want_aux=False)[0])
    runner.kernels = "triton"
    return float((outs[0] - outs[1]).abs().max()) / max(float(outs[0].abs().max()), 1e-30)


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impls", default=",".join(ATTENTION_IMPLS), help="attention implementations to compare")
    ap.add_argument(
        "--compile",
        default="off,on",
        help="off (eager step in a CUDA graph), on (torch.compile'd step), "
        "autotune (torch.compile max-autotune: inductor's Triton GEMMs tried against cuBLAS; slow compile)",
    )
    ap.add_argument(
        "--gemv",
        default="torch",
        help="torch (F.linear + separate norms/adds), triton "
        "(draftsmith.decode.kernels.gemv with the norms and residual adds folded in), or both: torch,triton",
    )
    ap.add_argument(
        "--gemv-blocks",
        default=None,
        help="BLOCK_N/BLOCK_K of the Triton gemv for every matrix, e.g. 8/1024 (default: tuned per weight kind)",
    )
    ap.add_argument(
        "--triton-ops",
        default="all",
        help="with --gemv triton: the ops that take the Triton kernels "
        "(comma list of qkv,rope,attn,o,gate_up,down,lm_head, or all); several routings separated by '/'",
    )
    ap.add_argument(
        "--pdl",
        default="on",
        help="with --gemv triton: programmatic dependent launch of the kernels, off, on or off,on (side by side)",
    )
    ap.add_argument(
        "--attn-sweep",
        action="store_true",
        help="with --gemv triton: also time the whole step with "
        "each attention plan of ATTN_CONFIGS forced (the tuning times attention alone)",
    )
    ap.add_argument(
        "--verify",
        default="",
        help="also a T-token verify forward (tree-shaped mask) per T listed, "
        "e.g. 8,48,64: ms, ÷ copy bw, kernels and the top kernels, next to the same matmuls alone at T rows",
    )
    ap.add_argument(
        "--rows-blocks",
        default="",
        help="with --verify and --gemv triton: gemm_rows tiles to sweep, "
        "BLOCK_N/BLOCK_K/warps comma-separated (default: KernelConfig.rows_block_n/k/num_warps)",
    )
    ap.add_argument("--cache", default="208,2128", help="cache lengths S the step attends over (context + slack)")
    ap.add_argument("--top", type=int, default=8, help="kernels listed per row")
    ap.add_argument("--reps", type=int, default=64, help="graph replays timed per row")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU (checks the code paths)")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = llama8b_config(args.smoke)
    caches = [int(c) for c in args.cache.split(",")] if not args.smoke else [64]  # smoke: one (the interpreter)
    reps = args.reps if not args.smoke else 2
    aux = [1, cfg.num_hidden_layers // 2 - 1, cfg.num_hidden_layers - 4]
    runner = LlamaFamilyForward.random(cfg, aux, max_len=max(caches), device=dev, dtype=dtype)
    bw = copy_bandwidth(dev, args.smoke)
    wbytes = runner.weight_bytes()
    t_mm = matmul_floor(runner, dev, reps)
    print(
        f"weights {wbytes / 1e9:.2f} GB; copy bandwidth {bw / 1e12:.2f} TB/s -> floor {wbytes / bw * 1e3:.3f} ms; "
        f"matmuls alone {t_mm * 1e3:.3f} ms ({wbytes / t_mm / bw:.3f} of copy bw)",
        flush=True,
    )
    gemvs = args.gemv.split(",")
    tuning = []
    if args.gemv_blocks:  # one tile for every matrix: the default and the whole sweep
        bn, bk = (int(v) for v in args.gemv_blocks.split("/"))
        runner.kernel_config = KernelConfig(block_n=bn, block_k=bk, gemv_sweep=((bn, bk, KernelConfig.num_warps, 0),))
    if "triton" in gemvs:
        t0 = time.perf_counter()
        tuning = runner.tune_kernels()
        print(f"gemv tiles tuned in {time.perf_counter() - t0:.1f} s", flush=True)
    mats = per_matrix(runner, dev, max(2, reps // 8), gemvs, bw)
    from draftsmith.decode.llama import TRITON_OPS

    routings = [",".join(TRITON_OPS) if r == "all" else r for r in args.triton_ops.split("/")]
    rows, tops, attn_tuning, attn_sweep = [], [], [], []
    sp = SamplingParams()
    # the Triton step runs from a CUDA graph without torch.compile (with compile the engine compiles only wider forwards)
    combos = [
        (kn, ops, comp, impl, S, pdl)
        for kn in gemvs
        for ops in (routings if kn == "triton" else ["-"])
        for comp in (args.compile.split(",") if kn == "torch" else ["off"])
        for pdl in (args.pdl.split(",") if kn == "triton" else ["-"])
        for impl in args.impls.split(",")
        for S in caches
    ]
    for kn, ops, comp, impl, S, pdl in combos:
        t0 = time.perf_counter()
        label = f"{kn}{'' if kn == 'torch' else '[' + ops + ']'}/{impl}/{comp}/pdl={pdl}/S={S}"
        row = {"gemv": kn, "triton ops": ops, "pdl": pdl, "attention": impl, "compile": comp, "cache S": S}
        try:
            # the tuned tables are shared with the copy (dataclasses.replace keeps the same dicts)
            runner.kernel_config = dataclasses.replace(runner.kernel_config, pdl=pdl == "on")
            runner.triton_ops = set(ops.split(",")) if kn == "triton" else set(TRITON_OPS)
            eng = SpeculativeDecoder(
                runner,
                None,
                max_len=S,
                attn_impl=impl,
                kernels=kn,
                compile={"off": False, "on": True, "autotune": "max-autotune"}[comp],
            )
            if kn == "triton" and not any(r["S"] == S for r in attn_tuning):  # attention alone, each plan
                attn_tuning += K.tune_attention(
                    runner.k_layers, runner.v_layers, runner.n_heads, S, runner.scale, config=runner.kernel_config
                )
            ctx = max(1, S - reps - 24) if not args.smoke else 8  # smoke: a short prefill (the interpreter is slow)
            prompt = torch.randint(0, cfg.vocab_size, (ctx,)).tolist()
            plain = eng.step_fn(DecodeMode("plain"), sp)
            eng.prefill(prompt, sp)
            gap = logits_gap(eng, runner) if kn == "triton" else 0.0
            setup_s = time.perf_counter() - t0
            t = time_steps(eng, plain, reps, dev)
            n, ms, top = kernel_census(eng.eager_step_fn(DecodeMode("plain"), sp), dev, args.top)
        except Exception as e:  # noqa: BLE001 - one failing combination must not cost the rest of a budgeted run
            row.update({"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"})
            rows.append(row)
            print(row, flush=True)
            continue
        ach = (wbytes + runner.kv_bytes_per_token() * (ctx + reps / 2)) / t
        row.update(
            {
                "ms/step": t * 1e3,
                "÷ copy bw": ach / bw,
                "÷ matmuls-only": t_mm / t,
                "kernels": n,
                "kernel ms": ms,
                "max |Δlogit| rel": gap,
                "setup s": setup_s,
                "error": "",
            }
        )
        if args.attn_sweep and kn == "triton":
            attn_sweep += sweep_attention_in_step(
                eng, runner, prompt, sp, S, reps, dev, bw, wbytes, ctx, pdl, args.smoke
            )
        rows.append(row)
        tops.append((label, top))
        print(row, flush=True)
        for name, c, kms in top:
            print(f"    {kms:8.3f} ms  x{c:<4d} {name[:110]}", flush=True)
        del eng
    runner.kernels = "torch"
    verify_rows = []
    tiles = [tuple(int(v) for v in b.split("/")) for b in args.rows_blocks.split(",")] if args.rows_blocks else [None]
    vcombos = [
        (T, impl, kn, tile)
        for T in [int(t) for t in args.verify.split(",") if t]
        for impl in args.impls.split(",")
        for kn in gemvs
        for tile in (tiles if kn == "triton" else [None])
    ]
    base = runner.kernel_config
    for T, impl, kn, tile in vcombos:
        # kernels="triton" with triton_max_rows: the verify's matmuls through experimental.gemm_rows (attention torch's)
        runner.kernels, runner.triton_max_rows = kn, (64 if kn == "triton" else 1)
        rows_tile = dict(zip(("rows_block_n", "rows_block_k", "rows_num_warps"), tile)) if tile else {}
        runner.kernel_config = dataclasses.replace(base, pdl="on" in args.pdl.split(","), **rows_tile)
        try:
            row = verify_census(runner, T, max(caches), impl, dev, reps, bw, wbytes, args.top)
        except Exception as e:  # noqa: BLE001 - a failing row must not cost the rest of a budgeted run
            row = {"T": T, "attention": impl, "error": f"{type(e).__name__}: {str(e)[:120]}"}
        verify_rows.append({"path": kn, "rows tile": "/".join(map(str, tile)) if tile else "-", **row})
        print(verify_rows[-1], flush=True)
    runner.kernels, runner.triton_max_rows, runner.kernel_config = "torch", 1, base
    columns = list(dict.fromkeys(k for r in rows for k in r))
    body = [
        markdown_table(rows, columns),
        "",
        f"Floors: weights {wbytes / 1e9:.2f} GB at the copy bandwidth {bw / 1e12:.2f} TB/s = "
        f"{wbytes / bw * 1e3:.3f} ms; the same matmuls alone (one CUDA graph of F.linear, bs=1) "
        f"{t_mm * 1e3:.3f} ms = {wbytes / t_mm / bw:.3f} of copy bw.",
        "",
        "Per weight kind (every layer's copy, one CUDA graph per kind and path):",
        "",
        markdown_table(mats, list(mats[0])),
        "",
    ]
    summ = tuning_summary(tuning, runner.kernel_config.gemv_default)
    if summ:
        body += [
            "Triton gemv tiles (the sweep of draftsmith.decode.kernels.GEMV_CONFIGS, per weight kind):",
            "",
            markdown_table(summ, list(summ[0])),
            "",
        ]
    if attn_tuning:
        kv_layer = 2 * runner.n_kv * runner.head_dim * runner.k_layers[0].element_size()  # bytes per slot
        for r in attn_tuning:
            r["KV ÷ copy bw"] = kv_layer * r["S"] / (r["us"] * 1e-6) / bw if r["us"] else None
        body += [
            "Triton attention plans timed alone (draftsmith.decode.kernels.tune_attention over "
            "ATTN_CONFIGS; one query token, every slot visible, us per layer):",
            "",
            markdown_table(
                attn_tuning, ["S", "BLOCK_S", "split_len", "chunks", "warps", "us", "KV ÷ copy bw", "error"]
            ),
            "",
        ]
    if attn_sweep:
        body += [
            "The whole Triton step with each attention plan forced (ms/step; * = the default rule's plan, "
            "kernels._attn_plan):",
            "",
            markdown_table(attn_sweep, list(attn_sweep[0])),
            "",
        ]
    if verify_rows:
        vcols = [c for c in dict.fromkeys(k for r in verify_rows for k in r) if c != "top"]
        body += [
            "Verify forwards (T tokens over the cache with a tree-shaped mask, one CUDA graph; path torch, or "
            "triton = the matmuls through experimental.gemm_rows; 'matmuls alone' = the same weights through "
            "F.linear at T rows):",
            "",
            markdown_table(verify_rows, vcols),
            "",
        ]
        for r in verify_rows:
            if r.get("top"):
                body.append(
                    f"- verify T={r['T']} {r['attention']} {r['path']} {r['rows tile']}: "
                    + "; ".join(f"{n[:60]} x{c} {kms:.3f} ms" for n, c, kms in r["top"][:6])
                )
        body.append("")
    body += ["Top kernels by summed time (one profiled step):", ""]
    for label, top in tops:
        body.append(f"- {label}: " + "; ".join(f"{name[:60]} x{c} {kms:.3f} ms" for name, c, kms in top[:5]))
    record(
        "decode_kernels",
        "decode kernels — where a plain 8B-shape step goes",
        "\n".join(body),
        {
            "rows": rows,
            "per_matrix": mats,
            "tuning": tuning,
            "attn_tuning": attn_tuning,
            "attn_sweep": attn_sweep,
            "verify": verify_rows,
            "top": tops,
            "matmul_floor_ms": t_mm * 1e3,
            "weight_bytes": wbytes,
            "copy_bw": bw,
        },
        "python bench/decode_kernels.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
