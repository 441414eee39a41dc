"""The serve queue and its edges with a scripted engine (no model): --queue-timeout and --max-queue answer 429, a
queued request whose stream client left is skipped, the engine's failure is a one-line 500; stop-string hold-back;
the capture recorder appending to its own store after a restart."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from draftsmith.decode.engine import GenerationResult  # noqa: E402  (after the importorskips)
from draftsmith.serve.app import ServeSettings, _cut_at_stop, _held_back, create_app  # noqa: E402
from draftsmith.serve.worker import EngineWorker  # noqa: E402


class _Tok:
    """Token i decodes to chr(ord('a') + i % 26)."""

    chat_template = None

    def __call__(self, text):
        return {"input_ids": [ord(c) - ord("a") for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i % 26) for i in ids)


class ScriptedEngine:
    """Emits token (prompt[0] + k) % 26 for k = 1, 2, ... every `step_s`; prompt [25, ...] raises."""

    eos_ids: set = set()

    def __init__(self, step_s: float):
        self.step_s = step_s
        self.started: list[list[int]] = []

    def generate(
        self, prompt_ids, max_new_tokens, sampling=None, mode=None, seed=None, stop_strings=(), on_tokens=None
    ):
        self.started.append(list(prompt_ids))
        if prompt_ids[0] == 25:
            raise RuntimeError("scripted failure")
        res = GenerationResult([], None, "length", len(prompt_ids), 0)
        for k in range(1, max_new_tokens + 1):
            time.sleep(self.step_s)
            res.token_ids.append((prompt_ids[0] + k) % 26)
            if on_tokens is not None and on_tokens(res.token_ids[-1:]) is False:
                res.finish_reason = "cancelled"
                break
        return res


def _serve(engine, **settings):
    worker = EngineWorker(lambda: (engine, None), max_queue=settings.pop("max_queue", 1))
    worker.start()
    s = ServeSettings(model_name="scripted", max_model_len=64, vocab_size=26, eos_ids=set(), **settings)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_app(worker, _Tok(), s), host="127.0.0.1", port=port, log_level="error")
    )
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.time() + 20
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    return server, th, worker, f"http://127.0.0.1:{port}"


@pytest.fixture
def scripted():
    made = []

    def make(step_s: float, **settings):
        engine = ScriptedEngine(step_s)
        server, th, worker, base = _serve(engine, **settings)
        made.append((server, th, worker))
        return engine, base

    yield make
    for server, th, worker in made:
        server.should_exit = True
        th.join(10)
        worker.stop(10)


def _post(base, results, key, body):
    try:
        r = httpx.post(base + "/v1/completions", json=body, timeout=30)
        results[key] = (r.status_code, r.json())
    except httpx.HTTPError as e:
        results[key] = (None, str(e))


def test_queue_timeout_and_full_queue_answer_429(scripted):
    engine, base = scripted(0.05, queue_timeout=0.4, max_queue=1)
    results: dict = {}
    a = threading.Thread(target=_post, args=(base, results, "a", {"prompt": "a", "max_tokens": 20}))
    a.start()  # ~1 s on the engine
    time.sleep(0.2)
    b = threading.Thread(target=_post, args=(base, results, "b", {"prompt": "b", "max_tokens": 2}))
    b.start()  # waits in the queue (the one place)
    time.sleep(0.1)
    _post(base, results, "c", {"prompt": "c", "max_tokens": 2})  # no place left
    b.join(10)
    a.join(10)
    assert results["a"][0] == 200 and results["a"][1]["choices"][0]["text"] == "bcdefghijklmnopqrstu"
    assert results["c"][0] == 429 and "--max-queue" in results["c"][1]["error"]["message"]
    assert results["b"][0] == 429 and "--queue-timeout" in results["b"][1]["error"]["message"]
    assert [p[0] for p in engine.started] == [0]  # the expired request never reached the engine
    r = httpx.post(base + "/v1/completions", json={"prompt": "d", "max_tokens": 3}, timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "efg"


def test_stream_disconnect_cancels_and_engine_error_is_one_line_500(scripted):
    _, base = scripted(0.02, max_queue=4)
    with httpx.Client(timeout=10) as c:
        with c.stream("POST", base + "/v1/completions", json={"prompt": "a", "max_tokens": 60, "stream": True}) as r:
            next(ln for ln in r.iter_lines() if ln.startswith("data:"))
    t0 = time.time()
    r = httpx.post(base + "/v1/completions", json={"prompt": "b", "max_tokens": 2}, timeout=10)
    assert r.status_code == 200 and time.time() - t0 < 0.9  # the 60-token stream (1.2 s) was cut short
    r = httpx.post(base + "/v1/completions", json={"prompt": "z", "max_tokens": 2}, timeout=10)
    assert r.status_code == 500
    msg = r.json()["error"]["message"]
    assert "scripted failure" in msg and "\n" not in msg and "Traceback" not in r.text
    assert httpx.get(base + "/health", timeout=10).json()["status"] == "ok"


def test_stop_string_hold_back():
    assert _cut_at_stop("abc</s>def", ["</s>"]) == "abc"
    assert _cut_at_stop("abc", ["</s>"]) == "abc"
    assert _held_back("abc</", ["</s>"]) == 2 and _held_back("abc<", ["</s>", "<|end|>"]) == 1
    assert _held_back("abc", ["</s>"]) == 0


def test_recorder_appends_after_restart_and_refuses_other_settings(tiny_path, tmp_path):
    from draftsmith.common.errors import DraftsmithError
    from draftsmith.serve.recorder import ServeRecorder
    from draftsmith.store import HiddenStateStore
    from draftsmith.store.verify import verify_store
    from draftsmith.target_model import load_target

    t = load_target(str(tiny_path), dtype="fp32")
    out = tmp_path / "store"
    r1 = ServeRecorder(out, t, [1, 2, 3], flush_s=60)
    assert r1.record([5, 6, 7], [8, 9])
    r1.close()
    r2 = ServeRecorder(out, t, [1, 2, 3], max_tokens=9, flush_s=60)
    assert r2.record([10, 11], [12])
    assert not r2.record([1] * 4, [2])  # would pass --capture-max-tokens 9
    r2.close()
    assert verify_store(out, progress=False) == []
    s = HiddenStateStore.open(out)
    assert len(s) == 2 and len(s.manifest["shards"]) == 2
    assert s[1]["input_ids"].tolist() == [10, 11, 12] and s[1]["loss_mask"].tolist() == [False, False, True]
    assert s.token_counts()[[8, 9, 12]].tolist() == [1, 1, 1] and int(s.token_counts().sum()) == 3
    aux = s[0]["aux_hidden_states"]
    assert aux.shape == (5, 3 * t.hidden_size) and aux.dtype == torch.bfloat16
    with pytest.raises(DraftsmithError, match="aux_layers"):
        ServeRecorder(out, t, [1, 2], flush_s=60)


@pytest.mark.parametrize(
    "cmd,flags",
    [
        (
            "serve",
            [
                "--target",
                "--drafter",
                "--host",
                "--port",
                "--api-key",
                "--max-queue",
                "--queue-timeout",
                "--tree",
                "--draft-tokens",
                "--kernels",
                "--compile",
                "--capture-to",
                "--capture-max-tokens",
            ],
        ),
        (
            "bench-endpoint",
            [
                "--url",
                "--model",
                "--prompts",
                "--max-tokens",
                "--concurrency",
                "--requests",
                "--label",
                "--out",
                "--api-key",
            ],
        ),
    ],
)
def test_contract_flags(cmd, flags):
    from typer.testing import CliRunner

    from draftsmith.cli import app

    r = CliRunner().invoke(app, [cmd, "--help"], terminal_width=240, env={"COLUMNS": "240"})
    assert r.exit_code == 0, r.output
    assert all(f in r.output for f in flags), [f for f in flags if f not in r.output]
    if cmd == "serve":
        assert "127.0.0.1" in r.output  # loopback by default
