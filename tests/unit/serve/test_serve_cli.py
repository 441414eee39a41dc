"""`draftsmith serve`'s options: its engine and decode-mode flags are generate's (draftsmith/decode/config.py),
checked before the server's dependencies or any model load."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from draftsmith.cli import app, main


def _params(name: str) -> dict[str, object]:
    return {p.name: p for p in typer.main.get_command(app).commands[name].params}


def test_serve_has_generates_engine_and_mode_flags():
    serve, gen = _params("serve"), _params("generate")
    shared = [n for n in serve if n in gen]
    engine_and_mode = {"device", "dtype", "backend", "cuda_graphs", "compile", "attn_impl", "kernels"}
    engine_and_mode |= {"plain", "draft_tokens", "tree", "top_k_draft", "depth", "tree_tokens"}
    assert engine_and_mode <= set(shared)
    for n in engine_and_mode:
        a, b = serve[n], gen[n]
        assert (a.opts, a.secondary_opts, a.default, a.help) == (b.opts, b.secondary_opts, b.default, b.help), n


def test_serve_own_flags_stay():
    r = CliRunner().invoke(app, ["serve", "--help"], terminal_width=240, env={"COLUMNS": "240"})
    assert r.exit_code == 0, r.output
    for f in ("--host", "--port", "--api-key", "--max-queue", "--capture-to", "--log-level", "--draft-tokens"):
        assert f in r.output, f


def test_serve_bad_engine_value_before_loading(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--target", str(tmp_path / "missing"), "--backend", "vllm"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --backend: must be one of auto, llama, hf, got 'vllm'"
