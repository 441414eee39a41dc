"""bench/decode_small.py on the CPU (the bundled target and drafter, tiny settings): every section's code path runs,
the speed rows carry the engine switches' columns (lookahead off, graphed prefill) and the census comparison."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(
    not (ROOT / "assets" / "pycode-tiny-drafter").is_dir(), reason="the bundled target and drafter are needed"
)


def test_decode_small_bench_smoke(tmp_path):
    prompts = tmp_path / "p.jsonl"
    rows = ["Complete.\ndef add(a, b):\n    return", "Complete.\nimport os\n\ndef main():\n"]
    prompts.write_text("".join(json.dumps({"turns": [r]}) + "\n" for r in rows))
    md = tmp_path / "BENCH.md"
    env = dict(os.environ, OUT=str(tmp_path), OMP_NUM_THREADS="1", DRAFTSMITH_BENCHMARKS=str(md))
    cmd = [sys.executable, str(ROOT / "bench" / "decode_small.py"), "--target", str(ROOT / "assets" / "pycode-tiny")]
    cmd += ["--drafter", str(ROOT / "assets" / "pycode-tiny-drafter"), "--prompts", str(prompts), "--device", "cpu"]
    cmd += [
        "--sections",
        "census,speed",
        "--configs",
        "torch,torch+nolook+pfgraph+ownpools+alltail",
        "--settings",
        "chain2",
    ]
    cmd += ["--speed-prompts", "2", "--speed-tokens", "8", "--replays", "2", "--loop-profile"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "decode_small.json").read_text())
    assert not res["errors"], res["errors"]
    speed = {(x["config"], x["setting"]): x for x in res["speed"]}
    other = "torch+nolook+pfgraph+ownpools+alltail"
    assert set(speed) == {(c, s) for c in ("torch", other) for s in ("plain", "chain2")}
    for row in speed.values():
        assert row["tok_s"] > 0 and row["prefill_ms"] > 0 and row["ms_per_round"] > 0 and row["x_census"] > 0
        assert row["graph_mb"] is None  # (no CUDA graphs on the CPU)
        assert "gpu_busy" in row and row["gpu_busy"] is None  # the loop profile: the GPU's timeline only
    # lossless either way: the same tokens with the lookahead off and the graphed (here: padded) prefill on
    assert speed[("torch", "chain2")]["differ"] == 0 and speed[(other, "chain2")]["differ"] == 0
    assert "ms_per_round" in md.read_text() and "graph_mb" in md.read_text()
    # the census splits each chain round into its parts (verify, drafting, hand-off, the rest)
    chain = [x for x in res["census"] if x["setting"] == "chain2"]
    assert len(chain) == 2
    for row in chain:
        parts = row["parts_us"]
        assert all(parts[k] > 0 for k in ("verify", "token", "step", "handoff"))
        assert abs(sum(row["parts_plain_steps"].values()) - row["plain_steps"]) < 1e-3
    assert "handoff_ps" in md.read_text()


def _bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("decode_small_bench", ROOT / "bench" / "decode_small.py")
    bench = importlib.util.module_from_spec(spec)
    path = list(sys.path)
    try:
        spec.loader.exec_module(bench)  # (it puts bench/ and tests/ on the path for its own imports)
    finally:
        sys.path[:] = path
    return bench


def test_loop_timeline_reads_overlaps_gaps_and_copies():
    """--loop-profile's reading of a generation's device events: busy = their union (overlapping kernels, as under
    programmatic dependent launch, count once), gaps = idle stretches over GAP_US, the device-to-host copies apart."""
    bench = _bench_module()
    evs = [
        (0.0, 10.0, "k1"),
        (8.0, 12.0, "k2"),  # overlaps k1: 2 us more busy
        (13.0, 14.0, "k3"),  # a 1 us idle stretch: no gap
        (20.0, 22.0, "Memcpy DtoH (Device -> Pinned)"),  # after a 6 us gap
        (22.0, 30.0, "k4"),
        (26.0, 28.0, "k5"),  # inside k4
    ]
    st = bench.timeline_stats(reversed(evs))
    assert st["span_us"] == 30.0 and st["busy_frac"] == (12 + 1 + 2 + 8) / 30
    assert (st["gaps"], st["gap_us"], st["dtoh"], st["dtoh_us"]) == (1, 6.0, 1, 2.0)
    assert bench.timeline_stats([]) == {}


def test_graph_mb_counts_private_pools_only():
    """graph_mb: the memory snapshot's segments in private pools (CUDA graphs') on the engine's device — not the
    default pool's (tuning, compiling, the weights) nor another device's."""
    bench = _bench_module()
    segs = [
        {"device": 0, "total_size": 2 << 20, "segment_pool_id": (0, 0)},  # default pool
        {"device": 0, "total_size": 8 << 20, "segment_pool_id": (1, 3)},  # a graph's
        {"device": 0, "total_size": 4 << 20, "segment_pool_id": [1, 7]},  # the shared prefill pool (a list in JSON)
        {"device": 1, "total_size": 16 << 20, "segment_pool_id": (1, 3)},  # another GPU
    ]
    assert bench.graph_pool_bytes(segs, 0) == 12 << 20
    assert bench.graph_pool_bytes([], 0) == 0


def test_tiles_line_says_which_tiles_did_not_run():
    """The census's tiles line: each tuned key's tile and its microseconds, and how many timed tiles did not run at
    all — the tuner skips those silently (every CUDA-core row tile once failed to compile on the H200 unseen)."""
    from types import SimpleNamespace

    from draftsmith.decode.kernel_config import KernelConfig

    bench = _bench_module()
    gkey = (640, 384, "torch.bfloat16", True, False, False, False, False)
    rkey = (640, 384, "torch.bfloat16", True, False, False, False)
    cfg = KernelConfig(gemv_tuned={gkey: (8, 512, 4, 1)}, rows_tuned={rkey: (4, 512, 4)}, tuned_us={gkey: 1.9})
    tuning = [
        {"matrix": "qkv", "BLOCK_N": 8, "us": 1.9, "error": ""},
        {"matrix": "qkv", "BLOCK_N": 4, "us": None, "error": "CompilationError", "rows": 8},
        {"matrix": "qkv", "BLOCK_N": 32, "us": 3.1, "error": "", "rows": 8},
    ]
    out = bench.tiles_chosen(SimpleNamespace(runner=SimpleNamespace(kernel_config=cfg), kernel_tuning=tuning))
    assert out["gemv 640x384+norm"] == "8/512/4/1 1.90us" and out["rows 640x384+norm"] == "4/512/4 fma"
    assert out["tiles that did not run"] == "1 of 3 (1 CUDA-core row tiles)"
    del tuning[1]
    assert "tiles that did not run" not in bench.tiles_chosen(
        SimpleNamespace(runner=SimpleNamespace(kernel_config=cfg), kernel_tuning=tuning)
    )


def test_config_parts_name_their_kernel_settings():
    """`--configs` parts -> KernelConfig: the cluster_gemm parts (the census before making it a default) and a few
    older ones; a part not named leaves the default."""
    bench = _bench_module()
    base = bench.kernel_config_for(["triton", "compile"])
    assert not base.cluster_gemm and not base.cluster_gemm_fused and base.embed_fold and base.rows_k_chains
    cg = bench.kernel_config_for(["triton", "cg"])
    assert cg.cluster_gemm and not cg.cluster_gemm_fused and not cg.cluster_gemm_rope
    fused = bench.kernel_config_for(["triton", "cgfused"])
    assert fused.cluster_gemm and fused.cluster_gemm_fused and not fused.cluster_gemm_rope
    rope = bench.kernel_config_for(["triton", "cgrope", "live4", "noembed"])
    assert rope.cluster_gemm and rope.cluster_gemm_fused and rope.cluster_gemm_rope and not rope.cluster_gemm_layer
    layer = bench.kernel_config_for(["triton", "cglayer"])
    assert layer.cluster_gemm and layer.cluster_gemm_fused and layer.cluster_gemm_rope and layer.cluster_gemm_layer
    assert rope.attn_live_chunks == 4 and not rope.embed_fold
