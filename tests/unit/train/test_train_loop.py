"""End-to-end training on pycode-tiny (CPU): overfit, offline == online, resume after kill -9,
2 gloo processes == 1 process, and the clear errors."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import cli_here, fork_cli, wait_exit
from train_helpers import QUIET_RUN

from draftsmith.common.errors import ArtifactMismatchError, DraftsmithError

REPO = Path(__file__).resolve().parents[3]
TARGET = (
    str(REPO / "assets" / "pycode-tiny")
    if (REPO / "assets" / "pycode-tiny" / "config.json").is_file()
    else "/work/shared/targets/pycode-tiny"
)

SNIPPET = (
    'def add_{i}(a, b):\n    """Return the sum of a and b."""\n    return a + b\n\n\n'
    "class Point{i}:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    '    def __repr__(self):\n        return f"Point{i}({{self.x}}, {{self.y}})"\n'
)


def _quiet(*a, **k):
    pass


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """8 small Python samples (~80 tokens each) captured from pycode-tiny into a store."""
    from draftsmith.capture.job import CaptureConfig, run_capture

    root = tmp_path_factory.mktemp("train")
    data = root / "code.jsonl"
    data.write_text("".join(json.dumps({"text": SNIPPET.format(i=i)}) + "\n" for i in range(8)))
    run_capture(
        CaptureConfig(
            target=TARGET, data=str(data), out=str(root / "store"), max_length=256, progress=False, model_dtype="fp32"
        ),
        log=_quiet,
    )
    return root


@pytest.fixture(scope="module")
def target():
    from draftsmith.target_model import load_target

    return load_target(TARGET, dtype="fp32")


def _cfg(tiny, out, **kw):
    from draftsmith.train import TrainConfig

    base = dict(
        target=TARGET,
        store=str(tiny / "store"),
        out=str(out),
        steps=3,
        ttt_steps=2,
        draft_vocab_size=256,
        batch_tokens=256,
        lr=3e-3,
        **QUIET_RUN,
    )
    base.update(kw)
    return TrainConfig(**base)


def _distinct_tokens(tiny) -> int:
    from draftsmith.store import HiddenStateStore

    return int((HiddenStateStore.open(tiny / "store").token_counts() > 0).sum())


def _metrics(run) -> list[dict]:
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.pop("DRAFTSMITH_TEST_KILL_AT_STEP", None)
    return env


def _cli(args, env=None, torchrun=0, check=True):
    if torchrun:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(torchrun),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            "-m",
            "draftsmith",
            "train",
            *args,
        ]
    else:
        cmd = [sys.executable, "-m", "draftsmith", "train", *args]
    r = subprocess.run(cmd, env=env or _env(), cwd=REPO, capture_output=True, text=True, timeout=180)
    if check and r.returncode != 0:
        raise AssertionError(f"{cmd} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r


# ---------------------------------------------------------------------------------------------------
def test_overfit_tiny_store_acc0(tiny, target, tmp_path):
    from draftsmith.drafter import Drafter
    from draftsmith.train import train

    out = tmp_path / "run"
    last = train(
        target=target, cfg=_cfg(tiny, out, steps=30, batch_tokens=512, tensorboard=True, plot=True), log=_quiet
    )
    recs = _metrics(out)
    assert [r["step"] for r in recs] == list(range(1, 31))
    for key in ("step", "loss", "acc", "cond_acc", "loss_k", "tau_sim", "lr", "grad_norm"):
        assert key in recs[-1]
    assert len(recs[-1]["acc"]) == 2
    assert recs[-1]["loss"] < recs[0]["loss"] / 4
    assert last["acc"][0] >= 0.95, last["acc"]
    assert (out / "training.png").is_file()
    assert any((out / "tensorboard").iterdir())
    assert (out / "final" / "config.json").is_file()
    d = Drafter.from_pretrained(out / "final")
    # 256 asked, capped at the store's distinct loss-masked tokens (issue #14 item 19; test_draft_vocab_capped)
    assert d.config.draft_vocab_size == _distinct_tokens(tiny) < 256 and d.config.aux_layer_ids == [1, 2, 3]


def test_init_from_starts_at_the_given_drafter(tiny, target, tmp_path):
    """--init-from: the run starts from that drafter's weights (a near-zero lr leaves them unchanged, and its first
    loss is the trained one, not a fresh drafter's), keeps its shape, records where it came from; a shape flag that
    contradicts it is one line naming the field."""
    from safetensors.torch import load_file

    from draftsmith.train import train

    first = tmp_path / "first"
    train(target=target, cfg=_cfg(tiny, first, steps=20, batch_tokens=512), log=_quiet)
    fresh = _metrics(first)[0]["loss"]
    again = tmp_path / "again"
    init = str(first / "final")
    train(target=target, cfg=_cfg(tiny, again, steps=2, lr=1e-12, draft_vocab_size=None, init_from=init), log=_quiet)
    a, b = load_file(first / "final" / "model.safetensors"), load_file(again / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-6, rtol=0)
    assert _metrics(again)[0]["loss"] < fresh / 2
    cfg = json.loads((again / "final" / "config.json").read_text())
    assert json.dumps(cfg).count(init) == 1
    with pytest.raises(DraftsmithError, match="draft_vocab_size"):
        train(target=target, cfg=_cfg(tiny, tmp_path / "bad", draft_vocab_size=200, init_from=init), log=_quiet)


def test_offline_equals_online(tiny, target, tmp_path):
    from draftsmith.train import train

    off = tmp_path / "off"
    on = tmp_path / "on"
    kw = dict(steps=3, eval_fraction=0.25, eval_every=3)
    train(target=target, cfg=_cfg(tiny, off, **kw), log=_quiet)
    train(
        target=target,
        cfg=_cfg(tiny, on, store=None, online=True, data=str(tiny / "code.jsonl"), max_length=256, **kw),
        log=_quiet,
    )
    a, b = _metrics(off), _metrics(on)
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-5)
        assert x["valid_tokens"] == y["valid_tokens"]
        assert x["acc"] == pytest.approx(y["acc"], abs=1e-9)
    assert a[-1]["eval_loss"] == pytest.approx(b[-1]["eval_loss"], rel=1e-5)


def test_resume_after_kill9_equals_uninterrupted(tiny, target, tmp_path, one_thread):
    """The CLI SIGKILLed right after step 3 (a child forked from this process, DRAFTSMITH_TEST_KILL_AT_STEP: what the
    kill leaves on disk is that of a real kill -9), then `--resume` (in this process: typer's runner) equals an
    uninterrupted run: metrics and weights. Every run on one intra-op thread (`one_thread`, the forked child too)."""
    from draftsmith.train import train

    full = tmp_path / "full"
    train(target=target, cfg=_cfg(tiny, full, steps=6, save_every=2, eval_fraction=0.2), log=_quiet)
    args = [
        "--target",
        TARGET,
        "--store",
        str(tiny / "store"),
        "--out",
        str(tmp_path / "cut"),
        "--steps",
        "6",
        "--ttt-steps",
        "2",
        "--draft-vocab-size",
        "256",
        "--batch-tokens",
        "256",
        "--lr",
        "3e-3",
        "--warmup",
        "0",
        "--eval-fraction",
        "0.2",
        "--save-every",
        "2",
        "-q",
    ]
    # SIGKILL itself right after step 3 (checkpoint at step 2)
    log = tmp_path / "killed.log"
    pid = fork_cli(["train", *args], log, env={"DRAFTSMITH_TEST_KILL_AT_STEP": "3"})
    assert wait_exit(pid, timeout=180) == -9, log.read_text()[-2000:]
    assert not (tmp_path / "cut" / "final").exists()
    with pytest.raises(DraftsmithError, match="--resume"):  # refuses to continue silently without --resume
        train(target=target, cfg=_cfg(tiny, tmp_path / "cut", steps=6, save_every=2, eval_fraction=0.2), log=_quiet)
    r = cli_here(["train", *args, "--resume"])
    assert r.exit_code == 0, (r.output[-3000:], r.exception)
    a, b = _metrics(full), _metrics(tmp_path / "cut")
    assert [r["step"] for r in b] == list(range(1, 7))
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-6
        assert x["acc"] == y["acc"]
        assert abs(x.get("eval_loss", 0.0) - y.get("eval_loss", 0.0)) <= 1e-6
    from safetensors.torch import load_file

    wa = load_file(str(full / "final" / "model.safetensors"))
    wb = load_file(str(tmp_path / "cut" / "final" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-6, rtol=1e-5)


def test_max_time_stops_then_resume_continues(tiny, target, tmp_path):
    """--max-time stops after the step that crosses it with a checkpoint and final/; --resume then finishes the
    same schedule, equal to an uninterrupted run."""
    from draftsmith.train import train

    full = tmp_path / "full"
    train(target=target, cfg=_cfg(tiny, full, steps=4), log=_quiet)
    cut = tmp_path / "cut"
    msgs = []
    train(target=target, cfg=_cfg(tiny, cut, steps=4, max_time=0.0), log=msgs.append)
    assert [r["step"] for r in _metrics(cut)] == [1]
    assert (cut / "final" / "model.safetensors").is_file()
    assert any("--max-time" in m and "step 1 of 4" in m for m in msgs), msgs
    assert any(m.startswith("step 1: ") for m in msgs), msgs  # first-step time is logged in eager runs too
    train(target=target, cfg=_cfg(tiny, cut, steps=4, resume=True), log=_quiet)
    a, b = _metrics(full), _metrics(cut)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-6


@pytest.fixture(scope="module")
def one_process_run(tiny, target, tmp_path_factory):
    """1 process, grad_accum 2: the reference for 2 processes x grad_accum 1 (same global batch)."""
    from draftsmith.train import train

    one = tmp_path_factory.mktemp("one")
    train(target=target, cfg=_cfg(tiny, one, steps=3, batch_tokens=128, grad_accum=2), log=_quiet)
    return _metrics(one)


@pytest.mark.parametrize(
    "fsdp,online", [(False, False), (True, False), (False, True)], ids=["ddp", "fsdp", "ddp-online"]
)
def test_two_gloo_processes_equal_one(tiny, one_process_run, tmp_path, fsdp, online):
    # online: each rank runs the target in the loop on its own rows; must equal the offline 1-process run
    data = (
        ["--online", "--data", str(tiny / "code.jsonl"), "--max-length", "256"]
        if online
        else ["--store", str(tiny / "store")]
    )
    args = [
        "--target",
        TARGET,
        *data,
        "--out",
        str(tmp_path / "two"),
        "--steps",
        "3",
        "--ttt-steps",
        "2",
        "--draft-vocab-size",
        "256",
        "--batch-tokens",
        "128",
        "--lr",
        "3e-3",
        "--warmup",
        "0",
        "--eval-fraction",
        "0",
        "--save-every",
        "0",
        "-q",
        "--device",
        "cpu",
        "--loss-chunk",
        "50",
    ] + (["--fsdp"] if fsdp else [])  # + checkpointed loss chunks under DDP/FSDP
    _cli(args, torchrun=2)
    a, b = one_process_run, _metrics(tmp_path / "two")
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
        assert x["valid_tokens"] == y["valid_tokens"]
        assert x["acc"] == pytest.approx(y["acc"], abs=1e-9)
    assert (tmp_path / "two" / "final" / "model.safetensors").is_file()


# ---------------------------------------------------------------------------------------------------
def _copy_store(tiny, tmp_path, edit):
    dst = tmp_path / "store"
    shutil.copytree(tiny / "store", dst)
    man = json.loads((dst / "manifest.json").read_text())
    edit(man)
    (dst / "manifest.json").write_text(json.dumps(man))
    return dst


def test_error_store_of_another_target(tiny, target, tmp_path):
    from draftsmith.train import train

    def edit(m):
        m["target"]["config_hash"] = "0" * 64

    st = _copy_store(tiny, tmp_path, edit)
    with pytest.raises(ArtifactMismatchError, match="config_hash"):
        train(target=target, cfg=_cfg(tiny, tmp_path / "r", store=str(st)), log=_quiet)


def test_error_store_without_final(tiny, target, tmp_path):
    from draftsmith.train import train

    st = _copy_store(tiny, tmp_path, lambda m: m.update(has_final=False))
    with pytest.raises(DraftsmithError, match="final"):
        train(target=target, cfg=_cfg(tiny, tmp_path / "r", store=str(st)), log=_quiet)


def test_error_empty_store_and_big_vocab(tiny, target, tmp_path):
    from draftsmith.train import Trainer, train

    with pytest.raises(DraftsmithError, match="empty"):
        Trainer(_cfg(tiny, tmp_path / "r"), target=target, source=[]).run()
    with pytest.raises(DraftsmithError, match="draft-vocab-size.*larger"):
        train(target=target, cfg=_cfg(tiny, tmp_path / "r2", draft_vocab_size=20000), log=_quiet)
    r = _cli(
        [
            "--target",
            TARGET,
            "--store",
            str(tiny / "store"),
            "--out",
            str(tmp_path / "r3"),
            "--draft-vocab-size",
            "99999",
        ],
        check=False,
    )
    assert r.returncode == 2
    err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "larger than the target vocab" in err[0] and "Traceback" not in r.stderr


def test_padding_is_not_trained(tiny, target, tmp_path):
    """Rows padded to the token budget (static shapes for flex attention) give the unpadded losses."""
    from draftsmith.train import train

    train(target=target, cfg=_cfg(tiny, tmp_path / "a", steps=2, pad_to_budget=False), log=_quiet)
    train(target=target, cfg=_cfg(tiny, tmp_path / "b", steps=2, pad_to_budget=True, batch_tokens=200), log=_quiet)
    train(target=target, cfg=_cfg(tiny, tmp_path / "c", steps=2, pad_to_budget=False, batch_tokens=200), log=_quiet)
    b, c = _metrics(tmp_path / "b"), _metrics(tmp_path / "c")
    for x, y in zip(b, c):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
        assert x["valid_tokens"] == y["valid_tokens"] and x["tokens"] == y["tokens"]


def test_cli_yaml_config(tiny, tmp_path):
    from typer.testing import CliRunner

    from draftsmith.cli import app

    cfg = tmp_path / "train.yaml"
    cfg.write_text(
        f"target: {TARGET}\nstore: {tiny / 'store'}\nsteps: 1\nttt-steps: 2\ndraft_vocab_size: 128\n"
        f"batch_tokens: 256\ntensorboard: false\nplot: false\neval_fraction: 0\n"
    )
    res = CliRunner().invoke(app, ["train", "--config", str(cfg), "--out", str(tmp_path / "run"), "-q", "--lr", "1e-3"])
    assert res.exit_code == 0, res.output
    rec = _metrics(tmp_path / "run")
    assert len(rec) == 1 and len(rec[0]["acc"]) == 2 and rec[0]["lr"] == pytest.approx(1e-3)
    bad = tmp_path / "bad.yaml"
    bad.write_text("nonsense_key: 1\n")
    res = CliRunner().invoke(app, ["train", "--config", str(bad), "--out", str(tmp_path / "r2")])
    assert isinstance(res.exception, DraftsmithError) and "nonsense_key" in str(res.exception)


@pytest.mark.parametrize("fails", [False, True], ids=["compiled", "compile-fails"])
def test_compiled_path_logs_and_falls_back(tiny, target, tmp_path, monkeypatch, fails):
    """The trainer's compile plumbing on CPU (torch has no CPU flex backward, so the 'compiled' unroll is the eager
    one behind the same call): the first steps' times are logged; a first-step failure under --compile auto
    falls back to eager with one warning and the same losses as --compile off."""
    from draftsmith.train import train
    from draftsmith.train import trainer as tr
    from draftsmith.train.ttt import Teacher, ttt_unroll

    calls = []

    def fake_compiled(drafter, input_ids, aux, doc_ids, position_ids, loss_mask, teacher: Teacher, k, w, lc):
        calls.append(1)
        if fails:
            raise RuntimeError("inductor exploded\nsecond line")
        loss, st = ttt_unroll(
            drafter,
            input_ids,
            aux,
            doc_ids,
            loss_mask,
            teacher,
            ttt_steps=k,
            step_weight=w,
            backend="chunked",
            position_ids=position_ids,
            loss_chunk=lc,
        )
        return loss, st.as_tensor()

    monkeypatch.setattr(tr.Trainer, "_use_compile", lambda self, device: True)
    monkeypatch.setattr(tr.TTTModel, "enable_compile", lambda self, **kw: setattr(self, "compiled", fake_compiled))
    logs: list[str] = []
    train(target=target, cfg=_cfg(tiny, tmp_path / "c"), log=logs.append)
    monkeypatch.undo()
    train(target=target, cfg=_cfg(tiny, tmp_path / "ref", compile="off"), log=_quiet)
    text = "\n".join(logs)
    if fails:
        assert (
            len(calls) == 1
            and text.count("warning: the compiled TTT unroll failed (RuntimeError: inductor exploded)") == 1
        )
        assert "includes compiling" not in text
    else:
        assert len(calls) == 3 and "step 1:" in text and "(includes compiling the TTT unroll)" in text
        assert "step 2:" in text and "step 3:" not in text
    for x, y in zip(_metrics(tmp_path / "c"), _metrics(tmp_path / "ref")):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6)


@pytest.mark.parametrize("granularity,graphs", [("unroll", 1), ("step", 2)])
def test_compiled_unroll_compiles_once_across_steps(tiny, target, tmp_path, monkeypatch, granularity, graphs):
    """The trainer's compiled unroll must not recompile at step 2. It did on the GPU (+54 s at 16k): the
    drafter's per-device RoPE cache was first filled inside the compiled call, so the next call failed that
    graph's guard. CPU stand-in: aot_eager and the dense flex replacement of the compiled-unroll test."""
    import torch._dynamo
    from test_train_ttt import _dense_doc_causal, _dense_flex
    from torch._dynamo.utils import counters

    import draftsmith.train.ttt as ttt
    from draftsmith.train import train
    from draftsmith.train import trainer as tr

    monkeypatch.setattr(ttt, "_flex_lse", _dense_flex)
    monkeypatch.setattr(ttt, "doc_causal_block_mask", _dense_doc_causal)
    monkeypatch.setattr(tr.Trainer, "_use_compile", lambda self, device: True)
    cls = ttt.CompiledStepUnroll if granularity == "step" else ttt.CompiledUnroll
    monkeypatch.setattr(
        tr.TTTModel, "enable_compile", lambda self, **kw: setattr(self, "compiled", cls(backend="aot_eager"))
    )
    torch._dynamo.reset()
    counters.clear()
    train(target=target, cfg=_cfg(tiny, tmp_path / "c", steps=3, attn_backend="flex", pad_to_budget=True), log=_quiet)
    assert len(_metrics(tmp_path / "c")) == 3
    assert counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])
    torch._dynamo.reset()


