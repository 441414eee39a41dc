"""Settings chosen by measurement: a short calibration picks the fastest decode mode on this engine, or plain.

Which setting wins depends on the target, the drafter, the device and the kernels (a small launch-bound target
wants a short chain; an 8B-class target deep trees; a CPU pays for every verify row), so `tune` measures instead
of guessing: each candidate mode decodes the calibration prompts (greedy, one untimed pass first), and its decode
rate (new tokens / wall time, prefill included), τ and time per round are recorded next to plain decoding's on
the same engine. Settings that land close together (within FINAL_MARGIN of the fastest, or the fastest within it
of plain) are measured again with FINAL_TOKENS_FACTOR times the tokens, plain with them, and that second measurement
decides. The fastest candidate wins only if it beats plain decoding; otherwise the choice is plain, so a tuned
setting is never slower than plain decoding on the calibration prompts.

    from draftsmith.decode.tuning import tune
    t = tune(engine, prompts[:4], max_new_tokens=64)
    t.mode, t.speedup, t.to_json(); t.save("tuning.json"); Tuning.load("tuning.json").mode
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from draftsmith.common.errors import DraftsmithError
from draftsmith.decode.engine import DecodeMode
from draftsmith.decode.sampling import SamplingParams

# a handful of shapes that span the useful range: short/long chains for launch-bound or CPU targets (on a CPU a
# chain of 1 costs about one plain step a round, so even a weak drafter's first-token acceptance pays), a small and
# a deep tree for targets whose verify rows are nearly free
DEFAULT_CANDIDATES = (
    DecodeMode("chain", draft_tokens=1),
    DecodeMode("chain", draft_tokens=2),
    DecodeMode("chain", draft_tokens=3),
    DecodeMode("chain", draft_tokens=4),
    DecodeMode("chain", draft_tokens=6),
    DecodeMode("tree", top_k=4, depth=4, tree_tokens=16),
    DecodeMode("tree", top_k=8, depth=6, tree_tokens=48),
)
CALIBRATION_PROMPTS = 4
CALIBRATION_TOKENS = 64
# The second, longer measurement of close settings: 4 prompts x 64 tokens ranked chain K=4 within 3 % of K=6 on
# pycode-small, and K=4 then ran 1.44x against K=6's 1.52x over 24 prompts x 200 tokens (BENCHMARKS.md, 2026-12-02
# twelfth session): a short calibration cannot separate settings that close. Finalists: those within FINAL_MARGIN of
# the fastest (at most FINALISTS), remeasured with plain at FINAL_TOKENS_FACTOR x the tokens.
FINAL_MARGIN = 0.10
FINALISTS = 3
FINAL_TOKENS_FACTOR = 4


@dataclass
class Tuning:
    """The chosen mode and what calibration measured (tok/s = new tokens / wall time, prefill included)."""

    mode: DecodeMode
    tok_s: float
    plain_tok_s: float
    candidates: list[dict] = field(default_factory=list)  # one row per mode and stage measured (plain first)
    prompts: int = 0
    max_new_tokens: int = 0

    @property
    def speedup(self) -> float:
        return self.tok_s / self.plain_tok_s if self.plain_tok_s else 1.0

    def summary(self) -> str:
        if self.mode.kind == "plain":
            return (
                f"tuned: plain decoding (no speculative setting beat it: plain {self.plain_tok_s:.1f} tok/s, "
                f"best {self._best_speculative():.1f})"
            )
        return (
            f"tuned: {describe(self.mode)}, {self.tok_s:.1f} tok/s = {self.speedup:.2f}x plain ({self.plain_tok_s:.1f})"
        )

    def _best_speculative(self) -> float:
        """The fastest speculative row of the deciding (last) stage measured."""
        last = max((int(c.get("stage", 1)) for c in self.candidates), default=1)
        return max(
            (
                c["tok_s"]
                for c in self.candidates
                if int(c.get("stage", 1)) == last and (c.get("mode") or {}).get("kind") != "plain"
            ),
            default=0.0,
        )

    def to_json(self) -> dict:
        return {
            "mode": mode_json(self.mode),
            "tok_s": self.tok_s,
            "plain_tok_s": self.plain_tok_s,
            "speedup": self.speedup,
            "candidates": self.candidates,
            "prompts": self.prompts,
            "max_new_tokens": self.max_new_tokens,
        }

    def save(self, path: str | Path, **context) -> None:
        from draftsmith.common.io import atomic_write_json

        atomic_write_json(Path(path), {"format": "draftsmith-tuning/1", **self.to_json(), **context})

    @classmethod
    def load(cls, path: str | Path) -> Tuning:
        """A file written by `save` (`--save-tuning`); errors name the file and the field."""
        p = Path(path)
        try:
            obj = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise DraftsmithError(f"{path}: no such tuning file") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DraftsmithError(f"{path}: not a tuning JSON file ({e})") from None
        if not isinstance(obj, dict) or obj.get("format") != "draftsmith-tuning/1":
            raise DraftsmithError(f"{path}: field 'format': expected 'draftsmith-tuning/1' (a --save-tuning file)")
        mode = mode_from_json(obj.get("mode"), f"{path}: field 'mode'")
        nums = {}
        for k in ("tok_s", "plain_tok_s"):
            v = obj.get(k)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0:
                raise DraftsmithError(f"{path}: field {k!r}: expected a number >= 0, got {v!r}")
            nums[k] = float(v)
        return cls(
            mode,
            nums["tok_s"],
            nums["plain_tok_s"],
            list(obj.get("candidates") or []),
            int(obj.get("prompts") or 0),
            int(obj.get("max_new_tokens") or 0),
        )


def describe(mode: DecodeMode) -> str:
    if mode.kind == "chain":
        return f"chain K={mode.draft_tokens}"
    if mode.kind == "tree":
        return f"tree top_k={mode.top_k} depth={mode.depth} tokens={mode.tree_tokens}"
    return "plain"


def mode_json(mode: DecodeMode) -> dict:
    return asdict(mode)


def mode_from_json(obj, where: str) -> DecodeMode:
    if not isinstance(obj, dict):
        raise DraftsmithError(f"{where}: expected an object like {mode_json(DecodeMode())}")
    fields = {"kind": str, "draft_tokens": int, "top_k": int, "depth": int, "tree_tokens": int}
    kw = {}
    for k, v in obj.items():
        if k not in fields:
            raise DraftsmithError(f"{where}: unknown key {k!r} (expected {sorted(fields)})")
        if not isinstance(v, fields[k]) or isinstance(v, bool):
            raise DraftsmithError(f"{where}.{k}: expected {fields[k].__name__}, got {v!r}")
        kw[k] = v
    mode = DecodeMode(**kw)
    try:
        mode.validate()
    except ValueError as e:
        raise DraftsmithError(f"{where}: {e}") from None
    return mode


def _measure(engine, prompts, mode: DecodeMode, sp: SamplingParams, max_new_tokens: int, seed: int) -> dict:
    engine.warmup(mode, sp)
    engine.generate(prompts[0], min(8, max_new_tokens), sampling=sp, mode=mode, seed=seed)  # untimed
    new = rounds = accepted = 0
    wall = decode = 0.0
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        r = engine.generate(p, max_new_tokens, sampling=sp, mode=mode, seed=seed + i)
        new += len(r.token_ids)
        wall += r.prefill_s + r.decode_s
        decode += r.decode_s
        rounds += r.rounds
        accepted += sum(r.accepted) + len(r.accepted)
    tau = accepted / rounds if mode.kind != "plain" and rounds else 1.0
    return {
        "mode": mode_json(mode),
        "tok_s": new / wall if wall else 0.0,
        "tau": tau,
        "round_ms": 1e3 * decode / rounds if rounds else None,
        "new_tokens": new,
        "calibration_s": time.perf_counter() - t0,
    }


def tune(
    engine,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = CALIBRATION_TOKENS,
    candidates: Sequence[DecodeMode] | None = None,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    progress=None,
    final_tokens: int | None = None,
) -> Tuning:
    """Measure plain decoding and each candidate mode on `prompts` (use a few: calibration should be short) and
    return the fastest, or plain when none beats it. Without a drafter the answer is plain. Close results (module
    docstring) are measured again at `final_tokens` new tokens (default FINAL_TOKENS_FACTOR x max_new_tokens; none
    when not more than max_new_tokens, or when no prompt fits the cache with them), which then decide. Each row
    has "stage" (1, 2)."""
    if not prompts:
        raise ValueError("tune needs at least one calibration prompt")
    sp = sampling or SamplingParams()
    cands = [m for m in (candidates if candidates is not None else DEFAULT_CANDIDATES) if m.kind != "plain"]
    for m in cands:
        m.validate()
    need = max([m.cache_need for m in cands] + [1]) + 2
    usable = [p for p in prompts if len(p) + max_new_tokens + need <= engine.max_len]
    if not usable:
        raise ValueError(
            f"no calibration prompt fits the engine's cache ({engine.max_len} tokens) with {max_new_tokens} new tokens"
        )
    # one untimed prefill per prompt length first: the first prefill of a new length pays one-time costs (kernel
    # selection, allocator growth) that would land on plain, measured first (eval does the same before its pass)
    warm = [DecodeMode("plain")] + (cands[:1] if engine.drafter is not None else [])  # with and without the drafter
    for n in sorted({len(p) for p in usable}):
        for m in warm:
            engine.generate(next(p for p in usable if len(p) == n), 1, sampling=sp, mode=m, seed=seed)

    def measure(mode, prompts_, tokens, stage):
        row = {**_measure(engine, prompts_, mode, sp, tokens, seed), "stage": stage}
        if progress:
            progress(row)
        return row

    rows = [measure(DecodeMode("plain"), usable, max_new_tokens, 1)]
    if engine.drafter is not None:
        rows += [measure(m, usable, max_new_tokens, 1) for m in cands]
    deciding = rows
    finals = _finalists(rows)
    n_final = FINAL_TOKENS_FACTOR * max_new_tokens if final_tokens is None else final_tokens
    usable2 = [p for p in usable if len(p) + n_final + need <= engine.max_len]
    if finals and n_final > max_new_tokens and usable2:  # (no longer than the first stage: nothing to add)
        deciding = [measure(DecodeMode("plain"), usable2, n_final, 2)]
        deciding += [measure(DecodeMode(**r["mode"]), usable2, n_final, 2) for r in finals]
        rows += deciding
    plain = deciding[0]["tok_s"]
    best = max(deciding[1:], key=lambda r: r["tok_s"], default=None)
    if best is None or best["tok_s"] <= plain:
        chosen, tok_s = DecodeMode("plain"), plain
    else:
        chosen, tok_s = DecodeMode(**best["mode"]), best["tok_s"]
    return Tuning(chosen, tok_s, plain, rows, len(usable), max_new_tokens)


def _finalists(rows: list[dict]) -> list[dict]:
    """The first stage's candidate rows worth a second measurement (rows[0] is plain's), fastest first: those within
    FINAL_MARGIN of the fastest, at most FINALISTS — when there are two or more, or the fastest is within the margin
    of plain (the fallback decision is close too); else [] (the first stage decides)."""
    ranked = sorted(rows[1:], key=lambda r: -r["tok_s"])
    if not ranked:
        return []
    top = ranked[0]["tok_s"]
    close = [r for r in ranked if r["tok_s"] >= (1 - FINAL_MARGIN) * top][:FINALISTS]
    if len(close) > 1 or top < (1 + FINAL_MARGIN) * rows[0]["tok_s"]:
        return close
    return []
