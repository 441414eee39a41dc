"""`draftsmith eval --passes N`: the speedup is the median of N timed passes, each pass's ratio listed (CPU)."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch
from decode_helpers import random_drafter

from draftsmith.common.errors import DraftsmithError
from draftsmith.decode.engine import DecodeMode, SpeculativeDecoder
from draftsmith.decode.evaluate import print_table, run_eval

TINY = Path(__file__).resolve().parents[3] / "assets" / "pycode-tiny"
pytestmark = pytest.mark.skipif(not (TINY / "config.json").is_file(), reason="pycode-tiny not available")


@pytest.fixture(scope="module")
def engine_and_prompts():
    from draftsmith.target_model import load_target

    torch.manual_seed(0)
    t = load_target(str(TINY), dtype="fp32")
    d = random_drafter(t.model, seed=0, aux_layer_ids=[1, 3, 4])
    prompts = [t.tokenizer.encode(s) for s in ("def ", "import os\n", "for i in range(")]
    return SpeculativeDecoder(t, d, max_len=64), prompts


def test_speedup_is_the_median_of_the_passes(engine_and_prompts, one_thread):
    eng, prompts = engine_and_prompts
    mode = DecodeMode("chain", draft_tokens=2)
    one = run_eval(eng, prompts, mode, temperatures=[0.0, 1.0], max_new_tokens=8)
    assert all("speedup_passes" not in e for e in one["temperatures"].values())
    rep = run_eval(eng, prompts, mode, temperatures=[0.0, 1.0], max_new_tokens=8, passes=3)
    for e in rep["temperatures"].values():
        ps = e["speedup_passes"]
        assert len(ps) == 3 and all(p > 0 for p in ps)
        assert e["speedup"] == statistics.median(ps)
        # the first pass is the one the summaries describe: its ratio is theirs
        s, pl = e["speculative"], e["plain"]
        assert ps[0] == pytest.approx(s["tokens_per_s"] / pl["tokens_per_s"])
        # and the decode-only ratio leaves the prefill out of both
        assert e["decode_speedup"] == pytest.approx(s["decode_tokens_per_s"] / pl["decode_tokens_per_s"])
    from rich.console import Console

    console = Console(record=True, width=200)
    print_table(rep, console)
    text = console.export_text()
    assert "median of 3" in text and "decode only" in text
    narrow = Console(record=True, width=80)  # the decode-only ratio moves under the table
    print_table(rep, narrow)
    assert "speedup without the prefill (decode only): " in narrow.export_text()


def test_passes_below_one_are_refused(engine_and_prompts):
    eng, prompts = engine_and_prompts
    with pytest.raises(DraftsmithError, match="--passes"):
        run_eval(eng, prompts, DecodeMode("chain", draft_tokens=2), temperatures=[0.0], max_new_tokens=4, passes=0)
