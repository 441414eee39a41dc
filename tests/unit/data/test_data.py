"""Tests for draftsmith.data: records -> tokenized samples with loss masks (CPU, pycode-tiny tokenizer)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from draftsmith.common.errors import BadRecordError, DraftsmithError
from draftsmith.data import DataReport, Sample, load_prompts, load_samples

REPO = Path(__file__).resolve().parents[3]
TOK_DIRS = [
    REPO / "assets" / "pycode-tiny",
    Path("/work/shared/targets/pycode-tiny"),
    REPO.parent / "shared" / "targets" / "pycode-tiny",
]
EVAL_DIRS = [REPO / "assets" / "eval", Path("/work/shared/data/eval"), REPO.parent / "shared" / "data" / "eval"]


def _tok_dir():
    for d in TOK_DIRS:
        if (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file():
            return d
    pytest.skip("pycode-tiny tokenizer not found (assets/pycode-tiny or ../shared/targets/pycode-tiny)")


def _load_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(_tok_dir()))


@pytest.fixture(scope="module")
def tok():
    """The demo tokenizer: it names a bos_token (<|endoftext|>, id 0) but its encoding never adds it."""
    return _load_tok()


@pytest.fixture(scope="module")
def tok_bos():
    """The demo tokenizer with a post-processor that adds its BOS (as Llama's does): text samples start with it."""
    from tokenizers.processors import TemplateProcessing

    t = _load_tok()
    t.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A $B", special_tokens=[("<|endoftext|>", 0)]
    )
    assert t("a")["input_ids"][0] == 0
    return t


LLAMA3 = (  # Llama-3.1 style (system header with dates, trimmed content)
    "{%- set loop_messages = messages %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- bos_token }}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in loop_messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
QWEN3 = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
MISTRAL = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.first and system_message is defined %}{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}"
    "{%- else %}{{- raise_exception('Only user and assistant roles are supported!') }}{%- endif %}"
    "{%- endfor %}"
)
# A template without special tokens: turn ends are plain newlines.
PLAIN = (
    "{%- for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
    "{%- if add_generation_prompt %}Assistant:{% endif %}"
)


def _with_template(template, tokens, bos=None, eos=None):
    t = _load_tok()
    if tokens:
        t.add_tokens(tokens, special_tokens=True)
    if bos:
        t.add_special_tokens({"bos_token": bos, "eos_token": eos})
    t.chat_template = template
    return t


@pytest.fixture(scope="module")
def llama3():
    return _with_template(LLAMA3, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])


@pytest.fixture(scope="module")
def qwen3():
    return _with_template(QWEN3, ["<|im_start|>", "<|im_end|>", "<think>", "</think>"])


@pytest.fixture(scope="module")
def mistral():
    return _with_template(MISTRAL, ["[INST]", "[/INST]"], "<s>", "</s>")


@pytest.fixture(scope="module")
def plain():
    return _with_template(PLAIN, [])


def write_jsonl(path: Path, records) -> Path:
    lines = [r if isinstance(r, (str, bytes)) else json.dumps(r) for r in records]
    data = b"\n".join(x if isinstance(x, bytes) else x.encode("utf-8") for x in lines) + b"\n"
    path.write_bytes(data)
    return path


def masked_runs(tokenizer, s: Sample) -> list[str]:
    runs, k, m = [], 0, s.loss_mask
    while k < len(m):
        if m[k]:
            j = k
            while j < len(m) and m[j]:
                j += 1
            runs.append(tokenizer.decode(s.input_ids[k:j].tolist()))
            k = j
        else:
            k += 1
    return runs


def check_sample(s: Sample):
    assert isinstance(s.input_ids, np.ndarray) and s.input_ids.dtype == np.int32 and s.input_ids.ndim == 1
    assert isinstance(s.loss_mask, np.ndarray) and s.loss_mask.dtype == np.bool_
    assert s.loss_mask.shape == s.input_ids.shape