def test_fp8_rows_dequantized_after_the_copy_equal_host_dequantized(tiny, tmp_path):
    """A store read with `defer_dequantize` (what the trainer does on CUDA: fp8 bytes cross to the GPU and are
    dequantized there) gives micro-batches equal, after `.to(device)`, to rows dequantized on the host —
    including the zero padding of a padded row and an explicit dtype."""
    from draftsmith.capture.job import CaptureConfig, run_capture
    from draftsmith.store import HiddenStateStore
    from draftsmith.train.batches import build_micro_batch

    out = tmp_path / "fp8"
    run_capture(
        CaptureConfig(
            target=TARGET,
            data=str(tiny / "code.jsonl"),
            out=str(out),
            max_length=256,
            progress=False,
            model_dtype="fp32",
            dtype="fp8",
        ),
        log=_quiet,
    )
    host = HiddenStateStore.open(out, dtype=torch.float32)
    deferred = HiddenStateStore.open(out, dtype=torch.float32)
    deferred.defer_dequantize = True
    assert deferred[0]["aux_hidden_states"].dtype == torch.float8_e4m3fn and "aux_scale" in deferred[0]
    for row, pad in (([0, 1, 2], 128), ([3], 1)):
        a = build_micro_batch(host, row, 512, with_states=True, pad_to=pad)
        b = build_micro_batch(deferred, row, 512, with_states=True, pad_to=pad)
        assert b.aux_hidden.dtype == torch.float8_e4m3fn and b.aux_scale is not None
        for dt in (None, torch.bfloat16):
            x, y = a.to("cpu", dt), b.to("cpu", dt)
            assert y.aux_scale is None and y.aux_hidden.dtype == x.aux_hidden.dtype
            assert torch.equal(x.aux_hidden, y.aux_hidden) and torch.equal(x.final_hidden, y.final_hidden)
            assert torch.equal(x.input_ids, y.input_ids) and x.num_tokens == y.num_tokens


