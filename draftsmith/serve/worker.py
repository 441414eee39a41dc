"""The engine worker: one thread owns the target, the drafter and the engine (batch size 1 is the engine's design),
and serves jobs one at a time from a bounded queue.

Jobs come from the asyncio event loop; the worker reports back through `loop.call_soon_threadsafe` (events
"start", "tokens", "done", "error"). A job leaves the queue either by starting or by expiring (its HTTP handler
gave up waiting: `--queue-timeout`); the state change is under one lock, so a job never does both. A job whose
client disconnected is skipped before it starts, or ends within one round (the engine's `on_tokens` callback
returns False).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("draftsmith.serve")


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    sampling: object  # draftsmith.decode.SamplingParams
    seed: int | None
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    state: str = "queued"  # queued -> running -> finished, or queued -> expired / skipped
    enqueued_at: float = field(default_factory=time.perf_counter)
    number: int = 0

    def push(self, kind: str, payload=None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed (server shutting down): nobody is listening
            pass


class EngineWorker:
    """`build()` runs on the worker thread and returns (engine, mode); `recorder` (optional) gets every finished,
    not-cancelled generation on the same thread, after its "done" event was sent."""

    def __init__(
        self,
        build: Callable[[], tuple[object, object]],
        max_queue: int,
        recorder_factory=None,
        stream_interval_s: float = 0.0,
    ):
        self._build = build
        # tokens of rounds that end within this long of the last hand-off wait and go with the next one: every
        # hand-off wakes the event loop, whose JSON/SSE work then holds the GIL the engine thread's launches need
        # (on an H200 a chain round per hand-off cost 0.25 ms a round, HTTP 0.77x the engine: BENCHMARKS.md "serve")
        self.stream_interval_s = float(stream_interval_s)
        self._recorder_factory = recorder_factory
        self.max_queue = max_queue
        self.engine = None
        self.mode = None
        self.recorder = None
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._busy = False
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._counter = itertools.count(1)
        self._thread = threading.Thread(target=self._run, name="draftsmith-engine", daemon=True)
        self.served = 0
        # engine-thread seconds by what they were spent on, and tokens out (the server's last log line; benchmarks
        # compare them with the HTTP side to say where a request's time went)
        self.timing = {"generate_s": 0.0, "record_s": 0.0, "tokens": 0, "requests": 0}

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise self._failure

    def stop(self, timeout: float = 30.0) -> None:
        self._q.put(None)
        self._thread.join(timeout)
        if self.recorder is not None:
            self.recorder.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def busy(self) -> bool:
        return self._busy

    # -- queue ---------------------------------------------------------------------------------------
    def submit(self, job: Job) -> bool:
        """Queue a job; False when --max-queue jobs are already waiting."""
        with self._lock:
            if self._waiting >= self.max_queue:
                return False
            self._waiting += 1
            job.number = next(self._counter)
        self._q.put(job)
        return True

    def expire(self, job: Job) -> bool:
        """Take a job that has not started out of the queue (True), or report that it already started (False)."""
        with self._lock:
            if job.state != "queued":
                return False
            job.state = "expired"
            self._waiting -= 1
            return True

    # -- the engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine, self.mode = self._build()
            if self._recorder_factory is not None:
                self.recorder = self._recorder_factory(self.engine)
        except BaseException as e:  # reported by start() on the main thread
            self._failure = e
            self._ready.set()
            return
        self._ready.set()
        while True:
            job = self._q.get()
            if job is None:
                return
            with self._lock:
                if job.state != "queued":  # expired while waiting
                    continue
                self._waiting -= 1
                if job.cancelled.is_set():  # its client went away before it started
                    job.state = "skipped"
                    continue
                job.state = "running"
                self._busy = True
            try:
                self._serve(job)
            finally:
                self._busy = False

    def _serve(self, job: Job) -> None:
        job.push("start", time.perf_counter())
        pending: list[int] = []
        last_push = [None]  # the first tokens go at once (time to first token)

        def flush() -> None:
            if pending:
                job.push("tokens", list(pending))
                pending.clear()
                last_push[0] = time.perf_counter()

        def on_tokens(new_ids: list[int]) -> bool:
            if new_ids:
                pending.extend(new_ids)
                if last_push[0] is None or time.perf_counter() - last_push[0] >= self.stream_interval_s:
                    flush()
            return not job.cancelled.is_set()

        t0 = time.perf_counter()
        try:
            res = self.engine.generate(
                job.prompt_ids,
                job.max_tokens,
                sampling=job.sampling,
                mode=self.mode,
                seed=job.seed,
                stop_strings=job.stop,
                on_tokens=on_tokens,
            )
        except Exception as e:  # the HTTP side answers 500 with one line; the traceback goes to the log
            log.error("generation failed:\n%s", traceback.format_exc())
            flush()
            job.state = "finished"
            job.push("error", f"{type(e).__name__}: {e}")
            return
        flush()
        job.state = "finished"
        self.served += 1
        t1 = time.perf_counter()
        self.timing["generate_s"] += t1 - t0
        self.timing["tokens"] += len(res.token_ids)
        self.timing["requests"] += 1
        job.push("done", res)
        if self.recorder is not None and res.finish_reason != "cancelled":
            try:
                self.recorder.record(job.prompt_ids, res.token_ids)
            except Exception:
                log.error("capture while serving failed for one request:\n%s", traceback.format_exc())
            self.timing["record_s"] += time.perf_counter() - t1
