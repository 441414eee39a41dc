// Few-row GEMM for a wide forward (the 8B verify's 49 rows): out[M, N] = x[M, K] @ w[N, K]^T, bf16 in and out, fp32
// accumulation, M <= NTOK (56 or 64). Built to stream the weights at copy bandwidth where cuBLAS's kernels reach
// 0.67-0.85 of it (docs/LOG.md, twenty-second and twenty-third sessions):
//
// * one CTA owns BN weight rows and a slice of K; the S CTAs sharing an N tile form a cluster (grid.y = S) and reduce
//   their fp32 partial tiles through distributed shared memory: split-K with no workspace and no second launch;
// * the weights stream through a STAGES-deep ring filled by the tensor memory accelerator (one 2-D TMA load a stage,
//   issued by one thread, completing on the stage's mbarrier; W evicted first from L2: read once). x (49 rows, re-read
//   by every N tile, in L2) takes cp.async;
// * programmatic dependent launch: the CTA lets the next kernel launch at once, issues its first STAGES-1 weight
//   tiles, and only then waits for the previous kernel (griddepcontrol.wait) before it reads x or writes out — so the
//   weights are in flight while the previous kernel drains, as the Triton gemv of the one-row step does;
// * the MMAs are Hopper's wgmma with the weights as A (64 rows a warpgroup instruction) and x as B (NTOK tokens):
//   "swap AB", so 49 tokens pad to 56, not to a 64-row M tile. At 49 tokens the GEMM does 49 FLOP a weight byte:
//   ~210 TFLOPS at copy bandwidth. A first version on mma.sync (ldmatrix-fed, the same ring) was bound by that: it
//   streamed ~25 GB/s an SM whatever the tile or ring depth (docs/LOG.md, twenty-third session).
//
// * split-K reduced either inside the cluster (each token row pushed to its owner CTA through distributed shared
//   memory) or, for the LASTCTA_GEMM instances, by each tile's last CTA from an L2 workspace (no cluster; at split 1
//   a tile simply stores its sums).
//
// Where it stands (H200, 49 rows; BENCHMARKS.md "Issue 16, twenty-third session"): one call streams at 0.66-0.89
// of copy bandwidth, level with cuBLAS (0.97-1.04x its time); a 32-layer chain of the four matmuls with PDL 0.124
// vs 0.125 ms a layer; in the compiled 8B verify 5.26 vs 5.20 ms. A call's fixed cost is ~2 us to the first weight
// tile and ~2.5 us for the cluster's exchange (the latest CTA of a cluster sets it), against ~8 us of streaming for
// o: what is left to win is there. `Epi` folds what sits between a layer's matmuls (RMSNorm, silu*up, residual add:
// KernelConfig.cluster_gemm_fused): a folded layer's chain 0.132 ms, the compiled tree verify 5.00-5.05 vs
// 5.12-5.21 ms with cuBLAS and inductor's glue (docs/LOG.md, twenty-fourth session); with RoPE in q/k/v's reduction
// (the `_rope` instances) and the lm_head through the kernel 4.96-4.98 ms. Measured slower and removed: stream-K,
// rings of 3-4 stages, a persistent chain kernel with split-K through L2 (twenty-fourth and twenty-fifth sessions).
//
// Shared-memory tiles are [rows][64] bf16 (128 bytes a row, 8 chunks of 16 bytes), chunk c of row r stored at chunk
// c ^ (r & 7) — TMA's 128-byte swizzle, which the wgmma descriptors name (layout 1), for tiles at 1024-byte
// boundaries.
//
// Built to PTX by scripts/build_cuda_kernels.sh (nvcc -arch=sm_90a); `experimental/cluster_gemm.py` assembles it with
// triton's ptxas and launches it through the driver API.

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace cg = cooperative_groups;

#define XROWS 64  // x rows a ring stage holds (NTOK of them are multiplied)
#define BK 64     // K a stage covers: 128 bytes of a weight row, TMA's 128-byte swizzle span

struct alignas(64) TmaDesc {  // a CUtensorMap, encoded on the host (cuTensorMapEncodeTiled)
    unsigned long long opaque[16];
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint32_t swz(int row, int chunk) {  // byte offset of (row, 16-byte chunk) in a tile
    return row * (BK * 2) + ((chunk ^ (row & 7)) << 4);
}

__device__ __forceinline__ void cp_async_zfill(uint32_t dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void mbar_init(uint32_t bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar));
}

__device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done = 0;
    while (!done)
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
}

// the [BN rows][64] box at (k, row, 0) of the tensor map into dst, completing on bar. The maps are 3-D: [1][N][K] for
// a plain weight, [2][N/2][K] for a GLU's gate and up (Epi::glu: a box of BN/2 gate rows then the same BN/2 up rows,
// laid out in shared memory as BN rows — the 128-byte swizzle follows the address, so the tile is the same)
template <bool EVICT>
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const TmaDesc* map, int k, int row, uint32_t bar,
                                            uint64_t policy) {
    const uint64_t m = reinterpret_cast<uint64_t>(map);
    if (EVICT)
        asm volatile(
            "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
            " [%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(dst),
            "l"(m), "r"(k), "r"(row), "r"(0), "r"(bar), "l"(policy)
            : "memory");
    else
        asm volatile(
            "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
            " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
            "l"(m), "r"(k), "r"(row), "r"(0), "r"(bar)
            : "memory");
}

// a wgmma shared-memory descriptor: K-major tile of 128-byte rows, 128-byte swizzle, 8-row groups 1024 bytes apart
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
    return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) | (static_cast<uint64_t>(1024 >> 4) << 32) |
           (1ull << 62);
}

__device__ __forceinline__ unsigned long long globaltimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

__device__ __forceinline__ void wgmma_m64n56(float* d, uint64_t da, uint64_t db) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n56k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27}, %28, %29, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27])
        : "l"(da), "l"(db));
}

__device__ __forceinline__ void wgmma_m64n64(float* d, uint64_t da, uint64_t db) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db));
}

template <int NTOK>
__device__ __forceinline__ void wgmma_tile(float* d, uint64_t da, uint64_t db) {
    if constexpr (NTOK == 56)
        wgmma_m64n56(d, da, db);
    else
        wgmma_m64n64(d, da, db);
}

// BN weight rows a CTA over WG warpgroups (each BN / WG rows: MT m64 tiles), NTOK tokens, a STAGES-deep ring; EVICT:
// the weights' loads hint L2 to evict them first; MMA false: no multiplies (measures the ring's streaming alone; the
// output is garbage). `wmap`: the weights [N, K] as a tensor map with a [BN, 64] box.
// a CTA's accumulators (wgmma's fragment layout) into red [token][weight row] fp32, rows BN + 4 floats apart
template <int BN, int WG, int NTOK, int MT>
__device__ __forceinline__ void write_partial(float* red, const float (*acc)[NTOK / 2], int wg, int wq, int lane) {
    constexpr int RED_LD = BN + 4;
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int j = 0; j < NTOK / 8; ++j) {
            const int wr = (wg * MT + t) * 64 + wq * 16 + (lane >> 2);
            const int xr = j * 8 + (lane & 3) * 2;
            red[xr * RED_LD + wr] = acc[t][4 * j];
            red[(xr + 1) * RED_LD + wr] = acc[t][4 * j + 1];
            red[xr * RED_LD + wr + 8] = acc[t][4 * j + 2];
            red[(xr + 1) * RED_LD + wr + 8] = acc[t][4 * j + 3];
        }
}

