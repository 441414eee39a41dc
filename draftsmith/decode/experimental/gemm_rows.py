"""`gemm_rows`: the T-row matmul kernel for verify widths (experimental, opt-in: `LlamaFamilyForward.triton_max_rows
> 1`). Off by default because it loses to cuBLAS (docs/LOG.md, "First T-row kernels for the verify": 11.9 vs 6.97
ms for a 49-row verify on the 8B shape); kept here, out of `draftsmith.decode.kernels`, so that benchmarks can
measure it (bench/decode_kernels.py --verify --gemv triton) while the default forward never imports it.

The kernel and its launcher moved here unchanged from `draftsmith/decode/kernels.py`; it shares that module's jitted
helpers (RMSNorm apply, silu*up, the PDL prologue) and launch settings (`KernelConfig.rows_block_n/k`,
`rows_num_warps`, `pdl`).
"""

from __future__ import annotations

import torch

from draftsmith.decode.kernel_config import KernelConfig
from draftsmith.decode.kernels import _INTERPRET, _need, _pdl, _tracing, config_for, config_key, triton

if triton is not None:
    import triton.language as tl

    from draftsmith.decode.kernels import _rms_apply, _silu_mul, gdc_launch_dependents, gdc_wait

    @triton.jit
    def _rows_x(x_ptr, xrow, m_ok, rk, k_ok, nw_ptr, rstd, HAS_NORM: tl.constexpr, out_ty: tl.constexpr):
        """One K block of the T input rows [BLOCK_M, BLOCK_K], RMS-normalised when the kernel folds the norm."""
        xv = tl.load(x_ptr + xrow[:, None] + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if HAS_NORM:
            xv = _rms_apply(xv, rstd[:, None], tl.load(nw_ptr + rk, mask=k_ok, other=0.0)[None, :], out_ty)
        return xv

    @triton.jit
    def _rows_mac(acc, xv, w, IEEE: tl.constexpr, FMA: tl.constexpr, SWAP: tl.constexpr = False):
        """acc [BLOCK_M, BLOCK_N] += xv [BLOCK_M, BLOCK_K] @ w [BLOCK_N, BLOCK_K]^T: one tl.dot (exact fp32 products for
        fp32); with FMA (tiles under tl.dot's 16, on the CUDA cores) acc is [BLOCK_M, BLOCK_N, BLOCK_K] and takes every
        row's products elementwise, as the gemv does for one row: `_rows_sum` reduces over K once, after the K loop
        (a reduction per row, serialised, lost to tl.dot: docs/LOG.md). SWAP: acc is [BLOCK_N, BLOCK_M] += w @ xv^T
        (the weights as the MMA's M side, the rows as its N side, as cuBLAS tiles a few-row GEMM); `_rows_sum`
        transposes it back."""
        # (one return after the branches: triton compiles the statements after a constexpr branch's return too, and
        # a tl.dot of the 3-D accumulator does not compile)
        if FMA:
            out = acc + xv.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        elif SWAP:
            if IEEE:
                out = tl.dot(w.to(tl.float32), tl.trans(xv.to(tl.float32)), acc, input_precision="ieee")
            else:
                out = tl.dot(w, tl.trans(xv), acc)
        elif IEEE:
            out = tl.dot(xv.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            out = tl.dot(xv, tl.trans(w), acc)
        return out

    @triton.jit
    def _rows_acc0(
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        FMA: tl.constexpr,
        SWAP: tl.constexpr = False,
    ):
        if FMA:
            acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        elif SWAP:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        return acc

    @triton.jit
    def _rows_sum(acc, FMA: tl.constexpr, SWAP: tl.constexpr = False):
        if FMA:
            out = tl.sum(acc, axis=2)
        elif SWAP:
            out = tl.trans(acc)
        else:
            out = acc
        return out

    @triton.jit
    def _rows_first_block(
        w_ptr,
        N,
        k_lo,
        k_hi,
        stride_w,
        GLU: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        ROPE: tl.constexpr = False,
        HALF: tl.constexpr = 1,
    ):
        """This program's outputs and their first K block of weights (of its K range [k_lo, k_hi); with GLU also the
        up rows, N rows below the gate rows; with ROPE output n is the pair of rows r1 = head * 2 HALF + j and r1 +
        HALF (head = n // HALF, j = n % HALF: what RoPE rotates together); else w2 is w), loaded before the PDL wait:
        no kernel writes the weights."""
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        r1 = rn
        if ROPE:
            r1 = (rn // HALF) * (2 * HALF) + rn % HALF
        row = r1.to(tl.int64) * stride_w
        row2 = (rn + N).to(tl.int64) * stride_w
        if ROPE:
            row2 = (r1 + HALF).to(tl.int64) * stride_w
        rk = k_lo + tl.arange(0, BLOCK_K)
        k_ok = rk < k_hi
        w = tl.load(w_ptr + row[:, None] + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        w2 = w
        if GLU or ROPE:
            w2 = tl.load(w_ptr + row2[:, None] + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        return rn, n_ok, row, row2, rk, k_ok, w, w2

    @triton.jit
    def _rows_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        nw_ptr,
        b_ptr,
        r_ptr,
        part_ptr,
        cnt_ptr,
        ssq_in_ptr,
        ssq_out_ptr,
        T,
        N,
        K,
        K_SPLIT,
        n_ssq,
        stride_x,
        stride_w,
        eps,
        HAS_NORM: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_RES: tl.constexpr,
        GLU: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        IEEE: tl.constexpr,
        FMA: tl.constexpr,
        ONE_K: tl.constexpr,
        SPLIT: tl.constexpr,
        HAS_SSQ: tl.constexpr,
        WANT_SSQ: tl.constexpr,
        SSQ_BLOCK: tl.constexpr,
        USE_PDL: tl.constexpr,
        SWAP: tl.constexpr = False,
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
        K_CHAINS: tl.constexpr = 1,
    ):
        """`gemv` for the T rows of a verify: one program per BLOCK_N outputs and BLOCK_M rows (axis 1), the
        weights read once for all of them; same folds and rounding as `_gemv_kernel`. The rows' products: one tl.dot
        tile (BLOCK_N >= 16, BLOCK_M >= 16), or with FMA the one-row gemv's tiling on the CUDA cores (BLOCK_N < 16:
        a 384-wide matrix in tl.dot tiles of 16 is 24 programs on a 132-SM GPU, in tiles of 2-8 it is 48-192, as
        the one-row step runs it). Like the gemv, the first K block of weights loads before the PDL wait (no kernel
        writes them), so on a small target (one K block: a wide BLOCK_K) the whole weight read overlaps the previous
        kernel's tail.

        SPLIT > 1 (split-K, grid axis 2): each program sums K_SPLIT inputs into fp32 partials (`part_ptr`,
        [SPLIT, 1 or 2, T, N]); the program of an output tile that arrives last (a counter per tile, acq_rel
        atomics, reset by it) adds them in split order — the same sum whichever program is last — and applies the
        folds. A wide tile (many outputs per program keeps the rows' x reads, from L2, well under the weights')
        leaves too few programs to stream a large matrix; the splits restore them.
        HAS_SSQ: the rows' sums of squares arrive as `ssq_in_ptr` [n_ssq, T] (per output tile of the kernel that
        wrote x: WANT_SSQ stores them) instead of every program reading the rows' whole x for the norm — with
        split-K, ~T * K * 2 bytes of L2 reads per program would outweigh its weights.
        K_CHAINS > 1 (one K range, no SSQ/FMA/SWAP/ROPE): the whole range at once in K_CHAINS blocks of BLOCK_K, each
        block's product its own MMA chain (`_rows_chains`), not one chain over every K block."""
        if USE_PDL:
            gdc_launch_dependents()
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = rm < T
        out_ty = y_ptr.dtype.element_ty
        xrow = rm.to(tl.int64) * stride_x
        k_lo = tl.program_id(2) * K_SPLIT
        k_hi = tl.minimum(k_lo + K_SPLIT, K)
        if K_CHAINS > 1:
            tl.static_assert(SPLIT == 1 and not (FMA or SWAP or ROPE or HAS_SSQ), "K chains: one K range, tl.dot tiles")
            rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = rn < N
            acc, acc2 = _rows_chains(
                x_ptr, w_ptr, nw_ptr, xrow, m_ok, rn, n_ok, N, K, stride_w, eps, HAS_NORM, GLU, BLOCK_K, K_CHAINS,
                IEEE, USE_PDL, out_ty,
            )  # fmt: skip
        else:
            rn, n_ok, row, row2, rk, k_ok, w, w2 = _rows_first_block(
                w_ptr, N, k_lo, k_hi, stride_w, GLU, BLOCK_N, BLOCK_K, ROPE, HALF
            )
            PAIR: tl.constexpr = GLU or ROPE
            if USE_PDL:
                gdc_wait()  # x and the residual are the previous kernels' outputs
            if ONE_K and HAS_NORM and not HAS_SSQ:  # the whole row is one block: its 1/rms from the same load
                xv = tl.load(x_ptr + xrow[:, None] + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                xf = xv.to(tl.float32)
                rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / K + eps)
                xv = _rows_apply_norm(xv, rstd, nw_ptr, rk, k_ok, HAS_NORM, out_ty)
            else:
                if HAS_SSQ:
                    rstd = _rows_rstd_given(ssq_in_ptr, n_ssq, T, rm, m_ok, K, eps, SSQ_BLOCK)
                else:
                    rstd = _rows_rstd(x_ptr, xrow, m_ok, K, eps, HAS_NORM, BLOCK_M, BLOCK_K)
                # the first K block with the prefetched weights, then the rest (none when BLOCK_K >= the range)
                xv = _rows_x(x_ptr, xrow, m_ok, rk, k_ok, nw_ptr, rstd, HAS_NORM, out_ty)
            acc = _rows_mac(_rows_acc0(BLOCK_M, BLOCK_N, BLOCK_K, FMA, SWAP), xv, w, IEEE, FMA, SWAP)
            acc2 = _rows_acc0(BLOCK_M, BLOCK_N, BLOCK_K, FMA, SWAP)  # up's (GLU) or the partners' (ROPE) sums
            if PAIR:
                acc2 = _rows_mac(acc2, xv, w2, IEEE, FMA, SWAP)
            for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                k_ok = rk < k_hi
                xv = _rows_x(x_ptr, xrow, m_ok, rk, k_ok, nw_ptr, rstd, HAS_NORM, out_ty)
                w = tl.load(w_ptr + row[:, None] + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                acc = _rows_mac(acc, xv, w, IEEE, FMA, SWAP)
                if PAIR:
                    w2 = tl.load(w_ptr + row2[:, None] + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                    acc2 = _rows_mac(acc2, xv, w2, IEEE, FMA, SWAP)
            acc = _rows_sum(acc, FMA, SWAP)
            acc2 = _rows_sum(acc2, FMA, SWAP)
        if ROPE:  # (never split: the launcher keeps it to one K range)
            _rows_rope_store(
                acc, acc2, b_ptr, q_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, stride_cache_h, NH, NKV,
                rm, m_ok, rn, n_ok, HAS_BIAS, HALF, out_ty,
            )  # fmt: skip
        elif SPLIT > 1:
            _rows_split_end(
                acc, acc2, part_ptr, cnt_ptr, y_ptr, b_ptr, r_ptr, ssq_out_ptr, rm, m_ok, rn, n_ok, T, N,
                HAS_BIAS, HAS_RES, GLU, WANT_SSQ, SPLIT,
            )  # fmt: skip
        else:
            _rows_store(acc, acc2, y_ptr, b_ptr, r_ptr, ssq_out_ptr, rm, m_ok, rn, n_ok, T, N, HAS_BIAS, HAS_RES, GLU,
                        WANT_SSQ)  # fmt: skip

    @triton.jit
    def _rows_chains(
        x_ptr,
        w_ptr,
        nw_ptr,
        xrow,
        m_ok,
        rn,
        n_ok,
        N,
        K,
        stride_w,
        eps,
        HAS_NORM: tl.constexpr,
        GLU: tl.constexpr,
        BLOCK_K: tl.constexpr,
        K_CHAINS: tl.constexpr,
        IEEE: tl.constexpr,
        USE_PDL: tl.constexpr,
        out_ty: tl.constexpr,
    ):
        """The rows' products over all of K as K_CHAINS independent MMA chains -> (acc, acc2) [BLOCK_M, BLOCK_N] fp32.
        One tl.dot over a K block is a chain of MMAs, each waiting on the last one's accumulator (K / 16 of them:
        ~0.5 us for 384 inputs at T = 5, most of a small target's row kernel); here x [C, BLOCK_M, BLOCK_K] and the
        weights [C, BLOCK_N, BLOCK_K] are C = K_CHAINS blocks of one batched dot, whose blocks run side by side (the
        warps split over them), summed once at the end. Every weight loads before the PDL wait; the norm's 1/rms
        comes from the same x load. acc2: the up rows' sums with GLU (else acc)."""
        rk = tl.arange(0, K_CHAINS)[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]  # [C, BLOCK_K]
        k_ok = rk < K
        w_mask = n_ok[None, :, None] & k_ok[:, None, :]
        w = tl.load(w_ptr + rn.to(tl.int64)[None, :, None] * stride_w + rk[:, None, :], mask=w_mask, other=0.0)
        w2 = w
        if GLU:  # w = cat(gate, up): the up rows N below
            w2 = tl.load(
                w_ptr + (rn + N).to(tl.int64)[None, :, None] * stride_w + rk[:, None, :], mask=w_mask, other=0.0
            )
        if USE_PDL:
            gdc_wait()  # x is the previous kernel's output
        xv = tl.load(
            x_ptr + xrow[None, :, None] + rk[:, None, :], mask=m_ok[None, :, None] & k_ok[:, None, :], other=0.0
        )
        if HAS_NORM:
            xf = xv.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(xf * xf, axis=2), axis=0) / K + eps)
            nw = tl.load(nw_ptr + rk, mask=k_ok, other=0.0)
            xv = _rms_apply(xv, rstd[None, :, None], nw[:, None, :], out_ty)
        acc = tl.sum(_rows_batched_dot(xv, w, IEEE), axis=0)
        acc2 = acc
        if GLU:
            acc2 = tl.sum(_rows_batched_dot(xv, w2, IEEE), axis=0)
        return acc, acc2

    @triton.jit
    def _rows_batched_dot(xv, w, IEEE: tl.constexpr):
        """[C, M, K] @ [C, N, K]^T -> [C, M, N] fp32 (exact fp32 products for fp32)."""
        wt = tl.permute(w, (0, 2, 1))
        if IEEE:
            out = tl.dot(xv.to(tl.float32), wt.to(tl.float32), input_precision="ieee")
        else:
            out = tl.dot(xv, wt)
        return out

    @triton.jit
    def _rows_rope_store(
        a,
        b,
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
        rm,
        m_ok,
        rn,
        n_ok,
        HAS_BIAS: tl.constexpr,
        HALF: tl.constexpr,
        out_ty: tl.constexpr,
    ):
        """`gemm_rows(rope=)`'s end, `kernels._rope_epilogue` for T rows: a, b [BLOCK_M, BLOCK_N] the sums of each
        pair's rows; rounded as the projection's outputs, q/k heads rotated at each row's position, q to q_ptr [T,
        NH, D], k and v to the caches at each row's slot."""
        D: tl.constexpr = 2 * HALF
        head = rn // HALF
        j = rn % HALF
        r1 = head * D + j
        if HAS_BIAS:
            a += tl.load(b_ptr + r1, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            b += tl.load(b_ptr + r1 + HALF, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        a = a.to(out_ty).to(tl.float32)
        b = b.to(out_ty).to(tl.float32)
        ok = m_ok[:, None] & n_ok[None, :]
        pos = tl.load(pos_ptr + rm, mask=m_ok, other=0).to(tl.int64)[:, None]
        cs = pos * D + j[None, :]
        c1 = tl.load(cos_ptr + cs, mask=ok, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + cs + HALF, mask=ok, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + cs, mask=ok, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + cs + HALF, mask=ok, other=0.0).to(tl.float32)
        o1 = ((a * c1).to(out_ty).to(tl.float32) + (-b * s1).to(out_ty).to(tl.float32)).to(out_ty)
        o2 = ((b * c2).to(out_ty).to(tl.float32) + (a * s2).to(out_ty).to(tl.float32)).to(out_ty)
        rot = (head < NH + NKV)[None, :]
        o1 = tl.where(rot, o1, a.to(out_ty))
        o2 = tl.where(rot, o2, b.to(out_ty))
        qo = (rm[:, None] * NH + head[None, :]) * D + j[None, :]
        is_q = ok & (head < NH)[None, :]
        tl.store(q_ptr + qo, o1, mask=is_q)
        tl.store(q_ptr + qo + HALF, o2, mask=is_q)
        slot = tl.load(slot_ptr + rm, mask=m_ok, other=0).to(tl.int64)[:, None]
        kvh = tl.where(head < NH + NKV, head - NH, head - NH - NKV).to(tl.int64)[None, :]
        kv = kvh * stride_cache_h + slot * D + j[None, :]
        is_k = ok & ((head >= NH) & (head < NH + NKV))[None, :]
        is_v = ok & (head >= NH + NKV)[None, :]
        tl.store(kc_ptr + kv, o1, mask=is_k)
        tl.store(kc_ptr + kv + HALF, o2, mask=is_k)
        tl.store(vc_ptr + kv, o1, mask=is_v)
        tl.store(vc_ptr + kv + HALF, o2, mask=is_v)

    @triton.jit
    def _rows_apply_norm(xv, rstd, nw_ptr, rk, k_ok, HAS_NORM: tl.constexpr, out_ty: tl.constexpr):
        if HAS_NORM:
            xv = _rms_apply(xv, rstd[:, None], tl.load(nw_ptr + rk, mask=k_ok, other=0.0)[None, :], out_ty)
        return xv

    @triton.jit
    def _rows_rstd_given(ssq_ptr, n_ssq, T, rm, m_ok, K, eps, SSQ_BLOCK: tl.constexpr):
        """Each row's 1/rms from the sums of squares the kernel that wrote x left per output tile ([n_ssq, T]),
        added in tile order."""
        js = tl.arange(0, SSQ_BLOCK)
        ss = tl.load(ssq_ptr + js[:, None] * T + rm[None, :], mask=(js < n_ssq)[:, None] & m_ok[None, :], other=0.0)
        return 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)

    @triton.jit
    def _rows_split_end(
        acc,
        acc2,
        part_ptr,
        cnt_ptr,
        y_ptr,
        b_ptr,
        r_ptr,
        ssq_out_ptr,
        rm,
        m_ok,
        rn,
        n_ok,
        T,
        N,
        HAS_BIAS: tl.constexpr,
        HAS_RES: tl.constexpr,
        GLU: tl.constexpr,
        WANT_SSQ: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
        """Split-K's end: this split's partial sums to `part_ptr`; the tile's last-arriving program adds all
        SPLIT partials in split order and stores the outputs with the folds (`_rows_store`)."""
        G: tl.constexpr = 2 if GLU else 1
        cell = rm[:, None] * N + rn[None, :]
        ok = m_ok[:, None] & n_ok[None, :]
        plane = T * N
        base = part_ptr + tl.program_id(2).to(tl.int64) * (G * plane)
        tl.store(base + cell, acc, mask=ok)
        if GLU:
            tl.store(base + plane + cell, acc2, mask=ok)
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        # every thread's stores before the one atomic (a CTA barrier), whose acq_rel at GPU scope publishes them to
        # the last program's loads (from L2, not a possibly stale L1: .cg) — as `kernels._argmax_epilogue`
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:
            s_acc = tl.zeros_like(acc)
            s_acc2 = tl.zeros_like(acc2)
            for s in tl.static_range(SPLIT):
                p = part_ptr + s * (G * plane)
                s_acc += tl.load(p + cell, mask=ok, other=0.0, cache_modifier=".cg")
                if GLU:
                    s_acc2 += tl.load(p + plane + cell, mask=ok, other=0.0, cache_modifier=".cg")
            _rows_store(s_acc, s_acc2, y_ptr, b_ptr, r_ptr, ssq_out_ptr, rm, m_ok, rn, n_ok, T, N, HAS_BIAS, HAS_RES,
                        GLU, WANT_SSQ)  # fmt: skip
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _rows_rstd(x_ptr, xrow, m_ok, K, eps, HAS_NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """Each row's 1/rms over its K features (all ones without the norm); x is L2-resident."""
        rstd = tl.full([BLOCK_M], 1.0, tl.float32)
        if HAS_NORM:
            ss = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                rkn = k0 + tl.arange(0, BLOCK_K)
                xv = tl.load(
                    x_ptr + xrow[:, None] + rkn[None, :], mask=m_ok[:, None] & (rkn < K)[None, :], other=0.0
                ).to(tl.float32)
                ss += tl.sum(xv * xv, axis=1)
            rstd = 1.0 / tl.sqrt(ss / K + eps)
        return rstd

    @triton.jit
    def _rows_store(
        acc,
        acc2,
        y_ptr,
        b_ptr,
        r_ptr,
        ssq_out_ptr,
        rm,
        m_ok,
        rn,
        n_ok,
        T,
        N,
        HAS_BIAS: tl.constexpr,
        HAS_RES: tl.constexpr,
        GLU: tl.constexpr,
        WANT_SSQ: tl.constexpr,
    ):
        """The folds after the matmul, as `_gemv_kernel` rounds them: bias, silu(gate) * up (acc2: up), residual.
        WANT_SSQ: also each row's sum of squares of the stored outputs of this tile, at ssq_out[program_id(0), row]
        (what the next norm-folding gemm_rows reads instead of the whole rows)."""
        out_ty = y_ptr.dtype.element_ty
        y = acc
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GLU:
            u = acc2
            if HAS_BIAS:
                u += tl.load(b_ptr + N + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            y = _silu_mul(y.to(out_ty).to(tl.float32), u.to(out_ty).to(tl.float32), out_ty).to(tl.float32)
        out = rm[:, None] * N + rn[None, :]
        ok = m_ok[:, None] & n_ok[None, :]
        if HAS_RES:
            y = y.to(out_ty).to(tl.float32) + tl.load(r_ptr + out, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + out, y.to(out_ty), mask=ok)
        if WANT_SSQ:
            yr = tl.where(ok, y.to(out_ty).to(tl.float32), 0.0)
            tl.store(ssq_out_ptr + tl.program_id(0) * T + rm, tl.sum(yr * yr, axis=1), mask=m_ok)


if triton is not None:

    @triton.jit
    def _rows_tma_kernel(
        x_desc,
        w_desc,
        y_ptr,
        b_ptr,
        r_ptr,
        part_ptr,
        cnt_ptr,
        T,
        N,
        K,
        K_SPLIT,
        HAS_BIAS: tl.constexpr,
        HAS_RES: tl.constexpr,
        GLU: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        IEEE: tl.constexpr,
        SPLIT: tl.constexpr,
        SWAP: tl.constexpr,
        STAGES: tl.constexpr,
        WS: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """`_rows_kernel` without the norm prologue, its x and weight blocks fed by the copy engine (TMA tensor
        descriptors: rows past T and inputs past K read as zeros) through a `tl.range` pipeline of STAGES (WS: warp
        specialisation, producer and consumer warps) — the way cuBLAS's few-row kernels stream weights. Grid and
        split-K as `_rows_kernel` (axis 2: K ranges of K_SPLIT, a multiple of BLOCK_K, so no block crosses into the
        next range)."""
        if USE_PDL:
            gdc_launch_dependents()
            gdc_wait()
        n0 = tl.program_id(0) * BLOCK_N
        k_lo = tl.program_id(2) * K_SPLIT
        k_hi = tl.minimum(k_lo + K_SPLIT, K)
        acc = _rows_acc0(BLOCK_M, BLOCK_N, BLOCK_K, False, SWAP)
        acc2 = _rows_acc0(BLOCK_M, BLOCK_N, BLOCK_K, False, SWAP)
        for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES, warp_specialize=WS):
            xv = x_desc.load([0, k])
            acc = _rows_mac(acc, xv, w_desc.load([n0, k]), IEEE, False, SWAP)
            if GLU:
                acc2 = _rows_mac(acc2, xv, w_desc.load([N + n0, k]), IEEE, False, SWAP)
        acc = _rows_sum(acc, False, SWAP)
        acc2 = _rows_sum(acc2, False, SWAP)
        rm = tl.arange(0, BLOCK_M)
        m_ok = rm < T
        rn = n0 + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        if SPLIT > 1:
            _rows_split_end(
                acc, acc2, part_ptr, cnt_ptr, y_ptr, b_ptr, r_ptr, y_ptr, rm, m_ok, rn, n_ok, T, N,
                HAS_BIAS, HAS_RES, GLU, False, SPLIT,
            )  # fmt: skip
        else:
            _rows_store(acc, acc2, y_ptr, b_ptr, r_ptr, y_ptr, rm, m_ok, rn, n_ok, T, N, HAS_BIAS, HAS_RES, GLU, False)


def gemm_rows_tma(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    glu: bool = False,
    block_n: int = 128,
    block_k: int = 64,
    num_warps: int = 4,
    split: int = 1,
    num_stages: int = 4,
    swap: bool = True,
    warp_specialize: bool = False,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """x [T, K] @ w^T (+ bias, silu(gate) * up with `glu`, + residual) for T <= ROWS_MAX through `_rows_tma_kernel`
    (no norm fold: x is the normed rows). Experimental, for `bench/rows_gemm.py`'s comparison with cuBLAS; not on any
    forward's path."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    _need()
    cfg = config if config is not None else KernelConfig()
    x = x.reshape(-1, x.shape[-1]).contiguous()
    T, K = x.shape
    N = w.shape[0] // 2 if glu else w.shape[0]
    if T > ROWS_MAX or w.shape[1] != K or w.stride(1) != 1 or (glu and w.shape[0] % 2):
        raise ValueError(f"gemm_rows_tma: {T} rows of {K} features do not fit weight {tuple(w.shape)}")
    bm = max(16, triton.next_power_of_2(T))
    grid_n = triton.cdiv(N, block_n)
    k_split = triton.cdiv(triton.cdiv(K, block_k), max(1, int(split))) * block_k
    sp = triton.cdiv(K, k_split)
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    part = torch.empty(sp, 2 if glu else 1, T, N, dtype=torch.float32, device=x.device) if sp > 1 else y
    _rows_tma_kernel[(grid_n, 1, sp)](
        TensorDescriptor.from_tensor(x, [bm, block_k]),
        TensorDescriptor.from_tensor(w, [block_n, block_k]),
        y,
        bias if bias is not None else y,
        residual.reshape(T, N).contiguous() if residual is not None else y,
        part,
        _rows_counters(x.device) if sp > 1 else y,
        T,
        N,
        K,
        k_split if sp > 1 else K,
        HAS_BIAS=bias is not None,
        HAS_RES=residual is not None,
        GLU=bool(glu),
        BLOCK_M=bm,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        IEEE=x.dtype == torch.float32 or _INTERPRET,
        SPLIT=sp,
        SWAP=bool(swap),
        STAGES=int(num_stages),
        WS=bool(warp_specialize),
        num_warps=num_warps,
        **_pdl(x, cfg.pdl),
    )
    return y


# Shared memory a launch may take for its pipelined (x, w) K blocks: under the H100/H200's 227 KB with room for the
# epilogue. A wide fp32 tile (16 x 1024, the tests' reference dtype) takes 128 KB a stage: one stage, not triton's 3.
ROWS_SMEM_BUDGET = 200 * 1024


def _rows_stages(block_m: int, block_n: int, block_k: int, glu: bool, esize: int) -> int:
    """Pipeline stages of the K loop that fit ROWS_SMEM_BUDGET (1-3): a wide K block leaves no loop to pipeline."""
    per_stage = (block_m + block_n * (2 if glu else 1)) * block_k * esize
    return max(1, min(3, ROWS_SMEM_BUDGET // per_stage))


# The CUDA-core products (`_rows_kernel` with FMA, tiles of BLOCK_N < 16): rows per program (more: more programs).
FMA_BLOCK_M = 8

# gemm_rows: the tile over (T rows padded to BLOCK_M, BLOCK_N outputs, BLOCK_K inputs) is `KernelConfig.rows_block_n`
# / `rows_block_k` / `rows_num_warps`. ROWS_MAX: the most rows one tile takes (a tree verify of 64 nodes).
ROWS_MAX = 64


def _rows_key(N, K, dtype, norm_weight, bias, residual, glu) -> tuple:
    return (int(N), int(K), str(dtype), norm_weight is not None, bias is not None, residual is not None, bool(glu))


# Past this many inputs a norm-folding gemm_rows takes its rows' sums of squares from the kernel that wrote them
# (`row_ssq`, `want_ssq`; `ops.TritonRowsOps` passes them): below it the rows fit one K block of the tile and their
# norm comes from the same load for free (a small target's verify is unchanged by it).
SSQ_MIN_K = 2048

# Split-K (`gemm_rows(split=)`, a 4th tile field): the arrival counters, one per output tile, zero between launches
# (each launch's last program per tile resets its own). Kept for the process per device — a CUDA graph bakes their
# address in — and made at the first split launch, which the tuner's eager launches make before any capture.
ROWS_MAX_TILES = 1 << 16
_ROWS_CNT: dict = {}


def _rows_counters(device: torch.device) -> torch.Tensor:
    """The split-K arrival counters on `device`. One launch at a time uses them: launches on one stream run in
    order (PDL included: a program touches them only after its wait on the previous kernel)."""
    cnt = _ROWS_CNT.get(device)
    if cnt is None:
        cnt = _ROWS_CNT[device] = torch.zeros(ROWS_MAX_TILES, dtype=torch.int32, device=device)
    return cnt


def _splits(K: int, block_k: int, split: int) -> bool:
    """Whether K in BLOCK_K blocks divides into `split` non-empty ranges as gemm_rows cuts them."""
    return triton.cdiv(K, triton.cdiv(triton.cdiv(K, block_k), split) * block_k) == split


def _tile4(tile) -> tuple[int, int, int, int]:
    """A rows tile as (BLOCK_N, BLOCK_K, num_warps, split): the 3-field tiles of before split-K are split 1."""
    return tuple(tile) if len(tile) == 4 else (*tile, 1)


def gemm_rows(
    x: torch.Tensor,
    w: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    glu: bool = False,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    config: KernelConfig | None = None,
    split: int | None = None,
    row_ssq: torch.Tensor | None = None,
    want_ssq: bool = False,
    swap: bool = False,
    num_stages: int | None = None,
    rope: tuple | None = None,
    out: torch.Tensor | None = None,
    k_chains: int | None = None,
):
    """`gemv` for x [T, K] with 1 <= T <= ROWS_MAX (the tokens of a verify) -> [T, N] (N = rows of w, halved with
    `glu`); residual [T, N]. Same folds and rounding as `gemv` (no act_mul). The tile: the arguments, else
    `config`'s rows tile. Traced by torch.compile: the `draftsmith::gemm_rows` operator.

    split: K in that many ranges over programs (split-K; their fp32 partials added in range order by the last
    program of each output tile), else the tile's. want_ssq: return (y, ssq), ssq [n_tiles, T] fp32 each output
    tile's sum of squares of y's rows; row_ssq: such an ssq of x (its rows' norm from it, not from reading x
    whole: what keeps a split-K norm fold cheap). Under tracing neither is used (ssq None; the norm reads x).
    swap (tl.dot tiles): the weights as the MMA's M side (`_rows_mac`); num_stages: the K loop's pipeline depth
    (default: as many as ROWS_SMEM_BUDGET fits, at most 3) — both for benchmarks' sweeps.
    rope = (positions [T], slots [T], cos, sin, k_cache, v_cache, n_heads, n_kv) as `kernels.rope_and_cache` takes
    them (no q/k norm): w is the fused q/k/v projection, RoPE and the cache writes happen in the epilogue, and the
    return is q [T, n_heads * d] — `rope_and_cache(gemm_rows(x, w, ...))` in one launch (`KernelConfig.rope_fold`;
    the unfolded projection's tile with half the outputs a program, one K range; traced as `draftsmith::qkv_rope`).
    out [T, N] contiguous: where the outputs go (the tuner's dependent chain, `kernels.chained_io`); not with rope or
    under tracing. k_chains: K in that many BLOCK_K blocks of one batched dot (independent MMA chains, `_rows_chains`;
    a power of two, k_chains * BLOCK_K >= K), else `config.rows_k_chains`'s rule (`_k_chains`)."""
    _need()
    if rope is not None:
        if out is not None:
            raise ValueError("gemm_rows: out takes the outputs of a plain launch, not of rope")
        return _gemm_rows_rope(x, w, norm_weight, eps, bias, rope, config, block_n, block_k, num_warps)
    if _tracing() and block_n is None and block_k is None and num_warps is None and split is None and out is None:
        y = _gemm_rows_op(x, w, norm_weight, float(eps), bias, residual, bool(glu), config_key(config))
        return (y, None) if want_ssq else y
    cfg = config if config is not None else KernelConfig()
    x = x.reshape(-1, x.shape[-1])
    T, K = x.shape
    N = w.shape[0] // 2 if glu else w.shape[0]
    if T > ROWS_MAX or w.shape[1] != K or w.stride(1) != 1 or (glu and w.shape[0] % 2):
        raise ValueError(
            f"gemm_rows: {T} rows of {K} features (at most {ROWS_MAX} rows) do not fit weight "
            f"{tuple(w.shape)} (strides {w.stride()}){' as cat(gate, up)' if glu else ''}"
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    tile = cfg.rows_tuned.get(_rows_key(N, K, x.dtype, norm_weight, bias, residual, glu))
    bn0, bk0, nw0, sp0 = _tile4(tile or (cfg.rows_block_n, cfg.rows_block_k, cfg.rows_num_warps, cfg.rows_split))
    bn, bk, nw, sp = block_n or bn0, block_k or bk0, num_warps or nw0, split or sp0
    fma = bn < 16  # a gemv-like tile: the CUDA-core products, rows in blocks of at most FMA_BLOCK_M (grid axis 1)
    bm = min(FMA_BLOCK_M, triton.next_power_of_2(T)) if fma else max(16, triton.next_power_of_2(T))
    grid_n, grid_m = triton.cdiv(N, bn), triton.cdiv(T, bm)
    # K per split in whole blocks; the splits actually launched (rounding can leave fewer than asked, never empty)
    k_split = triton.cdiv(triton.cdiv(K, bk), max(1, int(sp))) * bk
    sp = triton.cdiv(K, k_split)
    if sp > 1 and grid_n * grid_m > ROWS_MAX_TILES:
        k_split, sp = K, 1
    if sp == 1:
        k_split = K
    one_range = not (fma or swap or sp > 1 or row_ssq is not None)
    chains = _k_chains(K, bm, bn, bk, glu, x.element_size(), k_chains, cfg) if one_range else 1
    if row_ssq is not None and (row_ssq.dim() != 2 or row_ssq.shape[1] != T or row_ssq.dtype != torch.float32):
        raise ValueError(f"gemm_rows: row_ssq {tuple(row_ssq.shape)} {row_ssq.dtype} is not [tiles, {T}] float32")
    if out is not None and (out.numel() != T * N or out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError(f"gemm_rows: out must be [{T}, {N}] contiguous {x.dtype}, not {tuple(out.shape)} {out.dtype}")
    y = out.view(T, N) if out is not None else torch.empty(T, N, dtype=x.dtype, device=x.device)
    dummy = x
    part = torch.empty(sp, 2 if glu else 1, T, N, dtype=torch.float32, device=x.device) if sp > 1 else dummy
    ssq = torch.empty(grid_n, T, dtype=torch.float32, device=x.device) if want_ssq else None
    _rows_kernel[(grid_n, grid_m, sp)](
        x,
        w,
        y,
        norm_weight if norm_weight is not None else dummy,
        bias if bias is not None else dummy,
        residual.reshape(T, N).contiguous() if residual is not None else dummy,
        part,
        _rows_counters(x.device) if sp > 1 else dummy,
        row_ssq if row_ssq is not None else dummy,
        ssq if ssq is not None else dummy,
        T,
        N,
        K,
        k_split,
        row_ssq.shape[0] if row_ssq is not None else 0,
        x.stride(0),
        w.stride(0),
        float(eps),
        HAS_NORM=norm_weight is not None,
        HAS_BIAS=bias is not None,
        HAS_RES=residual is not None,
        GLU=bool(glu),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        IEEE=x.dtype == torch.float32 or _INTERPRET,
        FMA=fma,
        ONE_K=bk >= K,
        SPLIT=sp,
        HAS_SSQ=row_ssq is not None and norm_weight is not None and bk < K,
        WANT_SSQ=bool(want_ssq),
        SSQ_BLOCK=triton.next_power_of_2(row_ssq.shape[0]) if row_ssq is not None else 1,
        SWAP=bool(swap) and not fma,
        K_CHAINS=chains,
        num_warps=nw,
        num_stages=1 if fma or chains > 1 else (num_stages or _rows_stages(bm, bn, bk, glu, x.element_size())),
        **_pdl(x, cfg.pdl),
    )
    return (y, ssq) if want_ssq else y


# The most K blocks `_rows_chains` takes at once (its x and weight tiles hold all of them: registers and shared memory)
ROWS_MAX_CHAINS = 8


def _k_chains(
    K: int, block_m: int, block_n: int, block_k: int, glu: bool, esize: int, asked: int | None, cfg: KernelConfig
) -> int:
    """How many independent MMA chains a one-range tl.dot launch runs over K (1: the K loop, one chain). `asked` (a
    benchmark's or test's) must be a power of two that covers K; else with `cfg.rows_k_chains` every K that needs more
    than one block and at most ROWS_MAX_CHAINS of them, whose x and weight blocks ((BLOCK_M + BLOCK_N x 1 or 2 with
    glu) x K x element size bytes) fit ROWS_SMEM_BUDGET. The launcher, bench/kernels_aot.py and bench/decode_small.py
    all take the rule from here."""
    if asked is not None:
        if asked < 1 or asked & (asked - 1) or asked > ROWS_MAX_CHAINS or (asked > 1 and asked * block_k < K):
            raise ValueError(
                f"gemm_rows: k_chains={asked} must be a power of two <= {ROWS_MAX_CHAINS} whose blocks of "
                f"{block_k} cover K={K}"
            )
        return asked
    if not cfg.rows_k_chains or block_k >= K:
        return 1
    c = triton.next_power_of_2(triton.cdiv(K, block_k))
    smem = c * block_k * (block_m + block_n * (2 if glu else 1)) * esize
    return c if c <= ROWS_MAX_CHAINS and smem <= ROWS_SMEM_BUDGET else 1


def _gemm_rows_rope(x, w, norm_weight, eps, bias, rope, config, block_n, block_k, num_warps) -> torch.Tensor:
    """`gemm_rows(rope=)`: the fused q/k/v projection of T rows with RoPE and the cache writes in its epilogue."""
    positions, slots, cos, sin, k_cache, v_cache, n_heads, n_kv = rope
    if _tracing():
        from draftsmith.decode.kernels import qkv_rope_op

        return qkv_rope_op(x, w, norm_weight, eps, bias, rope, config)
    cfg = config if config is not None else KernelConfig()
    d = cos.shape[1]
    x = x.reshape(-1, x.shape[-1])
    T, K = x.shape
    rows = w.shape[0]
    if d % 2 or rows != (n_heads + 2 * n_kv) * d or w.stride(1) != 1 or w.shape[1] != K or T > ROWS_MAX:
        raise ValueError(
            f"gemm_rows(rope=): a fused q/k/v weight of ({n_heads} + 2 x {n_kv}) x {d} rows over {K} features and "
            f"at most {ROWS_MAX} rows; got {tuple(w.shape)} for {T} rows"
        )
    if k_cache.stride(-1) != 1 or k_cache.stride(-2) != d or k_cache.stride() != v_cache.stride():
        raise ValueError("gemm_rows(rope=): the caches must be [1, n_kv, max_len, d] with contiguous rows")
    if x.stride(1) != 1:
        x = x.contiguous()
    tile = cfg.rows_tuned.get(_rows_key(rows, K, x.dtype, norm_weight, bias, None, False))
    bn, bk, nw, _ = _tile4(tile or (cfg.rows_block_n, cfg.rows_block_k, cfg.rows_num_warps, 1))
    # the same rows a program: half the outputs (pairs), kept on the tensor cores where the tile was
    bn = block_n or (bn // 2 if bn < 16 or bn // 2 >= 16 else 16)
    bk, nw = block_k or bk, num_warps or nw
    fma = bn < 16
    bm = min(FMA_BLOCK_M, triton.next_power_of_2(T)) if fma else max(16, triton.next_power_of_2(T))
    N = rows // 2
    q = torch.empty(T, n_heads * d, dtype=x.dtype, device=x.device)
    dummy = x
    _rows_kernel[(triton.cdiv(N, bn), triton.cdiv(T, bm), 1)](
        x,
        w,
        q,
        norm_weight if norm_weight is not None else dummy,
        bias if bias is not None else dummy,
        dummy,
        dummy,
        dummy,
        dummy,
        dummy,
        T,
        N,
        K,
        K,
        0,
        x.stride(0),
        w.stride(0),
        float(eps),
        HAS_NORM=norm_weight is not None,
        HAS_BIAS=bias is not None,
        HAS_RES=False,
        GLU=False,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        IEEE=x.dtype == torch.float32 or _INTERPRET,
        FMA=fma,
        ONE_K=bk >= K,
        SPLIT=1,
        HAS_SSQ=False,
        WANT_SSQ=False,
        SSQ_BLOCK=1,
        num_warps=nw,
        num_stages=1 if fma else _rows_stages(bm, 2 * bn, bk, False, x.element_size()),
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
        ROPE=True,
        HALF=d // 2,
        **_pdl(x, cfg.pdl),
    )
    return q


def tune_rows(
    mats: list[torch.Tensor],
    rows: int,
    norm_weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    residual: bool = False,
    glu: bool = False,
    reps: int = 10,
    configs: list[tuple[int, int, int]] | None = None,
    force: bool = False,
    config: KernelConfig | None = None,
) -> list[dict]:
    """`kernels.tune_gemv` for gemm_rows: time every tile of `configs` (default `config.rows_sweep`, or
    `config.rows_split_sweep` from SSQ_MIN_K inputs on) on `mats` with
    `rows` tokens and keep the fastest in `config.rows_tuned` (the default tile is among those timed, so the choice is
    never slower than it at tuning time). One row per tile; [] when tuned before (unless `force`) or on the CPU."""
    from draftsmith.decode.kernels import chained_io, sweep_tiles

    _need()
    cfg = config if config is not None else KernelConfig()
    w0 = mats[0]
    if w0.device.type != "cuda":
        return []
    N = w0.shape[0] // 2 if glu else w0.shape[0]
    K = w0.shape[1]
    x = torch.randn(rows, K, device=w0.device, dtype=w0.dtype)
    r = torch.randn(rows, N, device=w0.device, dtype=w0.dtype) if residual else None
    key = _rows_key(N, K, w0.dtype, norm_weight, bias, r, glu)
    if key in cfg.rows_tuned and not force:
        return []
    x, y_buf = chained_io(rows, K, N, x) if cfg.tune_chained else (x, None)
    # split tiles whose K ranges would round to fewer splits than asked time another tile: dropped
    configs = configs or (cfg.rows_split_sweep if K >= SSQ_MIN_K else cfg.rows_sweep)
    sweep = [_tile4(t) for t in configs if _tile4(t)[3] == 1 or _splits(K, *_tile4(t)[1::2])]
    default = (cfg.rows_block_n, cfg.rows_block_k, cfg.rows_num_warps, cfg.rows_split)
    if default not in sweep:
        sweep.append(default)
    # the norm's rows sums of squares as the forward passes them past SSQ_MIN_K (a producer's ssq)
    ssq = torch.rand(8, rows, device=w0.device) * K if norm_weight is not None and K >= SSQ_MIN_K else None

    def launch(tile):
        bn, bk, nw, sp = tile
        for w in mats:
            gemm_rows(
                x, w, norm_weight, bias=bias, residual=r, glu=glu, block_n=bn, block_k=bk, num_warps=nw, split=sp,
                row_ssq=ssq, out=y_buf, config=cfg,
            )  # fmt: skip

    out = sweep_tiles(
        sweep, ("BLOCK_N", "BLOCK_K", "warps", "split"), launch, len(mats), reps, cfg.rows_tuned, key, cfg.tuned_us
    )
    return [{**row, "rows": rows} for row in out]


if triton is not None:

    @torch.library.custom_op("draftsmith::gemm_rows", mutates_args=())
    def _gemm_rows_op(
        x: torch.Tensor,
        w: torch.Tensor,
        norm_weight: torch.Tensor | None,
        eps: float,
        bias: torch.Tensor | None,
        residual: torch.Tensor | None,
        glu: bool,
        config: int,
    ) -> torch.Tensor:
        return gemm_rows(x, w, norm_weight, eps, bias, residual, glu, config=config_for(config))

    @_gemm_rows_op.register_fake
    def _(x, w, norm_weight, eps, bias, residual, glu, config):
        return x.new_empty(x.numel() // x.shape[-1], w.shape[0] // 2 if glu else w.shape[0])


__all__ = ["ROWS_MAX", "SSQ_MIN_K", "gemm_rows", "gemm_rows_tma", "tune_rows"]
