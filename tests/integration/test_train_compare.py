"""The held-out evaluator (`draftsmith.train.heldout`) and the CPU-checkable parts of the speculators side by side
(`bench/train_compare.py`): split + reordered export, the commands, speculators' own parser and CLI (--dry-run)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "assets" / "pycode-tiny"
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests"))

import train_compare as tc  # noqa: E402
from store_helpers import capture, make_corpus  # noqa: E402

AUX = [0, 2, 4]  # distinct: speculators refuses repeated --target-layer-ids
K, V, B = 3, 128, 256

_HAVE_DATASETS = all(importlib.util.find_spec(m) is not None for m in ("datasets", "pyarrow"))


def _have_speculators() -> bool:
    try:
        import importlib

        importlib.import_module("speculators.train.cli")
        importlib.import_module("speculators.train.config")
    except Exception:
        return False
    return _HAVE_DATASETS


needs_datasets = pytest.mark.skipif(
    not _HAVE_DATASETS, reason="datasets/pyarrow not installed (draftsmith[speculators])"
)
needs_speculators = pytest.mark.skipif(not _have_speculators(), reason="speculators 0.9.0 not importable")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    r = tmp_path_factory.mktemp("cmp")
    capture(TARGET, make_corpus(r), r / "store", aux_layers=AUX)
    return r


@pytest.fixture(scope="module")
def target():
    from draftsmith.target_model import load_target

    return load_target(str(TARGET), dtype="fp32")


@pytest.fixture(scope="module")
def store(root):
    from draftsmith.train.heldout import open_store

    return open_store(root / "store", "cpu")


def _bench_args(root, work, *extra):
    return tc.parse_args(
        [
            "--target",
            str(TARGET),
            "--store",
            str(root / "store"),
            "--work",
            str(work),
            "--draft-vocab-size",
            str(V),
            "--ttt-steps",
            str(K),
            "--batch-tokens",
            str(B),
            "--steps",
            "10",
            "--eval-fraction",
            "0.25",
            *extra,
        ]
    )


# ------------------------------------------------------------------------------------------------ evaluator
def test_heldout_split_is_the_trainers(store):
    from draftsmith.train.batches import split_train_eval
    from draftsmith.train.heldout import heldout_split
    from draftsmith.train.trainer import TrainConfig

    assert heldout_split(store, 3, 0.25) == split_train_eval(len(store), 0.25, 3)
    assert heldout_split(len(store), 0) == split_train_eval(len(store), TrainConfig.eval_fraction, 0)
    tr, ev = heldout_split(store, 0, 0.25)
    assert ev and sorted(tr + ev) == list(range(len(store)))


def test_fresh_drafter_evaluates(store, target):
    from draftsmith.drafter import Drafter
    from draftsmith.train.heldout import evaluate_drafter, heldout_split

    d = Drafter.from_target(target, token_counts=store.token_counts(), aux_layer_ids=AUX, draft_vocab_size=V)
    _, ev = heldout_split(store, 0, 0.25)
    m = evaluate_drafter(d, target, store, ev, ttt_steps=K, batch_tokens=B, device="cpu")
    assert len(m["acc"]) == len(m["loss_k"]) == len(m["cond_acc"]) == K
    assert math.isfinite(m["loss"]) and all(math.isfinite(x) for x in m["loss_k"])
    assert all(0.0 <= a <= 1.0 for a in m["acc"])
    from draftsmith.train.heldout import tau_sim

    assert m["tau_sim"] == pytest.approx(tau_sim(m["acc"]))
    assert m["num_samples"] == len(ev) and m["num_rows"] >= 1 and m["valid_tokens"][0] > 0


def test_evaluator_reproduces_the_trainers_final_eval(root, store, target):
    """Same split, same numbers (1e-5) as the eval `draftsmith train` logged at its last step."""
    from draftsmith.drafter import Drafter
    from draftsmith.train import TrainConfig
    from draftsmith.train.heldout import evaluate_drafter, heldout_split
    from draftsmith.train.trainer import train

    run = root / "run"
    cfg = TrainConfig(
        target=str(TARGET),
        store=str(root / "store"),
        out=str(run),
        steps=3,
        ttt_steps=K,
        draft_vocab_size=V,
        batch_tokens=B,
        lr=3e-3,
        warmup=0,
        eval_fraction=0.25,
        seed=1,
        save_every=0,
        progress=False,
        tensorboard=False,
        plot=False,
    )
    last = train(cfg, log=lambda *a: None)
    assert "eval_tau_sim" in last
    d = Drafter.from_pretrained(run / "final", target=target, dtype=torch.float32)
    _, ev = heldout_split(store, seed=1, eval_fraction=0.25)
    m = evaluate_drafter(d, target, store, ev, ttt_steps=K, batch_tokens=B, device="cpu")
    for key in ("loss_k", "acc", "cond_acc", "tau_sim", "tau_sim_cond", "loss"):
        torch.testing.assert_close(
            torch.tensor(m[key], dtype=torch.float64),
            torch.tensor(last[f"eval_{key}"], dtype=torch.float64),
            rtol=0,
            atol=1e-5,
        )
    assert m["valid_tokens"] == last["eval_valid_tokens"]
    # the other split is scored differently (it is not the same data)
    tr, _ = heldout_split(store, seed=1, eval_fraction=0.25)
    assert (
        evaluate_drafter(d, target, store, tr[:5], ttt_steps=K, batch_tokens=B, device="cpu")["valid_tokens"]
        != m["valid_tokens"]
    )


# ------------------------------------------------------------------------------------------------ bench pieces
def test_split_plan_and_ratio():
    for n in (2, 3, 7, 21, 100, 1001, 123457):
        for n_train in {1, n // 2, n - 1} - {0}:
            r = tc.train_data_ratio(n_train, n)
            assert 0 < r < 1 and int(n * r) == n_train  # speculators: split_idx = int(len * train_ratio)
    p = tc.plan_split(21, 0, 0.25)
    assert p["row_to_sample"][: p["num_train_rows"]] == p["train_samples"]
    assert p["row_to_sample"][p["num_train_rows"] :] == p["eval_samples"]
    assert sorted(p["row_to_sample"]) == list(range(21))


def test_epochs_for_steps():
    assert tc.epochs_for_steps(10, [7, 7, 7]) == 2
    assert tc.epochs_for_steps(7, [7, 6]) == 1
    assert tc.epochs_for_steps(8, [7, 6]) == 2
    assert tc.epochs_for_steps(30, [7, 6]) == 2 + math.ceil(17 / 6)


def test_throughput_parsers(tmp_path):
    recs = [
        {
            "train": {"loss": 1.0},
            "profile": {"step_ms": 100.0, "tokens_per_s": 1000.0 * (1 + (s == 0))},
            "global_step": s,
        }
        for s in range(4)
    ] + [{"val": {"loss_epoch": 1.0}, "epoch": 0}]
    r = tc.speculators_throughput(recs, skip=1)
    assert r["timed_steps"] == 3 and r["tokens_per_s"] == pytest.approx(1000.0)
    assert r["tokens_trained"] == 200 + 3 * 100
    m = tmp_path / "metrics.jsonl"
    lines = [{"step": s, "tokens": 100, "elapsed_s": 0.5 + 0.1 * s} for s in range(1, 6)]
    lines[-1]["eval_tau_sim"] = 1.5
    lines[-1]["elapsed_s"] += 5.0  # the eval step is not a training-speed sample
    m.write_text("".join(json.dumps(x) + "\n" for x in lines))
    r = tc.draftsmith_throughput(m, skip=1)
    assert r["timed_steps"] == 3 and r["tokens_per_s"] == pytest.approx(1000.0)
    assert r["tokens_trained"] == 500 and r["final_eval_tau_sim"] == 1.5


def test_dry_run_prints_the_commands_and_runs_nothing(root, tmp_path, capsys):
    work = tmp_path / "w"
    assert (
        tc.main(
            [
                "--target",
                str(TARGET),
                "--store",
                str(root / "store"),
                "--work",
                str(work),
                "--draft-vocab-size",
                str(V),
                "--ttt-steps",
                str(K),
                "--batch-tokens",
                str(B),
                "--steps",
                "10",
                "--eval-fraction",
                "0.25",
                "--dry-run",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert not work.exists()
    spec = next(line for line in out.splitlines() if line.startswith("speculators: speculators train"))
    ds = next(line for line in out.splitlines() if line.startswith("draftsmith:  draftsmith train"))
    for flag in (
        "--on-missing raise",
        "--mask-token-id 0",
        "--loss-implementation eager",
        "--target-layer-ids 1 3 5",
        f"--draft-vocab-size {V}",
        f"--ttt-steps {K}",
        f"--total-seq-len {B}",
        "--max-steps 10",
        "--ttt-step-loss-decay 0.8",
        "--no-norm-before-fc",
        "--no-norm-output",
        "--full-attention-indices 0",
        f"--d2t-path {work.resolve()}/speculators_data/d2t-{V}.npy",
    ):
        assert flag in spec, flag
    ratio = tc.train_data_ratio(
        *(lambda p: (p["num_train_rows"], p["num_samples"]))(
            tc.plan_split(
                len(
                    __import__("draftsmith.store", fromlist=["HiddenStateStore"]).HiddenStateStore.open(root / "store")
                ),
                0,
                0.25,
            )
        )
    )
    assert f"--train-data-ratio {ratio!r}" in spec
    for flag in (
        "--steps 10",
        f"--ttt-steps {K}",
        f"--draft-vocab-size {V}",
        f"--batch-tokens {B}",
        "--eval-fraction 0.25",
        "--seed 0",
        "--grad-clip 1.0",
    ):
        assert flag in ds, flag


def test_draftsmith_parser_accepts_the_command(root, tmp_path):
    """The constructed `draftsmith train` argv parses (typer) into the intended TrainConfig."""
    from typer.testing import CliRunner

    import draftsmith.train.trainer as trainer_mod
    from draftsmith.cli import app

    a = _bench_args(root, tmp_path / "w")
    seen = {}

    def fake_train(cfg, **kw):
        seen["cfg"] = cfg

    orig = trainer_mod.train
    trainer_mod.train = fake_train
    try:
        res = CliRunner().invoke(app, tc.draftsmith_argv(a, run_dir=tmp_path / "run"))
    finally:
        trainer_mod.train = orig
    assert res.exit_code == 0, res.output
    c = seen["cfg"]
    assert (c.steps, c.ttt_steps, c.draft_vocab_size, c.batch_tokens, c.eval_fraction, c.grad_clip, c.step_weight) == (
        10,
        K,
        V,
        B,
        0.25,
        1.0,
        0.8,
    )
    assert c.attn_backend == "auto" and c.num_layers == 1 and c.weight_decay == 0.0 and c.warmup == 0.015
    a2 = _bench_args(root, tmp_path / "w", "--attn-backend", "chunked", "--ds-extra", "--attn-chunk 512")
    argv = tc.draftsmith_argv(a2, run_dir=tmp_path / "run")
    assert argv[argv.index("--attn-backend") + 1] == "chunked" and argv[-2:] == ["--attn-chunk", "512"]


@needs_datasets
def test_export_puts_the_heldout_rows_last(root, store, tmp_path):
    from datasets import load_from_disk
    from safetensors.torch import load_file

    from draftsmith.drafter.vocab import build_draft_vocab

    split = tc.plan_split(len(store), 0, 0.25)
    out = tmp_path / "exp"
    tc.export_split(store, out, split, V, progress=False)
    ds = load_from_disk(str(out))
    assert len(ds) == len(store)
    for r, i in enumerate(split["row_to_sample"]):
        want = store[i]["input_ids"].to(torch.long)
        assert torch.equal(torch.as_tensor(ds[r]["input_ids"]).long(), want)
        assert torch.equal(load_file(str(out / "hidden_states" / f"hs_{r}.safetensors"))["token_ids"], want)
    assert json.loads((out / tc.SPLIT_FILE).read_text())["row_to_sample"] == split["row_to_sample"]
    import numpy as np

    d2t, t2d = build_draft_vocab(store.token_counts(), V)
    assert torch.equal(torch.from_numpy(np.load(out / f"d2t-{V}.npy")), d2t)
    assert torch.equal(torch.from_numpy(np.load(out / f"t2d-{V}.npy")), t2d)
    if _have_speculators():  # speculators' own dataset split = ours
        from speculators.train.data import ArrowDataset

        val = ArrowDataset(
            max_len=B,
            datapath=out,
            on_missing="raise",
            train_ratio=split["train_data_ratio"],
            split="val",
            hidden_states_dtype=torch.float32,
        )
        train = ArrowDataset(
            max_len=B,
            datapath=out,
            on_missing="raise",
            train_ratio=split["train_data_ratio"],
            split="train",
            hidden_states_dtype=torch.float32,
        )
        assert len(train) == len(split["train_samples"]) and len(val) == len(split["eval_samples"])
        for j, i in enumerate(split["eval_samples"]):
            assert torch.equal(val[j]["input_ids"], store[i]["input_ids"].long())
        for j, i in enumerate(split["train_samples"]):
            assert torch.equal(train[j]["input_ids"], store[i]["input_ids"].long())


@needs_speculators
def test_speculators_parser_resolves_the_command(root, tmp_path):
    from speculators.train.config import TrainConfig

    a = _bench_args(root, tmp_path / "w")
    P = tc.plan(a)
    cfg = TrainConfig.resolve(P["spec_argv"])
    f = cfg.flatten()
    want = {
        "speculator_type": "eagle3",
        "verifier_name_or_path": str(TARGET),
        "target_layer_ids": [1, 3, 5],
        "hidden_states_dtype": "bfloat16",
        "on_missing": "raise",
        "mask_token_id": 0,
        "loss_implementation": "eager",
        "draft_vocab_size": V,
        "ttt_steps": K,
        "ttt_step_loss_decay": 0.8,
        "total_seq_len": B,
        "train_data_ratio": P["split"]["train_data_ratio"],
        "max_steps": 10,
        "epochs": P["spec_epochs"],
        "optimizer": "adamw",
        "lr": 1e-4,
        "weight_decay": 0.0,
        "scheduler_type": "cosine",
        "scheduler_warmup_ratio": 0.015,
        "num_layers": 1,
        "norm_before_fc": False,
        "norm_output": False,
        "norm_before_residual": False,
        "full_attention_indices": [0],
        "seed": 0,
        "log_freq": 1,
    }
    for k, v in want.items():
        assert f[k] == v, (k, f[k], v)
    # epochs: the fewest that hold --max-steps packed batches of speculators' own sampler
    per = P["spec_batches_per_epoch"]
    assert sum(per[: P["spec_epochs"]]) >= 10 > sum(per[: P["spec_epochs"] - 1])


@needs_speculators
def test_speculators_cli_builds_a_drafter_we_can_score(root, store, target, tmp_path):
    """speculators' real CLI (through this script's runner, in a subprocess) with the constructed argv and its own
    --dry-run: vocab mappings, draft model from the verifier, checkpoint — which Drafter.from_pretrained loads
    (same aux layers, same draft vocab, full attention) and evaluate_drafter scores."""
    from draftsmith.drafter import Drafter
    from draftsmith.train.heldout import evaluate_drafter

    a = _bench_args(root, tmp_path / "w")
    P = tc.plan(a)
    tc.export_split(P["store"], P["export_dir"], P["split"], V, progress=False)
    stats = tmp_path / "stats.json"
    cp = subprocess.run(
        tc._runner_cmd("speculators", stats, P["spec_argv"] + ["--dry-run"]),
        env=tc._env(),
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=120,
    )
    st = json.loads(stats.read_text())
    assert cp.returncode == 0 and st["rc"] == 0, (st.get("error"), cp.stderr[-3000:])
    ckpt = Path(P["work"]) / "speculators_run"
    conf = json.loads((ckpt / "config.json").read_text())
    assert conf["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert conf["transformer_layer_config"].get("layer_types", ["full_attention"]) == ["full_attention"]
    assert not conf["norm_before_fc"] and not conf["norm_output"] and not conf["norm_before_residual"]
    d = Drafter.from_pretrained(ckpt, target=target, dtype=torch.float32)
    assert d.config.aux_layer_ids == AUX and d.config.draft_vocab_size == V
    from draftsmith.drafter.vocab import build_draft_vocab

    assert torch.equal(d.d2t.cpu(), build_draft_vocab(store.token_counts(), V)[0])
    m = evaluate_drafter(d, target, store, P["split"]["eval_samples"], ttt_steps=K, batch_tokens=B, device="cpu")
    assert len(m["acc"]) == K and math.isfinite(m["loss"])


_CPU_DRIVER = """
# CPU stand-in for the accelerator speculators' Trainer assumes (test only): model/batches on 'cpu', no pinning,
# no device sync/memory stats; then exactly train_compare's runner (speculators' CLI code + metric capture).
import sys, json, torch
sys.path.insert(0, {bench!r})
import speculators.train.trainer as st
st.get_local_rank = lambda: "cpu"
torch.accelerator.synchronize = lambda *a, **k: None
torch.accelerator.current_accelerator = lambda *a, **k: torch.device("cpu")
torch.accelerator.memory_allocated = lambda *a, **k: 0
torch.Tensor.pin_memory = lambda self, *a, **k: self
if not hasattr(torch.cpu, "empty_cache"):
    torch.cpu.empty_cache = lambda: None