// What the kernel does with its sums besides storing them (all null / 0: out = bf16(x @ w^T), nothing else). The
// folds take the launches between a layer's matmuls out of the verify (docs/LOG.md, twenty-fourth session):
// * ssq_in (the previous producer's per-tile sums of squares, [tiles][ssq_in_ld]): x is the residual stream already
//   multiplied by this norm's weight (the producer's hn), and each token row's sums are scaled by
//   rsqrt(sum of the row's ssq_in / K + eps): RMSNorm(h) @ w^T = rstd * ((h * nw) @ w^T), the norm without a launch;
// * glu: the weights are [2][N/2][K] (gate rows, then up rows) and out [M, N/2] = silu(g) * u, each rounded to bf16
//   as torch rounds them (HF's act_fn(gate_proj(x)) * up_proj(x));
// * res: out = bf16(bf16(sum) + res) (the residual add, HF's `h + o_proj(o)` rounding);
// * nw, hn: hn = bf16(out * nw) (the next norm's x, its weight applied), ssq_out[tile][m] = the sum of out^2 over
//   this CTA's columns (its rows' part of the next norm's mean square; ssq_out's rows 64 floats apart).
struct Epi {
    const __nv_bfloat16* res;
    int ldr;
    const __nv_bfloat16* nw;
    __nv_bfloat16* hn;
    int ldh;
    float* ssq_out;
    const float* ssq_in;
    int ssq_in_ld;
    int ssq_tiles;
    float inv_k;
    float eps;
    int glu;
};

