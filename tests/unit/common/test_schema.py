"""The stage schemas (draftsmith.common.schema): flags, --config YAML, help and checks come from one declaration.

Everything runs in-process through `draftsmith.cli.main` (no subprocess, no training: the run functions are
replaced), so each bad value costs milliseconds."""

from __future__ import annotations

import dataclasses
import re

import pytest
from typer.testing import CliRunner

from draftsmith.capture.config import CaptureConfig
from draftsmith.cli import app, main
from draftsmith.common.errors import DraftsmithError
from draftsmith.common.schema import (
    check_max_new_tokens,
    check_temperature,
    check_top_k,
    check_top_p,
    fields_of,
)
from draftsmith.train.config import TrainConfig

TRAIN = ["train", "-t", "T", "-s", "S", "-o", "O"]
CAPTURE = ["capture", "-t", "T", "-d", "D", "-o", "O"]


@pytest.fixture
def captured(monkeypatch):
    """Replace the train and capture jobs: the configs the commands would run with land in the returned list."""
    import draftsmith.capture.job as job
    import draftsmith.train.trainer as trainer

    seen = []
    monkeypatch.setattr(trainer, "train", lambda cfg, **kw: seen.append(cfg))
    monkeypatch.setattr(job, "run_capture", lambda cfg, **kw: seen.append(cfg))
    return seen


def _ok(argv) -> None:
    """Run the CLI expecting success (click's standalone mode ends with SystemExit(0))."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0


def _fails(argv, capsys) -> str:
    """Run the CLI expecting exit code 2; the one stderr line."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(
    "argv,line",
    [
        # at least 1
        (TRAIN + ["--steps", "0"], "--steps: must be >= 1, got 0"),
        (TRAIN + ["--steps", "-3"], "--steps: must be >= 1, got -3"),
        (TRAIN + ["--draft-vocab-size", "0"], "--draft-vocab-size: must be >= 1, got 0"),
        (TRAIN + ["--batch-tokens", "0"], "--batch-tokens: must be >= 1, got 0"),
        (TRAIN + ["-K", "0"], "--ttt-steps: must be >= 1, got 0"),
        (CAPTURE + ["--max-samples", "-5"], "--max-samples: must be >= 1, got -5"),
        (CAPTURE + ["--max-samples", "0"], "--max-samples: must be >= 1, got 0"),
        (CAPTURE + ["--writers", "0"], "--writers: must be >= 1, got 0"),
        # positive, non-negative
        (TRAIN + ["--lr", "-1"], "--lr: must be > 0, got -1"),
        (TRAIN + ["--epochs", "-1"], "--epochs: must be > 0, got -1"),
        (TRAIN + ["--grad-clip", "-0.5"], "--grad-clip: must be >= 0, got -0.5"),
        # finite
        (TRAIN + ["--lr", "nan"], "--lr: must be a finite number, got nan"),
        (TRAIN + ["--step-weight", "inf"], "--step-weight: must be a finite number, got inf"),
        # ranges
        (TRAIN + ["--eval-fraction", "1.5"], "--eval-fraction: must be in [0, 1), got 1.5"),
        (TRAIN + ["--min-lr-ratio", "2"], "--min-lr-ratio: must be in [0, 1], got 2"),
        # choices
        (TRAIN + ["--compile", "fast"], "--compile: must be one of auto, unroll, step, on, off, got 'fast'"),
        (CAPTURE + ["--dtype", "fp16"], "--dtype: must be one of bf16, fp8, got 'fp16'"),
        (TRAIN + ["--device", "gpu0"], "--device: must be auto, cpu, cuda, cuda:N, mps or xpu[:N], got 'gpu0'"),
        (CAPTURE + ["--device", "cuda:x"], "--device: must be auto, cpu, cuda, cuda:N, mps or xpu[:N], got 'cuda:x'"),
        # types
        (TRAIN + ["--steps", "abc"], "--steps: expected an integer, got 'abc'"),
        (TRAIN + ["--steps", "1.5"], "--steps: expected an integer, got '1.5'"),
        (TRAIN + ["--lr", "fast"], "--lr: expected a number, got 'fast'"),
        (TRAIN + ["--aux-layers", "1,x"], "--aux-layers: expected comma-separated integers, got '1,x'"),
        (CAPTURE + ["--aux-layers", "1,-2"], "--aux-layers: must be >= 0, got -2"),
        # required and combinations
        (["train", "-s", "S", "-o", "O"], "--target: required"),
        (["capture", "-t", "T", "-o", "O"], "--data: required"),
        (TRAIN + ["--steps", "3", "--epochs", "1"], "--steps and --epochs: give one, not both"),
        (["train", "-t", "T", "-o", "O", "--online"], "--online: needs --data FILE_OR_DIR"),
        (
            CAPTURE + ["--aux-layers", "1", "--aux-hidden-states-ids", "2"],
            "give either --aux-layers (layer-output ids) or --aux-hidden-states-ids, not both",
        ),
    ],
)
def test_bad_value_is_one_line_naming_the_flag(argv, line, capsys, captured):
    assert _fails(argv, capsys) == "error: " + line
    assert not captured