# --------------------------------------------------------------------------------------------------- issue #14
class _Poisoned:
    """A store whose sample `bad` has NaN aux states (what a corrupted shard that passes its checks would give)."""

    def __init__(self, store, bad: int):
        self._store, self._bad = store, bad

    def __len__(self):
        return len(self._store)

    def __getattr__(self, name):
        return getattr(self._store, name)

    def __getitem__(self, i):
        item = self._store[i]
        if i == self._bad:
            item = {**item, "aux_hidden_states": torch.full_like(item["aux_hidden_states"], float("nan"))}
        return item


def test_non_finite_loss_stops_naming_step_and_sample(tiny, target, tmp_path):
    from draftsmith.store import HiddenStateStore
    from draftsmith.train import Trainer
    from draftsmith.train.batches import epoch_rows, source_lengths

    store = HiddenStateStore.open(tiny / "store", dtype=torch.float32)
    bad = epoch_rows(range(len(store)), source_lengths(store), 128, 0, 0)[1][0]  # in step 2's row
    out = tmp_path / "r"
    with pytest.raises(DraftsmithError) as e:
        Trainer(
            _cfg(tiny, out, save_every=1, batch_tokens=128), target=target, source=_Poisoned(store, bad), log=_quiet
        ).run()
    msg = str(e.value)
    assert msg.startswith("step 2: the training loss is nan") and "\n" not in msg, msg
    assert re.search(rf"sample {bad} \(shards/shard-\d+\.safetensors #\d+\)", msg), msg
    assert [r["step"] for r in _metrics(out)] == [1]  # the step before it, not the bad one
    assert not (out / "final").exists()
    assert [p.name for p in (out / "checkpoints").glob("step-*")] == ["step-00000001"]