__device__ __forceinline__ float bf16r(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// The `_rope` instances (KernelConfig.cluster_gemm_rope): the q/k/v projection whose owner CTAs, holding whole heads
// (BN a multiple of the head size d), apply RoPE to the q and k heads and write k and v to this layer's caches at the
// rows' slots, q to `out` [M, q_cols] — `kernels.rope_and_cache`'s work and rounding, without its launch. Its
// rounding is what triton compiles, not what its source says: x·cos is not rounded to bf16 before the add but fused
// into it (bf16(fma(x, cos, bf16(±x'·sin)))), measured bit for bit on an H200 (docs/LOG.md, twenty-fifth session;
// test_cluster_gemm_rope_equals_rope_and_cache holds it). The one-row step takes that kernel, so the verify must
// round as it does.
struct RopeArgs {
    const long long* pos;    // [M] positions (rows of cos / sin)
    const long long* slots;  // [M] cache slots
    const __nv_bfloat16* cos;
    const __nv_bfloat16* sin;  // [max_len, d]
    __nv_bfloat16* kc;
    __nv_bfloat16* vc;       // [n_kv][cache_len][d] (one layer, batch 1)
    long long head_stride;   // elements from one kv head's cache to the next
    int q_cols;              // n_heads * d: the q columns, then n_kv * d of k, then v
    int k_cols;
    int d;
};

// the 4 sums of row m at columns col..col+3 through the folds into out (and hn, and this CTA's row sums of squares,
// returned for the caller's reduction)
__device__ __forceinline__ float epi_store4(const Epi& e, __nv_bfloat16* out, int ldo, int m, int col, float4 s,
                                            const float* rstd) {
    float v[4] = {s.x, s.y, s.z, s.w};
    if (e.ssq_in != nullptr) {
        const float r = rstd[m];
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] *= r;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = bf16r(v[i]);
    if (e.res != nullptr) {
        const __nv_bfloat162* r = reinterpret_cast<const __nv_bfloat162*>(e.res + static_cast<size_t>(m) * e.ldr + col);
        const float2 a = __bfloat1622float2(r[0]), b = __bfloat1622float2(r[1]);
        v[0] = bf16r(v[0] + a.x);
        v[1] = bf16r(v[1] + a.y);
        v[2] = bf16r(v[2] + b.x);
        v[3] = bf16r(v[3] + b.y);
    }
    __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(out + static_cast<size_t>(m) * ldo + col);
    o[0] = __floats2bfloat162_rn(v[0], v[1]);
    o[1] = __floats2bfloat162_rn(v[2], v[3]);
    if (e.hn != nullptr) {
        const __nv_bfloat162* w = reinterpret_cast<const __nv_bfloat162*>(e.nw + col);
        const float2 a = __bfloat1622float2(w[0]), b = __bfloat1622float2(w[1]);
        __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(e.hn + static_cast<size_t>(m) * e.ldh + col);
        h[0] = __floats2bfloat162_rn(v[0] * a.x, v[1] * a.y);
        h[1] = __floats2bfloat162_rn(v[2] * b.x, v[3] * b.y);
    }
    return v[0] * v[0] + v[1] * v[1] + v[2] * v[2] + v[3] * v[3];
}

__device__ __forceinline__ float silu_bf16(float g) { return bf16r(g / (1.f + __expf(-g))); }

// Epi::glu: gate sums g and up sums u of row m (4 columns of each) -> out[m][col..col+3] = silu(g) * u
__device__ __forceinline__ void epi_glu4(const Epi& e, __nv_bfloat16* out, int ldo, int m, int col, float4 g,
                                         float4 u, const float* rstd) {
    const float r = e.ssq_in != nullptr ? rstd[m] : 1.f;
    const float gv[4] = {g.x, g.y, g.z, g.w}, uv[4] = {u.x, u.y, u.z, u.w};
    float a[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = silu_bf16(bf16r(gv[i] * r)) * bf16r(uv[i] * r);
    __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(out + static_cast<size_t>(m) * ldo + col);
    o[0] = __floats2bfloat162_rn(a[0], a[1]);
    o[1] = __floats2bfloat162_rn(a[2], a[3]);
}

// a row's sum of squares over the lanes that hold its columns (W = min(32, BN / 4) consecutive lanes), added to
// row_ssq[m] by the group's first lane; every lane of the warp calls it (inactive ones with sq = 0, act false)
template <int BN>
__device__ __forceinline__ void row_ssq_add(float* row_ssq, int m, float sq, bool act, int lane) {
    constexpr int W = BN / 4 < 32 ? BN / 4 : 32;
#pragma unroll
    for (int off = W / 2; off > 0; off >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, off);
    if (act && lane % W == 0) atomicAdd(row_ssq + m, sq);
}

// The epilogue over this CTA's token rows m = first, first + stride, ... below M (`rows` of them), both reductions
// (the last CTA's: all rows; a cluster owner's: every S-th): local row r's sums at columns c..c+3 from sums(r, c)
// through the folds — silu(g) * u (Epi::glu), or epi_store4 with the rows' sums of squares into ssq_out
template <int BN, int THREADS, class Sums>
__device__ __forceinline__ void store_rows(const Epi& e, __nv_bfloat16* out, int ldo, int M, int rows, int stride,
                                           int first, Sums sums, const float* rstd, float* row_ssq, int tile) {
    const int tid = threadIdx.x, lane = tid & 31;
    if (e.glu) {
        for (int v = tid; v < rows * (BN / 8); v += THREADS) {
            const int r = v / (BN / 8), c = (v % (BN / 8)) * 4;
            epi_glu4(e, out, ldo, r * stride + first, tile * (BN / 2) + c, sums(r, c), sums(r, BN / 2 + c),
                     rstd);
        }
        return;
    }
    const int total = rows * (BN / 4);
    for (int v0 = 0; v0 < total; v0 += THREADS) {
        const int v = v0 + tid;
        const bool act = v < total;
        const int r = act ? v / (BN / 4) : 0, c = (v % (BN / 4)) * 4;
        const int m = r * stride + first;
        const float sq = act ? epi_store4(e, out, ldo, m, tile * BN + c, sums(r, c), rstd) : 0.f;
        if (e.ssq_out != nullptr) row_ssq_add<BN>(row_ssq, m, sq, act, lane);
    }
    if (e.ssq_out != nullptr) {
        __syncthreads();
        if (tid < M && tid % stride == first) e.ssq_out[tile * XROWS + tid] = row_ssq[tid];
    }
}

// `prof` (a diagnostic, normally null): each CTA's thread 0 writes PROF_POINTS %globaltimer stamps there, at
// prof[(blockIdx.y * gridDim.x + blockIdx.x) * PROF_POINTS + j] (bench/cluster_gemm.py --sections prof).
#define PROF_POINTS 7
// LAST: split-K without a cluster — each CTA writes its partial to `ws` (fp32, stays in L2) and counts itself in
// `counters[tile]`; the tile's last CTA to finish sums the S partials and stores (and resets the counter), the
// others leave at once: no CTA waits for its slowest partner, and no cluster co-scheduling.
struct PdlWait {  // a standalone kernel's inputs: the previous kernel's (programmatic dependent launch)
    __device__ __forceinline__ void operator()() const { asm volatile("griddepcontrol.wait;" ::: "memory"); }
};

// `tile` (default: blockIdx.x) is the N tile; `xwait` runs where the CTA first needs x (its weights' first tiles are
// in flight by then); with COUNT (the RoPE instances of a layer-persistent kernel) each CTA counts itself in
// `count[KV head of its tile]` once its rows are stored (`G` q heads a KV head).
template <int BN, int WG, int NTOK, int STAGES, bool EVICT, bool MMA, bool LAST, bool ROPE = false, bool COUNT = false,
          class XWait = PdlWait>
__device__ __forceinline__ void cluster_gemm_body(const TmaDesc* wmap, const __nv_bfloat16* __restrict__ x,
                                                  __nv_bfloat16* __restrict__ out, int M, int K, int ldx, int ldo,
                                                  int late, float* __restrict__ ws, int* __restrict__ counters,
                                                  unsigned long long* prof, const Epi& e,
                                                  const RopeArgs* rp = nullptr, int tile = -1, XWait xwait = XWait(),
                                                  int* count = nullptr, int G = 1) {
    static_assert(!(ROPE && LAST), "RoPE is folded in the cluster reduction only");
    constexpr int THREADS = 128 * WG;
    constexpr int MT = BN / WG / 64;  // m64 tiles a warpgroup
    constexpr int NREG = NTOK / 2;    // accumulator registers an m64 tile
    constexpr int W_BYTES = BN * BK * 2;
    constexpr int X_BYTES = XROWS * BK * 2;
    constexpr int STAGE_BYTES = W_BYTES + X_BYTES;
    constexpr int CH = BK / 8;  // 16-byte chunks a tile row
    static_assert(MT >= 1 && BN % (64 * WG) == 0 && BN <= 256, "warpgroup tile, TMA box");
    static_assert((XROWS * CH) % THREADS == 0 && STAGE_BYTES % 1024 == 0, "x chunks per thread, swizzle alignment");

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // PDL: the next kernel may launch once every CTA here has started (its CTAs then prefetch their weights beside
    // ours) — or, with `late`, once every CTA here is done with its K slice (their prefetch overlaps only our
    // exchange and stores). `late` bit 2 (a diagnostic, bench/cluster_gemm.py's chain): no wait for the previous kernel
    // at all — the output is garbage, the time is what the chain costs with no data dependency between its kernels
    if (!(late & 1)) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    unsigned long long* stamp = nullptr;  // this CTA's stamps (thread 0, with prof)
    if (prof != nullptr && threadIdx.x == 0) stamp = prof + (blockIdx.y * gridDim.x + blockIdx.x) * PROF_POINTS;
    if (stamp) stamp[0] = globaltimer();  // started
    // the ring at a 1024-byte boundary (the swizzle pattern repeats every 8 rows of 128 bytes), its stages' mbarriers
    // after it
    unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);

    const int S = LAST ? static_cast<int>(gridDim.y) : static_cast<int>(cg::this_cluster().num_blocks());
    const int rank = LAST ? static_cast<int>(blockIdx.y) : static_cast<int>(cg::this_cluster().block_rank());
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2, wq = warp & 3;  // warpgroup, warp within it
    if (tile < 0) tile = blockIdx.x;
    const int n0 = tile * BN;
    const int row0 = e.glu ? tile * (BN / 2) : n0;  // the tile's first row in the weights' map
    const int KT = K / BK;
    const int kt0 = KT * rank / S, nkt = KT * (rank + 1) / S - kt0;
    const uint32_t base = smem_addr(smem);
    const uint32_t bars = base + STAGES * STAGE_BYTES;

    uint64_t evict_first;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(evict_first));
    if (tid == 0) {
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(wmap)) : "memory");
#pragma unroll
        for (int s = 0; s < STAGES; ++s) mbar_init(bars + 8 * s);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __shared__ float rstd[XROWS], row_ssq[XROWS];  // Epi::ssq_in's scales, Epi::ssq_out's sums (token rows)
    if (tid < XROWS) row_ssq[tid] = 0.f;
    __syncthreads();

    auto load_w = [&](int slot, int kt) {  // thread 0 only
        mbar_expect(bars + 8 * slot, W_BYTES);
        tma_load_3d<EVICT>(base + slot * STAGE_BYTES, wmap, kt * BK, row0, bars + 8 * slot, evict_first);
    };
    auto load_x = [&](int slot, int kt) {
        const uint32_t dst = base + slot * STAGE_BYTES + W_BYTES;
#pragma unroll
        for (int i = 0; i < XROWS * CH / THREADS; ++i) {
            const int c = tid + i * THREADS, r = c / CH, ch = c % CH;
            if (r >= NTOK) continue;  // never multiplied
            const bool ok = r < M;    // rows past M read as zeros (their outputs are never stored)
            const __nv_bfloat16* src = ok ? x + static_cast<size_t>(r) * ldx + kt * BK + ch * 8 : x;
            cp_async_zfill(dst + swz(r, ch), src, ok ? 16 : 0);
        }
    };

    // the weights are no kernel's output: their first tiles load before the wait; x (the previous kernel's) after
    for (int s = 0; s < STAGES - 1; ++s)
        if (s < nkt && tid == 0) load_w(s, kt0 + s);
    if (!(late & 2)) xwait();
    if (stamp) stamp[1] = globaltimer();  // the previous kernel done
    if (e.ssq_in != nullptr && tid < M) {  // the rows' norm scales (read after the loop; the loop's barriers order it)
        float t = 0.f;
        for (int i = 0; i < e.ssq_tiles; ++i) t += e.ssq_in[i * e.ssq_in_ld + tid];
        rstd[tid] = rsqrtf(t * e.inv_k + e.eps);
    }
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < nkt) load_x(s, kt0 + s);
        cp_async_commit();
    }

    float acc[MT][NREG];
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int e = 0; e < NREG; ++e) acc[t][e] = 0.f;

    // x's cp.async groups in flight: X0..X(P-1), then one a step: a step's x is complete once at most P - 1 =
    // STAGES - 2 newer groups are pending; its weights once the slot's mbarrier completes its (i / STAGES)-th phase
    for (int i = 0; i < nkt; ++i) {
        cp_async_wait<STAGES - 2>();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // x's generic writes, seen by wgmma
        mbar_wait(bars + 8 * (i % STAGES), (i / STAGES) & 1);
        if (stamp && i == 0) stamp[2] = globaltimer();  // the first weight tile in
        __syncthreads();  // the tile is everyone's; the slot refilled below was consumed by everyone last step
        const int nxt = i + STAGES - 1;
        if (nxt < nkt) {
            if (tid == 0) load_w(nxt % STAGES, kt0 + nxt);
            load_x(nxt % STAGES, kt0 + nxt);
        }
        cp_async_commit();
        if constexpr (MMA) {
            const uint32_t wt = base + (i % STAGES) * STAGE_BYTES, xt = wt + W_BYTES;
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BK / 16; ++kk) {
                const uint64_t db = smem_desc(xt + kk * 32);
#pragma unroll
                for (int t = 0; t < MT; ++t)
                    wgmma_tile<NTOK>(acc[t], smem_desc(wt + (wg * MT + t) * 64 * 128 + kk * 32), db);
            }
            wgmma_commit();
            wgmma_wait0();  // the slot is refilled after the next step's barrier
        }
    }
    cp_async_wait<0>();
    __syncthreads();
    if (late & 1) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (stamp) stamp[3] = globaltimer();  // the K slice done

    constexpr int RED_LD = BN + 4;
    constexpr int RED_BYTES = NTOK * RED_LD * 4;
    float* red = reinterpret_cast<float*>(smem);
    const int quads = M * (BN / 4);
    if constexpr (LAST) {
        write_partial<BN, WG, NTOK, MT>(red, acc, wg, wq, lane);
        __syncthreads();
        __shared__ int is_last;
        if (S > 1) {
            float* mine = ws + static_cast<size_t>(tile * S + rank) * NTOK * BN;
            for (int v = tid; v < quads; v += THREADS) {
                const int m = v / (BN / 4), c = (v % (BN / 4)) * 4;
                __stcg(reinterpret_cast<float4*>(mine + m * BN + c), *reinterpret_cast<const float4*>(red + m * RED_LD + c));
            }
            __threadfence();  // this CTA's partial visible device-wide before it is counted
            __syncthreads();
            if (tid == 0) is_last = atomicAdd(counters + tile, 1) == S - 1;
            __syncthreads();
            if (!is_last) return;
            __threadfence();  // the other partials, counted before us, are visible to our loads
        }
        if (stamp) stamp[4] = globaltimer();  // partials exchanged (the last CTA)
        const float* part = ws + static_cast<size_t>(tile) * S * NTOK * BN;
        auto fetch = [&](int m, int c) {  // row m's sums at columns c..c+3
            float4 sum = *reinterpret_cast<const float4*>(red + m * RED_LD + c);
            if (S > 1) {  // every partial from the workspace, in rank order (deterministic whichever CTA is last)
                sum = __ldcg(reinterpret_cast<const float4*>(part + m * BN + c));
                for (int q = 1; q < S; ++q) {
                    const float4 p = __ldcg(reinterpret_cast<const float4*>(part + (q * NTOK + m) * BN + c));
                    sum.x += p.x;
                    sum.y += p.y;
                    sum.z += p.z;
                    sum.w += p.w;
                }
            }
            return sum;
        };
        store_rows<BN, THREADS>(e, out, ldo, M, M, 1, 0, fetch, rstd, row_ssq, tile);
        if (S > 1 && tid == 0) counters[tile] = 0;  // for the next call (it counts only after its wait)
        if (stamp) stamp[5] = globaltimer();
        if (stamp) stamp[6] = globaltimer();
        return;
    }

    // the partial tile, [token][weight row] fp32, over the ring's first bytes (a padded row: fewer bank conflicts);
    // then each token row goes to the CTA that owns it (token m: rank m % S) as vector stores into that CTA's inbox
    // [S senders][rows it owns][BN], after the partial tile. Pushing is cheap (stores do not wait), pulling was not:
    // a version whose owners loaded the S partials through distributed shared memory spent 2.3-3.7 us there, most of
    // a call's fixed cost (bench/cluster_gemm.py --sections prof; docs/LOG.md, twenty-third session).
    float* inbox = reinterpret_cast<float*>(smem + RED_BYTES);
    const int own = (M + S - 1) / S;  // token rows a CTA owns, at most
    static_assert(RED_BYTES + (NTOK + 7) * BN * 4 <= STAGES * STAGE_BYTES, "reduction buffers");  // S * own <= M + 7
    // the inbox overlaps the ring: no CTA pushes before every CTA of the cluster is done with its ring (arrive now,
    // wait after the local write, so the barrier's latency hides behind it)
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
    write_partial<BN, WG, NTOK, MT>(red, acc, wg, wq, lane);
    asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
    __syncthreads();
    cg::cluster_group cluster = cg::this_cluster();
    for (int v = tid; v < quads; v += THREADS) {
        const int m = v / (BN / 4), c = (v % (BN / 4)) * 4;
        float* dst = cluster.map_shared_rank(inbox, m % S) + ((rank * own + m / S) * BN + c);
        *reinterpret_cast<float4*>(dst) = *reinterpret_cast<const float4*>(red + m * RED_LD + c);
    }
    cluster.sync();  // every partial row delivered to its owner
    if (stamp) stamp[4] = globaltimer();  // partials exchanged

    // this CTA's token rows, summed over the S partials in rank order (deterministic), stored
    const int mine = M > rank ? (M - rank + S - 1) / S : 0;  // rows m = rank, rank + S, ... below M
    auto owned = [&](int lm, int c) {  // local row lm's sums at columns c..c+3
        float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int q = 0; q < S; ++q) {
            const float4 p = *reinterpret_cast<const float4*>(inbox + (q * own + lm) * BN + c);
            sum.x += p.x;
            sum.y += p.y;
            sum.z += p.z;
            sum.w += p.w;
        }
        return sum;
    };
    if constexpr (ROPE) {
        const int d = rp->d, half = d / 2;
        for (int v = tid; v < mine * (BN / 4); v += THREADS) {
            const int lm = v / (BN / 4), c = (v % (BN / 4)) * 4, m = lm * S + rank, col = n0 + c;
            const int hc = col % d;  // the column within its head
            const float r = e.ssq_in != nullptr ? rstd[m] : 1.f;
            const float4 s4 = owned(lm, c);
            float xv[4] = {bf16r(s4.x * r), bf16r(s4.y * r), bf16r(s4.z * r), bf16r(s4.w * r)};  // q/k/v as stored
            const long long slot = rp->slots[m];
            if (col < rp->q_cols + rp->k_cols) {
                const float4 p4 = owned(lm, hc < half ? c + half : c - half);  // rotate_half's partner columns
                const float pv[4] = {bf16r(p4.x * r), bf16r(p4.y * r), bf16r(p4.z * r), bf16r(p4.w * r)};
                const long long at = rp->pos[m] * d + hc;
                const float sign = hc < half ? -1.f : 1.f;
#pragma unroll
                for (int i = 0; i < 4; ++i) {  // rope_and_cache's rounding as compiled: bf16(fma(x, cos, bf16(+-x' sin)))
                    const float b = bf16r(sign * pv[i] * __bfloat162float(rp->sin[at + i]));
                    xv[i] = fmaf(xv[i], __bfloat162float(rp->cos[at + i]), b);
                }
            }
            __nv_bfloat16* dst;
            if (col < rp->q_cols)
                dst = out + static_cast<size_t>(m) * ldo + col;
            else if (col < rp->q_cols + rp->k_cols)
                dst = rp->kc + ((col - rp->q_cols) / d) * rp->head_stride + slot * d + hc;
            else
                dst = rp->vc + ((col - rp->q_cols - rp->k_cols) / d) * rp->head_stride + slot * d + hc;
            __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(dst);
            o[0] = __floats2bfloat162_rn(xv[0], xv[1]);
            o[1] = __floats2bfloat162_rn(xv[2], xv[3]);
        }
        if constexpr (COUNT) {  // this CTA's rows of its head stored: count it for its KV head's readers
            __syncthreads();    // (the CTA's stores ordered before thread 0's fence: cooperative groups' grid sync)
            if (tid == 0) {
                __threadfence();
                const int d = rp->d;
                atomicAdd(count + (n0 < rp->q_cols ? n0 / d / G : (n0 - rp->q_cols) % rp->k_cols / d), 1);
            }
        }
        if (stamp) stamp[5] = globaltimer();
        if (stamp) stamp[6] = globaltimer();
        return;
    }
    store_rows<BN, THREADS>(e, out, ldo, M, mine, S, rank, owned, rstd, row_ssq, tile);
    if (stamp) stamp[5] = globaltimer();  // stored
    // (no second cluster barrier: after the first, no CTA touches another's shared memory)
    if (stamp) stamp[6] = globaltimer();  // done
}

