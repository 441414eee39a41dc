"""`draftsmith serve` end to end: real server processes on loopback (the bundled demo target, with a saved random
drafter and without), the real `openai` client and raw httpx; `bench-endpoint` against the live server; the store
recorded while serving against an offline capture of the same tokens.

One server of each kind for the whole module (started together); tests only send requests. The speculative server
records into a store (`--capture-to`), the plain one requires an API key.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "assets" / "pycode-tiny"
pytestmark = pytest.mark.skipif(not TINY.is_dir(), reason="assets/pycode-tiny not available")

API_KEY = "sekret-key"
PROMPTS = ["def fib(n):\n", "import os\n\n\ndef read_lines(path):\n"]
CHAT_TEMPLATE = (
    "{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}# assistant:\n{% endif %}"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args: list[str], log_path: Path):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "draftsmith",
                "serve",
                "--target",
                str(TINY),
                "--port",
                str(self.port),
                "--device",
                "cpu",
                "--log-level",
                "warning",
                *args,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(ROOT),
        )

    def wait_ready(self, deadline: float) -> None:
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log_path.read_text()}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not ready in time:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()

    def client(self, key: str = "unused"):
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0, timeout=60)

    def metric(self, name: str, **labels) -> float:
        text = httpx.get(self.base + "/metrics", timeout=10).text
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        pat = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if want else "") + r" ([0-9.e+-]+)$"
        m = re.search(pat, text, re.M)
        return float(m.group(1)) if m else 0.0


def _save_random_drafter(path: Path) -> None:
    from draftsmith.drafter import Drafter
    from draftsmith.target_model import load_target

    t = load_target(str(TINY), dtype="fp32")
    torch.manual_seed(0)
    Drafter.from_target(t, draft_vocab_size=2048).save_pretrained(path)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    (d / "chat.jinja").write_text(CHAT_TEMPLATE)
    store = d / "store"
    # starts while we build the drafter; records with the default flush (60 s): its store is written at SIGTERM
    plain = Server(
        ["--api-key", API_KEY, "--max-model-len", "256", "--capture-to", str(d / "plain_store")], d / "plain.log"
    )
    spec = None
    try:
        _save_random_drafter(d / "drafter")  # untrained: greedy output must not depend on the drafter anyway
        spec = Server(
            [
                "--drafter",
                str(d / "drafter"),
                "--draft-tokens",
                "3",
                "--chat-template",
                str(d / "chat.jinja"),
                "--max-queue",
                "4",
                "--max-model-len",
                "1024",
                "--capture-to",
                str(store),
                "--capture-flush-s",
                "0.2",
            ],
            d / "spec.log",
        )
        deadline = time.time() + 150
        spec.wait_ready(deadline)
        plain.wait_ready(deadline)
        yield {"spec": spec, "plain": plain, "store": store, "dir": d}
    finally:
        for srv in (spec, plain):
            if srv is not None:
                srv.stop()


@pytest.fixture(scope="module")
def tokenizer():
    from draftsmith.target_model.load import load_tokenizer

    return load_tokenizer(str(TINY))


@pytest.fixture(scope="module")
def reference():
    """`draftsmith generate --json` (plain greedy) for each prompt: the text every server must return."""
    from typer.testing import CliRunner

    from draftsmith.cli import app

    out = {}
    for p in PROMPTS:
        r = CliRunner().invoke(
            app,
            ["generate", "--target", str(TINY), "--prompt", p, "--max-new-tokens", "24", "--json", "--device", "cpu"],
        )
        assert r.exit_code == 0, r.output
        out[p] = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])
    return out


def _ref_text(ref: dict, tokenizer) -> str:
    ids = ref["token_ids"]
    if ids and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("kind", ["spec", "plain"])
def test_greedy_completion_equals_generate(servers, reference, tokenizer, kind):
    srv = servers[kind]
    client = srv.client(API_KEY)
    for p in PROMPTS:
        r = client.completions.create(model="pycode-tiny", prompt=p, max_tokens=24, temperature=0)
        ref = reference[p]
        assert r.choices[0].text == _ref_text(ref, tokenizer)
        assert r.choices[0].finish_reason == ("length" if ref["finish_reason"] == "length" else "stop")
        assert r.usage.prompt_tokens == len(tokenizer(p)["input_ids"])
        assert r.usage.completion_tokens == len(ref["token_ids"])
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.id.startswith("cmpl-") and r.model == "pycode-tiny"


@pytest.mark.parametrize("kind", ["spec", "plain"])
def test_streaming_matches_non_streaming(servers, reference, tokenizer, kind):
    client = servers[kind].client(API_KEY)
    p = PROMPTS[0]
    chunks = list(
        client.completions.create(
            model="pycode-tiny",
            prompt=p,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == _ref_text(reference[p], tokenizer)
    assert len([c for c in chunks if c.choices and c.choices[0].text]) >= 2  # really streamed, not one blob
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices
    assert len({c.id for c in chunks}) == 1


def test_chat_goes_through_the_template(servers, tokenizer):
    srv = servers["spec"]
    client = srv.client()
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "a fibonacci function"}]
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    r = client.chat.completions.create(model="pycode-tiny", messages=msgs, max_tokens=16, temperature=0)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.role == "assistant"
    # the same tokens sent as a completion give the same text: the chat endpoint applied exactly this template
    same = client.completions.create(model="pycode-tiny", prompt=ids, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == same.choices[0].text
    stream = list(
        client.chat.completions.create(model="pycode-tiny", messages=msgs, max_tokens=16, temperature=0, stream=True)
    )
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == r.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_stop_strings(servers, reference, tokenizer):
    client = servers["spec"].client()
    p = PROMPTS[0]
    full = _ref_text(reference[p], tokenizer)
    stop = "fib(n)" if "fib(n)" in full else full[5:9]
    want = full[: full.index(stop)]
    r = client.completions.create(model="pycode-tiny", prompt=p, max_tokens=24, temperature=0, stop=[stop, "@@@@"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 24
    chunks = list(
        client.completions.create(model="pycode-tiny", prompt=p, max_tokens=24, temperature=0, stop=stop, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == want  # the stop string never leaks into a stream
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_sampling_with_seed_is_reproducible(servers):
    client = servers["spec"].client()
    kw = dict(model="pycode-tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0.9, top_p=0.95, seed=7)
    a = client.completions.create(**kw).choices[0].text
    assert a == client.completions.create(**kw).choices[0].text
    # top_k reaches the sampler: with top_k=1 sampling at any temperature is greedy decoding
    greedy = client.completions.create(model="pycode-tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0)
    top1 = client.completions.create(**kw, extra_body={"top_k": 1})
    assert top1.choices[0].text == greedy.choices[0].text


def test_models_health_and_auth(servers):
    spec, plain = servers["spec"], servers["plain"]
    assert [m.id for m in spec.client().models.list().data] == ["pycode-tiny"]
    h = httpx.get(spec.base + "/health", timeout=10).json()
    assert h["status"] == "ok"
    with pytest.raises(openai.AuthenticationError):
        plain.client("wrong-key").completions.create(model="pycode-tiny", prompt="x", max_tokens=2)
    r = httpx.post(plain.base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert httpx.get(plain.base + "/v1/models", timeout=10).status_code == 401
    assert plain.client(API_KEY).completions.create(model="pycode-tiny", prompt="x", max_tokens=2).usage


@pytest.mark.parametrize(
    "body,status,field",
    [
        (b"{not json", 400, "JSON"),
        (b"[1, 2]", 400, "JSON object"),
        ({"prompt": "x", "max_tokens": "abc"}, 400, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"prompt": "x", "n": 2}, 400, "'n'"),
        ({"prompt": "x", "logprobs": 2}, 400, "'logprobs'"),
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": [1, 99999999]}, 400, "prompt"),
        ({"prompt": "x", "stop": 5}, 400, "stop"),
        ({"prompt": "x", "stream": "maybe"}, 400, "field 'stream'"),
        ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ({"prompt": "x", "max_tokens": 5000}, 400, "context limit of 1024"),
        ({"messages": [{"content": "hi"}]}, 400, "messages.0.role"),
        ({"messages": "hi"}, 400, "messages"),
    ],
)
def test_bad_requests_are_one_line_400s(servers, body, status, field):
    srv = servers["spec"]
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(srv.base + path, headers={"content-type": "application/json"}, timeout=10, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert field in err["message"] and "\n" not in err["message"] and "Traceback" not in r.text


def test_32_concurrent_clients_get_200_or_429(servers, tokenizer):
    """--max-queue 4: a burst of 32 gets answers or 429s, each 200 is its own request, nothing lost."""
    srv = servers["spec"]
    before = {s: srv.metric("draftsmith_requests_total", endpoint="/v1/completions", status=s) for s in ("200", "429")}
    vocab_word = tokenizer("value")["input_ids"][0]

    def call(i: int):
        # prompt i has i+1 tokens: prompt_tokens identifies whose answer came back
        body = {"prompt": [vocab_word] * (i + 1), "max_tokens": 6, "temperature": 0}
        try:
            r = httpx.post(srv.base + "/v1/completions", json=body, timeout=60)
        except httpx.HTTPError as e:
            return i, None, str(e)
        return i, r.status_code, r.json()

    with cf.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(call, range(32)))
    statuses = [s for _, s, _ in results]
    assert all(s in (200, 429) for s in statuses), results
    ok = [(i, b) for i, s, b in results if s == 200]
    assert ok and len(ok) < 32  # the queue is bounded: some were turned away
    assert all(b["usage"]["prompt_tokens"] == i + 1 for i, b in ok)
    assert len({b["id"] for _, b in ok}) == len(ok)
    assert all("busy" in b["error"]["message"] for _, s, b in results if s == 429)
    after = {s: srv.metric("draftsmith_requests_total", endpoint="/v1/completions", status=s) for s in ("200", "429")}
    assert after["200"] - before["200"] == len(ok) and after["429"] - before["429"] == 32 - len(ok)
    h = httpx.get(srv.base + "/health", timeout=10).json()
    assert h["status"] == "ok" and h["waiting"] == 0


def test_client_disconnect_frees_the_engine(servers):
    srv = servers["spec"]
    out_before = srv.metric("draftsmith_completion_tokens_total")
    with httpx.Client(timeout=30) as c:
        with c.stream(
            "POST",
            srv.base + "/v1/completions",
            json={"prompt": PROMPTS[0], "max_tokens": 1000, "temperature": 0, "stream": True},
        ) as r:
            lines = r.iter_lines()
            got = [ln for _, ln in zip(range(3), (ln for ln in lines if ln.startswith("data:")))]
            assert len(got) == 3
    # the stream is closed; within a round the engine stops (1000 tokens would take many seconds here)
    t0 = time.time()
    r = httpx.post(
        srv.base + "/v1/completions", json={"prompt": "x = 1\n", "max_tokens": 4, "temperature": 0}, timeout=60
    )
    assert r.status_code == 200
    assert time.time() - t0 < 10
    assert srv.metric("draftsmith_completion_tokens_total") - out_before < 500


def test_bench_endpoint_against_the_live_server(servers, tmp_path):
    from typer.testing import CliRunner

    from draftsmith.cli import app

    srv = servers["spec"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS) + "\n")
    out = tmp_path / "bench"
    env = {"DRAFTSMITH_NO_PROGRESS": "1"}
    for label, extra in (("draftsmith-chain", []), ("draftsmith-chat", ["--chat", "--concurrency", "2"])):
        r = CliRunner().invoke(
            app,
            [
                "bench-endpoint",
                "--url",
                srv.base,
                "--prompts",
                str(prompts),
                "--max-tokens",
                "8",
                "--requests",
                "3",
                "--label",
                label,
                "--out",
                str(out),
                *extra,
            ],
            env=env,
        )
        assert r.exit_code == 0, r.output
    rows = [json.loads(ln) for ln in (out / "results.jsonl").read_text().splitlines()]
    assert [r["label"] for r in rows] == ["draftsmith-chain", "draftsmith-chat"]
    for row in rows:
        assert row["requests"] == 3 and row["errors"] == 0 and row["tokens_per_s"] > 0
        assert row["ttft_ms_p50"] > 0 and row["itl_ms_p99"] >= row["itl_ms_p50"] > 0
        assert row["completion_tokens"] == 3 * 8
    assert "draftsmith-chain" in r.stdout and "draftsmith-chat" in r.stdout and "tokens_per_s" in r.stdout
    assert (out / "results.png").stat().st_size > 1000


def test_capture_while_serving_equals_offline_capture(servers, tokenizer, tmp_path):
    """The store recorded while serving (states from the served chain rounds) verifies, holds prompt + response but
    the last token of a served request (the extra-forward fallback would hold all of them), and its states equal
    (bf16 rounding) an offline `run_capture` of the same token sequences."""
    from draftsmith.capture.config import CaptureConfig
    from draftsmith.capture.job import run_capture
    from draftsmith.data.loader import Sample
    from draftsmith.store import HiddenStateStore
    from draftsmith.store.verify import verify_store
    from draftsmith.target_model import load_target

    srv, store = servers["spec"], servers["store"]
    prompt = "class Stack:\n    def push(self, x):\n"
    r = srv.client().completions.create(model="pycode-tiny", prompt=prompt, max_tokens=12, temperature=0)
    p_ids = tokenizer(prompt)["input_ids"]
    deadline = time.time() + 30
    found = None
    while time.time() < deadline and found is None:
        if (store / "manifest.json").is_file():
            s = HiddenStateStore.open(store)
            for i in range(len(s)):
                ids = s[i]["input_ids"].tolist()
                if ids[: len(p_ids)] == p_ids and len(ids) == len(p_ids) + r.usage.completion_tokens - 1:
                    found = (s, i)
        time.sleep(0.2)
    assert found is not None, "the served request never reached the store"
    s, idx = found
    assert verify_store(store, progress=False) == []
    sample = s[idx]
    assert r.choices[0].text.startswith(tokenizer.decode(sample["input_ids"][len(p_ids) :].tolist()))
    assert sample["loss_mask"].tolist() == [False] * len(p_ids) + [True] * (r.usage.completion_tokens - 1)

    take = sorted({idx, *range(max(0, len(s) - 6), len(s))})
    samples = [
        Sample(
            input_ids=s[i]["input_ids"].numpy().astype("int32"),
            loss_mask=s[i]["loss_mask"].numpy(),
            source=f"served:{i}",
        )
        for i in take
    ]
    t = load_target(str(TINY), dtype="fp32")  # the server's dtype on CPU
    cfg = CaptureConfig(
        target=str(TINY),
        data="served",
        out=str(tmp_path / "offline"),
        aux_layers=s.aux_layers,
        max_length=None,
        device="cpu",
        progress=False,
    )
    run_capture(cfg, log=lambda *a, **k: None, target=t, samples=samples)
    off = HiddenStateStore.open(tmp_path / "offline")
    for j, i in enumerate(take):
        a, b = s[i], off[j]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for key in ("aux_hidden_states", "final_hidden_states"):
            torch.testing.assert_close(a[key].float(), b[key].float(), rtol=2**-7, atol=1e-4)


def test_sigterm_writes_the_pending_capture(servers):
    """The last test of the module: SIGTERM stops the plain server gracefully and its pending recordings are
    written (its flush interval was never reached), one sample per completed request."""
    from draftsmith.store import HiddenStateStore
    from draftsmith.store.verify import verify_store

    plain = servers["plain"]
    client = plain.client(API_KEY)
    for p in PROMPTS * 2:  # recordings of its own, whichever other tests ran on this server before
        client.completions.create(model="pycode-tiny", prompt=p, max_tokens=4, temperature=0)
    served = int(plain.metric("draftsmith_requests_total", endpoint="/v1/completions", status="200"))
    assert served >= 4
    plain.stop()
    assert plain.proc.returncode == 0
    store = servers["dir"] / "plain_store"
    assert verify_store(store, progress=False) == []
    assert len(HiddenStateStore.open(store)) == served
    assert "requests recorded" in plain.log_path.read_text()
    assert "(states from the served forwards;" in plain.log_path.read_text()  # plain steps record too
