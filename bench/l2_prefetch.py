"""Can a verify's HBM-idle windows feed its next matmul? Weights read from L2 against HBM, and a prefetch into L2 on
a second stream while a layer's attention runs (8B shape, bf16).

Why: a verify layer is matmuls that stream weights (bandwidth-bound) and, between q/k/v and o, the RoPE/cache write
and the attention (~15 us at 49 rows, latency-bound: HBM nearly idle). The o matrix (32 MiB) fits the H200's L2
(50 MiB); fetched there during the attention, o would read from L2. Three measurements, one CUDA graph each:

  1. hot / cold: F.linear over one matrix replayed L times (L2-resident when it fits) against L distinct copies;
  2. the prefetch alone: how fast each prefetch kernel moves a matrix into L2 (loads kept with evict_last, or the
     TMA's bulk L2 prefetch, `cp.async.bulk.prefetch.L2`), by programs;
  3. the window: L layers of q/k/v -> rows_attention -> o (+ residual), without and with o's weights prefetched on
     a side stream forked after q/k/v (or before it), us a layer.

    python bench/l2_prefetch.py                 # H200, ~1 min
    python bench/l2_prefetch.py --rows 1,8,49   # the widths (1: a plain step's, 8: a tree draft step's)
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
KINDS = {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 14336)}
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
        print("l2_prefetch: needs a CUDA GPU and triton")
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
        del mats
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
    plans = [("none", None, 0, "")]
    for m in sorted(ok_methods, key=lambda m: m["us"])[:2]:
        plans += [(f"{m['method']}{m['programs'] or ''} after q/k/v", m["method"], m["programs"], "after")]
        plans += [(f"{m['method']}{m['programs'] or ''} before q/k/v", m["method"], m["programs"], "before")]
    lines += ["", "| rows | o prefetch | us a layer | saved us a layer |", "|---|---|---|---|"]
    for T in widths:
        x, h = rnd(T, H), rnd(T, H)
        pos = args.context + torch.arange(T, device=dev)
        mask = torch.arange(args.cache, device=dev)[None, :] <= pos[:, None]
        evs = [torch.cuda.Event() for _ in range(L)]
        base = None
        for name, method, progs, where in plans:

            def layers(method=method, progs=progs, where=where):
                cur = torch.cuda.current_stream()
                out = None
                for i in range(L):
                    if method and where == "before":
                        evs[i].record(cur)
                    qkv = F.linear(x, qkvs[i])
                    if method and where == "after":
                        evs[i].record(cur)
                    if method:
                        side.wait_event(evs[i])
                        with torch.cuda.stream(side):
                            prefetch(mats[i], method, progs, sink)
                    q = qkv[:, : NH * D].view(T, NH, D)
                    a = K.rows_attention(q, kcs[i], vcs[i], mask, D**-0.5, pos)
                    out = torch.addmm(h, a, mats[i].t())
                if method:
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
    body = (
        f"8B shapes, bf16, {L} distinct copies of each matrix per timed graph (cold) or one matrix replayed {L} times "
        f"(hot: L2-resident when it fits); copy bandwidth {bw / 1e12:.2f} TB/s; attention over a {args.cache}-slot "
        f"cache, {args.context} of context.\n\n" + "\n".join(lines)
    )
    print(body)
    common.record("l2_prefetch", "Weights from L2, and a prefetch into L2 during the attention", body, data,
                  " ".join(sys.argv))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
