"""Triton kernels for the bs=1 decode step (opt-in: `LlamaFamilyForward.kernels = "triton"`, engine/CLI
`kernels="triton"`).

Why: an 8B-shape plain step spends 0.90 of copy bandwidth in its weight matmuls alone, but the whole compiled
step reaches 0.74 — the rest is ~16 kernels per layer where ~7 would do (bench/decode_kernels.py, docs/LOG.md).
With every op below a one-token layer is seven kernels (eight with the attention's combine) and nothing else;
how close that comes to the copy bandwidth, against the torch and compiled steps, is in BENCHMARKS.md ("P1").

  gemv(qkv, norm)  ->  rope_and_cache  ->  decode_attention  ->  gemv(o, +residual)
  ->  gemv(gate/up, norm, silu(g)*u)  ->  gemv(down, +residual)

`gemv` folds the neighbours of a matmul into it:

  y = W @ xn (+ bias) (+ residual),   xn = rmsnorm(x) * norm_weight,  or silu(g) * u  (`act_mul`),  or x
  y = silu(W_g @ xn) * (W_u @ xn)     (`glu`: W = cat(W_g, W_u), each program takes the same rows of both)

One program computes BLOCK_N outputs over all of K (no split-K reduce kernel); each program recomputes the
norm's sum of squares of x (K values, L2-resident). The tile is picked per matrix shape by `tune_gemv` (a timed
sweep of `GEMV_CONFIGS` on the GPU, before any graph capture) or is `KernelConfig.block_n`/`block_k`.

`rope_and_cache`: q/k RMSNorm (Qwen3), RoPE on q and k, and the K/V cache writes at the token's slot, one
program per (token, head). `decode_attention`: flash-decoding for one query token — the query heads that share a
KV head are one tile (the cache is read once), the keys are split into chunks of one or two 32-key blocks that
run as their own programs (a one-token attention is a chain of dependent loads: short chains over many programs
win), then one small combine kernel. `rows_attention`: the same for T tokens with a mask row each (a speculative
round's verify, hand-off and tree draft steps, which keep cuBLAS for their matmuls): the tile's rows are the
(token, query head) pairs of a KV head, and the keys end at the highest slot the forward wrote, so the K/V loads
pipeline without waiting for the mask (one kernel pair where torch runs two batched matmuls and a softmax; timings
in BENCHMARKS.md, "decode attention"). It is a torch custom op, so compiled forwards can call it.

Rounding follows the torch path op for op (HF's RMSNorm: fp32 normalise, round to the model dtype, times the
weight, round; the matmul accumulates in fp32 and rounds once; the residual add rounds again; RoPE rounds each
product and the sum, as `q * cos + rotate_half(q) * sin` in the model dtype does), so outputs match it up to
summation order. Attention keeps scores and softmax in fp32 (as SDPA's fused kernels do).

Runs on CUDA, and on CPU tensors under `TRITON_INTERPRET=1` (the tests). `available()` says whether triton
imports at all; without it the compact forward keeps its torch path.
"""

from __future__ import annotations

import os

import torch

from draftsmith.decode.kernel_config import GEMV_CONFIGS, KernelConfig

try:  # an optional dependency: the CUDA wheels of torch bring it, the CPU wheel does not
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001
    triton = tl = None
try:  # grid dependency control (programmatic dependent launch), triton >= 3.4 on sm_90+
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except Exception:  # noqa: BLE001
    gdc_launch_dependents = gdc_wait = None


# Launch settings (gemv tiles, the tuned tables, PDL) arrive as a `KernelConfig` (`kernel_config.py`: the runner
# owns one, benchmarks pass their own); no module state here changes how a kernel is launched.
# the norm prologue reads x in blocks of up to this many values (one L2 round trip for a 4k-8k hidden size)
NORM_BLOCK_MAX = 8192

# decode_attention's default plan: keys per block, and at most this many chunks per KV head — the smallest chunk
# of ATTN_BLOCK_S * 2^j keys that keeps within it. Chosen from whole-step timings of every plan
# (bench/decode_kernels.py --attn-sweep, docs/LOG.md): one or two 32-key blocks per program won at short and long
# caches over the plans `tune_attention` prefers when attention is timed alone (other kernels share the memory system).
ATTN_BLOCK_S = 32
ATTN_TARGET_CHUNKS = 64
# The sweep of `tune_attention`: (BLOCK_S, key blocks per program, num_warps); 0 blocks = one program per KV head.
# One query token's attention is latency-bound (a few kB per KV head per block): short chains of loads over many
# programs beat long ones, down to the extra combine kernel's cost.
ATTN_CONFIGS = (
    (64, 0, 4),
    (16, 2, 4),
    (16, 4, 4),
    (32, 1, 2),
    (32, 2, 2),
    (32, 1, 4),
    (32, 2, 4),
    (32, 4, 4),
    (64, 1, 4),
    (64, 2, 4),
    (64, 4, 4),
    (64, 8, 4),
    (64, 1, 8),
    (64, 2, 8),
    (128, 1, 8),
    (128, 2, 8),
)
ATTN_MAX_SPLIT = 128  # chunks per KV head the combine kernel takes (its tile is [chunks, head_dim] fp32)

# Programmatic dependent launch: each kernel lets the next one launch as soon as all its own programs have started,
# and waits (griddepcontrol.wait) for the previous kernel to finish only before it reads what that kernel wrote or
# writes anything — so a gemv's first weight block is in flight while the previous kernel drains, and the launch
# latency and ramp of ~230 kernels a step overlap their predecessors. Used on CUDA when the GPU (sm_90+) and triton
# support it; `KernelConfig.pdl = False` turns it off (bench/decode_kernels.py --pdl off,on measures both).

# triton's interpreter (3.9) computes tl.dot of bf16 tiles wrongly; there the tiles are upcast first, which gives
# the same products (bf16 x bf16 is exact in fp32) and the same fp32 accumulation
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def available() -> bool:
    return triton is not None


def interpreted() -> bool:
    """Whether the kernels run in triton's interpreter (CPU tensors, tests) rather than compiled for a GPU."""
    return _INTERPRET


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


