// Attention for a wide forward (the 8B tree verify's 49 tokens, each with its own mask row), one launch: the rows of a
// CTA are 64 (token, query head) pairs of one KV head, token-major as `kernels.rows_attention` orders them; the live
// keys (up to the highest slot this forward wrote) are split into C chunks, one CTA each, and the C CTAs of a row
// block form a thread-block cluster that combines their partial softmaxes through distributed shared memory — no
// second (combine) launch, no partials in global memory, and each K/V block is read once per 64 rows.
//
// Why: `rows_attention` (Triton, 16 rows a program, chunks combined by a second kernel) takes ~12 us a layer at 49
// tokens against ~6.5 at 8 (BENCHMARKS.md, "decode attention"), while its FLOPs and bytes (~0.45 GFLOP, ~2.3 MB of
// K/V at 512 of context) are worth ~1 us: 416 programs in ~1.6 waves, each K/V block re-read by 13 programs, and the
// combine's launch. Here: 8 KV heads x 4 row blocks x C chunks (C = 4: 128 CTAs, one wave).
//
// A CTA: 4 warps, each 16 rows (mma.sync m16n8k16, bf16 in, fp32 accumulation, FlashAttention-2's register layout:
// the scores' accumulators become the P operand of P V without shared memory). Q [64][D] and a 2-stage ring of K and V
// blocks [64 keys][D] in shared memory (cp.async, 16-byte chunks swizzled by the row: chunk c of row r at c ^ (r & 7),
// so ldmatrix reads are conflict-free). The mask is read from global memory (bytes, cached: a row block has 16
// tokens). Rounding as `kernels._softmax_step`: scores scaled in fp32, masked to -1e30, P rounded to bf16 for P V.
//
// The combine: after its keys, each CTA pushes its rows' (m, l, O) to the row's owner CTA (rank = local row / (64 /
// C)) into an inbox over its (now idle) K/V ring; after the cluster barrier the owner sums the C partials in rank order
// (deterministic) as `kernels._attn_combine_kernel` does and stores bf16.
//
// PDL: the next kernel may launch at once (the o projection's CTAs fetch their first weight tiles while this runs);
// everything this kernel reads besides the mask's constant part is the previous kernels' output, so it waits first.
//
// Built to PTX by scripts/build_cuda_kernels.sh; `experimental/cluster_attention.py` launches it.

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace cg = cooperative_groups;

