"""`cluster_attention`: the attention of a wide forward (a tree verify's T tokens, each with its own mask row) in one
CUDA launch — the live keys split into chunks, one CTA each, the chunks of a 64-row block a thread-block cluster that
combines their partial softmaxes through distributed shared memory (`csrc/cluster_attention.cu` says how and why).
Same contract as `kernels.rows_attention` with slots: q [T, nh, d] (d 64 or 128), caches [1, nkv, max_len, d], mask
[T, S] bool, slots [T] -> [T, nh * d]. Shipped as PTX, launched through `cuda_driver` on torch's current stream
(CUDA graphs capture it); `KernelConfig(cluster_attention=True)` routes a wide forward's attention here on sm_90."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from draftsmith.decode.experimental import cuda_driver as drv

PTX = Path(__file__).resolve().parent / "csrc" / "cluster_attention.ptx"
ROWS = 64  # (token, query head) rows a CTA
BS = 64  # keys a block
CHUNKS = (1, 2, 4, 8)  # CTAs a cluster (8: the portable cluster size)
HEAD_DIMS = (64, 128)
KSPLITS = (1, 2, 4)  # warps a row group (each a share of a key block's keys): 128 * KSPLIT threads a CTA
KSPLIT_DEFAULT = 2


class _AttnArgs(ctypes.Structure):
    """csrc/cluster_attention.cu's `AttnArgs`, passed by value."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("q_st", ctypes.c_longlong),
        ("q_sh", ctypes.c_longlong),
        ("kc", ctypes.c_void_p),
        ("vc", ctypes.c_void_p),
        ("head_stride", ctypes.c_longlong),
        ("mask", ctypes.c_void_p),
        ("mask_st", ctypes.c_longlong),
        ("slots", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("T", ctypes.c_int),
        ("S", ctypes.c_int),
        ("G", ctypes.c_int),
        ("nh", ctypes.c_int),
        ("scale", ctypes.c_float),
        ("flags", ctypes.c_int),
    ]


def smem_bytes(d: int, ksplit: int = 1) -> int:
    """Q, then a 2-stage ring of K and V blocks (the combine's inbox after); or, if larger, the key groups' merge
    buffer over both."""
    return max(ROWS * d * 2 + 2 * 2 * BS * d * 2, (ksplit - 1) * ROWS * d * 4)


def _function(device: torch.device, d: int, ksplit: int) -> ctypes.c_void_p:
    names = {f"cluster_attention_d{e}_k{k}": smem_bytes(e, k) for e in HEAD_DIMS for k in KSPLITS}
    return drv.functions(device, PTX, names, "cluster_attention")[f"cluster_attention_d{d}_k{ksplit}"]


def refusal(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor, slots) -> str:
    """Why the kernel does not take these arguments ('' when it does): CUDA sm_90+, bf16, head_dim 64 or 128, batch-1
    caches with contiguous rows, q's rows 16-byte aligned, a bool mask with contiguous rows, one int64 slot a token."""
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] < 9:
        return "not CUDA sm_90+"
    T, nh, d = q.shape
    if q.dtype != torch.bfloat16 or k_cache.dtype != torch.bfloat16 or v_cache.dtype != torch.bfloat16:
        return "not bf16"
    if d not in HEAD_DIMS or k_cache.dim() != 4 or k_cache.shape[0] != 1 or k_cache.shape[3] != d:
        return f"head_dim {d} (64 or 128) or caches {tuple(k_cache.shape)} (1, nkv, max_len, d)"
    if nh % k_cache.shape[1] or v_cache.stride() != k_cache.stride() or v_cache.shape != k_cache.shape:
        return "heads not a multiple of the KV heads, or K and V laid out differently"
    if k_cache.stride(3) != 1 or k_cache.stride(2) != d or q.stride(2) != 1 or q.stride(0) % 8 or q.stride(1) % 8:
        return "rows not contiguous or not 16-byte aligned"
    if mask.dtype != torch.bool or mask.dim() != 2 or mask.shape[0] != T or mask.stride(1) != 1:
        return "mask not [T, S] bool with contiguous rows"
    if mask.shape[1] > k_cache.shape[2]:
        return "mask wider than the cache"
    if slots is None or slots.dtype != torch.int64 or slots.shape != (T,):
        return "slots not [T] int64"
    return ""


def chunks_for(T: int, G: int, nkv: int, S: int, sms: int = 132) -> int:
    """The chunk count (CTAs a cluster) of the default rule: the most in `CHUNKS` whose grid is one wave over `sms`
    SMs, at most one per 64 keys of the mask's width."""
    blocks = nkv * -(-(T * G) // ROWS)
    best = 1
    for c in CHUNKS:
        if blocks * c <= sms and c <= max(1, S // BS):
            best = c
    return best


def launch(
    q,
    k_cache,
    v_cache,
    mask,
    slots,
    scale: float,
    out: torch.Tensor,
    chunks: int,
    pdl: bool = True,
    ksplit: int = 0,
    flags: int = 0,
) -> None:
    """out [T, nh, d] = the attention (`refusal` must be '' for the arguments; `chunks` in `CHUNKS`, `ksplit` in
    `KSPLITS` or 0: KSPLIT_DEFAULT). flags 1 (a diagnostic): no keys read (out is garbage)."""
    ksplit = ksplit or KSPLIT_DEFAULT
    if chunks not in CHUNKS or ksplit not in KSPLITS:
        raise ValueError(f"cluster_attention: chunks {chunks} not in {CHUNKS} or ksplit {ksplit} not in {KSPLITS}")
    T, nh, d = q.shape
    nkv = k_cache.shape[1]
    G = nh // nkv
    args = _AttnArgs(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_cache.stride(1),
        mask.data_ptr(),
        mask.stride(0),
        slots.data_ptr(),
        out.data_ptr(),
        T,
        mask.shape[1],
        G,
        nh,
        float(scale),
        flags,
    )
    grid = (nkv, -(-(T * G) // ROWS), chunks)
    fn = _function(q.device, d, ksplit)
    drv.launch(
        fn, grid, 128 * ksplit, smem_bytes(d, ksplit), (1, 1, chunks), pdl, [args], q.device, "cluster_attention"
    )


def cluster_attention(
    q, k_cache, v_cache, mask, slots, scale: float, chunks: int = 0, pdl: bool = True, ksplit: int = 0, flags: int = 0
):
    """[T, nh * d] (`refusal` must be ''); chunks 0: `chunks_for`'s; ksplit 0: KSPLIT_DEFAULT."""
    T, nh, d = q.shape
    c = chunks or chunks_for(T, nh // k_cache.shape[1], k_cache.shape[1], mask.shape[1])
    out = torch.empty(T, nh, d, dtype=q.dtype, device=q.device)
    launch(q, k_cache, v_cache, mask, slots, scale, out, c, pdl, ksplit, flags)
    return out.view(T, nh * d)


@torch.library.custom_op("draftsmith::cluster_attention", mutates_args=())
def cluster_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    mask: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    chunks: int,
    pdl: bool,
    ksplit: int = 0,
) -> torch.Tensor:
    """`cluster_attention` as a torch operator (a compiled forward calls it between inductor's kernels)."""
    return cluster_attention(q, k_cache, v_cache, mask, slots, scale, chunks, pdl, ksplit)


@cluster_attention_op.register_fake
def _(q, k_cache, v_cache, mask, slots, scale, chunks, pdl, ksplit=0):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
