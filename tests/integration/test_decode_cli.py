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
PYCODE_TINY = next(
    (p for p in (os.path.join(ROOT, "assets", "pycode-tiny"), "/work/shared/targets/pycode-tiny") if os.path.isdir(p)),
    None,
)
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


@pytest.mark.parametrize(
    "extra",
    [[], ["--draft-tokens", "2"], ["--tree", "--top-k-draft", "3", "--depth", "3", "--tree-tokens", "8"]],
    ids=["plain", "chain", "tree"],
)
def test_generate_json_matches_plain_greedy(app, drafter_dir, extra):
    path, t = drafter_dir
    prompt = "def fib(n):\n"
    args = [
        "generate",
        "--target",
        PYCODE_TINY,
        "--prompt",
        prompt,
        "--max-new-tokens",
        "20",
        "--json",
        "--device",
        "cpu",
    ]
    if extra:
        args += ["--drafter", path] + extra
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    obj = _json_line(r.stdout)
    ids = t.tokenizer(prompt)["input_ids"]
    x = torch.tensor([ids])
    ref = t.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=20, do_sample=False, pad_token_id=0)[
        0, len(ids) :
    ].tolist()
    assert obj["token_ids"] == ref
    assert obj["text"] == t.tokenizer.decode(ref)
    assert obj["tau"] >= 1.0 and "timing" in obj and obj["timing"]["total_s"] > 0


def test_generate_sampling_seed_reproducible(app, drafter_dir):
    path, _ = drafter_dir
    args = [
        "generate",
        "--target",
        PYCODE_TINY,
        "--drafter",
        path,
        "--prompt",
        "import os\n",
        "--max-new-tokens",
        "12",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--seed",
        "3",
        "--json",
        "--device",
        "cpu",
    ]
    a = _json_line(CliRunner().invoke(app, args).stdout)
    b = _json_line(CliRunner().invoke(app, args).stdout)
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 12


def test_generate_stop_string(app, drafter_dir):
    path, t = drafter_dir
    args = [
        "generate",
        "--target",
        PYCODE_TINY,
        "--drafter",
        path,
        "--prompt",
        "def fib(n):\n",
        "--max-new-tokens",
        "40",
        "--stop",
        "\n",
        "--json",
        "--device",
        "cpu",
    ]
    obj = _json_line(CliRunner().invoke(app, args).stdout)
    assert obj["finish_reason"] == "stop" and "\n" in obj["text"]
    # the stop string is completed by the last token, not before
    assert "\n" not in t.tokenizer.decode(obj["token_ids"][:-1])


def test_eval_writes_report(app, drafter_dir, tmp_path):
    path, _ = drafter_dir
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\\n\nclass Stack:\\n    def push(self, x):\n")
    out = tmp_path / "ev"
    r = CliRunner().invoke(
        app,
        [
            "eval",
            "--target",
            PYCODE_TINY,
            "--drafter",
            path,
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "12",
            "--draft-tokens",
            "2",
            "--temperatures",
            "0,0.7",
            "--out",
            str(out),
            "--device",
            "cpu",
            "--attn-impl",
            "bmm",
        ],
    )
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
    r = CliRunner().invoke(
        app,
        [
            "eval",
            "--target",
            PYCODE_TINY,
            "--drafter",
            path,
            "--prompts",
            src,
            "--raw",
            "--limit",
            "2",
            "--max-new-tokens",
            "8",
            "--tree",
            "--top-k-draft",
            "2",
            "--depth",
            "2",
            "--tree-tokens",
            "4",
            "--temperatures",
            "0",
            "--out",
            str(out),
            "--device",
            "cpu",
        ],
    )
    assert r.exit_code == 0, r.output
    rep = json.loads((out / "eval.json").read_text())
    assert rep["mode"]["kind"] == "tree" and rep["temperatures"]["0"]["greedy_mismatches"] == 0


