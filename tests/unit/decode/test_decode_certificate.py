"""The bf16 greedy certificate: speculative vs plain greedy outputs either agree, or differ first at a near tie
(the plain step's top-2 logit gap within a few bf16 ulps); a divergence at a real margin fails. The engine runs
pycode-tiny in bf16 on CPU with a drafter overfit on its own outputs (so verifies accept several tokens)."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
from decode_helpers import overfit_drafter_ttt, random_drafter

from draftsmith.decode import certificate as C
from draftsmith.decode.engine import DecodeMode, SpeculativeDecoder
from draftsmith.decode.evaluate import run_eval

ROOT = str(Path(__file__).resolve().parents[3])
PYCODE_TINY = next(
    (p for p in (os.path.join(ROOT, "assets", "pycode-tiny"), "/work/shared/targets/pycode-tiny") if os.path.isdir(p)),
    None,
)
pytestmark = [pytest.mark.skipif(PYCODE_TINY is None, reason="pycode-tiny not available"), pytest.mark.slow]
NEW = 24
SEEDS = [
    "def ",
    "import os\n",
    "class Foo:\n    def ",
    "for i in range(",
    "# utils\n",
    "x = [",
    "def add(a, b):\n",
    "if __name__ == ",
]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def bf16_engine():
    from draftsmith.target_model import load_target

    torch.set_num_threads(1)
    t32 = load_target(PYCODE_TINY, dtype="fp32")
    prompts = [t32.tokenizer.encode(s) for s in SEEDS]
    d = random_drafter(t32.model, seed=0, aux_layer_ids=[1, 3, 4])
    eng32 = SpeculativeDecoder(t32, d, max_len=128)
    seqs = [p + eng32.generate(p, NEW, mode=DecodeMode("plain")).token_ids for p in prompts]
    overfit_drafter_ttt(eng32, d, seqs, steps=15, ttt_steps=2, lr=5e-3)
    t = load_target(PYCODE_TINY, dtype="bf16")
    d16 = copy.deepcopy(d).to(torch.bfloat16)
    d16.set_embedding(t.model.get_input_embeddings().weight)
    eng = SpeculativeDecoder(t, d16, max_len=128)
    return eng, prompts


def test_epsilon_is_a_few_bf16_ulps():
    assert C.dtype_ulp(20.0, torch.bfloat16) == 0.125  # 2^4 * 2^-7
    assert C.divergence_epsilon(20.0, torch.bfloat16) == C.ULPS_PER_TIE * 0.125
    assert C.divergence_epsilon(20.0, torch.float32) < 1e-4
    assert C.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert C.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert C.first_difference([1, 2], [1, 2, 3]) == 2


@pytest.mark.parametrize(
    "mode",
    [DecodeMode("chain", draft_tokens=3), DecodeMode("tree", top_k=3, depth=3, tree_tokens=8)],
    ids=["chain", "tree"],
)
def test_bf16_greedy_divergences_are_near_ties_only(bf16_engine, mode):
    eng, prompts = bf16_engine
    rep = run_eval(eng, prompts, mode, temperatures=[0.0], max_new_tokens=NEW)
    e = rep["temperatures"]["0"]
    gd = e["greedy_divergences"]
    assert set(gd) == {"equal", "near_tie", "real", "epsilon"}  # the eval.json contract
    assert gd["equal"] + gd["near_tie"] + gd["real"] == len(prompts)
    assert gd["epsilon"] > 0
    assert e["speculative"]["tau"] > 1.3, "the overfit drafter should make verifies accept several tokens"
    assert gd["real"] == 0, f"greedy divergence at a real margin: {e['greedy_divergence_details']}"
    for d in e["greedy_divergence_details"]:
        assert d["plain_gap"] <= d["epsilon"]


def test_margins_are_recorded_per_emitted_token(bf16_engine):
    eng, prompts = bf16_engine
    eng.record_margins = True
    try:
        r = eng.generate(prompts[0], NEW, mode=DecodeMode("chain", draft_tokens=3))
        rp = eng.generate(prompts[0], NEW, mode=DecodeMode("plain"))
    finally:
        eng.record_margins = False
    assert len(r.margins) >= len(r.token_ids) and len(rp.margins) >= len(rp.token_ids)
    assert all(g >= 0 for g, _ in r.margins + rp.margins)
    assert r.margins[0] == rp.margins[0]  # the prefill chose the first token in both


def test_a_wrong_token_is_reported_as_a_real_divergence(bf16_engine, monkeypatch):
    """An engine that emits the runner-up of a confident verify row (a bug) must be caught as real."""
    import draftsmith.decode.engine as E

    eng, prompts = bf16_engine
    real_accept = E.chain_accept

    def wrong_bonus(draft, p, q, choice):
        a, bonus = real_accept(draft, p, q, choice)
        return a, (bonus + 1) % eng.vocab_size

    monkeypatch.setattr(E, "chain_accept", wrong_bonus)
    rep = run_eval(eng, prompts[:3], DecodeMode("chain", draft_tokens=3), temperatures=[0.0], max_new_tokens=8)
    gd = rep["temperatures"]["0"]["greedy_divergences"]
    assert gd["real"] >= 1, gd