def test_out_with_unrelated_files_is_refused_and_a_run_dir_is_locked(tiny, target, tmp_path):
    from draftsmith.common.io import dir_lock
    from draftsmith.train import train

    other = tmp_path / "model"
    other.mkdir()
    (other / "config.json").write_text("{}")
    with pytest.raises(DraftsmithError, match="not a draftsmith run directory"):
        train(target=target, cfg=_cfg(tiny, other), log=_quiet)
    assert (other / "config.json").read_text() == "{}" and sorted(p.name for p in other.iterdir()) == ["config.json"]
    run = tmp_path / "run"
    with dir_lock(run, what="train"):  # another train holds it
        with pytest.raises(DraftsmithError, match="in use by another draftsmith train"):
            train(target=target, cfg=_cfg(tiny, run), log=_quiet)
    assert not (run / "metrics.jsonl").exists()


def test_resume_with_other_lr_or_data_is_refused(tiny, target, tmp_path):
    from draftsmith.store import HiddenStateStore
    from draftsmith.train import Trainer, train

    out = tmp_path / "r"
    train(target=target, cfg=_cfg(tiny, out, steps=1), log=_quiet)
    with pytest.raises(DraftsmithError, match=r"different settings \['lr'\]"):
        train(target=target, cfg=_cfg(tiny, out, steps=2, lr=1e-2, resume=True), log=_quiet)
    store = HiddenStateStore.open(tiny / "store", dtype=torch.float32)
    fewer = [store[i] for i in range(len(store) - 1)]
    with pytest.raises(DraftsmithError, match="different data"):
        Trainer(_cfg(tiny, out, steps=2, resume=True), target=target, source=fewer, log=_quiet).run()
    train(target=target, cfg=_cfg(tiny, out, steps=2, resume=True), log=_quiet)  # the same settings resume
    assert [r["step"] for r in _metrics(out)] == [1, 2]