#define GEMM_KERNEL(BN, WG, NTOK, STAGES, EVICT, MMA, LAST, NAME, MINB)                                             \
    extern "C" __global__ void __launch_bounds__(128 * WG, MINB)                                                   \
        cluster_gemm_##NAME(const __grid_constant__ TmaDesc wmap, const __nv_bfloat16* __restrict__ x,             \
                            __nv_bfloat16* __restrict__ out, int M, int K, int ldx, int ldo, int late, float* ws,  \
                            int* counters, unsigned long long* prof, const Epi epi) {                              \
        cluster_gemm_body<BN, WG, NTOK, STAGES, EVICT, MMA, LAST>(&wmap, x, out, M, K, ldx, ldo, late, ws,         \
                                                                  counters, prof, epi);                            \
    }
#define CLUSTER_GEMM(BN, WG, NTOK, STAGES, EVICT, MMA, NAME, MINB) \
    GEMM_KERNEL(BN, WG, NTOK, STAGES, EVICT, MMA, false, NAME, MINB)
#define LASTCTA_GEMM(BN, WG, NTOK, STAGES, NAME, MINB) GEMM_KERNEL(BN, WG, NTOK, STAGES, true, true, true, NAME, MINB)

// shared memory: STAGES * (BN + 64) * 128 bytes + 1024 (alignment) + the mbarriers; the names are
// experimental/cluster_gemm.py's VARIANTS
CLUSTER_GEMM(64, 1, 56, 12, true, true, bn64, 1)            // 192 KiB, one warpgroup
CLUSTER_GEMM(128, 2, 56, 8, true, true, bn128, 1)           // 192 KiB
CLUSTER_GEMM(256, 2, 56, 5, true, true, bn256, 1)           // 200 KiB
CLUSTER_GEMM(256, 4, 56, 5, true, true, bn256wg4, 1)        // 200 KiB, four warpgroups
CLUSTER_GEMM(256, 2, 64, 5, true, true, bn256n64, 1)        // 200 KiB, up to 64 tokens
CLUSTER_GEMM(64, 1, 56, 6, true, true, bn64_half, 2)        // 96 KiB: two CTAs an SM
CLUSTER_GEMM(128, 2, 56, 4, true, true, bn128_half, 2)      // 96 KiB
CLUSTER_GEMM(256, 2, 56, 5, true, false, bn256_nomma, 1)    // the ring alone (diagnostic)
CLUSTER_GEMM(128, 2, 56, 8, true, false, bn128_nomma, 1)    // the ring alone (diagnostic)
// q/k/v with RoPE and the cache writes folded ("_rope"; KernelConfig.cluster_gemm_rope)
#define ROPE_GEMM(BN, WG, NTOK, STAGES, NAME, MINB)                                                                 \
    extern "C" __global__ void __launch_bounds__(128 * WG, MINB)                                                   \
        cluster_gemm_##NAME(const __grid_constant__ TmaDesc wmap, const __nv_bfloat16* __restrict__ x,             \
                            __nv_bfloat16* __restrict__ out, int M, int K, int ldx, int ldo, int late, float* ws,  \
                            int* counters, unsigned long long* prof, const Epi epi, const RopeArgs rope) {         \
        cluster_gemm_body<BN, WG, NTOK, STAGES, true, true, false, true>(&wmap, x, out, M, K, ldx, ldo, late, ws,  \
                                                                         counters, prof, epi, &rope);              \
    }
