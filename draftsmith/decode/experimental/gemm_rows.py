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
    def _rows_mac(acc, xv, w, IEEE: tl.constexpr, FMA: tl.constexpr):
        """acc [BLOCK_M, BLOCK_N] += xv [BLOCK_M, BLOCK_K] @ w [BLOCK_N, BLOCK_K]^T: one tl.dot (exact fp32 products for
        fp32); with FMA (tiles under tl.dot's 16, on the CUDA cores) acc is [BLOCK_M, BLOCK_N, BLOCK_K] and takes every
        row's products elementwise, as the gemv does for one row: `_rows_sum` reduces over K once, after the K loop
        (a reduction per row, serialised, lost to tl.dot: docs/LOG.md)."""
        # (one return after the branches: triton compiles the statements after a constexpr branch's return too, and
        # a tl.dot of the 3-D accumulator does not compile)
        if FMA:
            out = acc + xv.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        elif IEEE:
            out = tl.dot(xv.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            out = tl.dot(xv, tl.trans(w), acc)
        return out

    @triton.jit
    def _rows_acc0(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FMA: tl.constexpr):
        if FMA:
            acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        return acc

    @triton.jit
    def _rows_sum(acc, FMA: tl.constexpr):
        if FMA:
            out = tl.sum(acc, axis=2)
        else:
            out = acc
        return out

    @triton.jit
    def _rows_first_block(w_ptr, N, K, stride_w, GLU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """This program's outputs and their first K block of weights (with GLU also the up rows, N rows below the
        gate rows; else w2 is w), loaded before the PDL wait: no kernel writes the weights."""
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        row = rn.to(tl.int64) * stride_w
        row2 = (rn + N).to(tl.int64) * stride_w
        rk = tl.arange(0, BLOCK_K)
        k_ok = rk < K
        w = tl.load(w_ptr + row[:, None] + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        w2 = w
        if GLU:
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
        T,
        N,
        K,
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
        USE_PDL: tl.constexpr,
    ):
        """`gemv` for the T rows of a verify: one program per BLOCK_N outputs and BLOCK_M rows (axis 1), the
        weights read once for all of them; same folds and rounding as `_gemv_kernel`. The rows' products: one tl.dot
        tile (BLOCK_N >= 16, BLOCK_M >= 16), or with FMA the one-row gemv's tiling on the CUDA cores (BLOCK_N < 16:
        a 384-wide matrix in tl.dot tiles of 16 is 24 programs on a 132-SM GPU, in tiles of 2-8 it is 48-192, as
        the one-row step runs it). Like the gemv, the first K block of weights loads before the PDL wait (no kernel
        writes them), so on a small target (one K block: a wide BLOCK_K) the whole weight read overlaps the previous
        kernel's tail."""
        if USE_PDL:
            gdc_launch_dependents()
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = rm < T
        out_ty = y_ptr.dtype.element_ty
        xrow = rm.to(tl.int64) * stride_x
        rn, n_ok, row, row2, rk, k_ok, w, w2 = _rows_first_block(w_ptr, N, K, stride_w, GLU, BLOCK_N, BLOCK_K)
        if USE_PDL:
            gdc_wait()  # x and the residual are the previous kernels' outputs
        if ONE_K and HAS_NORM:  # the whole row is one block: its 1/rms from the same load, not a second pass
            xv = tl.load(x_ptr + xrow[:, None] + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            xf = xv.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / K + eps)
            xv = _rms_apply(xv, rstd[:, None], tl.load(nw_ptr + rk, mask=k_ok, other=0.0)[None, :], out_ty)
        else:
            rstd = _rows_rstd(x_ptr, xrow, m_ok, K, eps, HAS_NORM, BLOCK_M, BLOCK_K)
            # the first K block with the prefetched weights, then the rest (none when BLOCK_K >= K)
            xv = _rows_x(x_ptr, xrow, m_ok, rk, k_ok, nw_ptr, rstd, HAS_NORM, out_ty)
        acc = _rows_mac(_rows_acc0(BLOCK_M, BLOCK_N, BLOCK_K, FMA), xv, w, IEEE, FMA)
        acc2 = _rows_acc0(BLOCK_M, BLOCK_N, BLOCK_K, FMA)  # up's sums with GLU (else unused)
        if GLU:
            acc2 = _rows_mac(acc2, xv, w2, IEEE, FMA)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            xv = _rows_x(x_ptr, xrow, m_ok, rk, k_ok, nw_ptr, rstd, HAS_NORM, out_ty)
            w = tl.load(w_ptr + row[:, None] + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc = _rows_mac(acc, xv, w, IEEE, FMA)
            if GLU:
                w2 = tl.load(w_ptr + row2[:, None] + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                acc2 = _rows_mac(acc2, xv, w2, IEEE, FMA)
        acc = _rows_sum(acc, FMA)
        acc2 = _rows_sum(acc2, FMA)
        _rows_store(acc, acc2, y_ptr, b_ptr, r_ptr, rm, m_ok, rn, n_ok, N, HAS_BIAS, HAS_RES, GLU)

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
        rm,
        m_ok,
        rn,
        n_ok,
        N,
        HAS_BIAS: tl.constexpr,
        HAS_RES: tl.constexpr,
        GLU: tl.constexpr,
    ):
        """The folds after the matmul, as `_gemv_kernel` rounds them: bias, silu(gate) * up (acc2: up), residual."""
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
) -> torch.Tensor:
    """`gemv` for x [T, K] with 1 <= T <= ROWS_MAX (the tokens of a verify) -> [T, N] (N = rows of w, halved with
    `glu`); residual [T, N]. Same folds and rounding as `gemv` (no act_mul). The tile: the arguments, else
    `config`'s rows tile. Traced by torch.compile: the `draftsmith::gemm_rows` operator."""
    _need()
    if _tracing() and block_n is None and block_k is None and num_warps is None:
        return _gemm_rows_op(x, w, norm_weight, float(eps), bias, residual, bool(glu), config_key(config))
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
    bn0, bk0, nw0 = tile or (cfg.rows_block_n, cfg.rows_block_k, cfg.rows_num_warps)
    bn, bk, nw = block_n or bn0, block_k or bk0, num_warps or nw0
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    dummy = x
    args = (
        x,
        w,
        y,
        norm_weight if norm_weight is not None else dummy,
        bias if bias is not None else dummy,
        residual.reshape(T, N).contiguous() if residual is not None else dummy,
        T,
        N,
        K,
        x.stride(0),
        w.stride(0),
        float(eps),
    )
    fma = bn < 16  # a gemv-like tile: the CUDA-core products, rows in blocks of at most FMA_BLOCK_M (grid axis 1)
    bm = min(FMA_BLOCK_M, triton.next_power_of_2(T)) if fma else max(16, triton.next_power_of_2(T))
    _rows_kernel[(triton.cdiv(N, bn), triton.cdiv(T, bm))](
        *args,
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
        num_warps=nw,
        num_stages=1 if fma else _rows_stages(bm, bn, bk, glu, x.element_size()),
        **_pdl(x, cfg.pdl),
    )
    return y


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
    """`kernels.tune_gemv` for gemm_rows: time every tile of `configs` (default `config.rows_sweep`) on `mats` with
    `rows` tokens and keep the fastest in `config.rows_tuned` (the default tile is among those timed, so the choice is
    never slower than it at tuning time). One row per tile; [] when tuned before (unless `force`) or on the CPU."""
    from draftsmith.decode.kernels import sweep_tiles

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
    sweep = list(configs or cfg.rows_sweep)
    default = (cfg.rows_block_n, cfg.rows_block_k, cfg.rows_num_warps)
    if default not in sweep:
        sweep.append(default)

    def launch(tile):
        bn, bk, nw = tile
        for w in mats:
            gemm_rows(x, w, norm_weight, bias=bias, residual=r, glu=glu, block_n=bn, block_k=bk, num_warps=nw)

    out = sweep_tiles(
        sweep, ("BLOCK_N", "BLOCK_K", "warps"), launch, len(mats), reps, cfg.rows_tuned, key, cfg.tuned_us
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


__all__ = ["ROWS_MAX", "gemm_rows", "tune_rows"]
