"""Export/import of drafters: sglang, vllm, speculators, official EAGLE-3 layouts (issue 4), inspect.

The interop tests with the real `speculators` package are skipped when it is not importable; enable with
    pip install --no-deps speculators==0.9.0
    pip install "loguru>=0.7.2,<=0.7.3" pydantic-settings openai "datasets>=4,<=5.1"
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from draftsmith.common.errors import DraftsmithError
from draftsmith.drafter import Drafter, inspect_drafter
from draftsmith.drafter.formats import detect_format
from draftsmith.export import export

REPO = Path(__file__).resolve().parents[3]
TINY = next(
    (
        p
        for p in (
            REPO / "assets" / "pycode-tiny",
            REPO.parent / "shared" / "targets" / "pycode-tiny",
            Path("/work/shared/targets/pycode-tiny"),
        )
        if (p / "config.json").is_file()
    ),
    None,
)
pytestmark = pytest.mark.skipif(TINY is None, reason="pycode-tiny target not found")
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}


def make_drafter(seed=0, **kw) -> Drafter:
    torch.manual_seed(seed)
    counts = torch.randint(0, 1000, (16384,))
    aux = kw.pop("aux_layer_ids", [0, 2, 4])  # None: the target's default layers
    if aux is not None:
        kw["aux_layer_ids"] = aux
    d = Drafter.from_target(TINY, token_counts=counts, draft_vocab_size=kw.pop("draft_vocab_size", 700), **kw)
    with torch.no_grad():  # trained-looking norms, so a misplaced norm shows in the logits
        for n, p in d.named_parameters():
            if "norm" in n:
                p.add_(torch.rand_like(p))
    return d


def sample(d: Drafter, t=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 16384, (2, t), generator=g)
    aux = torch.randn(2, t, d.config.fc_in_features, generator=g)
    pos = torch.arange(t)[None].expand(2, -1) * 37  # long distances, where RoPE scaling differs
    return ids, aux, pos


def logits(d: Drafter, ids, aux, pos):
    with torch.no_grad():
        h = d(ids, d.fuse(aux), pos)
        h2 = d(ids, h, pos + 1)  # a second draft step: the pre-norm feedback must survive too
        return torch.cat([d.compute_logits(h), d.compute_logits(h2)], 1)


def keys(path: Path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys())


# ------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize(
    "fmt,variant",
    [
        ("sglang", {}),
        ("vllm", {}),
        ("vllm", {"norm_before_residual": True, "num_hidden_layers": 2}),
        ("speculators", {}),
        ("speculators", {"norm_before_residual": True, "num_hidden_layers": 2}),
        ("sglang", {"rope_scaling": LLAMA3_ROPE}),
        ("speculators", {"rope_scaling": LLAMA3_ROPE}),
    ],
)
def test_round_trip_identical_logits(tmp_path, fmt, variant):
    d = make_drafter(**variant)
    ids, aux, pos = sample(d)
    ref = logits(d, ids, aux, pos)
    info = export(d, tmp_path / fmt, fmt, target=TINY, dtype="fp32")
    c = json.loads((tmp_path / fmt / "config.json").read_text())
    # every layout names the aux layers in both conventions (issue #14 item 11)
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]  # layer-output ids (SGLang)
    assert c["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]  # hidden_states ids (vLLM, speculators)
    d2 = Drafter.from_pretrained(tmp_path / fmt, target=TINY)
    assert d2.config.extra.get("source_format") == fmt
    assert d2.config.aux_layer_ids == [0, 2, 4]
    assert d2.config.norm_before_residual == d.config.norm_before_residual
    assert d2.config.num_hidden_layers == d.config.num_hidden_layers
    assert torch.equal(d2.d2t, d.d2t) and torch.equal(d2.t2d, d.t2d)
    assert torch.equal(logits(d2, ids, aux, pos), ref)
    assert str(tmp_path / fmt) in info["serve_command"]
    # and back again: re-export of the re-import gives the same files
    export(d2, tmp_path / "again", fmt, target=TINY, dtype="fp32")
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == json.loads(
        (tmp_path / fmt / "config.json").read_text()
    )


def test_sglang_and_vllm_layout(tmp_path):
    d = make_drafter()
    export(d, tmp_path / "s", "sglang", target=TINY)
    export(d, tmp_path / "v", "vllm", target=TINY)
    s = json.loads((tmp_path / "s" / "config.json").read_text())
    v = json.loads((tmp_path / "v" / "config.json").read_text())
    assert s["architectures"] == ["LlamaForCausalLMEagle3"] and s["model_type"] == "llama"
    for c in (s, v):  # one config serves both engines: each reads its own field
        assert c["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 2, 4], "use_aux_hidden_state": True}
        assert c["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]  # hidden_states ids (vLLM reads this one)
        assert c["torch_dtype"] == c["dtype"] == "bfloat16"  # the target's dtype (issue #14 item 13)
    for c in (s, v):
        assert (c["vocab_size"], c["draft_vocab_size"], c["num_hidden_layers"], c["hidden_size"]) == (
            16384,
            700,
            1,
            192,
        )
        assert c["tie_word_embeddings"] is False and "target_hidden_size" not in c  # H == H_t
    k = keys(tmp_path / "s")
    assert k == keys(tmp_path / "v")
    assert {
        "fc.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.input_layernorm.weight",
        "midlayer.self_attn.q_proj.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
    } <= k
    assert not any("embed" in x or x.startswith("layers.") or x.startswith("model.") for x in k)
    # the marker names the layout; without it, a drafter SGLang can run reads as sglang (the same reader)
    assert detect_format(s, marker={"format": "sglang"}) == "sglang" == detect_format(s)
    assert detect_format(v, marker={"format": "vllm"}) == "vllm"
    assert detect_format({**v, "norm_before_residual": True}) == "vllm"
    assert Drafter.from_pretrained(tmp_path / "v").config.extra["source_format"] == "vllm"
    sd = load_file(str(tmp_path / "s" / "model.safetensors"))
    assert sd["fc.weight"].dtype == torch.bfloat16 and sd["d2t"].dtype == torch.int64
    # SGLang and vLLM parse it with transformers' LlamaConfig first
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(tmp_path / "v"))
    assert type(hf).__name__ == "LlamaConfig" and hf.draft_vocab_size == 700 and hf.tie_word_embeddings is False
    assert hf.eagle_aux_hidden_state_layer_ids == [1, 3, 5] and hf.head_dim == 64


def test_speculators_layout(tmp_path):
    d = make_drafter()
    export(d, tmp_path, "speculators", target=TINY, speculative_tokens=5)
    c = json.loads((tmp_path / "config.json").read_text())
    assert c["architectures"] == ["Eagle3DraftModel"] and c["speculators_model_type"] == "eagle3"
    assert c["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]  # hidden_states ids
    assert c["draft_vocab_size"] == 700 and c["norm_before_residual"] is False
    tl = c["transformer_layer_config"]
    assert (tl["model_type"], tl["hidden_size"], tl["vocab_size"], tl["num_hidden_layers"]) == ("llama", 192, 16384, 1)
    sc = c["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"][0]["proposal_type"] == "greedy"
    assert sc["proposal_methods"][0]["speculative_tokens"] == 5
    assert sc["verifier"] == {"name_or_path": str(TINY), "architectures": ["LlamaForCausalLM"]}
    k = keys(tmp_path)
    assert {"fc.weight", "layers.0.hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= k
    assert not any(x.startswith("midlayer.") for x in k)


def test_export_refusals(tmp_path):
    with pytest.raises(DraftsmithError, match="num_hidden_layers"):
        export(make_drafter(num_hidden_layers=2), tmp_path / "a", "sglang", target=TINY)
    with pytest.raises(DraftsmithError, match="norm_before_residual"):
        export(make_drafter(norm_before_residual=True), tmp_path / "b", "sglang", target=TINY)
    with pytest.raises(DraftsmithError, match="aux_layer_ids"):
        export(make_drafter(aux_layer_ids=[1, 4]), tmp_path / "c", "vllm", target=TINY)
    with pytest.raises(DraftsmithError, match="format"):
        export(make_drafter(), tmp_path / "d", "tensorrt", target=TINY)


# ------------------------------------------------------------------------------------- imports
def test_import_sglang_with_model_prefix(tmp_path):
    d = make_drafter()
    export(d, tmp_path / "s", "sglang", target=TINY, dtype="fp32")
    sd = load_file(str(tmp_path / "s" / "model.safetensors"))
    (tmp_path / "p").mkdir()
    save_file(
        {("model." + k if k not in ("lm_head.weight", "d2t", "t2d") else k): v for k, v in sd.items()},
        str(tmp_path / "p" / "model.safetensors"),
    )
    (tmp_path / "p" / "config.json").write_text((tmp_path / "s" / "config.json").read_text())
    d2 = Drafter.from_pretrained(tmp_path / "p", target=TINY)
    ids, aux, pos = sample(d)
    assert torch.equal(logits(d2, ids, aux, pos), logits(d, ids, aux, pos))


def _official_eagle(tmp_path: Path, d: Drafter) -> Path:
    """The official EAGLE-3 release layout: pytorch_model.bin, no aux ids, no t2d (some releases)."""
    export(d, tmp_path / "s", "sglang", target=TINY, dtype="fp32")
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    cfg.pop("eagle_config")
    cfg.pop("eagle_aux_hidden_state_layer_ids")
    sd = load_file(str(tmp_path / "s" / "model.safetensors"))
    sd.pop("t2d")
    sd["embed_tokens.weight"] = torch.zeros(16384, 192)  # some releases ship one: ignored
    out = tmp_path / "eagle"
    out.mkdir()
    torch.save(sd, out / "pytorch_model.bin")
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_import_official_eagle_release(tmp_path):
    d = make_drafter(aux_layer_ids=None)  # default aux layers for the target
    path = _official_eagle(tmp_path, d)
    # a config without aux ids takes the engines' default, and says so in both conventions (issue #14)
    with pytest.warns(
        UserWarning,
        match=r"names no aux layers.*layer-output ids \[1, 2, 2\] = hidden_states ids "
        r"\[2, 3, 3\]",
    ):
        d2 = Drafter.from_pretrained(path, target=TINY)
    assert d2.config.extra["source_format"] == "eagle"
    assert d2.config.aux_layer_ids == [1, 2, 2]  # engine default [2, N//2, N-3] hidden_states ids for N=6
    assert torch.equal(d2.t2d, d.t2d)  # rebuilt from d2t
    ids, aux, pos = sample(d)
    assert torch.equal(logits(d2, ids, aux, pos), logits(d, ids, aux, pos))
    # without a target the aux layers stay unknown, and exporting needs them
    d3 = Drafter.from_pretrained(path)
    assert d3.config.aux_layer_ids is None
    with pytest.raises(DraftsmithError, match="aux_layer_ids"):
        export(d3, tmp_path / "x", "vllm")


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_pickle_with_code_is_refused(tmp_path):
    path = _official_eagle(tmp_path, make_drafter())
    sd = torch.load(path / "pytorch_model.bin", weights_only=True)
    sd["evil"] = _Evil()
    torch.save(sd, path / "pytorch_model.bin")
    with pytest.raises(DraftsmithError, match="weights_only"):
        Drafter.from_pretrained(path)


def test_fit_refusals_name_the_field(tmp_path):
    d = make_drafter()
    export(d, tmp_path / "v", "vllm", target=TINY)
    cfg_path = tmp_path / "v" / "config.json"
    base = json.loads(cfg_path.read_text())

    def with_cfg(**changes):
        cfg_path.write_text(json.dumps({**base, **changes}))

    with_cfg(
        eagle_aux_hidden_state_layer_ids=[1, 3, 7],
        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 6], "use_aux_hidden_state": True},
    )
    with pytest.raises(DraftsmithError, match="aux_layer_ids"):
        Drafter.from_pretrained(tmp_path / "v", target=TINY)
    with_cfg(eagle_aux_hidden_state_layer_ids=[1, 3, 4])  # disagrees with the nested layer-output ids
    with pytest.raises(DraftsmithError, match="name different layers"):
        Drafter.from_pretrained(tmp_path / "v", target=TINY)
    with_cfg(target_hidden_size=256)
    with pytest.raises(DraftsmithError, match="fc.weight|target_hidden_size"):
        Drafter.from_pretrained(tmp_path / "v", target=TINY)
    # another vocabulary
    small = tmp_path / "small"
    export(make_drafter(), small, "sglang", target=TINY)
    c = json.loads((small / "config.json").read_text())
    c["vocab_size"] = 32000
    (small / "config.json").write_text(json.dumps(c))
    sd = load_file(str(small / "model.safetensors"))
    sd["t2d"] = torch.cat([sd["t2d"], torch.zeros(32000 - 16384, dtype=torch.bool)])
    save_file(sd, str(small / "model.safetensors"))
    with pytest.raises(DraftsmithError, match="vocab_size"):
        Drafter.from_pretrained(small, target=TINY)


# ------------------------------------------------------------------------------------- cli + inspect
def test_cli_export(tmp_path):
    import typer
    from typer.testing import CliRunner

    from draftsmith.export.cli import register

    app = typer.Typer()
    register(app)

    @app.command("noop", hidden=True)
    def _noop():  # a second command keeps typer in multi-command mode, as in the real CLI
        pass

    make_drafter().save_pretrained(tmp_path / "native")
    r = CliRunner().invoke(
        app,
        [
            "export",
            str(tmp_path / "native"),
            "--format",
            "sglang",
            "--out",
            str(tmp_path / "out"),
            "--target",
            str(TINY),
            "--dtype",
            "bf16",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "--speculative-algorithm EAGLE3" in r.output and "speculators convert" in r.output
    assert "[1, 3, 5]" in r.output  # hidden_states ids for the converter
    c = json.loads((tmp_path / "out" / "config.json").read_text())
    assert c["torch_dtype"] == "bfloat16"
    r = CliRunner().invoke(app, ["export", "--help"])
    assert "--speculative-tokens" in r.output and "--target" in r.output
    r = CliRunner().invoke(app, ["export", str(tmp_path / "native"), "--format", "vllm", "--out", str(tmp_path / "o2")])
    assert r.exit_code == 0, r.output  # target found from the drafter's own config
    assert "vllm serve" in r.output and '"method": "eagle3"' in r.output


def test_inspect(tmp_path):
    d = make_drafter()
    export(d, tmp_path / "spec", "speculators", target=TINY)
    info = inspect_drafter(tmp_path / "spec", target=TINY)
    assert info["format"] == "speculators" and info["fits_target"] is True and info["fit_problems"] == []
    assert info["aux_layer_ids"] == [0, 2, 4] and info["aux_hidden_states_ids"] == [1, 3, 5]
    assert info["aux_ids_source"] == "checkpoint"
    assert (info["hidden_size"], info["draft_vocab_size"], info["vocab_size"], info["num_aux"]) == (192, 700, 16384, 3)
    assert info["speculative_tokens"] == 3
    path = _official_eagle(tmp_path, make_drafter(aux_layer_ids=None))
    info = inspect_drafter(path)
    assert info["format"] == "eagle" and info["aux_layer_ids"] is None and info["fits_target"] is None
    info = inspect_drafter(path, target=TINY)
    assert info["aux_layer_ids"] == [1, 2, 2] and info["aux_ids_source"] == "engine default for the target"
    # a target of another shape: fits False, with one reason per field
    other = tmp_path / "other-target"
    other.mkdir()
    c = json.loads((TINY / "config.json").read_text())
    c.update(num_hidden_layers=3, vocab_size=32000)
    (other / "config.json").write_text(json.dumps(c))
    info = inspect_drafter(tmp_path / "spec", target=other)
    assert info["fits_target"] is False
    text = " ".join(info["fit_problems"])
    assert "vocab_size" in text and "aux_layer_ids" in text
    from draftsmith.drafter.inspect import format_report

    assert "fits target" in format_report(info) and "NO:" in format_report(info)


# ------------------------------------------------------------------------------------- speculators interop
def _speculators():
    """speculators' eagle3 module, or skip (not installed, or its light dependencies missing)."""
    if importlib.util.find_spec("speculators") is None:
        pytest.skip("speculators not installed (see module docstring)")
    for mod in ("speculators.utils.loading", "speculators.convert"):  # pull in its light deps (loguru, ...)
        pytest.importorskip(
            mod, reason="speculators' dependencies missing (see module docstring)", exc_type=ImportError
        )
    return pytest.importorskip(
        "speculators.models.eagle3", reason="speculators or its dependencies missing", exc_type=ImportError
    )


