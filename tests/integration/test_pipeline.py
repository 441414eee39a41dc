"""`draftsmith pipeline`: end to end on the demo target, resume (skip / rerun what changed and what follows), and a
bad config failing before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from draftsmith.common.errors import DraftsmithError
from draftsmith.pipeline.runner import decide, plan, run_pipeline

REPO = Path(__file__).resolve().parents[2]


def _config(tmp: Path, run: Path, **changes) -> dict:
    cfg = {
        "target": str(REPO / "assets" / "pycode-tiny"),
        "out": str(run),
        "threads": 1,
        "train": {
            "online": True,
            "data": str(REPO / "draftsmith" / "pipeline"),
            "on_bad": "skip",
            "aux_layers": [1, 3, 4],
            "max_length": 64,
            "steps": 2,
            "batch_tokens": 128,
            "draft_vocab_size": 128,
            "device": "cpu",
            "quiet": True,
        },
        "eval": {
            "prompts": str(REPO / "assets" / "demo_prompts.jsonl"),
            "raw": True,
            "limit": 1,
            "max_new_tokens": 4,
            "temperatures": [0],
            "draft_tokens": 2,
            "device": "cpu",
        },
        "export": {"formats": ["sglang"]},
    }
    for path, v in changes.items():
        sec, key = path.split(".")
        cfg[sec][key] = v
    return cfg


def _write(tmp: Path, cfg: dict, name: str = "p.yaml") -> str:
    p = tmp / name
    p.write_text(yaml.safe_dump(cfg))
    return str(p)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline")
    run = tmp / "run"
    cfg = _config(tmp, run)
    data = run_pipeline(plan(_write(tmp, cfg)), log=lambda s: None)
    return tmp, run, cfg, data


def test_end_to_end_writes_drafter_eval_export_and_report(finished):
    tmp, run, cfg, data = finished
    assert (run / "train" / "final" / "config.json").is_file()
    ev = json.loads((run / "eval" / "trained" / "eval.json").read_text())
    t0 = ev["temperatures"]["0"]
    assert t0["greedy_mismatches"] == 0 and t0["speculative"]["tau"] >= 1.0
    assert (run / "export" / "sglang" / "config.json").is_file()
    report = (run / "report.md").read_text()
    assert f"| trained | 0 | {t0['speculative']['tau']:.2f} |" in report
    assert "Acceptance by position" in report and "python -m sglang.launch_server" in report
    assert "steps: 2" in report  # the settings
    assert [s["status"] for s in data["stages"]] == ["done"] * 3
    assert (run / "pipeline.yaml").is_file()


def test_rerun_skips_everything_and_a_change_reruns_that_stage_and_after(finished):
    tmp, run, cfg, _ = finished
    same = plan(_write(tmp, cfg, "same.yaml"))
    assert decide(same) == ["up to date"] * 3
    data = run_pipeline(same, log=lambda s: None)  # nothing to run: no model is even loaded
    assert [s["status"] for s in data["stages"]] == ["skipped"] * 3
    # an eval setting: eval reruns; train and export (which do not read eval) stay
    p = plan(_write(tmp, _config(tmp, run, **{"eval.max_new_tokens": 5}), "eval.yaml"))
    assert decide(p) == ["up to date", "changed", "up to date"]
    # a train setting: train and everything after it
    p = plan(_write(tmp, _config(tmp, run, **{"train.steps": 3}), "train.yaml"))
    assert decide(p) == ["changed", "changed", "changed"]


def test_an_interrupted_stage_resumes(finished, tmp_path):
    """A stage whose record says it started with these settings but never finished is resumed (train: --resume)."""
    tmp, run, cfg, _ = finished
    p = plan(_write(tmp, cfg, "again.yaml"))
    rec = run / ".pipeline" / "train.json"
    saved = rec.read_text()
    try:
        rec.write_text(json.dumps({**json.loads(saved), "done": False}))
        assert decide(p) == ["resume", "up to date", "up to date"]
    finally:
        rec.write_text(saved)


def test_changed_eval_reruns_only_eval(finished):
    tmp, run, cfg, _ = finished
    before = (run / "train" / "final" / "model.safetensors").stat().st_mtime_ns
    data = run_pipeline(
        plan(_write(tmp, _config(tmp, run, **{"eval.max_new_tokens": 5}), "e.yaml")), log=lambda s: None
    )
    assert [s["status"] for s in data["stages"]] == ["skipped", "done", "skipped"]
    assert (run / "train" / "final" / "model.safetensors").stat().st_mtime_ns == before
    assert json.loads((run / "eval" / "trained" / "eval.json").read_text())["max_new_tokens"] == 5
    # back to the module's settings (the other tests of this module expect them): only eval reruns again
    data = run_pipeline(plan(_write(tmp, cfg, "back.yaml")), log=lambda s: None)
    assert [s["status"] for s in data["stages"]] == ["skipped", "done", "skipped"]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda c: c.update(trian={}), r"field 'trian': unknown \(did you mean 'train'\?\)"),
        (lambda c: c["train"].update(stpes=3), r"field 'train.stpes': unknown \(did you mean 'steps'\?\)"),
        (lambda c: c["train"].update(steps="many"), r"section 'train': .*--steps"),
        (lambda c: c["train"].update(out="elsewhere"), r"field 'train.out': set by the pipeline"),
        (lambda c: c["eval"].update(prompts="missing.jsonl"), r"field 'eval.prompts': missing.jsonl: no such file"),
        (lambda c: c["train"].update(online=False), r"field 'train.online': without a capture section"),
        (lambda c: c["export"].update(formats=["onnx"]), r"field 'export.formats': unknown format 'onnx'"),
        (lambda c: c["train"].update(quiet="yes"), r"field 'train.quiet': expected true or false"),
        (lambda c: c.pop("target"), r"field 'target': required"),
        (lambda c: c["train"].update(init_from="nowhere"), r"field 'train.init_from': nowhere: no such file"),
        (lambda c: c["train"].update(store="nowhere"), r"field 'train.store': train reads one source"),
    ],
)
def test_bad_config_fails_before_any_work(tmp_path, mutate, message):
    run = tmp_path / "run"
    cfg = _config(tmp_path, run)
    mutate(cfg)
    path = _write(tmp_path, cfg)
    with pytest.raises(DraftsmithError, match=message) as e:
        run_pipeline(plan(path), log=lambda s: None)
    assert str(e.value).startswith(path) and "\n" not in str(e.value)
    assert not run.exists()


def test_regenerate_and_capture_are_wired_into_train(tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}\n')
    cfg = _config(tmp_path, tmp_path / "run")
    cfg["regenerate"] = {"data": str(chats), "max_new_tokens": 16, "batch_size": 8}
    cfg["capture"] = {"max_length": 256, "aux_layers": [1, 3, 4]}
    cfg["train"] = {"steps": 2}
    p = plan(_write(tmp_path, cfg))
    names = [s.name for s in p.stages]
    assert names == ["regenerate", "capture", "train", "eval:trained", "export:sglang"]
    regen, cap, train = p.stages[:3]
    assert cap.argv[cap.argv.index("--data") + 1] == str(regen.output)
    assert train.argv[train.argv.index("--store") + 1] == str(cap.output)
    assert "--aux-layers" in cap.argv and cap.argv[cap.argv.index("--aux-layers") + 1] == "1,3,4"
    # a drafter to start from: passed on, and its files are part of the train stage's fingerprint
    drafter = Path(__file__).resolve().parents[2] / "assets" / "pycode-tiny-drafter"
    if drafter.is_dir():
        cfg["train"]["init_from"] = str(drafter)
        train = plan(_write(tmp_path, cfg, "init.yaml")).stages[2]
        assert train.argv[train.argv.index("--init-from") + 1] == str(drafter)
        assert str(drafter / "config.json") in train.inputs and any(i.endswith(".safetensors") for i in train.inputs)


def test_a_store_recorded_elsewhere_trains_the_drafter_it_was_served_with(tmp_path):
    """train.store: a store this pipeline did not capture (`serve --capture-to`) is read offline, with the serving
    drafter to start from (init_from); the store's manifest joins the train stage's fingerprint (a server appending
    shards rewrites it)."""
    store = tmp_path / "served"
    store.mkdir()
    (store / "manifest.json").write_text("{}")  # planning reads no store (train opens it, with its own checks)
    drafter = Path(__file__).resolve().parents[2] / "assets" / "pycode-tiny-drafter"
    cfg = _config(tmp_path, tmp_path / "run")
    cfg["train"] = {"store": str(store), "steps": 2, **({"init_from": str(drafter)} if drafter.is_dir() else {})}
    p = plan(_write(tmp_path, cfg))
    assert [s.name for s in p.stages][:1] == ["train"]
    train = p.stages[0]
    assert train.argv[train.argv.index("--store") + 1] == str(store) and "--online" not in train.argv
    assert str(store / "manifest.json") in train.inputs


def test_the_served_traffic_recipe_is_valid(tmp_path, monkeypatch):
    """examples/served-traffic.yaml validates and plans train (from the served store, starting at the serving
    drafter) -> eval of both drafters -> export."""
    repo = Path(__file__).resolve().parents[2]
    drafter = repo / "assets" / "pycode-tiny-drafter"
    if not drafter.is_dir():
        pytest.skip("assets/pycode-tiny-drafter not available")
    store = tmp_path / "served"
    store.mkdir()
    (store / "manifest.json").write_text("{}")
    for k, v in dict(TARGET=repo / "assets" / "pycode-tiny", DRAFTER=drafter, SERVED_STORE=store).items():
        monkeypatch.setenv(k, str(v))
    monkeypatch.setenv("PROMPTS", str(repo / "assets" / "demo_prompts.jsonl"))
    p = plan(str(repo / "examples" / "served-traffic.yaml"))
    names = [st.name for st in p.stages]
    assert names[0] == "train" and {"eval:trained", "eval:serving"} <= set(names), names
    train = p.stages[0]
    assert train.argv[train.argv.index("--init-from") + 1] == str(drafter)


def test_the_small_target_recipe_is_valid(small_path, monkeypatch):
    """examples/pycode-small.yaml (the recipe the next drafter for pycode-small is trained with) validates: every
    field is a flag of its stage's command, and the stages chain (regenerate -> train -> eval -> export)."""
    repo = Path(__file__).resolve().parents[2]
    monkeypatch.setenv("PYCODE_SMALL", str(small_path))
    monkeypatch.setenv("HUMANEVAL", str(repo / "assets" / "demo_prompts.jsonl"))
    p = plan(str(repo / "examples" / "pycode-small.yaml"))
    names = [st.name for st in p.stages]
    assert names[:2] == ["regenerate", "train"] and names[2].startswith("eval"), names
    train = next(st for st in p.stages if st.name == "train")
    assert "--online" in train.argv and "regenerated.jsonl" in " ".join(train.argv)
