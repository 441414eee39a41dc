"""`draftsmith doctor` on the demo target: a drafter that accepts well gets a clean bill, and each fault planted in a
saved copy of it (edited as a wrong export or convention would write it) is named, alone, with its fix.

The drafter: the bundled demo drafter when assets/ has one for pycode-tiny, else a fixture overfit in seconds with the
trainer's TTT unroll on the doctor's own prompts (tests/doctor_helpers.py). Every test runs the real measurement; a
doctor that always names the same fault, or always none, fails all but one of them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from doctor_helpers import PLANTS, plant, train_fixture_drafter

pytestmark = pytest.mark.slow

PROMPTS, NEW, K = 6, 48, 4
AUX = [1, 3, 5]  # distinct layers, the last one included (its post-norm state is what HF output_hidden_states gives)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # small drafter steps: one intra-op thread is faster than two on 2 shared cores, and keeps the fixture's
    # training numerically the same from run to run
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def target(tiny_path):
    from draftsmith.target_model import load_target

    return load_target(tiny_path, dtype="fp32")


@pytest.fixture(scope="module")
def traces(target):
    from draftsmith.doctor import diagnosis

    ids = diagnosis.prompt_token_ids(target.tokenizer, None, PROMPTS, template=False)
    cache = {diagnosis.trace_key(None, PROMPTS, False, NEW, K): diagnosis.build_traces(target, ids, NEW, K)}
    return cache


@pytest.fixture(scope="module")
def clean(target, traces, tmp_path_factory):
    trs = next(iter(traces.values()))
    d, _ = train_fixture_drafter(target, trs, AUX, steps=80, lr=5e-3, ttt_steps=3)
    return d.save_pretrained(tmp_path_factory.mktemp("doctor") / "clean")


def _diagnose(target, traces, path, **kw):
    from draftsmith.doctor import diagnose

    return diagnose(
        target, str(path), max_prompts=PROMPTS, max_new_tokens=NEW, draft_tokens=K, trace_cache=traces, **kw
    )


def test_clean_drafter_gets_a_clean_bill(target, traces, clean):
    rep = _diagnose(target, traces, clean)
    assert rep["likely_faults"] == []
    assert all(c["ok"] for c in rep["checks"]), [c for c in rep["checks"] if not c["ok"]]
    assert rep["acceptance_rate"] > 0.5  # a drafter worth diagnosing: otherwise no fault could show
    # as trained, no variant beats the configuration
    assert max(v["acceptance_rate"] for v in rep["variants"]) <= rep["acceptance_rate"] + 1e-9
    assert {v["fault"] for v in rep["variants"]} >= {
        "aux_layer_shift",
        "aux_layer_order",
        "final_norm",
        "norm_before_residual",
        "draft_vocab",
    }
    assert rep["suggestions"]


FIX_SAYS = {
    "aux_layer_shift": "eagle_aux_hidden_state_layer_ids to [2, 4, 6]",
    "aux_layer_order": "column blocks [2, 1, 0]",
    "final_norm": "layer 5",
    "norm_before_residual": "set norm_before_residual to false",
    "d2t_absolute": "d2t[i] - i",
    "draft_vocab": "rebuild d2t/t2d",
    "rope": "set rope_theta to 10000",
}


@pytest.mark.parametrize("kind", PLANTS)
def test_planted_fault_is_named_with_its_fix(kind, target, traces, clean, tmp_path):
    path = plant(kind, Path(clean), tmp_path / kind, target=target, traces=next(iter(traces.values())))
    rep = _diagnose(target, traces, path)
    assert [f["fault"] for f in rep["likely_faults"]] == [kind], rep["likely_faults"]
    f = rep["likely_faults"][0]
    assert FIX_SAYS[kind] in f["fix"], f["fix"]
    assert f["variant_acceptance_rate"] > f["acceptance_rate"] + 0.05
    assert f["acceptance_rate"] == rep["acceptance_rate"]


CHAT_TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant:\n{% endif %}"
)


def test_chat_template_the_drafter_was_not_trained_with(target, traces, clean, monkeypatch):
    """The target's tokenizer gains a chat template the drafter never saw (it was trained on raw prompts): prompts
    are measured through the template (as `draftsmith eval` would send them), and the raw variant is named."""
    monkeypatch.setattr(target.tokenizer, "chat_template", CHAT_TEMPLATE)
    cache = dict(traces)  # raw traces reused; the templated ones are computed for this test only
    rep = _diagnose(target, cache, clean)
    assert rep["chat_template"] is True
    assert [f["fault"] for f in rep["likely_faults"]] == ["chat_template"], rep["likely_faults"]
    assert "without the chat template" in rep["likely_faults"][0]["fix"]


def test_simulated_acceptance_equals_the_decode_engine(target, traces, clean):
    """The rounds doctor simulates from one target pass are the rounds draftsmith.decode runs (greedy chain)."""
    from draftsmith.decode import DecodeMode, SpeculativeDecoder
    from draftsmith.doctor import diagnosis
    from draftsmith.doctor import measure as M
    from draftsmith.drafter import Drafter

    d = Drafter.from_pretrained(clean, target=target, dtype=torch.float32)
    eng = SpeculativeDecoder(target, d, max_len=256)
    trs = next(iter(traces.values()))
    tables = diagnosis._tables(d.d2t.clone(), d.config.vocab_size)
    cfg = diagnosis.Variant(None, "as configured", "", list(d.config.aux_layer_ids))
    sim = diagnosis.measure_variant(cfg, trs[:3], d, tables, K, target.final_norm)
    for tr, sim_rounds in zip(trs[:3], sim["rounds_per_prompt"]):
        r = eng.generate(
            tr.input_ids[: tr.prompt_len].tolist(), tr.max_new_tokens, mode=DecodeMode("chain", draft_tokens=K)
        )
        assert r.token_ids == tr.input_ids[tr.prompt_len : tr.prompt_len + len(r.token_ids)].tolist()
        assert r.accepted == sim_rounds
    assert M.summarize(sim["rounds_per_prompt"], K)["rounds"] > 20
    # the drafts themselves (also after a rejection, where acceptance no longer looks) equal a from-scratch chain
    from decode_helpers import reference_chain_drafts

    tr = trs[0]
    starts = M.round_starts(tr, K)[::3]
    aux = tr.layer_states[:, d.config.aux_layer_ids].reshape(tr.length, -1)
    drafts, _ = M.chain_drafts(d, aux, tr.input_ids, starts, K, d.draft_target_ids)
    for row, n in zip(drafts.tolist(), starts.tolist()):
        assert row == reference_chain_drafts(eng, d, tr.input_ids[: n + 1].tolist(), K)


def test_cli_json_contract_and_plot(target, clean, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from draftsmith.cli import app

    png = tmp_path / "acc.png"
    res = CliRunner().invoke(
        app,
        [
            "doctor",
            "--target",
            target.path,
            "--drafter",
            str(clean),
            "--max-prompts",
            "2",
            "--max-new-tokens",
            "16",
            "--json",
            "--plot",
            str(png),
        ],
    )
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout.strip().splitlines()[-1])
    assert {"checks", "acceptance_rate", "tau", "variants", "likely_faults"} <= set(rep)
    assert all(set(c) == {"name", "ok", "detail"} for c in rep["checks"])
    assert all({"fault", "acceptance_rate", "tau"} <= set(v) for v in rep["variants"])
    assert all(
        f["fault"]
        in {
            "aux_layer_shift",
            "aux_layer_order",
            "final_norm",
            "norm_before_residual",
            "d2t_absolute",
            "chat_template",
            "rope",
            "draft_vocab",
        }
        for f in rep["likely_faults"]
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