def test_run_eval_warms_each_prompt_length_once_before_timing():
    """The first prefill of a prompt length pays one-time costs (with `prefill_graphs` a capture per length bucket,
    with and without the drafter, per sampling setting); run_eval pays them untimed, once per engine, for both
    paths and every temperature."""
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
    run_eval(eng, prompts, DecodeMode("chain", draft_tokens=2), (0.0,), max_new_tokens=16, certificate=False)
    warm = [c for c in eng.calls if c[1] == 1]
    # one untimed prefill per distinct length and path (plain: the target alone; chain: with the drafter)
    assert sorted((c[0], c[2]) for c in warm) == [(5, "chain"), (5, "plain"), (7, "chain"), (7, "plain")]
    first_timed = next(i for i, c in enumerate(eng.calls) if c[1] == 16)
    assert all(eng.calls.index(c) < first_timed for c in warm)
    eng.calls.clear()
    run_eval(eng, prompts, DecodeMode("chain", draft_tokens=2), (0.0,), max_new_tokens=16, certificate=False)
    assert not [c for c in eng.calls if c[1] == 1]  # already warm
    run_eval(eng, prompts, DecodeMode("chain", draft_tokens=2), (0.7,), max_new_tokens=16, certificate=False)
    assert len([c for c in eng.calls if c[1] == 1]) == 4  # a new sampling setting: its own graphs


def _main_error(argv, capsys) -> str:
    """Run `draftsmith ARGV` through the real entry point; it must exit 2 with one `error:` line."""
    from draftsmith.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


BAD_NUMBERS = [
    (["--temperature", "nan"], "--temperature"),
    (["--temperature", "-1"], "--temperature"),
    (["--temperature", "inf"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--top-k", "-3"], "--top-k"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--max-new-tokens", "-5"], "--max-new-tokens"),
    (["--draft-tokens", "0"], "--draft-tokens"),
]


@pytest.mark.parametrize("extra,flag", BAD_NUMBERS, ids=[" ".join(x) for x, _ in BAD_NUMBERS])
def test_generate_rejects_bad_numbers_before_loading(extra, flag, capsys):
    err = _main_error(["generate", "--target", "/nonexistent", "--prompt", "x", *extra], capsys)
    assert flag in err  # named before the (missing) target is even opened


@pytest.mark.parametrize(
    "extra,flag",
    BAD_NUMBERS[3:] + [(["--temperatures", "0,nan"], "--temperature"), (["--limit", "0"], "--limit")],
    ids=[" ".join(x) for x, _ in BAD_NUMBERS[3:]] + ["temperatures nan", "limit 0"],
)
def test_eval_rejects_bad_numbers_before_loading(extra, flag, capsys, tmp_path):
    err = _main_error(
        [
            "eval",
            "--target",
            "/nonexistent",
            "--drafter",
            "/nonexistent",
            "--prompts",
            "p.txt",
            *extra,
            "--out",
            str(tmp_path / "o"),
        ],
        capsys,
    )
    assert flag in err


def test_generate_empty_prompt_is_one_line(capsys):
    err = _main_error(["generate", "--target", PYCODE_TINY, "--prompt", ""], capsys)
    assert "--prompt" in err


def test_eval_binary_prompts_file_is_one_line(drafter_dir, capsys, tmp_path):
    path, _ = drafter_dir
    bad = tmp_path / "prompts.bin"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    err = _main_error(
        [
            "eval",
            "--target",
            PYCODE_TINY,
            "--drafter",
            path,
            "--prompts",
            str(bad),
            "--device",
            "cpu",
            "--out",
            str(tmp_path / "o"),
        ],
        capsys,
    )
    assert str(bad) in err and "binary" in err
    latin = tmp_path / "prompts.txt"
    latin.write_bytes(b"def f():\n\xe9t\xe9\n")
    err = _main_error(
        [
            "eval",
            "--target",
            PYCODE_TINY,
            "--drafter",
            path,
            "--prompts",
            str(latin),
            "--device",
            "cpu",
            "--out",
            str(tmp_path / "o"),
        ],
        capsys,
    )
    assert f"{latin}:2" in err and "UTF-8" in err


