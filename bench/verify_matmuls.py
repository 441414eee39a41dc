"""A verify's matmuls on the 8B shape (bf16): can its HBM-idle windows feed the next matmul (weights from L2 against
HBM, a prefetch into L2 on a second stream while a layer's attention runs), and does cuBLAS fill the GPU better with
K split into a batch (one bmm over K slices, summed after)?

Why: a verify layer is matmuls that stream weights (bandwidth-bound) and, between q/k/v and o, the RoPE/cache write
and the attention (~15 us at 49 rows, latency-bound: HBM nearly idle). The o matrix (32 MiB) fits the H200's L2
(50 MiB); fetched there during the attention, o would read from L2. Three measurements, one CUDA graph each:

  1. hot / cold: F.linear over one matrix replayed L times (L2-resident when it fits) against L distinct copies;
  2. the prefetch alone: how fast each prefetch kernel moves a matrix into L2 (loads kept with evict_last, or the
     TMA's bulk L2 prefetch, `cp.async.bulk.prefetch.L2`), by programs;
  3. the window: L layers of q/k/v -> rows_attention -> o (+ residual), without and with o's weights prefetched on
     a side stream forked after q/k/v (or before it), us a layer;
  4. split-K through cuBLAS: x [T, K] @ W^T as bmm over S slices of K ([S, T, K/S] @ [S, K/S, N], W's own strides,
     no copy; fp32 slices with bmm's out_dtype) then a sum over S, against F.linear. q/k/v's 6,144 outputs in
     cuBLAS's 64-wide tiles are 96 programs on 132 SMs (it reaches ~0.75 of copy bandwidth there).

    python bench/verify_matmuls.py                 # H200, ~1 min
    python bench/verify_matmuls.py --rows 1,8,49   # the widths (1: a plain step's, 8: a tree draft step's)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU machines without triton
    triton = None

# 8B (Llama-3.1-8B) weight kinds: (out, in)
KINDS = {k: common.LLAMA_8B_MATMULS[k] for k in ("qkv", "o", "down")}
H, NH, NKV, D = 4096, 32, 8, 128

if triton is not None:

    @triton.jit
    def _prefetch_load_kernel(w_ptr, sink_ptr, n, BLOCK: tl.constexpr):
        """Reads n int32 of w with evict_last (kept in L2 before evict_first/normal lines), xor-summed into one
        word a program so the loads are not dead code."""
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(pid * BLOCK, n, step):
            offs = start + tl.arange(0, BLOCK)
            acc ^= tl.load(w_ptr + offs, mask=offs < n, other=0, eviction_policy="evict_last")
        tl.store(sink_ptr + pid, tl.xor_sum(acc, 0))

    @triton.jit
    def _prefetch_bulk_kernel(w_ptr, n_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """One TMA bulk prefetch into L2 per lane, CHUNK bytes each (no registers held, nothing waited for)."""
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = idx < n_chunks
        ptrs = w_ptr + tl.where(ok, idx, 0).to(tl.int64) * CHUNK
        size = tl.full([BLOCK], CHUNK, tl.int32)
        tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
            "=r,l,r",
            [ptrs, size],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


def prefetch(w: torch.Tensor, method: str, programs: int, sink: torch.Tensor) -> None:
    """Brings w into L2: method "load" (programs x 8 warps of evict_last loads) or "bulk" (cp.async.bulk.prefetch.L2,
    4 KiB a lane, 128 lanes a program; `programs` ignored)."""
    if method == "load":
        wi = w.view(-1).view(torch.int32)
        _prefetch_load_kernel[(programs,)](wi, sink, wi.numel(), BLOCK=4096, num_warps=8)
    else:
        chunk = 4096
        n = w.numel() * w.element_size() // chunk
        _prefetch_bulk_kernel[(triton.cdiv(n, 128),)](w.view(-1).view(torch.uint8), n, CHUNK=chunk, BLOCK=128)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,49", help="forward widths (tokens) measured")
    ap.add_argument("--layers", type=int, default=8, help="distinct copies of each matrix in one timed graph")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--cache", type=int, default=816)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or triton is None:
        print("verify_matmuls: needs a CUDA GPU and triton")
        return 0
    from draftsmith.decode import kernels as K

    dev, dt = torch.device("cuda"), torch.bfloat16
    bw = common.measure_copy_bandwidth(2.0)
    L = args.layers
    widths = [int(x) for x in args.rows.split(",")]
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device=dev, dtype=dt, generator=g) * 0.02

    def us(run, per):
        t, err = K._time_graph(run, per, 20)
        return None if t is None else t, err

    lines, data = [], {"hot_cold": [], "prefetch": [], "window": []}
    # 1. hot / cold
    lines += ["| matrix | rows | cold us | ÷ bw | hot us (L2) | hot ÷ cold |", "|---|---|---|---|---|---|"]
    for kind, (N, Kd) in KINDS.items():
        mats = [rnd(N, Kd) for _ in range(L)]
        nbytes = N * Kd * 2
        for T in widths:
            x = rnd(T, Kd)
            cold, _ = us(lambda: [F.linear(x, w) for w in mats], L)
            hot, _ = us(lambda: [F.linear(x, mats[0]) for _ in mats], L)
            r = {"matrix": kind, "rows": T, "cold_us": cold, "hot_us": hot, "cold_bw": nbytes / (cold * 1e-6) / bw}
            data["hot_cold"].append(r)
            lines.append(f"| {kind} | {T} | {cold:.1f} | {r['cold_bw']:.3f} | {hot:.1f} | {hot / cold:.2f} |")
            print(lines[-1], flush=True)
    # 2. the prefetch alone (o's shape)
    N, Kd = KINDS["o"]
    mats = [rnd(N, Kd) for _ in range(L)]
    sink = torch.zeros(1024, dtype=torch.int32, device=dev)
    lines += ["", "| prefetch of o (32 MiB) | programs | us | TB/s |", "|---|---|---|---|"]
    for method, progs in [("load", p) for p in (16, 32, 66, 132)] + [("bulk", 0)]:
        try:
            t, err = us(lambda: [prefetch(w, method, progs, sink) for w in mats], L)
        except Exception as e:  # noqa: BLE001 - a method this GPU or triton cannot compile is a row
            t, err = None, f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:100] if str(e).strip() else ''}"
        data["prefetch"].append({"method": method, "programs": progs, "us": t, "error": err})
        tbs = "-" if not t else f"{N * Kd * 2 / (t * 1e-6) / 1e12:.2f}"
        lines.append(f"| {method} | {progs or '-'} | {t if t is None else round(t, 1)} | {tbs} {err or ''} |")
        print(lines[-1], flush=True)
    # 3. the window: q/k/v -> attention -> o (+ residual), o prefetched on a side stream
    qkvs = [rnd(6144, H) for _ in range(L)]
    kcs = [rnd(1, NKV, args.cache, D) * 50 for _ in range(L)]
    vcs = [rnd(1, NKV, args.cache, D) * 50 for _ in range(L)]
    side = torch.cuda.Stream()
    ok_methods = [m for m in data["prefetch"] if m["us"]]
    # (name, method, programs, where, on a side stream): the side stream forks after (or before) q/k/v and joins at
    # the graph's end; "same stream" launches the bulk prefetch between q/k/v and the attention (it only issues the
    # prefetches: the copies into L2 run on while the attention does)
    plans = [("none", None, 0, "", False)]
    if any(m["method"] == "bulk" for m in ok_methods):
        plans += [("bulk, same stream, after q/k/v", "bulk", 0, "after", False)]
    for m in sorted(ok_methods, key=lambda m: m["us"])[:2]:
        tag = f"{m['method']}{m['programs'] or ''}, side stream"
        plans += [(f"{tag}, after q/k/v", m["method"], m["programs"], "after", True)]
        plans += [(f"{tag}, before q/k/v", m["method"], m["programs"], "before", True)]
    lines += ["", "| rows | o prefetch | us a layer | saved us a layer |", "|---|---|---|---|"]
    for T in widths:
        x, h = rnd(T, H), rnd(T, H)
        pos = args.context + torch.arange(T, device=dev)
        mask = torch.arange(args.cache, device=dev)[None, :] <= pos[:, None]
        evs = [torch.cuda.Event() for _ in range(L)]
        base = None
        for name, method, progs, where, forked in plans:

            def layers(method=method, progs=progs, where=where, forked=forked):
                cur = torch.cuda.current_stream()
                out = None
                for i in range(L):
                    if forked and where == "before":
                        evs[i].record(cur)
                    qkv = F.linear(x, qkvs[i])
                    if forked and where == "after":
                        evs[i].record(cur)
                    if forked:
                        side.wait_event(evs[i])
                        with torch.cuda.stream(side):
                            prefetch(mats[i], method, progs, sink)
                    elif method:
                        prefetch(mats[i], method, progs, sink)
                    q = qkv[:, : NH * D].view(T, NH, D)
                    a = K.rows_attention(q, kcs[i], vcs[i], mask, D**-0.5, pos)
                    out = torch.addmm(h, a, mats[i].t())
                if forked:
                    cur.wait_stream(side)
                return out

            try:
                t, err = us(layers, L)
            except Exception as e:  # noqa: BLE001
                t, err = None, f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:100] if str(e).strip() else ''}"
            base = t if name == "none" else base
            saved = "-" if not (t and base) or name == "none" else f"{base - t:.1f}"
            data["window"].append({"rows": T, "plan": name, "us": t, "error": err})
            lines.append(f"| {T} | {name} | {t if t is None else round(t, 1)} {err or ''} | {saved} |")
            print(lines[-1], flush=True)
    # 4. split-K through cuBLAS's batched GEMM
    lines += ["", "| matrix | rows | F.linear us | ÷ bw | split | bmm+sum us | ÷ bw | bmm fp32+sum us | ÷ bw |"]
    lines += ["|---|---|---|---|---|---|---|---|---|"]
    for kind, (N, Kd) in {**KINDS, "gate_up": (28672, 4096)}.items():
        mats = [rnd(N, Kd) for _ in range(L)]
        nbytes = N * Kd * 2
        for T in widths:
            x = rnd(T, Kd)
            base, _ = us(lambda: [F.linear(x, w) for w in mats], L)
            for S in (2, 3, 4, 8):
                if Kd % S:
                    continue
                xs = x.view(T, S, Kd // S).transpose(0, 1)
                ws = [w.view(N, S, Kd // S).permute(1, 2, 0) for w in mats]
                want = F.linear(x.float(), mats[0].float())
                got = torch.bmm(xs, ws[0], out_dtype=torch.float32).sum(0)
                err = (got - want).abs().max().item()
                t16, _ = us(lambda: [torch.bmm(xs, w).sum(0) for w in ws], L)
                t32, _ = us(lambda: [torch.bmm(xs, w, out_dtype=torch.float32).sum(0).to(dt) for w in ws], L)

                def f(t):
                    return ("-", "-") if not t else (f"{t:.1f}", f"{nbytes / (t * 1e-6) / bw:.3f}")

                data["splitk"] = data.get("splitk", []) + [
                    {
                        "matrix": kind,
                        "rows": T,
                        "split": S,
                        "linear_us": base,
                        "bmm_us": t16,
                        "bmm_fp32_us": t32,
                        "max_err_fp32": err,
                    }  # fmt: skip
                ]
                lines.append(
                    f"| {kind} | {T} | {' | '.join(f(base))} | {S} | {' | '.join(f(t16))} | {' | '.join(f(t32))} |"
                )
                print(lines[-1], flush=True)
    body = (
        f"8B shapes, bf16, {L} distinct copies of each matrix per timed graph (cold) or one matrix replayed {L} times "
        f"(hot: L2-resident when it fits); copy bandwidth {bw / 1e12:.2f} TB/s; attention over a {args.cache}-slot "
        f"cache, {args.context} of context.\n\n" + "\n".join(lines)
    )
    print(body)
    common.record("verify_matmuls", "Weights from L2, and a prefetch into L2 during the attention", body, data,
                  " ".join(sys.argv))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