def test_truncated_latest_checkpoint_falls_back_to_the_previous(tiny, target, tmp_path):
    from draftsmith.train import train

    out = tmp_path / "r"
    train(target=target, cfg=_cfg(tiny, out, steps=2, save_every=1), log=_quiet)
    latest = out / "checkpoints" / "step-00000002" / "model.safetensors"
    latest.write_bytes(latest.read_bytes()[:100])
    msgs: list[str] = []
    train(target=target, cfg=_cfg(tiny, out, steps=3, save_every=1, resume=True), log=msgs.append)
    text = "\n".join(msgs)
    assert "checkpoint step-00000002 is unreadable" in text and "older checkpoint step-00000001 (step 1)" in text
    assert "resumed from" in text and "at step 1 " in text
    assert [r["step"] for r in _metrics(out)] == [1, 2, 3]


def test_draft_vocab_capped_at_the_distinct_loss_masked_tokens(tiny, target, tmp_path):
    from draftsmith.drafter import Drafter
    from draftsmith.train import train

    n = _distinct_tokens(tiny)
    msgs: list[str] = []
    train(target=target, cfg=_cfg(tiny, tmp_path / "r", steps=1, draft_vocab_size=n + 7), log=msgs.append)
    assert any(
        f"--draft-vocab-size {n + 7} is more than the {n} distinct loss-masked tokens" in m and f"capped at {n}" in m
        for m in msgs
    ), msgs
    assert Drafter.from_pretrained(tmp_path / "r" / "final").config.draft_vocab_size == n
    msgs.clear()
    train(target=target, cfg=_cfg(tiny, tmp_path / "s", steps=1, draft_vocab_size=n - 1), log=msgs.append)
    assert not any("draft vocab is capped" in m for m in msgs)