def _spec_logits(model, ids, aux, pos):
    """speculators' own forward (ttt_steps=1), read at its lm_head."""
    out = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: out.append(o))
    try:
        with torch.no_grad():
            for b in range(ids.shape[0]):
                model(
                    hidden_states=aux[b : b + 1],
                    input_ids=ids[b : b + 1],
                    position_ids=pos[b : b + 1],
                    document_ids=torch.zeros_like(ids[b : b + 1]),
                    ttt_steps=1,
                )
    finally:
        hook.remove()
    return torch.cat(out, 0)


@pytest.mark.parametrize(
    "variant",
    [{}, {"norm_before_residual": True, "num_hidden_layers": 2}, {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}],
)
def test_speculators_loads_our_export(tmp_path, variant):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Eagle3DraftModel = _speculators().Eagle3DraftModel

        d = make_drafter(aux_layer_ids=[0, 2, 4], **variant)
        export(d, tmp_path, "speculators", target=TINY, dtype="fp32")
        m = Eagle3DraftModel.from_pretrained(str(tmp_path)).eval()
        assert m.config.eagle_aux_hidden_state_layer_ids == [1, 3, 5]
        ids, aux, pos = sample(d, t=12)
        with torch.no_grad():
            ours = d.compute_logits(d(ids, d.fuse(aux), pos))
        torch.testing.assert_close(_spec_logits(m, ids, aux, pos), ours, rtol=1e-4, atol=1e-4)


