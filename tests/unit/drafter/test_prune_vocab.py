"""`Drafter.prune_draft_vocab` and `draftsmith prune-vocab`: a trained drafter's draft vocab cut to its most
frequent tokens, nothing retrained (CPU, fast)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from draftsmith.cli import app
from draftsmith.common.errors import DraftsmithError
from draftsmith.drafter import Drafter, build_draft_vocab
from tests.unit.drafter.test_drafter import TINY, needs_tiny, small_drafter


def _with_vocab(d: Drafter, counts: torch.Tensor) -> Drafter:
    d2t, t2d = build_draft_vocab(counts, d.config.draft_vocab_size)
    d.set_draft_vocab(d2t, t2d)
    return d


def test_prune_keeps_the_most_frequent_rows_and_their_logits():
    g = torch.Generator().manual_seed(1)
    d = _with_vocab(small_drafter(), torch.randint(0, 1000, (100,), generator=g)).eval()
    counts = torch.randint(0, 50, (100,), generator=g)  # other counts than the ones that chose the vocab
    p = d.prune_draft_vocab(counts, 16).eval()

    assert p.config.draft_vocab_size == 16 and p.lm_head.weight.shape == (16, d.config.hidden_size)
    old_ids = d.draft_target_ids.tolist()
    # the reference: the 16 draft tokens with the highest counts, ties to the lower target id
    want = sorted(sorted(old_ids, key=lambda t: (-int(counts[t]), t))[:16])
    assert p.draft_target_ids.tolist() == want
    assert int(p.t2d.sum()) == 16 and p.t2d[want].all()
    # same hidden state -> the pruned logits are the original logits at the kept draft ids
    h = torch.randn(3, d.config.hidden_size)
    cols = [old_ids.index(t) for t in want]
    torch.testing.assert_close(p.compute_logits(h), d.compute_logits(h)[:, cols], rtol=0, atol=0)
    # everything but the head is untouched
    for (k, v), (k2, v2) in zip(d.trainable_state_dict().items(), p.trainable_state_dict().items()):
        assert k == k2
        if k not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(v, v2), k
    assert p.embed_tokens is not None and torch.equal(p.embed_tokens.weight, d.embed_tokens.weight)


def test_prune_refuses_bad_sizes_and_counts():
    d = small_drafter()
    with pytest.raises(DraftsmithError, match="draft_vocab_size"):
        d.prune_draft_vocab(torch.ones(100), 41)  # more than the 40 it has
    with pytest.raises(DraftsmithError, match="draft_vocab_size"):
        d.prune_draft_vocab(torch.ones(100), 0)
    with pytest.raises(DraftsmithError, match="token_counts"):
        d.prune_draft_vocab(torch.ones(99), 8)


@needs_tiny
def test_prune_vocab_cli_round_trip(tmp_path: Path):
    src = tmp_path / "d"
    torch.manual_seed(0)
    Drafter.from_target(str(TINY), draft_vocab_size=512).save_pretrained(src)
    data = tmp_path / "code.py"
    data.write_text("def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, i))\n" * 20)
    out = tmp_path / "pruned"
    args = ["prune-vocab", str(src), "--draft-vocab-size", "64", "--target", str(TINY), "--out", str(out)]
    r = CliRunner().invoke(app, [*args, "--data", str(data)])
    assert r.exit_code == 0, r.output
    assert "512 -> 64 rows" in r.output and "coverage" in r.output
    p = Drafter.from_pretrained(out, target=str(TINY))
    assert p.config.draft_vocab_size == 64
    # every token of the data that the source draft vocab had is among the kept ones (fewer than 64 distinct)
    from transformers import AutoTokenizer

    seen = set(AutoTokenizer.from_pretrained(str(TINY))(data.read_text())["input_ids"])
    had = seen & set(Drafter.from_pretrained(src).draft_target_ids.tolist())
    assert had <= set(p.draft_target_ids.tolist())

    again = CliRunner().invoke(app, [*args, "--data", str(data)])  # --out exists now
    assert again.exit_code != 0 and "--overwrite" in str(again.exception or again.output)
    (out / "README.md").write_text("kept")
    over = CliRunner().invoke(app, [*args, "--data", str(data), "--draft-vocab-size", "32", "--overwrite"])
    assert over.exit_code == 0, over.output
    assert Drafter.from_pretrained(out).config.draft_vocab_size == 32 and (out / "README.md").read_text() == "kept"
    both = CliRunner().invoke(app, [*args[:-1], str(tmp_path / "x"), "--data", str(data), "--store", str(tmp_path)])
    assert both.exit_code != 0 and "exactly one of --data or --store" in str(both.exception or both.output)


@needs_tiny
def test_prune_vocab_counts_from_a_store(tmp_path: Path):
    """--store: the store's token_counts (its loss tokens) rank the draft vocab."""
    from store_helpers import capture, make_corpus

    from draftsmith.store import HiddenStateStore

    store = tmp_path / "store"
    capture(TINY, make_corpus(tmp_path, n_files=4), store)
    counts = HiddenStateStore.open(store).token_counts()
    src = tmp_path / "d"
    Drafter.from_target(str(TINY), draft_vocab_size=256).save_pretrained(src)
    out = tmp_path / "pruned"
    r = CliRunner().invoke(
        app,
        ["prune-vocab", str(src), "--draft-vocab-size", "16", "--target", str(TINY), "--store", str(store)]
        + ["--out", str(out)],
    )
    assert r.exit_code == 0, r.output
    want = Drafter.from_pretrained(src).prune_draft_vocab(counts, 16).draft_target_ids
    assert Drafter.from_pretrained(out).draft_target_ids.tolist() == want.tolist()
