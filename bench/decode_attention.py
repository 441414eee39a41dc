"""Attention of a speculative round's multi-token forwards (a tree verify, a tree draft step, a hand-off): the torch
paths of the compact forward against every plan of `kernels.rows_attention`, per layer, over all 32 layers' caches
(Llama-3.1-8B shape: 32 query heads, 8 KV heads, head_dim 128, bf16), each timed as one CUDA graph.

Why: a T=49 verify's attention is latency-bound (3.6 MB of K/V a layer), and the first rows_attention plan took
17 us a layer in the round (2026-12-01) — its fp32 partials (T x heads x chunks x 128) outweighed the K/V. This
ranks the plans (row tile, key block, chunks, warps) per T so the default rule can be set from measurements.

Usage (device):  python bench/decode_attention.py [--tokens 8,49,65] [--cache 880] [--top 12]
                 python bench/decode_attention.py --shape small --tokens 5,16,49 --cache 480 --context 350
                                   (pycode-small's heads: where one split and no combine kernel may win)
                 python bench/decode_attention.py --smoke        (CPU, triton's interpreter: code paths only)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import markdown_table, record  # noqa: E402

# (query heads, KV heads, head_dim, layers)
SHAPES = {"8b": (32, 8, 128, 32), "small": (6, 2, 64, 10)}


def plans(
    T: int,
    G: int,
    S: int,
    smoke: bool,
    stages=(None,),
    block_s=(32, 64),
    chunks=(1, 2, 4, 8, 16),
    live_only: bool = False,
) -> list[tuple[int, int, int, int, int, int | None]]:
    """(block_r, block_s, split_len, warps, live, stages) candidates; block_r at most the rows rounded up. live > 0:
    the chunks split the live keys (up to the forward's highest slot) into `live` parts (`KernelConfig.attn_live_chunks`),
    not the mask's width into split_len-wide ones. stages: the launch's num_stages (None: triton's default)."""
    from draftsmith.decode import kernels as K

    rows = T * G
    out = []
    for br in (16, 32, 64, 128):
        if br > max(16, K.triton.next_power_of_2(rows)):
            continue
        for st in stages:
            for bs in block_s if not live_only else ():
                for n_split in chunks:
                    split_len = -(-S // n_split)
                    split_len = -(-split_len // bs) * bs
                    if -(-S // split_len) != n_split:
                        continue
                    for nw in (4, 8):
                        out.append((br, bs, split_len, nw, 0, st))
            for bs in block_s:
                for live in chunks:
                    for nw in (4, 8):
                        out.append((br, bs, bs, nw, live, st))
    return out[:6] + [p for p in out if p[4]][:2] if smoke else out


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8,49,65", help="query tokens T per forward (tree k=8 step, verify 48/64)")
    ap.add_argument("--cache", type=int, default=880, help="cache slots S (the P2b round's 880)")
    ap.add_argument("--context", type=int, default=512, help="committed slots every row sees")
    ap.add_argument("--top", type=int, default=12, help="plans listed per T (fastest first)")
    ap.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="8b",
        help="attention shape: 8b (Llama-3.1-8B) or small (pycode-small: 6 heads, 2 KV heads, d=64, 10 layers)",
    )
    ap.add_argument(
        "--regs",
        action="store_true",
        help="also the default rule without PDL, and each compiled attention kernel's registers and spills",
    )
    ap.add_argument("--no-sweep", action="store_true", help="only torch's paths and the default rule, no plan sweep")
    ap.add_argument(
        "--stages", default="", help="num_stages values the sweep tries, e.g. 1,2,3,4 (default: triton's own only)"
    )
    ap.add_argument("--block-s", default="32,64", help="key blocks the sweep tries")
    ap.add_argument("--chunks", default="1,2,4,8,16", help="chunk counts the sweep tries (over the width and live)")
    ap.add_argument("--live-only", action="store_true", help="sweep only chunks over the live keys, not the width")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU through triton's interpreter")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from draftsmith.decode import kernels as K
    from draftsmith.decode.kernel_config import KernelConfig
    from draftsmith.decode.llama import grouped_attention, prepare_mask

    # the tests' reference tree mask (built from parent pointers, independent of the engine's own)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from decode_helpers import tree_mask

    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    nh, nkv, d, layers = SHAPES[args.shape] if not args.smoke else (4, 2, 16, 2)
    S, ctx = (args.cache, args.context) if not args.smoke else (48, 30)
    G = nh // nkv
    kcs = [torch.randn(1, nkv, S, d, device=dev, dtype=dtype) for _ in range(layers)]
    vcs = [torch.randn(1, nkv, S, d, device=dev, dtype=dtype) for _ in range(layers)]
    scale = d**-0.5
    rows, best = [], []

    def timed(fn):
        if dev.type != "cuda":
            fn()
            return 0.0, ""
        us, err = K._time_graph(fn, layers, 5)
        return us, err

    for T in [int(t) for t in args.tokens.split(",")] if not args.smoke else [3, 9]:
        # a binary tree over the T nodes (node i's parent (i-1)//2) after the context
        mask = tree_mask([(t - 1) // 2 if t else -1 for t in range(T)], S, min(ctx, S - T)).to(dev)
        qkv = torch.randn(T, nh + 2 * nkv, d, device=dev, dtype=dtype)
        q = qkv[:, :nh]  # the compact forward's view
        ref = (
            grouped_attention(q.transpose(0, 1)[None].float(), kcs[0].float(), vcs[0].float(), mask, scale, "bmm")
            .transpose(1, 2)
            .reshape(T, nh * d)
        )
        res = []
        for impl in ("bmm", "sdpa"):  # as the compact forward's torch path runs them: mask prepared once a forward

            def run(impl=impl):
                am = prepare_mask(mask, G, dtype)
                for kc, vc in zip(kcs, vcs):
                    grouped_attention(q.transpose(0, 1)[None], kc, vc, am, scale, impl).transpose(1, 2).reshape(
                        T, nh * d
                    )

            us, err = timed(run)
            res.append(
                {
                    "T": T,
                    "path": f"torch {impl}",
                    "block_r": "-",
                    "block_s": "-",
                    "chunks": "-",
                    "warps": "-",
                    "us/layer": us,
                    "error": err,
                }
            )
        slots = torch.arange(min(ctx, S - T), min(ctx, S - T) + T, device=dev)  # what the forward wrote
        stages = tuple(int(x) for x in args.stages.split(",")) if args.stages else (None,)
        sweep = plans(
            T,
            G,
            S,
            args.smoke,
            stages,
            tuple(int(x) for x in args.block_s.split(",")),
            tuple(int(x) for x in args.chunks.split(",")),
            args.live_only,
        )
        for br, bs, sl, nw, live, st in sweep if not args.no_sweep else []:
            chunks = f"live {live}" if live else -(-S // sl)

            def attend(kc, vc, br=br, bs=bs, sl=sl, nw=nw, live=live, st=st):
                return K._rows_attention(
                    q,
                    kc,
                    vc,
                    mask,
                    scale,
                    slots,
                    split_len=sl,
                    block_s=bs,
                    block_r=br,
                    num_warps=nw,
                    live_chunks=live,
                    num_stages=st,
                )

            try:
                o = attend(kcs[0], vcs[0])
                diff = float((o.float() - ref).abs().max())
            except Exception as e:  # noqa: BLE001 - a plan this GPU cannot run is a row, not the end
                res.append(
                    {
                        "T": T,
                        "path": "rows_attention",
                        "block_r": br,
                        "block_s": bs,
                        "chunks": chunks,
                        "warps": nw,
                        "stages": st or "-",
                        "us/layer": None,
                        "error": type(e).__name__,
                    }
                )
                continue

            def run(attend=attend):
                for kc, vc in zip(kcs, vcs):
                    attend(kc, vc)

            us, err = timed(run)
            res.append(
                {
                    "T": T,
                    "path": "rows_attention",
                    "block_r": br,
                    "block_s": bs,
                    "chunks": chunks,
                    "warps": nw,
                    "stages": st or "-",
                    "us/layer": us,
                    "max |Δ|": diff,
                    "error": err,
                }
            )

        defaults = [(slots, None, "rows_attention (default rule)"), (None, None, "rows_attention (default, no slots)")]
        if args.regs:
            defaults += [(slots, KernelConfig(pdl=False), "rows_attention (default rule, no PDL)")]
        base = K.rows_attention(q, kcs[0], vcs[0], mask, scale, slots)
        for sl_arg, cfg, label in defaults:

            def run_default(sl_arg=sl_arg, cfg=cfg):
                for kc, vc in zip(kcs, vcs):
                    K.rows_attention(q, kc, vc, mask, scale, sl_arg, config=cfg)

            diff = None
            if cfg is not None:  # the same plan as the default rule's, so its output must match it closely
                diff = float((K.rows_attention(q, kcs[0], vcs[0], mask, scale, slots, config=cfg) - base).abs().max())
            us, err = timed(run_default)
            res.append(
                {
                    "T": T,
                    "path": label,
                    "block_r": "-",
                    "block_s": "-",
                    "chunks": "-",
                    "warps": "-",
                    "us/layer": us,
                    "max |Δ|": diff,
                    "error": err,
                }
            )
        ok = sorted((r for r in res if r["us/layer"] is not None), key=lambda r: r["us/layer"])
        rows += res
        best += ok[: args.top] + [
            r for r in res if (r["path"].startswith("torch") or "default" in r["path"]) and r not in ok[: args.top]
        ]
        for r in ok[:5]:
            print(r, flush=True)
    if args.regs and dev.type == "cuda":  # each specialisation JIT-compiled above: registers, spills, constants
        for dev_cache in getattr(K._rows_attn_kernel, "device_caches", {}).values():
            for key, kern in dev_cache[0].items():
                regs, spills = getattr(kern, "n_regs", "?"), getattr(kern, "n_spills", "?")
                print(f"_rows_attn_kernel regs {regs} spills {spills}: {str(key)[-400:]}", flush=True)
    cols = ["T", "path", "block_r", "block_s", "chunks", "warps", "stages", "us/layer", "max |Δ|", "error"]
    body = (
        f"{args.shape} attention shape ({nh} heads, {nkv} KV heads, d={d}), {S} cache slots, {ctx} of context, tree masks; "
        f"each row one CUDA graph over {layers} layers' caches, us per layer (the fastest {args.top} plans per T, "
        "then torch's paths and the default rule):\n\n" + markdown_table(best, cols)
    )
    if not args.smoke:
        record(
            "decode_attention",
            f"decode attention — multi-token forwards of a round ({args.shape} shape)",
            body,
            {"rows": rows},
            "python bench/decode_attention.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        )
    else:
        print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
