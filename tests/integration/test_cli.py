"""The CLI surface: contract flags exist, help teaches, inspect handles targets and drafters."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from draftsmith.cli import app

runner = CliRunner()


def test_help_lists_stages():
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0
    for cmd in ("capture", "store", "inspect", "export"):
        assert cmd in r.output


@pytest.mark.parametrize(
    "cmd,flags",
    [
        (
            ["capture"],
            ["--target", "--data", "--out", "--aux-layers", "--max-length", "--dtype", "--batch-tokens", "--on-bad"],
        ),
        (["train"], ["--target", "--store", "--out", "--steps", "--ttt-steps", "-K", "--config", "--online", "--lr"]),
        (["store", "export"], ["--format", "--out"]),
        (["export"], ["--format", "--out"]),
    ],
)
def test_contract_flags(cmd, flags):
    r = runner.invoke(app, [*cmd, "--help"], terminal_width=200)
    assert r.exit_code == 0, r.output
    for f in flags:
        assert f in r.output, f
    if cmd == ["capture"]:
        assert "LAYER-OUTPUT" in r.output  # --aux-layers names its convention


def test_inspect_target_and_drafter(tiny_path, tmp_path):
    r = runner.invoke(app, ["inspect", str(tiny_path)])
    assert r.exit_code == 0
    assert "[1, 2, 3]" in r.output and "[2, 3, 4]" in r.output
    from draftsmith.drafter import Drafter

    Drafter.from_target(str(tiny_path), aux_layer_ids=[0, 2, 4], draft_vocab_size=512).save_pretrained(tmp_path / "d")
    r = runner.invoke(app, ["inspect", str(tmp_path / "d"), "--target", str(tiny_path)])
    assert r.exit_code == 0, r.output
    assert "layer-output ids [0, 2, 4] = hidden_states ids [1, 3, 5]" in r.output
    assert "yes" in r.output
