"""doctor's terminal report and its PNG of acceptance by position."""

from __future__ import annotations

import io
from pathlib import Path

from draftsmith.common.io import atomic_file


def format_report(report: dict) -> str:
    lines = ["Static checks"]
    for c in report["checks"]:
        lines.append(f"  {'✔' if c['ok'] else '✘'} {c['name']}: {c['detail']}")
    K = report["draft_tokens"]
    lines.append("")
    lines.append(
        f"Measured (greedy chain, K={K}, {report['prompts']} prompts x {report['max_new_tokens']} new tokens, "
        f"{report['rounds']} rounds{', chat template' if report.get('chat_template') else ''})"
    )
    head = f"  {'setting':<52} {'fault':<22} {'accept':>7} {'τ':>6}  ≥i accepted (i=1..{K})"
    lines.append(head)
    lines.append("  " + "-" * (len(head) - 2))

    def row(label, fault, rate, tau, per):
        per_s = " ".join(f"{x:.2f}" for x in per)
        return f"  {label[:52]:<52} {fault or '':<22} {rate:>7.3f} {tau:>6.2f}  {per_s}"

    lines.append(row("as configured", "", report["acceptance_rate"], report["tau"], report["p_at_least"]))
    for v in sorted(report["variants"], key=lambda v: -v["acceptance_rate"]):
        lines.append(row(v["label"], v["fault"], v["acceptance_rate"], v["tau"], v["p_at_least"]))
    lines.append("")
    if report["likely_faults"]:
        lines.append("Likely faults")
        for f in report["likely_faults"]:
            lines.append(
                f"  ✘ {f['fault']}: acceptance {f['acceptance_rate']:.3f} -> "
                f"{f['variant_acceptance_rate']:.3f} "
                f"with {f['variant']} (noise between prompt halves {f['noise']:.3f})"
            )
            lines.append(f"    fix: {f['fix']}")
    else:
        lines.append("No likely fault: no variant accepts clearly more than the configuration.")
        for s in report.get("suggestions", []):
            lines.append(f"  - {s}")
    if report.get("plot"):
        lines.append(f"\nplot: {report['plot']}")
    return "\n".join(lines)


def write_plot(report: dict, path: str | Path) -> str | None:
    """acceptance by position (share of rounds accepting >= i drafts) as configured and for the best variant."""
    try:
        import matplotlib  # optional dependency (the plot extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional dependency (the plot extra)
    except ImportError:
        return None

    K = report["draft_tokens"]
    xs = list(range(1, K + 1))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, report["p_at_least"], marker="o", label=f"as configured (rate {report['acceptance_rate']:.2f})")
    best = report.get("best_variant")
    if report["likely_faults"]:
        f = report["likely_faults"][0]
        v = next((v for v in report["variants"] if v["label"] == f["variant"]), None)
        if v is not None:
            best = {"label": v["label"], "acceptance_rate": v["acceptance_rate"], "p_at_least": v["p_at_least"]}
    if best is not None:
        ax.plot(
            xs, best["p_at_least"], marker="x", ls="--", label=f"{best['label']} (rate {best['acceptance_rate']:.2f})"
        )
    ax.set_xlabel("draft position i")
    ax.set_ylabel("share of rounds accepting >= i drafts")
    ax.set_ylim(0, 1.05)
    ax.set_xticks(xs)
    ax.legend(fontsize=8)
    ax.set_title("draftsmith doctor: acceptance by position")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=100, format="png")
    plt.close(fig)
    with atomic_file(path) as f:
        f.write(buf.getvalue())
    return str(path)