#define ROWS 64  // (token, query head) rows a CTA: 4 warps of 16
#define BS 64    // keys a block
#define WARPS 4

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// byte offset of (row, 16-byte chunk) in a [rows][D] bf16 tile (D * 2 bytes a row)
template <int D>
__device__ __forceinline__ uint32_t swz(int row, int chunk) {
    return row * (D * 2) + ((chunk ^ (row & 7)) << 4);
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// d[4] += a[4] (16x16, row) * b[2] (16x8, col), bf16 -> fp32
__device__ __forceinline__ void mma16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

struct AttnArgs {
    const __nv_bfloat16* q;  // [T, nh, D] (token and head strides below; D contiguous)
    long long q_st, q_sh;
    const __nv_bfloat16* kc;  // [nkv][max_len][D] (one layer, batch 1)
    const __nv_bfloat16* vc;
    long long head_stride;      // elements from one KV head's cache to the next
    const unsigned char* mask;  // [T, S] bool (1 = attend)
    long long mask_st;
    const long long* slots;  // [T] the cache slots this forward wrote: keys past the highest are not read
    __nv_bfloat16* out;      // [T, nh, D] contiguous
    int T, S, G, nh;
    float scale;
    int flags;  // bit 0 (a diagnostic): read no keys — the launch, the waits, Q and the combine alone
};

// grid (nkv, row blocks, C), cluster (1, 1, C), 128 * KSPLIT threads: warp w takes rows (w % 4) * 16.. and, of each
// key block, the keys (w / 4) * BS / KSPLIT.. — KSPLIT warps a row group, so a scheduler has KSPLIT warps to switch
// between where one warp's chain of loads, MMAs and shuffles would leave it idle (the key groups' softmaxes are
// merged through shared memory after the loop, as the chunks are across the cluster)
template <int D, int KSPLIT>
__device__ __forceinline__ void attention_body(const AttnArgs& a) {
    constexpr int THREADS = 128 * KSPLIT;
    constexpr int CH = D / 8;  // 16-byte chunks a row
    constexpr int NT = D / 8;  // n8 tiles of O
    constexpr int KB = BS / KSPLIT;  // keys a warp takes of a block
    constexpr int TILE = ROWS * D * 2;
    static_assert(KB >= 16 && (ROWS * CH) % THREADS == 0 && (BS * CH) % THREADS == 0, "tiles over the threads");
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* qs = smem;           // [ROWS][D]
    unsigned char* ring = smem + TILE;  // 2 stages x (K [BS][D], V [BS][D]); the cluster's inbox after
    float* merge = reinterpret_cast<float*>(smem);  // key groups 1.. : [KSPLIT - 1][ROWS][D] fp32 after the loop
    __shared__ int live_s;
    __shared__ float ml_in[ROWS][2];  // the owner's inbox of (m, l): [sender][its rows] (ROWS entries in all)
    __shared__ float ml_merge[KSPLIT][ROWS][2];

    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");  // q, the caches' new rows and the slots are ours to read now

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int rg = warp & 3, kg = warp >> 2;  // row group, key group
    const int h = blockIdx.x, rb = blockIdx.y;
    cg::cluster_group cluster = cg::this_cluster();
    const int C = static_cast<int>(cluster.num_blocks()), rank = static_cast<int>(cluster.block_rank());
    if (tid < 32) {  // live keys: the highest slot written + 1, at most S
        long long mx = -1;
        for (int t = tid; t < a.T; t += 32) mx = max(mx, a.slots[t]);
        for (int off = 16; off > 0; off >>= 1) mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        if (tid == 0) live_s = static_cast<int>(min(mx + 1, static_cast<long long>(a.S)));
    }
    // Q: row r of this block = (token, head) pair rb * ROWS + r
    const int rows_total = a.T * a.G;
#pragma unroll
    for (int i = 0; i < ROWS * CH / THREADS; ++i) {
        const int c = tid + i * THREADS, r = c / CH, ch = c % CH;
        const int gr = rb * ROWS + r;
        const bool ok = gr < rows_total;
        const int t = ok ? gr / a.G : 0, qh = h * a.G + (ok ? gr % a.G : 0);
        cp_async16(smem_u32(qs) + swz<D>(r, ch), a.q + t * a.q_st + qh * a.q_sh + ch * 8, ok);
    }
    cp_commit();
    __syncthreads();
    const int live = live_s;
    int span = (live + C - 1) / C;
    span = (span + 15) / 16 * 16;
    const int start = rank * span, stop = min(start + span, live);
    const int nblk = stop > start && !(a.flags & 1) ? (stop - start + BS - 1) / BS : 0;

    const __nv_bfloat16* kb = a.kc + h * a.head_stride;
    const __nv_bfloat16* vb = a.vc + h * a.head_stride;
    auto load_kv = [&](int stage, int s0) {
        const uint32_t kd = smem_u32(ring) + stage * 2 * BS * D * 2, vd = kd + BS * D * 2;
#pragma unroll
        for (int i = 0; i < BS * CH / THREADS; ++i) {
            const int c = tid + i * THREADS, r = c / CH, ch = c % CH;
            const int s = s0 + r;
            const bool ok = s < stop;
            const size_t off = static_cast<size_t>(ok ? s : 0) * D + ch * 8;
            cp_async16(kd + swz<D>(r, ch), kb + off, ok);
            cp_async16(vd + swz<D>(r, ch), vb + off, ok);
        }
    };
    if (nblk > 0) load_kv(0, start);
    cp_commit();

    // this thread's two rows (local lr0 = rg * 16 + lane / 4, lr0 + 8) and their tokens
    const int lr0 = rg * 16 + (lane >> 2);
    int tok[2];
    bool rok[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int gr = rb * ROWS + lr0 + 8 * i;
        rok[i] = gr < rows_total;
        tok[i] = rok[i] ? gr / a.G : 0;
    }
    float m[2] = {-1.0e30f, -1.0e30f}, l[2] = {0.f, 0.f};
    float o[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;

    for (int b = 0; b < nblk; ++b) {
        if (b + 1 < nblk) load_kv((b + 1) & 1, start + (b + 1) * BS);
        cp_commit();
        const int s0 = start + b * BS + kg * KB;  // this warp's first key
        // the mask of this thread's 2 rows x its keys as bits (read before the data wait and the MMAs: its latency
        // hides behind them)
        uint32_t vis = 0;
#pragma unroll
        for (int j = 0; j < KB / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = e >> 1, s = s0 + j * 8 + 2 * (lane & 3) + (e & 1);
                if (rok[i] && s < stop && a.mask[tok[i] * a.mask_st + s] != 0) vis |= 1u << (j * 4 + e);
            }
        cp_wait<1>();
        __syncthreads();
        const uint32_t kt = smem_u32(ring) + (b & 1) * 2 * BS * D * 2, vt = kt + BS * D * 2;
        // scores: 16 rows x KB keys
        float sc[KB / 8][4];
#pragma unroll
        for (int j = 0; j < KB / 8; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t qf[4];  // this warp's Q rows, d 16kk.. (an A fragment; re-read a block: registers are scarce)
            ldsm_x4(smem_u32(qs) + swz<D>(rg * 16 + (lane & 15), 2 * kk + (lane >> 4)), qf[0], qf[1], qf[2], qf[3]);
#pragma unroll
            for (int j = 0; j < KB / 8; j += 2) {
                uint32_t b0, b1, b2, b3;  // keys j*8.. (d halves 2kk, 2kk+1), keys (j+1)*8..
                const int r = kg * KB + j * 8 + (lane & 7) + ((lane >> 4) << 3), ch = 2 * kk + ((lane >> 3) & 1);
                ldsm_x4(kt + swz<D>(r, ch), b0, b1, b2, b3);
                mma16816(sc[j], qf, b0, b1);
                mma16816(sc[j + 1], qf, b2, b3);
            }
        }
        // mask, running max, p
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int j = 0; j < KB / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = e >> 1;
                sc[j][e] = (vis >> (j * 4 + e)) & 1u ? sc[j][e] * a.scale : -1.0e30f;
                mx[i] = fmaxf(mx[i], sc[j][e]);
            }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
        }
        float alpha[2], rs[2] = {0.f, 0.f};
#pragma unroll
        for (int i = 0; i < 2; ++i) alpha[i] = __expf(m[i] - mx[i]);
#pragma unroll
        for (int j = 0; j < KB / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = e >> 1;
                const float p = sc[j][e] > -1.0e29f ? __expf(sc[j][e] - mx[i]) : 0.f;
                sc[j][e] = p;
                rs[i] += p;
            }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            rs[i] += __shfl_xor_sync(0xffffffffu, rs[i], 1);
            rs[i] += __shfl_xor_sync(0xffffffffu, rs[i], 2);
            l[i] = l[i] * alpha[i] + rs[i];
            m[i] = mx[i];
        }
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            o[j][0] *= alpha[0];
            o[j][1] *= alpha[0];
            o[j][2] *= alpha[1];
            o[j][3] *= alpha[1];
        }
        // O += P V: P (bf16) as A fragments over 16 keys at a time, V through ldmatrix.trans
