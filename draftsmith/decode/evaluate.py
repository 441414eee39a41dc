"""`draftsmith eval`: what a drafter is worth — τ, acceptance, per-position acceptance, speedup.

Definitions (also written into the JSON):
- τ (acceptance length): tokens emitted per target forward in the decode rounds, bonus token included.
- acceptance rate: accepted draft tokens ÷ proposed draft tokens. A chain proposes K per round; a tree
  proposes `depth` per round (the most one accepted path can hold), so tree rates are comparable to a
  chain of K = depth.
- per-position acceptance: `p_at_least[i]` = share of rounds that accepted >= i draft tokens (i = 1..K);
  `conditional[i]` = p_at_least[i] ÷ p_at_least[i-1] (EAGLE's α_i).
- greedy_divergences (T=0): prompts whose speculative output equals plain decoding, and those that differ at a
  near tie (the plain step's top-2 logit gap at the first differing token <= epsilon, a few bf16 units in the last
  place of the logits' magnitude: rounding) or at a real margin (a bug); see draftsmith.decode.certificate.
- tokens/s: new tokens ÷ wall time (prefill included) summed over prompts; speculative and plain decoding
  run in the same engine (same forward, same CUDA-graph policy), so the ratio is an honest speedup.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from draftsmith.common.errors import DraftsmithError
from draftsmith.decode.engine import DecodeMode, SpeculativeDecoder
from draftsmith.decode.sampling import SamplingParams
from draftsmith.decode.setup import cluster_gemm_setting

PROMPT_RULE = (
    "Prompts go through the tokenizer's chat template (as one user message, generation prompt added) "
    "when it has one, else they are tokenized as text; --raw always uses the text as is, --chat requires "
    "a template. The same rule for generate and eval, every prompts-file format."
)
_PROMPT_KEYS = ("conversations", "messages", "turns", "text")


def use_chat_template(tokenizer, chat: bool | None, where: str = "--chat") -> bool:
    """The one chat/raw rule (PROMPT_RULE): chat None = the template when the tokenizer has one."""
    has = bool(getattr(tokenizer, "chat_template", None))
    if chat and not has:
        raise DraftsmithError(f"{where}: the tokenizer has no chat template (use --raw, or leave both off)")
    return has if chat is None else bool(chat)


def read_prompts_text(path: str) -> str:
    """The prompts file as text; a missing, binary or non-UTF-8 file is one DraftsmithError line."""
    p = Path(path)
    if not p.is_file():
        raise DraftsmithError(f"{path}: no such prompts file")
    data = p.read_bytes()
    nul = data.find(b"\x00")
    if nul >= 0:
        raise DraftsmithError(f"{path}: not a text prompts file (a NUL byte at offset {nul}: binary data)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise DraftsmithError(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x}): a prompts file is "
            "JSONL or one prompt per line"
        ) from None


def _as_records(text: str, path: str) -> list[str]:
    """The file's lines as JSONL records load_prompts reads, line for line (blank lines kept, so FILE:LINE in its
    errors stays right): {"prompt": ...} records (vLLM's and many datasets' format) become {"turns": [...]}; a
    plain-text file's lines (a literal backslash-n is a newline) become {"text": ...}."""
    lines = text.splitlines()
    first = next((ln.strip() for ln in lines if ln.strip()), "")
    out = []
    if first.startswith("{"):
        for i, line in enumerate(lines, 1):
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    out.append(line)  # load_prompts reports it with the line number
                    continue
                if isinstance(obj, dict) and "prompt" in obj and not any(k in obj for k in _PROMPT_KEYS):
                    if not isinstance(obj["prompt"], str):
                        raise DraftsmithError(
                            f"{path}:{i}: field 'prompt': expected a string, got {type(obj['prompt']).__name__}"
                        )
                    line = json.dumps({"turns": [obj["prompt"]]})
            out.append(line)
        return out
    return [json.dumps({"text": ln.replace("\\n", "\n")}) if ln.strip() else "" for ln in lines]