def _yaml(tmp_path, text, name="train.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize(
    "text,says",
    [
        ("optim:\n  lrr: 1\n", "field 'optim.lrr': unknown (did you mean 'lr'?)"),
        ("stpes: 3\n", "field 'stpes': unknown (did you mean 'steps'?)"),
        ("zzz: 3\n", "field 'zzz': unknown (`--help` lists the fields)"),
        ("optim:\n  seed: 1\n", "field 'optim.seed': belongs to group 'data', not 'optim'"),
        ("optim: 3\n", "field 'optim': a group, expected a mapping of its fields, got 3"),
        ("lr: abc\n", "field 'lr': expected a number, got 'abc'"),
        ("optim:\n  steps: 1.5\n", "field 'optim.steps': expected an integer, got 1.5 (float)"),
        ("online: 'yes'\n", "field 'online': expected true or false, got 'yes'"),
        ("aux_layers: [1, two]\n", "field 'aux_layers': expected a list of integers, got [1, 'two'] (list)"),
        ("optim:\n  steps: 0\n", "field 'optim.steps': must be >= 1, got 0"),
        ("ttt:\n  step_weight: .nan\n", "field 'ttt.step_weight': must be a finite number, got nan"),
        ("steps: 3\noptim:\n  steps: 4\n", "field 'optim.steps': given twice (also as 'steps')"),
        ("- steps\n", "expected a mapping of field: value"),
    ],
)
def test_yaml_errors_name_file_and_field(text, says, tmp_path, capsys, captured):
    path = _yaml(tmp_path, text)
    line = _fails(TRAIN + ["--config", path], capsys)
    assert line.startswith(f"error: {path}: ") and says in line, line
    assert not captured


def test_yaml_syntax_error_names_the_line(tmp_path, capsys):
    path = _yaml(tmp_path, "steps: 3\noptim: {lr: [\n")
    assert re.match(rf"error: {re.escape(path)}:\d+: invalid YAML", _fails(TRAIN + ["-c", path], capsys))