#pragma unroll
        for (int kk = 0; kk < KB / 16; ++kk) {
            uint32_t pa[4] = {pack_bf16(sc[2 * kk][0], sc[2 * kk][1]), pack_bf16(sc[2 * kk][2], sc[2 * kk][3]),
                              pack_bf16(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                              pack_bf16(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
            for (int j = 0; j < NT; j += 2) {
                uint32_t b0, b1, b2, b3;  // d tile j (keys 0-7, 8-15), d tile j+1
                const int r = kg * KB + kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3), ch = j + (lane >> 4);
                ldsm_x4_t(vt + swz<D>(r, ch), b0, b1, b2, b3);
                mma16816(o[j], pa, b0, b1);
                mma16816(o[j + 1], pa, b2, b3);
            }
        }
        __syncthreads();  // this stage is refilled next step
    }
    cp_wait<0>();
    __syncthreads();

    if constexpr (KSPLIT > 1) {  // key groups 1.. hand their (m, l, O) to group 0 through shared memory (Q's, ring's)
        if (kg > 0) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                float* dst = merge + static_cast<size_t>((kg - 1) * ROWS + lr0 + 8 * i) * D;
#pragma unroll
                for (int j = 0; j < NT; ++j)
                    *reinterpret_cast<float2*>(dst + j * 8 + 2 * (lane & 3)) = make_float2(o[j][2 * i], o[j][2 * i + 1]);
                ml_merge[kg][lr0 + 8 * i][0] = m[i];
                ml_merge[kg][lr0 + 8 * i][1] = l[i];
            }
        }
        __syncthreads();
        if (kg == 0) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int lr = lr0 + 8 * i;
                float mm = m[i];
#pragma unroll
                for (int g = 1; g < KSPLIT; ++g) mm = fmaxf(mm, ml_merge[g][lr][0]);
                const float a0 = __expf(m[i] - mm);
                l[i] *= a0;
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    o[j][2 * i] *= a0;
                    o[j][2 * i + 1] *= a0;
                }