# --------------------------------------------------------------------------------------------- text
def test_text_records_full_mask_and_bos(tok_bos, tmp_path):
    tok = tok_bos
    f = write_jsonl(tmp_path / "t.jsonl", [{"text": "def f():\n    return 1\n"}, "", {"text": "x = 2"}])
    samples, rep = load_samples(f, tok)
    assert [s.source for s in samples] == [f"{f}:1", f"{f}:3"]  # blank line 2 is not a record
    for s in samples:
        check_sample(s)
        assert s.input_ids[0] == tok.bos_token_id == 0  # BOS prepended ...
        assert not s.loss_mask[0] and s.loss_mask[1:].all()  # ... and never a target
    assert tok.decode(samples[0].input_ids[1:].tolist()) == "def f():\n    return 1\n"
    assert (rep.total, rep.kept, rep.samples, rep.skipped, rep.truncated) == (2, 2, 2, {}, 0)
    assert rep.tokens == sum(len(s) for s in samples)
    assert rep.masked_tokens == sum(int(s.loss_mask.sum()) for s in samples) == rep.tokens - 2
    assert "2 records read, 2 kept" in rep.summary() and "\n" not in rep.summary()
    assert isinstance(rep, DataReport) and rep.to_dict()["kept"] == 2


def test_bos_rule(tok_bos, tmp_path):
    tok = tok_bos
    f = write_jsonl(tmp_path / "t.jsonl", [{"text": "<|endoftext|>import os"}])
    # the special-token string inside text stays text: BOS is still prepended, and no id-0 in the body
    (s,), _ = load_samples(f, tok)
    assert s.input_ids[0] == 0 and 0 not in s.input_ids[1:].tolist()
    (s,), _ = load_samples(f, tok, add_bos=False)
    assert 0 not in s.input_ids.tolist() and s.loss_mask.all()
    from copy import deepcopy

    nobos = deepcopy(tok)
    nobos.bos_token = None
    assert nobos.bos_token_id is None
    (s,), _ = load_samples(f, nobos)  # no BOS token: nothing prepended
    assert s.loss_mask.all() and 0 not in s.input_ids.tolist()
    with pytest.raises(DraftsmithError, match="no BOS"):
        load_samples(f, nobos, add_bos=True)


def test_max_length_truncation(tok_bos, tmp_path):
    tok = tok_bos
    long = "def f(x):\n" + "".join(f"    y{i} = x + {i}\n" for i in range(200))
    f = write_jsonl(tmp_path / "t.jsonl", [{"text": long}, {"text": "x = 1"}])
    (full, short), _ = load_samples(f, tok)
    samples, rep = load_samples(f, tok, max_length=64)
    assert len(samples) == 2 and len(samples[0]) == 64 and rep.truncated == 1 and rep.split == 0
    assert np.array_equal(samples[0].input_ids, full.input_ids[:64])
    assert np.array_equal(samples[1].input_ids, short.input_ids)
    assert "1 truncated" in rep.summary()
    # split_long=True on JSONL: consecutive windows instead
    samples, rep = load_samples(f, tok, max_length=64, split_long=True)
    assert rep.split == 1 and rep.truncated == 0 and rep.kept == 2 and rep.samples == len(samples) > 2
    wins = [s for s in samples if s.source.endswith(":1")]
    assert all(len(w) <= 64 and w.input_ids[0] == 0 and not w.loss_mask[0] for w in wins)
    body = np.concatenate([w.input_ids[1:] for w in wins])
    assert np.array_equal(body, full.input_ids[1:])


# ---------------------------------------------------------------------------------------- directory
def _make_tree(root: Path):
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "b.py").write_text("import os\nprint(os.getcwd())\n")
    (root / "pkg" / "__init__.py").write_text("")  # empty: skipped, counted, never an error
    (root / "pkg" / "a.py").write_text("def g():\n" + "".join(f"    z{i} = {i} * {i}\n" for i in range(120)))
    (root / "pkg" / "sub" / "c.py").write_text("class C:\n    pass\n")
    (root / "notes.txt").write_text("not python")
    return root


