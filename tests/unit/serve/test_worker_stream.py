"""Streaming hand-offs of the engine worker: rounds that end within --stream-interval-ms of the last hand-off are
coalesced (fewer event-loop wake-ups), the first token goes at once, and nothing is lost or reordered."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from draftsmith.serve.worker import EngineWorker, Job


@dataclass
class _Recorded(Job):
    pushed: list = field(default_factory=list)

    def push(self, kind, payload=None):
        self.pushed.append((kind, payload))


class _Engine:
    """Emits 1 token from prefill, then rounds of 3 tokens, `pause` seconds apart."""

    def __init__(self, rounds: int, pause: float):
        self.rounds, self.pause = rounds, pause

    def generate(self, prompt_ids, max_new_tokens, sampling, mode, seed, stop_strings, on_tokens):
        toks = [0]
        on_tokens([0])
        for r in range(self.rounds):
            time.sleep(self.pause)
            new = [3 * r + 1, 3 * r + 2, 3 * r + 3]
            toks += new
            if on_tokens(new) is False:
                break
        return type("Res", (), {"token_ids": toks, "finish_reason": "length"})()


def _serve(interval_s: float, rounds: int = 20, pause: float = 0.001):
    loop = asyncio.new_event_loop()
    try:
        job = _Recorded([1, 2], 64, None, None, [], loop)
        w = EngineWorker(lambda: None, max_queue=1, stream_interval_s=interval_s)
        w.engine = _Engine(rounds, pause)
        w._serve(job)
    finally:
        loop.close()
    chunks = [p for k, p in job.pushed if k == "tokens"]
    assert [k for k, _ in job.pushed][0] == "start" and job.pushed[-1][0] == "done"
    assert sum(chunks, []) == list(range(3 * rounds + 1))  # every token once, in order
    return chunks


def test_zero_interval_hands_off_every_round():
    chunks = _serve(0.0)
    assert len(chunks) == 21 and chunks[0] == [0]


def test_an_interval_coalesces_rounds_but_sends_the_first_token_at_once():
    chunks = _serve(10.0)  # longer than the whole generation: the first token, then the rest at the end
    assert chunks[0] == [0] and len(chunks) == 2
    chunks = _serve(0.004, rounds=30, pause=0.001)  # ~4 rounds a hand-off
    assert chunks[0] == [0] and 3 <= len(chunks) <= 20