def test_prompt_records_and_one_rule_for_every_format(drafter_dir, tmp_path):
    """{"prompt": ...} records are read, and every format of the same prompt gives the same ids (one rule)."""
    from draftsmith.decode.evaluate import load_prompt_ids, use_chat_template

    _, t = drafter_dir
    tok = t.tokenizer
    texts = ["def add(a, b):\n", "import os\nx = 1"]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": x}) + "\n" for x in texts))
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": x}) + "\n" for x in texts))
    (tmp_path / "q.jsonl").write_text("".join(json.dumps({"turns": [x]}) + "\n" for x in texts))
    (tmp_path / "l.txt").write_text("".join(x.replace("\n", "\\n") + "\n" for x in texts))
    raw = not use_chat_template(tok, None)  # pycode-tiny has no chat template: text as is
    assert raw
    got = [load_prompt_ids(str(tmp_path / f), tok, raw=raw) for f in ("p.jsonl", "t.jsonl", "q.jsonl", "l.txt")]
    assert len(got[0]) == 2 and all(g == got[0] for g in got)
    with pytest.raises(Exception, match="chat template"):
        use_chat_template(tok, True)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n" + json.dumps({"prompt": 3}) + "\n")
    with pytest.raises(Exception, match="bad.jsonl:2: field 'prompt'"):
        load_prompt_ids(str(tmp_path / "bad.jsonl"), tok)


def test_generate_tune_save_and_reuse(app, drafter_dir, tmp_path):
    path, _ = drafter_dir
    f = tmp_path / "tuning.json"
    base = [
        "generate",
        "--target",
        PYCODE_TINY,
        "--drafter",
        path,
        "--prompt",
        "def fib(n):\n",
        "--max-new-tokens",
        "8",
        "--json",
        "--device",
        "cpu",
    ]
    r = CliRunner().invoke(app, base + ["--tune", "--save-tuning", str(f)])
    assert r.exit_code == 0, r.output
    assert "tuned: " in r.stderr and "calibrate chain K=2" in r.stderr
    saved = json.loads(f.read_text())
    assert saved["format"] == "draftsmith-tuning/1" and saved["candidates"][0]["mode"]["kind"] == "plain"
    assert len(saved["candidates"]) >= 5
    assert saved["speedup"] >= 1.0  # never slower than plain on the calibration prompts (plain is the fallback)
    obj = _json_line(r.stdout)
    assert obj["decode_mode"] == saved["mode"]
    r2 = CliRunner().invoke(app, base + ["--tuning", str(f)])
    assert r2.exit_code == 0, r2.output
    assert f"using {f}" in r2.stderr and _json_line(r2.stdout)["token_ids"] == obj["token_ids"]


def test_tuning_file_errors_name_the_field(tmp_path):
    from draftsmith.common.errors import DraftsmithError
    from draftsmith.decode.tuning import Tuning

    f = tmp_path / "t.json"
    f.write_text(
        json.dumps(
            {
                "format": "draftsmith-tuning/1",
                "mode": {"kind": "chain", "draft_tokens": 0},
                "tok_s": 1.0,
                "plain_tok_s": 1.0,
            }
        )
    )
    with pytest.raises(DraftsmithError, match="field 'mode'.*draft-tokens"):
        Tuning.load(f)
    f.write_text(
        json.dumps({"format": "draftsmith-tuning/1", "mode": {"kind": "chain"}, "tok_s": "x", "plain_tok_s": 1.0})
    )
    with pytest.raises(DraftsmithError, match="field 'tok_s'"):
        Tuning.load(f)