def test_directory_mode_sorted_split_deterministic(tok_bos, tmp_path):
    tok = tok_bos
    root = _make_tree(tmp_path / "src")
    samples, rep = load_samples(root, tok, max_length=50)
    assert rep.total == 4 and rep.kept == 3 and rep.skipped == {"empty file": 1} and rep.files == 4
    srcs = [s.source for s in samples]
    assert srcs[0] == str(root / "b.py") and srcs[-1] == str(root / "pkg/sub/c.py")
    assert srcs == sorted(srcs, key=lambda x: os.path.relpath(x, root))
    wins = [s for s in samples if s.source.endswith("a.py")]
    assert len(wins) > 2 and rep.split == 1 and rep.truncated == 0
    assert all(len(w) <= 50 and w.input_ids[0] == 0 and not w.loss_mask[0] and w.loss_mask[1:].all() for w in wins)
    text = (root / "pkg" / "a.py").read_text()
    assert tok.decode(np.concatenate([w.input_ids[1:] for w in wins]).tolist()) == text
    again, rep2 = load_samples(root, tok, max_length=50)
    assert [s.source for s in again] == srcs and rep2.to_dict() == rep.to_dict()
    assert all(
        np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.loss_mask, b.loss_mask)
        for a, b in zip(samples, again)
    )
    # split_long=False: truncation instead; glob selects other files
    samples, rep = load_samples(root, tok, max_length=50, split_long=False)
    assert rep.truncated == 1 and rep.split == 0 and len(samples) == 3
    samples, rep = load_samples(root, tok, glob="*.txt")
    assert [s.source for s in samples] == [str(root / "notes.txt")]


def test_max_samples_keeps_the_first_n_and_stops_reading(tok_bos, tmp_path):
    root = _make_tree(tmp_path / "src")
    full, _ = load_samples(root, tok_bos, max_length=50)
    for n in (1, 3, len(full)):
        head, rep = load_samples(root, tok_bos, max_length=50, max_samples=n)
        assert [s.source for s in head] == [s.source for s in full[:n]] and rep.samples == n
        assert rep.tokens == sum(len(s.input_ids) for s in head)
        assert all(np.array_equal(a.input_ids, b.input_ids) for a, b in zip(head, full))
    with pytest.raises(DraftsmithError, match="max_samples"):
        load_samples(root, tok_bos, max_samples=0)


def test_directory_invalid_utf8_file(tok, tmp_path):
    root = _make_tree(tmp_path / "src")
    (root / "pkg" / "bad.py").write_bytes(b"x = 1\ny = '\xff\xfe'\n")
    with pytest.raises(BadRecordError, match=r"pkg/bad\.py: invalid UTF-8: byte 0xff on line 2"):
        load_samples(root, tok)
    samples, rep = load_samples(root, tok, on_bad="skip")
    assert rep.skipped == {"invalid UTF-8": 1, "empty file": 1} and rep.kept == 3


