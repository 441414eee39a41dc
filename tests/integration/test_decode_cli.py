"""`draftsmith generate` / `draftsmith eval` end to end on CPU (pycode-tiny + a saved random drafter)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from draftsmith.decode.cli import register

ROOT = str(Path(__file__).resolve().parents[2])
PYCODE_TINY = next((p for p in (os.path.join(ROOT, "assets", "pycode-tiny"), "/work/shared/targets/pycode-tiny")
                    if os.path.isdir(p)), None)
pytestmark = pytest.mark.skipif(PYCODE_TINY is None, reason="pycode-tiny not available")


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def app():
    a = typer.Typer()
    register(a)

    @a.callback()
    def _root():
        pass

    return a


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    from draftsmith.drafter import Drafter
    from draftsmith.target_model import load_target

    t = load_target(PYCODE_TINY, dtype="fp32")
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("drafter")
    Drafter.from_target(t, draft_vocab_size=2048).save_pretrained(path)
    return str(path), t


def _json_line(out: str) -> dict:
    return json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])


@pytest.mark.parametrize("extra", [[], ["--draft-tokens", "2"], ["--tree", "--top-k-draft", "3", "--depth", "3",
                                                                  "--tree-tokens", "8"]],
                         ids=["plain", "chain", "tree"])
def test_generate_json_matches_plain_greedy(app, drafter_dir, extra):
    path, t = drafter_dir
    prompt = "def fib(n):\n"
    args = ["generate", "--target", PYCODE_TINY, "--prompt", prompt, "--max-new-tokens", "20", "--json",
            "--device", "cpu"]
    if extra:
        args += ["--drafter", path] + extra
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    obj = _json_line(r.stdout)
    ids = t.tokenizer(prompt)["input_ids"]
    x = torch.tensor([ids])
    ref = t.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=20, do_sample=False,
                           pad_token_id=0)[0, len(ids):].tolist()
    assert obj["token_ids"] == ref
    assert obj["text"] == t.tokenizer.decode(ref)
    assert obj["tau"] >= 1.0 and "timing" in obj and obj["timing"]["total_s"] > 0


def test_generate_sampling_seed_reproducible(app, drafter_dir):
    path, _ = drafter_dir
    args = ["generate", "--target", PYCODE_TINY, "--drafter", path, "--prompt", "import os\n", "--max-new-tokens",
            "12", "--temperature", "0.8", "--top-p", "0.9", "--seed", "3", "--json", "--device", "cpu"]
    a = _json_line(CliRunner().invoke(app, args).stdout)
    b = _json_line(CliRunner().invoke(app, args).stdout)
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 12


def test_generate_stop_string(app, drafter_dir):
    path, t = drafter_dir
    args = ["generate", "--target", PYCODE_TINY, "--drafter", path, "--prompt", "def fib(n):\n", "--max-new-tokens",
            "40", "--stop", "\n", "--json", "--device", "cpu"]
    obj = _json_line(CliRunner().invoke(app, args).stdout)
    assert obj["finish_reason"] == "stop" and "\n" in obj["text"]
    # the stop string is completed by the last token, not before
    assert "\n" not in t.tokenizer.decode(obj["token_ids"][:-1])


def test_eval_writes_report(app, drafter_dir, tmp_path):
    path, _ = drafter_dir
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\\n\nclass Stack:\\n    def push(self, x):\n")
    out = tmp_path / "ev"
    r = CliRunner().invoke(app, ["eval", "--target", PYCODE_TINY, "--drafter", path, "--prompts", str(prompts),
                                 "--max-new-tokens", "12", "--draft-tokens", "2", "--temperatures", "0,0.7",
                                 "--out", str(out), "--device", "cpu", "--attn-impl", "bmm"])
    assert r.exit_code == 0, r.output
    rep = json.loads((out / "eval.json").read_text())
    assert rep["attn_impl"] == "bmm" and rep["compiled"] is False  # the report says how it was measured
    t0 = rep["temperatures"]["0"]
    assert t0["greedy_mismatches"] == 0
    s = t0["speculative"]
    assert s["prompts"] == 2 and s["tau"] >= 1 and 0 <= s["acceptance_rate"] <= 1
    assert len(s["p_at_least"]) == 2 and t0["speedup"] > 0
    assert "0.7" in rep["temperatures"]


def test_eval_humaneval_jsonl(app, drafter_dir, tmp_path):
    src = "/work/shared/data/eval/humaneval.jsonl"
    if not os.path.exists(src):
        pytest.skip("eval data not available")
    path, _ = drafter_dir
    out = tmp_path / "ev"
    r = CliRunner().invoke(app, ["eval", "--target", PYCODE_TINY, "--drafter", path, "--prompts", src, "--raw",
                                 "--limit", "2", "--max-new-tokens", "8", "--tree", "--top-k-draft", "2", "--depth",
                                 "2", "--tree-tokens", "4", "--temperatures", "0", "--out", str(out),
                                 "--device", "cpu"])
    assert r.exit_code == 0, r.output
    rep = json.loads((out / "eval.json").read_text())
    assert rep["mode"]["kind"] == "tree" and rep["temperatures"]["0"]["greedy_mismatches"] == 0


def test_run_eval_warms_each_prompt_length_once_before_timing():
    """The first prefill of a prompt length pays one-time costs; run_eval pays them untimed, once per engine."""
    from types import SimpleNamespace

    from draftsmith.decode import DecodeMode
    from draftsmith.decode.evaluate import run_eval

    class FakeEngine:
        backend, cuda_graphs, device, dtype = "llama", False, "cpu", "float32"

        def __init__(self):
            self.calls = []

        def warmup(self, mode, sp):
            pass

        def generate(self, p, n, sampling=None, mode=None, seed=0):
            self.calls.append((len(p), n, mode.kind))
            return SimpleNamespace(token_ids=[1] * n, accepted=[0] * n, prefill_s=0.01, decode_s=0.01)

    eng = FakeEngine()
    prompts = [[1] * 5, [1] * 7, [2] * 5]
    run_eval(eng, prompts, DecodeMode("chain", draft_tokens=2), (0.0,), max_new_tokens=16)
    warm = [c for c in eng.calls if c[1] == 1]
    assert sorted(c[0] for c in warm) == [5, 7]  # one untimed prefill per distinct length
    first_timed = next(i for i, c in enumerate(eng.calls) if c[1] == 16)
    assert all(eng.calls.index(c) < first_timed for c in warm)
    eng.calls.clear()
    run_eval(eng, prompts, DecodeMode("chain", draft_tokens=2), (0.0,), max_new_tokens=16)
    assert not [c for c in eng.calls if c[1] == 1]  # already warm