def test_yaml_nested_flat_and_flags_give_one_config(tmp_path, captured):
    """The same settings as flags, as flat YAML keys (snake or kebab case) and nested under their groups: one config.
    Flags override the file."""
    flags = [
        "--steps",
        "5",
        "-K",
        "3",
        "--lr",
        "3e-4",
        "--eval-fraction",
        "0",
        "--aux-layers",
        "0,2,4",
        "--no-tensorboard",
        "--pad-to-budget",
        "--compile",
        "off",
        "-q",
        "--online",
        "-d",
        "data.jsonl",
    ]
    _ok(["train", "-t", "T", "-o", "O", *flags])
    flat = _yaml(
        tmp_path,
        "target: T\nout: O\nsteps: 5\nttt-steps: 3\nlr: 3e-4\neval_fraction: 0\n"
        "aux_layers: [0, 2, 4]\ntensorboard: false\npad_to_budget: true\ncompile: 'off'\n"
        "progress: false\nonline: true\ndata: data.jsonl\n",
        "flat.yaml",
    )
    _ok(["train", "--config", flat])
    nested = _yaml(
        tmp_path,
        "data: {target: T, online: true, data: data.jsonl, pad-to-budget: true, "
        "eval_fraction: 0.0}\noutput: {out: O}\noptim: {steps: 5, lr: 0.0003}\n"
        "ttt: {ttt_steps: 3}\ndrafter: {aux_layers: '0,2,4'}\ncompile: {compile: 'off'}\n"
        "logging: {tensorboard: false, progress: false}\n",
        "nested.yaml",
    )
    _ok(["train", "-c", nested])
    _ok(["train", "-c", nested, "--lr", "1e-3", "-K", "2"])  # flags override the file
    assert len(captured) == 4
    first = dataclasses.asdict(captured[0])
    assert first["lr"] == 3e-4 and first["ttt_steps"] == 3 and first["progress"] is False
    assert first["pad_to_budget"] is True and first["tensorboard"] is False and first["aux_layers"] == [0, 2, 4]
    assert dataclasses.asdict(captured[1]) == first
    assert dataclasses.asdict(captured[2]) == first
    assert dataclasses.asdict(captured[3]) == {**first, "lr": 1e-3, "ttt_steps": 2}
    assert (
        dataclasses.asdict(
            TrainConfig(
                target="T",
                out="O",
                **{
                    k: first[k]
                    for k in (
                        "steps",
                        "ttt_steps",
                        "lr",
                        "eval_fraction",
                        "aux_layers",
                        "tensorboard",
                        "pad_to_budget",
                        "compile",
                        "progress",
                        "online",
                        "data",
                    )
                },
            )
        )
        == first
    )  # the Python API builds the same


def test_yaml_old_alias_and_capture_config(tmp_path, captured):
    _ok(["train", "-t", "T", "-s", "S", "-o", "O", "-c", _yaml(tmp_path, "ttt: 4\n")])  # `ttt` = ttt_steps
    path = _yaml(
        tmp_path,
        "target: {target: T, aux_layers: [1, 3]}\ndata: {data: D, max_samples: 8}\noutput: {out: O, dtype: fp8}\n",
        "capture.yaml",
    )
    _ok(["capture", "-c", path, "--no-final", "--aux-hidden-states-ids", "3,5"])
    train_cfg, cap = captured
    assert train_cfg.ttt_steps == 4
    assert isinstance(cap, CaptureConfig)
    assert (cap.target, cap.data, cap.out, cap.max_samples, cap.dtype) == ("T", "D", "O", 8, "fp8")
    assert cap.capture_final is False and cap.aux_layers == [2, 4]  # hidden_states ids 3,5 = layer-output 2,4


# The flags and short aliases of the commands before the schema: contracts checked from outside the repository.
OLD_TRAIN_FLAGS = [
    "--target",
    "-t",
    "--store",
    "-s",
    "--out",
    "-o",
    "--steps",
    "--epochs",
    "--ttt-steps",
    "-K",
    "--draft-vocab-size",
    "--online",
    "--data",
    "-d",
    "--resume",
    "--config",
    "-c",
    "--lr",
    "--min-lr-ratio",
    "--warmup",
    "--weight-decay",
    "--grad-clip",
    "--batch-tokens",
    "--grad-accum",
    "--step-weight",
    "--eval-fraction",
    "--eval-every",
    "--save-every",
    "--keep-checkpoints",
    "--log-every",
    "--seed",
    "--num-layers",
    "--aux-layers",
    "--freeze-lm-head",
    "--fsdp",
    "--device",
    "--dtype",
    "--attn-backend",
    "--attn-chunk",
    "--loss-chunk",
    "--max-length",
    "--max-time",
    "--on-bad",
    "--compile",
    "--glob",
    "--quiet",
    "-q",
]
OLD_CAPTURE_FLAGS = [
    "--target",
    "-t",
    "--data",
    "-d",
    "--out",
    "-o",
    "--aux-layers",
    "--aux-hidden-states-ids",
    "--max-length",
    "--dtype",
    "--batch-tokens",
    "--on-bad",
    "--shard-mb",
    "--writers",
    "--shard-tokens",
    "--device",
    "--model-dtype",
    "--no-final",
    "--cuda-graphs",
    "--tp",
    "--glob",
    "--max-samples",
    "--quiet",
    "-q",
]


