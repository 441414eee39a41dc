"""RUN/report.md of a pipeline run: settings, τ, acceptance, speedup, training curves, serve commands."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from draftsmith.common.io import atomic_write_bytes, atomic_write_json
from draftsmith.export import serve_command


def _passes(ps) -> str:
    """A speedup timed over several passes is their median: ' (median of N, min-max)'."""
    return f" (median of {len(ps)}, {min(ps):.2f}-{max(ps):.2f})" if ps and None not in ps else ""


def eval_summary(eval_json: Path) -> list[dict]:
    """One row per temperature of an eval.json: τ, acceptance rate, per-position acceptance, speedup."""
    rep = json.loads(Path(eval_json).read_text())
    rows = []
    for temp, e in rep.get("temperatures", {}).items():
        s = e.get("speculative", {})
        rows.append(
            {
                "temperature": temp,
                "tau": s.get("tau"),
                "acceptance_rate": s.get("acceptance_rate"),
                "p_at_least": s.get("p_at_least") or [],
                "conditional": s.get("conditional") or [],
                "speedup": e.get("speedup"),
                "speedup_passes": e.get("speedup_passes"),
                "spec_tok_s": s.get("tokens_per_s"),
                "plain_tok_s": (e.get("plain") or {}).get("tokens_per_s"),
                "greedy_mismatches": e.get("greedy_mismatches"),
                "prompts": s.get("prompts"),
                "new_tokens": s.get("new_tokens"),
            }
        )
    mode = rep.get("mode", {})
    for r in rows:
        r["mode"] = mode.get("kind", "chain")
        r["draft_tokens"] = mode.get("draft_tokens")
        r["device"] = rep.get("device")
    return rows


def _f(v, fmt="{:.2f}") -> str:
    return "–" if v is None else fmt.format(v)


def _last_metrics(metrics: Path) -> dict:
    last: dict = {}
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            for k, v in rec.items():
                last[k] = v
    return last


def write_report(p) -> dict:
    """Write p.run_dir/report.md from the stages' outputs; return its data (also RUN/report.json)."""
    run = p.run_dir
    lines = [
        f"# draftsmith pipeline report: {run}",
        "",
        f"- config: `{p.config_path}` (copied to `{run / 'pipeline.yaml'}`)",
        f"- target: `{p.target}`",
        "",
    ]
    lines += ["## Stages", "", "| stage | status | seconds | command |", "|---|---|---|---|"]
    for st in p.stages:
        cmd = "draftsmith " + st.command + " " + " ".join(st.argv)
        lines.append(f"| {st.name} | {st.status} | {st.seconds:.1f} | `{cmd}` |")
    lines += ["", "## Settings", "", "```yaml", yaml.safe_dump(p.config, sort_keys=False).rstrip(), "```", ""]
    data: dict = {
        "run": str(run),
        "target": p.target,
        "stages": [{"name": s.name, "status": s.status, "seconds": s.seconds, "argv": s.argv} for s in p.stages],
        "eval": {},
    }
    evals = [s for s in p.stages if s.command == "eval"]
    if evals:
        lines += [
            "## Speculative decoding",
            "",
            "τ: tokens per target forward (accepted drafts + 1); speedup: speculative tokens/s over the same "
            "engine's plain decoding on the same prompts; greedy mismatches: prompts whose greedy output "
            "differs from plain decoding (0 = lossless).",
            "",
            "| drafter | T | τ | acceptance rate | speedup | spec tok/s | plain tok/s | greedy mismatches |",
            "|---|---|---|---|---|---|---|---|",
        ]
        pos_lines = []
        for st in evals:
            label = st.name.split(":", 1)[1]
            ej = st.output / "eval.json"
            if not ej.is_file():
                continue
            rows = eval_summary(ej)
            data["eval"][label] = rows
            for r in rows:
                lines.append(
                    f"| {label} | {r['temperature']} | {_f(r['tau'])} | {_f(r['acceptance_rate'])} | "
                    f"{_f(r['speedup'], '{:.2f}×')}{_passes(r.get('speedup_passes'))} | {_f(r['spec_tok_s'], '{:.1f}')} | "
                    f"{_f(r['plain_tok_s'], '{:.1f}')} | {r['greedy_mismatches'] if r['greedy_mismatches'] is not None else '–'} |"
                )
                pos_lines.append(
                    f"| {label} | {r['temperature']} | " + " | ".join(f"{x:.2f}" for x in r["p_at_least"]) + " |"
                )
        if pos_lines:
            k = max(len(r["p_at_least"]) for rows in data["eval"].values() for r in rows)
            lines += [
                "",
                "Acceptance by position (share of rounds that accepted at least i drafts):",
                "",
                "| drafter | T | " + " | ".join(f"≥{i}" for i in range(1, k + 1)) + " |",
                "|---|---|" + "---|" * k,
            ] + pos_lines
        for st in evals:
            for png in ("acceptance_by_position.png", "speedup.png"):
                if (st.output / png).is_file():
                    lines.append(f"\n![{st.name} {png}]({(st.output / png).relative_to(run)})")
        lines.append("")
    train = next((s for s in p.stages if s.command == "train"), None)
    if train is not None:
        last = _last_metrics(train.output / "metrics.jsonl")
        lines += ["## Training", "", f"- run directory: `{train.output}` (drafter: `{train.output / 'final'}`)"]
        keys = [k for k in ("step", "loss", "tau_sim", "eval_tau_sim", "tokens") if k in last]
        if keys:
            lines.append(
                "- last logged: "
                + ", ".join(f"{k} = {last[k]:.4g}" if isinstance(last[k], float) else f"{k} = {last[k]}" for k in keys)
            )
        data["train_last"] = last
        png = train.output / "training.png"
        if png.is_file():
            lines += ["", f"![training curves]({png.relative_to(run)})"]
        else:
            lines.append("- training curves: `training.png` was not written (matplotlib missing or --no-plot)")
        lines.append("")
    exports = [s for s in p.stages if s.command == "export"]
    if exports:
        lines += ["## Serving", ""]
        spec = 3
        if "--speculative-tokens" in exports[0].argv:
            spec = int(exports[0].argv[exports[0].argv.index("--speculative-tokens") + 1])
        data["serve"] = {}
        for st in exports:
            fmt = st.name.split(":", 1)[1]
            cmd = serve_command(fmt, st.output.resolve(), Path(p.target).resolve(), speculative_tokens=spec)
            data["serve"][fmt] = cmd
            lines += [f"{fmt} (`{st.output}`):", "", "```bash", cmd, "```", ""]
    atomic_write_bytes(run / "report.md", ("\n".join(lines) + "\n").encode())
    atomic_write_json(run / "report.json", data)
    return data
