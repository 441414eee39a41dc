"""`draftsmith pipeline CONFIG.yaml`: regenerate -> capture (or online training) -> train -> eval -> export.

The config is one YAML mapping (see examples/ and docs/commands/pipeline.md):

    target: PATH                  # the HF target every stage uses
    out: RUN                      # everything lands here
    threads: 1                    # optional: torch CPU threads for this process (CPU runs)
    regenerate: {data: FILE, ...} # optional: the flags of `draftsmith regenerate` (long names, snake or kebab case)
    capture: {data: PATH, ...}    # optional: the flags of `draftsmith capture`; without it train needs online: true
    train: {steps: N, ...}        # the flags of `draftsmith train`
    eval: {prompts: FILE, ..., drafters: {label: DIR}}   # optional: the flags of `draftsmith eval`; `drafters`
                                  # evaluates more drafters next to the one trained here (e.g. a bundled one)
    export: {formats: [sglang, vllm], ...}               # optional: the flags of `draftsmith export`

Every stage runs the stage's own command in this process (`draftsmith.cli`), so a stage section accepts exactly the
flags that command has and means by them what it does. The whole file is checked before any work starts: an
unknown section or field, a field the pipeline sets itself (--target, --out, ...), or a value of the wrong type is
one line naming the file and the field.

Resume: each stage's settings (its command line + the fingerprint of what it reads: the previous stage's settings,
input files' size and mtime) are written to RUN/.pipeline/STAGE.json when it starts and marked done when it ends.
A stage whose record matches and is done is skipped; one interrupted with the same settings continues (capture and
regenerate resume themselves, train gets --resume); a changed setting removes that stage's output and reruns it,
and, since every later stage's fingerprint includes it, everything after it. RUN/report.md sums it up.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import json
import os
import shlex
import shutil
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import click
import typer.main
import yaml

from draftsmith.common.errors import DraftsmithError
from draftsmith.common.io import atomic_write_json, read_json
from draftsmith.common.schema import build, fields_of, values_from_flags
from draftsmith.pipeline.report import write_report

STAGES = ("regenerate", "capture", "train", "eval", "export")
TOP_LEVEL = ("target", "out", "threads", "description") + STAGES
# fields each stage's command gets from the pipeline (a config that sets them is refused: it would fight the wiring)
PIPELINE_SET = {
    "regenerate": ("target", "out", "config"),
    "capture": ("target", "out", "config"),
    "train": ("target", "out", "resume", "config"),
    "eval": ("target", "drafter", "out", "json"),
    "export": ("drafter", "format", "out", "target"),
}
# fields the pipeline itself reads from a stage section (not flags of the command)
EXTRA_FIELDS = {"eval": ("drafters",), "export": ("formats",)}
EXPORT_FORMATS = ("sglang", "vllm", "speculators")


@dataclass
class Stage:
    name: str  # regenerate | capture | train | eval:LABEL | export:FORMAT
    command: str  # the draftsmith subcommand
    argv: list[str]
    output: Path  # what the stage writes (removed when its settings change)
    inputs: list[str] = field(default_factory=list)  # files whose size/mtime are part of the fingerprint
    fingerprint: str = ""
    status: str = "pending"
    seconds: float = 0.0


@dataclass
class PipelinePlan:
    config_path: str
    config: dict
    target: str
    run_dir: Path
    stages: list[Stage]
    threads: Optional[int] = None


# --------------------------------------------------------------------------------------------- config checks
def _snake(key: str) -> str:
    return str(key).strip().replace("-", "_")


def _command(name: str):
    from draftsmith.cli import app  # circular at module level: draftsmith.cli imports pipeline.cli, which imports this

    group = typer.main.get_command(app)
    return group.commands[name]


def _flag_table(command) -> dict[str, tuple[str, Optional[str], bool, Any]]:
    """field name -> (primary option, negative option or None, is a flag, click param) for a command's options."""
    table = {}
    for p in command.params:
        if p.param_type_name != "option":
            continue
        longs = [o for o in p.opts if o.startswith("--")]
        neg = [o for o in p.secondary_opts if o.startswith("--")]
        for o in longs:
            table[_snake(o[2:])] = (o, neg[0] if neg else None, bool(p.is_flag), p)
        for o in neg:  # '--no-cuda-graphs: true' / '--raw: true' work too
            table[_snake(o[2:])] = (o, longs[0] if longs else None, bool(p.is_flag), p)
    return table