def test_every_old_train_flag_still_parses(captured):
    _ok(
        [
            "train",
            "--target",
            "T",
            "--store",
            "S",
            "--out",
            "O",
            "--steps",
            "7",
            "-K",
            "2",
            "--draft-vocab-size",
            "64",
            "--resume",
            "--lr",
            "0.01",
            "--min-lr-ratio",
            "0.1",
            "--warmup",
            "3",
            "--weight-decay",
            "0.01",
            "--grad-clip",
            "0",
            "--batch-tokens",
            "128",
            "--grad-accum",
            "2",
            "--step-weight",
            "0.5",
            "--eval-fraction",
            "0.25",
            "--eval-every",
            "2",
            "--save-every",
            "0",
            "--keep-checkpoints",
            "0",
            "--log-every",
            "2",
            "--seed",
            "-1",
            "--num-layers",
            "2",
            "--aux-layers",
            "[1, 2, 3]",
            "--freeze-lm-head",
            "--fsdp",
            "--device",
            "cpu",
            "--dtype",
            "bf16",
            "--attn-backend",
            "chunked",
            "--attn-chunk",
            "64",
            "--loss-chunk",
            "0",
            "--max-length",
            "96",
            "--max-time",
            "60",
            "--on-bad",
            "skip",
            "--compile",
            "step",
            "--glob",
            "*.py",
            "-q",
        ]
    )
    _ok(["train", "-t", "T", "-s", "S", "-o", "O", "--epochs", "0.5", "--ttt-steps", "3", "--quiet"])
    c, e = captured
    assert (c.target, c.store, c.out, c.steps, c.ttt_steps, c.draft_vocab_size, c.resume) == (
        "T",
        "S",
        "O",
        7,
        2,
        64,
        True,
    )
    assert (c.lr, c.min_lr_ratio, c.warmup, c.weight_decay, c.grad_clip) == (0.01, 0.1, 3.0, 0.01, 0.0)
    assert (c.batch_tokens, c.grad_accum, c.step_weight, c.eval_fraction, c.eval_every) == (128, 2, 0.5, 0.25, 2)
    assert (c.save_every, c.keep_checkpoints, c.log_every, c.seed, c.num_layers) == (0, 0, 2, -1, 2)
    assert (c.aux_layers, c.freeze_lm_head, c.fsdp, c.device, c.dtype) == ([1, 2, 3], True, True, "cpu", "bf16")
    assert (c.attn_backend, c.attn_chunk, c.loss_chunk, c.max_length, c.max_time) == ("chunked", 64, 0, 96, 60.0)
    assert (c.on_bad, c.compile, c.glob, c.progress, c.tensorboard) == ("skip", "step", "*.py", False, True)
    assert (e.epochs, e.steps, e.ttt_steps, e.progress, e.online) == (0.5, None, 3, False, False)


def test_every_old_capture_flag_still_parses(captured):
    _ok(
        [
            "capture",
            "--target",
            "T",
            "--data",
            "D",
            "--out",
            "O",
            "--aux-layers",
            "1 4 7",
            "--max-length",
            "64",
            "--dtype",
            "fp8",
            "--batch-tokens",
            "512",
            "--on-bad",
            "skip",
            "--shard-mb",
            "8",
            "--writers",
            "1",
            "--shard-tokens",
            "700",
            "--device",
            "cpu",
            "--model-dtype",
            "fp32",
            "--no-final",
            "--cuda-graphs",
            "--tp",
            "--glob",
            "*.txt",
            "--max-samples",
            "5",
            "--quiet",
        ]
    )
    _ok(["capture", "-t", "T", "-d", "D", "-o", "O", "-q"])
    c, d = captured
    assert (c.target, c.data, c.out, c.aux_layers, c.max_length, c.dtype) == ("T", "D", "O", [1, 4, 7], 64, "fp8")
    assert (c.batch_tokens, c.on_bad, c.shard_mb, c.writers, c.shard_tokens) == (512, "skip", 8, 1, 700)
    assert (c.device, c.model_dtype, c.capture_final, c.cuda_graphs, c.tp) == ("cpu", "fp32", False, True, True)
    assert (c.glob, c.max_samples, c.progress) == ("*.txt", 5, False)
    assert dataclasses.asdict(d) == dataclasses.asdict(CaptureConfig(target="T", data="D", out="O", progress=False))