def load_prompt_ids(path: str, tokenizer, raw: bool = False, limit: int | None = None) -> list[list[int]]:
    """Token ids of each prompt in `path`: JSONL with turns (EAGLE questions) / text / messages / conversations /
    prompt records, a JSON array of them, or a text file with one prompt per line. raw=False: the chat template
    when the tokenizer has one (PROMPT_RULE; draftsmith.data.load_prompts does the rendering for every format)."""
    import tempfile

    from draftsmith.data import load_prompts

    text = read_prompts_text(path)
    if path.lower().endswith(".json") and text.lstrip().startswith("["):
        ids = load_prompts(path, tokenizer, raw=raw, limit=limit)
        return [[int(x) for x in row] for row in ids]
    with tempfile.TemporaryDirectory() as d:
        tmp = str(Path(d) / "prompts.jsonl")
        Path(tmp).write_text("\n".join(_as_records(text, path)) + "\n", encoding="utf-8")
        try:
            ids = load_prompts(tmp, tokenizer, raw=raw, limit=limit)
        except DraftsmithError as e:
            raise DraftsmithError(str(e).replace(tmp, path)) from None
    return [[int(x) for x in row] for row in ids]


def _summary(results, K: int) -> dict:
    acc = [a for r in results for a in r.accepted]
    rounds = len(acc)
    new = sum(len(r.token_ids) for r in results)
    wall = sum(r.prefill_s + r.decode_s for r in results)
    decode_s = sum(r.decode_s for r in results)
    at_least = [sum(1 for a in acc if a >= i) / max(rounds, 1) for i in range(1, K + 1)]
    cond = [at_least[0] if at_least else 0.0] + [
        at_least[i] / at_least[i - 1] if at_least[i - 1] else 0.0 for i in range(1, len(at_least))
    ]
    return {
        "prompts": len(results),
        "new_tokens": new,
        "rounds": rounds,
        "tau": (sum(acc) + rounds) / rounds if rounds else None,
        "acceptance_rate": sum(acc) / (K * rounds) if rounds and K else None,
        "p_at_least": at_least,
        "conditional": cond,
        "tokens_per_s": new / wall if wall else None,
        "wall_s": wall,
        "decode_tokens_per_s": (new - len(results)) / decode_s if decode_s else None,
    }