ROPE_GEMM(128, 2, 56, 4, bn128_half_rope, 2)  // bn128_half's tile (the 8B q/k/v plan)
ROPE_GEMM(64, 1, 56, 12, bn64_rope, 1)        // bn64's
// byte offset of (row, 16-byte chunk) in a swizzled tile of rows `row_bytes` wide
__device__ __forceinline__ uint32_t swz_d(int row, int chunk, int row_bytes) {
    return row * row_bytes + ((chunk ^ (row & 7)) << 4);
}

__device__ __forceinline__ void ldsm4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm4_t(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void mma16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// ---------------------------------------------------------------------------------------------------------------------
// A layer's q/k/v -> attention -> o in one launch (`layer_qkv_attn_o_*`; experimental: correct on the H200, and slower
// than the three launches, 56.4 vs 44.5 us a layer — docs/verify-persistent-kernel.md, docs/LOG.md twenty-eighth
// session). The grid is q/k/v's, (N / BN, S) CTAs in
// clusters of S, a tile one head (BN = d), every CTA resident at once (the launcher checks: the waits below would
// deadlock otherwise). Three phases, chained by counters in global memory, not by launches:
//  A. every CTA its q/k/v unit, as the `_rope` instance (RoPE, the cache writes, q to `q`), then counts itself in
//     ready[g] for its tile's KV head g;
//  B. every CTA is then an attention item (docs/LOG.md, twenty-eighth session: the k/v tiles' CTAs alone, 64 at the
//     8B, took 17 us for it, latency-bound): KV head g's (G + 2) S CTAs — those that count ready[g] — are items j of
//     P = C x parts: key chunk c = j / parts of C, row part j % parts of the G x M (q head, token) rows (so that a
//     part's m16 row tiles are one round of the CTA's warps). An item stages its chunk's keys in shared memory once
//     for all its warps (the context's before the wait: only this forward's rows wait for ready[g] = (G + 2) S),
//     attends its rows over them, writes (m, l, O) to the workspace and counts done[g]; once done[g] = P it combines
//     its 1/P of g's rows over the C chunks into o's x and counts xready[g]. (Each KV head's keys are read C x parts
//     times in all, not once per q tile: what sank `cluster_gemm_attn`, docs/LOG.md twenty-seventh session.)
//  C. the q tiles' CTAs (n_heads d / BN of them x S: o's units when o's N = n_heads d) run o's unit (tile, K slice):
//     its first weight tiles load at once, x once xready = P for the KV heads its slice reads; the epilogue is the
//     residual producer's (h, the next norm's h * weight and sums of squares). The last of a KV head's readers resets
//     its counters for the next call.
struct LayerArgs {
    const unsigned char* mask;  // [M, mask_s] bool (1 = attend)
    long long mask_st;
    int mask_s;
    int G;       // q heads a KV head
    int n_kv;
    int chunks;  // C, key chunks a KV head
    int parts;   // row parts a chunk (C x parts items a KV head, at most (G + 2) S)
    float scale;
    __nv_bfloat16* attn;  // [M, n_heads d]: the attention's output, o's x
    int lda;
    float* part;  // [n_kv][C][LAYER_ROWS][d] fp32: the items' unnormalised O (a chunk's parts: disjoint rows)
    float* ml;    // [n_kv][C][LAYER_ROWS][2]: their running max and sum
    int* flags;   // [4][n_kv] int32, zero between calls: ready, done, xready, fin
    int ko;       // o's K (n_heads d)
};
#define LAYER_ROWS 256  // G x M rows of a KV head, at most

__device__ __forceinline__ void spin_until(const int* p, int target) {  // one thread; acquire
    int n = 0;
    do {
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(n) : "l"(p) : "memory");
        if (n < target) __nanosleep(64);
    } while (n < target);
}