def _flat_help(argv) -> str:
    out = CliRunner().invoke(app, argv, env={"TERMINAL_WIDTH": "240", "COLUMNS": "240"}).output
    return " ".join(out.replace("│", " ").split())


@pytest.mark.parametrize(
    "cmd,schema,old", [("train", TrainConfig, OLD_TRAIN_FLAGS), ("capture", CaptureConfig, OLD_CAPTURE_FLAGS)]
)
def test_help_lists_every_field_with_its_help(cmd, schema, old):
    text = _flat_help([cmd, "--help"])
    for flag in old:
        assert re.search(rf"(^|\s){re.escape(flag)}(\s|/|$)", text), flag
    for info in fields_of(schema).values():
        assert info.flag in text, info.name
        assert info.spec.help[:40] in text, info.name
        for check in info.spec.checks:
            if check.in_help:
                assert check.says in text, (info.name, check.says)


def test_python_api_checks_the_same_bounds():
    with pytest.raises(DraftsmithError, match=r"^--steps: must be >= 1, got 0$"):
        TrainConfig(steps=0)
    with pytest.raises(DraftsmithError, match=r"^--eval-fraction: must be in \[0, 1\), got 1$"):
        TrainConfig(eval_fraction=1.0)
    with pytest.raises(DraftsmithError, match=r"^--max-samples: must be >= 1, got 0$"):
        CaptureConfig(target="T", data="D", out="O", max_samples=0)
    assert TrainConfig(max_time=0.0, eval_fraction=0).max_time == 0.0  # 0 = stop after one step; no held-out split


@pytest.mark.parametrize(
    "check,value,says",
    [
        (check_temperature, float("nan"), "must be a finite number, got nan"),
        (check_temperature, float("inf"), "must be a finite number, got inf"),
        (check_temperature, -1.0, "must be >= 0, got -1"),
        (check_top_p, 0.0, "must be in (0, 1], got 0"),
        (check_top_p, 1.5, "must be in (0, 1], got 1.5"),
        (check_top_k, -3, "must be >= 0, got -3"),
        (check_max_new_tokens, 0, "must be >= 1, got 0"),
        (check_max_new_tokens, -5, "must be >= 1, got -5"),
    ],
)
def test_sampling_checks(check, value, says):
    with pytest.raises(DraftsmithError) as e:
        check("--x", value)
    assert str(e.value) == "--x: " + says
    for ok in (0.0, 1.0) if check in (check_temperature,) else (1,):
        check("--x", ok)


@pytest.mark.parametrize("cmd", [TRAIN, CAPTURE])
def test_trust_remote_code_flag_scopes_the_run(cmd, monkeypatch):
    """train/capture --trust-remote-code lets the target loaders run a model directory's code (the refusal message
    names this flag); without it they do not."""
    import draftsmith.capture.job as job
    import draftsmith.train.trainer as trainer
    from draftsmith.target_model.load import TRUST_REMOTE_CODE_ENV, trust_remote_code

    monkeypatch.delenv(TRUST_REMOTE_CODE_ENV, raising=False)
    trusted = []
    monkeypatch.setattr(trainer, "train", lambda cfg, **kw: trusted.append(trust_remote_code()))
    monkeypatch.setattr(job, "run_capture", lambda cfg, **kw: trusted.append(trust_remote_code()))
    _ok(cmd)
    _ok(cmd + ["--trust-remote-code"])
    assert trusted == [False, True] and trust_remote_code() is False