def test_directory_of_jsonl(tok, tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    write_jsonl(d / "b.jsonl", [{"text": "b1"}])
    write_jsonl(d / "a.jsonl", [{"text": "a1"}, {"text": "a2"}])
    samples, rep = load_samples(d, tok, max_length=2)
    assert [s.source for s in samples] == [f"{d / 'a.jsonl'}:1", f"{d / 'a.jsonl'}:2", f"{d / 'b.jsonl'}:1"]
    assert rep.files == 2 and rep.kept == 3 and rep.split == 0  # JSONL: no splitting by default
    with pytest.raises(DraftsmithError, match="no files match"):
        load_samples(tmp_path / "data", tok, glob="*.py")


def test_batched_tokenization(tok, tmp_path, monkeypatch):
    root = tmp_path / "many"
    root.mkdir()
    for i in range(300):
        (root / f"m{i:03d}.py").write_text(f"def f{i}(x):\n    return x * {i}\n")
    calls = []
    orig = type(tok).__call__

    def counting(self, *a, **k):
        if a and isinstance(a[0], list):  # batch calls (not the one-text probe of the tokenizer's BOS rule)
            calls.append(1)
        return orig(self, *a, **k)

    monkeypatch.setattr(type(tok), "__call__", counting)
    samples, rep = load_samples(root, tok)
    assert len(samples) == 300 and len(calls) == 1  # one batch call, not one per file
    assert samples[7].source.endswith("m007.py")


# ------------------------------------------------------------------------------------- bad records
BAD = [
    ('{"text": "ok"', "malformed JSON", "malformed JSON: Expecting"),
    ("[1, 2]", "not an object", "record is a JSON list"),
    ('{"foo": 1}', "unknown format", "no 'conversations', 'messages', 'text' or 'turns'"),
    (
        {
            "conversations": [
                {"from": "human", "value": "a"},
                {"from": "gpt", "value": "b"},
                {"from": "robot", "value": "c"},
            ]
        },
        "unknown role",
        "conversations[2].from='robot'",
    ),
    (
        {"messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]},
        "unknown role",
        "messages[1].role='wizard'",
    ),
    ({"conversations": []}, "empty conversation", "conversations is empty"),
    (b'{"text": "caf\xe9"}', "invalid UTF-8", "invalid UTF-8: byte 0xe9 at column 14"),
    ({"conversations": [{"from": "human", "value": "a"}]}, "no assistant turn", "conversations has no assistant"),
    (
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]},
        "bad content",
        "messages[1].content is missing",
    ),
    (
        {"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "b"}]},
        "bad content",
        "conversations[0].value is int, not a string",
    ),
    ({"text": 5}, "bad content", "text is int, not a string"),
    ({"text": "  \n"}, "empty text", "text is empty"),
    ({"messages": ["hi"]}, "bad message", "messages[0] is string, not an object"),
    (
        '{"conversations": [{"from": "human", "value": "a\\ud800"}, {"from": "gpt", "value": "b"}]}',
        "invalid UTF-8",
        "conversations[0].value has a lone surrogate",
    ),
]


@pytest.mark.parametrize("line,kind,detail", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_record_errors(tok, llama3, tmp_path, line, kind, detail):
    f = write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}, line])
    with pytest.raises(BadRecordError) as ei:
        load_samples(f, llama3)
    e = ei.value
    assert e.where == f"{f}:2"
    msg = str(e)
    assert msg.startswith(f"{f}:2: {kind}") and detail in msg and "\n" not in msg
    samples, rep = load_samples(f, llama3, on_bad="skip")
    assert len(samples) == 1 and rep.skipped == {kind: 1} and rep.total == 2 and rep.kept == 1
    assert f"1 skipped ({kind}: 1)" in rep.summary()


def test_skip_counts_by_reason(tmp_path, llama3):
    recs = [line for line, _, _ in BAD] + [{"text": "good"}, {"text": "also good"}]
    f = write_jsonl(tmp_path / "mixed.jsonl", recs)
    samples, rep = load_samples(f, llama3, on_bad="skip")
    expect = {}
    for _, kind, _ in BAD:
        expect[kind] = expect.get(kind, 0) + 1
    assert rep.skipped == expect and rep.kept == 2 and rep.total == len(recs) and len(samples) == 2
    assert rep.total == rep.kept + rep.num_skipped


def test_tokenizer_failure_is_a_bad_record(tok, tmp_path, monkeypatch):
    f = write_jsonl(tmp_path / "t.jsonl", [{"text": "fine"}, {"text": "BOOM here"}, {"text": "also fine"}])
    orig = type(tok).__call__

    def fragile(self, text, *a, **k):
        if any("BOOM" in t for t in text):
            raise TypeError("TextEncodeInput must be Union[...]")
        return orig(self, text, *a, **k)

    monkeypatch.setattr(type(tok), "__call__", fragile)
    with pytest.raises(BadRecordError, match=r"t\.jsonl:2: tokenizer error: TextEncodeInput"):
        load_samples(f, tok)
    samples, rep = load_samples(f, tok, on_bad="skip")
    assert [s.source for s in samples] == [f"{f}:1", f"{f}:3"] and rep.skipped == {"tokenizer error": 1}


def test_bad_arguments(tok, tmp_path):
    f = write_jsonl(tmp_path / "t.jsonl", [{"text": "x"}])
    for kw in ({"on_bad": "ignore"}, {"mode": "pretty"}, {"max_length": 0}, {"mode": "chat"}):
        with pytest.raises(DraftsmithError):
            load_samples(f, tok, **kw)
    with pytest.raises(DraftsmithError, match="no such file"):
        load_samples(tmp_path / "missing.jsonl", tok)


