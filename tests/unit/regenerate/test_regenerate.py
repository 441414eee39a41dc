"""`draftsmith regenerate`: user turns kept exactly, answers from the target, loss mask on exactly those answers,
bad records, resume after kill -9 (a real SIGKILL of a process of its own)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from cli_helpers import cli_here, exit_code, fork_cli

from draftsmith.common.errors import DraftsmithError
from draftsmith.regenerate import RegenerateConfig, run_regenerate
from draftsmith.regenerate.job import progress_path

REPO = Path(__file__).resolve().parents[3]
# A template whose turn boundaries are special tokens of the demo tokenizer (<|pad|> opens an answer,
# <|endoftext|> closes it), so the masked tokens decode to exactly answer + <|endoftext|>.
TEMPLATE = (
    "{%- for m in messages %}### {{ m['role'] }}<|pad|>{{ m['content'] }}"
    "{%- if m['role'] == 'assistant' %}<|endoftext|>{% endif %}\n{% endfor %}"
    "{%- if add_generation_prompt %}### assistant<|pad|>{% endif %}"
)


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory, tiny_path) -> Path:
    """pycode-tiny with a chat template (same weights and vocabulary)."""
    d = tmp_path_factory.mktemp("chat-target") / "pycode-tiny-chat"
    shutil.copytree(tiny_path, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def _records(n: int) -> list[dict]:
    recs = []
    for i in range(n):
        if i % 2:
            recs.append(
                {
                    "id": i,
                    "conversations": [
                        {"from": "human", "value": f"def add_{i}(a, b):\n  "},
                        {"from": "gpt", "value": "dataset answer"},
                        {"from": "human", "value": "  and now  \u00e9 \\n unicode ☃\t"},
                        {"from": "gpt", "value": "second dataset answer"},
                    ],
                }
            )
        else:
            recs.append(
                {
                    "messages": [
                        {"role": "system", "content": "You write Python."},
                        {"role": "user", "content": f"class Stack{i}:\n    def push(self, x):"},
                        {"role": "assistant", "content": "old"},
                    ],
                    "meta": {"k": i},
                }
            )
    return recs


def _write(path: Path, recs, extra_lines=()) -> Path:
    with open(path, "w") as f:
        for r in recs:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return path


def _cfg(target, data, out, **kw) -> RegenerateConfig:
    base = dict(target=str(target), data=str(data), out=str(out), max_new_tokens=12, batch_size=4, device="cpu")
    base.update(kw)
    return RegenerateConfig(**base)


@pytest.fixture(scope="module")
def regenerated(chat_target, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("regen")
    recs = _records(6)
    data = _write(tmp / "in.jsonl", recs)
    rep = run_regenerate(_cfg(chat_target, data, tmp / "out.jsonl"), log=lambda s: None)
    outs = [json.loads(x) for x in (tmp / "out.jsonl").read_text().splitlines()]
    return recs, outs, rep, tmp / "out.jsonl"


def test_keeps_non_assistant_turns_and_adds_provenance(regenerated, chat_target):
    recs, outs, rep, _ = regenerated
    assert rep["records"] == len(recs) == len(outs)
    assert rep["new_tokens"] > 0
    for r, o in zip(recs, outs):
        key = "conversations" if "conversations" in r else "messages"
        assert set(o) == set(r) | {"provenance"}
        for k in r:
            if k != key:
                assert o[k] == r[k]
        for m_in, m_out in zip(r[key], o[key], strict=True):
            assert set(m_in) == set(m_out)
            role = m_in.get("from", m_in.get("role"))
            if role in ("gpt", "assistant"):
                continue
            assert m_out == m_in  # system/user turns: the same strings, character for character
        prov = o["provenance"]
        assert prov["target"] == str(chat_target) and prov["temperature"] == 0.0 and prov["max_new_tokens"] == 12
        assert prov["source"].endswith(f"in.jsonl:{recs.index(r) + 1}") and "draftsmith_version" in prov
    answers = [
        m.get("value", m.get("content"))
        for o in outs
        for m in o.get("conversations", o.get("messages"))
        if m.get("from", m.get("role")) in ("gpt", "assistant")
    ]
    assert not {"old", "dataset answer", "second dataset answer"} & set(answers)


def test_answers_are_the_targets_greedy_continuation(regenerated, chat_target):
    """The first answer of a record is what the target greedily writes after the rendered prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recs, outs, _, _ = regenerated
    tok = AutoTokenizer.from_pretrained(chat_target)
    model = AutoModelForCausalLM.from_pretrained(chat_target, dtype="float32").eval()
    o = outs[0]
    prompt = tok.apply_chat_template(recs[0]["messages"][:2], tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    # an explicit mask: the prompt holds <|pad|> tokens, which generate() would otherwise mask out
    ref = model.generate(
        ids, attention_mask=ids * 0 + 1, max_new_tokens=12, do_sample=False, eos_token_id=0, pad_token_id=1
    )[0, ids.shape[1] :].tolist()
    ref = ref[: ref.index(0)] if 0 in ref else ref
    assert o["messages"][2]["content"] == tok.decode(ref, skip_special_tokens=True)


def test_loss_mask_covers_exactly_the_regenerated_answers(regenerated, chat_target):
    from transformers import AutoTokenizer

    from draftsmith.data import load_samples

    _, outs, _, out = regenerated
    tok = AutoTokenizer.from_pretrained(chat_target)
    samples, report = load_samples(out, tok)
    assert len(samples) == len(outs)
    for s, o in zip(samples, outs):
        msgs = o.get("conversations", o.get("messages"))
        answers = [
            m.get("value", m.get("content")) for m in msgs if m.get("from", m.get("role")) in ("gpt", "assistant")
        ]
        ids = [int(t) for t in s.input_ids]
        mask = [bool(m) for m in s.loss_mask]
        masked = tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
        assert masked == "".join(a + "<|endoftext|>" for a in answers)


def test_bad_records_error_or_skip(chat_target, tmp_path):
    data = _write(
        tmp_path / "in.jsonl", _records(2), ['{"conversations": [{"from": "human", "value": "x"}]}', "{not json"]
    )
    with pytest.raises(DraftsmithError, match=r"in\.jsonl:3: no assistant turn"):
        run_regenerate(_cfg(chat_target, data, tmp_path / "a.jsonl"), log=lambda s: None)
    rep = run_regenerate(_cfg(chat_target, data, tmp_path / "b.jsonl", on_bad="skip"), log=lambda s: None)
    assert rep["records"] == 2 and rep["skipped"] == {"no assistant turn": 1, "malformed JSON": 1}


def test_rerun_with_other_settings_is_refused(regenerated, chat_target):
    _, _, _, out = regenerated
    data = out.parent / "in.jsonl"
    with pytest.raises(DraftsmithError, match="max_new_tokens=12"):
        run_regenerate(_cfg(chat_target, data, out, max_new_tokens=13), log=lambda s: None)
    # the same settings: nothing left to do, nothing appended
    before = out.read_bytes()
    rep = run_regenerate(_cfg(chat_target, data, out, batch_size=2), log=lambda s: None)
    assert rep["records"] == 0 and out.read_bytes() == before


def _consumed(prog: Path) -> int:
    """The input records a run's progress file counts (0 while it is being replaced)."""
    try:
        return json.loads(prog.read_text())["consumed"]
    except (ValueError, KeyError):
        return 0


@pytest.mark.slow
def test_resume_after_kill_9(chat_target, tmp_path, one_thread):
    """A run SIGKILLed mid-run (a child forked from this process: a process of its own, killed by the test), then
    the same command again (in this process: typer's runner): every input record exactly once, in order, each line
    a complete record."""
    n = 12
    data = _write(tmp_path / "in.jsonl", _records(n))
    out = tmp_path / "out.jsonl"
    args = [
        "regenerate",
        "--target",
        str(chat_target),
        "--data",
        str(data),
        "--out",
        str(out),
        "--batch-size",
        "1",
        "--max-new-tokens",
        "6",
        "--device",
        "cpu",
        "-q",
    ]
    log = tmp_path / "killed.log"
    pid = fork_cli(args, log, env={"TOKENIZERS_PARALLELISM": "false"})
    prog = progress_path(out)
    deadline = time.time() + 120
    code = None  # the child's return code once it ended (and was reaped)
    try:
        while time.time() < deadline:
            code = exit_code(pid, block=False)
            if code is not None or (prog.is_file() and _consumed(prog) >= 2):
                break
            time.sleep(0.01)
        assert code is None, f"the run ended ({code}) before 2 records: {log.read_text()[-2000:]}"
    finally:
        if code is None:
            os.kill(pid, signal.SIGKILL)
            code = exit_code(pid)
    assert code == -9, log.read_text()[-2000:]
    assert 2 <= json.loads(prog.read_text())["consumed"] < n
    with open(out, "ab") as f:  # what a kill between a record's write and the progress update leaves behind
        f.write(b'{"messages": [{"role": "user", "content": "partial')
    r = cli_here(args)
    assert r.exit_code == 0, (r.output[-2000:], r.exception)
    lines = out.read_text().splitlines()
    recs = [json.loads(x) for x in lines]  # the partial line was cut away: every line parses
    assert [r["provenance"]["source"] for r in recs] == [f"{data}:{i}" for i in range(1, n + 1)]
    assert all(r.get("id", r.get("meta", {}).get("k")) == i for i, r in enumerate(recs))


def test_assistant_turns_with_tool_calls_are_kept(chat_target, tmp_path):
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}],
    }
    rec = {
        "messages": [
            {"role": "user", "content": "find x"},
            call,
            {"role": "tool", "content": "x = 1"},
            {"role": "assistant", "content": "dataset answer"},
        ]
    }
    data = _write(tmp_path / "in.jsonl", [rec])
    run_regenerate(_cfg(chat_target, data, tmp_path / "out.jsonl"), log=lambda s: None)
    (out,) = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert out["messages"][:3] == rec["messages"][:3]
    assert out["messages"][3]["content"] != "dataset answer"


