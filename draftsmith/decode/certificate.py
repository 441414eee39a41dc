"""A certificate for greedy equality in low precision: is a divergence numerics, or a bug?

Speculative greedy decoding emits, at every position, the argmax of a verify row: a forward over several tokens.
Plain decoding emits the argmax of a one-token step. In fp32 both are the same function of the same prefix and
agree token for token. In bf16 a forward over T > 1 rows accumulates its matmuls in another order than a one-row
step, so two logits that are within rounding of each other can come out in either order: the outputs then differ
from that token on, and neither is wrong.

For each prompt whose speculative output differs from plain decoding, `certify` reruns both with the engine's
margin recording on and takes, at the first divergent token j (the prefixes before j are equal, so the two rows
differ by numerics only), the plain step's top-2 logit gap and the verify row's. The divergence is

- a **near tie** when the plain step's gap is within `divergence_epsilon` of zero: the two best logits are within
  a few units in the last place of the model dtype at the logits' magnitude;
- **real** otherwise: the plain step was sure of a token the speculative path did not emit. A correct engine has
  none; any is a bug (or numerics far worse than rounding).

ε for a logit magnitude M is `ULPS_PER_TIE` units in the last place of M in the model dtype: each of the two
paths may place each of the top-2 logits anywhere within about one rounding step, so their order can flip when
the gap is below a few ulps (bf16: ulp(M) = 2^(floor(log2 M) - 7), so M = 20 gives ulp 0.125, ε = 0.5).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# units in the last place of the top logit under which a flipped order is rounding (see the module docstring)
ULPS_PER_TIE = 4


def dtype_ulp(magnitude: float, dtype: torch.dtype) -> float:
    """One unit in the last place of `magnitude` in `dtype` (a float dtype)."""
    m = abs(float(magnitude))
    if m == 0.0 or not math.isfinite(m):
        m = 1.0
    return math.ldexp(torch.finfo(dtype).eps, math.floor(math.log2(m)))


def divergence_epsilon(magnitude: float, dtype: torch.dtype) -> float:
    """The largest top-2 gap at which a greedy divergence counts as a near tie, for logits of this magnitude."""
    return ULPS_PER_TIE * dtype_ulp(magnitude, dtype)


@dataclass
class Divergence:
    """The first token at which speculative and plain greedy outputs of one prompt differ."""

    prompt_index: int
    token_index: int  # among the new tokens
    plain_token: int
    speculative_token: int
    plain_gap: float | None  # top-1 minus top-2 logit of the plain step that chose plain_token
    verify_gap: float | None  # the same for the verify row that chose speculative_token
    top_logit: float | None  # the plain step's top-1 logit
    epsilon: float
    kind: str  # "near_tie" | "real"

    def to_json(self) -> dict:
        return dict(self.__dict__)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where a and b differ (a shorter sequence differs where it ends), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def certify(
    engine, prompt: Sequence[int], mode, max_new_tokens: int, prompt_index: int = 0
) -> tuple[Divergence | None, float]:
    """Rerun plain and speculative greedy decoding of `prompt` with margins recorded. Returns (the first divergence,
    or None when the outputs are equal; the largest |top-1 logit| of the plain run, for ε)."""
    from draftsmith.decode.engine import DecodeMode
    from draftsmith.decode.sampling import SamplingParams

    sp = SamplingParams()
    prev = engine.record_margins
    engine.record_margins = True
    try:
        rp = engine.generate(prompt, max_new_tokens, sampling=sp, mode=DecodeMode("plain"))
        rs = engine.generate(prompt, max_new_tokens, sampling=sp, mode=mode)
    finally:
        engine.record_margins = prev
    top_max = max((abs(t) for _, t in rp.margins or [] if t is not None), default=1.0)
    j = first_difference(rp.token_ids, rs.token_ids)
    if j is None:
        return None, top_max
    if j >= min(len(rp.token_ids), len(rs.token_ids)):
        # one output is a prefix of the other (they stopped differently): no token was chosen differently, so no
        # margin explains it -- counted as real, the conservative side
        return Divergence(
            prompt_index, j, -1, -1, None, None, None, divergence_epsilon(top_max, engine.dtype), "real"
        ), top_max
    pg, top = rp.margins[j]
    vg = rs.margins[j][0]
    eps = divergence_epsilon(top, engine.dtype)
    kind = "near_tie" if pg <= eps else "real"
    return Divergence(prompt_index, j, int(rp.token_ids[j]), int(rs.token_ids[j]), pg, vg, top, eps, kind), top_max


def summarize(n_prompts: int, divergences: Sequence[Divergence], top_logit: float, dtype: torch.dtype) -> dict:
    """eval.json's "greedy_divergences" (a contract): {"equal", "near_tie", "real", "epsilon"}. ε is the near-tie
    bound at the largest top logit seen (`top_logit`, or the divergences' own when larger)."""
    mags = [abs(top_logit)] + [abs(d.top_logit) for d in divergences if d.top_logit is not None]
    return {
        "equal": n_prompts - len(divergences),
        "near_tie": sum(d.kind == "near_tie" for d in divergences),
        "real": sum(d.kind == "real" for d in divergences),
        "epsilon": divergence_epsilon(max(mags), dtype),
    }
