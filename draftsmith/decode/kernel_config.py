"""Launch settings of the Triton decode kernels (`draftsmith.decode.kernels`), as one object the runner owns.

`LlamaFamilyForward.kernel_config` holds the one its forwards launch with (the engine fills its tuned tables at
build, `LlamaFamilyForward.tune_kernels`); a benchmark that wants other settings builds its own and assigns it to
the runner, or passes it to `SpeculativeDecoder(kernel_config=...)`, instead of overwriting module globals. The
kernels' code takes these values as launch arguments only; none of them changes what a kernel computes beyond
summation order (the tile) and the launch overlap (PDL). Importing this module does not import triton.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The sweep of `kernels.tune_gemv`: (BLOCK_N, BLOCK_K, num_warps, prefetch). From 2 to 32 rows per program (the 8B
# q/k/v has 6,144 rows: 192..3,072 programs over 132 SMs), 4-32 KB of weights in flight per program and iteration.
# prefetch=1 loads the next K block before the current one is summed: triton does not pipeline a loop without
# tl.dot, so without it every iteration waits one full memory latency (a 4096-wide matrix in 512-wide blocks is
# 8 such waits per program, ~6 us — the whole budget of a 33 MB o projection at 4 TB/s is 8 us).
GEMV_CONFIGS: tuple[tuple[int, int, int, int], ...] = (
    (2, 2048, 8, 0),
    (4, 512, 4, 0),
    (4, 1024, 4, 0),
    (8, 256, 4, 0),
    (8, 512, 4, 0),
    (8, 1024, 8, 0),
    (16, 256, 4, 0),
    (16, 512, 4, 0),
    (16, 512, 8, 0),
    (32, 128, 4, 0),
    (32, 256, 4, 0),
    (32, 256, 8, 0),
    (4, 512, 4, 1),
    (8, 256, 4, 1),
    (8, 512, 4, 1),
    (8, 512, 8, 1),
    (16, 256, 4, 1),
    (16, 256, 8, 1),
    (16, 512, 8, 1),
    (32, 128, 4, 1),
    (4, 1024, 4, 1),
    (8, 1024, 8, 1),
    (4, 2048, 8, 1),
)


# The tiles `tune_rows` times for experimental.gemm_rows: (BLOCK_N, BLOCK_K, num_warps). BLOCK_N >= 16: the tl.dot
# kernel (all T rows one tile). Small N wants small BLOCK_N (more programs than SMs: on a 384-wide target 32 leaves
# most of an H200 idle); small K wants a wide BLOCK_K (pycode-small's K is 384 or 1,024: a 5-row verify's matmuls
# took 3.9 us a launch in 128-wide steps vs the one-row gemv's 2.5 us — each K step is a memory round trip,
# BENCHMARKS.md). BLOCK_N < 16: the CUDA-core products (`_rows_kernel`'s FMA: the gemv's tiling, 8 rows a program), for
# a small target's 5-9-row verify, where even 16 outputs a program leave 24 programs on a 384-wide matrix.
ROWS_CONFIGS = (
    (16, 64, 4),
    (16, 128, 4),
    (16, 256, 4),
    (16, 512, 4),
    (16, 1024, 8),
    (32, 512, 4),
    (32, 64, 4),
    (32, 128, 4),
    (32, 256, 4),
    (64, 64, 4),
    (64, 128, 4),
    (64, 128, 8),
    (128, 64, 8),
    (1, 512, 4),
    (2, 256, 4),
    (2, 512, 4),
    (4, 128, 4),
    (4, 256, 4),
    (4, 512, 8),
    (8, 64, 4),
    (8, 128, 4),
    (8, 256, 8),
)

# The tiles `tune_rows` times instead for a matrix of at least `gemm_rows.SSQ_MIN_K` inputs (an 8B verify's 49 rows):
# (BLOCK_N, BLOCK_K, num_warps, split). A wide tile keeps the rows' x (re-read by every program from L2, BLOCK_M x
# BLOCK_K a step) well under its weights (BLOCK_N x BLOCK_K), and the K splits (split-K) give a large matrix's few
# wide tiles enough programs to stream it. Separate from ROWS_CONFIGS so that a small target's tuning compiles no
# more tiles than before.
ROWS_SPLIT_CONFIGS = (
    (32, 128, 4, 1),
    (64, 128, 4, 1),
    (128, 128, 8, 1),
    (64, 128, 4, 2),
    (64, 128, 4, 4),
    (128, 128, 8, 2),
    (128, 128, 8, 4),
    (128, 64, 8, 8),
    (256, 64, 8, 4),
    (256, 64, 8, 8),
)


@dataclass
class KernelConfig:
    """How the decode kernels are launched.

    block_n, block_k, num_warps: the gemv tile for a shape `gemv_tuned` has no entry for (BLOCK_N outputs per
    program, K walked BLOCK_K at a time; no prefetch). rows_block_n, rows_block_k, rows_num_warps, rows_split:
    the tile of `kernels.gemm_rows` (experimental T-row matmuls; split: K ranges over programs, split-K). embed_fold: a drafter's first-layer qkv gemv
    gathers the token embedding and applies both input norms itself (`gemv`'s `embed`: two kernels fewer per draft
    step; off = the torch norms and cat before it, for A/B measurements). rope_fold: the all-kernel forwards' q/k/v matmul
    (the one-token gemv, the T-row gemm_rows) applies RoPE and writes the caches in its epilogue (`rope=`: one launch
    a layer fewer; off until a GPU run measures it — models without q/k norms only); rope_fold_rows: with rope_fold, the
    T-row forwards too (off: the one-row gemv only — the fold measured slower in the row kernels). pdl: programmatic dependent launch (used on CUDA sm_90+ where
    triton supports it; off = each kernel waits for the previous one at launch: bench/decode_kernels.py --pdl
    off,on measures both). attn_live_chunks: the attention kernels (one token, and T rows with their slots) split
    the live keys — up to the forward's highest slot, read on the device — into this many chunks, so a graph's fixed
    grid follows the context (one chunk: no combine launch); 0 = the rule on the mask's width S (the cache's
    capacity under CUDA graphs: 64 chunks, most past the context, all combined). rows_attn_live: with attn_live_chunks 0,
    a T-row attention of at most `kernels.ROWS_ATTN_LIVE_MAX_ROWS` tile rows splits its live keys into
    `kernels.ROWS_ATTN_LIVE_CHUNKS` chunks, at most one per key block of the mask's width (off: the width rule for those too, the engine before 2026-12-03). rows_k_chains: gemm_rows's tl.dot tiles take all of K at
    once as independent MMA chains of BLOCK_K each (up to `gemm_rows.ROWS_MAX_CHAINS`; a batched dot), not one chain
    over a K loop: on a launch-bound target a K=384 tile's single chain of 24-32 MMAs is latency, not work (off: the
    engine before 2026-12-03's seventeenth session; pycode-small's chain4 verify 192 vs 249 us). tune_chained: the tuners time each tile as a dependent chain (every launch's input the
    previous launch's output, `kernels.chained_io`), as a forward runs them, not on one fixed input (launches that
    overlap under PDL: a throughput, where a forward pays each kernel's latency). gemv_sweep: the tiles `tune_gemv` times. gemv_tuned: (N, K, dtype, folds) -> (BLOCK_N,
    BLOCK_K, num_warps, prefetch), filled by `kernels.tune_gemv`. rows_sweep / rows_tuned: the same for gemm_rows (rows_split_sweep: its tiles for matrices of
    at least gemm_rows.SSQ_MIN_K inputs)
    ((N, K, dtype, folds) -> (BLOCK_N, BLOCK_K, num_warps, split), `experimental.gemm_rows.tune_rows`). tuned_us: a tuned
    key of either -> its tile's microseconds a matrix when it was chosen (benchmarks report them). attn_plans: (S, n_kv, G, head_dim, dtype) ->
    (split_len, BLOCK_S, num_warps) of `kernels.decode_attention`, overriding its rule (benchmarks forcing a plan,
    `kernels.tune_attention(keep=True)`). lt_matmuls (experimental, CUDA): a wide forward's matmuls (verify widths past the
    kernel rows: q/k/v, o, gate/up, down, lm_head) through the cuBLASLt algorithm `experimental.cublaslt.tune_lt` timed
    fastest among those whose output equals F.linear's bit for bit, per width, tuned when a mode's round is first
    built; lt_tuned: (rows, N, K, dtype) -> that algorithm's index (no entry: F.linear); lt_widths: the widths tuned so far. lt_search (with lt_matmuls): the
    candidates include `LtLinear.search`'s configurations past the heuristic's list. rows_attn_plan: (block_r, block_s,
    chunks, num_warps, num_stages) of the T-row attentions with slots that the few-row live rule does not take (wider
    than `kernels.ROWS_ATTN_LIVE_MAX_ROWS` tile rows: the 8B verify's; or rows_attn_live off): that tile, the live keys
    in that many chunks (1: no combine launch); None: the width rule. Measured 2026-12-03 on the 8B 49-row verify: one
    chunk (16/128/1/8/3) and four (16/64/4/4/3) both within 0.6 % of the width rule (BENCHMARKS.md), so None.
    cluster_gemm (experimental, CUDA sm_90): a wide forward's q/k/v, o, gate/up and down matmuls (verify widths up to
    56 rows) through `experimental.cluster_gemm`, our CUDA kernel (TMA + wgmma, split-K reduced inside a thread-block
    cluster, PDL), each shape with `cluster_gemm_plans`' (variant, split) or `cluster_gemm.plan_for`'s;
    cluster_gemm_late: its next kernel launches (PDL) once its K loops are done, not at its start. cluster_gemm_fused
    (with cluster_gemm; bias-free silu models): the kernel also takes what sits between the matmuls — the RMSNorms
    (from the residual producer's h * weight and its sums of squares), silu(gate) * up, the residual adds — so a layer
    is its four matmuls, RoPE and the attention (the 8B verify's inductor kernels gone; docs/LOG.md, twenty-fourth
    session). cluster_gemm_rope (with cluster_gemm_fused; models without q/k norms): RoPE and the cache writes too,
    in q/k/v's reduction (the `_rope` instances, rounding as triton's compiled `kernels.rope_and_cache` does: the
    8B verify 4.96-4.98 vs 4.98-4.99 ms with the folds alone; docs/LOG.md, twenty-fifth session). cluster_gemm_layer
    (with cluster_gemm_rope; correct, slower: the 8B verify 5.53 vs 4.98 ms, docs/LOG.md twenty-eighth session): a
    layer's q/k/v, attention and o in one launch (`experimental.cluster_gemm.layer_qkv_attn_o`, on q/k/v's plan;
    docs/verify-persistent-kernel.md), the three launches where it refuses."""

    block_n: int = 16
    block_k: int = 512
    num_warps: int = 4
    rows_block_n: int = 32
    rows_block_k: int = 128
    rows_num_warps: int = 4
    rows_split: int = 1
    embed_fold: bool = True
    rope_fold: bool = False
    rope_fold_rows: bool = True
    pdl: bool = True
    tune_chained: bool = False
    attn_live_chunks: int = 0
    rows_attn_live: bool = True
    rows_k_chains: bool = True
    lt_matmuls: bool = False
    lt_search: bool = False
    rows_attn_plan: tuple[int, int, int, int, int] | None = None
    cluster_gemm: bool = False
    cluster_gemm_late: bool = False
    cluster_gemm_fused: bool = False
    cluster_gemm_rope: bool = False
    cluster_gemm_layer: bool = False
    cluster_gemm_plans: dict = field(default_factory=dict)
    gemv_sweep: tuple[tuple[int, int, int, int], ...] = GEMV_CONFIGS
    gemv_tuned: dict = field(default_factory=dict)
    rows_sweep: tuple[tuple[int, ...], ...] = ROWS_CONFIGS
    rows_split_sweep: tuple[tuple[int, ...], ...] = ROWS_SPLIT_CONFIGS
    rows_tuned: dict = field(default_factory=dict)
    tuned_us: dict = field(default_factory=dict)
    attn_plans: dict = field(default_factory=dict)
    lt_tuned: dict = field(default_factory=dict)
    lt_widths: set = field(default_factory=set)

    @property
    def gemv_default(self) -> tuple[int, int, int, int]:
        """The (BLOCK_N, BLOCK_K, num_warps, prefetch) of an untuned gemv."""
        return (self.block_n, self.block_k, self.num_warps, 0)


__all__ = ["GEMV_CONFIGS", "KernelConfig", "ROWS_CONFIGS", "ROWS_SPLIT_CONFIGS"]
