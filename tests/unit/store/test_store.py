"""Capture into the store: numerics vs output_hidden_states, format, atomicity/resume, verify, refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from store_helpers import capture, make_corpus  # noqa: E402  (tests/store_helpers.py)

from draftsmith.capture.job import plan_batches, plan_shards
from draftsmith.common.errors import ArtifactMismatchError, DraftsmithError
from draftsmith.common.io import LOCK_FILE_NAME
from draftsmith.store import HiddenStateStore
from draftsmith.store import format as fmt
from draftsmith.store.verify import verify_store
from draftsmith.target_model import load_target

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def store_bf16(tiny_path, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("stores") / "bf16"
    capture(tiny_path, corpus, out, aux_layers=[1, 3, 4])
    return out


def test_plans_are_deterministic_and_cover_everything():
    lengths = np.array([5, 300, 7, 7, 120, 1, 64])
    shards = plan_shards(lengths, 128)
    assert sum(n for _, n, _ in shards) == len(lengths)
    assert [f for f, _, _ in shards] == sorted(f for f, _, _ in shards)
    assert sum(t for _, _, t in shards) == lengths.sum()
    batches = plan_batches(lengths.tolist(), 256)
    assert sorted(j for b in batches for j in b) == list(range(len(lengths)))
    for b in batches:  # padded size within budget unless a single sample is longer
        assert len(b) == 1 or len(b) * max(lengths[j] for j in b) <= 256


def test_store_matches_output_hidden_states(store_bf16, tiny_path):
    s = HiddenStateStore.open(store_bf16, dtype=torch.float32)
    target = load_target(tiny_path, dtype="fp32")
    assert s.manifest["aux_layers"] == [1, 3, 4]
    assert s.manifest["aux_hidden_states_ids"] == [2, 4, 5]
    assert len(s) > 12  # long files were split into several samples
    H = 192
    for i in range(len(s)):
        item = s[i]
        ids = item["input_ids"]
        assert ids.dtype == torch.long and item["loss_mask"].dtype == torch.bool
        assert item["aux_hidden_states"].shape == (len(ids), 3 * H)
        with torch.no_grad():
            ref = target.model(ids[None], output_hidden_states=True)
        for slot, lid in enumerate([1, 3, 4]):
            want = ref.hidden_states[lid + 1][0].to(torch.bfloat16).float()
            got = item["aux_hidden_states"][:, slot * H : (slot + 1) * H]
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        # the stored final state is pre-norm: norm + lm_head reproduce the model's logits
        logits = target.lm_head(target.final_norm(item["final_hidden_states"]))
        torch.testing.assert_close(logits, ref.logits[0], rtol=5e-2, atol=5e-2)
        assert (logits.argmax(-1) == ref.logits[0].argmax(-1)).float().mean() > 0.97


def test_manifest_and_sizes(store_bf16):
    m = json.loads((store_bf16 / "manifest.json").read_text())
    for key in (
        "target",
        "aux_layers",
        "aux_layers_convention",
        "dtype",
        "hidden_size",
        "num_samples",
        "num_tokens",
        "shards",
        "draftsmith_version",
        "token_counts",
    ):
        assert key in m
    assert m["target"]["config_hash"] and m["target"]["tokenizer_hash"]
    assert m["aux_layers_convention"] == "layer-output"
    assert len(m["shards"]) > 1
    s = HiddenStateStore.open(store_bf16)
    assert int(s.lengths.sum()) == m["num_tokens"]
    # no padding stored: rows in the shards == real tokens
    from safetensors import safe_open

    rows = 0
    for sh in m["shards"]:
        with safe_open(str(store_bf16 / sh["file"]), "pt") as f:
            rows += f.get_slice("aux_hidden_states").get_shape()[0]
    assert rows == m["num_tokens"]
    # bytes/token: ids + 4 bf16 rows of H, plus headers/index
    assert m["bytes_per_token"] < 1.05 * fmt.bytes_per_token(192, 3, "bf16") + 40


def test_token_counts_are_loss_masked_frequencies(store_bf16):
    s = HiddenStateStore.open(store_bf16)
    counts = s.token_counts()
    want = torch.zeros_like(counts)
    for i in range(len(s)):
        it = s[i]
        want.index_add_(0, it["input_ids"][it["loss_mask"]], torch.ones(int(it["loss_mask"].sum()), dtype=torch.long))
    assert torch.equal(counts, want)
    assert counts.sum() == s.manifest["num_loss_tokens"]


def test_fp8_store(tiny_path, corpus, tmp_path, store_bf16):
    out = tmp_path / "fp8"
    m = capture(tiny_path, corpus, out, aux_layers=[1, 3, 4], dtype="fp8")
    assert m["dtype"] == "fp8"
    s8, s16 = HiddenStateStore.open(out, dtype=torch.float32), HiddenStateStore.open(store_bf16, dtype=torch.float32)
    err, norm = 0.0, 0.0
    for i in range(len(s8)):
        a, b = s8[i]["aux_hidden_states"], s16[i]["aux_hidden_states"]
        err += float((a - b).pow(2).sum())
        norm += float(b.pow(2).sum())
    assert (err / norm) ** 0.5 < 0.05  # e4m3 has 3 mantissa bits: ~2-4% relative RMS error
    assert m["bytes_per_token"] < 0.55 * json.loads((store_bf16 / "manifest.json").read_text())["bytes_per_token"]


def test_fp8_roundtrip_unit():
    x = torch.randn(17, 3 * 64) * torch.logspace(-3, 3, 17)[:, None]
    q, s = fmt.quantize_fp8_rows(x, 64)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (17, 3) and s.dtype == torch.uint8
    y = fmt.dequantize_fp8_rows(q, s, torch.float32)
    rel = ((y - x).norm(dim=-1) / x.norm(dim=-1)).max()
    assert rel < 0.05
    z = torch.zeros(2, 64)
    qz, sz = fmt.quantize_fp8_rows(z, 64)
    assert torch.equal(fmt.dequantize_fp8_rows(qz, sz, torch.float32), z)


def test_mask_spans_roundtrip():
    rng = np.random.default_rng(1)
    for _ in range(50):
        m = rng.random(int(rng.integers(0, 40))) < 0.5
        assert np.array_equal(fmt.spans_to_mask(fmt.mask_to_spans(m), len(m)), m)


def test_verify_names_a_corrupted_shard(store_bf16, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(store_bf16, copy)
    assert verify_store(copy, progress=False) == []
    shard = copy / "shards" / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    problems = verify_store(copy, progress=False)
    assert len(problems) == 1 and "shards/shard-00001.safetensors" in problems[0] and "sha256" in problems[0]
    (copy / "shards" / "shard-00000.safetensors").unlink()
    assert any("shard-00000" in p and "missing" in p for p in verify_store(copy, progress=False))


def test_store_of_another_target_is_refused(store_bf16, small_path):
    s = HiddenStateStore.open(store_bf16)
    other = load_target(small_path, load_tokenizer=False)
    with pytest.raises(ArtifactMismatchError, match="config_hash"):
        s.check_target(other)


def test_resume_with_other_settings_is_refused(tiny_path, corpus, store_bf16, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(store_bf16, copy)
    (copy / "manifest.json").unlink()
    with pytest.raises(DraftsmithError, match="aux_layers"):
        capture(tiny_path, corpus, copy, aux_layers=[1, 2, 4])


def test_incomplete_store_says_resume(tmp_path):
    (tmp_path / "plan.json").write_text("{}")
    with pytest.raises(DraftsmithError, match="resume"):
        HiddenStateStore.open(tmp_path)


def _cli(args, env=None, check=True):
    e = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "draftsmith", *args], cwd=REPO, env=e, capture_output=True, text=True, check=check
    )


def _tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file of a store but the directory lock (it holds the pid of the last capture)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != LOCK_FILE_NAME
    }


def _cli_crashing_at_each(outs: dict[str, Path], args) -> tuple[dict[str, int], str]:
    """The CLI run by tests/capture_crash.py once per commit point, each run in a process of its own (forked after
    the imports) that SIGKILLs itself at that point with `--out outs[point]` (test-only fault injection): the return
    code of each run, and their stderr."""
    e = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, str(REPO / "tests" / "capture_crash.py"), *(f"{p}={o}" for p, o in outs.items()), *args],
        cwd=REPO,
        env=e,
        capture_output=True,
        text=True,
    )
    rows = [line.split() for line in r.stdout.splitlines()]
    return {row[0]: int(row[1]) for row in rows if len(row) == 2 and row[0] in outs}, r.stderr


def _cli_here(args):
    """The same command in this process (typer's runner: no ~5 s interpreter start-up and imports). The caller holds
    one intra-op thread (`one_thread`), as the subprocesses' OMP_NUM_THREADS=1, so the bytes are comparable."""
    from typer.testing import CliRunner

    from draftsmith.cli import app

    return CliRunner().invoke(app, args)


@pytest.mark.slow
def test_kill9_at_every_commit_point_then_resume_is_byte_identical(tiny_path, corpus, tmp_path, one_thread):
    args = [
        "capture",
        "--target",
        str(tiny_path),
        "--data",
        str(corpus),
        "--max-length",
        "128",
        "--batch-tokens",
        "512",
        "--shard-tokens",
        "700",
        "--model-dtype",
        "fp32",
        "--aux-layers",
        "1,3,4",
        "-q",
    ]
    ref = tmp_path / "ref"
    r = _cli_here([*args, "--out", str(ref)])
    assert r.exit_code == 0, r.output[-3000:]
    want = _tree_bytes(ref)
    points = ["before_shard:0", "after_shard:1", "after_progress:0", "before_shard:2", "before_finalize:0"]
    outs = {point: tmp_path / point.replace(":", "_") for point in points}
    codes, stderr = _cli_crashing_at_each(outs, args)
    assert codes == {point: -9 for point in points}, (codes, stderr[-2000:])  # every run killed at its point
    for point, out in outs.items():
        assert not (out / "manifest.json").exists()
        r = _cli_here([*args, "--out", str(out)])  # the same command resumes
        assert r.exit_code == 0, (point, r.output[-3000:])
        assert _tree_bytes(out) == want, point
    # an already complete store: rerunning is a no-op
    r = _cli_here([*args, "--out", str(ref)])
    assert r.exit_code == 0 and "already complete" in r.stderr and _tree_bytes(ref) == want


@pytest.mark.slow
def test_random_kill9_then_resume(tiny_path, corpus, tmp_path, one_thread):
    import time

    args = [
        "capture",
        "--target",
        str(tiny_path),
        "--data",
        str(corpus),
        "--max-length",
        "128",
        "--batch-tokens",
        "256",
        "--shard-tokens",
        "300",
        "--model-dtype",
        "fp32",
        "-q",
    ]
    ref = tmp_path / "ref"
    assert _cli_here([*args, "--out", str(ref)]).exit_code == 0
    out = tmp_path / "killed"
    e = dict(os.environ, OMP_NUM_THREADS="1")
    for delay in (0.3, 1.5):  # seconds after the plan is written, i.e. while shards are being captured
        p = subprocess.Popen(
            [sys.executable, "-m", "draftsmith", *args, "--out", str(out)],
            cwd=REPO,
            env=e,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        while not (out / "plan.json").exists() and p.poll() is None:
            time.sleep(0.05)
        time.sleep(delay)
        p.kill()
        p.wait()
    r = _cli_here([*args, "--out", str(out)])  # the same command resumes
    assert r.exit_code == 0, r.output[-3000:]
    assert _tree_bytes(out) == _tree_bytes(ref)


def _torchrun_capture(args, port: int) -> None:
    """`torchrun --nproc-per-node 2 -m draftsmith capture ARGS` (gloo on CPU); fails the test on a non-zero exit."""
    e = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(port),
            "-m",
            "draftsmith",
            "capture",
            *args,
        ],
        cwd=REPO,
        env=e,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process(tiny_path, corpus, tmp_path):
    args = [
        "--target",
        str(tiny_path),
        "--data",
        str(corpus),
        "--max-length",
        "128",
        "--batch-tokens",
        "512",
        "--shard-tokens",
        "700",
        "--model-dtype",
        "fp32",
        "--device",
        "cpu",
        "-q",
    ]
    one = tmp_path / "one"
    _cli(["capture", *args, "--out", str(one)])
    two = tmp_path / "two"
    _torchrun_capture([*args, "--out", str(two)], port=29531)
    assert _tree_bytes(two) == _tree_bytes(one)


def test_cli_bad_record_is_one_line(tiny_path, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "def f(): pass"}\n{"text": oops}\n')
    r = _cli(
        ["capture", "--target", str(tiny_path), "--data", str(bad), "--out", str(tmp_path / "s"), "-q"], check=False
    )
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "bad.jsonl:2" in lines[0] and "Traceback" not in r.stderr
    r = _cli(
        [
            "capture",
            "--target",
            str(tiny_path),
            "--data",
            str(bad),
            "--out",
            str(tmp_path / "s2"),
            "-q",
            "--on-bad",
            "skip",
            "--model-dtype",
            "fp32",
        ]
    )
    s = HiddenStateStore.open(tmp_path / "s2")
    assert len(s) == 1


def test_cli_store_info_and_verify(store_bf16):
    r = _cli(["store", "info", str(store_bf16)])
    assert "layer-output ids [1, 3, 4] = hidden_states ids [2, 4, 5]" in r.stdout
    r = _cli(["store", "verify", str(store_bf16), "-q"])
    assert "OK" in r.stdout


@pytest.mark.slow
def test_tensor_parallel_capture_matches_single_process(small_path, corpus, tmp_path):
    """transformers' tp_plan='auto' under torchrun (2 gloo ranks on CPU): same store as one process."""
    pytest.importorskip("accelerate")
    args = [
        "--target",
        str(small_path),
        "--data",
        str(corpus),
        "--max-length",
        "64",
        "--batch-tokens",
        "512",
        "--model-dtype",
        "fp32",
        "--device",
        "cpu",
        "--max-samples",
        "6",
        "-q",
    ]
    one = tmp_path / "one"
    _cli(["capture", *args, "--out", str(one)])
    tp = tmp_path / "tp"
    _torchrun_capture([*args, "--tp", "--out", str(tp)], port=29533)
    a, b = HiddenStateStore.open(one, dtype=torch.float32), HiddenStateStore.open(tp, dtype=torch.float32)
    assert len(a) == len(b) == 6
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert torch.equal(x["input_ids"], y["input_ids"])
        torch.testing.assert_close(x["aux_hidden_states"], y["aux_hidden_states"], rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(x["final_hidden_states"], y["final_hidden_states"], rtol=2e-2, atol=5e-2)