# ------------------------------------------------------------------------------------ chat masks
CONV = {
    "conversations": [
        {"from": "system", "value": "You are a helpful assistant."},
        {"from": "human", "value": "Hi there"},
        {"from": "gpt", "value": "Hello! How can I help?"},
        {"from": "human", "value": "Write a function"},
        {"from": "gpt", "value": "def f(x):\n    return x + 1"},
    ]
}
OPENAI = {
    "messages": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6"},
        {"role": "user", "content": "thanks"},
    ]
}  # trailing user turn: unmasked


def _masks(tokenizer, tmp_path, recs, **kw):
    f = write_jsonl(tmp_path / "c.jsonl", recs)
    samples, rep = load_samples(f, tokenizer, **kw)
    for s in samples:
        check_sample(s)
    return [masked_runs(tokenizer, s) for s in samples], samples, rep


def test_llama3_mask(llama3, tmp_path):
    runs, samples, rep = _masks(llama3, tmp_path, [CONV, OPENAI])
    assert runs == [
        ["Hello! How can I help?<|eot_id|>", "def f(x):\n    return x + 1<|eot_id|>"],
        ["4<|eot_id|>", "6<|eot_id|>"],
    ]
    # the template's own BOS (pycode's <|endoftext|>) is kept and not duplicated
    assert samples[0].input_ids[0] == 0 and samples[0].input_ids[1] != 0
    assert rep.masked_tokens == sum(int(s.loss_mask.sum()) for s in samples)
    # every prefix render is a string prefix of the full render: no fallback (even though byte-level BPE
    # splits the header's '\n\n' differently once content follows it)
    assert rep.mask_fallbacks == 0


def test_qwen3_mask_with_think_stripping(qwen3, tmp_path):
    conv = json.loads(json.dumps(CONV))
    conv["conversations"][2]["value"] = "<think>\nsay hi\n</think>\n\nHello! How can I help?"
    conv["conversations"][4]["value"] = "<think>\nadd one\n</think>\n\ndef f(x):\n    return x + 1"
    runs, samples, rep = _masks(qwen3, tmp_path, [conv, OPENAI])
    text0 = qwen3.decode(samples[0].input_ids.tolist())
    assert "say hi" not in text0 and "add one" in text0  # the template dropped the earlier reasoning
    assert runs[0] == [
        "Hello! How can I help?<|im_end|>",  # '\n' after <|im_end|> is not a target
        "<think>\nadd one\n</think>\n\ndef f(x):\n    return x + 1<|im_end|>",
    ]
    # the last answer gets the template's empty think block (the model generates it); earlier ones don't
    assert runs[1] == ["4<|im_end|>", "6<|im_end|>"]
    assert rep.mask_fallbacks >= 2  # earlier turns re-rendered differently: located by character offsets


def test_mistral_mask(mistral, tmp_path):
    runs, samples, rep = _masks(mistral, tmp_path, [CONV, OPENAI])
    assert runs == [[" Hello! How can I help?</s>", " def f(x):\n    return x + 1</s>"], [" 4</s>", " 6</s>"]]
    assert rep.mask_fallbacks == 0  # every turn is a token-prefix: the fast path
    assert mistral.decode(samples[0].input_ids[:1].tolist()) == "<s>"


def test_plain_template_mask(plain, tmp_path):
    runs, _, rep = _masks(plain, tmp_path, [OPENAI])
    assert runs == [[" 4\n", " 6\n"]]  # no special end-of-turn token: the newline ends the turn
    assert rep.mask_fallbacks == 0


@pytest.mark.parametrize("name", ["llama3", "qwen3", "mistral", "plain"])
def test_masks_without_offset_mapping(name, request, tmp_path, monkeypatch):
    """Tokenizers without offset mappings (slow ones) use token-prefix checks: same masks."""
    import draftsmith.data.loader as L

    t = request.getfixturevalue(name)
    conv = json.loads(json.dumps(CONV))
    conv["conversations"][2]["value"] = "<think>\nsay hi\n</think>\n\nHello! How can I help?"
    ref, ref_samples, _ = _masks(t, tmp_path, [conv, OPENAI])
    orig = L._encode
    monkeypatch.setattr(
        L,
        "_encode",
        lambda tok, texts, offsets=False, as_text=False: (orig(tok, texts, offsets=False, as_text=as_text)[0], None),
    )
    got, samples, _ = _masks(t, tmp_path, [conv, OPENAI])
    assert got == ref
    assert all(np.array_equal(a.loss_mask, b.loss_mask) for a, b in zip(samples, ref_samples))