def test_speculators_convert_of_our_sglang_export(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Eagle3DraftModel = _speculators().Eagle3DraftModel
        from speculators.convert import convert_model

        d = make_drafter(aux_layer_ids=[0, 2, 4])
        info = export(d, tmp_path / "sglang", "sglang", target=TINY, dtype="fp32")
        # what `speculators convert` runs (the printed command passes the hidden_states ids the same way)
        assert '"eagle_aux_hidden_state_layer_ids": [1, 3, 5]' in info["speculators_convert_command"]
        convert_model(
            model=str(tmp_path / "sglang"),
            verifier=str(TINY),
            output_path=str(tmp_path / "conv"),
            algorithm="eagle3",
            eagle_aux_hidden_state_layer_ids=[1, 3, 5],
        )
        m = Eagle3DraftModel.from_pretrained(str(tmp_path / "conv")).eval()
        # speculators 0.9.0's converter writes no embed_tokens and its from_pretrained then leaves the embedding
        # initialised by transformers (zeros or random) instead of fetching the verifier's; use its own reload
        # path: NaN marks "not loaded", load_verifier_weights() then copies the verifier's embedding
        m.embed_tokens.weight.data.fill_(float("nan"))
        m.load_verifier_weights()
        ids, aux, pos = sample(d, t=12)
        with torch.no_grad():
            ours = d.compute_logits(d(ids, d.fuse(aux), pos))
        torch.testing.assert_close(_spec_logits(m, ids, aux, pos), ours, rtol=1e-4, atol=1e-4)
        # and draftsmith reads speculators' converted checkpoint back, identically
        d2 = Drafter.from_pretrained(tmp_path / "conv", target=TINY)
        assert d2.config.aux_layer_ids == [0, 2, 4]
        assert torch.equal(logits(d2, ids, aux, pos), logits(d, ids, aux, pos))


def test_narrow_drafter_keeps_its_own_embedding(tmp_path):
    """hidden_size != target_hidden_size: the target's embedding cannot be used, so (like EAGLE's cnets.py)
    the drafter's own embedding travels with it in every layout that allows the shape."""
    from draftsmith.drafter import DrafterConfig

    torch.manual_seed(0)
    cfg = DrafterConfig(
        hidden_size=32,
        target_hidden_size=48,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=100,
        draft_vocab_size=40,
        aux_layer_ids=[0, 1, 2],
    )
    d = Drafter(cfg)
    d.set_embedding(torch.randn(100, 32))
    g = torch.Generator().manual_seed(0)
    ids, aux = torch.randint(0, 100, (1, 5), generator=g), torch.randn(1, 5, 144, generator=g)
    pos = torch.arange(5)[None]
    d.save_pretrained(tmp_path / "native")
    export(d, tmp_path / "s", "sglang")
    c = json.loads((tmp_path / "s" / "config.json").read_text())
    assert c["target_hidden_size"] == 48 and c["hidden_size"] == 32
    for p in ("native", "s"):
        assert "embed_tokens.weight" in keys(tmp_path / p)
        d2 = Drafter.from_pretrained(tmp_path / p)
        assert torch.equal(logits(d2, ids, aux, pos), logits(d, ids, aux, pos))
    with pytest.raises(DraftsmithError, match="target_hidden_size"):
        export(d, tmp_path / "x", "speculators")


# ------------------------------------------------------------------------------------- issue #14: safety and interop
def test_out_must_be_new_empty_or_an_export_of_the_same_format(tmp_path):
    """Item 3: --out pointing at a model directory replaced its config.json and weights."""
    d = make_drafter()
    model_dir = tmp_path / "a-target"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (model_dir / "model.safetensors").write_bytes(b"target weights")
    with pytest.raises(DraftsmithError, match="not a draftsmith drafter export.*--overwrite") as e:
        export(d, model_dir, "vllm", target=TINY)
    assert "\n" not in str(e.value)
    assert (model_dir / "model.safetensors").read_bytes() == b"target weights"  # untouched
    export(d, tmp_path / "v", "vllm", target=TINY)
    export(d, tmp_path / "v", "vllm", target=TINY)  # an earlier export of the same layout: refreshed in place
    with pytest.raises(DraftsmithError, match="a draftsmith vllm export, not sglang"):
        export(d, tmp_path / "v", "sglang", target=TINY)
    (tmp_path / "file").write_text("x")
    with pytest.raises(DraftsmithError, match="not a directory"):
        export(d, tmp_path / "file", "vllm", target=TINY)
    (model_dir / "model-00001-of-00002.safetensors").write_bytes(b"x")
    info = export(d, model_dir, "vllm", target=TINY, overwrite=True)
    assert any("model-00001-of-00002.safetensors" in n for n in info["notes"])
    assert json.loads((model_dir / "draftsmith_export.json").read_text())["format"] == "vllm"
    assert Drafter.from_pretrained(model_dir, target=TINY).config.aux_layer_ids == [0, 2, 4]


def test_repeated_or_uncapturable_aux_ids_are_refused(tmp_path):
    """Item 12: repeated ids break both engines; SGLang cannot capture the last layer's output."""
    d = make_drafter(aux_layer_ids=[1, 2, 2])
    for fmt in ("sglang", "vllm", "speculators"):
        with pytest.raises(DraftsmithError, match="membership.*de-duplicates") as e:
            export(d, tmp_path / fmt, fmt, target=TINY)
        assert "\n" not in str(e.value) and "[2, 3, 3] (hidden_states ids)" in str(e.value)
    last = make_drafter(aux_layer_ids=[1, 3, 5])  # 5 = the last layer of the 6-layer target
    with pytest.raises(DraftsmithError, match="last layer"):
        export(last, tmp_path / "s", "sglang", target=TINY)
    export(last, tmp_path / "v", "vllm", target=TINY)  # vLLM captures it (hidden_states id 6)
    # the defaults for this target are distinct (and not the last layer), so they export everywhere
    default = make_drafter(aux_layer_ids=None)
    assert default.config.aux_layer_ids == [1, 2, 3]
    export(default, tmp_path / "s2", "sglang", target=TINY)


def test_dtype_follows_the_target_or_the_option(tmp_path):
    """Item 13: exports said float32, and SGLang with --dtype auto then built an fp16 drafter."""
    d = make_drafter()
    for fmt in ("sglang", "speculators"):
        info = export(d, tmp_path / fmt, fmt, target=TINY)  # auto: pycode-tiny is bfloat16
        c = json.loads((tmp_path / fmt / "config.json").read_text())
        assert info["dtype"] == c["dtype"] == "bfloat16"
        assert load_file(str(tmp_path / fmt / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    export(d, tmp_path / "fp32", "vllm", target=TINY, dtype="fp32")
    c = json.loads((tmp_path / "fp32" / "config.json").read_text())
    assert c["dtype"] == c["torch_dtype"] == "float32"
    assert load_file(str(tmp_path / "fp32" / "model.safetensors"))["fc.weight"].dtype == torch.float32
    with pytest.raises(DraftsmithError, match="--dtype"):
        export(d, tmp_path / "x", "vllm", target=TINY, dtype="int8")


def test_speculators_serve_command_and_absolute_verifier(tmp_path, monkeypatch):
    """Item 14: `vllm serve DIR` fails for a local verifier; the relative verifier path broke from other dirs."""
    monkeypatch.chdir(TINY.parent)
    info = export(make_drafter(), tmp_path / "spec", "speculators", target=TINY.name, speculative_tokens=4)
    c = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert c["speculators_config"]["verifier"]["name_or_path"] == str(TINY.resolve())
    cmd = info["serve_command"]
    assert cmd.startswith(f"vllm serve {TINY.resolve()} --speculative-config ")
    spec = json.loads(cmd.split("--speculative-config ", 1)[1].strip("'"))
    assert spec == {"method": "eagle3", "model": str((tmp_path / "spec").resolve()), "num_speculative_tokens": 4}


def test_inspect_says_what_is_known_of_the_target(tmp_path):
    """Item 18: vLLM/speculators exports printed `trained for None (None layers)`."""
    from draftsmith.drafter.inspect import format_report

    export(make_drafter(), tmp_path / "v", "vllm", target=TINY)
    text = format_report(inspect_drafter(tmp_path / "v"))
    assert f"trained for  {TINY.resolve()} (6 layers)" in text  # from the export's draftsmith_export.json
    (tmp_path / "v" / "draftsmith_export.json").unlink()  # e.g. a checkpoint from elsewhere
    text = format_report(inspect_drafter(tmp_path / "v"))
    assert "trained for  unknown (unknown layers)" in text and "None" not in text.split("trained for")[1]


def test_damaged_drafter_and_contradicting_weights(tmp_path):
    """A truncated model.safetensors is one line; inspect checks the weights' shapes, not only config.json."""
    from draftsmith.drafter.inspect import format_report

    make_drafter().save_pretrained(tmp_path / "d")
    w = tmp_path / "d" / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 3])
    with pytest.raises(DraftsmithError, match="truncated or corrupted") as e:
        Drafter.from_pretrained(tmp_path / "d", target=TINY)
    assert "\n" not in str(e.value) and str(w) in str(e.value)
    w.write_bytes(data)
    cfg_path = tmp_path / "d" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "intermediate_size": 1024}))  # the weights say 512
    info = inspect_drafter(tmp_path / "d", target=TINY)
    assert info["fits_target"] is False
    assert any("layers.0.mlp.gate_proj.weight" in p for p in info["fit_problems"])
    assert "WEIGHTS PROBLEM: " in format_report(info)


def test_missing_aux_ids_warn_in_one_line(tmp_path):
    """A drafter config without aux_layer_ids took the default silently; now a warning names it, both ways."""
    import typer
    from typer.testing import CliRunner

    from draftsmith.export.cli import register

    d = make_drafter()
    d.save_pretrained(tmp_path / "d")
    cfg_path = tmp_path / "d" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["aux_layer_ids"] = None
    cfg_path.write_text(json.dumps(cfg))
    app = typer.Typer()
    register(app)
    app.command("noop", hidden=True)(lambda: None)
    r = CliRunner().invoke(
        app, ["export", str(tmp_path / "d"), "--format", "vllm", "--out", str(tmp_path / "o"), "--target", str(TINY)]
    )
    # the engines' default for 6 layers repeats a layer: the warning says which, then the export is refused
    assert r.exit_code != 0
    warning = [line for line in r.output.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "layer-output ids [1, 2, 2] = hidden_states ids [2, 3, 3]" in warning[0], r.output
    assert isinstance(r.exception, DraftsmithError) and "membership" in str(r.exception)