// Phase B: item j of KV head g (chunk c = j / parts, row part j % parts). Rows r = m G + i (token m, q head g G + i)
// in m16 row tiles, a warp a tile at a time; the chunk's 16-key blocks staged for all warps (once, when the chunk fits
// KVB blocks; else KVB at a time, again for each round of row tiles); FlashAttention-2's register layout on mma.sync,
// rounding as `kernels._softmax_step` (scores scaled in fp32, masked to -1e30, P rounded to bf16).
template <int D, int THREADS, int RING>
__device__ __forceinline__ void attend_item(const LayerArgs& la, const RopeArgs& rp, const __nv_bfloat16* q, int ldq,
                                            int M, int S, int g, int j, unsigned char* smem,
                                            unsigned long long* lst) {
    constexpr int WARPS = THREADS / 32, NT = D / 8, CHR = D / 8, ROWB = D * 2, BLK = 16 * ROWB;
    constexpr int QBYTES = WARPS * BLK;              // a warp's q row tile
    constexpr int KVB = (RING - QBYTES) / (2 * BLK);  // key blocks staged at once
    static_assert(KVB >= 1 && D % 16 == 0, "shared memory for a block of K and V beside the warps' q tiles");
    const int C = la.chunks, parts = la.parts, P = C * parts, G = la.G, R = G * M, RT = (R + 15) / 16;
    if (j >= P) return;  // (G + 2) S CTAs, P items: the rest have none
    const int c = j / parts, part = j % parts, rt_lo = RT * part / parts, rt_hi = RT * (part + 1) / parts;
    int* done = la.flags + la.n_kv;
    int* xready = done + la.n_kv;
    __shared__ int live_s, fixed_s;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid < 32) {  // the live keys (up to the highest slot this forward writes) and the fixed ones (below its lowest)
        long long mx = -1, mn = la.mask_s;
        for (int t = tid; t < M; t += 32) {
            mx = max(mx, rp.slots[t]);
            mn = min(mn, rp.slots[t]);
        }
        for (int off = 16; off > 0; off >>= 1) {
            mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            mn = min(mn, __shfl_xor_sync(0xffffffffu, mn, off));
        }
        if (tid == 0) {
            live_s = static_cast<int>(min(mx + 1, static_cast<long long>(la.mask_s)));
            fixed_s = static_cast<int>(max(mn, 0ll));
        }
    }
    __syncthreads();
    const int live = live_s, nb = (live + 15) / 16, cb0 = nb * c / C, cb1 = nb * (c + 1) / C;
    const uint32_t qs = smem_addr(smem) + warp * BLK, ks = smem_addr(smem) + QBYTES, vs = ks + KVB * BLK;
    const __nv_bfloat16* kb = rp.kc + static_cast<size_t>(g) * rp.head_stride;
    const __nv_bfloat16* vb = rp.vc + static_cast<size_t>(g) * rp.head_stride;
    const size_t slab = (static_cast<size_t>(g) * C + c) * LAYER_ROWS;  // this item's chunk's rows in the workspace
    const int r0 = lane >> 2;  // this thread's rows r0, r0 + 8 of a tile
    auto stage_keys = [&](int gb, int nblk, int at) {  // blocks gb.. of K and V into staged blocks at.., by the CTA
        for (int i = tid; i < nblk * 16 * CHR; i += THREADS) {
            const int b = i / (16 * CHR), r = i % (16 * CHR) / CHR, ch = i % CHR, s = (gb + b) * 16 + r;
            const bool ok = s < live;
            const size_t off = static_cast<size_t>(ok ? s : 0) * D + ch * 8;
            cp_async_zfill(ks + (at + b) * BLK + swz_d(r, ch, ROWB), kb + off, ok ? 16 : 0);
            cp_async_zfill(vs + (at + b) * BLK + swz_d(r, ch, ROWB), vb + off, ok ? 16 : 0);
        }
        cp_async_commit();
    };
    const bool resident = cb1 - cb0 <= KVB;  // the whole chunk fits: staged once, for every round of row tiles
    // blocks wholly below this forward's lowest slot hold earlier forwards' keys: in flight before the wait
    const int cbf = resident ? max(cb0, min(cb1, fixed_s / 16)) : cb0;
    if (cbf > cb0) stage_keys(cb0, cbf - cb0, 0);
    if (tid == 0) spin_until(la.flags + g, (G + 2) * S);  // the KV head's q, k and v rows stored
    if (lst) lst[2] = globaltimer();
    __syncthreads();
    if (resident && cbf < cb1) stage_keys(cbf, cb1 - cbf, cbf - cb0);
    for (int rt0 = rt_lo; rt0 < rt_hi; rt0 += WARPS) {
        const int rt = rt0 + warp;  // this warp's row tile (every warp takes the block loop's barriers)
        const bool rt_ok = rt < rt_hi;
        if (rt_ok) {  // its q rows (written by phase A's owners: read through L2)
            for (int i = lane; i < 16 * CHR; i += 32) {
                const int r = i / CHR, ch = i % CHR, row = rt * 16 + r;
                const bool ok = row < R;
                const __nv_bfloat16* src =
                    ok ? q + static_cast<size_t>(row / G) * ldq + (g * G + row % G) * D + ch * 8 : q;
                cp_async_zfill(qs + swz_d(r, ch, ROWB), src, ok ? 16 : 0);
            }
        }
        cp_async_commit();
        bool rok[2];
        int tok[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int row = rt * 16 + r0 + 8 * i;
            rok[i] = rt_ok && row < R;
            tok[i] = rok[i] ? row / G : 0;
        }
        auto mask_bits = [&](int s0) {  // 2 rows x 4 keys: bit j * 4 + row * 2 + col
            uint32_t vis = 0;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int i = (e >> 1) & 1, s = s0 + (e >> 2) * 8 + 2 * (lane & 3) + (e & 1);
                if (rok[i] && s < live && la.mask[tok[i] * la.mask_st + s] != 0) vis |= 1u << e;
            }
            return vis;
        };
        float m[2] = {-1.0e30f, -1.0e30f}, l[2] = {0.f, 0.f}, o[NT][4];