def test_full_disk_is_one_line(tiny, target, tmp_path):
    from store_helpers import small_tmpfs

    from draftsmith.train import train

    with small_tmpfs(tmp_path / "fs", 256 << 10) as fs:
        with pytest.raises(DraftsmithError, match=r"^no space left on device: ") as e:
            train(target=target, cfg=_cfg(tiny, fs / "r", steps=1), log=_quiet)
        assert "\n" not in str(e.value)
        assert not list((fs / "r" / "checkpoints").glob("*step-*"))  # nothing half-written left behind


@pytest.mark.slow
def test_background_compile_switches_at_a_step_boundary_without_recompiling(tiny, target, tmp_path, monkeypatch):
    """The default CUDA start (`warmup.py`): the first step runs the chunked attention while a copy of the model
    compiles the unroll in a thread; the next step boundary switches to the compiled unroll, which the real drafter
    then calls without a recompile, and the losses are those of an eager run. CPU stand-in: aot_eager and the dense
    flex replacement; `done()` waits, so the switch is at step 2."""
    import torch._dynamo
    from test_train_ttt import _dense_doc_causal, _dense_flex
    from torch._dynamo.utils import counters

    import draftsmith.train.ttt as ttt
    from draftsmith.train import train, warmup
    from draftsmith.train import trainer as tr

    monkeypatch.setattr(ttt, "_flex_lse", _dense_flex)
    monkeypatch.setattr(ttt, "doc_causal_block_mask", _dense_doc_causal)
    monkeypatch.setattr(tr.Trainer, "_use_compile", lambda self, device: True)
    monkeypatch.setattr(tr.Trainer, "_deferred_compile", lambda self: "thread")
    monkeypatch.setattr(
        tr.TTTModel,
        "enable_compile",
        lambda self, **kw: setattr(self, "compiled", ttt.CompiledUnroll(backend="aot_eager")),
    )
    monkeypatch.setattr(warmup.BackgroundCompile, "done", lambda self: self.wait())
    torch._dynamo.reset()
    counters.clear()
    msgs: list[str] = []
    train(target=target, cfg=_cfg(tiny, tmp_path / "bg", steps=2, pad_to_budget=True), log=msgs.append)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # compiled once, in the thread
    torch._dynamo.reset()
    text = "\n".join(msgs)
    assert "the first steps run the chunked attention while the TTT unroll compiles in the background" in text
    assert "step 2: the compiled TTT unroll is ready" in text, text
    monkeypatch.undo()
    train(target=target, cfg=_cfg(tiny, tmp_path / "ref", steps=2, pad_to_budget=True, compile="off"), log=_quiet)
    for x, y in zip(_metrics(tmp_path / "bg"), _metrics(tmp_path / "ref"), strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)