def run_eval(
    engine: SpeculativeDecoder,
    prompts: Sequence[Sequence[int]],
    mode: DecodeMode,
    temperatures: Sequence[float] = (0.0, 1.0),
    max_new_tokens: int = 256,
    seed: int = 0,
    top_p: float = 1.0,
    top_k: int = 0,
    progress=None,
    certificate: bool = True,
    passes: int = 1,
) -> dict:
    """Speculative vs plain decoding over prompts, per temperature. Returns a JSON-able dict.

    `passes` > 1: the prompts are timed that many times (plain and speculative back to back per prompt each time)
    and "speedup" is the median of the passes' ratios, "speedup_passes" lists them; τ, acceptance and the outputs
    are the first pass's (the others decode the same tokens). On a shared machine one pass's ratio moves by ±0.1
    (docs/LOG.md, 2026-12-01 sixth session): the median of a few is the figure to report."""
    mode.validate()
    if int(passes) < 1:
        raise DraftsmithError(f"--passes: must be >= 1, got {passes}")
    out = {
        "mode": mode.__dict__ | {"proposed_per_round": mode.max_accept},
        "max_new_tokens": max_new_tokens,
        "backend": engine.backend,
        "cuda_graphs": engine.cuda_graphs,
        "device": str(engine.device),
        "attn_impl": getattr(engine, "attn_impl", None),
        "compiled": bool(getattr(engine, "_compiled", False)),
        "kernels": getattr(getattr(engine, "runner", None), "kernels", "torch"),
        "cluster_gemm": cluster_gemm_setting(engine),
        "prefill_graphs": bool(getattr(engine, "prefill_graphs", False)),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "temperatures": {},
    }
    for temp in temperatures:
        sp = SamplingParams(temperature=float(temp), top_p=top_p, top_k=top_k)
        engine.warmup(mode, sp)
        engine.warmup(DecodeMode("plain"), sp)
        if prompts:  # one untimed pass of each path (allocator, caches, first-call overheads)
            engine.generate(prompts[0], min(8, max_new_tokens), sampling=sp, mode=mode, seed=seed)
            engine.generate(prompts[0], min(8, max_new_tokens), sampling=sp, mode=DecodeMode("plain"), seed=seed)
        # The first prefill of a new prompt length pays one-time costs that a timed pass would charge to whichever
        # path ran first -- plain, below: eagerly, kernel selection and allocator growth (the first setting's plain
        # rate ~30% low on the GPU, 2026-11-29); with `prefill_graphs`, a graph captured per (length bucket, with
        # or without the drafter, sampling) on its first use, ~50 ms (plain's captures alone lifted a 1.58x decode
        # ratio to 1.74x, 2026-12-02). One untimed prefill per new length, sampling setting and path.
        warm = engine.__dict__.setdefault("_eval_warm_lengths", set())
        for p in prompts:
            if (len(p), sp) not in warm:
                for m in (DecodeMode("plain"), mode):
                    engine.generate(p, 1, sampling=sp, mode=m, seed=seed)
                warm.add((len(p), sp))
        spec, plain = [], []
        mismatches = 0
        differing = []
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            rp = engine.generate(p, max_new_tokens, sampling=sp, mode=DecodeMode("plain"), seed=seed + i)
            rs = engine.generate(p, max_new_tokens, sampling=sp, mode=mode, seed=seed + i)
            if sp.greedy and rs.token_ids != rp.token_ids:
                mismatches += 1
                differing.append(i)
            spec.append(rs)
            plain.append(rp)
            if progress:
                progress(i + 1, len(prompts))
        s = _summary(spec, mode.max_accept)
        pl = _summary(plain, 0)
        ratio = (s["tokens_per_s"] / pl["tokens_per_s"]) if s["tokens_per_s"] and pl["tokens_per_s"] else None
        ratios = [ratio]
        for _ in range(int(passes) - 1):
            tok = {"plain": [0, 0.0], "spec": [0, 0.0]}  # [new tokens, seconds]
            for i, p in enumerate(prompts):
                for key, m in (("plain", DecodeMode("plain")), ("spec", mode)):
                    r = engine.generate(p, max_new_tokens, sampling=sp, mode=m, seed=seed + i)
                    tok[key][0] += len(r.token_ids)
                    tok[key][1] += r.prefill_s + r.decode_s
            (n_p, w_p), (n_s, w_s) = tok["plain"], tok["spec"]
            ratios.append((n_s / w_s) / (n_p / w_p) if ratio is not None and w_s and w_p and n_p else None)
        entry = {
            "speculative": s,
            "plain": {k: pl[k] for k in ("new_tokens", "tokens_per_s", "wall_s", "decode_tokens_per_s")},
            "speedup": statistics.median(ratios) if None not in ratios else ratio,
            # the same ratio without the prefill (time to first token): what a long generation tends to; on a small
            # target the eager prefill is a large share of a short one (BENCHMARKS.md 2026-12-02: 1.28x vs 1.56x)
            "decode_speedup": (s["decode_tokens_per_s"] / pl["decode_tokens_per_s"])
            if s["decode_tokens_per_s"] and pl["decode_tokens_per_s"]
            else None,
            "eval_wall_s": time.perf_counter() - t0,
        }
        if int(passes) > 1:
            entry["speedup_passes"] = ratios
        if sp.greedy:
            entry["greedy_mismatches"] = mismatches
        if sp.greedy and certificate:
            entry["greedy_divergences"], entry["greedy_divergence_details"] = _certify_all(
                engine, prompts, mode, max_new_tokens, differing
            )
        out["temperatures"][f"{float(temp):g}"] = entry
    return out