def test_continue_text_prefixes_and_greedy_continuations(tiny_path, tmp_path):
    """--continue-text: each record = a slice of a source sample (the provenance says where) + the target's greedy
    continuation of exactly that slice; a rerun after the output is cut short draws the same prefixes."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.data import load_samples

    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"m{i}.py").write_text(
            "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(40)), encoding="utf-8"
        )
    out = tmp_path / "out.jsonl"
    cfg = _cfg(tiny_path, src, out, continue_text=True, prefix_tokens="8:40", max_length=128, max_new_tokens=10)
    rep = run_regenerate(cfg, log=lambda s: None)
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(tiny_path)
    samples, _ = load_samples(src, tok, max_length=128, mode="text")
    assert len(recs) == len(samples) == rep["records"] and rep["new_tokens"] == 10 * len(recs)
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    for r, s in zip(recs[:4], samples):
        pv = r["provenance"]
        assert pv["source"] == s.source and 8 <= pv["prefix_tokens"] <= 40
        head = [] if s.loss_mask[0] else [int(s.input_ids[0])]  # a BOS the loader prepended (never a loss target)
        body = [int(t) for t in s.input_ids[len(head) :]]
        prefix = body[pv["prefix_offset"] : pv["prefix_offset"] + pv["prefix_tokens"]]
        with torch.no_grad():
            ref = model.generate(torch.tensor([head + prefix]), max_new_tokens=10, do_sample=False)
        new = ref[0, len(head) + len(prefix) :].tolist()
        assert r["text"] == tok.decode(prefix + new, skip_special_tokens=True)
    # resume: cut the output back to two records (as a kill leaves it) and rerun: the same records again
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:2]))
    prog = json.loads(progress_path(out).read_text())
    prog.update(consumed=2, bytes=len("".join(lines[:2]).encode()))
    progress_path(out).write_text(json.dumps(prog))
    run_regenerate(cfg, log=lambda s: None)
    assert out.read_text().splitlines(keepends=True) == lines
    with pytest.raises(DraftsmithError, match="prefix-tokens"):
        run_regenerate(_cfg(tiny_path, src, tmp_path / "o2.jsonl", continue_text=True, prefix_tokens="9"))