class _FakeWarmer:
    """Stands in for `warmup.CacheWarmer` (whose child process has its own tests): ready or failed at once."""

    specs: list = []
    fail = False

    def __init__(self, spec, log_path):
        type(self).specs.append(spec)
        self.seconds, self.error = 1.0, "exit code 1: RuntimeError: inductor exploded (compile_warmup.log)"

    def poll(self):
        return "failed" if self.fail else "ready"

    def close(self):
        pass


@pytest.mark.parametrize("fails", [False, True], ids=["switches", "child-fails"])
def test_warm_start_runs_chunked_then_switches_or_stays(tiny, target, tmp_path, monkeypatch, fails):
    """The default CUDA start: the steps run the chunked attention from step 1; after step 1 a child process is
    given the first forward's input shapes; once it is done every rank switches at one step boundary to the compiled
    unroll, compiled once, with the losses of an eager run. A failed child: one warning line, every step chunked.
    CPU stand-in: aot_eager and the dense flex replacement, a fake child."""
    import torch
    import torch._dynamo
    from test_train_ttt import _dense_doc_causal, _dense_flex
    from torch._dynamo.utils import counters

    import draftsmith.train.ttt as ttt
    from draftsmith.train import train
    from draftsmith.train import trainer as tr

    monkeypatch.setattr(ttt, "_flex_lse", _dense_flex)
    monkeypatch.setattr(ttt, "doc_causal_block_mask", _dense_doc_causal)
    monkeypatch.setattr(tr.Trainer, "_use_compile", lambda self, device: True)
    monkeypatch.setattr(tr.Trainer, "_deferred_compile", lambda self: "process")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 96 << 30))
    monkeypatch.setattr(
        tr.TTTModel, "enable_compile", lambda self, **kw: setattr(self, "compiled", ttt.CompiledUnroll("aot_eager"))
    )
    monkeypatch.setattr(_FakeWarmer, "specs", [])
    monkeypatch.setattr(_FakeWarmer, "fail", fails)
    monkeypatch.setattr(tr, "CacheWarmer", _FakeWarmer)
    torch._dynamo.reset()
    counters.clear()
    msgs: list[str] = []
    train(target=target, cfg=_cfg(tiny, tmp_path / "w", steps=5, pad_to_budget=True), log=msgs.append)
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    text = "\n".join(msgs)
    assert "the first steps run the chunked attention while the TTT unroll compiles in a separate process" in text
    (spec,) = _FakeWarmer.specs
    assert spec["fast_path"] == "compiled" and spec["inputs"][0]["shape"] == [1, 256]  # the padded row
    assert spec["inputs"][5]["shape"][:2] == [1, 256] and spec["params"]["fc.weight"]["requires_grad"]
    if fails:
        assert graphs == 0 and text.count("warning:") == 1, text
        assert "compiling the TTT unroll in a separate process failed (exit code 1: RuntimeError" in text
    else:
        # step 1 starts the child, step 2's boundary sees it done, step 3's reduce agrees: step 4 switches
        assert graphs == 1 and "warning:" not in text, text
        assert "step 4: the compiled TTT unroll is ready (1s warming the caches in a separate process)" in text
        assert "step 4: " in text and "(includes compiling the TTT unroll from the warm caches)" in text
    monkeypatch.undo()
    train(target=target, cfg=_cfg(tiny, tmp_path / "ref", steps=5, pad_to_budget=True, compile="off"), log=_quiet)
    for x, y in zip(_metrics(tmp_path / "w"), _metrics(tmp_path / "ref"), strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)


