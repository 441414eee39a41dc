"""Triton kernels for the bs=1 decode step (opt-in: `LlamaFamilyForward.kernels = "triton"`; not yet measured).

Why: an 8B-shape plain step spends 0.90 of copy bandwidth in its weight matmuls alone, but the whole compiled
step reaches 0.74 — the rest is ~16 kernels per layer where ~8 would do (bench/decode_kernels.py, docs/LOG.md).
`gemv` folds the two neighbours of every matmul into it:

  y = W @ xn (+ bias) (+ residual),   xn = rmsnorm(x) * norm_weight  (or x itself without `norm_weight`)

so a layer is four of these (q/k/v with the input norm, o_proj with the residual, gate/up with the post-attention
norm, down with the residual) and no separate norm, residual-add or split-K reduce kernels. One program computes
BLOCK_N outputs over all of K (no split-K): N/BLOCK_N programs (384 for the 8B q/k/v) keep the GPU's memory
system busy on their own. Each program recomputes the norm's sum of squares of x (K values, L2-resident).

Rounding follows the torch path op for op (HF's RMSNorm: fp32 normalise, round to the model dtype, times the
weight, round; the matmul accumulates in fp32 and rounds once; the residual add rounds again), so outputs match
it up to the matmul's summation order.

Runs on CUDA, and on CPU tensors under `TRITON_INTERPRET=1` (the tests). `available()` says whether triton
imports at all; without it the compact forward keeps its torch path.
"""

from __future__ import annotations

import torch

try:  # an optional dependency: the CUDA wheels of torch bring it, the CPU wheel does not
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001
    triton = tl = None


# Tile of one program: BLOCK_N outputs, K walked BLOCK_K at a time. Module-level so that a benchmark can sweep
# them (bench/decode_kernels.py --gemv-blocks); not tuned on a GPU yet.
BLOCK_N = 16
BLOCK_K = 512


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, y_ptr, nw_ptr, b_ptr, r_ptr, N, K, stride_w, eps,
                     HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        row = rn.to(tl.int64) * stride_w  # int64: a 256k-vocab x 16k lm_head passes 2^31 elements
        out_ty = y_ptr.dtype.element_ty
        rstd = 1.0
        if HAS_NORM:
            ss = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                xv = tl.load(x_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
                ss += xv * xv
            rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            xv = tl.load(x_ptr + rk, mask=k_ok, other=0.0)
            if HAS_NORM:
                xn = (xv.to(tl.float32) * rstd).to(out_ty)  # HF: normalise in fp32, round to the model dtype
                nw = tl.load(nw_ptr + rk, mask=k_ok, other=0.0)
                xv = (nw.to(tl.float32) * xn.to(tl.float32)).to(out_ty)  # ... times the weight, round
            w = tl.load(w_ptr + row[:, None] + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        if HAS_RES:  # the linear's output is rounded before the residual add, as two torch ops would
            y = y.to(out_ty).to(tl.float32) + tl.load(r_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + rn, y.to(out_ty), mask=n_ok)


def gemv(x: torch.Tensor, w: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
         bias: torch.Tensor | None = None, residual: torch.Tensor | None = None, block_n: int | None = None,
         block_k: int | None = None) -> torch.Tensor:
    """x [1, K] or [K]; w [N, K] (rows contiguous) -> [1, N] in x's dtype. See the module docstring."""
    if triton is None:
        raise RuntimeError("triton is not installed: the compact forward's torch path needs no kernels")
    K = x.shape[-1]
    N = w.shape[0]
    if w.shape[1] != K or w.stride(1) != 1:
        raise ValueError(f"gemv: weight {tuple(w.shape)} (strides {w.stride()}) does not fit x of {K} features")
    block_n, block_k = block_n or BLOCK_N, block_k or BLOCK_K
    xf = x.reshape(K).contiguous()
    y = torch.empty(N, dtype=x.dtype, device=x.device)
    dummy = xf  # never read when the matching HAS_* flag is off
    grid = (triton.cdiv(N, block_n),)
    _gemv_kernel[grid](xf, w, y, norm_weight if norm_weight is not None else dummy,
                       bias if bias is not None else dummy,
                       residual.reshape(N).contiguous() if residual is not None else dummy,
                       N, K, w.stride(0), float(eps),
                       HAS_NORM=norm_weight is not None, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
                       BLOCK_N=block_n, BLOCK_K=block_k)
    return y[None]


__all__ = ["available", "gemv"]
