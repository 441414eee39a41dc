"""`cluster_gemm`: a few-row bf16 GEMM of our own, `out[M, N] = x[M, K] @ w[N, K]^T` for M <= 56 (or 64) (the 8B verify's
49 rows), split over K inside a thread-block cluster and reduced through distributed shared memory, with
programmatic dependent launch: its first weight tiles are in flight before the previous kernel finishes.

Why: at 49 rows cuBLAS's kernels stream q/k/v, o and down at 0.67-0.85 of copy bandwidth and never overlap their
neighbours (no PDL), which leaves the verify at ~1.25 plain steps (docs/LOG.md, twenty-second session). The kernel
is CUDA (`csrc/cluster_gemm.cu`, what it does and why is there), shipped as PTX (`csrc/cluster_gemm.ptx`, made by
`scripts/build_cuda_kernels.sh`), assembled here for the GPU by triton's bundled ptxas (the driver's JIT when
there is none) and launched through the driver API (`cuLaunchKernelEx`: cluster dimensions and PDL are launch
attributes), on torch's current stream, so CUDA graphs capture it like any kernel.

A plan is (variant, split): the variant names a tile (`VARIANTS`: BN weight rows a CTA, warpgroups, tokens, ring
stages), split the CTAs over K that form one cluster (or, for the `LAST` variants, that write their partials to an
L2 workspace, the tile's last CTA summing them). `plan_for` picks one for a shape (bench/cluster_gemm.py times
them).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from draftsmith.decode.experimental import cuda_driver as drv
from draftsmith.decode.llama import _rotate_half

_CSRC = Path(__file__).resolve().parent / "csrc"
PTX = _CSRC / "cluster_gemm.ptx"
BK = 64  # K a ring stage covers: K must be a multiple of it
# variant -> (BN weight rows a CTA, warpgroups, tokens (M at most), ring stages): csrc/cluster_gemm.cu's CLUSTER_GEMM
# instances ("_half": half the shared memory, two CTAs an SM; "_keep": no L2 evict-first hint on the weights;
# "_nomma": the ring alone, no multiplies — a diagnostic whose output is garbage)
VARIANTS = {
    "bn64": (64, 1, 56, 12),
    "bn128": (128, 2, 56, 8),
    "bn256": (256, 2, 56, 5),
    "bn256wg4": (256, 4, 56, 5),
    "bn256n64": (256, 2, 64, 5),
    "bn64_half": (64, 1, 56, 6),
    "bn128_half": (128, 2, 56, 4),
    "bn256_nomma": (256, 2, 56, 5),
    "bn128_nomma": (128, 2, 56, 8),
    # split-K reduced by each tile's last CTA through an L2 workspace, no cluster ("_l": LAST)
    "bn64_l": (64, 1, 56, 12),
    "bn128_l": (128, 2, 56, 8),
    "bn256_l": (256, 2, 56, 5),
    # q/k/v with RoPE and the cache writes in the cluster reduction (`fused(rope=)`): a plan's variant + "_rope"
    "bn128_half_rope": (128, 2, 56, 4),
    "bn64_rope": (64, 1, 56, 12),
}
LAST = frozenset(v for v in VARIANTS if v.endswith("_l"))
NO_WAIT = 2  # `launch(late=NO_WAIT)`: csrc's `late` bit 2, no PDL wait (bench/cluster_gemm.py's chain diagnostic)
ROPE = frozenset(v for v in VARIANTS if v.endswith("_rope"))
# a layer's q/k/v -> attention -> o in one launch (csrc/cluster_gemm.cu's `layer_qkv_attn_o_*`; experimental: correct,
# and slower than the three launches it replaces, 56.4 vs 44.5 us a layer on the H200 — docs/LOG.md, twenty-eighth
# session): the variant whose q/k/v plan it takes
LAYER = frozenset({"bn128_half", "bn64"})
# the layer kernels' ring stages (csrc's LAYER_KERNEL instances): bn128_half's 3, not its GEMM's 4, so that two
# CTAs an SM leave 92 KB of L1 (the 228 KB shared-memory carveout left 28 KB, under the attention's spilled registers)
LAYER_STAGES = {"bn128_half": 3, "bn64": 12}
LAYER_ROWS = 256  # G x M (q head, token) rows of a KV head, at most (the kernel's workspace rows)
WS_BYTES = 32 << 20  # the LAST variants' partials (N * split * 56 * 4 bytes a call), one buffer a device
COUNTERS = 8192  # their per-tile arrival counters (N / BN tiles a call)
ROWS_MAX = max(v[2] for v in VARIANTS.values())
SPLIT_MAX = 8  # portable cluster size
N_MAX = 65536  # the engine's route (ops.TritonAttnOps._cg) leaves wider matrices (a vocabulary's lm_head) to cuBLAS
# unless PLANS (or KernelConfig.cluster_gemm_plans) name the shape
# (variant, split) by (N, K), measured on an H200 at 49 rows (bench/cluster_gemm.py iso, BENCHMARKS.md "Issue 16,
# twenty-third session": the 8B shapes); `plan_for` takes these before its rule
PLANS = {
    (6144, 4096): ("bn128_half", 4),
    (4096, 4096): ("bn128_half", 6),
    (28672, 4096): ("bn128_l", 1),  # no split: 224 CTAs of 128 rows, stored straight from shared memory
    (4096, 14336): ("bn256wg4", 6),
    # the Llama-3 lm_head: 256.5 us against cuBLAS's 268 (0.977 of copy bandwidth; twenty-fifth session)
    (128256, 4096): ("bn128_half", 1),
}
# what each of a CTA's profile stamps marks (`launch(prof=)`)
PROF_STAMPS = (
    "start",
    "previous kernel done",
    "first weight tile in",
    "K slice done",
    "partials exchanged",
    "stored",
    "end",
)
# the layer kernel's phase stamps after them (`layer_qkv_attn_o(prof=)`; csrc's LAYER_POINTS): the SM's id, then
# %globaltimer ns
LAYER_STAMPS = (
    "sm",
    "q/k/v unit done",
    "attention: ready",
    "attention: partial stored",
    "attention: the KV head's items done",
    "attention: combined",
    "o: xready",
    "o: stored",
    "attention: keys and q in shared memory",
    "attention: scores done (warp 0)",
)

_CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 = 9
_CU_TENSOR_MAP_SWIZZLE_128B = 3
_CU_TENSOR_MAP_L2_PROMOTION_L2_256B = 3


class _Epi(ctypes.Structure):
    """csrc/cluster_gemm.cu's `Epi` (what the kernel folds into its stores), passed by value."""

    _fields_ = [
        ("res", ctypes.c_void_p),
        ("ldr", ctypes.c_int),
        ("nw", ctypes.c_void_p),
        ("hn", ctypes.c_void_p),
        ("ldh", ctypes.c_int),
        ("ssq_out", ctypes.c_void_p),
        ("ssq_in", ctypes.c_void_p),
        ("ssq_in_ld", ctypes.c_int),
        ("ssq_tiles", ctypes.c_int),
        ("inv_k", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("glu", ctypes.c_int),
    ]


class _RopeArgs(ctypes.Structure):
    """csrc/cluster_gemm.cu's `RopeArgs` (the `_rope` instances' extra argument), passed by value."""

    _fields_ = [
        ("pos", ctypes.c_void_p),
        ("slots", ctypes.c_void_p),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("kc", ctypes.c_void_p),
        ("vc", ctypes.c_void_p),
        ("head_stride", ctypes.c_longlong),
        ("q_cols", ctypes.c_int),
        ("k_cols", ctypes.c_int),
        ("d", ctypes.c_int),
    ]


_WS: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # device index -> (workspace, counters)
_MAPS: dict[tuple[int, int, int, int, bool], tuple[ctypes.Array, int]] = {}  # (ptr, N, K, BN, glu) -> (buffer, addr)
_MAPS_MAX = 4096  # a model's matrices (4 a layer) many times over; past it the oldest go


def _epi(K, res=None, nw=None, hn=None, ssq_out=None, ssq_in=None, eps=1e-6, glu=False) -> _Epi:
    """csrc/cluster_gemm.cu's `Epi` for `launch`'s folds (None: the fold is off)."""
    return _Epi(
        res.data_ptr() if res is not None else None,
        res.stride(0) if res is not None else 0,
        nw.data_ptr() if hn is not None else None,
        hn.data_ptr() if hn is not None else None,
        hn.stride(0) if hn is not None else 0,
        ssq_out.data_ptr() if ssq_out is not None else None,
        ssq_in.data_ptr() if ssq_in is not None else None,
        ssq_in.stride(0) if ssq_in is not None else 0,
        ssq_in.shape[0] if ssq_in is not None else 0,
        1.0 / K,
        eps,
        1 if glu else 0,
    )


def _rope_struct(rope: tuple) -> _RopeArgs:
    """`RopeArgs` from (positions, slots, cos, sin, k_cache, v_cache, n_heads, n_kv)."""
    pos, slots, cos, sin, kc, vc, nh, nkv = rope
    d = cos.shape[1]
    return _RopeArgs(
        pos.data_ptr(), slots.data_ptr(), cos.data_ptr(), sin.data_ptr(), kc.data_ptr(), vc.data_ptr(), kc.stride(1),
        nh * d, nkv * d, d,
    )  # fmt: skip


def _check(status: int, what: str) -> None:
    drv.check(status, what, "cluster_gemm")


def smem_bytes(variant: str, layer: bool = False) -> int:
    bn, _, _, stages = VARIANTS[variant]
    stages = LAYER_STAGES[variant] if layer else stages
    return stages * (bn + 64) * BK * 2 + 1024 + 8 * stages  # the ring (x: 64 rows a stage), alignment, mbarriers


def _function(device: torch.device, variant: str, layer: bool = False) -> ctypes.c_void_p:
    """The variant's kernel (with `layer`: its `layer_qkv_attn_o` kernel, LAYER)."""
    names = {f"cluster_gemm_{v}": smem_bytes(v) for v in VARIANTS}
    names.update({f"layer_qkv_attn_o_{v}": smem_bytes(v, layer=True) for v in LAYER})
    return drv.functions(device, PTX, names, "cluster_gemm")[
        f"{'layer_qkv_attn_o' if layer else 'cluster_gemm'}_{variant}"
    ]


def supports(x: torch.Tensor, w: torch.Tensor, variant: str = "bn128", check_ptr: bool = True) -> bool:
    """Whether the variant takes x @ w^T: CUDA sm_90+, bf16, 1 <= M <= the variant's tokens (56 or 64), K a multiple
    of 64, N of the variant's BN, rows 16-byte aligned (`check_ptr` False: not the data pointers — a traced tensor
    has none)."""
    if x.device.type != "cuda" or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.dim() != 2:
        return False
    if torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    M, K = x.shape
    N = w.shape[0]
    return (
        1 <= M <= VARIANTS[variant][2]
        and w.shape[1] == K
        and K % BK == 0
        and N % VARIANTS[variant][0] == 0
        and w.is_contiguous()
        and x.stride(1) == 1
        and x.stride(0) % 8 == 0
        and (not check_ptr or (x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0))
    )


def _weight_map(w: torch.Tensor, bn: int, glu: bool = False) -> int:
    """The address of a CUtensorMap over w [N, K] with a [bn, 64] box and the 128-byte swizzle (made once per
    weight: the host encodes it, the kernel takes it by value). 3-D: [1][N][K], or with `glu` [2][N/2][K] with a
    [2][bn/2][64] box (a tile's gate rows, then its up rows)."""
    N, K = w.shape
    key = (w.data_ptr(), N, K, bn, glu)
    hit = _MAPS.get(key)
    if hit is not None:
        return hit[1]
    buf = ctypes.create_string_buffer(128 + 64)
    addr = (ctypes.addressof(buf) + 63) & ~63  # CUtensorMap is 64-byte aligned
    rows, planes = (N // 2, 2) if glu else (N, 1)
    dims = (ctypes.c_uint64 * 3)(K, rows, planes)
    strides = (ctypes.c_uint64 * 2)(K * 2, rows * K * 2)
    box = (ctypes.c_uint32 * 3)(BK, bn // planes, planes)
    elem = (ctypes.c_uint32 * 3)(1, 1, 1)
    _check(
        drv.lib().cuTensorMapEncodeTiled(
            ctypes.c_void_p(addr),
            _CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            3,
            ctypes.c_void_p(w.data_ptr()),
            dims,
            strides,
            box,
            elem,
            0,
            _CU_TENSOR_MAP_SWIZZLE_128B,
            _CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            0,
        ),
        "cuTensorMapEncodeTiled",
    )
    if len(_MAPS) >= _MAPS_MAX:
        _MAPS.pop(next(iter(_MAPS)))
    _MAPS[key] = (buf, addr)
    return addr


def _workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The LAST variants' workspace and zeroed counters on `device` (made once, outside any CUDA graph capture: a
    graph's private pool would hand the memory back when the graph goes; the counters reset themselves)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _WS:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("cluster_gemm: make the workspace before capturing (one eager call first)")
        _WS[idx] = (
            torch.empty(WS_BYTES // 4, dtype=torch.float32, device=device),
            torch.zeros(COUNTERS, dtype=torch.int32, device=device),
        )
    return _WS[idx]


def launch(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    variant: str,
    split: int,
    pdl: bool = True,
    prof: torch.Tensor | None = None,
    late: bool | int = False,
    *,
    res: torch.Tensor | None = None,
    nw: torch.Tensor | None = None,
    hn: torch.Tensor | None = None,
    ssq_out: torch.Tensor | None = None,
    ssq_in: torch.Tensor | None = None,
    eps: float = 1e-6,
    glu: bool = False,
    rope: tuple | None = None,
) -> None:
    """out[:M, :N] = x @ w^T on torch's current stream (`supports(x, w, variant)` must hold; out [M, N] bf16, rows
    8-byte aligned). `prof` (a diagnostic): int64 [CTAs * PROF_POINTS], each CTA's %globaltimer stamps (ns) at
    PROF_STAMPS. `late`: the next kernel launches (PDL) once every CTA is done with its K slice, not at once;
    `late=NO_WAIT` (a diagnostic whose output is garbage): the kernel does not wait for the previous one at all.

    The folds (csrc/cluster_gemm.cu's `Epi`; `fused` checks and allocates them): `ssq_in` [tiles, >= M] fp32 —
    x is h * norm weight and row m's sums are scaled by rsqrt(ssq_in[:, m].sum() / K + eps); `glu` — w is [gate; up]
    and out [M, N/2] = silu(g) * u; `res` [M, N] — out = bf16(bf16(sums) + res); `nw` [N] with `hn` [M, N] and
    `ssq_out` [N / BN, 64] fp32 — hn = bf16(out * nw), ssq_out[tile, m] = the sum of out^2 over the tile's columns;
    `rope` (a `_rope` variant; `fused` checks it) = (positions, slots, cos, sin, k_cache, v_cache, n_heads, n_kv) — out
    [M, n_heads * d] is q rotated, k (rotated) and v go to the caches at the slots."""
    if (rope is not None) != (variant in ROPE):
        raise ValueError(f"cluster_gemm: {variant} {'needs' if variant in ROPE else 'takes no'} rope arguments")
    M, K = x.shape
    N = w.shape[0]
    bn = VARIANTS[variant][0]
    if not 1 <= split <= min(SPLIT_MAX, K // BK):
        raise ValueError(f"cluster_gemm: split {split} not in 1..{min(SPLIT_MAX, K // BK)} for K={K}")
    fn = _function(x.device, variant)
    last = variant in LAST
    ws = counters = None
    if last:
        ws, counters = _workspace(x.device)
        if (N // bn) > COUNTERS or N * split * VARIANTS[variant][2] * 4 > WS_BYTES:
            raise ValueError(f"cluster_gemm: N={N} split {split} past the {variant} workspace")
    wmap = _weight_map(w, bn, glu)
    epi = _epi(K, res, nw, hn, ssq_out, ssq_in, eps, glu)
    args = [
        ctypes.c_void_p(x.data_ptr()),
        ctypes.c_void_p(out.data_ptr()),
        ctypes.c_int(M),
        ctypes.c_int(K),
        ctypes.c_int(x.stride(0)),
        ctypes.c_int(out.stride(0)),
        ctypes.c_int(late if late == NO_WAIT else int(bool(late))),
        ctypes.c_void_p(ws.data_ptr() if last else None),
        ctypes.c_void_p(counters.data_ptr() if last else None),
        ctypes.c_void_p(prof.data_ptr() if prof is not None else None),
        epi,
    ]
    if rope is not None:
        args.append(_rope_struct(rope))
    cluster = (1, 1 if last else split, 1)
    block = 128 * VARIANTS[variant][1]
    drv.launch(
        fn, (N // bn, split, 1), block, smem_bytes(variant), cluster, pdl, [wmap, *args], x.device, "cluster_gemm"
    )


def max_active_clusters(variant: str, split: int, device: torch.device | None = None, layer: bool = False) -> int:
    """How many clusters of `split` CTAs of the variant (with `layer`: its layer kernel) the GPU holds at once
    (cuOccupancyMaxActiveClusters): a grid past that runs in more than one wave."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    fn = _function(device, variant, layer)
    split = 1 if variant in LAST else split
    cfg, _attrs = drv.launch_config(
        (1, split, 1), 128 * VARIANTS[variant][1], smem_bytes(variant, layer), (1, split, 1), False
    )
    n = ctypes.c_int()
    _check(
        drv.lib().cuOccupancyMaxActiveClusters(ctypes.byref(n), fn, ctypes.byref(cfg)), "cuOccupancyMaxActiveClusters"
    )
    return n.value


def plan_for(N: int, K: int, sms: int = 132) -> tuple[str, int]:
    """A (variant, split) for a shape: `PLANS`' measured one, else fewest waves of CTAs over the SMs, then the
    best-filled last wave, then the widest tile."""
    if (N, K) in PLANS:
        return PLANS[(N, K)]
    best, best_key = ("bn128", 1), None
    for v, (bn, _, _, _) in VARIANTS.items():
        if N % bn or K % BK or v not in ("bn64", "bn128", "bn256"):
            continue
        tiles = N // bn
        for s in range(1, min(SPLIT_MAX, K // BK) + 1):
            ctas = tiles * s
            waves = -(-ctas // sms)
            key = (-waves, ctas / (waves * sms), bn)  # one wave, then its fill, then the wider tile (x read less)
            if best_key is None or key > best_key:
                best, best_key = (v, s), key
    return best


def cluster_gemm(
    x: torch.Tensor, w: torch.Tensor, plan: tuple[str, int] | None = None, pdl: bool = True, late: bool = False
):
    """x [M, K] @ w [N, K]^T -> [M, N] bf16 through the kernel (`supports` must hold for the plan's variant)."""
    return fused(x, w, plan, pdl, late)


def fused(
    x: torch.Tensor,
    w: torch.Tensor,
    plan: tuple[str, int] | None = None,
    pdl: bool = True,
    late: bool | int = False,
    *,
    res: torch.Tensor | None = None,
    nw: torch.Tensor | None = None,
    ssq_in: torch.Tensor | None = None,
    eps: float = 1e-6,
    glu: bool = False,
    rope: tuple | None = None,
):
    """x @ w^T through the kernel with its folds (`launch`): out [M, N] ([M, N/2] with glu; [M, n_heads * d], q
    rotated, with `rope`: the plan's variant is then taken as its "_rope" sibling), or with `nw` the triple (out, hn
    [M, N], ssq_out [N / BN, 64] fp32) — a residual stream's producer hands the next norm-folding call (ssq_in=) what
    it needs. `supports(x, w, plan's variant)` must hold."""
    variant, split = plan or plan_for(w.shape[0], x.shape[1])
    if rope is not None:
        variant = _rope_variant(variant)
        why = rope_refusal(w, variant, rope)
        if why:
            raise ValueError(f"cluster_gemm: rope: {why}")
    M, K = x.shape
    N = w.shape[0]
    bn = VARIANTS[variant][0]
    if glu and (N % 2 or res is not None or nw is not None):
        raise ValueError("cluster_gemm: glu takes an even N and no res / nw")
    if res is not None and (res.shape != (M, N) or res.dtype != x.dtype or res.stride(1) != 1 or res.stride(0) % 4):
        raise ValueError(f"cluster_gemm: res must be [{M}, {N}] {x.dtype}, rows 8-byte aligned")
    if nw is not None and (nw.shape != (N,) or nw.dtype != x.dtype or not nw.is_contiguous()):
        raise ValueError(f"cluster_gemm: nw must be [{N}] {x.dtype}, contiguous")
    if ssq_in is not None and (
        ssq_in.dtype != torch.float32 or ssq_in.dim() != 2 or ssq_in.stride(1) != 1 or ssq_in.shape[1] < M
    ):
        raise ValueError(f"cluster_gemm: ssq_in must be fp32 [tiles, >= {M}] with unit column stride")
    cols = rope[6] * rope[2].shape[1] if rope is not None else N // 2 if glu else N
    out = torch.empty(M, cols, dtype=x.dtype, device=x.device)
    hn = ssq_out = None
    if nw is not None:
        hn = torch.empty(M, N, dtype=x.dtype, device=x.device)
        ssq_out = torch.empty(N // bn, ROWS_MAX, dtype=torch.float32, device=x.device)
    launch(x, w, out, variant, split, pdl, late=late, res=res, nw=nw, hn=hn, ssq_out=ssq_out, ssq_in=ssq_in, eps=eps,
           glu=glu, rope=rope)  # fmt: skip
    return out if nw is None else (out, hn, ssq_out)


class _LayerArgs(ctypes.Structure):
    """csrc/cluster_gemm.cu's `LayerArgs` (the layer kernel's attention and o arguments), passed by value."""

    _fields_ = [
        ("mask", ctypes.c_void_p),
        ("mask_st", ctypes.c_longlong),
        ("mask_s", ctypes.c_int),
        ("G", ctypes.c_int),
        ("n_kv", ctypes.c_int),
        ("chunks", ctypes.c_int),
        ("parts", ctypes.c_int),
        ("scale", ctypes.c_float),
        ("attn", ctypes.c_void_p),
        ("lda", ctypes.c_int),
        ("part", ctypes.c_void_p),
        ("ml", ctypes.c_void_p),
        ("flags", ctypes.c_void_p),
        ("ko", ctypes.c_int),
    ]


_LAYER_WS: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def layer_items(variant: str, split: int, G: int, M: int) -> tuple[int, int]:
    """The layer kernel's attention items a KV head, (chunks C, row parts): its (G + 2) split CTAs, the G x M rows in
    parts of at most one round of the CTA's warps (m16 row tiles), the keys in as many chunks as the CTAs allow."""
    warps = 4 * VARIANTS[variant][1]
    row_tiles = -(-G * M // 16)
    parts = -(-row_tiles // warps)
    return (G + 2) * split // parts, parts


def layer_workspace(
    device: torch.device, nkv: int, items: int, d: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer kernel's partials [nkv, items, LAYER_ROWS, d] and (m, l) [.., 2] fp32 (`items`: (G + 2) split, room
    for every chunk count) and its zeroed counters [4, nkv] int32: one set for every layer of a shape (a layer's
    kernel touches them only after its PDL wait, when the previous layer's kernel has finished with them, and leaves
    the counters at zero; so layer kernels of one shape must not run on two streams at once), made once outside any
    CUDA graph capture (one eager call first)."""
    key = (drv.device_index(device), nkv, items, d)
    hit = _LAYER_WS.get(key)
    if hit is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "cluster_gemm: make the layer kernel's workspace before capturing (one eager call first)"
            )
        f32 = dict(dtype=torch.float32, device=device)
        hit = _LAYER_WS[key] = (
            torch.empty(nkv, items, LAYER_ROWS, d, **f32),
            torch.empty(nkv, items, LAYER_ROWS, 2, **f32),
            torch.zeros(4, nkv, dtype=torch.int32, device=device),
        )
    return hit


@functools.cache
def _layer_clusters(variant: str, split: int, device_index: int) -> int:
    """max_active_clusters of the layer kernel (asked once: `layer_refusal` runs at every eager call)."""
    return max_active_clusters(variant, split, torch.device("cuda", device_index), layer=True)


def layer_refusal(x, w_qkv, w_o, plan: tuple[str, int], rope: tuple, mask: torch.Tensor) -> str:
    """Why `layer_qkv_attn_o` cannot take a layer ('' when it can): the plan's variant in LAYER, a tile one head, o
    square over the q columns (o's tiles are the q tiles' CTAs), G x M rows within LAYER_ROWS, a [M, S] bool mask with
    contiguous rows over at most the cache, and every CTA resident at once (its counters' waits would deadlock)."""
    variant, split = plan
    M = x.shape[0]
    nh, nkv, d, kc = rope[6], rope[7], rope[2].shape[1], rope[4]
    if variant not in LAYER:
        return f"no layer kernel for {variant} (only {sorted(LAYER)})"
    bn, _, ntok, _ = VARIANTS[variant]
    if bn != d or nh % nkv or w_qkv.shape[0] != (nh + 2 * nkv) * d:
        return f"one head a tile (BN {bn}, head size {d}), n_heads a multiple of n_kv"
    if tuple(w_o.shape) != (nh * d, nh * d):
        return f"o must be [{nh * d}, {nh * d}] (its tiles are the q tiles' CTAs), not {tuple(w_o.shape)}"
    if not 1 <= split <= min(SPLIT_MAX, x.shape[1] // BK, nh * d // BK):
        return f"split {split} not in 1..{min(SPLIT_MAX, x.shape[1] // BK, nh * d // BK)}"
    if M > ntok or (nh // nkv) * M > LAYER_ROWS:
        return f"{M} rows: more than {ntok}, or G x M past {LAYER_ROWS}"
    if layer_items(variant, split, nh // nkv, M)[0] < 1:
        return f"{(nh // nkv + 2) * split} CTAs a KV head: too few for its {nh // nkv} x {M} rows' parts"
    if mask.dtype != torch.bool or mask.dim() != 2 or mask.shape[0] != M or mask.stride(1) != 1:
        return "mask [M, S] bool with contiguous rows"
    if mask.shape[1] > kc.shape[2]:
        return "mask wider than the cache"
    if not supports(x, w_qkv, variant) or not supports(x, w_o, variant):
        return "the kernel does not take x or the weights (device, dtype, shape)"
    clusters = w_qkv.shape[0] // bn
    if _layer_clusters(variant, split, drv.device_index(x.device)) < clusters:
        return f"{clusters} clusters of {split}: not all resident at once"
    return ""


def layer_qkv_attn_o(
    hn: torch.Tensor,
    w_qkv: torch.Tensor,
    ssq: torch.Tensor,
    eps: float,
    rope: tuple,
    mask: torch.Tensor,
    scale: float,
    w_o: torch.Tensor,
    h: torch.Tensor,
    nw: torch.Tensor,
    plan: tuple[str, int] = ("bn128_half", 4),
    pdl: bool = True,
    prof: torch.Tensor | None = None,
    check: bool = True,
):
    """A layer's q/k/v (its norm folded: hn = h * norm weight, `ssq` the sums of squares, as `fused(ssq_in=)`), RoPE
    and the cache writes (`rope`, as `fused(rope=)`), the attention over the caches (`mask` [M, S] bool) and o with
    the residual (h + attn @ w_o^T, and the next norm's inputs with `nw`) in one launch (experimental; slower than
    the three launches on the H200: docs/LOG.md, twenty-eighth session). Returns (q, attn, h_out, hn_out, ssq_out) —
    what `fused` gives for q/k/v, `kernels.rows_attention` for the attention and `fused(res=, nw=)` for o.
    `layer_refusal` must be '' (`check=False`: the caller has asked it). `prof` (a diagnostic): int64 [CTAs *
    (len(PROF_STAMPS) + len(LAYER_STAMPS))], the q/k/v unit's stamps for every CTA, then the phases' (LAYER_STAMPS)."""
    variant, split = plan
    why = layer_refusal(hn, w_qkv, w_o, plan, rope, mask) if check else ""
    if why:
        raise ValueError(f"cluster_gemm: layer kernel: {why}")
    M, K = hn.shape
    nh, nkv, d = rope[6], rope[7], rope[2].shape[1]
    bn = VARIANTS[variant][0]
    H = w_o.shape[0]
    chunks, parts = layer_items(variant, split, nh // nkv, M)
    part, ml, flags = layer_workspace(hn.device, nkv, (nh // nkv + 2) * split, d)
    q = torch.empty(M, nh * d, dtype=hn.dtype, device=hn.device)
    attn = torch.empty(M, nh * d, dtype=hn.dtype, device=hn.device)
    h_out = torch.empty(M, H, dtype=hn.dtype, device=hn.device)
    hn_out = torch.empty(M, H, dtype=hn.dtype, device=hn.device)
    ssq_out = torch.empty(H // bn, ROWS_MAX, dtype=torch.float32, device=hn.device)
    la = _LayerArgs(
        mask.data_ptr(), mask.stride(0), mask.shape[1], nh // nkv, nkv, chunks, parts, float(scale), attn.data_ptr(),
        attn.stride(0), part.data_ptr(), ml.data_ptr(), flags.data_ptr(), nh * d,
    )  # fmt: skip
    args = [
        _weight_map(w_qkv, bn),
        _weight_map(w_o, bn),
        ctypes.c_void_p(hn.data_ptr()),
        ctypes.c_void_p(q.data_ptr()),
        ctypes.c_int(M),
        ctypes.c_int(K),
        ctypes.c_int(hn.stride(0)),
        ctypes.c_int(q.stride(0)),
        ctypes.c_void_p(h_out.data_ptr()),
        ctypes.c_int(h_out.stride(0)),
        ctypes.c_void_p(prof.data_ptr() if prof is not None else None),
        _epi(K, ssq_in=ssq, eps=eps),
        _rope_struct(rope),
        _epi(nh * d, res=h, nw=nw, hn=hn_out, ssq_out=ssq_out),
        la,
    ]
    drv.launch(
        _function(hn.device, variant, layer=True), (w_qkv.shape[0] // bn, split, 1), 128 * VARIANTS[variant][1],
        smem_bytes(variant, layer=True), (1, split, 1), pdl, args, hn.device, "cluster_gemm",
    )  # fmt: skip
    return q, attn, h_out, hn_out, ssq_out


def _rope_variant(variant: str) -> str:
    """The `_rope` sibling of a plan's variant (which may not exist: `rope_refusal` says so)."""
    return variant if variant in ROPE else variant + "_rope"


def rope_refusal(w: torch.Tensor, variant: str, rope: tuple) -> str:
    """Why the `_rope` variant cannot take this q/k/v projection ('' when it can): whole heads a tile, the caches
    [1, n_kv, len, d] contiguous per head, int64 positions and slots, cos / sin [len, d] in the weights' dtype."""
    pos, slots, cos, sin, kc, vc, nh, nkv = rope
    d = cos.shape[1]
    if variant not in ROPE:
        return f"no {variant} instance"
    if VARIANTS[variant][0] % d or d % 8 or w.shape[0] != (nh + 2 * nkv) * d:
        return f"head size {d} must divide the tile ({VARIANTS[variant][0]}) and N = (n_heads + 2 n_kv) d"
    if pos.dtype != torch.int64 or slots.dtype != torch.int64 or cos.dtype != w.dtype or sin.dtype != w.dtype:
        return "positions / slots int64, cos / sin in the weights' dtype"
    for c in (kc, vc):
        if c.dim() != 4 or c.shape[0] != 1 or c.shape[1] != nkv or c.shape[3] != d or c.stride(3) != 1:
            return "caches [1, n_kv, len, d] with unit stride over d"
        if c.stride(2) != d or c.stride(1) != kc.stride(1) or c.dtype != w.dtype:
            return "caches with rows d apart and one head stride, in the weights' dtype"
    if not (cos.is_contiguous() and sin.is_contiguous() and pos.is_contiguous() and slots.is_contiguous()):
        return "contiguous positions, slots, cos and sin"
    return ""


def norm_inputs(h: torch.Tensor, nw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a producer's folds give, from h in torch (the first layer's, whose h is the embedding): hn = h * nw in
    h's dtype and the rows' sums of squares as one tile [1, M] fp32."""
    return h * nw, h.float().square().sum(-1)[None]


def _ssq_tiles(N: int, variant: str) -> int:
    return max(1, N // VARIANTS[variant][0])


@torch.library.custom_op("draftsmith::cluster_gemm_produce", mutates_args=())
def cluster_gemm_produce_op(
    x: torch.Tensor, w: torch.Tensor, res: torch.Tensor, nw: torch.Tensor, variant: str, split: int, pdl: bool,
    late: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """A residual stream's producer (o, down): h = res + x @ w^T (rounded as `linear_add`), hn = h * nw (the next
    RMSNorm's x, its weight applied) and h's sums of squares per output tile [N / BN, 64] — what
    `cluster_gemm_normed_op` takes in place of the norm. Torch's ops where the kernel does not take x."""
    if supports(x, w, variant):
        return fused(x, w, (variant, split), pdl, late, res=res, nw=nw)
    h = res + torch.nn.functional.linear(x, w)
    # (a forward wider than the kernel's rows — a prefill chunk — hands on the sums of all its rows)
    ssq = torch.zeros(_ssq_tiles(w.shape[0], variant), _ssq_width(x), dtype=torch.float32, device=x.device)
    hn, ssq[0, : x.shape[0]] = norm_inputs(h, nw)
    return h, hn, ssq


def _ssq_width(x: torch.Tensor):
    return torch.sym_max(x.shape[0], ROWS_MAX)


@cluster_gemm_produce_op.register_fake
def _(x, w, res, nw, variant, split, pdl, late):
    M, N = x.shape[0], w.shape[0]
    return x.new_empty(M, N), x.new_empty(M, N), x.new_empty(_ssq_tiles(N, variant), _ssq_width(x), dtype=torch.float32)


@torch.library.custom_op("draftsmith::cluster_gemm_normed", mutates_args=())
def cluster_gemm_normed_op(
    x: torch.Tensor, w: torch.Tensor, ssq: torch.Tensor, eps: float, glu: bool, variant: str, split: int, pdl: bool,
    late: bool,
) -> torch.Tensor:  # fmt: skip
    """RMSNorm(h) @ w^T from x = h * norm weight and h's tile sums of squares `ssq` [tiles, >= M] (a producer's, or
    `norm_inputs`'); with glu (w = [gate; up]) silu(g) * u [M, N/2]. Torch's ops where the kernel does not take x."""
    if supports(x, w, variant):
        return fused(x, w, (variant, split), pdl, late, ssq_in=ssq, eps=eps, glu=glu)
    rstd = torch.rsqrt(ssq[:, : x.shape[0]].sum(0) / x.shape[1] + eps)[:, None]
    y = (torch.nn.functional.linear(x, w).float() * rstd).to(x.dtype)
    if not glu:
        return y
    g, u = y.chunk(2, -1)
    return torch.nn.functional.silu(g) * u


@cluster_gemm_normed_op.register_fake
def _(x, w, ssq, eps, glu, variant, split, pdl, late):
    return x.new_empty(x.shape[0], w.shape[0] // 2 if glu else w.shape[0])


def rope_rows(y: torch.Tensor, positions, slots, cos, sin, kc, vc, nh: int, nkv: int) -> torch.Tensor:
    """RoPE and the cache writes in torch (the fallback where the kernel does not run): y [M, (nh + 2 nkv) d] q/k/v ->
    q [M, nh * d]; k (rotated) and v written to the caches at `slots`. Rounded as torch's bf16 ops round
    (bf16(bf16(x cos) + bf16(x' sin)), torch's own rope_cache); on the GPU the `_rope` instances round as triton's
    compiled `kernels.rope_and_cache` does, x cos fused into the add (docs/LOG.md, twenty-fifth session)."""
    M, d = y.shape[0], cos.shape[1]
    y = y.view(M, nh + 2 * nkv, d)
    qk, v = y[:, : nh + nkv], y[:, nh + nkv :]
    c, s = cos.index_select(0, positions)[:, None], sin.index_select(0, positions)[:, None]
    rot = (qk * c) + (_rotate_half(qk) * s)  # bf16 * bf16 rounds each product; the sum rounds again
    kc[0].index_copy_(1, slots, rot[:, nh:].transpose(0, 1))
    vc[0].index_copy_(1, slots, v.transpose(0, 1))
    return rot[:, :nh].reshape(M, nh * d).contiguous()


@torch.library.custom_op("draftsmith::cluster_gemm_qkv_rope", mutates_args=("kc", "vc"))
def cluster_gemm_qkv_rope_op(
    x: torch.Tensor, w: torch.Tensor, ssq: torch.Tensor, eps: float, positions: torch.Tensor, slots: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, nh: int, nkv: int, variant: str,
    split: int, pdl: bool, late: bool,
) -> torch.Tensor:  # fmt: skip
    """`cluster_gemm_normed_op` for q/k/v with RoPE and the cache writes folded in (the `_rope` sibling of the plan's
    variant): q [M, nh * d] rotated; k and v written to this layer's caches. Torch's ops where the kernel does not
    take x (`rope_rows` after the normed fallback)."""
    rope = (positions, slots, cos, sin, kc, vc, nh, nkv)
    rv = _rope_variant(variant)
    if rv in VARIANTS and supports(x, w, rv) and not rope_refusal(w, rv, rope):
        return fused(x, w, (rv, split), pdl, late, ssq_in=ssq, eps=eps, rope=rope)
    y = cluster_gemm_normed_op(x, w, ssq, eps, False, variant, split, pdl, late)
    return rope_rows(y, positions, slots, cos, sin, kc, vc, nh, nkv)


@cluster_gemm_qkv_rope_op.register_fake
def _(x, w, ssq, eps, positions, slots, cos, sin, kc, vc, nh, nkv, variant, split, pdl, late):
    return x.new_empty(x.shape[0], nh * cos.shape[1])


@torch.library.custom_op("draftsmith::cluster_gemm_layer", mutates_args=("kc", "vc"))
def cluster_gemm_layer_op(
    x: torch.Tensor, w: torch.Tensor, ssq: torch.Tensor, eps: float, positions: torch.Tensor, slots: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, mask: torch.Tensor, scale: float,
    nh: int, nkv: int, wo: torch.Tensor, h: torch.Tensor, nw: torch.Tensor, variant: str, split: int, o_variant: str,
    o_split: int, pdl: bool, late: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """A layer's q/k/v (norm folded), RoPE and cache writes, attention (`mask` [M, S] bool) and o with the residual
    (and the next norm's inputs, `nw`) in one launch, `layer_qkv_attn_o` on the q/k/v plan (KernelConfig.cluster_gemm_
    layer; experimental): (q, attention, h, hn, ssq). Where it does not take the layer (`layer_refusal`, or o's plan
    on another tile width): `cluster_gemm_qkv_rope_op`, `kernels.rows_attention`, `cluster_gemm_produce_op` on o's
    plan."""
    rope = (positions, slots, cos, sin, kc, vc, nh, nkv)
    if (
        variant in LAYER
        and VARIANTS[o_variant][0] == VARIANTS[variant][0]  # (the sums-of-squares tiles o's plan would give)
        and not layer_refusal(x, w, wo, (variant, split), rope, mask)
    ):
        return layer_qkv_attn_o(x, w, ssq, eps, rope, mask, scale, wo, h, nw, (variant, split), pdl, check=False)
    from draftsmith.decode import kernels as K

    q = cluster_gemm_qkv_rope_op(x, w, ssq, eps, positions, slots, cos, sin, kc, vc, nh, nkv, variant, split, pdl, late)
    a = K.rows_attention(q.view(q.shape[0], nh, cos.shape[1]), kc, vc, mask, scale, slots)
    return (q, a, *cluster_gemm_produce_op(a, wo, h, nw, o_variant, o_split, pdl, late))


@cluster_gemm_layer_op.register_fake
def _(x, w, ssq, eps, positions, slots, cos, sin, kc, vc, mask, scale, nh, nkv, wo, h, nw, variant, split, o_variant,
      o_split, pdl, late):  # fmt: skip
    M, H, cols = x.shape[0], wo.shape[0], nh * cos.shape[1]
    return (
        x.new_empty(M, cols), x.new_empty(M, cols), x.new_empty(M, H), x.new_empty(M, H),
        x.new_empty(_ssq_tiles(H, o_variant), _ssq_width(x), dtype=torch.float32),
    )  # fmt: skip


@torch.library.custom_op("draftsmith::cluster_gemm", mutates_args=())
def cluster_gemm_op(x: torch.Tensor, w: torch.Tensor, variant: str, split: int, pdl: bool, late: bool) -> torch.Tensor:
    """x @ w^T through the kernel with plan (variant, split) — a torch op, so a compiled forward calls it (inductor
    keeps it whole) and a CUDA graph captures its launch; F.linear where the kernel does not take x (the caller
    checked `supports` on x's traced metadata; a strided view can still arrive)."""
    if not supports(x, w, variant):
        return torch.nn.functional.linear(x, w)
    return cluster_gemm(x, w, (variant, split), pdl, late)


@cluster_gemm_op.register_fake
def _(x, w, variant, split, pdl, late):
    return x.new_empty(x.shape[0], w.shape[0])


__all__ = [
    "cluster_gemm_layer_op",
    "LAYER",
    "layer_qkv_attn_o",
    "layer_refusal",
    "cluster_gemm_normed_op",
    "cluster_gemm_produce_op",
    "cluster_gemm_qkv_rope_op",
    "ROPE",
    "rope_refusal",
    "rope_rows",
    "fused",
    "norm_inputs",
    "N_MAX",
    "PLANS",
    "cluster_gemm_op",
    "PROF_STAMPS",
    "BK",
    "PTX",
    "VARIANTS",
    "cluster_gemm",
    "launch",
    "max_active_clusters",
    "plan_for",
    "smem_bytes",
    "supports",
]