def test_chat_template_kwargs(qwen3, tmp_path):
    # enable_thinking=False: the empty think block belongs to the generation prompt, not to the answer
    rec = {"messages": OPENAI["messages"][:4]}  # ends with an answer: Qwen3 puts a think block before it
    runs, _, _ = _masks(qwen3, tmp_path, [rec])
    assert runs == [["4<|im_end|>", "<think>\n\n</think>\n\n6<|im_end|>"]]
    runs, _, _ = _masks(qwen3, tmp_path, [rec], chat_template_kwargs={"enable_thinking": False})
    assert runs == [["4<|im_end|>", "6<|im_end|>"]]
    f = write_jsonl(tmp_path / "q.jsonl", TURNS)
    (p,) = load_prompts(f, qwen3, return_text=True, limit=1, chat_template_kwargs={"enable_thinking": False})
    assert p.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_qwen3_tool_turns(qwen3, tmp_path):
    rec = {
        "messages": [
            {"role": "user", "content": "What is 6*7?"},
            {"role": "assistant", "content": "Let me compute."},
            {"role": "tool", "content": "42"},
            {"role": "assistant", "content": "It is 42.", "reasoning_content": "tool said 42"},
        ]
    }
    runs, samples, rep = _masks(qwen3, tmp_path, [rec])
    assert runs == [["Let me compute.<|im_end|>", "<think>\ntool said 42\n</think>\n\nIt is 42.<|im_end|>"]]
    assert "<tool_response>\n42\n</tool_response>" in qwen3.decode(samples[0].input_ids.tolist())


def test_template_error_is_bad_record(mistral, tmp_path):
    rec = {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "user", "content": "b"},
            {"role": "assistant", "content": "c"},
        ]
    }
    f = write_jsonl(tmp_path / "c.jsonl", [rec])
    with pytest.raises(BadRecordError, match=r"c\.jsonl:1: chat template error: .*must alternate"):
        load_samples(f, mistral)
    _, rep = load_samples(f, mistral, on_bad="skip")
    assert rep.skipped == {"chat template error": 1}


def test_chat_truncation_and_add_bos(llama3, tmp_path):
    runs, samples, _ = _masks(llama3, tmp_path, [CONV])
    (s,), rep = load_samples(tmp_path / "c.jsonl", llama3, max_length=20)
    assert len(s) == 20 and rep.truncated == 1
    assert np.array_equal(s.loss_mask, samples[0].loss_mask[:20])


def test_chat_record_without_template(tok, tmp_path):
    f = write_jsonl(tmp_path / "c.jsonl", [OPENAI])
    with pytest.raises(BadRecordError, match=r"c\.jsonl:1: no chat template: .*mode='text'"):
        load_samples(f, tok)
    (s,), rep = load_samples(f, tok, mode="text")
    assert tok.decode(s.input_ids.tolist()) == "What is 2+2?\n\n4\n\nAnd 3+3?\n\n6\n\nthanks"
    assert s.loss_mask.all() and s.input_ids[0] != 0  # the demo tokenizer adds no BOS: none is prepended


def test_mode_chat_rejects_text(llama3, tmp_path):
    f = write_jsonl(tmp_path / "c.jsonl", [{"text": "x"}, CONV])
    samples, rep = load_samples(f, llama3, mode="chat", on_bad="skip")
    assert len(samples) == 1 and rep.skipped == {"unknown format": 1}