#pragma unroll
        for (int jn = 0; jn < NT; ++jn) o[jn][0] = o[jn][1] = o[jn][2] = o[jn][3] = 0.f;
        uint32_t vis4 = 0;  // the first 4 blocks' mask bits, their loads in flight together (8 bits a block)
#pragma unroll
        for (int b = 0; b < 4; ++b)
            if (cb0 + b < cb1) vis4 |= mask_bits((cb0 + b) * 16) << (8 * b);
        for (int gb = cb0; gb < cb1; gb += KVB) {
            const int nblk = min(KVB, cb1 - gb);
            if (!resident) {
                __syncthreads();  // every warp is done with the previous blocks
                stage_keys(gb, nblk, 0);
            }
            cp_async_wait<0>();  // (the keys, and this round's q rows)
            __syncthreads();
            if (lst && rt0 == rt_lo && gb == cb0) lst[8] = globaltimer();
            if (!rt_ok) continue;
            for (int b = 0; b < nblk; ++b) {
                const int s0 = (gb + b) * 16;
                const int bi = gb - cb0 + b;  // the block within the chunk
                const uint32_t vis = bi < 4 ? (vis4 >> (8 * bi)) & 0xffu : mask_bits(s0);
                const int at = resident ? bi : b;  // its staged slot
                const uint32_t kt = ks + at * BLK, vt = vs + at * BLK;
                float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
                for (int kk = 0; kk < D / 16; ++kk) {
                    uint32_t qf[4], k0, k1, k2, k3;
                    ldsm4(qs + swz_d(lane & 15, 2 * kk + (lane >> 4), ROWB), qf[0], qf[1], qf[2], qf[3]);
                    ldsm4(kt + swz_d((lane & 7) + ((lane >> 4) << 3), 2 * kk + ((lane >> 3) & 1), ROWB), k0, k1, k2,
                          k3);
                    mma16816(sc[0], qf, k0, k1);
                    mma16816(sc[1], qf, k2, k3);
                }
                float mx[2] = {m[0], m[1]};
#pragma unroll
                for (int jn = 0; jn < 2; ++jn)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {  // sc[jn][e]: row r0 + 8 (e >> 1), key s0 + 8 jn + 2 (lane & 3) + (e & 1)
                        sc[jn][e] = (vis >> (jn * 4 + e)) & 1u ? sc[jn][e] * la.scale : -1.0e30f;
                        mx[e >> 1] = fmaxf(mx[e >> 1], sc[jn][e]);
                    }
                float alpha[2], rs[2] = {0.f, 0.f};
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
                    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
                    alpha[i] = __expf(m[i] - mx[i]);
                }
#pragma unroll
                for (int jn = 0; jn < 2; ++jn)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const float p = sc[jn][e] > -1.0e29f ? __expf(sc[jn][e] - mx[e >> 1]) : 0.f;
                        sc[jn][e] = p;
                        rs[e >> 1] += p;
                    }
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    rs[i] += __shfl_xor_sync(0xffffffffu, rs[i], 1);
                    rs[i] += __shfl_xor_sync(0xffffffffu, rs[i], 2);
                    l[i] = l[i] * alpha[i] + rs[i];
                    m[i] = mx[i];
                }
#pragma unroll
                for (int jn = 0; jn < NT; ++jn) {
                    o[jn][0] *= alpha[0];
                    o[jn][1] *= alpha[0];
                    o[jn][2] *= alpha[1];
                    o[jn][3] *= alpha[1];
                }
                const uint32_t pa[4] = {pack2(sc[0][0], sc[0][1]), pack2(sc[0][2], sc[0][3]),
                                        pack2(sc[1][0], sc[1][1]), pack2(sc[1][2], sc[1][3])};
#pragma unroll
                for (int jn = 0; jn < NT; jn += 2) {
                    uint32_t v0, v1, v2, v3;
                    ldsm4_t(vt + swz_d((lane & 7) + (((lane >> 3) & 1) << 3), jn + (lane >> 4), ROWB), v0, v1, v2, v3);
                    mma16816(o[jn], pa, v0, v1);
                    mma16816(o[jn + 1], pa, v2, v3);
                }
            }
        }
        cp_async_wait<0>();  // (a chunk without blocks never waited for its q rows)
        if (lst && rt0 == rt_lo) lst[9] = globaltimer();
        if (rt_ok) {         // the tile's partial: O unnormalised, and the rows' (m, l)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const size_t row = slab + rt * 16 + r0 + 8 * i;
#pragma unroll
                for (int jn = 0; jn < NT; ++jn)
                    __stcg(reinterpret_cast<float2*>(la.part + row * D + jn * 8 + 2 * (lane & 3)),
                           make_float2(o[jn][2 * i], o[jn][2 * i + 1]));
                if ((lane & 3) == 0) __stcg(reinterpret_cast<float2*>(la.ml + row * 2), make_float2(m[i], l[i]));
            }
        }
    }
    __syncthreads();  // (the CTA's partials ordered before thread 0's fence: cooperative groups' grid sync)
    if (tid == 0) {   // this item counted; then every item of the KV head
        if (lst) lst[3] = globaltimer();
        __threadfence();
        atomicAdd(done + g, 1);
        spin_until(done + g, P);
        if (lst) lst[4] = globaltimer();
    }
    __syncthreads();
    // this item's 1/P of the KV head's rows, merged over the C chunks (as `kernels._attn_combine_kernel`), to o's x
    const int rb0 = R * j / P, rb1 = R * (j + 1) / P;
    const size_t base = static_cast<size_t>(g) * C * LAYER_ROWS;
    for (int v = tid; v < (rb1 - rb0) * (D / 4); v += THREADS) {
        const int row = rb0 + v / (D / 4), col = (v % (D / 4)) * 4;
        float mm = -1.0e30f;
        for (int k = 0; k < C; ++k) mm = fmaxf(mm, __ldcg(la.ml + (base + k * LAYER_ROWS + row) * 2));
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        float den = 0.f;
        for (int k = 0; k < C; ++k) {
            const size_t at = base + k * LAYER_ROWS + row;
            const float2 ml = __ldcg(reinterpret_cast<const float2*>(la.ml + at * 2));
            const float wt = __expf(ml.x - mm);
            const float4 p = __ldcg(reinterpret_cast<const float4*>(la.part + at * D + col));
            acc.x += wt * p.x;
            acc.y += wt * p.y;
            acc.z += wt * p.z;
            acc.w += wt * p.w;
            den += wt * ml.y;
        }
        const float inv = 1.f / den;
        __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(la.attn + static_cast<size_t>(row / G) * la.lda +
                                                                 (g * G + row % G) * D + col);
        dst[0] = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
        dst[1] = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
    }
    __syncthreads();
    if (tid == 0) {
        __threadfence();
        atomicAdd(xready + g, 1);
    }
    if (lst) lst[5] = globaltimer();
}

