"""`draftsmith demo`: the pipeline on the bundled demo target (CPU), then τ and the measured speedup.

The recipe is examples/pycode-tiny-demo.yaml: a drafter trained for a few minutes (online: the target runs in the
loop over this Python's own standard-library sources, so there is no store to write), evaluated next to the
bundled drafter (assets/pycode-tiny-drafter, trained on a GPU with examples/pycode-tiny-bundled.yaml), each
against the engine's own plain decoding of the same prompts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from draftsmith.common.errors import DraftsmithError
from draftsmith.pipeline.runner import load_config, plan, run_pipeline

REPO = Path(__file__).resolve().parents[2]
DEFAULT_RECIPE = REPO / "examples" / "pycode-tiny-demo.yaml"
BUNDLED_DRAFTER = REPO / "assets" / "pycode-tiny-drafter"
LABELS = {
    "trained": "trained here, in this demo's few minutes on CPU",
    "bundled": "bundled (assets/pycode-tiny-drafter: trained on a GPU with examples/pycode-tiny-bundled.yaml)",
}


@contextlib.contextmanager
def _cwd(path: Path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def run_demo(
    out: str = "runs/demo", config: Optional[str] = None, fresh: bool = False, log: Callable[[str], None] = print
) -> dict:
    recipe = Path(config).resolve() if config else DEFAULT_RECIPE
    if not recipe.is_file():
        raise DraftsmithError(f"{recipe}: demo recipe not found (the demo runs from a checkout of the repository)")
    run_dir = Path(out).resolve()
    if fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    with _cwd(REPO):  # the recipe's paths (assets/...) are relative to the repository
        cfg = load_config(str(recipe))
        drafters = (cfg.get("eval") or {}).get("drafters") or {}
        missing = [k for k, v in drafters.items() if not Path(v).is_dir()]
        overrides = {"out": str(run_dir)}
        if missing:
            log(f"note: {', '.join(drafters[k] for k in missing)} not present: evaluating the trained drafter only")
            ev = dict(cfg["eval"])
            ev["drafters"] = {k: v for k, v in drafters.items() if k not in missing}
            overrides["eval"] = ev
        p = plan(str(recipe), overrides=overrides)
        data = run_pipeline(p, log=log)
    _print_summary(data, log)
    return data


def _print_summary(data: dict, log) -> None:
    rows = []
    for label, evals in data.get("eval", {}).items():
        for r in evals:
            rows.append((label, r))
    if not rows:
        return
    log("")
    log(
        f"speculative decoding on this CPU (chain of {rows[0][1].get('draft_tokens')} draft tokens, greedy) vs the "
        "engine's plain decoding:"
    )
    for label, r in rows:
        same = r.get("greedy_mismatches")
        eq = "output identical to plain decoding" if same == 0 else (f"{same} prompts differ" if same else "")
        tau = f"{r['tau']:.2f}" if r.get("tau") is not None else "–"
        sp = f"{r['speedup']:.2f}x" if r.get("speedup") is not None else "–"
        ps = r.get("speedup_passes")
        if ps and None not in ps:  # the median of several timed passes: say so, with the spread
            sp += f" (median of {len(ps)} passes, {min(ps):.2f}-{max(ps):.2f})"
        log(f"  {label:<8} tau {tau:>5}   speedup {sp:>6}   {eq}")
        log(f"           {LABELS.get(label, label)}")
    log(f"full report: {Path(data['run']) / 'report.md'}")
