"""Pull a weight matrix into the GPU's L2 cache ahead of the matmul that reads it, while latency-bound kernels run.

The idea (issue 16, the 8B verify at 1.24-1.27 plain steps): per layer ~25 us go to kernels that barely touch HBM
(RoPE and the cache writes, the attention and its combine, the norms, silu), and a bulk L2 prefetch
(`cp.async.bulk.prefetch.L2.global`, sm_90+) issued as RoPE starts could move the o projection's 32 MB (the H200's L2
holds 50 MB) in that window. Measured (`bench/l2_prefetch.py`, BENCHMARKS.md "a bulk L2 prefetch of the o
projection", 2026-12-03): the o matmul with its weights already in L2 takes 9.9 us against 11.8 us from HBM —
cuBLAS's 49-row kernels are bound by how fast each CTA streams, not by HBM — and a prefetch on a second stream beside
a 15 us window saves 1.2-1.4 us a layer at best (a gate/up head: nothing), under the run-to-run spread of a verify.
So no engine path takes it; the kernel stays as the benchmark's instrument.

`l2_prefetch(tensors, nbytes)` launches one small kernel per tensor (the first `nbytes[i]` bytes of each; the
tensors' storage contiguous): the programs issue their copies and exit.
"""

from __future__ import annotations

import torch

from draftsmith.decode.kernels import _pdl, gdc_launch_dependents, gdc_wait, tl, triton

# Bytes per prefetch instruction, and instructions per program. An SM issues bulk prefetches at ~290 GB/s (the lanes
# of a program take turns: the instruction's operands are uniform registers) and sizes of 1 MB did nothing measurable
# (bench/l2_prefetch.py, 2026-12-03), so 32 MB is spread as one 256 KB chunk over each of 128 programs.
CHUNK_BYTES = 256 * 1024
PER_PROGRAM = 1

if triton is not None:

    @triton.jit
    def _l2_prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, PER: tl.constexpr, USE_PDL: tl.constexpr):
        if USE_PDL:
            # the copies read no kernel's output, but they should not compete with the matmul before them for HBM
            gdc_launch_dependents()
            gdc_wait()
        lane = tl.arange(0, 32)  # one warp; lanes past PER issue nothing
        c = (tl.program_id(0) * PER + lane).to(tl.int64)
        start = c * CHUNK
        size = tl.minimum(tl.maximum(nbytes - start, 0), CHUNK)
        size = tl.where(lane < PER, size, 0).to(tl.int32)
        # a lane with size 0 issues nothing (the copy's size must be a positive multiple of 16)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r",
            [ptr + start, size],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


def supported(device: torch.device) -> bool:
    """Bulk L2 prefetch needs CUDA sm_90+ and triton."""
    return triton is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def l2_prefetch(
    tensors: list[torch.Tensor],
    nbytes: list[int],
    pdl: bool = True,
    chunk: int = CHUNK_BYTES,
    per_program: int = PER_PROGRAM,
) -> None:
    """Ask L2 for the first nbytes[i] bytes of tensors[i] (each contiguous; sizes rounded down to 16 bytes): one
    launch per tensor, `per_program` chunks of `chunk` bytes a program (1-32)."""
    if not 1 <= per_program <= 32:
        raise ValueError(f"l2_prefetch: per_program {per_program} is not in 1..32")
    for t, n in zip(tensors, nbytes):
        if not t.is_contiguous():
            raise ValueError("l2_prefetch: the tensor must be contiguous")
        n = min(int(n), t.numel() * t.element_size()) // 16 * 16
        if n <= 0:
            continue
        flat = t.view(-1).view(torch.uint8)
        progs = -(-n // (chunk * per_program))
        _l2_prefetch_kernel[(progs,)](flat, n, CHUNK=chunk, PER=per_program, num_warps=1, **_pdl(t, pdl))


__all__ = ["CHUNK_BYTES", "PER_PROGRAM", "l2_prefetch", "supported"]