__device__ __forceinline__ unsigned char* layer_smem() {  // the dynamic shared memory at a 1024-byte boundary (as the body's ring)
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    return smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
}

// the KV heads [g0, g1] whose q heads o's K slice `rank` of S reads (o's K = n_heads d, BK at a time)
__device__ __forceinline__ void o_slice_groups(const LayerArgs& la, int d, int rank, int S, int& g0, int& g1) {
    const int kt = la.ko / BK, k0 = kt * rank / S * BK, k1 = kt * (rank + 1) / S * BK;
    g0 = k0 / d / la.G;
    g1 = (k1 - 1) / d / la.G;
}

// the layer kernel's phase stamps (with `prof`; after the q/k/v body's PROF_POINTS a CTA): thread 0's, LAYER_POINTS
// a CTA — 0 the SM, 1 the q/k/v unit done; its attention item's 2 ready[g] reached, 3 partial stored, 4 the KV
// head's items all done, 5 combined; the q tiles' o unit's 6 xready reached, 7 stored; the item's first round's
// 8 keys and q rows in shared memory, 9 (warp 0's) scores done
#define LAYER_POINTS 10
__device__ __forceinline__ unsigned long long* layer_stamps(unsigned long long* prof) {
    if (prof == nullptr || threadIdx.x != 0) return nullptr;
    const unsigned cta = blockIdx.y * gridDim.x + blockIdx.x, ctas = gridDim.x * gridDim.y;
    unsigned long long* p = prof + static_cast<size_t>(ctas) * PROF_POINTS + static_cast<size_t>(cta) * LAYER_POINTS;
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    p[0] = smid;
    p[1] = globaltimer();
    return p;
}

#define LAYER_KERNEL(BN, WG, NTOK, STAGES, NAME, MINB)                                                             \
    extern "C" __global__ void __launch_bounds__(128 * WG, MINB) layer_qkv_attn_o_##NAME(                          \
        const __grid_constant__ TmaDesc wmap, const __grid_constant__ TmaDesc omap,                               \
        const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ q, int M, int K, int ldx, int ldq,       \
        __nv_bfloat16* __restrict__ h, int ldh, unsigned long long* prof, const Epi epi, const RopeArgs rope,     \
        const Epi epi_o, const LayerArgs la) {                                                                    \
        constexpr int RING = STAGES * (BN + XROWS) * BK * 2;                                                      \
        cluster_gemm_body<BN, WG, NTOK, STAGES, true, true, false, true, true>(                                   \
            &wmap, x, q, M, K, ldx, ldq, 0, nullptr, nullptr, prof, epi, &rope, -1, PdlWait(), la.flags, la.G);   \
        __syncthreads(); /* the ring (the exchange's inbox) is free again */                                      \
        const int S = static_cast<int>(cg::this_cluster().num_blocks());                                          \
        const int rank = static_cast<int>(cg::this_cluster().block_rank());                                       \
        unsigned char* smem = layer_smem();                                                                       \
        const int n_q = rope.q_cols / BN;                                                                         \
        unsigned long long* lst = layer_stamps(prof);                                                             \
        { /* every CTA an item of its tile's KV head: q tiles (a head each) first, then k, then v */              \
            const int t = blockIdx.x, G = la.G;                                                                   \
            const int g = t < n_q ? t / G : (t - n_q) % la.n_kv;                                                  \
            const int local = t < n_q ? t % G : G + (t - n_q) / la.n_kv;                                          \
            attend_item<BN, 128 * WG, RING>(la, rope, q, ldq, M, S, g, local * S + rank, smem, lst);              \
        }                                                                                                         \
        if (static_cast<int>(blockIdx.x) >= n_q) return; /* the k and v tiles' CTAs have no o unit */              \
        int g0, g1;                                                                                               \
        o_slice_groups(la, rope.d, rank, S, g0, g1);                                                              \
        const int* xready = la.flags + 2 * la.n_kv;                                                               \
        auto xwait = [&]() {                                                                                      \
            if (threadIdx.x == 0)                                                                                 \
                for (int g = g0; g <= g1; ++g) spin_until(xready + g, la.chunks * la.parts);                            \
            if (lst) lst[6] = globaltimer();                                                                      \
            __syncthreads();                                                                                      \
        };                                                                                                        \
        cluster_gemm_body<BN, WG, NTOK, STAGES, true, true, false, false, false, decltype(xwait)>(                \
            &omap, la.attn, h, M, la.ko, la.lda, ldh, 0, nullptr, nullptr, nullptr, epi_o, nullptr, blockIdx.x,   \
            xwait);                                                                                               \
        if (lst) lst[7] = globaltimer();                                                                          \
        if (threadIdx.x == 0) { /* the last reader of a KV head's counters resets them for the next call */       \
            for (int g = g0; g <= g1; ++g) {                                                                      \
                int readers = 0;                                                                                  \
                for (int r = 0; r < S; ++r) {                                                                     \
                    int a, b;                                                                                     \
                    o_slice_groups(la, rope.d, r, S, a, b);                                                       \
                    readers += (a <= g && g <= b) ? n_q : 0;                                                      \
                }                                                                                                 \
                if (atomicAdd(la.flags + 3 * la.n_kv + g, 1) == readers - 1) {                                    \
                    for (int f = 0; f < 4; ++f) la.flags[f * la.n_kv + g] = 0;                                    \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
    }
LAYER_KERNEL(128, 2, 56, 3, bn128_half, 2)  // bn128_half's tile: the 8B plan (192 CTAs at split 4, 264 places); 3
                                            // stages (cluster_gemm.LAYER_STAGES: L1 room for spills)
LAYER_KERNEL(64, 1, 56, 12, bn64, 1)        // bn64's: 64-wide heads (the pycode targets; a CTA an SM)

// split-K reduced by the tile's last CTA through an L2 workspace ("_l"; no cluster)
LASTCTA_GEMM(64, 1, 56, 12, bn64_l, 1)
LASTCTA_GEMM(128, 2, 56, 8, bn128_l, 1)
LASTCTA_GEMM(256, 2, 56, 5, bn256_l, 1)
