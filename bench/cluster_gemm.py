"""The 8B verify's matmuls through `experimental.cluster_gemm` (our CUDA kernel: split-K in a cluster, PDL) against
torch's mm (cuBLAS's pick), one at a time and as a layer's dependent chain.

Why: at 49 rows cuBLAS streams q/k/v, o and down at 0.67-0.85 of copy bandwidth and breaks the PDL chain; the 49-row
verify is ~1.25 plain steps where issue 16 asks <= 1.15 (docs/LOG.md, twenty-second session).

Sections:
  prof   where a cold call's time goes: each CTA's in-kernel clock stamps (start, weights in, K done, reduced)
  scale  us a call against K at N = 4096 for each variant (split 1 and 4): the fixed cost and the streaming rate
  check  every variant and split against an fp32 reference at 1, 17, 49 and 64 rows (max |err| beside torch's)
  iso    us a call for each (variant, split) over L copies of the weights (> 400 MB, read from HBM as a verify
         layer does), one CUDA graph of R passes; fraction of copy bandwidth (weights + x + out bytes); torch beside
  layer  a layer's q/k/v -> attention -> o in one launch (`cluster_gemm.layer_qkv_attn_o`, experimental) against
         today's three (q/k/v with RoPE, kernels.rows_attention, o), 32 layers of distinct weights and caches at
         context --layer-ctx, us a layer (docs/verify-persistent-kernel.md: the bar is 44.5 us, 2026-12-04); then
         the one launch's phases from its CTAs' stamps (where the time goes: 56.4 us, 2026-12-04)
  chain  32 layers of q/k/v -> o -> gate/up -> down, each matmul's input the previous one's output (distinct weights:
         14 GB, all from HBM): ms a layer for torch, the kernel with each kind's fastest iso plan (PDL on and off),
         and the kernel with gate/up left to torch; the copy-bandwidth floor beside

    python bench/cluster_gemm.py                       # H200, ~1 min
    python bench/cluster_gemm.py --sections iso --kinds o --splits 1,2,4
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402

SHAPES = common.LLAMA_8B_MATMULS  # iso and check take any of them (--kinds ...,lm_head)
KINDS = {k: v for k, v in SHAPES.items() if k != "lm_head"}  # a layer's: the chain's


def _save_plans(path: str, plans: dict) -> None:
    """A plan a kind as JSON {'N,K': [variant, split]} (what bench/decode.py --cluster-gemm-plans reads)."""
    Path(path).write_text(json.dumps({"{},{}".format(*SHAPES[k]): list(p) for k, p in plans.items()}, indent=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="check,iso,chain", help="check, iso, chain (comma-separated)")
    ap.add_argument("--rows", type=int, default=49, help="forward width (tokens) for iso and chain")
    ap.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help=f"weight kinds for check and iso ({', '.join(SHAPES)}; the chain takes a layer's four). An iso lm_head "
        "plan that beats torch joins the saved plans (the engine then routes the lm_head through the kernel)",
    )
    ap.add_argument("--variants", default="", help="kernel variants (default: all of cluster_gemm.VARIANTS)")
    ap.add_argument("--splits", default="1,2,3,4,6,8", help="CTAs over K a cluster (iso)")
    ap.add_argument("--passes", type=int, default=3, help="passes over the copies in one graph (iso)")
    ap.add_argument("--iso-no-pdl", type=int, default=1, help="iso: also time each plan without PDL (1) or not (0)")
    ap.add_argument(
        "--iso-hot",
        action="store_true",
        help="iso: each shape's weights as one copy, re-read from L2 (the o projection, 33.5 MB, fits the H200's L2): "
        "the kernel's time if the weights were prefetched into L2 during the attention",
    )
    ap.add_argument("--layers", type=int, default=32, help="layers of the chain (and of layer)")
    ap.add_argument("--layer-ctx", type=int, default=512, help="layer: the context before the verify's rows")
    ap.add_argument("--layer-splits", default="4", help="layer: the q/k/v (and the one launch's o) splits")
    ap.add_argument(
        "--chain-plans",
        default="",
        help="chain: more plan sets for the glue-folded layer, 'NAME=kind:variant:split,...;NAME2=...' (kinds not "
        "named keep the iso / PLANS plan), e.g. 'half=gate_up:bn128_half:2,down:bn128_half:6'",
    )
    ap.add_argument(
        "--save-plans",
        help="write iso's fastest plan a shape (PDL on) as JSON {'N,K': [variant, split]} (bench/decode.py "
        "--cluster-gemm-plans reads it)",
    )
    ap.add_argument(
        "--save-chain-plans",
        help="write the plan set of the fastest glue-folded chain row (iso's or a --chain-plans one) as --save-plans "
        "does",
    )
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("cluster_gemm: needs a CUDA device")
        return 1
    from draftsmith.decode.experimental import cluster_gemm as cg
    from draftsmith.decode.kernels import _time_graph

    torch.manual_seed(0)
    sections = set(args.sections.split(","))
    kinds = args.kinds.split(",")
    variants = args.variants.split(",") if args.variants else [v for v in cg.VARIANTS if "nomma" not in v]
    scale_variants = args.variants.split(",") if args.variants else list(cg.VARIANTS)  # + the ring alone
    splits = [int(s) for s in args.splits.split(",")]
    bw = common.measure_copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    m = args.rows
    md, data = [], {"copy_GBps": bw / 1e9}

    if "check" in sections:
        rows_out = []
        for kind in kinds:
            n, k = SHAPES[kind]
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            for rows in (1, 17, 49, 64):
                x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                ref = x.float() @ w.float().t()
                t_err = (torch.mm(x, w.t()).float() - ref).abs().max().item()
                worst = 0.0
                for v in variants:
                    if not cg.supports(x, w, v):
                        continue
                    for s in (1, 2, 4, 8):
                        got = cg.cluster_gemm(x, w, (v, s))
                        worst = max(worst, (got.float() - ref).abs().max().item())
                ok = worst <= max(2 * t_err, 1e-6)
                rows_out.append({"kind": kind, "rows": rows, "torch err": t_err, "kernel err (worst)": worst, "ok": ok})
                print(rows_out[-1], flush=True)
        md.append("check (max |err| against x.float() @ w.float().T):\n\n")
        md.append(common.markdown_table(rows_out, ["kind", "rows", "torch err", "kernel err (worst)", "ok"]))
        data["check"] = rows_out
        if not all(r["ok"] for r in rows_out):
            print("cluster_gemm: CHECK FAILED")

    if "scale" in sections:
        # us a call against K at N = 4096: the slope is the streaming rate, the intercept the fixed cost (launch,
        # prologue, the cluster's reduction and its two barriers)
        rows_out = []
        n = 4096
        for v in scale_variants:
            bn, bk = cg.VARIANTS[v][0], cg.BK
            for s in (1, 4):
                pts = []
                for k in (512, 1024, 2048, 4096, 8192, 14336):
                    if k % bk or s > k // bk:
                        continue
                    copies = max(2, math.ceil(400e6 / (n * k * 2)))
                    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
                    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

                    def fn(v=v, s=s, ws=ws, x=x, out=out):
                        for w in ws:
                            cg.launch(x, w, out, v, s, False)

                    us, _ = _time_graph(fn, copies, 10)
                    if us is not None:
                        pts.append((k, us))
                    del ws
                if len(pts) < 2:
                    continue
                kk = torch.tensor([p[0] * n * 2 / 1e6 for p in pts], dtype=torch.float64)  # MB of weights
                tt = torch.tensor([p[1] for p in pts], dtype=torch.float64)
                A = torch.stack([kk, torch.ones_like(kk)], 1)
                slope, icpt = torch.linalg.lstsq(A, tt[:, None]).solution[:, 0].tolist()
                rows_out.append(
                    {
                        "variant": v,
                        "split": s,
                        "CTAs": (n // bn) * s,
                        "fixed us": icpt,
                        "stream bw": 1.0 / slope * 1e12 / bw,
                        "us by K": " ".join(f"{k}:{t:.1f}" for k, t in pts),
                        "max clusters": cg.max_active_clusters(v, s),
                    }
                )
                print(rows_out[-1], flush=True)
            torch.cuda.empty_cache()
        md.append(f"\nscale (N = 4096, {m} rows, no PDL; us = fixed + weight MB / stream bw):\n\n")
        md.append(
            common.markdown_table(
                rows_out, ["variant", "split", "CTAs", "fixed us", "stream bw", "max clusters", "us by K"]
            )
        )
        data["scale"] = rows_out

    if "prof" in sections:
        # where a call's time goes: each CTA's %globaltimer stamps (cg.PROF_STAMPS) of a cold call (its weights not
        # in L2), eagerly launched (no PDL), relative to the first CTA's start: median and latest over the CTAs
        rows_out = []
        for kind in ("qkv", "o", "down"):
            n, k = SHAPES[kind]
            ws = [
                torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                for _ in range(max(2, math.ceil(200e6 / (n * k * 2))))
            ]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            for v, s in [
                ("bn128", 4),
                ("bn256", 4),
                ("bn256wg4", 4),
                ("bn256wg4", 6),
                ("bn128_half", 6),
                ("bn128_nomma", 4),
            ]:
                if not cg.supports(x, ws[0], v) or s > k // cg.BK:
                    continue
                ctas = (n // cg.VARIANTS[v][0]) * s
                prof = torch.zeros(ctas * len(cg.PROF_STAMPS), dtype=torch.int64, device="cuda")
                for w in ws:
                    cg.launch(x, w, out, v, s, False, prof)
                    torch.cuda.synchronize()
                st = prof.view(ctas, -1).double()
                st = (st - st[:, 0].min()) / 1e3
                med, mx = st.median(0).values.tolist(), st.max(0).values.tolist()
                row = {"kind": kind, "plan": f"{v} s{s} ({ctas} CTAs)"}
                for j, name in enumerate(cg.PROF_STAMPS):
                    row[name] = f"{med[j]:.2f} / {mx[j]:.2f}"
                rows_out.append(row)
                print(row, flush=True)
            del ws
            torch.cuda.empty_cache()
        md.append(f"\nprof (us from the first CTA's start, median / latest CTA; {m} rows, cold, no PDL):\n\n")
        md.append(common.markdown_table(rows_out, ["kind", "plan", *cg.PROF_STAMPS]))
        data["prof"] = rows_out

    if "layer" in sections:
        _layer_section(args, cg, m, md, data)

    best_plan: dict[str, tuple[str, int]] = {}
    if "iso" in sections:
        rows_out = []
        for kind in kinds:
            n, k = SHAPES[kind]
            wbytes = n * k * 2
            # --iso-hot: one copy, re-read from L2 (what a matrix prefetched into L2 during the attention would cost)
            ws = (
                [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02]
                if args.iso_hot
                else common.weight_copies(n, k)
            )
            copies = len(ws)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            calls = copies * args.passes
            nbytes = wbytes + (m * k + m * n) * 2

            t_torch = common.time_torch_mm(x, ws, out, args.passes)
            row = {"kind": kind, "rows": m, "torch us": t_torch, "torch bw": nbytes / t_torch * 1e6 / bw}
            timed = []
            for v in variants:
                if not cg.supports(x, ws[0], v) or "nomma" in v:
                    continue
                for s in splits:
                    if s > min(cg.SPLIT_MAX, k // cg.BK) or (v in cg.LAST and n * s * m * 4 > cg.WS_BYTES):
                        continue
                    for pdl in (True, False) if args.iso_no_pdl else (True,):

                        def fn(v=v, s=s, pdl=pdl):
                            for _ in range(args.passes):
                                for w in ws:
                                    cg.launch(x, w, out, v, s, pdl)

                        us, why = _time_graph(fn, calls, 10)
                        if us is None:
                            print(f"{kind} {v} s{s} pdl={pdl}: {why}", flush=True)
                            continue
                        timed.append((us, v, s, pdl, (n // cg.VARIANTS[v][0]) * s))
            timed.sort()
            on = [t for t in timed if t[3]]
            off = [t for t in timed if not t[3]]
            if on and (kind in KINDS or on[0][0] < t_torch):  # (the lm_head's only where it beats cuBLAS)
                best_plan[kind] = (on[0][1], on[0][2])
            if on:
                row.update(
                    {
                        "best (pdl)": f"{on[0][1]} s{on[0][2]} ({on[0][4]} CTAs)",
                        "us": on[0][0],
                        "bw": nbytes / on[0][0] * 1e6 / bw,
                        "/torch": on[0][0] / t_torch,
                        "best (no pdl)": f"{off[0][1]} s{off[0][2]} {off[0][0]:.2f}us" if off else "-",
                        "plan_for": "{} s{}".format(*cg.plan_for(n, k, sms)),
                        "next": "; ".join(f"{t[1]} s{t[2]} {t[0]:.2f}" for t in on[1:5]),
                    }
                )
            rows_out.append(row)
            print(row, flush=True)
            ws.clear()
            torch.cuda.empty_cache()
        cols = ["kind", "rows", "torch us", "torch bw", "best (pdl)", "us", "bw", "/torch", "best (no pdl)", "plan_for"]
        hot = "; --iso-hot: one weight copy, from L2" if args.iso_hot else ""
        md.append(f"\niso ({m} rows; bw = fraction of copy bandwidth {bw / 1e9:.0f} GB/s{hot}):\n\n")
        md.append(common.markdown_table(rows_out, cols + ["next"]))
        data["iso"] = rows_out

    if "chain" in sections:
        L = args.layers
        H, I2 = KINDS["o"][0], KINDS["gate_up"][0]
        layers = [
            {kind: torch.randn(*KINDS[kind], device="cuda", dtype=torch.bfloat16) * 0.02 for kind in KINDS}
            for _ in range(L)
        ]
        x0 = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
        layer_bytes = sum(n * k * 2 for n, k in KINDS.values())
        plans = {kind: best_plan.get(kind) or cg.plan_for(*KINDS[kind], sms) for kind in KINDS}

        def mm_torch(x, w, kind):
            return torch.mm(x, w.t())

        def chain(mm):
            def run():
                x = x0
                for lw in layers:
                    q = mm(x, lw["qkv"], "qkv")
                    o = mm(q[:, :H], lw["o"], "o")
                    gu = mm(o, lw["gate_up"], "gate_up")
                    x = mm(gu[:, : I2 // 2], lw["down"], "down")
                return x

            return run

        def ours(plans, pdl=True, torch_kinds=(), late=False):
            def mm(x, w, kind):
                if kind in torch_kinds or not cg.supports(x, w, plans[kind][0]):
                    return torch.mm(x, w.t())
                return cg.cluster_gemm(x, w, plans[kind], pdl, late)

            return mm

        # two CTAs an SM: the next matmul's CTAs can sit beside this one's and prefetch while it drains
        half = {
            "qkv": ("bn128_half", 4),
            "o": ("bn128_half", 6),
            "gate_up": ("bn128_half", 2),
            "down": ("bn128_half", 6),
        }
        extra = {}  # --chain-plans
        for spec in filter(None, args.chain_plans.split(";")):
            name, body = spec.split("=", 1)
            extra[name] = dict(plans)
            for item in body.split(","):
                kind, v, sp = item.split(":")
                extra[name][kind] = (v, int(sp))
        # the chosen plans' tiles, each tile's last CTA reducing through L2 (no cluster)
        last = {kind: (v + "_l", s) if v + "_l" in cg.VARIANTS else (v, s) for kind, (v, s) in plans.items()}
        # the layer with what sits between its matmuls (RMSNorm, silu(gate) * up, the residual adds): torch's glue
        # around torch's or our matmuls, against our matmuls with the glue folded (KernelConfig.cluster_gemm_fused)
        from draftsmith.drafter.model import hf_rms_norm

        nws = [(1 + 0.1 * torch.randn(2, H, device="cuda")).to(torch.bfloat16) for _ in range(L)]

        def glued(mm):
            def run():
                h = x0
                for lw, nw in zip(layers, nws):
                    q = mm(hf_rms_norm(h, nw[0], 1e-5), lw["qkv"], "qkv")
                    h = h + mm(q[:, :H], lw["o"], "o")
                    g, u = mm(hf_rms_norm(h, nw[1], 1e-5), lw["gate_up"], "gate_up").chunk(2, -1)
                    h = h + mm(torch.nn.functional.silu(g) * u, lw["down"], "down")
                return h

            return run

        def folded(plans, pdl=True, late=False):
            def run():
                h = x0
                hn, ssq = cg.norm_inputs(h, nws[0][0])
                for i, (lw, nw) in enumerate(zip(layers, nws)):
                    q = cg.fused(hn, lw["qkv"], plans["qkv"], pdl, late, ssq_in=ssq, eps=1e-5)
                    h, hn, ssq = cg.fused(q[:, :H], lw["o"], plans["o"], pdl, late, res=h, nw=nw[1])
                    a = cg.fused(hn, lw["gate_up"], plans["gate_up"], pdl, late, ssq_in=ssq, eps=1e-5, glu=True)
                    nxt = nws[i + 1][0] if i + 1 < L else nw[0]
                    h, hn, ssq = cg.fused(a, lw["down"], plans["down"], pdl, late, res=h, nw=nxt)
                return h

            return run

        ref = chain(mm_torch)()
        got = chain(ours(plans))()
        g_ref, g_got = glued(mm_torch)(), folded(plans)()
        rel_glue = ((g_got.float() - g_ref.float()).norm() / g_ref.float().norm()).item()
        rel = ((got.double() - ref.double()).norm() / ref.double().norm()).item()  # ~5x a layer: fp32 norms overflow
        rows_out = []
        for name, mm in [
            ("torch", mm_torch),
            ("iso plans, pdl", ours(plans)),
            ("iso plans, no pdl", ours(plans, False)),
            ("half plans, pdl", ours(half)),
            ("last-CTA plans, pdl", ours(last)),
            ("last-CTA plans, no pdl", ours(last, False)),
            ("torch", mm_torch),
            ("torch + glue", glued(mm_torch)),
            ("iso plans + torch glue", glued(ours(plans))),
            ("iso plans, glue folded", folded(plans)),
            ("iso plans, glue folded, no pdl", folded(plans, False)),
            # a diagnostic (garbage output): no kernel waits for its predecessor, so only residency orders them —
            # what any flag-chained (persistent) design of these kernels could save at most
            ("iso plans, glue folded, no waits", folded(plans, True, cg.NO_WAIT)),
            *[(f"{name} plans, glue folded", folded(p)) for name, p in extra.items()],
            # the next kernel launches once every CTA here is done with its K loop: where both kernels' CTAs fit on an
            # SM together (<= 113 KB, <= 132 CTAs), its ring streams through this one's exchange and stores
            *[(f"{name} plans, glue folded, late", folded(p, True, True)) for name, p in extra.items()],
            ("torch + glue", glued(mm_torch)),
        ]:
            run = mm if name.endswith("glue") or "folded" in name else chain(mm)
            us, why = _time_graph(run, 4 * L, 5)
            per_layer = us * 4 / 1e3 if us is not None else None
            rows_out.append(
                {
                    "matmuls": name,
                    "ms a layer": per_layer,
                    "x floor": per_layer / (layer_bytes / bw * 1e3) if per_layer else None,
                    "32 layers ms": per_layer * 32 if per_layer else why,
                }
            )
            print(rows_out[-1], flush=True)
        md.append(
            f"\nchain ({L} layers, {m} rows; iso plans {plans}, half plans {half}, last-CTA plans {last}; floor {layer_bytes / bw * 1e3:.4f} ms a layer at copy "
            f"bandwidth; kernel vs torch output after {L} layers: relative L2 {rel:.2e}; glue folded vs torch + glue "
            f"{rel_glue:.2e}; --chain-plans {extra or '-'}):\n\n"
        )
        md.append(common.markdown_table(rows_out, ["matmuls", "ms a layer", "x floor", "32 layers ms"]))
        sets = {"iso plans, glue folded": plans, **{f"{n} plans, glue folded": p for n, p in extra.items()}}
        timed_sets = [(r["ms a layer"], r["matmuls"]) for r in rows_out if r["matmuls"] in sets and r["ms a layer"]]
        if args.save_chain_plans and timed_sets:
            best = sets[min(timed_sets)[1]]
            _save_plans(args.save_chain_plans, {**best, **{k: p for k, p in best_plan.items() if k not in KINDS}})
            md.append(f"\nfastest glue-folded plan set: {min(timed_sets)[1]} ({best})\n")
        data["chain"] = rows_out
        data["plans"] = plans
    if args.save_plans and best_plan:
        _save_plans(args.save_plans, best_plan)
    body = "".join(md)
    print(body)
    if not args.no_append:
        common.record(
            "cluster_gemm",
            "Our CUDA few-row GEMM (split-K in a cluster, PDL) vs torch at the 8B verify's shapes",
            body,
            data,
            "python bench/cluster_gemm.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        )
    return 0


def _layer_section(args, cg, m: int, md: list, data: dict) -> None:
    """The 8B verify layer's q/k/v -> attention -> o, us a layer over `args.layers` layers (distinct weights and
    caches: the weights stream from HBM as in a verify, each layer's next-norm inputs the next layer's x): today's
    three launches — q/k/v with RoPE and the cache writes (the `_rope` instance), kernels.rows_attention (the engine's
    Triton pair), o with the residual (bn128_half at split 6, its 8B plan, and at the one launch's split) — against
    `cluster_gemm.layer_qkv_attn_o`, and the max |difference| of the last layer's outputs."""
    from draftsmith.decode import kernels as K
    from draftsmith.decode.kernel_config import KernelConfig
    from draftsmith.decode.kernels import _time_graph

    L, ctx, nh, nkv, d, H = args.layers, args.layer_ctx, 32, 8, 128, 4096
    cap = ctx + 320
    N = (nh + 2 * nkv) * d
    qkv = [torch.randn(N, H, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(L)]
    ow = [torch.randn(H, nh * d, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(L)]
    nws = [(1 + 0.1 * torch.randn(H, device="cuda")).to(torch.bfloat16) for _ in range(L)]
    caches = [[torch.randn(1, nkv, cap, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)] for _ in range(L)]
    ang = torch.arange(cap, device="cuda")[:, None] * torch.rand(d // 2, device="cuda")[None]
    cos = torch.cat([ang.cos()] * 2, -1).to(torch.bfloat16).contiguous()
    sin = torch.cat([ang.sin()] * 2, -1).to(torch.bfloat16).contiguous()
    pos = torch.arange(ctx, ctx + m, device="cuda")
    # the tests' reference tree mask (a binary tree over the rows after the context), as bench/decode_attention.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from decode_helpers import tree_mask

    mask = tree_mask([(t - 1) // 2 if t else -1 for t in range(m)], cap, ctx).cuda()
    x0 = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    hn0, ssq0 = cg.norm_inputs(x0, nws[0])
    cfg, scale = KernelConfig(), d**-0.5

    def rope_args(i):
        return (pos, pos, cos, sin, caches[i][0], caches[i][1], nh, nkv)

    def three(split, o_split):
        def run():
            hn, ssq = hn0, ssq0
            for i in range(L):
                q = cg.fused(hn, qkv[i], ("bn128_half", split), ssq_in=ssq, eps=1e-5, rope=rope_args(i))
                a = K.rows_attention(q.view(m, nh, d), caches[i][0], caches[i][1], mask, scale, pos, config=cfg)
                _h, hn, ssq = cg.fused(a, ow[i], ("bn128_half", o_split), res=x0, nw=nws[i])
            return hn

        return run

    def one(split):
        def run():
            hn, ssq = hn0, ssq0
            for i in range(L):
                out = cg.layer_qkv_attn_o(hn, qkv[i], ssq, 1e-5, rope_args(i), mask, scale, ow[i], x0, nws[i],
                                          ("bn128_half", split))  # fmt: skip
                hn, ssq = out[3], out[4]
            return hn

        return run

    rows_out = []
    for split in [int(s) for s in args.layer_splits.split(",")]:
        why = cg.layer_refusal(hn0, qkv[0], ow[0], ("bn128_half", split), rope_args(0), mask)
        want = three(split, split)()
        err = float((one(split)().float() - want.float()).abs().max()) if not why else None
        for name, run in (
            ("three launches, o at split 6", three(split, 6)),
            (f"three launches, o at split {split}", three(split, split)),
            ("one launch (layer_qkv_attn_o)", None if why else one(split)),
        ):
            us, why_t = _time_graph(run, L, 5) if run is not None else (None, why)
            row = {
                "q/k/v split": split,
                "layer": name,
                "us a layer": f"{us:.2f}" if us is not None else why_t,
                "max abs diff of the last hn (one launch vs three)": f"{err:.3g}" if err is not None else "-",
            }
            rows_out.append(row)
            print(row, flush=True)
    md.append(f"\nlayer ({m} rows, context {ctx}, {L} layers, 8B heads {nh}/{nkv}x{d}):\n\n")
    md.append(common.markdown_table(rows_out, list(rows_out[0]) if rows_out else []))
    data["layer"] = rows_out
    prof_rows = []
    for split in [int(s) for s in args.layer_splits.split(",")]:
        if cg.layer_refusal(hn0, qkv[0], ow[0], ("bn128_half", split), rope_args(0), mask):
            continue
        prof_rows += _layer_phases(cg, split, L, hn0, ssq0, qkv, ow, nws, x0, rope_args, mask, scale, nh, d)
    if prof_rows:
        md.append(
            "\nlayer phases (one launch, eager with PDL, each CTA's thread 0 stamps; us from the layer's first CTA "
            "start, the median over layers 2..L of each CTA group's median / latest; B: the CTAs with an attention "
            "item; C: the q tiles' CTAs, o):\n\n"
        )
        md.append(common.markdown_table(prof_rows, list(prof_rows[0])))
        data["layer phases"] = prof_rows


def _layer_phases(cg, split, L, hn0, ssq0, qkv, ow, nws, x0, rope_args, mask, scale, nh, d) -> list[dict]:
    """Where a layer's one launch spends its time: the chain run eagerly once more with a stamp buffer a layer
    (`layer_qkv_attn_o(prof=)`), each phase's median and latest CTA, and how the CTAs sit on the SMs."""
    n_pt, n_ls = len(cg.PROF_STAMPS), len(cg.LAYER_STAMPS)
    ctas = qkv[0].shape[0] // 128 * split
    bufs = [torch.zeros(ctas * (n_pt + n_ls), dtype=torch.int64, device="cuda") for _ in range(L)]
    hn, ssq = hn0, ssq0
    for i in range(L):
        out = cg.layer_qkv_attn_o(hn, qkv[i], ssq, 1e-5, rope_args(i), mask, scale, ow[i], x0, nws[i],
                                  ("bn128_half", split), prof=bufs[i])  # fmt: skip
        hn, ssq = out[3], out[4]
    torch.cuda.synchronize()
    n_q = nh * d // 128
    # CTA (x, y) at y * gridDim.x + x; x < n_q are the q tiles
    is_q = (torch.arange(ctas) % (qkv[0].shape[0] // 128)) < n_q
    per = {}
    for i in range(1, L):
        a = bufs[i][: ctas * n_pt].view(ctas, n_pt).double().cpu()
        b = bufs[i][ctas * n_pt :].view(ctas, n_ls).double().cpu()
        t0 = a[:, 0].min()
        has_item = b[:, 2] > 0  # (a KV head's CTAs past its items have none)
        cols = {
            "all: q/k/v stored": (a[:, 5], None),
            "B: ready": (b[:, 2], has_item),
            "B: keys and q in smem": (b[:, 8], has_item),
            "B: scores done (warp 0)": (b[:, 9], has_item),
            "B: partial stored": (b[:, 3], has_item),
            "B: the KV head's items done": (b[:, 4], has_item),
            "B: combined": (b[:, 5], has_item),
            "C: xready": (b[:, 6], is_q),
            "C: o stored": (b[:, 7], is_q),
        }
        for name, (v, sel) in cols.items():
            v = (v if sel is None else v[sel]) - t0
            per.setdefault(name, []).append((float(v.median()) / 1e3, float(v.max()) / 1e3))
        sm = b[:, 0].long()
        q_sms = torch.bincount(sm[is_q], minlength=256)
        per.setdefault("SMs with 2+ q CTAs | most q CTAs an SM", []).append(
            (float((q_sms > 1).sum()), float(q_sms.max()))
        )
        per.setdefault("SMs used: all | q CTAs'", []).append(
            (float(sm.unique().numel()), float(sm[is_q].unique().numel()))
        )
    rows = []
    for name, vals in per.items():
        med = sorted(v[0] for v in vals)[len(vals) // 2]
        mx = sorted(v[1] for v in vals)[len(vals) // 2]
        rows.append({"q/k/v split": split, "phase": name, "median CTA": f"{med:.2f}", "latest CTA": f"{mx:.2f}"})
        print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
