"""The engine, decode-mode and sampling options of generate, eval and serve come from one schema
(draftsmith/decode/config.py): the same names and defaults in the three commands, checked as they are parsed."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from draftsmith.cli import app, main
from draftsmith.common.errors import DraftsmithError
from draftsmith.common.schema import fields_of
from draftsmith.decode.config import (
    ATTN_IMPLS,
    BACKENDS,
    KERNELS,
    EngineConfig,
    EvalSamplingConfig,
    ModeConfig,
    SamplingConfig,
    parse_temperatures,
)

# The flags external checks use: a change here is a contract change (see issue 15).
ENGINE_FLAGS = {
    "--device": "auto",
    "--dtype": "auto",
    "--backend": "auto",
    "--cuda-graphs": True,
    "--compile": False,
    "--attn-impl": "auto",
    "--kernels": "torch",
    "--kernel-rows": 0,
    "--cluster-gemm": "off",
}
MODE_FLAGS = {"--draft-tokens": 4, "--tree": False, "--top-k-draft": 8, "--depth": 5, "--tree-tokens": 32}


def _options(name: str) -> dict[str, object]:
    """{long flag: click default} of one command, as typer builds it."""
    cmd = typer.main.get_command(app).commands[name]
    return {p.opts[0]: p for p in cmd.params if p.opts}


def _effective_default(param, schemas) -> object:
    for s in schemas:
        info = fields_of(s).get(param.name)
        if info is not None:
            assert param.default is None  # "not given": the schema's default applies
            return info.default
    return param.default


@pytest.mark.parametrize(
    "name,schemas",
    [
        ("generate", (EngineConfig, ModeConfig, SamplingConfig)),
        ("eval", (EngineConfig, ModeConfig, EvalSamplingConfig)),
        ("serve", (EngineConfig, ModeConfig)),
    ],
)
def test_commands_share_engine_and_mode_flags(name, schemas):
    opts = _options(name)
    got = {f: _effective_default(opts[f], schemas) for f in (*ENGINE_FLAGS, *MODE_FLAGS) if f in opts}
    want = {**ENGINE_FLAGS, **MODE_FLAGS}
    assert got == want, name
    cg = opts["--cuda-graphs"]
    assert cg.secondary_opts == ["--no-cuda-graphs"]
    # --plain: generate and serve (eval always measures plain decoding as its baseline)
    assert ("--plain" in opts) == (name != "eval")
    # the same help line in all three: one declaration
    assert opts["--kernels"].help == _options("generate")["--kernels"].help


def test_sampling_flags_of_generate_and_eval():
    gen, ev = _options("generate"), _options("eval")
    defaults = {
        f: _effective_default(gen[f], (SamplingConfig,)) for f in ("--max-new-tokens", "--temperature", "--top-p")
    }
    assert defaults == {"--max-new-tokens": 128, "--temperature": 0.0, "--top-p": 1.0}
    assert _effective_default(gen["--top-k"], (SamplingConfig,)) == 0
    assert _effective_default(gen["--seed"], (SamplingConfig,)) is None
    assert "--temperature" not in ev and _effective_default(ev["--temperatures"], (EvalSamplingConfig,)) == "0,1"
    assert _effective_default(ev["--max-new-tokens"], (EvalSamplingConfig,)) == 256
    assert _effective_default(ev["--seed"], (EvalSamplingConfig,)) == 0
    assert "--temperatures" not in gen


def test_choices_match_the_engine():
    from draftsmith.decode.llama import ATTENTION_IMPLS

    assert ATTN_IMPLS == ("auto", *ATTENTION_IMPLS)
    assert KERNELS == ("torch", "triton") and BACKENDS == ("auto", "llama", "hf")


@pytest.mark.parametrize(
    "argv,line",
    [
        (["generate", "--prompt", "x", "--draft-tokens", "0"], "--draft-tokens: must be in [1, 250], got 0"),
        (["generate", "--prompt", "x", "--top-p", "0"], "--top-p: must be in (0, 1], got 0"),
        (["generate", "--prompt", "x", "--temperature", "nan"], "--temperature: must be a finite number, got nan"),
        (["generate", "--prompt", "x", "--max-new-tokens", "ten"], "--max-new-tokens: expected an integer, got 'ten'"),
        (["eval", "--drafter", "d", "--prompts", "p", "--temperatures", "0,-1"], "--temperatures: must be"),
        (["eval", "--drafter", "d", "--prompts", "p", "--kernels", "cuda"], "--kernels: must be one of torch, triton"),
        (["generate", "--prompt", "x", "--kernel-rows", "65"], "--kernel-rows: must be in [0, 64], got 65"),
        (
            ["generate", "--prompt", "x", "--cluster-gemm", "sideways"],
            "--cluster-gemm: must be one of off, on, fused, fusedrope, got 'sideways'",
        ),
        (
            ["eval", "--drafter", "d", "--prompts", "p", "--cluster-gemm", "on"],
            "--cluster-gemm on needs --kernels triton (it replaces that engine's matmuls)",
        ),
        (["serve", "--device", "gpu"], "--device: must be auto, cpu, cuda, cuda:N, mps or xpu[:N], got 'gpu'"),
        (["serve", "--attn-impl", "flash"], "--attn-impl: must be one of auto, sdpa, bmm, split, got 'flash'"),
        (["serve", "--depth", "300"], "--depth: must be in [1, 250], got 300"),
    ],
)
def test_bad_value_is_one_line_naming_the_flag(argv, line, tmp_path, capsys):
    # the target does not exist: the error must come from parsing, before anything loads
    with pytest.raises(SystemExit) as e:
        main([argv[0], "--target", str(tmp_path / "missing"), *argv[1:]])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: " + line), err
    assert "\n" not in err and "Traceback" not in err


def test_tree_shape_checked_before_loading(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--target", str(tmp_path), "--prompt", "x", "--tree", "--top-k-draft", "2", "--depth", "2"])
    assert "--tree-tokens 32 > candidates" in capsys.readouterr().err


def test_python_callers_get_the_same_checks():
    assert EngineConfig().kernels == "torch" and ModeConfig(tree=True).tree
    with pytest.raises(DraftsmithError, match="--draft-tokens: must be in"):
        ModeConfig(draft_tokens=251)
    with pytest.raises(DraftsmithError, match="--dtype: must be one of"):
        EngineConfig(dtype="int8")
    assert EngineConfig(dtype="BF16").dtype == "BF16"  # load_target reads dtype names case-insensitively
    assert parse_temperatures("0, 0.7,") == [0.0, 0.7]
    assert EvalSamplingConfig(temperatures="1").temps == [1.0]
    for bad in ("", "a", "-1", "inf"):
        with pytest.raises(ValueError):
            parse_temperatures(bad)


def test_help_groups_the_engine_flags():
    r = CliRunner().invoke(app, ["generate", "--help"], terminal_width=240, env={"COLUMNS": "240"})
    assert r.exit_code == 0, r.output
    for panel in ("Engine", "Decode mode", "Sampling"):
        assert panel in r.output
    assert "(default: 128; >= 1)" in r.output  # --max-new-tokens: the default and the bound from the schema


def test_pipeline_checks_eval_settings_before_any_stage_runs():
    from draftsmith.pipeline.runner import _dry_parse

    base = ["--target", "t", "--drafter", "d", "--prompts", "p"]
    _dry_parse("p.yaml", "eval", "eval", [*base, "--max-new-tokens", "8", "--tree"])
    with pytest.raises(
        DraftsmithError, match=r"^p.yaml: section 'eval': --max-new-tokens: expected an integer, got 'x'$"
    ):
        _dry_parse("p.yaml", "eval", "eval", [*base, "--max-new-tokens", "x"])
    with pytest.raises(DraftsmithError, match=r"section 'eval': --attn-impl: must be one of"):
        _dry_parse("p.yaml", "eval", "eval", [*base, "--attn-impl", "flash"])


def test_kernel_rows_auto_follows_the_hidden_size():
    """--kernel-rows 0 (the default): the T-row kernels (8 rows, or a longer chain's verify up to 16) with --kernels
    triton on a small, launch-bound target (hidden <= 1,024), cuBLAS verifies (1) on a large one or with the torch
    kernels."""
    from types import SimpleNamespace

    from draftsmith.decode.config import AUTO_KERNEL_ROWS, AUTO_KERNEL_ROWS_MAX_HIDDEN
    from draftsmith.decode.setup import auto_kernel_rows

    def target(hidden):
        return SimpleNamespace(config=SimpleNamespace(hidden_size=hidden))

    assert auto_kernel_rows(target(384), "triton") == AUTO_KERNEL_ROWS == 8
    assert auto_kernel_rows(target(AUTO_KERNEL_ROWS_MAX_HIDDEN), "triton") == 8
    assert auto_kernel_rows(target(4096), "triton") == 1
    assert auto_kernel_rows(target(384), "torch") == 1
    # a longer chain than the default rows cover: its whole verify through the row kernels, up to one tile of 16
    from draftsmith.decode.config import AUTO_KERNEL_ROWS_FOR_CHAINS
    from draftsmith.decode.engine import DecodeMode

    chain = lambda k: DecodeMode("chain", draft_tokens=k)  # noqa: E731
    tree = DecodeMode("tree", top_k=8, depth=6, tree_tokens=48)
    assert auto_kernel_rows(target(384), "triton", (chain(4), tree, None)) == 8  # a tree verify keeps cuBLAS
    assert auto_kernel_rows(target(384), "triton", (chain(8),)) == 9
    assert auto_kernel_rows(target(384), "triton", (chain(6), chain(11))) == 12
    assert auto_kernel_rows(target(384), "triton", (chain(30),)) == AUTO_KERNEL_ROWS_FOR_CHAINS == 16
    assert auto_kernel_rows(target(4096), "triton", (chain(8),)) == 1


def test_prefill_graphs_flag_reaches_the_engine(monkeypatch):
    """--prefill-graphs / --no-prefill-graphs (EngineConfig.prefill_graphs, on by default) set the engine's
    `prefill_graphs` where it has CUDA graphs; without them (the CPU) it stays off: the padded body alone only adds
    rows."""
    from decode_helpers import tiny_qwen3

    from draftsmith.decode.engine import SpeculativeDecoder
    from draftsmith.decode.setup import engine_from

    m = tiny_qwen3()
    assert EngineConfig().prefill_graphs is True
    assert engine_from(m, None, 64, EngineConfig(device="cpu")).prefill_graphs is False
    assert SpeculativeDecoder(m, None, max_len=64).prefill_graphs is False  # the engine's own default: cuda_graphs
    init = SpeculativeDecoder.__init__

    def with_graphs(self, *a, **k):  # as on a GPU
        init(self, *a, **k)
        self.cuda_graphs = True

    monkeypatch.setattr(SpeculativeDecoder, "__init__", with_graphs)
    eng = engine_from(m, None, 64, EngineConfig(device="cpu"))
    assert eng.prefill_graphs and eng._prefill_bucket(10) == 16 and eng._prefill_bucket(65) is None  # max_len 64
    assert engine_from(m, None, 64, EngineConfig(device="cpu", prefill_graphs=False)).prefill_graphs is False


def test_cluster_gemm_flag_refuses_where_the_kernel_cannot_run():
    """--cluster-gemm: one-line errors without --kernels triton and off a Hopper GPU; off builds no KernelConfig; the
    setting reads back from an engine's KernelConfig."""
    from types import SimpleNamespace

    import torch

    from draftsmith.common.errors import DraftsmithError
    from draftsmith.decode.kernel_config import KernelConfig
    from draftsmith.decode.setup import cluster_gemm_config, cluster_gemm_setting

    target = SimpleNamespace(model=torch.nn.Linear(2, 2))  # on the CPU
    assert cluster_gemm_config(target, "torch", "off") is None
    with pytest.raises(DraftsmithError, match="--cluster-gemm fused needs --kernels triton"):
        cluster_gemm_config(target, "torch", "fused")
    with pytest.raises(DraftsmithError, match=r"needs a Hopper GPU \(sm_90\); the target is on cpu"):
        cluster_gemm_config(target, "triton", "fusedrope")
    for flag, kc in [
        ("off", KernelConfig()),
        ("on", KernelConfig(cluster_gemm=True)),
        ("fused", KernelConfig(cluster_gemm=True, cluster_gemm_fused=True)),
        ("fusedrope", KernelConfig(cluster_gemm=True, cluster_gemm_fused=True, cluster_gemm_rope=True)),
    ]:
        assert cluster_gemm_setting(SimpleNamespace(runner=SimpleNamespace(kernel_config=kc))) == flag
    assert cluster_gemm_setting(SimpleNamespace(runner=SimpleNamespace())) == "off"  # the generic HF path