def _where(path: str, section: str, key: str) -> str:
    return f"{path}: field '{section}.{key}'" if section else f"{path}: field '{key}'"


def _unknown(path: str, section: str, key: str, known) -> DraftsmithError:
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return DraftsmithError(f"{_where(path, section, key)}: unknown{hint}")


def _argv_for(path: str, section: str, values: dict, command, skip: tuple = ()) -> list[str]:
    """A stage section -> the command's argv (checked: unknown fields, fields the pipeline sets, value shapes)."""
    table = _flag_table(command)
    argv: list[str] = []
    for raw_key, v in values.items():
        key = _snake(raw_key)
        if key in skip:
            continue
        if key in PIPELINE_SET.get(section, ()):
            raise DraftsmithError(f"{_where(path, section, raw_key)}: set by the pipeline (remove it)")
        if key not in table:
            raise _unknown(path, section, raw_key, list(table) + list(skip))
        opt, other, is_flag, _ = table[key]
        if v is None:
            continue
        if is_flag:
            if not isinstance(v, bool):
                raise DraftsmithError(f"{_where(path, section, raw_key)}: expected true or false, got {v!r}")
            if v:
                argv.append(opt)
            elif other is not None:
                argv.append(other)
            continue
        if isinstance(v, (list, tuple)):
            if not all(isinstance(x, (int, float, str)) and not isinstance(x, bool) for x in v):
                raise DraftsmithError(f"{_where(path, section, raw_key)}: expected a list of numbers or strings")
            v = ",".join(str(x) for x in v)
        elif isinstance(v, dict):
            raise DraftsmithError(f"{_where(path, section, raw_key)}: expected a value, got a mapping")
        elif isinstance(v, bool):
            v = str(v).lower()
        argv += [opt, str(v)]
    return argv


def _dry_parse(path: str, section: str, command_name: str, argv: list[str]) -> None:
    """Let the command's own parser convert every value now (types, choices), before any stage runs."""
    cmd = _command(command_name)
    try:
        ctx = cmd.make_context(command_name, list(argv), resilient_parsing=False)
        _schema_check(command_name, ctx.params)
        check_settings = getattr(cmd.callback, "check_settings", None)  # generate/eval/serve (decode/config.py)
        if check_settings is not None:
            check_settings(ctx.params)
    except click.exceptions.Exit:
        pass
    except click.UsageError as e:  # BadParameter, NoSuchOption, MissingParameter
        msg = " ".join(e.format_message().split())
        raise DraftsmithError(f"{path}: section '{section}': {msg}") from None
    except DraftsmithError as e:  # commands whose options convert their values themselves (common.schema)
        raise DraftsmithError(f"{path}: section '{section}': {e}") from None


# commands whose options typer passes as strings and the stage's schema converts and checks (common.schema)
SCHEMA_CONFIGS = {
    "train": ("draftsmith.train.config", "TrainConfig"),
    "capture": ("draftsmith.capture.config", "CaptureConfig"),
}


def _schema_check(command_name: str, params: dict) -> None:
    """Convert and check a schema command's values as the command will, without running it."""
    where = SCHEMA_CONFIGS.get(command_name)
    if where is None:
        return
    try:
        schema = getattr(importlib.import_module(where[0]), where[1])
        names = fields_of(schema)
    except (ImportError, AttributeError):  # the command no longer uses a schema: its parser checked the values
        return
    build(schema, values_from_flags(schema, {k: v for k, v in params.items() if k in names}))