def test_assistant_first_and_key_variants(llama3, tmp_path):
    recs = [
        {
            "messages": [
                {"role": "assistant", "content": "Welcome!"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
            ]
        },
        # ShareGPT container with OpenAI-style keys, odd case in speaker names
        {"conversations": [{"role": "Human", "content": "q"}, {"role": "GPT", "content": "a"}]},
    ]
    runs, _, rep = _masks(llama3, tmp_path, recs)
    assert runs == [["Welcome!<|eot_id|>", "hello<|eot_id|>"], ["a<|eot_id|>"]]


def test_json_array_file(llama3, tmp_path):
    f = tmp_path / "sharegpt.json"
    f.write_text(json.dumps([CONV, {"conversations": [{"from": "robot", "value": "x"}]}], indent=2))
    with pytest.raises(BadRecordError, match=r"sharegpt\.json\[1\]: unknown role: conversations\[0\]\.from='robot'"):
        load_samples(f, llama3)
    samples, rep = load_samples(f, llama3, on_bad="skip")
    assert [s.source for s in samples] == [f"{f}[0]"] and rep.skipped == {"unknown role": 1}
    f.write_text('[\n  {"text": 1},\n  {oops}\n]')
    with pytest.raises(BadRecordError, match=r"sharegpt\.json:3: malformed JSON"):
        load_samples(f, llama3)


# ----------------------------------------------------------------------------------- prompts/eval
TURNS = [
    {"question_id": 1, "turns": ['Complete the code I provided.\n\ndef add(a, b):\n    """Add."""\n']},
    {"question_id": 2, "turns": ["Tell me a joke.", "Another one."]},
]


def test_turns_records_are_prompts(tok, llama3, tmp_path):
    f = write_jsonl(tmp_path / "q.jsonl", TURNS)
    samples, rep = load_samples(f, llama3)
    assert rep.kept == 2 and rep.masked_tokens == 0 and all(not s.loss_mask.any() for s in samples)
    assert llama3.decode(samples[1].input_ids.tolist()).endswith(
        "Tell me a joke.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    samples, rep = load_samples(f, tok)  # no template: the first turn as raw text
    assert tok.decode(samples[1].input_ids.tolist()) == "Tell me a joke."


def test_load_prompts(tok, llama3, tmp_path):
    f = write_jsonl(tmp_path / "q.jsonl", TURNS + [OPENAI, {"text": "x = "}])
    texts = load_prompts(f, tok, return_text=True)  # no chat template -> raw
    assert texts == ['def add(a, b):\n    """Add."""\n', "Tell me a joke.", "What is 2+2?", "x = "]
    ids = load_prompts(f, tok)
    assert len(ids) == 4 and all(a.dtype == np.int32 and a[0] != 0 for a in ids)  # no BOS the tokenizer never adds
    assert tok.decode(ids[0].tolist()) == texts[0]
    chat = load_prompts(f, llama3, return_text=True)
    assert chat[2].endswith("What is 2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert "Complete the code" in chat[0]  # a chat model gets the instruction
    assert load_prompts(f, llama3, raw=True, return_text=True) == texts
    ids = load_prompts(f, llama3)
    assert ids[1][0] == 0 and ids[1][1] != 0  # template's BOS, not doubled
    assert len(load_prompts(f, tok, limit=2)) == 2


def test_load_prompts_real_eval_sets(tok):
    d = next((d for d in EVAL_DIRS if (d / "humaneval.jsonl").is_file()), None)
    if d is None:
        pytest.skip("eval question sets not found")
    he = load_prompts(d / "humaneval.jsonl", tok, return_text=True)
    assert len(he) == 80 and not any(t.startswith("Complete the code") for t in he)
    assert all(t.lstrip().startswith(("def ", "from ", "import ")) for t in he)
    mt = load_prompts(d / "mt_bench.jsonl", tok)
    assert len(mt) == 80 and all(a[0] != 0 for a in mt)


def test_worker_pool_tokenization_equals_serial(tok, tmp_path, monkeypatch):
    """DRAFTSMITH_TOKENIZE_WORKERS=N tokenizes text batches in N forked workers: same samples, same report."""
    import shutil

    import draftsmith.data.loader as L

    pkg = REPO / "draftsmith"
    for i, f in enumerate(sorted(pkg.rglob("*.py"))[:40]):
        shutil.copy(f, tmp_path / f"m{i:02d}.py")
    monkeypatch.setattr(L, "_BATCH_ITEMS", 6)  # several batches: the pool starts at the second one
    monkeypatch.delenv("DRAFTSMITH_TOKENIZE_WORKERS", raising=False)
    a, ra = load_samples(tmp_path, tok, max_length=256, on_bad="skip")
    monkeypatch.setenv("DRAFTSMITH_TOKENIZE_WORKERS", "2")
    started = []
    orig = L._TextPool.__init__
    monkeypatch.setattr(L._TextPool, "__init__", lambda self, *a, **k: (started.append(1), orig(self, *a, **k))[1])
    b, rb = load_samples(tmp_path, tok, max_length=256, on_bad="skip")
    assert started, "the worker pool was not used"
    assert ra.to_dict() == rb.to_dict() and len(a) == len(b) > 40
    for x, y in zip(a, b):
        assert x.source == y.source and np.array_equal(x.input_ids, y.input_ids)
        assert np.array_equal(x.loss_mask, y.loss_mask) and x.input_ids.dtype == y.input_ids.dtype
    monkeypatch.setenv("DRAFTSMITH_TOKENIZE_WORKERS", "lots")
    with pytest.raises(DraftsmithError, match="DRAFTSMITH_TOKENIZE_WORKERS"):
        load_samples(tmp_path, tok, max_length=256, on_bad="skip")


# --------------------------------------------------------------------------------------- BOS follows the tokenizer
def test_bos_follows_the_tokenizer(tok, tok_bos, tmp_path):
    """Text samples and raw prompts get a BOS exactly when the tokenizer's own encoding adds one (issue #14 item 15):
    the demo tokenizer names <|endoftext|> as bos_token but never adds it, so nothing is prepended."""
    from draftsmith.data.loader import tokenizer_adds_bos

    assert tok.bos_token_id == 0 and not tokenizer_adds_bos(tok) and tokenizer_adds_bos(tok_bos)
    text = "The capital of France is Paris."
    f = write_jsonl(tmp_path / "t.jsonl", [{"text": text}])
    for t in (tok, tok_bos):
        want = t(text, add_special_tokens=True)["input_ids"]  # what `generate` and transformers feed
        (s,), _ = load_samples(f, t)
        assert s.input_ids.tolist() == want
        added = t is tok_bos
        assert s.loss_mask.tolist() == [not added] + [True] * (len(want) - 1)  # a prepended BOS is no target
        (p,) = load_prompts(f, t, raw=True)
        assert p.tolist() == want
    (s,), _ = load_samples(f, tok, add_bos=True)  # asked for explicitly: still possible
    assert s.input_ids[0] == 0 and not s.loss_mask[0]


# ------------------------------------------------------------------------------------------ symlinks in --data
def test_symlinks_out_of_the_data_directory_are_skipped(tok, tmp_path):
    """A link in a --data directory that leads outside it is not read (issue #14 item 10) unless asked for."""
    outside = tmp_path / "outside"
    (outside / "pkg").mkdir(parents=True)
    (outside / "secret.py").write_text("password = 'hunter2'\n")
    (outside / "pkg" / "leak.py").write_text("token = 'abc'\n")
    root = tmp_path / "data"
    (root / "inner").mkdir(parents=True)
    (root / "a.py").write_text("x = 1\n")
    (root / "inner" / "b.py").write_text("y = 2\n")
    (root / "link_in.py").symlink_to(root / "inner" / "b.py")  # stays inside: read
    (root / "link_out.py").symlink_to(outside / "secret.py")  # a file outside
    (root / "dir_out").symlink_to(outside / "pkg", target_is_directory=True)  # a directory outside
    samples, rep = load_samples(root, tok)
    names = sorted(os.path.relpath(s.source, root) for s in samples)
    assert names == ["a.py", "inner/b.py", "link_in.py"]
    assert "hunter2" not in "".join(tok.decode(s.input_ids.tolist()) for s in samples)
    skipped = rep.skipped.get("symlink outside the data directory", 0)
    assert skipped in (1, 2)  # the linked directory is walked only where glob('**') follows directory links
    assert rep.total == rep.kept + sum(rep.skipped.values())
    assert "symlink outside the data directory" in rep.summary()
    samples, rep = load_samples(root, tok, follow_symlinks=True)
    assert "link_out.py" in [os.path.relpath(s.source, root) for s in samples] and not rep.skipped
    only_links = tmp_path / "only_links"
    only_links.mkdir()
    (only_links / "x.py").symlink_to(outside / "secret.py")
    with pytest.raises(DraftsmithError, match=r"no files match .*1 symlinked file\(s\) outside it skipped"):
        load_samples(only_links, tok)