#pragma unroll
                for (int g = 1; g < KSPLIT; ++g) {
                    const float ag = __expf(ml_merge[g][lr][0] - mm);
                    l[i] += ag * ml_merge[g][lr][1];
                    const float* src = merge + static_cast<size_t>((g - 1) * ROWS + lr) * D;
#pragma unroll
                    for (int j = 0; j < NT; ++j) {
                        const float2 p = *reinterpret_cast<const float2*>(src + j * 8 + 2 * (lane & 3));
                        o[j][2 * i] += ag * p.x;
                        o[j][2 * i + 1] += ag * p.y;
                    }
                }
                m[i] = mm;
            }
        }
    }

    if (C == 1) {  // no partner: out = O / l
        if (kg > 0) return;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            if (!rok[i]) continue;
            const int gr = rb * ROWS + lr0 + 8 * i;
            __nv_bfloat16* dst = a.out + (static_cast<size_t>(tok[i]) * a.nh + h * a.G + gr % a.G) * D;
            const float inv = 1.f / (l[i] > 0.f ? l[i] : 1.f);
#pragma unroll
            for (int j = 0; j < NT; ++j)
                *reinterpret_cast<__nv_bfloat162*>(dst + j * 8 + 2 * (lane & 3)) =
                    __floats2bfloat162_rn(o[j][2 * i] * inv, o[j][2 * i + 1] * inv);
        }
        return;
    }
    // the combine: the inbox [sender][owned row][D] fp32 over the ring (ROWS * D * 4 bytes), once every CTA of the
    // cluster is past its keys (and its merge)
    const int rpo = ROWS / C;  // rows an owner has
    float* inbox = reinterpret_cast<float*>(ring);
    __syncthreads();
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");  // every ring idle
    if (kg == 0) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int lr = lr0 + 8 * i, owner = lr / rpo, slot = rank * rpo + lr % rpo;
            float* dst = cluster.map_shared_rank(inbox, owner) + static_cast<size_t>(slot) * D;
#pragma unroll
            for (int j = 0; j < NT; ++j)
                *reinterpret_cast<float2*>(dst + j * 8 + 2 * (lane & 3)) = make_float2(o[j][2 * i], o[j][2 * i + 1]);
            if ((lane & 3) == 0) {
                float* mlr = cluster.map_shared_rank(&ml_in[0][0], owner) + 2 * slot;
                mlr[0] = m[i];
                mlr[1] = l[i];
            }
        }
    }
    cluster.sync();  // every partial delivered
    // this CTA's rows lr = rank * rpo + k: sum the C partials in rank order
    for (int v = tid; v < rpo * (D / 4); v += THREADS) {
        const int k = v / (D / 4), c = (v % (D / 4)) * 4, lr = rank * rpo + k, gr = rb * ROWS + lr;
        if (gr >= rows_total) continue;
        float mmax = -1.0e30f;
        for (int q = 0; q < C; ++q) mmax = fmaxf(mmax, ml_in[q * rpo + k][0]);
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        float den = 0.f;
        for (int q = 0; q < C; ++q) {
            const float w = __expf(ml_in[q * rpo + k][0] - mmax);
            const float4 p = *reinterpret_cast<const float4*>(inbox + static_cast<size_t>(q * rpo + k) * D + c);
            acc.x += w * p.x;
            acc.y += w * p.y;
            acc.z += w * p.z;
            acc.w += w * p.w;
            den += w * ml_in[q * rpo + k][1];
        }
        const float inv = 1.f / den;
        __nv_bfloat16* dst = a.out + (static_cast<size_t>(gr / a.G) * a.nh + h * a.G + gr % a.G) * D + c;
        reinterpret_cast<__nv_bfloat162*>(dst)[0] = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
        reinterpret_cast<__nv_bfloat162*>(dst)[1] = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
    }
}

#define ATTN_KERNEL(D, KSPLIT)                                                                         \
    extern "C" __global__ void __launch_bounds__(128 * KSPLIT, 1)                                      \
        cluster_attention_d##D##_k##KSPLIT(const __grid_constant__ AttnArgs a) {                       \
        attention_body<D, KSPLIT>(a);                                                                  \
    }
ATTN_KERNEL(128, 1)
ATTN_KERNEL(128, 2)
ATTN_KERNEL(128, 4)
ATTN_KERNEL(64, 1)
ATTN_KERNEL(64, 2)
ATTN_KERNEL(64, 4)