def tuned_entry(
    engine,
    prompts,
    tuned_mode: DecodeMode,
    report: dict,
    fixed_mode: DecodeMode,
    temperature: float,
    max_new_tokens: int,
    seed: int = 0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> dict:
    """eval.json's "tuned" (a contract): {"mode", "tok_s", "plain_tok_s", "speedup"} of the tuned mode over all the
    eval prompts at `temperature` (the fixed mode's run is reused when the tuner chose it; plain is its own rate)."""
    from draftsmith.decode.tuning import mode_json

    key = f"{float(temperature):g}"
    fixed = report["temperatures"][key]
    if tuned_mode.kind == "plain":
        pl = fixed["plain"]["tokens_per_s"]
        return {"mode": mode_json(tuned_mode), "tok_s": pl, "plain_tok_s": pl, "speedup": 1.0}
    if tuned_mode == fixed_mode:
        e = fixed
    else:
        e = run_eval(
            engine,
            prompts,
            tuned_mode,
            [temperature],
            max_new_tokens,
            seed=seed,
            top_p=top_p,
            top_k=top_k,
            certificate=False,
        )["temperatures"][key]
    return {
        "mode": mode_json(tuned_mode),
        "tok_s": e["speculative"]["tokens_per_s"],
        "plain_tok_s": e["plain"]["tokens_per_s"],
        "speedup": e["speedup"],
    }


def _certify_all(engine, prompts, mode, max_new_tokens: int, differing: Sequence[int]) -> tuple[dict, list]:
    """The greedy certificate (`draftsmith.decode.certificate`) of one temperature-0 result: every differing prompt
    rerun with margins recorded (untimed); prompt 0 too, for the logits' magnitude when none differs."""
    from draftsmith.decode.certificate import certify, summarize

    divs, top = [], 0.0
    for i in sorted(set(differing) | ({0} if prompts else set())):
        d, t = certify(engine, prompts[i], mode, max_new_tokens, prompt_index=i)
        top = max(top, t)
        if d is not None:
            divs.append(d)
    # a prompt that differed in the timed run but not in the rerun (or the reverse) would make the counts disagree
    # with greedy_mismatches: the rerun is what the margins describe, so its count is the one reported
    return summarize(len(prompts), divs, top, engine.dtype), [d.to_json() for d in divs]


def print_table(report: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    m = report["mode"]
    title = (
        f"{m['kind']} K={m['draft_tokens']}"
        if m["kind"] == "chain"
        else f"tree top_k={m['top_k']} depth={m['depth']} tokens={m['tree_tokens']}"
    )
    t = Table(title=f"draftsmith eval — {title} ({report['device']}, {report['backend']})")
    # the decode-only ratio gets its own column where the terminal is wide enough, else a line under the table
    wide = console.width >= 100
    cols = ("T", "τ", "accept rate", "per-position (≥i)", "spec tok/s", "plain tok/s", "speedup")
    cols += ("decode only", "greedy ok") if wide else ("greedy ok",)
    for c in cols:
        t.add_column(c, justify="right")
    for temp, e in report["temperatures"].items():
        s = e["speculative"]
        per = " ".join(f"{x:.2f}" for x in s["p_at_least"])
        ok = (
            ""
            if "greedy_mismatches" not in e
            else ("yes" if e["greedy_mismatches"] == 0 else f"{e['greedy_mismatches']} differ")
        )
        gd = e.get("greedy_divergences")
        if gd and (gd["near_tie"] or gd["real"]):
            ok += f" ({gd['near_tie']} near-tie, {gd['real']} real; ε={gd['epsilon']:.3g})"
        t.add_row(
            temp,
            _num(s["tau"]),
            _num(s["acceptance_rate"]),
            per,
            _num(s["tokens_per_s"], 1),
            _num(e["plain"]["tokens_per_s"], 1),
            _num(e["speedup"]) + "×" + _spread(e.get("speedup_passes")),
            *((_num(e.get("decode_speedup")) + "×",) if wide else ()),
            ok,
        )
    console.print(t)
    if not wide:
        console.print(
            "speedup without the prefill (decode only): "
            + ", ".join(f"{_num(e.get('decode_speedup'))}× (T={temp})" for temp, e in report["temperatures"].items())
        )


def _num(x, d: int = 2) -> str:
    return "-" if x is None else f"{x:.{d}f}"


def _spread(passes) -> str:
    """' (median of N passes, min-max)' for a speedup timed over several passes, else ''."""
    if not passes or None in passes:
        return ""
    return f" (median of {len(passes)}: {min(passes):.2f}-{max(passes):.2f})"


def _save(plt, fig, path: Path, paths: list[str]) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    paths.append(str(path))


def write_plots(report: dict, out_dir: Path) -> list[str]:
    """acceptance_by_position.png and speedup.png (needs matplotlib; returns [] without it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for temp, e in report["temperatures"].items():
        ys = e["speculative"]["p_at_least"]
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=f"T={temp} (≥i accepted)")
        ax.plot(
            range(1, len(ys) + 1),
            e["speculative"]["conditional"],
            ls="--",
            marker="x",
            label=f"T={temp} (α_i conditional)",
        )
    ax.set_xlabel("draft position i")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1.05)
    ax.legend()
    ax.set_title("Acceptance by position")
    p = out_dir / "acceptance_by_position.png"
    _save(plt, fig, p, paths)
    fig, ax = plt.subplots(figsize=(5, 4))
    temps = list(report["temperatures"])
    ax.bar([f"T={t}" for t in temps], [report["temperatures"][t]["speedup"] or 0 for t in temps])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("speculative ÷ plain tokens/s")
    ax.set_title("Speedup")
    p = out_dir / "speedup.png"
    _save(plt, fig, p, paths)
    return paths