def test_warm_start_switch_that_fails_to_compile_stays_chunked(tiny, target, tmp_path, monkeypatch):
    """The compile from the warm caches fails at the switch: one warning, that step is redone chunked, the run goes
    on with the losses of an eager run."""
    import torch

    from draftsmith.train import train
    from draftsmith.train import trainer as tr

    def broken(*a, **k):
        raise RuntimeError("cache says no\nsecond line")

    monkeypatch.setattr(tr.Trainer, "_use_compile", lambda self, device: True)
    monkeypatch.setattr(tr.Trainer, "_deferred_compile", lambda self: "process")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 96 << 30))
    monkeypatch.setattr(tr.TTTModel, "enable_compile", lambda self, **kw: setattr(self, "compiled", broken))
    monkeypatch.setattr(_FakeWarmer, "fail", False)
    monkeypatch.setattr(tr, "CacheWarmer", _FakeWarmer)
    msgs: list[str] = []
    train(target=target, cfg=_cfg(tiny, tmp_path / "w", steps=5), log=msgs.append)
    text = "\n".join(msgs)
    assert text.count("warning:") == 1, text
    assert "compiling the TTT unroll from the warm caches failed (RuntimeError: cache says no)" in text
    monkeypatch.undo()
    train(target=target, cfg=_cfg(tiny, tmp_path / "ref", steps=5, compile="off"), log=_quiet)
    for x, y in zip(_metrics(tmp_path / "w"), _metrics(tmp_path / "ref"), strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6)