import train_compare as tc
from pathlib import Path
sys.exit(tc.run_speculators_inprocess(json.loads(sys.argv[1]), Path(sys.argv[2])))
"""


@needs_speculators
def test_speculators_training_run_is_logged_and_scored(root, store, target, tmp_path):
    """speculators' real train loop (CPU stand-in for its accelerator, sdpa attention) with the constructed argv:
    the runner captures its per-step metric log, --epochs/--max-steps give exactly --steps steps, the last epoch
    checkpoint is found, loads as a Drafter and is scored by evaluate_drafter."""
    a = _bench_args(root, tmp_path / "w", "--spec-workers", "0", "--spec-extra", "--draft-attn-impl sdpa")
    P = tc.plan(a)
    tc.export_split(P["store"], P["export_dir"], P["split"], V, progress=False)
    driver = tmp_path / "driver.py"
    driver.write_text(_CPU_DRIVER.format(bench=str(REPO / "bench")))
    stats = tmp_path / "stats.json"
    cp = subprocess.run(
        [sys.executable, str(driver), json.dumps(P["spec_argv"]), str(stats)],
        env=tc._env(),
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=180,
    )
    st = json.loads(stats.read_text())
    assert cp.returncode == 0 and st["rc"] == 0, (st.get("error"), cp.stderr[-3000:])
    train_recs = [r for r in st["metrics"] if "train" in r]
    assert [r["global_step"] for r in train_recs] == list(range(10))
    assert all(isinstance(r["lr"], float) for r in train_recs)  # one optimizer (AdamW); Muon would log a dict
    assert any("val" in r for r in st["metrics"])
    thr = tc.speculators_throughput(st["metrics"], skip=2)
    assert thr["timed_steps"] == 8 and thr["tokens_per_s"] > 0
    # every real training token counted: 10 packed rows of the training split
    assert 0 < thr["tokens_trained"] <= 10 * B
    ckpt = tc.latest_speculators_checkpoint(Path(P["work"]) / "speculators_run")
    assert ckpt is not None and ckpt.name == str(P["spec_epochs"] - 1)
    from draftsmith.drafter import Drafter
    from draftsmith.train.heldout import evaluate_drafter

    d = Drafter.from_pretrained(ckpt, target=target, dtype=torch.float32)
    m = evaluate_drafter(d, target, store, P["split"]["eval_samples"], ttt_steps=K, batch_tokens=B, device="cpu")
    assert len(m["acc"]) == K and math.isfinite(m["loss"])