def test_tune_falls_back_to_plain_when_nothing_wins():
    """With rounds that are always slower than a plain step, the tuner picks plain and says so."""
    from types import SimpleNamespace

    from draftsmith.decode.tuning import DEFAULT_CANDIDATES, tune

    class SlowRounds:
        max_len, drafter = 4096, object()

        def warmup(self, mode, sp):
            pass

        def generate(self, p, n, sampling=None, mode=None, seed=0):
            slow = mode.kind != "plain"
            return SimpleNamespace(
                token_ids=[1] * n,
                accepted=[0] * n if slow else [],
                rounds=n,
                prefill_s=0.0,
                decode_s=n * (0.02 if slow else 0.01),
            )

    res = tune(SlowRounds(), [[1, 2, 3]], max_new_tokens=16)
    assert res.mode.kind == "plain" and res.speedup == 1.0 and "plain decoding" in res.summary()
    # every candidate ties (all within the margin): plain and the first FINALISTS measured again, longer
    from draftsmith.decode.tuning import FINAL_TOKENS_FACTOR, FINALISTS

    stages = [c["stage"] for c in res.candidates]
    assert stages == [1] * (1 + len(DEFAULT_CANDIDATES)) + [2] * (1 + FINALISTS)
    assert all(c["new_tokens"] == 16 * FINAL_TOKENS_FACTOR for c in res.candidates if c["stage"] == 2)
    assert len(tune(SlowRounds(), [[1, 2, 3]], max_new_tokens=16, final_tokens=16).candidates) == 8


def test_tune_measures_close_settings_again_longer():
    """Two settings within the margin after the short calibration: both measured again with 4x the tokens (and
    plain with them), and the longer measurement decides — here it reverses the short ranking (the kind of reversal
    that put chain K=4 ahead of K=6 on pycode-small). A clear winner is not measured again."""
    from types import SimpleNamespace

    from draftsmith.decode.engine import DecodeMode
    from draftsmith.decode.tuning import tune

    k2, k4 = DecodeMode("chain", draft_tokens=2), DecodeMode("chain", draft_tokens=4)

    class Engine:
        max_len, drafter = 4096, object()

        def __init__(self, short_k4):
            self.short_k4 = short_k4

        def warmup(self, mode, sp):
            pass

        def generate(self, p, n, sampling=None, mode=None, seed=0):
            per_token = {"plain": 0.010, 2: 0.006, 4: self.short_k4 if n <= 16 else 0.004}
            key = "plain" if mode.kind == "plain" else mode.draft_tokens
            return SimpleNamespace(
                token_ids=[1] * n, accepted=[0] * n, rounds=n, prefill_s=0.0, decode_s=n * per_token[key]
            )

    res = tune(Engine(short_k4=0.0062), [[1, 2, 3]], max_new_tokens=16, candidates=[k2, k4])
    assert [c["stage"] for c in res.candidates] == [1, 1, 1, 2, 2, 2]
    assert res.mode == k4 and res.tok_s == pytest.approx(1 / 0.004) and res.plain_tok_s == pytest.approx(100)
    # far apart after the short calibration: no second stage
    res = tune(Engine(short_k4=0.003), [[1, 2, 3]], max_new_tokens=16, candidates=[k2, k4])
    assert [c["stage"] for c in res.candidates] == [1, 1, 1] and res.mode == k4


def test_eval_tune_reports_tuned_and_certificate(app, drafter_dir, tmp_path):
    path, _ = drafter_dir
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):\n"}) + "\n" + json.dumps({"prompt": "import os\n"}) + "\n")
    out = tmp_path / "ev"
    r = CliRunner().invoke(
        app,
        [
            "eval",
            "--target",
            PYCODE_TINY,
            "--drafter",
            path,
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "8",
            "--draft-tokens",
            "2",
            "--temperatures",
            "0",
            "--tune",
            "--out",
            str(out),
            "--device",
            "cpu",
        ],
    )
    assert r.exit_code == 0, r.output
    rep = json.loads((out / "eval.json").read_text())
    assert set(rep["tuned"]) == {"mode", "tok_s", "plain_tok_s", "speedup"}
    assert rep["tuned"]["mode"]["kind"] in ("plain", "chain", "tree") and rep["tuned"]["tok_s"] > 0
    assert set(rep["temperatures"]["0"]["greedy_divergences"]) == {"equal", "near_tie", "real", "epsilon"}
    assert rep["temperatures"]["0"]["greedy_divergences"]["equal"] == 2  # fp32: equal token for token
    assert rep["raw"] is True and rep["prompt_format"] == "text as is"  # no chat template: true to what ran