def load_config(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise DraftsmithError(f"{path}: pipeline config not found")
    try:
        cfg = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise DraftsmithError(f"{path}{line}: invalid YAML ({getattr(e, 'problem', None) or e})") from None
    if not isinstance(cfg, dict):
        raise DraftsmithError(f"{path}: expected a mapping with target, out and stage sections")
    return _expand(cfg)


def _expand(v):
    """${VAR} in string values from the environment; ${PYTHON_STDLIB} and ${PYTHON_SITE_PACKAGES} default to this
    Python's standard library and site-packages directories (the demo recipes train on their .py files: every
    machine with Python has them)."""
    if isinstance(v, dict):
        return {k: _expand(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_expand(x) for x in v]
    if isinstance(v, str) and "${" in v:
        env = dict(os.environ)
        env.setdefault("PYTHON_STDLIB", sysconfig.get_paths()["stdlib"])
        env.setdefault("PYTHON_SITE_PACKAGES", sysconfig.get_paths()["purelib"])
        for k, x in env.items():
            v = v.replace("${" + k + "}", x)
    return v


def plan(config_path: str, overrides: Optional[dict] = None) -> PipelinePlan:
    """Check the config and build every stage's command line (no work, no model loaded)."""
    cfg = load_config(config_path)
    for k, v in (overrides or {}).items():
        cfg[k] = _expand(v)
    path = config_path
    norm: dict[str, Any] = {}
    for k, v in cfg.items():
        key = _snake(k)
        if key not in TOP_LEVEL:
            raise _unknown(path, "", str(k), TOP_LEVEL)
        norm[key] = v
    for req in ("target", "out", "train"):
        if norm.get(req) in (None, ""):
            raise DraftsmithError(f"{_where(path, '', req)}: required")
    for s in STAGES:
        if s in norm and norm[s] is not None and not isinstance(norm[s], dict):
            raise DraftsmithError(f"{_where(path, '', s)}: expected a mapping of {s} flags")
    threads = norm.get("threads")
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise DraftsmithError(f"{_where(path, '', 'threads')}: expected an integer >= 1, got {threads!r}")
    target = str(norm["target"])
    if not Path(target).is_dir():
        raise DraftsmithError(f"{_where(path, '', 'target')}: {target}: no such model directory")
    run = Path(str(norm["out"]))
    stages: list[Stage] = []

    def section(name) -> dict:
        return {_snake(k): v for k, v in (norm.get(name) or {}).items()}

    def need_path(sec: str, key: str, value) -> str:
        if not isinstance(value, str) or not value:
            raise DraftsmithError(f"{_where(path, sec, key)}: expected a path")
        if not Path(value).exists():
            raise DraftsmithError(f"{_where(path, sec, key)}: {value}: no such file or directory")
        return value

    data_after_regen: Optional[str] = None
    if norm.get("regenerate") is not None:
        sec = section("regenerate")
        data = need_path("regenerate", "data", sec.get("data"))
        out = run / "regenerated.jsonl"
        argv = ["--target", target, "--out", str(out)] + _argv_for(path, "regenerate", sec, _command("regenerate"))
        stages.append(Stage("regenerate", "regenerate", argv, out, inputs=[data]))
        data_after_regen = str(out)

    store: Optional[Path] = None
    if norm.get("capture") is not None:
        sec = section("capture")
        if "data" not in sec and data_after_regen:
            sec["data"] = data_after_regen
        data = sec.get("data")
        if data != data_after_regen:
            need_path("capture", "data", data)
        store = run / "store"
        argv = ["--target", target, "--out", str(store)] + _argv_for(path, "capture", sec, _command("capture"))
        stages.append(Stage("capture", "capture", argv, store, inputs=[str(data)]))

    tsec = section("train")
    online = bool(tsec.get("online"))
    store_inputs = []
    if tsec.get("store") is not None:  # a store made elsewhere (`serve --capture-to`, an earlier capture)
        if store is not None or online:
            raise DraftsmithError(
                f"{_where(path, 'train', 'store')}: train reads one source: this store, "
                f"{'the capture section' if store is not None else 'online data'}; drop one of them"
            )
        store = Path(need_path("train", "store", tsec.pop("store")))
        store_inputs = [str(store / "manifest.json")]  # a server appending shards rewrites it: train reruns
    if store is not None and online:
        raise DraftsmithError(
            f"{_where(path, 'train', 'online')}: with a capture section train reads its store; drop one of them"
        )
    if store is None and not online:
        raise DraftsmithError(
            f"{_where(path, 'train', 'online')}: without a capture section (or a train.store) train must run "
            "online (online: true, data: ...)"
        )
    if online:
        if "data" not in tsec and data_after_regen:
            tsec["data"] = data_after_regen
        if tsec.get("data") != data_after_regen:
            need_path("train", "data", tsec.get("data"))
    init = []  # the drafter train starts from: its config and weights files join the train stage's fingerprint
    if tsec.get("init_from") is not None:
        root = Path(need_path("train", "init_from", tsec["init_from"]))
        init = [str(root / "config.json")] + sorted(str(f) for f in root.glob("*.safetensors"))
    train_dir = run / "train"
    argv = ["--target", target, "--out", str(train_dir)]
    if store is not None:
        argv += ["--store", str(store)]
    argv += _argv_for(path, "train", tsec, _command("train"))
    inputs = ([str(tsec["data"])] if online else []) + store_inputs + init
    stages.append(Stage("train", "train", argv, train_dir, inputs=inputs))
    drafter = train_dir / "final"

    if norm.get("eval") is not None:
        sec = section("eval")
        extra = sec.get("drafters") or {}
        if not isinstance(extra, dict):
            raise DraftsmithError(f"{_where(path, 'eval', 'drafters')}: expected a mapping of label: drafter dir")
        need_path("eval", "prompts", sec.get("prompts"))
        flags = _argv_for(path, "eval", sec, _command("eval"), skip=EXTRA_FIELDS["eval"])
        drafters = {"trained": str(drafter)}
        for label, d in extra.items():
            if not str(label).replace("-", "").replace("_", "").isalnum() or label == "trained":
                raise DraftsmithError(
                    f"{_where(path, 'eval', f'drafters.{label}')}: labels are letters, digits, "
                    "'-' and '_' ('trained' is the drafter of this run)"
                )
            need_path("eval", f"drafters.{label}", d)
            drafters[str(label)] = str(d)
        for label, d in drafters.items():
            out = run / "eval" / label
            stages.append(
                Stage(
                    f"eval:{label}",
                    "eval",
                    ["--target", target, "--drafter", d, "--out", str(out)] + flags,
                    out,
                    inputs=[sec["prompts"]] + ([d + "/config.json"] if label != "trained" else []),
                )
            )

    if norm.get("export") is not None:
        sec = section("export")
        formats = sec.get("formats") or ["sglang", "vllm"]
        if isinstance(formats, str):
            formats = [formats]
        for f in formats:
            if f not in EXPORT_FORMATS:
                raise DraftsmithError(
                    f"{_where(path, 'export', 'formats')}: unknown format {f!r} (choose from "
                    f"{', '.join(EXPORT_FORMATS)})"
                )
        flags = _argv_for(path, "export", sec, _command("export"), skip=EXTRA_FIELDS["export"])
        for f in formats:
            out = run / "export" / f
            stages.append(
                Stage(
                    f"export:{f}",
                    "export",
                    [str(drafter), "--format", f, "--out", str(out), "--target", target] + flags,
                    out,
                )
            )

    for st in stages:
        _dry_parse(path, st.name.split(":")[0], st.command, st.argv)
    _fingerprint(stages)
    return PipelinePlan(config_path, norm, target, run, stages, threads)


def _file_stamp(p: str) -> Any:
    q = Path(p)
    if q.is_file():
        s = q.stat()
        return [str(q), s.st_size, s.st_mtime_ns]
    return [str(q)]  # a directory of sources: its path (listing every file would cost more than it protects)


def _fingerprint(stages: list[Stage]) -> None:
    """Each stage's fingerprint covers its own command line, its input files and every earlier stage's
    fingerprint (so a change reruns the stage and all after it)."""
    prev = ""
    produced = {str(o.output) for o in stages}
    for st in stages:
        # a file an earlier stage writes is covered by that stage's fingerprint (its mtime changes on every rerun)
        stamps = [_file_stamp(i) for i in st.inputs if i not in produced]
        blob = json.dumps({"command": st.command, "argv": st.argv, "inputs": stamps, "before": prev}, sort_keys=True)
        st.fingerprint = hashlib.sha256(blob.encode()).hexdigest()[:16]
        # eval and export stages of one run do not depend on each other: they chain on train's fingerprint
        if not st.name.startswith(("eval:", "export:")):
            prev = st.fingerprint


# --------------------------------------------------------------------------------------------------- running
def _record_path(run: Path, st: Stage) -> Path:
    return run / ".pipeline" / (st.name.replace(":", "-") + ".json")


def _invoke(command: str, argv: list[str]) -> None:
    """Run `draftsmith COMMAND ARGV` in this process; errors come back as DraftsmithError."""
    from draftsmith.cli import app  # circular at module level: draftsmith.cli imports pipeline.cli, which imports this

    group = typer.main.get_command(app)
    try:
        rc = group.main(args=[command] + list(argv), prog_name="draftsmith", standalone_mode=False)
    except click.UsageError as e:
        raise DraftsmithError(f"draftsmith {command}: {' '.join(e.format_message().split())}") from None
    except click.exceptions.Exit as e:
        rc = e.exit_code
    except SystemExit as e:
        rc = e.code
    if rc not in (None, 0):
        raise DraftsmithError(f"draftsmith {command} exited with status {rc}")


def _output_present(st: Stage) -> bool:
    o = st.output
    if st.command == "regenerate":
        return o.is_file()
    if st.command == "capture":
        return (o / "manifest.json").is_file()
    if st.command == "train":
        return (o / "final" / "config.json").is_file()
    if st.command == "eval":
        return (o / "eval.json").is_file()
    return o.is_dir() and any(o.iterdir())


def _remove_output(st: Stage) -> None:
    o = st.output
    if st.command == "regenerate":
        for p in (o, Path(str(o) + ".progress.json")):
            if p.exists():
                p.unlink()
    elif o.exists():
        shutil.rmtree(o)


def decide(p: PipelinePlan) -> list[str]:
    """Each stage's fate from its record in RUN/.pipeline: 'up to date' (skip), 'resume' (interrupted with the same
    settings), 'changed' or 'new' (run from scratch). A rerun stage changes the fingerprints of those after it."""
    for st in p.stages:
        rec_path = _record_path(p.run_dir, st)
        rec = read_json(rec_path, "pipeline stage record") if rec_path.is_file() else None
        if rec and rec.get("fingerprint") == st.fingerprint and rec.get("done") and _output_present(st):
            st.status = "up to date"
            st.seconds = float(rec.get("seconds") or 0.0)  # the run that produced the output
        elif rec and rec.get("fingerprint") == st.fingerprint and not rec.get("done"):
            st.status = "resume"
        else:
            st.status = "changed" if rec else "new"
    return [st.status for st in p.stages]


def run_pipeline(p: PipelinePlan, log: Callable[[str], None] = print, echo_table: bool = True) -> dict:
    """Run (or skip) every stage of the plan, then write RUN/report.md. Returns the report's data."""
    if p.threads:
        import torch  # torch-free --help (pipeline.cli imports this module)

        torch.set_num_threads(p.threads)
    p.run_dir.mkdir(parents=True, exist_ok=True)
    (p.run_dir / ".pipeline").mkdir(exist_ok=True)
    shutil.copyfile(p.config_path, p.run_dir / "pipeline.yaml") if Path(p.config_path).is_file() else None
    n = len(p.stages)
    t_all = time.perf_counter()
    decide(p)
    if echo_table:
        log(f"pipeline {p.config_path} -> {p.run_dir}")
        for i, st in enumerate(p.stages, 1):
            log(f"  [{i}/{n}] {st.name:<18} {st.status}")
    for i, st in enumerate(p.stages, 1):
        head = f"[{i}/{n}] {st.name}"
        if st.status == "up to date":
            log(f"{head}: skipped (settings unchanged, output present)")
            st.status = "skipped"
            continue
        argv = list(st.argv)
        if st.status == "resume":
            if st.command == "train" and st.output.is_dir():
                argv.append("--resume")
            elif st.command in ("eval", "export"):
                _remove_output(st)
        elif st.status == "changed":  # this pipeline wrote it with other settings: start that stage over
            _remove_output(st)
        # "new" (no record): whatever is there was not made by this pipeline (e.g. a store captured under
        # torchrun): never removed; the command itself resumes it, or refuses it naming the setting that differs
        rec_path = _record_path(p.run_dir, st)
        atomic_write_json(rec_path, {"stage": st.name, "fingerprint": st.fingerprint, "argv": argv, "done": False})
        log(f"{head}: draftsmith {st.command} {' '.join(_quote(a) for a in argv)}")
        t0 = time.perf_counter()
        _invoke(st.command, argv)
        st.seconds = time.perf_counter() - t0
        atomic_write_json(
            rec_path,
            {
                "stage": st.name,
                "fingerprint": st.fingerprint,
                "argv": argv,
                "done": True,
                "seconds": round(st.seconds, 2),
            },
        )
        st.status = "done"
        log(f"{head}: done in {st.seconds:.1f} s")

    data = write_report(p)
    data["wall_s"] = time.perf_counter() - t_all
    log(f"report: {p.run_dir / 'report.md'}")
    return data


def _quote(a: str) -> str:
    return shlex.quote(a)


def main_pipeline(config: str, log=None) -> dict:
    log = log or (lambda s: print(s, file=sys.stderr))
    return run_pipeline(plan(config), log=log)
