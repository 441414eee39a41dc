"""Lossless sampling: the empirical joint distribution of the first emitted tokens matches the target's
exact distribution (chi-square), for chain speculative sampling and tree recursive rejection sampling."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from decode_helpers import random_drafter, tiny_llama

from draftsmith.decode.engine import DecodeMode, SpeculativeDecoder
from draftsmith.decode.sampling import SamplingParams, chain_accept, leading_true, warp

V = 5
PROMPT = [1, 3, 2]
N = 1500


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _chi2_pvalue(observed: Counter, expected: dict, n: int) -> float:
    cells = sorted(expected, key=lambda c: expected[c])
    stat, df, pool_o, pool_e = 0.0, 0, 0.0, 0.0
    for c in cells:
        e = expected[c] * n
        if e < 5:
            pool_o += observed.get(c, 0)
            pool_e += e
            continue
        stat += (observed.get(c, 0) - e) ** 2 / e
        df += 1
    if pool_e > 0:
        stat += (pool_o - pool_e) ** 2 / max(pool_e, 1e-9)
        df += 1
    df -= 1
    return float(
        torch.special.gammaincc(
            torch.tensor(df / 2.0, dtype=torch.float64), torch.tensor(stat / 2.0, dtype=torch.float64)
        )
    )


def _exact_joint(model, sp, n_tok=3):
    out = {}
    with torch.no_grad():
        for combo in itertools.product(range(V), repeat=n_tok):
            seq = PROMPT + list(combo)
            logits = model(torch.tensor([seq])).logits[0]
            prob = 1.0
            for i, t in enumerate(combo):
                prob *= float(warp(logits[len(PROMPT) - 1 + i], sp)[t])
            out[combo] = prob
    return out


@pytest.fixture(scope="module")
def setup():
    m = tiny_llama(vocab_size=V, init=0.4, seed=1)
    d = random_drafter(m, seed=2)
    return m, d


CASES = [
    ("chain", DecodeMode("chain", draft_tokens=2), SamplingParams(temperature=1.0)),
    ("tree", DecodeMode("tree", top_k=2, depth=2, tree_tokens=4), SamplingParams(temperature=1.0)),
    ("tree-warped", DecodeMode("tree", top_k=2, depth=3, tree_tokens=5), SamplingParams(0.8, top_p=0.9, top_k=4)),
    ("chain-warped", DecodeMode("chain", draft_tokens=3), SamplingParams(1.3, top_p=0.95, top_k=3)),
]


@pytest.mark.parametrize("name,mode,sp", CASES, ids=[c[0] for c in CASES])
def test_first_tokens_match_target_distribution(setup, name, mode, sp):
    m, d = setup
    eng = SpeculativeDecoder(m, d, max_len=32)
    exact = _exact_joint(m, sp)
    assert abs(sum(exact.values()) - 1) < 1e-4
    torch.manual_seed(1234)
    obs = Counter()
    accepted = 0
    for _ in range(N):
        r = eng.generate(PROMPT, 3, sampling=sp, mode=mode)
        obs[tuple(r.token_ids)] += 1
        accepted += sum(r.accepted)
    assert accepted > 0.1 * N  # both accept and reject paths were exercised
    p = _chi2_pvalue(obs, exact, N)
    assert p > 1e-3, (p, obs.most_common(5))


def test_chi2_detects_a_biased_sampler(setup):
    """Sanity of the statistic: samples from the drafter's distribution alone are rejected."""
    m, _ = setup
    sp = SamplingParams(temperature=1.0)
    exact = _exact_joint(m, sp)
    biased = {c: (p**1.5) for c, p in exact.items()}
    z = sum(biased.values())
    g = torch.Generator().manual_seed(0)
    keys = list(biased)
    idx = torch.multinomial(torch.tensor([biased[k] / z for k in keys]), N, replacement=True, generator=g)
    obs = Counter(keys[i] for i in idx.tolist())
    assert _chi2_pvalue(obs, exact, N) < 1e-3


def test_leading_true_counts_the_accepted_prefix():
    """leading_true (chain acceptance's count, a min-reduction) equals the scan it replaced, cumprod(ok).sum(), on
    every boolean vector of lengths 1-7, and greedy chain_accept takes its bonus token at that index."""
    for K in range(1, 8):
        for bits in itertools.product([False, True], repeat=K):
            ok = torch.tensor(bits)
            want = torch.cumprod(ok.long(), 0).sum()
            got = leading_true(ok)
            assert got.dtype == torch.long and got.shape == () and int(got) == int(want), bits
    choice = torch.tensor([5, 6, 7, 8])
    a, bonus = chain_accept(torch.tensor([5, 6, 0]), None, None, choice)
    assert (int(a), int(bonus)) == (2, 7)


def test_chain_accept_rule_is_exact():
    """Monte-Carlo of one speculative-sampling step: P(emit x) == p(x) for arbitrary p, q."""
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(2, 6) * 2, -1)
    q = torch.softmax(torch.randn(1, 6) * 2, -1)
    counts = torch.zeros(6)
    n = 20000
    draws = torch.multinomial(q[0], n, replacement=True)
    for x in draws.tolist():
        a, bonus = chain_accept(torch.tensor([x]), p, q, None)
        counts[x if int(a) == 1 else int(bonus)] += 1
    torch.testing.assert_close(counts / n, p[0], atol=0.015, rtol=0)
