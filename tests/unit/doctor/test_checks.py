"""doctor's static checks and the simulated chain on small inputs (no trained drafter needed)."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture(scope="module")
def target(tiny_path):
    from draftsmith.target_model import load_target

    return load_target(tiny_path, dtype="fp32")


def _checks(target, path, store=None):
    from draftsmith.doctor.checks import static_checks
    from draftsmith.doctor.diagnosis import load_for_doctor

    info = load_for_doctor(str(path), target)
    out = static_checks(
        target, str(path), info["format"], info["config"], info["state"], info["notes"], info["load_error"], store
    )
    return {c["name"]: c for c in out}


def _drafter(target, **kw):
    from draftsmith.drafter import Drafter

    torch.manual_seed(0)
    return Drafter.from_target(target, draft_vocab_size=512, **kw)


def test_clean_native_drafter_passes_every_check(target, tmp_path):
    c = _checks(target, _drafter(target, aux_layer_ids=[1, 3, 4]).save_pretrained(tmp_path / "d"))
    assert all(x["ok"] for x in c.values()), [x for x in c.values() if not x["ok"]]


def test_repeated_aux_ids_fail_with_distinct_ones_suggested(target, tmp_path):
    # the 6-layer default [1, N//2-1, N-4] = [1, 2, 2]: SGLang/vLLM capture layer 2 once
    c = _checks(target, _drafter(target, aux_layer_ids=[1, 2, 2]).save_pretrained(tmp_path / "d"))
    assert not c["aux_ids"]["ok"]
    assert "repeat [2]" in c["aux_ids"]["detail"] and "[0, 1, 2]" in c["aux_ids"]["detail"]


def test_sglang_layout_without_the_top_level_field_fails_conventions(target, tmp_path):
    from draftsmith.export.formats import export_drafter

    out = export_drafter(_drafter(target, aux_layer_ids=[1, 3, 4]), tmp_path / "sg", "sglang")
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("eagle_aux_hidden_state_layer_ids", None)
    (out / "config.json").write_text(json.dumps(cfg))
    c = _checks(target, out)
    assert not c["aux_id_conventions"]["ok"]
    assert "[2, 4, 5]" in c["aux_id_conventions"]["detail"]  # the top-level field to add (hidden_states ids)
    assert c["aux_ids"]["ok"]


def test_absolute_d2t_is_recognised_and_loading_still_works(target, tmp_path):
    from safetensors.torch import load_file, save_file

    counts = torch.arange(target.vocab_size).flip(0)  # a draft vocab of the ids 0..511: offsets all 0
    counts[1000:1512] = 10**6  # ... of 1000..1511 instead: offsets 1000
    p = _drafter(target, aux_layer_ids=[1, 3, 4], token_counts=counts).save_pretrained(tmp_path / "d")
    sd = load_file(str(p / "model.safetensors"))
    sd["d2t"] = sd["d2t"] + torch.arange(sd["d2t"].numel())
    save_file(sd, str(p / "model.safetensors"))
    c = _checks(target, p)
    assert not c["loads"]["ok"]
    assert not c["draft_vocab_mapping"]["ok"] and "absolute" in c["draft_vocab_mapping"]["detail"]


def test_store_hashes_and_aux_layers(target, tmp_path):
    p = _drafter(target, aux_layer_ids=[1, 3, 4]).save_pretrained(tmp_path / "d")
    store = tmp_path / "store"
    store.mkdir()
    (store / "manifest.json").write_text(
        json.dumps({"target": {"config_hash": target.config_hash, "tokenizer_hash": "0" * 64}, "aux_layers": [1, 3, 5]})
    )
    c = _checks(target, p, store=str(store))
    assert c["store_config_hash"]["ok"]
    assert not c["store_tokenizer_hash"]["ok"]
    assert not c["store_aux_layers"]["ok"] and "[1, 3, 5]" in c["store_aux_layers"]["detail"]


def test_rounds_and_summary():
    from draftsmith.doctor.measure import accepted_per_start, engine_rounds, summarize

    target_next = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12])
    starts = torch.tensor([0, 1, 2, 3])
    drafts = torch.tensor([[5, 6, 0], [6, 0, 8], [7, 8, 9], [0, 9, 10]])
    acc = accepted_per_start(drafts, target_next, starts)
    assert acc.tolist() == [2, 1, 3, 0]
    assert engine_rounds(acc, starts) == [2, 0]  # start 0 accepts 2 -> next round at 3, which accepts 0 -> 4 (none)
    s = summarize([[2, 0]], 3)
    assert s["acceptance_rate"] == pytest.approx(2 / 6) and s["tau"] == pytest.approx(2.0)
    assert s["p_at_least"] == [0.5, 0.5, 0.0]


def test_suggestions_read_tau_sim_of_the_run_and_the_fall_off(tmp_path):
    from draftsmith.doctor.checks import read_tau_sim
    from draftsmith.doctor.diagnosis import suggestions

    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    recs = [
        {"step": 10, "tau_sim": 1.0, "acc": [0.5] * 7},
        {"step": 20, "tau_sim": 2.9, "acc": [0.9] * 7, "eval_tau_sim": 2.5, "eval_acc": [0.9, 0.8, 0.8, 0.7]},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    ts = read_tau_sim(str(run / "final"))
    assert ts["held_out"] and ts["step"] == 20 and ts["tau_sim"] == 2.5
    config = {"tau": 1.3, "conditional": [0.25, 0.3, 0.1, 0.0]}
    assert "falls off fast" in " ".join(suggestions({"tau": 2.0, "conditional": [0.8, 0.7, 0.3, 0.2]}, 0.99, None, 4))
    out = " | ".join(suggestions(config, 0.99, ts, 4))
    # 1 + 0.9 + 0.72 + 0.576 + 0.4032 = 3.60 expected from the held-out per-step accuracies
    assert "τ ≈ 3.60" in out and "well below" in out
    assert "first draft is accepted only 25%" in out and "falls off fast" not in out
    assert read_tau_sim(str(tmp_path)) is None


@pytest.mark.parametrize("layers", [1, 2])
def test_chain_drafts_equal_a_from_scratch_reference(layers):
    """Batched chain drafts (every round start at once, cached step-0 keys) equal the drafts recomputed from scratch
    for each start (decode_helpers.reference_chain_drafts), also for drafters with more than one layer."""
    from decode_helpers import random_drafter, reference_chain_drafts, tiny_llama

    from draftsmith.decode import SpeculativeDecoder
    from draftsmith.doctor.measure import chain_drafts, trace_prompt
    from draftsmith.target_model import target_from_model

    model = tiny_llama(vocab_size=64, layers=4, hidden=32)
    d = random_drafter(model, num_hidden_layers=layers)
    with torch.no_grad():  # attention outweighs everything else: drafts depend on the keys and their positions
        d.reset_parameters(std=0.3)
        for layer in d.layers:
            layer.self_attn.o_proj.weight.mul_(10)
            layer.mlp.down_proj.weight.zero_()
    tr = trace_prompt(target_from_model(model), [3, 7, 1, 9, 4], max_new_tokens=12, lookahead=3)
    starts = torch.tensor([5, 8, 11])
    table = d.draft_target_ids
    drafts, _ = chain_drafts(
        d, tr.layer_states[:, d.config.aux_layer_ids].reshape(tr.length, -1), tr.input_ids, starts, 3, table
    )
    eng = SpeculativeDecoder(model, d, max_len=64)
    for row, n in zip(drafts.tolist(), starts.tolist()):
        assert row == reference_chain_drafts(eng, d, tr.input_ids[: n + 1].tolist(), 3)
