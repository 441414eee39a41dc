"""The decode kernels' tooling, each in a subprocess: bench/decode_kernels.py's Triton rows in the interpreter, and
bench/kernels_aot.py's ahead-of-time compile for the H200 (no GPU needed). Apart from test_decode_kernels.py so the
test runner can put these two slow ones (~2 min each) on the other worker."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="on a GPU machine the GPU bench runs; triton 3.6's interpreter fails on the tiny CPU shape",
)
def test_bench_decode_kernels_triton_smoke(tmp_path):
    """bench/decode_kernels.py --gemv torch,triton runs the Triton rows and the per-matrix table (tiny shape)."""
    import json
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parents[3])
    # --smoke runs on CPU tensors, also on a GPU machine: the kernels there need the interpreter
    env = dict(
        os.environ,
        OUT=str(tmp_path),
        OMP_NUM_THREADS="1",
        DRAFTSMITH_BENCHMARKS=str(tmp_path / "B.md"),
        TRITON_INTERPRET="1",
    )
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(root, "bench", "decode_kernels.py"),
            "--smoke",
            "--compile",
            "off",
            "--impls",
            "sdpa",
            "--gemv",
            "torch,triton",
            "--attn-sweep",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "decode_kernels.json").read_text())
    assert {row["gemv"] for row in res["rows"]} == {"torch", "triton"}
    assert all("triton us/matrix" in m for m in res["per_matrix"])
    assert {r["cache S"] for r in res["attn_sweep"]} == {r["cache S"] for r in res["rows"]}  # every plan, each S


def _aot(tmp_path, *args: str) -> tuple[list[dict], int]:
    """bench/kernels_aot.py's rows (and its exit code) for these arguments, run in a subprocess (the interpreter mode
    of this file's other tests replaces the kernels in-process)."""
    import json
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    root = str(Path(__file__).resolve().parents[3])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # a cache of its own that outlives the run (~2 min of compiles cold, seconds warm): Triton keys each binary by
    # its source, constants, target and compiler version, so a changed kernel compiles afresh
    cache = os.environ.get("DRAFTSMITH_AOT_CACHE") or os.path.join(Path.home(), ".cache", "draftsmith", "triton-aot")
    env["TRITON_CACHE_DIR"] = cache
    out = tmp_path / "aot.json"
    r = subprocess.run(
        [sys.executable, os.path.join(root, "bench", "kernels_aot.py"), *args, "--json", str(out)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.exists(), r.stderr[-2000:]
    return json.loads(out.read_text()), r.returncode


def test_kernels_compile_for_the_gpu_without_spills(tmp_path):
    """Every kernel a decode step launches compiles ahead of time for sm_90 (the H200) with the 8B shape's
    constants, without local memory (register spills), and the gemv and attention read memory with 16-byte vector
    loads. No GPU needed (bench/kernels_aot.py)."""
    rows, rc = _aot(tmp_path, "--only", "")
    from draftsmith.decode import kernels as K

    n_attn = len({(bs, nw) for bs, _, nw in K.ATTN_CONFIGS})
    # gemv: every tile with PDL (on by default on sm_90), the default tile also without; a drafter's first-layer qkv
    # (embed) and the RoPE-folded qkv at the default tile those two ways; the lm_head with the argmax epilogue at the tiles whose partials
    # one program reduces (128,256 outputs); the others with and without PDL
    n_argmax = sum(1 for t in K.GEMV_CONFIGS if -(-128256 // t[0]) <= K.ARGMAX_MAX_PROGRAMS) + 1
    assert n_argmax > 1
    # (+ 2: the q/k/v gemv with the RoPE epilogue at the default tile; the row kernels: five kinds, q/k/v with
    # RoPE among them, at the three default variants; + 1 + 1: both attention kernels' live-key split)
    assert len(rows) == 7 * (len(K.GEMV_CONFIGS) + 1) + 2 + 2 + n_argmax + 5 * 3 + 4 + 3 * n_attn + 1 + 4 + 1 + 4 + 3
    pdl = [row for row in rows if " pdl" in row["kernel"]]
    assert pdl and all(row["griddepcontrol"] >= 2 for row in pdl), pdl  # launch_dependents + wait in the binary
    bad = [row for row in rows if row["error"] or row["local B"] != 0]
    assert not bad, bad
    # 16-byte loads: as vector loads into registers, or as the async copies of a pipelined tl.dot loop
    assert all(
        row["v4 loads"] > 0 or row["cp.async"] > 0
        for row in rows
        if row["kernel"].startswith(("gemv", "gemm_rows", "decode_attention split", "rows_attention"))
    )
    assert rc == 0


def test_every_rows_tile_the_tuner_may_pick_compiles(tmp_path):
    """`tune_rows` times every tile of `KernelConfig.rows_sweep` and silently skips one that does not compile (a GPU
    without the resources for it): a tile that compiles nowhere is lost without a word. On 2026-12-02 every CUDA-core
    (FMA) tile failed so on the H200 and the tuner measured none of them. Here each compiles for sm_90 on a small
    target's shape (its K one block for the wide tiles: the single-pass norm) without spills."""
    from draftsmith.decode.kernel_config import KernelConfig

    rows, _ = _aot(tmp_path, "--shape", "tiny", "--rows-sweep", "--only", "gemm_rows")
    fma_tiles = sum(1 for t in KernelConfig().rows_sweep if t[0] < 16)
    # every CUDA-core tile, for each of the four matrices of a layer
    assert fma_tiles and len({row["kernel"] for row in rows if row["kernel"].endswith(" fma")}) == 4 * fma_tiles
    bad = [row for row in rows if row["error"] or row["local B"] != 0]
    assert not bad, bad


def test_mma_chain_reads_dependent_mmas_from_sass():
    """bench/kernels_aot.py --sass: the longest run of HMMAs each taking the previous one's result as its
    accumulator (one tl.dot over a K block), beside independent chains (`KernelConfig.rows_k_chains`'s batched
    dot) and Hopper's asynchronous HGMMA (counted, not chained)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
    from kernels_aot import mma_chain

    one_chain = "\n".join(
        f"        /*{i:04x}*/                   HMMA.16816.F32.BF16 R{10 + i}, R80.reuse, R2, {'RZ' if i == 0 else f'R{9 + i}'} ;"
        for i in range(6)
    )
    assert mma_chain(one_chain) == (6, 6)
    two = """
        HMMA.16816.F32.BF16 R84, R80.reuse, R28, RZ ;
        HMMA.16816.F32.BF16 R80, R80, R36, RZ ;
        HMMA.16816.F32.BF16 R28, R72.reuse, R30, R84 ;
        HMMA.16816.F32.BF16 R80, R72, R38, R80 ;
        HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
    """
    assert mma_chain(two) == (5, 2)
    assert mma_chain("") == (0, 0)