if triton is not None:

    @triton.jit
    def _pdl_start(USE_PDL: tl.constexpr):
        """Programmatic dependent launch for a kernel that touches shared data at once: let the next kernel launch,
        then wait for the previous one to finish (a kernel that can prefetch first, the gemv, waits later)."""
        if USE_PDL:
            gdc_launch_dependents()
            gdc_wait()

    @triton.jit
    def _rms_apply(x, rstd, nw, out_ty: tl.constexpr):
        """HF's RMSNorm of x given its 1/rms: normalise in fp32, round to the model dtype, times the weight, round."""
        xn = (x.to(tl.float32) * rstd).to(out_ty)
        return (nw.to(tl.float32) * xn.to(tl.float32)).to(out_ty)

    @triton.jit
    def _silu_mul(g, u, out_ty: tl.constexpr):
        """silu(g) * u as two torch ops in the model dtype: g, u fp32 (already model-dtype values); torch's silu
        x / (1 + exp(-x)) in fp32, rounded, times u, rounded."""
        a = (g / (1.0 + tl.exp(-g))).to(out_ty)
        return (a.to(tl.float32) * u).to(out_ty)

    @triton.jit
    def _gemv_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        nw_ptr,
        b_ptr,
        r_ptr,
        N,
        K,
        stride_w,
        eps,
        e_ptr,
        id_ptr,
        nw2_ptr,
        pv_ptr,
        pi_ptr,
        cnt_ptr,
        map_ptr,
        HAS_NORM: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_RES: tl.constexpr,
        ACT_MUL: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        NORM_BLOCK: tl.constexpr,
        PREFETCH: tl.constexpr,
        USE_PDL: tl.constexpr,
        GLU: tl.constexpr,
        EMBED: tl.constexpr,
        ARGMAX: tl.constexpr = False,
        P_BLOCK: tl.constexpr = 1,
        q_ptr=None,
        kc_ptr=None,
        vc_ptr=None,
        cos_ptr=None,
        sin_ptr=None,
        pos_ptr=None,
        slot_ptr=None,
        stride_cache_h=0,
        NH=0,
        NKV=0,
        ROPE: tl.constexpr = False,
        HALF: tl.constexpr = 1,
    ):
        """One program: BLOCK_N outputs of the one row x over all of K (`gemv`): the norm prologue, the K loop
        (PIPELINED: each iteration issues the next block's weight load before summing its own), the folds, the store.
        With EMBED (an EAGLE-3 drafter's first layer), the input is cat(rmsnorm(e[id]) * nw, rmsnorm(x) * nw2) of
        K = 2 * (x's K / 2) features: the embedding gather, both norms and the concatenation folded in. With ARGMAX
        (`gemv(argmax_map=)`) the outputs are not stored: y[0] = map[argmax] (`_argmax_epilogue`). With ROPE (a
        fused q/k/v projection, `gemv(rope=)`) output n is the pair of rows (h * 2 HALF + j, + HALF) of head h = n //
        HALF, j = n % HALF — the two elements RoPE rotates together — so the epilogue rotates q and k heads and writes
        q to q_ptr and k, v to the caches at the token's slot (`_rope_cache_kernel`'s work, one launch fewer)."""
        if USE_PDL:
            gdc_launch_dependents()
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        r1 = rn
        if ROPE:
            head = rn // HALF
            r1 = head * (2 * HALF) + (rn - head * HALF)
        row = r1.to(tl.int64) * stride_w  # int64: a 256k-vocab x 16k lm_head passes 2^31 elements
        row2 = row
        if GLU:  # w = cat(gate, up): this program's up rows sit N rows below its gate rows
            row2 = (rn + N).to(tl.int64) * stride_w
        if ROPE:  # the rotation partner of each row, HALF rows below it in its head
            row2 = (r1 + HALF).to(tl.int64) * stride_w
        PAIR: tl.constexpr = GLU or ROPE
        w_first = tl.zeros([BLOCK_N, BLOCK_K], dtype=w_ptr.dtype.element_ty)
        w2_first = w_first
        PIPELINED: tl.constexpr = PREFETCH or USE_PDL
        if PIPELINED:  # the weights are no kernel's output: their first block loads before the wait
            rk0 = tl.arange(0, BLOCK_K)
            m0 = n_ok[:, None] & (rk0 < K)[None, :]
            w_first = tl.load(w_ptr + row[:, None] + rk0[None, :], mask=m0, other=0.0)
            if PAIR:
                w2_first = tl.load(w_ptr + row2[:, None] + rk0[None, :], mask=m0, other=0.0)
        if USE_PDL:
            gdc_wait()  # x, the residual and y are shared with the previous kernels
        out_ty = x_ptr.dtype.element_ty  # (y's too; with ARGMAX y_ptr is the token's)
        w_mask_n = n_ok[:, None]
        rstd = 1.0
        rstd2 = 1.0
        e_row = e_ptr
        if EMBED:  # the row's token embedding; each half's own 1/rms, over its K // 2 features
            E = K // 2
            e_row = e_ptr + tl.load(id_ptr).to(tl.int64) * E
            ss = tl.zeros([NORM_BLOCK], dtype=tl.float32)
            ss2 = tl.zeros([NORM_BLOCK], dtype=tl.float32)
            for k0 in range(0, E, NORM_BLOCK):
                rk = k0 + tl.arange(0, NORM_BLOCK)
                ev = tl.load(e_row + rk, mask=rk < E, other=0.0).to(tl.float32)
                xv = tl.load(x_ptr + rk, mask=rk < E, other=0.0).to(tl.float32)
                ss += ev * ev
                ss2 += xv * xv
            rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / E + eps)
            rstd2 = 1.0 / tl.sqrt(tl.sum(ss2, axis=0) / E + eps)
        elif HAS_NORM:
            ss = tl.zeros([NORM_BLOCK], dtype=tl.float32)
            for k0 in range(0, K, NORM_BLOCK):
                rk = k0 + tl.arange(0, NORM_BLOCK)
                xv = tl.load(x_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
                ss += xv * xv
            rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # up's products with GLU (else unused)
        w_next = w_first
        w2_next = w2_first
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            if PIPELINED:  # this block's weights were loaded last iteration; issue the next block's now
                w = w_next
                rk1 = rk + BLOCK_K
                m1 = w_mask_n & (rk1 < K)[None, :]
                w_next = tl.load(w_ptr + row[:, None] + rk1[None, :], mask=m1, other=0.0)
                if PAIR:
                    w2 = w2_next
                    w2_next = tl.load(w_ptr + row2[:, None] + rk1[None, :], mask=m1, other=0.0)
            else:
                w = tl.load(w_ptr + row[:, None] + rk[None, :], mask=w_mask_n & k_ok[None, :], other=0.0)
                if PAIR:
                    w2 = tl.load(w_ptr + row2[:, None] + rk[None, :], mask=w_mask_n & k_ok[None, :], other=0.0)
            if EMBED:  # features [0, K/2): the embedding row's, [K/2, K): x's, each with its norm
                lo = rk < K // 2
                hi = k_ok & (rk >= K // 2)
                xv = tl.where(
                    lo, tl.load(e_row + rk, mask=lo, other=0.0), tl.load(x_ptr + rk - K // 2, mask=hi, other=0.0)
                )
                nwv = tl.where(
                    lo, tl.load(nw_ptr + rk, mask=lo, other=0.0), tl.load(nw2_ptr + rk - K // 2, mask=hi, other=0.0)
                )
                xv = _rms_apply(xv, tl.where(lo, rstd, rstd2), nwv, out_ty)
            else:
                xv = tl.load(x_ptr + rk, mask=k_ok, other=0.0)
                if HAS_NORM:
                    xv = _rms_apply(xv, rstd, tl.load(nw_ptr + rk, mask=k_ok, other=0.0), out_ty)
            if ACT_MUL:  # x = cat(gate, up) of 2K values
                u = tl.load(x_ptr + K + rk, mask=k_ok, other=0.0).to(tl.float32)
                xv = _silu_mul(xv.to(tl.float32), u, out_ty)
            xf = xv.to(tl.float32)[None, :]
            acc += w.to(tl.float32) * xf
            if PAIR:
                acc2 += w2.to(tl.float32) * xf
        y = tl.sum(acc, axis=1)
        if ROPE:
            _rope_epilogue(
                y, tl.sum(acc2, axis=1), r1, rn, n_ok, b_ptr, q_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, pos_ptr,
                slot_ptr, stride_cache_h, NH, NKV, HAS_BIAS, HALF, out_ty,
            )  # fmt: skip
        else:
            if HAS_BIAS:
                y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            if GLU:  # silu(gate) * up in the epilogue: each projection rounded, silu rounded, the product rounded
                u = tl.sum(acc2, axis=1)
                if HAS_BIAS:
                    u += tl.load(b_ptr + N + rn, mask=n_ok, other=0.0).to(tl.float32)
                y = _silu_mul(y.to(out_ty).to(tl.float32), u.to(out_ty).to(tl.float32), out_ty).to(tl.float32)
            if HAS_RES:  # the linear's output is rounded before the residual add, as two torch ops would
                y = y.to(out_ty).to(tl.float32) + tl.load(r_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            if ARGMAX:
                _argmax_epilogue(
                    y.to(out_ty).to(tl.float32), rn, n_ok, N, pid, y_ptr, pv_ptr, pi_ptr, cnt_ptr, map_ptr, P_BLOCK
                )
            else:
                tl.store(y_ptr + rn, y.to(out_ty), mask=n_ok)

    @triton.jit
    def _rope_epilogue(
        a,
        b,
        r1,
        rn,
        n_ok,
        b_ptr,
        q_ptr,
        kc_ptr,
        vc_ptr,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        slot_ptr,
        stride_cache_h,
        NH,
        NKV,
        HAS_BIAS: tl.constexpr,
        HALF: tl.constexpr,
        out_ty: tl.constexpr,
    ):
        """`gemv(rope=)`'s end: a, b the sums of rows r1 and r1 + HALF of head r1 // (2 HALF). Rounded as the
        projection's output, then for q and k heads rotated as `_rope_cache_kernel` rounds it (each product, then
        the sum: x * cos + rotate_half(x) * sin in the model dtype); q heads to q_ptr, k and v heads to their cache
        rows at the token's slot."""
        D: tl.constexpr = 2 * HALF
        if HAS_BIAS:
            a += tl.load(b_ptr + r1, mask=n_ok, other=0.0).to(tl.float32)
            b += tl.load(b_ptr + r1 + HALF, mask=n_ok, other=0.0).to(tl.float32)
        a = a.to(out_ty).to(tl.float32)
        b = b.to(out_ty).to(tl.float32)
        head = rn // HALF
        j = rn - head * HALF
        pos = tl.load(pos_ptr).to(tl.int64)
        c1 = tl.load(cos_ptr + pos * D + j, mask=n_ok, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + pos * D + j + HALF, mask=n_ok, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + pos * D + j, mask=n_ok, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + pos * D + j + HALF, mask=n_ok, other=0.0).to(tl.float32)
        o1 = ((a * c1).to(out_ty).to(tl.float32) + (-b * s1).to(out_ty).to(tl.float32)).to(out_ty)
        o2 = ((b * c2).to(out_ty).to(tl.float32) + (a * s2).to(out_ty).to(tl.float32)).to(out_ty)
        rot = head < NH + NKV
        o1 = tl.where(rot, o1, a.to(out_ty))
        o2 = tl.where(rot, o2, b.to(out_ty))
        slot = tl.load(slot_ptr).to(tl.int64)
        is_q = n_ok & (head < NH)
        tl.store(q_ptr + head * D + j, o1, mask=is_q)
        tl.store(q_ptr + head * D + j + HALF, o2, mask=is_q)
        kv = tl.where(head < NH + NKV, head - NH, head - NH - NKV).to(tl.int64) * stride_cache_h + slot * D + j
        is_k = n_ok & (head >= NH) & (head < NH + NKV)
        is_v = n_ok & (head >= NH + NKV)
        tl.store(kc_ptr + kv, o1, mask=is_k)
        tl.store(kc_ptr + kv + HALF, o2, mask=is_k)
        tl.store(vc_ptr + kv, o1, mask=is_v)
        tl.store(vc_ptr + kv + HALF, o2, mask=is_v)

    @triton.jit
    def _argmax_epilogue(y, rn, n_ok, N, pid, tok_ptr, pv_ptr, pi_ptr, cnt_ptr, map_ptr, P_BLOCK: tl.constexpr):
        """`gemv(argmax_map=)`'s end: each program's largest output (the first on ties) and its index go to the
        partial buffers; the program that arrives last (a counter, acq_rel atomics) reduces them, stores map[index] at
        tok_ptr and resets the counter for the next launch. y: the outputs as the model dtype rounds them (the logits
        torch's argmax would see), so the token is torch.argmax's: the first index of the largest value. NaN outputs
        (a broken drafter) give some valid id, never a read past the map."""
        y = tl.where(n_ok, y, float("-inf"))
        tl.store(pv_ptr + pid, tl.max(y, axis=0))
        tl.store(pi_ptr + pid, tl.min(tl.where((y == tl.max(y, axis=0)) & n_ok, rn, 2147483647), axis=0))
        n_prog = tl.num_programs(0)
        # every thread's stores before the one atomic (a CTA barrier), whose acq_rel at GPU scope publishes them to
        # the last program's loads (from L2, not a possibly stale L1: .cg)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
        if done == n_prog - 1:
            rp = tl.arange(0, P_BLOCK)
            ok = rp < n_prog
            pv = tl.load(pv_ptr + rp, mask=ok, other=float("-inf"), cache_modifier=".cg")
            pi = tl.load(pi_ptr + rp, mask=ok, other=2147483647, cache_modifier=".cg")
            best = tl.min(tl.where(pv == tl.max(pv, axis=0), pi, 2147483647), axis=0)
            tl.store(tok_ptr, tl.load(map_ptr + tl.minimum(best, N - 1)))
            tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _rope_cache_kernel(
        qkv_ptr,
        q_ptr,
        kc_ptr,
        vc_ptr,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        slot_ptr,
        qkn_ptr,
        stride_t,
        stride_cache_h,
        eps,
        NH: tl.constexpr,
        NKV: tl.constexpr,
        D: tl.constexpr,
        HAS_QKN: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        _pdl_start(USE_PDL)
        t = tl.program_id(0)
        hd = tl.program_id(1)  # 0..NH-1: q heads, then NKV k heads, then NKV v heads
        rd = tl.arange(0, D)
        base = qkv_ptr + t * stride_t + hd * D
        x = tl.load(base + rd)
        ty = x.dtype
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if hd < NH + NKV:
            partner = (rd + D // 2) % D  # rotate_half(x)[i] = -x[i + D/2] for i < D/2, x[i - D/2] after
            x2 = tl.load(base + partner)
            if HAS_QKN:
                xf = x.to(tl.float32)
                rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
                w1 = tl.load(qkn_ptr + hd * D + rd).to(tl.float32)
                w2 = tl.load(qkn_ptr + hd * D + partner).to(tl.float32)
                x = (w1 * (xf * rstd).to(ty).to(tl.float32)).to(ty)
                x2 = (w2 * (x2.to(tl.float32) * rstd).to(ty).to(tl.float32)).to(ty)
            pos = tl.load(pos_ptr + t).to(tl.int64)
            c = tl.load(cos_ptr + pos * D + rd).to(tl.float32)
            s = tl.load(sin_ptr + pos * D + rd).to(tl.float32)
            sign = tl.where(rd < D // 2, -1.0, 1.0)
            a = (x.to(tl.float32) * c).to(ty).to(tl.float32)
            b = (sign * x2.to(tl.float32) * s).to(ty).to(tl.float32)
            y = (a + b).to(ty)
            if hd < NH:
                tl.store(q_ptr + (t * NH + hd) * D + rd, y)
            else:
                tl.store(kc_ptr + (hd - NH) * stride_cache_h + slot * D + rd, y)
        else:
            tl.store(vc_ptr + (hd - NH - NKV) * stride_cache_h + slot * D + rd, x)

    @triton.jit
    def _softmax_step(q, k, v, vis, m, l_sum, acc, scale, IEEE: tl.constexpr):
        """One key block of flash attention: scores q k^T (fp32), masked by vis (True = attend), folded into the
        running max m, sum l_sum and output acc [rows, D] (fp32) -> (m, l_sum, acc)."""
        if IEEE:  # fp32 models (and the interpreter): no TF32 in the scores
            sc = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        sc = tl.where(vis, sc * scale, -1.0e30)
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.where(vis, tl.exp(sc - m_new[:, None]), 0.0)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        return m_new, l_sum, acc * alpha[:, None] + pv

    @triton.jit
    def _attn_split_kernel(
        q_ptr,
        kc_ptr,
        vc_ptr,
        mask_ptr,
        o_ptr,
        pm_ptr,
        pl_ptr,
        po_ptr,
        S,
        split_len,
        n_split,
        stride_cache_h,
        scale,
        G: tl.constexpr,
        BLOCK_R: tl.constexpr,
        D: tl.constexpr,
        BLOCK_S: tl.constexpr,
        SINGLE: tl.constexpr,
        IEEE: tl.constexpr,
        USE_PDL: tl.constexpr,
        slot_ptr=None,
        LIVE: tl.constexpr = False,
    ):
        """One query token's attention over key chunk `sp` (flash-decoding): split_len keys a chunk, or with LIVE
        the live keys (up to the token's slot, `slot_ptr`) in n_split equal chunks of whole blocks — the grid is
        fixed at capture, the chunks follow the context at every replay (`KernelConfig.attn_live_chunks`)."""
        _pdl_start(USE_PDL)
        h = tl.program_id(0)  # KV head: its G query heads are the rows of one tile
        sp = tl.program_id(1)  # key chunk
        rr = tl.arange(0, BLOCK_R)
        rd = tl.arange(0, D)
        r_ok = rr < G
        q = tl.load(q_ptr + (h * G + rr)[:, None] * D + rd[None, :], mask=r_ok[:, None], other=0.0)
        m = tl.full([BLOCK_R], -1.0e30, tl.float32)  # "-inf" that keeps exp(m_old - m_new) finite when all masked
        l_sum = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, D], tl.float32)
        kbase = kc_ptr + h.to(tl.int64) * stride_cache_h
        vbase = vc_ptr + h.to(tl.int64) * stride_cache_h
        if LIVE:
            kv_hi = tl.minimum(tl.load(slot_ptr).to(tl.int32) + 1, S)
            span = tl.cdiv(tl.cdiv(kv_hi, n_split), BLOCK_S) * BLOCK_S
            start = sp * span
            stop = tl.minimum(start + span, kv_hi)
        else:
            start = sp * split_len
            stop = start + split_len
        for s0 in range(start, stop, BLOCK_S):
            rs = s0 + tl.arange(0, BLOCK_S)
            s_ok = (rs < S) & (rs < stop)
            valid = s_ok & (tl.load(mask_ptr + rs, mask=s_ok, other=0) != 0)
            # keys no mask row sees are not read (masked lanes issue no loads): the cache's unused tail costs a mask
            # read, not a K/V read, so attention time follows the context, not the cache capacity. Branch-free, so
            # the next block's loads can be issued early.
            k = tl.load(kbase + rs[:, None] * D + rd[None, :], mask=valid[:, None], other=0.0)
            v = tl.load(vbase + rs[:, None] * D + rd[None, :], mask=valid[:, None], other=0.0)
            m, l_sum, acc = _softmax_step(q, k, v, valid[None, :], m, l_sum, acc, scale, IEEE)
        rows = h * G + rr
        if SINGLE:
            out = acc / l_sum[:, None]
            tl.store(o_ptr + rows[:, None] * D + rd[None, :], out.to(o_ptr.dtype.element_ty), mask=r_ok[:, None])
        else:  # partials of chunk sp, laid out [head rows, n_split]
            idx = rows * n_split + sp
            tl.store(pm_ptr + idx, m, mask=r_ok)
            tl.store(pl_ptr + idx, l_sum, mask=r_ok)
            tl.store(po_ptr + idx[:, None] * D + rd[None, :], acc, mask=r_ok[:, None])

    @triton.jit
    def _rows_attn_kernel(
        q_ptr,
        kc_ptr,
        vc_ptr,
        mask_ptr,
        slot_ptr,
        o_ptr,
        pm_ptr,
        pl_ptr,
        po_ptr,
        T,
        S,
        split_len,
        n_split,
        stride_qt,
        stride_qh,
        stride_mt,
        stride_cache_h,
        scale,
        NH: tl.constexpr,
        G: tl.constexpr,
        BLOCK_R: tl.constexpr,
        D: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_T: tl.constexpr,
        HAS_SLOTS: tl.constexpr,
        SINGLE: tl.constexpr,
        IEEE: tl.constexpr,
        USE_PDL: tl.constexpr,
        LIVE: tl.constexpr = False,
    ):
        """`_attn_split_kernel` for T query tokens, each with its own mask row (a tree verify): the rows of a tile
        are (token, query head of this KV head) pairs, token-major, BLOCK_R of them per program. With HAS_SLOTS the
        keys read are those up to the highest slot this forward wrote (a scalar bound, so the K/V loads do not
        wait for the mask tile and pipeline across key blocks); else a key block is read where any row of the tile
        sees one of its keys."""
        _pdl_start(USE_PDL)
        if HAS_SLOTS:
            rt = tl.arange(0, BLOCK_T)
            kv_hi = tl.max(tl.load(slot_ptr + rt, mask=rt < T, other=0), axis=0).to(tl.int32) + 1
        else:
            kv_hi = S
        h = tl.program_id(0)  # KV head
        sp = tl.program_id(1)  # key chunk
        rr = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
        rd = tl.arange(0, D)
        t = rr // G
        qh = h * G + rr % G  # query head
        r_ok = t < T
        q = tl.load(
            q_ptr + t[:, None] * stride_qt + qh[:, None] * stride_qh + rd[None, :], mask=r_ok[:, None], other=0.0
        )
        m = tl.full([BLOCK_R], -1.0e30, tl.float32)
        l_sum = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, D], tl.float32)
        kbase = kc_ptr + h.to(tl.int64) * stride_cache_h
        vbase = vc_ptr + h.to(tl.int64) * stride_cache_h
        if LIVE:  # (with HAS_SLOTS) the live keys in n_split equal chunks of whole blocks, as `_attn_split_kernel`
            live = tl.minimum(kv_hi, S)
            span = tl.cdiv(tl.cdiv(live, n_split), BLOCK_S) * BLOCK_S
            start = sp * span
            stop = tl.minimum(start + span, live)
        else:
            start = sp * split_len
            stop = tl.minimum(start + split_len, tl.minimum(kv_hi, S))
        for s0 in range(start, stop, BLOCK_S):
            rs = s0 + tl.arange(0, BLOCK_S)
            s_ok = rs < stop
            vis = (
                tl.load(mask_ptr + t[:, None] * stride_mt + rs[None, :], mask=r_ok[:, None] & s_ok[None, :], other=0)
                != 0
            )
            if HAS_SLOTS:
                seen = s_ok
            else:
                seen = tl.max(vis.to(tl.int32), axis=0) > 0  # keys no row of this tile sees are not read
            k = tl.load(kbase + rs[:, None] * D + rd[None, :], mask=seen[:, None], other=0.0)
            v = tl.load(vbase + rs[:, None] * D + rd[None, :], mask=seen[:, None], other=0.0)
            m, l_sum, acc = _softmax_step(q, k, v, vis, m, l_sum, acc, scale, IEEE)
        rows = t * NH + qh  # output row [T, NH] token-major, as the combine kernel's rows
        if SINGLE:  # (a padding row sees nothing: l = 0, not stored)
            out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
            tl.store(o_ptr + rows[:, None] * D + rd[None, :], out.to(o_ptr.dtype.element_ty), mask=r_ok[:, None])
        else:
            idx = rows * n_split + sp
            tl.store(pm_ptr + idx, m, mask=r_ok)
            tl.store(pl_ptr + idx, l_sum, mask=r_ok)
            tl.store(po_ptr + idx[:, None] * D + rd[None, :], acc, mask=r_ok[:, None])

    @triton.jit
    def _attn_combine_kernel(
        o_ptr, pm_ptr, pl_ptr, po_ptr, n_split, D: tl.constexpr, BLOCK_SP: tl.constexpr, USE_PDL: tl.constexpr
    ):
        _pdl_start(USE_PDL)
        row = tl.program_id(0)  # query head
        rp = tl.arange(0, BLOCK_SP)
        rd = tl.arange(0, D)
        p_ok = rp < n_split
        idx = row * n_split + rp
        ms = tl.load(pm_ptr + idx, mask=p_ok, other=-1.0e30)
        ls = tl.load(pl_ptr + idx, mask=p_ok, other=0.0)
        w = tl.exp(ms - tl.max(ms, axis=0))  # a chunk with every key masked has m = -1e30: weight 0
        os = tl.load(po_ptr + idx[:, None] * D + rd[None, :], mask=p_ok[:, None], other=0.0)
        out = tl.sum(w[:, None] * os, axis=0) / tl.sum(w * ls, axis=0)
        tl.store(o_ptr + row * D + rd, out.to(o_ptr.dtype.element_ty))


def pdl_supported(device) -> bool:
    """Whether programmatic dependent launch can be used on `device`: CUDA sm_90+, triton with grid dependency
    control, not the interpreter."""
    if triton is None or gdc_wait is None or _INTERPRET or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


_PDL_CACHE: dict = {}


def _pdl(t: torch.Tensor, want: bool) -> dict:
    """The launch arguments that turn programmatic dependent launch on (if `want` and the device supports it) or
    off for a kernel on t's device."""
    if t.device not in _PDL_CACHE:
        _PDL_CACHE[t.device] = pdl_supported(t.device)
    on = want and _PDL_CACHE[t.device]
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}


def _need():
    if triton is None:
        raise RuntimeError("triton is not installed: the compact forward's torch path needs no kernels")


# Under torch.compile (a round traced whole, `SpeculativeDecoder.compile_rounds`) `gemv`, `rope_and_cache` and
# `decode_attention` (and experimental.gemm_rows) dispatch to torch custom ops: dynamo does not trace a Triton launch,
# an opaque operator it places between inductor's own kernels, which fuse the glue around it. An operator's arguments
# are tensors and scalars, so the launch settings travel as a key into this table (configs are kept for the process:
# a handful of small objects).
_CONFIGS: dict[int, KernelConfig] = {}


def config_key(config: KernelConfig | None) -> int:
    """The key a custom op passes for `config` (0 = the defaults)."""
    if config is None:
        return 0
    _CONFIGS.setdefault(id(config), config)
    return id(config)


def config_for(key: int) -> KernelConfig | None:
    return _CONFIGS.get(key) if key else None


_PDL_CONFIGS = {True: KernelConfig(pdl=True), False: KernelConfig(pdl=False)}


def _tracing() -> bool:
    return torch.compiler.is_compiling()


@torch.library.custom_op("draftsmith::realize", mutates_args=())
def _realize_op(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x.clone() for x in xs]


@_realize_op.register_fake
def _(xs):
    return [torch.empty_like(x) for x in xs]


def realize(*xs: torch.Tensor | None) -> tuple:
    """The forward's index tensors (positions, slots, the boolean mask) as buffers of their own, once, before the
    layers' kernels take them. Under torch.compile inductor re-computes a pointwise input of an opaque operator for
    every operator that takes it: in a traced round `positions = L + arange(T)` and its mask cost 2-3 small kernels per
    layer and kernel call (33 of a pycode-small chain round's 167 launches, BENCHMARKS.md); an opaque copy is one
    launch per tensor per forward. Eager (and None): returned as they are."""
    if not _tracing():
        return xs
    idx = [i for i, x in enumerate(xs) if x is not None]
    out = list(xs)
    for i, y in zip(idx, _realize_op([xs[i] for i in idx])):
        out[i] = y
    return tuple(out)


def _gemv_key(
    N: int, K: int, dtype, has_norm: bool, has_bias: bool, has_res: bool, act_mul: bool, glu: bool = False
) -> tuple:
    return (int(N), int(K), str(dtype), has_norm, has_bias, has_res, act_mul, glu)


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    act_mul: bool = False,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    prefetch: int | None = None,
    glu: bool = False,
    config: KernelConfig | None = None,
    embed: tuple[torch.Tensor, torch.Tensor] | None = None,
    norm_weight2: torch.Tensor | None = None,
    argmax_map: torch.Tensor | None = None,
    rope: tuple | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token: x [1, K] or [K] (with `act_mul`: [1, 2K] = cat(gate, up)); w [N, K] (rows contiguous) -> [1, N] in
    x's dtype (several rows are `experimental.gemm_rows`'; the gemv looped over a verify's rows lost to it twice,
    and the one-row program over a grid of rows once: docs/LOG.md 2026-12-02). The tile: the arguments, else
    `config`'s tuned one for this shape, else its default.
    See the module docstring. `embed` = (table [V, K/2], ids [1]) with `norm_weight2` (an EAGLE-3 drafter's first
    layer): the input row is cat(rmsnorm(table[ids]) * norm_weight, rmsnorm(x) * norm_weight2), x [1, K/2] — the
    gather, both norms and the concatenation in the matmul's prologue, rounded as the two HF RMSNorms and torch.cat
    would. `argmax_map` [N] (int): return not the outputs but [map[argmax]] (long [1]), the argmax over the
    outputs as rounded to x's dtype, first index on ties — torch.argmax's — taken in the kernel (a drafter's greedy
    step: its lm_head, argmax and draft-to-target id map in one launch, not two; `ARGMAX_MAX_PROGRAMS`).
    `rope` = (positions [1], slots [1], cos, sin, k_cache, v_cache, n_heads, n_kv), as `rope_and_cache` takes them
    (no q/k norm): w is the fused q/k/v projection; RoPE and the cache writes happen in the epilogue and the return
    is q [1, n_heads * d] (rotated) — `rope_and_cache(gemv(x, w, ...))` in one launch (`KernelConfig.rope_fold`).
    Its tile is the unfolded projection's, with half the outputs a program (each output is a pair of rows).
    Traced by torch.compile: the `draftsmith::gemv` operator (the config's tiles; with `rope`, `draftsmith::qkv_rope`).
    `out` [1, N] contiguous: where the outputs go (the tuners' dependent chains, `chained_io`); not with argmax_map,
    rope or under tracing."""
    _need()
    if out is not None and (rope is not None or argmax_map is not None):
        raise ValueError("gemv: out takes the outputs of a plain gemv, not of rope or argmax_map")
    if rope is not None:
        if act_mul or glu or residual is not None or argmax_map is not None:
            raise ValueError("gemv: rope combines with neither act_mul, glu, a residual nor argmax_map")
        return _gemv_rope(
            x, w, norm_weight, eps, bias, rope, config, block_n, block_k, num_warps, prefetch, embed, norm_weight2
        )
    table, ids = embed if embed is not None else (None, None)
    if _tracing() and block_n is None and block_k is None and num_warps is None and prefetch is None and out is None:
        return _gemv_op(
            x,
            w,
            norm_weight,
            float(eps),
            bias,
            residual,
            bool(act_mul),
            bool(glu),
            config_key(config),
            table,
            ids,
            norm_weight2,
            argmax_map,
        )
    cfg = config if config is not None else KernelConfig()
    K = w.shape[1]
    N = w.shape[0] // 2 if glu else w.shape[0]
    if act_mul and (norm_weight is not None or glu):
        raise ValueError("gemv: act_mul combines with neither norm_weight nor glu")
    if embed is not None:
        E = K // 2
        if (
            act_mul
            or norm_weight is None
            or norm_weight2 is None
            or K % 2
            or tuple(table.shape[1:]) != (E,)
            or table.stride(1) != 1
            or table.dtype != x.dtype
            or x.shape[-1] != E
            or ids.numel() != x.numel() // E
        ):
            raise ValueError(
                f"gemv: embed needs a [V, {K // 2}] table of x's dtype, one id per row of x [T, {K // 2}], "
                f"both norm weights and no act_mul (got table {tuple(table.shape)} {table.dtype}, x "
                f"{tuple(x.shape)} {x.dtype}, {ids.numel()} ids)"
            )
        x_features = E
    else:
        x_features = 2 * K if act_mul else K
    if glu and w.shape[0] % 2:
        raise ValueError(f"gemv: glu needs cat(gate, up) weights, an even number of rows, not {w.shape[0]}")
    if x.shape[-1] != x_features or w.stride(1) != 1:
        raise ValueError(
            f"gemv: weight {tuple(w.shape)} (strides {w.stride()}) does not fit x of {x.shape[-1]} "
            f"features{' (act_mul: 2K)' if act_mul else ''}"
        )
    key = _gemv_key(N, K, x.dtype, norm_weight is not None, bias is not None, residual is not None, act_mul, glu)
    bn, bk, nw, pf = cfg.gemv_tuned.get(key, cfg.gemv_default)
    bn, bk, nw = block_n or bn, block_k or bk, num_warps or nw
    pf = pf if prefetch is None else prefetch
    xf = x.reshape(-1, x.shape[-1])
    if xf.shape[0] != 1:
        raise ValueError(f"gemv: one token, not {xf.shape[0]} rows (a verify's rows: experimental.gemm_rows)")
    if xf.stride(-1) != 1:
        xf = xf.contiguous()
    dummy = xf  # never read when the matching HAS_* flag is off
    grid = (triton.cdiv(N, bn),)
    if argmax_map is not None:
        if argmax_map.shape != (N,) or argmax_map.dtype not in (torch.long, torch.int32):
            raise ValueError(f"gemv: argmax_map must be [{N}] ints, not {tuple(argmax_map.shape)} {argmax_map.dtype}")
        if grid[0] > ARGMAX_MAX_PROGRAMS:  # too many partials for one program to reduce: the outputs, then torch's
            y = gemv(x, w, norm_weight, eps, bias, residual, act_mul, bn, bk, nw, pf, glu, cfg, embed, norm_weight2)
            return argmax_map.gather(0, torch.argmax(y[0].float()).view(1)).long()
        y = torch.empty(1, dtype=argmax_map.dtype, device=x.device)
        pv, pi, cnt = _argmax_workspace(x.device)
        am = (pv, pi, cnt, argmax_map.contiguous())
    else:
        if out is not None and (out.numel() != N or out.dtype != x.dtype or not out.is_contiguous()):
            raise ValueError(f"gemv: out must be {N} contiguous {x.dtype} outputs, not {tuple(out.shape)} {out.dtype}")
        y = out.view(1, N) if out is not None else torch.empty(1, N, dtype=x.dtype, device=x.device)
        am = (dummy,) * 4
    _gemv_kernel[grid](
        xf,
        w,
        y,
        norm_weight if norm_weight is not None else dummy,
        bias if bias is not None else dummy,
        residual.reshape(1, N).contiguous() if residual is not None else dummy,
        N,
        K,
        w.stride(0),
        float(eps),
        table if table is not None else dummy,
        ids.reshape(-1).contiguous() if ids is not None else dummy,
        norm_weight2 if norm_weight2 is not None else dummy,
        *am,
        HAS_NORM=norm_weight is not None,
        HAS_BIAS=bias is not None,
        HAS_RES=residual is not None,
        ACT_MUL=bool(act_mul),
        BLOCK_N=bn,
        BLOCK_K=bk,
        NORM_BLOCK=min(triton.next_power_of_2(K // 2 if embed is not None else K), NORM_BLOCK_MAX),
        PREFETCH=bool(pf),
        num_warps=nw,
        GLU=bool(glu),
        EMBED=embed is not None,
        ARGMAX=argmax_map is not None,
        P_BLOCK=triton.next_power_of_2(grid[0]) if argmax_map is not None else 1,
        **_pdl(x, cfg.pdl),
    )
    return y if argmax_map is None else y.to(torch.long)


def _gemv_rope(
    x, w, norm_weight, eps, bias, rope, config, block_n, block_k, num_warps, prefetch, embed=None, norm_weight2=None
) -> torch.Tensor:
    """`gemv(rope=)`: the fused q/k/v projection of one token with RoPE and the cache writes in its epilogue (and
    with `embed`, the drafter's first-layer prologue)."""
    positions, slots, cos, sin, k_cache, v_cache, n_heads, n_kv = rope
    if _tracing():
        return qkv_rope_op(x, w, norm_weight, eps, bias, rope, config, embed, norm_weight2)
    cfg = config if config is not None else KernelConfig()
    d = cos.shape[1]
    rows, K = w.shape
    table, ids = embed if embed is not None else (None, None)
    feats = K // 2 if embed is not None else K
    if d % 2 or rows != (n_heads + 2 * n_kv) * d or w.stride(1) != 1 or x.shape[-1] != feats:
        raise ValueError(
            f"gemv(rope=): a fused q/k/v weight of ({n_heads} + 2 x {n_kv}) x {d} rows over x's {x.shape[-1]} "
            f"features{' (embed: 2x)' if embed is not None else ''}, not {tuple(w.shape)}"
        )
    if embed is not None and (norm_weight is None or norm_weight2 is None or table.shape[1] != feats):
        raise ValueError("gemv(rope=, embed=): both norm weights and a [V, K/2] table")
    if k_cache.stride(-1) != 1 or k_cache.stride(-2) != d or k_cache.stride() != v_cache.stride():
        raise ValueError("gemv(rope=): the caches must be [1, n_kv, max_len, d] with contiguous rows")
    xf = x.reshape(1, feats)
    if xf.stride(-1) != 1:
        xf = xf.contiguous()
    key = _gemv_key(rows, K, x.dtype, norm_weight is not None, bias is not None, False, False)
    bn, bk, nw, pf = cfg.gemv_tuned.get(key, cfg.gemv_default)
    bn = block_n or max(1, bn // 2)
    bk, nw = block_k or bk, num_warps or nw
    pf = pf if prefetch is None else prefetch
    N = rows // 2  # pairs
    q = torch.empty(1, n_heads * d, dtype=x.dtype, device=x.device)
    dummy = xf
    _gemv_kernel[(triton.cdiv(N, bn),)](
        xf,
        w,
        q,
        norm_weight if norm_weight is not None else dummy,
        bias if bias is not None else dummy,
        dummy,
        N,
        K,
        w.stride(0),
        float(eps),
        table if table is not None else dummy,
        ids.reshape(-1).contiguous() if ids is not None else dummy,
        norm_weight2 if norm_weight2 is not None else dummy,
        dummy,
        dummy,
        dummy,
        dummy,
        q_ptr=q,
        kc_ptr=k_cache,
        vc_ptr=v_cache,
        cos_ptr=cos,
        sin_ptr=sin,
        pos_ptr=positions,
        slot_ptr=slots,
        stride_cache_h=k_cache.stride(1),
        NH=int(n_heads),
        NKV=int(n_kv),
        HAS_NORM=norm_weight is not None,
        HAS_BIAS=bias is not None,
        HAS_RES=False,
        ACT_MUL=False,
        BLOCK_N=bn,
        BLOCK_K=bk,
        NORM_BLOCK=min(triton.next_power_of_2(feats), NORM_BLOCK_MAX),
        PREFETCH=bool(pf),
        num_warps=nw,
        GLU=False,
        EMBED=embed is not None,
        ROPE=True,
        HALF=d // 2,
        **_pdl(x, cfg.pdl),
    )
    return q


# `gemv(argmax_map=)`: the most programs whose partial maxima the last one reduces in registers (a 128k vocabulary
# in tiles of 32 outputs is 4,096)
ARGMAX_MAX_PROGRAMS = 8192
_ARGMAX_WS: dict = {}


def _argmax_workspace(device: torch.device):
    """The partial maxima, their indices and the arrival counter of `gemv(argmax_map=)` on `device`: kept for the
    process (a CUDA graph bakes their addresses in; the counter is zero between launches, each launch's last program
    resets it). One launch at a time uses them: launches on one stream run in order (PDL included: a program touches
    them only after its wait on the previous kernel)."""
    ws = _ARGMAX_WS.get(device)
    if ws is None:  # the largest size at once: a later, larger one allocated inside a capture would be the graph's
        n = ARGMAX_MAX_PROGRAMS
        ws = (
            torch.empty(n, dtype=torch.float32, device=device),
            torch.empty(n, dtype=torch.int32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device),
        )
        _ARGMAX_WS[device] = ws
    return ws


def tune_gemv(
    mats: list[torch.Tensor],
    norm_weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    residual: bool = False,
    act_mul: bool = False,
    glu: bool = False,
    reps: int = 10,
    configs: list[tuple[int, int, int, int]] | None = None,
    force: bool = False,
    config: KernelConfig | None = None,
) -> list[dict]:
    """Time every tile of `configs` (default: `config.gemv_sweep`, `GEMV_CONFIGS` unless set) on `mats` (same shape;
    one pass over all of them per timing, so with a model's 32 layers the weights stream from memory, not L2) and
    keep the fastest for their key in `config.gemv_tuned` (the runner's config: `LlamaFamilyForward.tune_kernels`).
    Returns one row per tile (`us` per matrix), [] when the key was tuned before (unless `force`). On CPU (the
    interpreter) nothing is timed and nothing is kept: returns []."""
    _need()
    cfg = config if config is not None else KernelConfig()
    w0 = mats[0]
    if w0.device.type != "cuda":
        return []
    N, K = w0.shape
    N = N // 2 if glu else N
    dt = w0.dtype
    key = _gemv_key(N, K, dt, norm_weight is not None, bias is not None, residual, act_mul, glu)
    if key in cfg.gemv_tuned and not force:
        return []
    x = torch.randn(1, 2 * K if act_mul else K, device=w0.device, dtype=dt)
    r = torch.randn(1, N, device=w0.device, dtype=dt) if residual else None
    x, y_buf = chained_io(1, x.shape[1], N, x) if cfg.tune_chained else (x, None)

    def launch(tile):
        bn, bk, nw, pf = tile
        for w in mats:
            gemv(
                x,
                w,
                norm_weight,
                bias=bias,
                residual=r,
                act_mul=act_mul,
                block_n=bn,
                block_k=bk,
                num_warps=nw,
                prefetch=pf,
                glu=glu,
                config=cfg,
                out=y_buf,
            )

    return sweep_tiles(
        configs or cfg.gemv_sweep,
        ("BLOCK_N", "BLOCK_K", "warps", "prefetch"),
        launch,
        len(mats),
        reps,
        cfg.gemv_tuned,
        key,
        cfg.tuned_us,
    )


def chained_io(T: int, n_in: int, n_out: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [T, n_in], out [T, n_out]) over one buffer, for a tuner's timed launches (`KernelConfig.tune_chained`):
    a launch that reads x and writes out, repeated, runs as a dependent chain — each launch waits for the previous
    one's outputs before reading its input, as in a forward — where launches on a fixed input are independent and
    overlap (under PDL a whole launch can run in the previous one's tail), which ranks tiles by throughput instead
    of by the latency a forward pays. Timing only: a launch reads what others of its programs write (the values are
    meaningless)."""
    buf = torch.randn(T * max(n_in, n_out), device=like.device, dtype=like.dtype)
    return buf[: T * n_in].view(T, n_in), buf[: T * n_out].view(T, n_out)


def sweep_tiles(
    tiles, names, launch, per: int, reps: int, table: dict, key, us_table: dict | None = None
) -> list[dict]:
    """Time `launch(tile)` (CUDA graph replays, `per` matrices a launch) for every tile and keep the fastest in
    `table[key]` (and its microseconds a matrix in `us_table[key]`): the sweep of `tune_gemv` and
    `experimental.gemm_rows.tune_rows`. One row per tile (its fields named by `names`, `us` per matrix or None with
    `error`); the tables untouched when no tile ran."""
    rows = []
    for tile in tiles:
        us, err = _time_graph(lambda: launch(tile), per, reps)
        rows.append({**dict(zip(names, tile)), "us": us, "error": err})
    ok = [row for row in rows if row["us"] is not None]
    if ok:
        top = min(ok, key=lambda row: row["us"])
        table[key] = tuple(top[n] for n in names)
        if us_table is not None:
            us_table[key] = top["us"]
    return rows


# The fewest kernels one timed graph replay holds (`_time_graph`): a replay's own launch and the events' resolution
# (~several us) must not decide between tiles of ~2 us. With a 1-matrix launch (an lm_head) timed alone, the chosen
# tile's time varied 9.7-16.5 us between engines built in one run, and so did the engine's plain step (2026-12-02).
TIME_MIN_KERNELS = 32


def _time_graph(run, per: int, reps: int) -> tuple[float | None, str]:
    """Best microseconds per `per` calls of `run` (CUDA) replayed as one CUDA graph, as the step runs: launched
    from Python, dozens of ~10 us kernels would time the host's launch rate instead. The graph repeats `run` until
    it holds TIME_MIN_KERNELS kernels; best of `reps` replays (the tuners' default: 10). (None, error) when the
    variant does not run on this GPU (registers, shared memory)."""
    copies = max(1, -(-TIME_MIN_KERNELS // per))
    per *= copies
    try:
        run()  # compiles
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(copies):
                run()
        graph.replay()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - a tile this GPU cannot run: skip it
        return None, type(e).__name__
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / per)
    del graph
    return best, ""


def rope_and_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    n_heads: int,
    n_kv: int,
    qk_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """qkv [T, (nh + 2 nkv) d] (the fused projection); positions/slots [T]; cos/sin [max_len, d] in the model
    dtype; caches [1, nkv, max_len, d] (one layer); qk_norm [(nh + nkv), d] per-head RMSNorm weights or None.
    Writes k (normed, rotated) and v at `slots` and returns q [T, nh, d] (normed, rotated). Traced by torch.compile:
    the `draftsmith::rope_and_cache` operator (mutates the caches)."""
    _need()
    if _tracing():
        pdl = True if config is None else bool(config.pdl)
        return _rope_and_cache_op(
            qkv, positions, slots, cos, sin, k_cache, v_cache, int(n_heads), int(n_kv), qk_norm, float(eps), pdl
        )
    T = qkv.shape[0]
    d = cos.shape[1]
    if not _pow2(d):
        raise ValueError(f"rope_and_cache: head_dim {d} is not a power of two")
    qkv = qkv.reshape(T, -1)
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    q = torch.empty(T, n_heads, d, dtype=qkv.dtype, device=qkv.device)
    _rope_cache_kernel[(T, n_heads + 2 * n_kv)](
        qkv,
        q,
        k_cache,
        v_cache,
        cos,
        sin,
        positions,
        slots,
        qk_norm if qk_norm is not None else cos,
        qkv.stride(0),
        k_cache.stride(1),
        float(eps),
        NH=n_heads,
        NKV=n_kv,
        D=d,
        HAS_QKN=qk_norm is not None,
        num_warps=1 if d <= 128 else 2,
        **_pdl(qkv, True if config is None else config.pdl),
    )
    return q


def _attn_key(S: int, nkv: int, G: int, d: int, dtype) -> tuple:
    return (int(S), int(nkv), int(G), int(d), str(dtype))


def _attn_plan(
    S: int,
    nkv: int,
    G: int,
    d: int,
    dtype,
    device,
    split_len: int | None,
    block_s: int | None,
    num_warps: int | None,
    plans: dict | None = None,
) -> tuple[int, int, int]:
    """(split_len, BLOCK_S, num_warps): the arguments, else a plan kept for this shape in `plans`
    (`KernelConfig.attn_plans`: `tune_attention(keep=True)` or a benchmark forcing one), else the default:
    ATTN_BLOCK_S-key blocks, the smallest power-of-two number of them per chunk that keeps the chunks per KV head
    within ATTN_TARGET_CHUNKS."""
    tuned = plans.get(_attn_key(S, nkv, G, d, dtype)) if plans else None
    if tuned and split_len is None and block_s is None:
        sl, bs, nw = tuned
        return sl, bs, num_warps or nw
    bs = block_s or ATTN_BLOCK_S
    if split_len is None:
        split_len = bs
        while triton.cdiv(S, split_len) > ATTN_TARGET_CHUNKS:
            split_len *= 2
    return split_len, bs, num_warps or 4


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    split_len: int | None = None,
    block_s: int | None = None,
    num_warps: int | None = None,
    config: KernelConfig | None = None,
    slot: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token: q [nh, d] (or [1, nh, d]); caches [1, nkv, max_len, d] (one layer, the first S slots
    used); mask [S] bool (True = attend) -> [1, nh * d] in q's dtype. `split_len` (a multiple of `block_s`):
    keys per program; by default the plan `config.attn_plans` keeps for this shape, else the rule of `_attn_plan`.
    `slot` [1] (the token's cache slot; keys past it are not read — true of causal decoding) with
    `config.attn_live_chunks` > 0: that many chunks over the live keys instead (one: no combine launch).
    Traced by torch.compile: the `draftsmith::decode_attention` operator."""
    _need()
    if _tracing() and split_len is None and block_s is None and num_warps is None:
        return _decode_attention_op(q, k_cache, v_cache, mask, float(scale), config_key(config), slot)
    cfg = config if config is not None else KernelConfig()
    nkv, max_len, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    q = q.reshape(-1, d)
    nh = q.shape[0]
    S = mask.shape[-1]
    if not _pow2(d) or d < 16 or nh % nkv or S > max_len:
        raise ValueError(
            f"decode_attention: head_dim {d} (a power of two >= 16 needed), {nh} heads over {nkv} KV "
            f"heads, {S} mask slots of {max_len}"
        )
    G = nh // nkv
    split_len, bs, nw = _attn_plan(S, nkv, G, d, q.dtype, q.device, split_len, block_s, num_warps, cfg.attn_plans)
    if split_len % bs:
        raise ValueError(f"decode_attention: split_len {split_len} is not a multiple of the key block {bs}")
    live = slot is not None and cfg.attn_live_chunks > 0
    n_split = int(cfg.attn_live_chunks) if live else triton.cdiv(S, split_len)
    o = torch.empty(nh, d, dtype=q.dtype, device=q.device)
    single = n_split == 1
    if single:
        pm = pl = po = o
    else:
        pm = torch.empty(nh, n_split, dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        po = torch.empty(nh, n_split, d, dtype=torch.float32, device=q.device)
    mask = mask.reshape(-1)
    _attn_split_kernel[(nkv, n_split)](
        q.contiguous(),
        k_cache,
        v_cache,
        mask,
        o,
        pm,
        pl,
        po,
        S,
        split_len,
        n_split,
        k_cache.stride(1),
        float(scale),
        G=G,
        BLOCK_R=max(16, triton.next_power_of_2(G)),
        D=d,
        BLOCK_S=bs,
        SINGLE=single,
        IEEE=q.dtype == torch.float32 or _INTERPRET,
        num_warps=nw,
        slot_ptr=slot.reshape(-1) if live else mask,
        LIVE=live,
        **_pdl(q, cfg.pdl),
    )
    if not single:
        bsp = max(2, triton.next_power_of_2(n_split))
        _attn_combine_kernel[(nh,)](
            o, pm, pl, po, n_split, D=d, BLOCK_SP=bsp, num_warps=_combine_warps(bsp, d), **_pdl(q, cfg.pdl)
        )
    return o.reshape(1, nh * d)


# rows_attention (T query tokens, a verify or a tree draft step): tile rows (token x query head of a KV head), key
# block and the most chunks per KV head over all row blocks — the one-token rule's ATTN_TARGET_CHUNKS divided by the
# row blocks, since those already multiply the programs. ROWS_ATTN_MAX: the most tokens it takes (longer forwards,
# prefill, keep the torch attention).
ROWS_ATTN_BLOCK_R = 64
ROWS_ATTN_BLOCK_S = 32
ROWS_ATTN_WARPS = 4
ROWS_ATTN_MAX = 256
# A forward with slots and at most ROWS_ATTN_LIVE_MAX_ROWS tile rows (T x query heads of a KV head: a small target's
# verify and hand-off, an 8B tree's draft step) splits the live keys into ROWS_ATTN_LIVE_CHUNKS chunks, at most one
# per key block of the mask's width (`KernelConfig.rows_attn_live`; a None config means on): with so few row blocks
# the width rule above launches up to 64 chunks over the cache's capacity, most past the context, and combines them
# all. Measured 2026-12-03 (bench/decode_attention.py, BENCHMARKS.md): pycode-small T=5 3.3 vs 4.2 us a layer, T=7
# 3.6 vs 5.7, at an 1,800-token context (T=5) 4.6 vs 4.4; rounds -2.4 % (chain4) and -4 % (chain6). The 8B 49-row
# verify (196 tile rows) keeps the width rule: live chunks were no faster there.
ROWS_ATTN_LIVE_CHUNKS = 16
ROWS_ATTN_LIVE_MAX_ROWS = 64
# The live split's tile (any live split, `attn_live_chunks` too), the fastest at the few-row shapes measured: 16 rows;
# for 128-wide heads 64-key blocks and 8 warps (8B T=5 6.2 us vs 8.0 with the width rule's tile, T=8 6.4 vs 8.6), for
# 64-wide ones the width rule's 32-key blocks and 4 warps (pycode-small T=5 3.3 vs 3.4 with the wide tile, T=7 3.6
# vs 4.0). In a round on the 8B shape the rule is neutral (chain4 5.83 vs 5.77 ms off).
ROWS_ATTN_LIVE_BLOCK_R = 16
ROWS_ATTN_LIVE_BLOCK_S = 64


def _rows_live_tile(d: int) -> tuple[int, int]:
    """(key block, warps) of the live split's tile for head_dim d: ROWS_ATTN_LIVE_BLOCK_S and 8 for 128-wide heads,
    the width rule's for narrower ones."""
    return (ROWS_ATTN_LIVE_BLOCK_S, 8) if d >= 128 else (ROWS_ATTN_BLOCK_S, ROWS_ATTN_WARPS)


def _rows_attn_plan(S: int, n_rblocks: int, split_len: int | None, block_s: int | None) -> tuple[int, int]:
    bs = block_s or ROWS_ATTN_BLOCK_S
    if split_len is None:
        target = max(1, ATTN_TARGET_CHUNKS // n_rblocks)
        split_len = bs
        while triton.cdiv(S, split_len) > target:
            split_len *= 2
    return split_len, bs


def _rows_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    slots: torch.Tensor | None = None,
    split_len: int | None = None,
    block_s: int | None = None,
    block_r: int | None = None,
    num_warps: int | None = None,
    pdl: bool = True,
    live_chunks: int = 0,
    num_stages: int | None = None,
) -> torch.Tensor:
    _need()
    T, nh, d = q.shape
    nkv, max_len = k_cache.shape[1], k_cache.shape[2]
    S = mask.shape[-1]
    if (
        not _pow2(d)
        or d < 16
        or nh % nkv
        or S > max_len
        or mask.shape[0] != T
        or q.stride(2) != 1
        or k_cache.stride(3) != 1
        or k_cache.stride(2) != d
        or v_cache.stride() != k_cache.stride()
    ):
        raise ValueError(
            f"rows_attention: q {tuple(q.shape)} (strides {q.stride()}), caches {tuple(k_cache.shape)} "
            f"(strides {k_cache.stride()}), mask {tuple(mask.shape)}: head_dim a power of two >= 16, "
            "heads a multiple of the KV heads, one mask row per token over at most the cache's slots"
        )
    G = nh // nkv
    live = live_chunks > 0 and slots is not None  # `KernelConfig.attn_live_chunks`: chunks over the live keys
    if live:  # the live split's own tile: 16 rows; 128-wide heads 64 keys a block and 8 warps (ROWS_ATTN_LIVE_*)
        live_bs, live_warps = _rows_live_tile(d)
        block_r = block_r or ROWS_ATTN_LIVE_BLOCK_R
        block_s = block_s or live_bs
        num_warps = num_warps or live_warps
    br = block_r or min(ROWS_ATTN_BLOCK_R, max(16, triton.next_power_of_2(T * G)))
    n_rb = triton.cdiv(T * G, br)
    split_len, bs = _rows_attn_plan(S, n_rb, split_len, block_s)
    if split_len % bs:
        raise ValueError(f"rows_attention: split_len {split_len} is not a multiple of the key block {bs}")
    n_split = int(live_chunks) if live else triton.cdiv(S, split_len)
    o = torch.empty(T, nh, d, dtype=q.dtype, device=q.device)
    single = n_split == 1
    if single:
        pm = pl = po = o
    else:
        pm = torch.empty(T * nh, n_split, dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        po = torch.empty(T * nh, n_split, d, dtype=torch.float32, device=q.device)
    if mask.stride(1) != 1:
        mask = mask.contiguous()
    if slots is not None and slots.shape != (T,):
        raise ValueError(f"rows_attention: slots {tuple(slots.shape)} is not one per token ({T})")
    _rows_attn_kernel[(nkv, n_split, n_rb)](
        q,
        k_cache,
        v_cache,
        mask,
        slots if slots is not None else mask,
        o,
        pm,
        pl,
        po,
        T,
        S,
        split_len,
        n_split,
        q.stride(0),
        q.stride(1),
        mask.stride(0),
        k_cache.stride(1),
        float(scale),
        NH=nh,
        G=G,
        BLOCK_R=br,
        D=d,
        BLOCK_S=bs,
        BLOCK_T=triton.next_power_of_2(T),
        HAS_SLOTS=slots is not None,
        SINGLE=single,
        IEEE=q.dtype == torch.float32 or _INTERPRET,
        num_warps=num_warps or ROWS_ATTN_WARPS,
        LIVE=live,
        **({"num_stages": num_stages} if num_stages else {}),
        **_pdl(q, pdl),
    )
    if not single:
        bsp = max(2, triton.next_power_of_2(n_split))
        _attn_combine_kernel[(T * nh,)](
            o, pm, pl, po, n_split, D=d, BLOCK_SP=bsp, num_warps=_combine_warps(bsp, d), **_pdl(q, pdl)
        )
    return o.reshape(T, nh * d)


if triton is not None:
    # an opaque operator to torch.compile (dynamo does not trace the launch; inductor calls it between its own
    # kernels), so a compiled verify can take it
    @torch.library.custom_op("draftsmith::rows_attention", mutates_args=())
    def _rows_attention_op(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        mask: torch.Tensor,
        slots: torch.Tensor | None,
        scale: float,
        pdl: bool,
        live_chunks: int = 0,
        plan: list[int] | None = None,
    ) -> torch.Tensor:
        br, bs, nw, st = plan if plan else (None, None, None, None)
        return _rows_attention(
            q, k_cache, v_cache, mask, scale, slots, None, bs, br, nw, pdl, live_chunks=live_chunks, num_stages=st
        )

    @_rows_attention_op.register_fake
    def _(q, k_cache, v_cache, mask, slots, scale, pdl, live_chunks=0, plan=None):
        return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])

    @torch.library.custom_op("draftsmith::gemv", mutates_args=())
    def _gemv_op(
        x: torch.Tensor,
        w: torch.Tensor,
        norm_weight: torch.Tensor | None,
        eps: float,
        bias: torch.Tensor | None,
        residual: torch.Tensor | None,
        act_mul: bool,
        glu: bool,
        config: int,
        table: torch.Tensor | None = None,
        ids: torch.Tensor | None = None,
        norm_weight2: torch.Tensor | None = None,
        argmax_map: torch.Tensor | None = None,
    ) -> torch.Tensor:
        embed = None if table is None else (table, ids)
        return gemv(
            x,
            w,
            norm_weight,
            eps,
            bias,
            residual,
            act_mul,
            glu=glu,
            config=config_for(config),
            embed=embed,
            norm_weight2=norm_weight2,
            argmax_map=argmax_map,
        )

    @_gemv_op.register_fake
    def _(
        x,
        w,
        norm_weight,
        eps,
        bias,
        residual,
        act_mul,
        glu,
        config,
        table=None,
        ids=None,
        norm_weight2=None,
        argmax_map=None,
    ):
        if argmax_map is not None:
            return argmax_map.new_empty(1, dtype=torch.long)
        return x.new_empty(x.numel() // x.shape[-1], w.shape[0] // 2 if glu else w.shape[0])

    @torch.library.custom_op("draftsmith::rope_and_cache", mutates_args=("k_cache", "v_cache"))
    def _rope_and_cache_op(
        qkv: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        n_heads: int,
        n_kv: int,
        qk_norm: torch.Tensor | None,
        eps: float,
        pdl: bool,
    ) -> torch.Tensor:
        cfg = _PDL_CONFIGS[bool(pdl)]
        return rope_and_cache(qkv, positions, slots, cos, sin, k_cache, v_cache, n_heads, n_kv, qk_norm, eps, cfg)

    @_rope_and_cache_op.register_fake
    def _(qkv, positions, slots, cos, sin, k_cache, v_cache, n_heads, n_kv, qk_norm, eps, pdl):
        return qkv.new_empty(qkv.shape[0], n_heads, cos.shape[1])

    @torch.library.custom_op("draftsmith::qkv_rope", mutates_args=("k_cache", "v_cache"))
    def _qkv_rope_op(
        x: torch.Tensor,
        w: torch.Tensor,
        norm_weight: torch.Tensor | None,
        eps: float,
        bias: torch.Tensor | None,
        positions: torch.Tensor,
        slots: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        n_heads: int,
        n_kv: int,
        config: int,
        table: torch.Tensor | None = None,
        ids: torch.Tensor | None = None,
        norm_weight2: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rope = (positions, slots, cos, sin, k_cache, v_cache, n_heads, n_kv)
        cfg = config_for(config)
        if x.numel() // x.shape[-1] == 1:
            embed = None if table is None else (table, ids)
            return gemv(x, w, norm_weight, eps, bias, config=cfg, embed=embed, norm_weight2=norm_weight2, rope=rope)
        from draftsmith.decode.experimental.gemm_rows import gemm_rows

        return gemm_rows(x, w, norm_weight, eps, bias, config=cfg, rope=rope)

    @_qkv_rope_op.register_fake
    def _(x, w, norm_weight, eps, bias, positions, slots, cos, sin, k_cache, v_cache, n_heads, n_kv, config, *rest):
        return x.new_empty(x.numel() // x.shape[-1], n_heads * cos.shape[1])

    @torch.library.custom_op("draftsmith::decode_attention", mutates_args=())
    def _decode_attention_op(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        mask: torch.Tensor,
        scale: float,
        config: int,
        slot: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return decode_attention(q, k_cache, v_cache, mask, scale, config=config_for(config), slot=slot)

    @_decode_attention_op.register_fake
    def _(q, k_cache, v_cache, mask, scale, config, slot=None):
        return q.new_empty(1, q.numel())


def qkv_rope_op(x, w, norm_weight, eps, bias, rope, config, embed=None, norm_weight2=None) -> torch.Tensor:
    """`gemv(rope=)` / `gemm_rows(rope=)` under torch.compile: the `draftsmith::qkv_rope` operator (mutates the
    caches; the config's tiles)."""
    positions, slots, cos, sin, k_cache, v_cache, n_heads, n_kv = rope
    table, ids = embed if embed is not None else (None, None)
    return _qkv_rope_op(
        x, w, norm_weight, float(eps), bias, positions, slots, cos, sin, k_cache, v_cache, int(n_heads), int(n_kv),
        config_key(config), table, ids, norm_weight2,
    )  # fmt: skip


def rows_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    slots: torch.Tensor | None = None,
    split_len: int | None = None,
    block_s: int | None = None,
    block_r: int | None = None,
    num_warps: int | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """T query tokens, each with its own mask row: q [T, nh, d] (any strides, head_dim contiguous); caches
    [1, nkv, max_len, d] (one layer); mask [T, S] bool (True = attend) -> [T, nh * d] in q's dtype. Flash-decoding
    as `decode_attention`, with the tile's rows the (token, query head) pairs of one KV head.

    `slots` [T] (the cache slots this forward wrote): keys past the highest of them are not read and count as
    masked — true of every causal use (a token sees what was written before it or with it), and it lets the K/V
    loads run ahead of the mask; masked keys below the bound are read and weigh 0 (a cache holds finite values).
    Without `slots` a key block is read only where the tile's mask rows see it. The plan
    arguments (benchmarks) bypass the torch operator that torch.compile sees. `config`: its `pdl`, `attn_live_chunks`
    and `rows_attn_live` (few rows with slots: up to ROWS_ATTN_LIVE_CHUNKS chunks over the live keys; on for a None
    config too) and `rows_attn_plan` (with slots, past ROWS_ATTN_LIVE_MAX_ROWS tile rows: that tile and chunk count
    over the live keys)."""
    pdl = True if config is None else bool(config.pdl)
    if split_len or block_s or block_r or num_warps:
        return _rows_attention(q, k_cache, v_cache, mask, scale, slots, split_len, block_s, block_r, num_warps, pdl)
    _need()
    live = int(config.attn_live_chunks) if config is not None and slots is not None else 0
    tile_rows = q.shape[0] * (q.shape[1] // k_cache.shape[1])
    plan = None
    if (
        live == 0
        and slots is not None
        and (config is None or config.rows_attn_live)
        and tile_rows <= ROWS_ATTN_LIVE_MAX_ROWS
    ):
        # never more chunks than the mask's width has key blocks (a short cache: the tests' 64 slots)
        live = min(ROWS_ATTN_LIVE_CHUNKS, -(-mask.shape[-1] // _rows_live_tile(q.shape[-1])[0]))
    elif live == 0 and slots is not None and config is not None and config.rows_attn_plan:
        br, bs, live, nw, st = config.rows_attn_plan
        plan = [int(br), int(bs), int(nw), int(st)]
    return _rows_attention_op(q, k_cache, v_cache, mask, slots, float(scale), pdl, live, plan)


# topk_logprobs: columns per program of the first pass (each keeps its k best), and the largest k it takes
TOPK_BLOCK = 2048
TOPK_MAX = 16

if triton is not None:

    @triton.jit
    def _topk_block_kernel(
        x_ptr,
        cv_ptr,
        ci_ptr,
        bm_ptr,
        bs_ptr,
        V,
        stride_x,
        NB,
        K: tl.constexpr,
        BLOCK: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """Pass 1 of `topk_logprobs`: one block of BLOCK columns of one row -> its K largest (value, column), first
        column first among equal values, and the block's max and sum of exp(x - max) for the log-softmax."""
        _pdl_start(USE_PDL)
        r = tl.program_id(0)
        b = tl.program_id(1)
        cols = b * BLOCK + tl.arange(0, BLOCK)
        ok = cols < V
        x = tl.load(x_ptr + r.to(tl.int64) * stride_x + cols, mask=ok, other=float("-inf")).to(tl.float32)
        bm = tl.max(x, axis=0)
        tl.store(bm_ptr + r * NB + b, bm)
        tl.store(bs_ptr + r * NB + b, tl.sum(tl.where(ok, tl.exp(x - bm), 0.0), axis=0))
        big = V + BLOCK
        for i in tl.static_range(K):
            v = tl.max(x, axis=0)
            j = tl.min(tl.where((x == v) & ok, cols, big), axis=0)
            tl.store(cv_ptr + (r * NB + b) * K + i, v)
            tl.store(ci_ptr + (r * NB + b) * K + i, j)
            x = tl.where(cols == j, float("-inf"), x)

    @triton.jit
    def _topk_merge_kernel(
        cv_ptr,
        ci_ptr,
        bm_ptr,
        bs_ptr,
        ov_ptr,
        oi_ptr,
        NB,
        V,
        K: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_B: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """Pass 2: the K best of a row's blocks' candidates, in descending order (ties: lower column first), minus
        the row's log-sum-exp -> log-probs and columns."""
        _pdl_start(USE_PDL)
        r = tl.program_id(0)
        rb = tl.arange(0, BLOCK_B)
        b_ok = rb < NB
        bm = tl.load(bm_ptr + r * NB + rb, mask=b_ok, other=float("-inf"))
        bs = tl.load(bs_ptr + r * NB + rb, mask=b_ok, other=0.0)
        mx = tl.max(bm, axis=0)
        lse = mx + tl.log(tl.sum(tl.where(b_ok, bs * tl.exp(bm - mx), 0.0), axis=0))
        rc = tl.arange(0, BLOCK_C)
        c_ok = rc < NB * K
        cv = tl.load(cv_ptr + r * NB * K + rc, mask=c_ok, other=float("-inf"))
        ci = tl.load(ci_ptr + r * NB * K + rc, mask=c_ok, other=V)
        for i in tl.static_range(K):
            v = tl.max(cv, axis=0)
            j = tl.min(tl.where((cv == v) & c_ok, ci, V), axis=0)
            tl.store(ov_ptr + r * K + i, v - lse)
            tl.store(oi_ptr + r * K + i, j.to(tl.int64))
            cv = tl.where(ci == j, float("-inf"), cv)


def _topk_logprobs(logits: torch.Tensor, k: int, pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    _need()
    R, V = logits.shape
    if not 1 <= k <= min(TOPK_MAX, V) or logits.stride(1) != 1:
        raise ValueError(f"topk_logprobs: k={k} of {V} columns (1 <= k <= {TOPK_MAX}, columns contiguous)")
    block = min(TOPK_BLOCK, max(16, triton.next_power_of_2(V)))
    nb = triton.cdiv(V, block)
    dev = logits.device
    cv = torch.empty(R, nb, k, dtype=torch.float32, device=dev)
    ci = torch.empty(R, nb, k, dtype=torch.int32, device=dev)
    bm = torch.empty(R, nb, dtype=torch.float32, device=dev)
    bs = torch.empty_like(bm)
    ov = torch.empty(R, k, dtype=torch.float32, device=dev)
    oi = torch.empty(R, k, dtype=torch.int64, device=dev)
    _topk_block_kernel[(R, nb)](
        logits,
        cv,
        ci,
        bm,
        bs,
        V,
        logits.stride(0),
        nb,
        K=k,
        BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
        **_pdl(logits, pdl),
    )
    _topk_merge_kernel[(R,)](
        cv,
        ci,
        bm,
        bs,
        ov,
        oi,
        nb,
        V,
        K=k,
        BLOCK_C=max(16, triton.next_power_of_2(nb * k)),
        BLOCK_B=max(2, triton.next_power_of_2(nb)),
        num_warps=1,
        **_pdl(logits, pdl),
    )
    return ov, oi


if triton is not None:

    @torch.library.custom_op("draftsmith::topk_logprobs", mutates_args=())
    def _topk_logprobs_op(logits: torch.Tensor, k: int, pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return _topk_logprobs(logits, k, pdl)

    @_topk_logprobs_op.register_fake
    def _(logits, k, pdl):
        R = logits.shape[0]
        return (logits.new_empty(R, k, dtype=torch.float32), logits.new_empty(R, k, dtype=torch.int64))


def topk_logprobs(
    logits: torch.Tensor, k: int, config: KernelConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.topk(torch.log_softmax(logits.float(), -1), k)` in two kernels: logits [..., V] (any float dtype) ->
    (log-probs fp32 [..., k] in descending order, column indices int64 [..., k]; among equal values the lower
    column first). What a tree level of the drafter needs; torch's top-k over a 32k-wide row is a chain of radix-
    select kernels after a separate log-softmax. A torch custom op (compiled callers). `config`: its `pdl`."""
    _need()
    shape = logits.shape
    v, i = _topk_logprobs_op(logits.reshape(-1, shape[-1]), int(k), True if config is None else bool(config.pdl))
    return v.reshape(*shape[:-1], k), i.reshape(*shape[:-1], k)


def _combine_warps(block_sp: int, d: int) -> int:
    """Warps of the combine kernel: its [chunks, head_dim] fp32 tile at <= 64 values per thread (no spills)."""
    return max(1, min(8, block_sp * d // (64 * 32)))


def attention_plans(S: int, configs: list[tuple[int, int, int]] | None = None) -> list[tuple[int, int, int]]:
    """The distinct launches (split_len, BLOCK_S, num_warps) of `ATTN_CONFIGS` for S mask slots: plans whose chunk
    covers every slot collapse into one, plans with more chunks than the combine kernel takes are left out."""
    out = []
    for bs, nb, nw in configs or ATTN_CONFIGS:
        whole = triton.cdiv(S, bs) * bs  # one chunk per KV head
        split_len = whole if nb == 0 else min(bs * nb, whole)
        if triton.cdiv(S, split_len) <= ATTN_MAX_SPLIT and (split_len, bs, nw) not in out:
            out.append((split_len, bs, nw))
    return out


def tune_attention(
    k_layers: list[torch.Tensor],
    v_layers: list[torch.Tensor],
    n_heads: int,
    S: int,
    scale: float,
    reps: int = 10,
    configs: list[tuple[int, int, int]] | None = None,
    force: bool = False,
    keep: bool = False,
    config: KernelConfig | None = None,
) -> list[dict]:
    """Time every plan of `ATTN_CONFIGS` for one query token over the first S slots of each layer's cache (every
    key visible: the longest the step gets); with `keep`, the fastest becomes this shape's plan. One row per plan
    (`us` per layer); [] on CPU or when this shape was kept before in `config.attn_plans` (unless `force`).

    Attention timed alone is not the step: its favourite plans cost the whole step more than the default rule's (other kernels' weight streams share the memory system), so the engine does not keep
    these timings; bench/decode_kernels.py prints them next to whole-step timings of every plan."""
    _need()
    cfg = config if config is not None else KernelConfig()
    kc0 = k_layers[0]
    if kc0.device.type != "cuda":
        return []
    nkv, d = kc0.shape[1], kc0.shape[3]
    G = n_heads // nkv
    key = _attn_key(S, nkv, G, d, kc0.dtype)
    if key in cfg.attn_plans and not force:
        return []
    q = torch.randn(n_heads, d, device=kc0.device, dtype=kc0.dtype)
    mask = torch.ones(S, dtype=torch.bool, device=kc0.device)
    rows = []
    for split_len, bs, nw in attention_plans(S, configs):

        def run(split_len=split_len, bs=bs, nw=nw):
            for kc, vc in zip(k_layers, v_layers):
                decode_attention(q, kc, vc, mask, scale, split_len=split_len, block_s=bs, num_warps=nw, config=cfg)

        us, err = _time_graph(run, len(k_layers), reps)
        rows.append(
            {
                "S": S,
                "BLOCK_S": bs,
                "split_len": split_len,
                "chunks": triton.cdiv(S, split_len),
                "warps": nw,
                "us": us,
                "error": err,
            }
        )
    ok = [row for row in rows if row["us"] is not None]
    if ok and keep:
        top = min(ok, key=lambda row: row["us"])
        cfg.attn_plans[key] = (top["split_len"], top["BLOCK_S"], top["warps"])
    return rows


__all__ = [
    "chained_io",
    "KernelConfig",
    "available",
    "gemv",
    "tune_gemv",
    "rope_and_cache",
    "decode_attention",
    "rows_attention",
    "topk_logprobs",
    "realize",
    "tune_attention",
    "GEMV_CONFIGS",
    "ATTN_CONFIGS",
]
