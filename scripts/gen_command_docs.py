"""Write docs/commands/<command>.md: one page per `draftsmith` command, its flags read from the CLI itself.

Each page: what the command reads and writes (written here, by hand), then every flag with its help text, grouped
by purpose: the command's own help panels where it has them (the schema-built train/capture), else the groups
below. Rerun after changing a command's flags or help:  python scripts/gen_command_docs.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
OUT = REPO / "docs" / "commands"

# what each command reads and writes, and where to read more
INTRO = {
    "inspect": (
        "A target or a drafter directory.",
        "Nothing (prints).",
        "Architecture, layers, hidden size, vocab and the default aux layers in both id conventions for a "
        "target; format, sizes, draft vocab, aux layers and whether it fits `--target` for a drafter.",
    ),
    "regenerate": (
        "`--target` (needs a chat template) and `--data`: JSONL of ShareGPT `conversations` or OpenAI "
        "`messages` records.",
        "`--out`: the same records, every assistant turn replaced by the target's own answer, plus a "
        "`provenance` field (target, config hash, sampling settings, draftsmith version, source "
        "FILE:LINE, answers cut at --max-new-tokens); `OUT.progress.json` (settings + records done).",
        "System, user and tool turns keep their exact strings; a later assistant turn is generated after "
        "the earlier ones are already the target's. Batched `generate()` with left padding (static KV "
        "cache on CUDA). Resume: rerun the same command; the output is cut back to the last record the "
        "progress file vouches for, so a kill -9 repeats or loses nothing. Another setting on the same "
        "--out is refused, naming it. Bad records: `--on-bad error|skip`, as capture.",
    ),
    "capture": (
        "`--target`, `--data` (JSONL with conversations / messages / text, or a directory of source files).",
        "`--out STORE`: the hidden-state store (see [store-format.md](../store-format.md)).",
        "Runs the target over the data with forward hooks and stores the aux layers' and the last layer's "
        "hidden states, checksummed and resumable (rerun the same command after any interruption).",
    ),
    "store": (
        "A store directory.",
        "`verify`: nothing; `info`: nothing; `export`: the `speculators` 0.9 offline "
        "layout (see [speculators-format.md](../speculators-format.md)).",
        "`verify` checks every shard's sha256, `info` summarizes, `export` converts.",
    ),
    "prune-vocab": (
        "A trained drafter (any layout draftsmith reads), `--target` (its tokenizer counts `--data`), and text "
        "to count tokens on (`--data`, read as `train --data` reads it) or a capture store (`--store`, its "
        "`token_counts`).",
        "`--out DIR`: the drafter in draftsmith's layout with `--draft-vocab-size` rows (lm_head rows, `d2t`, "
        "`t2d`); prints the counted tokens' coverage before and after.",
        "Keeps the drafter's N most frequent draft tokens; nothing is retrained and decoding stays lossless (the "
        "target decides every token). Where the draft head is what a round pays for (a small target, a CPU: the "
        "head is read once per draft token), a smaller head is cheaper, and cutting a head trained large kept "
        "more acceptance than training a small one (the bundled demo drafter: 8,192 rows cut to 4,096 kept τ "
        "3.62 of 3.73 at K=4; trained at 4,096: 3.44). See docs/LOG.md.",
    ),
    "train": (
        "`--target`, and `--store` (offline) or `--online --data` (the target runs in the loop).",
        "`--out RUN`: `checkpoints/`, `final/` (the drafter, see [checkpoint-formats.md]"
        "(../checkpoint-formats.md)), `metrics.jsonl`, `training.png`, `train_config.json`.",
        "The EAGLE-3 drafter with training-time test. `--resume` continues after any interruption with the "
        "same loss sequence. Settings can come from `--config FILE.yaml` ([config.md](../config.md)).",
    ),
    "generate": (
        "`--target`, optionally `--drafter`.",
        "Nothing (prints the text, or one JSON object with --json).",
        "Speculative decoding at batch size 1: greedy output equals plain greedy decoding token for token; "
        "sampling is lossless.",
    ),
    "eval": (
        "`--target`, `--drafter`, `--prompts` (EAGLE question JSONL, JSONL with text/messages, or a text file).",
        "`--out DIR`: `eval.json`, `acceptance_by_position.png`, `speedup.png`.",
        "τ (tokens per target forward), acceptance rate, acceptance by position and the speedup over the same "
        "engine's plain decoding on the same prompts, per temperature; greedy runs also count prompts whose "
        "output differs from plain decoding (0 = lossless).",
    ),
    "export": (
        "A drafter in any layout draftsmith reads.",
        "`--out DIR` in the layout of `--format`.",
        "Prints the command that serves it. Details: [export.md](../export.md).",
    ),
    "pipeline": (
        "CONFIG.yaml (see [pipeline.md](../pipeline.md) and `examples/`).",
        "`RUN/`: `regenerated.jsonl`, `store/`, `train/`, `eval/LABEL/`, `export/FORMAT/`, `report.md`, "
        "`report.json`, `pipeline.yaml` (the config), `.pipeline/STAGE.json` (what each stage ran).",
        "regenerate → capture (or online training) → train → eval → export. The config is checked against "
        "each command's flags before anything runs; unchanged stages are skipped, a changed one reruns "
        "with everything after it.",
    ),
    "demo": (
        "`examples/pycode-tiny-demo.yaml`, `assets/pycode-tiny`, `assets/pycode-tiny-drafter` (when present), "
        "this Python's standard-library sources.",
        "`runs/demo/` (a pipeline run directory).",
        "The README's first command (`bash scripts/demo.sh` = setup + this). Trains a drafter for a few "
        "minutes on CPU and evaluates it next to the bundled one, both against plain decoding.",
    ),
    "serve": (
        "`--target`, optionally `--drafter`.",
        "Nothing on disk; serves HTTP.",
        "An OpenAI-compatible server over the speculative decoder (needs the `serve` extra).",
    ),
    "bench-endpoint": (
        "A running OpenAI-compatible endpoint and prompts.",
        "A report of latency and throughput.",
        "Load-tests an endpoint (e.g. `draftsmith serve`, SGLang, vLLM).",
    ),
    "doctor": (
        "`--target`, `--drafter`, optionally prompts or a store.",
        "Nothing (prints; `--json`, `--plot`).",
        "Measures the drafter as configured and under common mis-wirings (aux ids off by one, norm, d2t "
        "...) and names the one that accepts clearly more. Details: [doctor.md](../doctor.md).",
    ),
}

# purpose groups for commands without help panels: flag -> group (first match of the listed flags)
GROUPS = {
    "regenerate": {
        "Inputs and outputs": ["--target", "--data", "--out", "--max-samples", "--on-bad"],
        "Sampling": ["--max-new-tokens", "--temperature", "--top-p", "--seed"],
        "Runtime": ["--batch-size", "--device", "--dtype", "--cache", "--quiet"],
    },
    "prune-vocab": {
        "Inputs and outputs": ["--target", "--out", "--save-dtype", "--overwrite"],
        "Token counts": ["--data", "--glob", "--max-samples", "--on-bad", "--store"],
        "Pruning": ["--draft-vocab-size"],
    },
    "generate": {
        "Inputs": ["--target", "--drafter", "--prompt", "--chat", "--stop"],
        "Sampling": ["--max-new-tokens", "--temperature", "--top-p", "--top-k", "--seed"],
        "Speculation": ["--draft-tokens", "--tree", "--top-k-draft", "--depth", "--tree-tokens", "--plain"],
        "Output": ["--json"],
    },
    "eval": {
        "Inputs": ["--target", "--drafter", "--prompts", "--chat", "--limit"],
        "Sampling": ["--max-new-tokens", "--temperatures", "--top-p", "--top-k", "--seed"],
        "Speculation": [
            "--draft-tokens",
            "--tree",
            "--top-k-draft",
            "--depth",
            "--tree-tokens",
            "--tune",
            "--tune-prompts",
            "--save-tuning",
            "--tuning",
        ],
        "Output": ["--out", "--json"],
    },
    "export": {
        "Inputs and outputs": ["drafter", "--format", "--out", "--overwrite", "--target"],
        "Weights and serving": ["--dtype", "--speculative-tokens"],
    },
    "pipeline": {"Inputs": ["config", "--out", "--check"]},
    "demo": {"Inputs": ["--out", "--config", "--fresh"]},
}
RUNTIME = "Runtime"


def _strip(s: str) -> str:
    return re.sub(r"\s+", " ", (s or "").replace("|", "\\|")).strip()


def _flag_cell(p) -> str:
    if p.param_type_name == "argument":
        return f"`{p.name.upper()}`"
    names = list(p.opts) + list(getattr(p, "secondary_opts", []) or [])
    return " ".join(f"`{n}`" for n in names)


def _default(p) -> str:
    if p.param_type_name == "argument" or getattr(p, "is_flag", False) and p.default in (False, None):
        return ""
    d = p.default
    if d is None or (isinstance(d, (list, tuple)) and not d) or callable(d):
        return ""
    return f"`{d}`"


def _group_of(cmd_name: str, p) -> str:
    panel = getattr(p, "rich_help_panel", None)
    if panel:
        return panel
    flags = set(p.opts) | set(getattr(p, "secondary_opts", []) or []) | {p.name}
    for group, members in GROUPS.get(cmd_name, {}).items():
        if flags & set(members):
            return group
    return RUNTIME if GROUPS.get(cmd_name) else "Options"


def page(name: str, cmd, sub: str = "") -> str:
    full = f"draftsmith {name}" + (f" {sub}" if sub else "")
    reads, writes, what = INTRO.get(name, ("", "", ""))
    doc = (cmd.help or "").strip().split("\n\n")[0].replace("\n", " ")
    lines = [f"# `{full}`", "", doc, ""]
    if not sub:
        lines += [f"- **Reads:** {reads}", f"- **Writes:** {writes}", "", what, ""] if reads else []
    groups: dict[str, list] = {}
    for p in cmd.params:
        if p.name in ("help",) or getattr(p, "hidden", False):
            continue
        groups.setdefault(_group_of(name, p), []).append(p)
    for g, params in groups.items():
        lines += [f"## {g}", "", "| flag | default | what |", "|---|---|---|"]
        for p in params:
            lines.append(f"| {_flag_cell(p)} | {_default(p)} | {_strip(getattr(p, 'help', '') or '')} |")
        lines.append("")
    return "\n".join(lines)


def render_all() -> dict[str, str]:
    import typer.main

    from draftsmith.cli import app

    group = typer.main.get_command(app)
    pages = {}
    index = [
        "# Commands",
        "",
        "One page per command: what it reads and writes, and its flags grouped by purpose "
        "(generated from the CLI by `scripts/gen_command_docs.py`).",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):  # a group: one page with a section per subcommand
            parts = [f"# `draftsmith {name}`", ""]
            reads, writes, what = INTRO.get(name, ("", "", ""))
            if reads:
                parts += [f"- **Reads:** {reads}", f"- **Writes:** {writes}", "", what, ""]
            for sname, scmd in cmd.commands.items():
                parts.append(page(name, scmd, sname).replace("# `", "## `", 1).replace("\n## ", "\n### "))
            pages[name] = "\n".join(parts)
        else:
            pages[name] = page(name, cmd)
        summary = _strip((cmd.help or cmd.short_help or "").strip().split("\n\n")[0])
        index.append(f"| [`draftsmith {name}`]({name}.md) | {summary} |")
    pages["README"] = "\n".join(index) + "\n"
    return {k: v.rstrip() + "\n" for k, v in pages.items()}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in render_all().items():
        (OUT / f"{name}.md").write_text(text)
        print(f"wrote {OUT / name}.md")


if __name__ == "__main__":
    main()
