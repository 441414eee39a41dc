"""`diagnose`: static checks, measured acceptance as configured and under each candidate mis-wiring, and the verdict.

A variant is named a likely fault when its acceptance rate is >= `RATIO` x the configuration's, at least
`MIN_GAIN` higher, and its gain over the configuration is positive in both halves of the prompts and larger than
the noise between them (|gain on half A - gain on half B|; halves by `prompt_half`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftsmith.common.errors import DraftsmithError
from draftsmith.data import load_prompts
from draftsmith.decode.evaluate import load_prompt_ids
from draftsmith.doctor import measure as M
from draftsmith.doctor.checks import aux_fix, d2t_readings, read_tau_sim, static_checks
from draftsmith.doctor.prompts import BUILTIN_PROMPTS
from draftsmith.drafter import Drafter
from draftsmith.drafter.formats import read_checkpoint
from draftsmith.target_model.facts import target_facts
from draftsmith.target_model.layers import default_aux_layers

FAULTS = (
    "aux_layer_shift",
    "aux_layer_order",
    "final_norm",
    "norm_before_residual",
    "d2t_absolute",
    "chat_template",
    "rope",
    "draft_vocab",
)
# A correctly wired drafter accepts best as configured: every variant perturbs the inputs it was trained on, so a
# variant that gains consistently across both prompt halves is evidence of a fault even well below 1.5x (on the demo
# target a drafter trained on post-norm states loses 15% of its acceptance when served pre-norm states).
RATIO = 1.15
# a floor under the gain (in acceptance rate): the halves' noise rule decides significance, so the floor stays low
# enough for weak drafters, where a fault moves the rate by a few points (0.072 -> 0.106 for an aux shift of a
# drafter trained for 200 CPU steps)
MIN_GAIN = 0.01
# static checks whose failure already says the files disagree with the target: the matching variant needs only a
# gain above the noise (a RoPE base off the target's costs little on short prompts, yet is wrong)
STATIC_EVIDENCE = {"rope": "rope", "draft_vocab_mapping": "d2t_absolute", "aux_id_conventions": "aux_layer_shift"}
# a wrong d2t reading is one way a draft vocab can be wrong: when it explains the loss, the generic
# remapped-vocab variant (which also recovers it) is not reported beside it
SUBSUMED_BY = {"draft_vocab": ("d2t_absolute",)}


@dataclass
class Variant:
    fault: str | None  # None = the configuration
    label: str
    fix: str
    aux_layers: list[int]  # layer-output id of each fc input block, in fc order
    normed_slots: tuple[int, ...] = ()  # fc blocks fed the target's final norm of their state
    drafter: Any = None  # None = the configuration's drafter
    table: str = "config"  # "config" | "absolute" | "remap"
    template: bool | None = None  # None = the configuration's prompts
    result: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------------ loading
def load_for_doctor(path: str, target) -> dict:
    """Read a drafter in any layout. If `Drafter.from_pretrained` refuses it (a d2t that is not valid offsets,
    say) the weights are still loaded so the fault can be measured; the refusal becomes a failed check."""
    fmt, cfg, sd, notes = read_checkpoint(path)
    load_error = None
    try:
        drafter = Drafter.from_pretrained(path, target=target, dtype=torch.float32)
    except DraftsmithError as e:
        load_error = str(e)
        n = target.num_layers
        if cfg.aux_layer_ids is None and cfg.num_aux == 3:
            cfg.aux_layer_ids = default_aux_layers(n)
        if cfg.target_num_layers is None:
            cfg.target_num_layers = n
        drafter = Drafter(cfg)
        own = drafter.state_dict()
        weights = {k: v for k, v in sd.items() if k not in ("d2t", "t2d")}
        missing = sorted(set(own) - set(weights) - {"d2t", "t2d"})
        bad = [k for k, v in weights.items() if k not in own or tuple(v.shape) != tuple(own[k].shape)]
        if missing or bad:
            raise DraftsmithError(f"{path}: cannot load the drafter ({load_error})") from None
        with torch.no_grad():
            for k, v in weights.items():
                own[k].copy_(v.to(own[k].dtype))
        drafter.to(torch.float32)
        emb = notes.get("embedding")
        drafter.set_embedding(emb if emb is not None else target.embed_tokens.weight)
    drafter.eval()
    drafter.requires_grad_(False)
    cfg = drafter.config
    d2t = sd.get("d2t")
    d2t = drafter.d2t.clone() if d2t is None else d2t.to(torch.int64)
    return {
        "format": fmt,
        "config": cfg,
        "state": sd,
        "notes": notes,
        "drafter": drafter,
        "load_error": load_error,
        "d2t": d2t,
    }


def clone_drafter(drafter, **changes):
    """The same weights under a changed config (norm_before_residual, RoPE)."""
    new = Drafter(drafter.config.replace(**changes))
    new.load_state_dict(drafter.state_dict())
    new.to(next(drafter.parameters()).dtype)
    new.set_embedding(drafter.embed_tokens.weight)
    new.eval()
    new.requires_grad_(False)
    return new.to(next(drafter.parameters()).device)


# ------------------------------------------------------------------------------------------ prompts
def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_token_ids(tokenizer, prompts_file: str | None, max_prompts: int | None, template: bool) -> list[list[int]]:
    """Token ids of the prompts (the built-in set without a file) through draftsmith's prompt loader, with or
    without the tokenizer's chat template."""
    if prompts_file is not None:
        ids = load_prompt_ids(prompts_file, tokenizer, raw=not template, limit=max_prompts)
    else:
        texts = BUILTIN_PROMPTS[:max_prompts] if max_prompts else BUILTIN_PROMPTS
        with tempfile.TemporaryDirectory() as tmp:
            p = Path(tmp) / "prompts.jsonl"
            p.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
            ids = load_prompts(str(p), tokenizer, raw=not template)
    out = [[int(x) for x in row] for row in ids]
    if not out:
        raise DraftsmithError(f"{prompts_file or 'built-in prompts'}: no prompts")
    return out


def trace_key(prompts_file: str | None, max_prompts: int | None, template: bool, max_new_tokens: int, K: int):
    """The key of a `diagnose(trace_cache=...)` entry: traces depend only on these (and the target)."""
    return (str(prompts_file), max_prompts, bool(template), int(max_new_tokens), int(K))


def build_traces(target, prompts: Sequence[Sequence[int]], max_new_tokens: int, K: int) -> list[M.Trace]:
    return [M.trace_prompt(target, p, max_new_tokens, K) for p in prompts]


# ------------------------------------------------------------------------------------------ variants
def _fc_order_fix(ids: list[int], perm: tuple[int, ...], width: int) -> str:
    order = [ids[p] for p in perm]
    blocks = [order.index(i) for i in ids]
    return (
        f"fc.weight's input blocks are in the order of layers {order}, not {ids}: rewrite fc.weight as its "
        f"column blocks {blocks} ({width} columns each) so block i reads layer {ids}[i], or for draftsmith's own "
        f"engine only set aux_layer_ids to {order} (SGLang and vLLM concatenate aux states in layer order)"
    )


def candidate_variants(
    info: dict, target, base: Variant, template_available: bool, template_used: bool, skip: set[str] = frozenset()
) -> list[Variant]:
    """Every candidate mis-wiring, each changing one thing of `base` (the configuration, or the configuration with
    the faults found so far fixed); families in `skip` are left out."""
    fmt = info["format"]
    drafter = base.drafter or info["drafter"]
    cfg = drafter.config
    N = target.num_layers
    ids = list(base.aux_layers)
    k = len(ids)

    def v(fault, label, fix, **changes):
        return dataclasses.replace(base, fault=fault, label=label, fix=fix, result={}, **changes)

    out: list[Variant] = []
    if "aux_layer_shift" not in skip:
        for delta in (+1, -1):
            shifted = [i + delta for i in ids]
            if all(0 <= i < N for i in shifted):
                out.append(
                    v("aux_layer_shift", f"aux ids {delta:+d} ({shifted})", aux_fix(fmt, shifted), aux_layers=shifted)
                )
    if "aux_layer_order" not in skip:
        seen = {tuple(ids)}
        for perm in itertools.permutations(range(k)):
            order = [ids[p] for p in perm]
            if tuple(order) not in seen:
                seen.add(tuple(order))
                fix = _fc_order_fix(ids, perm, cfg.target_hidden_size)
                out.append(v("aux_layer_order", f"fc blocks read layers {order}", fix, aux_layers=order))
    if "final_norm" not in skip:
        for slot in range(k):
            last = ids[slot] == N - 1
            why = (
                f"the drafter expects layer {ids[slot]}'s state after the target's final norm"
                + (" (HF output_hidden_states[-1] is post-norm)" if last else "")
                + "; engines and draftsmith capture it before the norm: retrain on pre-norm states "
                "(draftsmith capture stores them)"
            )
            out.append(
                v(
                    "final_norm",
                    f"final norm on layer {ids[slot]}",
                    why,
                    normed_slots=tuple(sorted(set(base.normed_slots) | {slot})),
                )
            )
        if k > 1:
            out.append(
                v(
                    "final_norm",
                    "final norm on every aux state",
                    "the drafter expects every aux state after the target's final norm; engines capture them "
                    "before it: retrain on pre-norm states",
                    normed_slots=tuple(range(k)),
                )
            )
    if "norm_before_residual" not in skip:
        flip = not cfg.norm_before_residual
        out.append(
            v(
                "norm_before_residual",
                f"norm_before_residual={str(flip).lower()}",
                f"set norm_before_residual to {str(flip).lower()}",
                drafter=clone_drafter(drafter, norm_before_residual=flip),
            )
        )
    if "d2t_absolute" not in skip and base.table == "config":
        readings = d2t_readings(info["d2t"], cfg.vocab_size)
        if readings["absolute"] is not None or readings["offsets"] is None:
            out.append(
                v(
                    "d2t_absolute",
                    "d2t read as absolute ids",
                    "d2t holds absolute target ids but engines read offsets (target = draft + d2t[draft]): "
                    "write d2t[i] - i",
                    table="absolute",
                )
            )
    if "draft_vocab" not in skip and info.get("remap_available") and base.table == "config":
        out.append(
            v(
                "draft_vocab",
                "draft ids mapped by lm_head rows",
                "the draft vocab (d2t/t2d) does not name the tokens lm_head was trained for (built for another "
                "tokenizer or other token counts): rebuild d2t/t2d with the vocab the drafter was trained with "
                "(its lm_head rows match the target's rows of those tokens)",
                table="remap",
            )
        )
    facts = target_facts(target)
    if "rope" not in skip and (
        abs(cfg.rope_theta - facts["rope_theta"]) > 1e-6 * facts["rope_theta"]
        or (cfg.rope_scaling or None) != (facts["rope_scaling"] or None)
    ):
        out.append(
            v(
                "rope",
                f"target's RoPE (theta {facts['rope_theta']:g}, scaling {facts['rope_scaling']})",
                f"set rope_theta to {facts['rope_theta']:g} and rope_scaling to {facts['rope_scaling']}",
                drafter=clone_drafter(drafter, rope_theta=facts["rope_theta"], rope_scaling=facts["rope_scaling"]),
            )
        )
    if "chat_template" not in skip and template_available:
        other = not (template_used if base.template is None else base.template)
        out.append(
            v(
                "chat_template",
                f"prompts {'with' if other else 'without'} the chat template",
                (
                    "render prompts with the tokenizer's chat template (the drafter was trained on chats)"
                    if other
                    else "send raw text without the chat template (the drafter was trained on raw text), or "
                    "retrain on chats"
                ),
                template=other,
            )
        )
    return out


# ------------------------------------------------------------------------------------------ measuring
def _aux_inputs(trace: M.Trace, v: Variant, final_norm) -> torch.Tensor:
    states = trace.layer_states[:, v.aux_layers, :].float()  # [T, k, H]
    if v.normed_slots:
        w = next(final_norm.parameters(), None)
        dt = w.dtype if w is not None else torch.float32
        dev = w.device if w is not None else torch.device("cpu")
        with torch.no_grad():
            for s in v.normed_slots:
                states[:, s] = final_norm(states[:, s].to(dev, dt)).float().cpu()
    return states.reshape(states.shape[0], -1)


def _tables(d2t: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    ar = torch.arange(d2t.numel())
    out = {}
    for name, ids in (("config", d2t + ar), ("absolute", d2t.clone())):
        out[name] = torch.where((ids >= 0) & (ids < vocab_size), ids, torch.full_like(ids, -1))
    return out


@torch.no_grad()
def lm_head_remap(drafter, target, chunk: int = 4096) -> torch.Tensor | None:
    """Draft id -> the target token whose lm_head row is closest (cosine) to the draft id's lm_head row. A drafter
    whose lm_head started as (or is frozen to) the target's rows of its draft vocab keeps them close, so this
    recovers the vocab it was trained with whatever its d2t says; None when the widths differ."""
    head = target.lm_head.weight
    dh = drafter.lm_head.weight
    if head.shape[1] != dh.shape[1]:
        return None
    dev = head.device  # [V_d, H] x [H, V]: on the target's device, in row chunks of the target's vocab
    dn = torch.nn.functional.normalize(dh.detach().to(dev, torch.float32), dim=-1)
    best = torch.full((dn.shape[0],), -2.0, device=dev)
    arg = torch.zeros(dn.shape[0], dtype=torch.long, device=dev)
    for i in range(0, head.shape[0], chunk):
        tn = torch.nn.functional.normalize(head[i : i + chunk].detach().float(), dim=-1)
        v, j = (dn @ tn.T).max(-1)
        better = v > best
        best = torch.where(better, v, best)
        arg = torch.where(better, j + i, arg)
    return arg.cpu()


def prompt_half(i: int) -> int:
    """Half A = prompts 0, 1, 4, 5, ..., half B = 2, 3, 6, 7, ...: pairs, so that the built-in set's alternating
    code / prose prompts put the same mix in both halves."""
    return (i // 2) % 2


def measure_variant(v: Variant, traces: list[M.Trace], base_drafter, tables: dict, K: int, final_norm) -> dict:
    drafter = v.drafter or base_drafter
    rounds = []
    table = tables[v.table]
    for tr in traces:
        starts = M.round_starts(tr, K)
        if starts.numel() == 0:
            rounds.append([])
            continue
        drafts, _ = M.chain_drafts(drafter, _aux_inputs(tr, v, final_norm), tr.input_ids, starts, K, table)
        acc = M.accepted_per_start(drafts, tr.target_next, starts)
        rounds.append(M.engine_rounds(acc, starts))
    summary = M.summarize(rounds, K)
    summary["halves"] = [
        M.summarize([r for i, r in enumerate(rounds) if prompt_half(i) == h], K)["acceptance_rate"] for h in (0, 1)
    ]
    summary["rounds_per_prompt"] = rounds
    return summary


def draft_vocab_coverage(traces: list[M.Trace], table: torch.Tensor) -> float:
    """Share of the target's greedy tokens (continuations) that the draft vocab can propose at all."""
    vocab = {int(t) for t in table.tolist() if t >= 0}
    toks = [
        int(t)
        for tr in traces
        for t in tr.target_next[tr.prompt_len - 1 : tr.prompt_len - 1 + tr.max_new_tokens].tolist()
    ]
    return sum(t in vocab for t in toks) / max(len(toks), 1)


# ------------------------------------------------------------------------------------------ verdict
def qualifying(
    reference: dict, variants: list[Variant], ratio: float = RATIO, static_evidence: frozenset[str] = frozenset()
) -> list[tuple[Variant, float]]:
    """The best variant of each fault family that beats `reference` clearly (module docstring), best first.
    Families in `static_evidence` (a static check already shows the files disagree with the target) need only a
    gain above the noise, not `ratio`."""
    best: dict[str, Variant] = {}
    for v in variants:
        if v.fault not in best or v.result["acceptance_rate"] > best[v.fault].result["acceptance_rate"]:
            best[v.fault] = v
    rc = reference["acceptance_rate"]
    found = []
    for v in best.values():
        r = v.result
        gains = [r["halves"][h] - reference["halves"][h] for h in (0, 1)]
        noise = abs(gains[0] - gains[1])  # how much the variant's gain moves between the two halves
        gain = r["acceptance_rate"] - rc
        need_ratio = 1.0 if v.fault in static_evidence else ratio
        need_gain = MIN_GAIN
        if r["acceptance_rate"] >= need_ratio * rc and gain >= need_gain and gain > noise and min(gains) > 0:
            found.append((v, noise))
    names = {v.fault for v, _ in found}
    found = [x for x in found if not any(s in names for s in SUBSUMED_BY.get(x[0].fault, ()))]
    found.sort(key=lambda x: -x[0].result["acceptance_rate"])
    return found


def suggestions(config: dict, coverage: float, tau_sim: dict | None, K: int) -> list[str]:
    out = []
    cond = config["conditional"]
    if tau_sim and tau_sim.get("acc"):
        acc = list(tau_sim["acc"])[:K]
        expect = 1.0 + sum(float(torch.tensor(acc[: i + 1]).prod()) for i in range(len(acc)))
        kind = "held-out" if tau_sim.get("held_out") else "training"
        gap = (
            "close to"
            if abs(expect - config["tau"]) <= 0.15 * expect
            else ("well below" if config["tau"] < expect else "above")
        )
        out.append(
            f"training's {kind} τ_sim at K={len(acc)} predicts τ ≈ {expect:.2f} ({tau_sim['file']}, step "
            f"{tau_sim['step']}); measured τ {config['tau']:.2f} is {gap} it"
            + (
                ""
                if gap != "well below"
                else ": the prompts differ from the training data, or a "
                "serving-side difference not covered by the variants"
            )
        )
    if coverage < 0.9:
        out.append(
            f"the draft vocab covers only {coverage:.0%} of the target's greedy tokens on these prompts: "
            "a larger --draft-vocab-size, or token counts from data like these prompts"
        )
    if cond and cond[0] < 0.3:
        out.append(
            f"the first draft is accepted only {cond[0]:.0%} of the time: undertrained, or trained on "
            "different data than these prompts (fine-tune it on the target's own answers to prompts like these: "
            "`draftsmith regenerate`, then `draftsmith train --online --init-from DRAFTER`)"
        )
    if len(cond) > 1 and cond[0] >= 0.3 and min(cond[1:]) < 0.6 * cond[0]:
        out.append(
            "acceptance falls off fast with draft position (α_i "
            + " ".join(f"{c:.2f}" for c in cond)
            + "): undertrained for later steps (more data / steps, or more TTT steps)"
        )
    if not out:
        out.append(
            "no mis-wiring found and acceptance holds up by position (α_i " + " ".join(f"{c:.2f}" for c in cond) + ")"
        )
    return out


def diagnose(
    target,
    drafter_path: str,
    prompts_file: str | None = None,
    store: str | None = None,
    max_prompts: int | None = None,
    draft_tokens: int = 4,
    max_new_tokens: int = 64,
    raw: bool = False,
    trace_cache: dict | None = None,
    progress=None,
    ratio: float = RATIO,
) -> dict:
    """The whole doctor run on a loaded draftsmith Target; returns the report dict (the --json object).
    trace_cache: a dict reused across calls with the same target/prompts (tests) to skip the target passes."""
    K = int(draft_tokens)
    if K < 1:
        raise DraftsmithError(f"--draft-tokens: must be >= 1, got {K}")
    say = progress or (lambda msg: None)
    info = load_for_doctor(str(drafter_path), target)
    checks = static_checks(
        target,
        str(drafter_path),
        info["format"],
        info["config"],
        info["state"],
        info["notes"],
        info["load_error"],
        store,
    )
    tok = target.tokenizer
    template_available = has_chat_template(tok)
    template_used = template_available and not raw
    cache = trace_cache if trace_cache is not None else {}

    def traces_for(template: bool) -> list[M.Trace]:
        key = trace_key(prompts_file, max_prompts, template, max_new_tokens, K)
        if key not in cache:
            say(f"target: greedy continuations of the prompts ({'chat template' if template else 'raw'})")
            ids = prompt_token_ids(tok, prompts_file, max_prompts, template)
            cache[key] = build_traces(target, ids, max_new_tokens, K)
        return cache[key]

    traces = traces_for(template_used)
    drafter = info["drafter"].to(target.device)
    tables = _tables(info["d2t"], info["config"].vocab_size)
    remap = lm_head_remap(drafter, target)
    if remap is not None:
        tables["remap"] = remap
    if info["config"].aux_layer_ids is None:
        bad = next(c for c in checks if c["name"] == "aux_ids")
        raise DraftsmithError(f"{drafter_path}: cannot measure without aux layer ids: {bad['detail']}")
    cfg_variant = Variant(None, "as configured", "", list(info["config"].aux_layer_ids))
    say("measuring the configuration")
    config = measure_variant(cfg_variant, traces, drafter, tables, K, target.final_norm)
    info["remap_available"] = remap is not None

    def measure(v: Variant) -> dict:
        tr = traces if v.template is None else traces_for(v.template)
        return measure_variant(v, tr, drafter, tables, K, target.final_norm)

    # Faults are found one at a time: the best clearly-better variant is a fault; the search then starts again from
    # the configuration with it fixed, so a second, independent fault shows as a gain over the first fix (and a
    # partial recovery of the same loss by another family, which the fix already explains, does not).
    failed = {c["name"] for c in checks if not c["ok"]}
    static_evidence = frozenset(fault for name, fault in STATIC_EVIDENCE.items() if name in failed)
    base, reference, faults, variants, seen = cfg_variant, config, [], None, set()
    for _ in range(len(FAULTS)):
        round_variants = candidate_variants(info, target, base, template_available, template_used, skip=seen)
        for v in round_variants:
            say(f"measuring variant: {v.label}")
            v.result = measure(v)
        if variants is None:
            variants = round_variants  # the report's variants: each one change away from the configuration
        found = qualifying(reference, round_variants, ratio, static_evidence)
        if not found:
            break
        top, noise = found[0]
        faults.append(
            {
                "fault": top.fault,
                "fix": top.fix,
                "acceptance_rate": config["acceptance_rate"],
                "variant_acceptance_rate": top.result["acceptance_rate"],
                "variant": top.label,
                "noise": noise,
            }
        )
        seen.add(top.fault)
        base, reference = top, top.result
    coverage = draft_vocab_coverage(traces, tables["config"])
    checks.append(
        {
            "name": "draft_vocab_coverage",
            "ok": coverage >= 0.9,
            "detail": f"the draft vocab holds {coverage:.1%} of the target's greedy tokens on these prompts",
        }
    )
    best = max(variants, key=lambda v: v.result["acceptance_rate"]) if variants else None
    report = {
        "checks": checks,
        "acceptance_rate": config["acceptance_rate"],
        "tau": config["tau"],
        "variants": [
            {
                "fault": v.fault,
                "label": v.label,
                "acceptance_rate": v.result["acceptance_rate"],
                "tau": v.result["tau"],
                "p_at_least": v.result["p_at_least"],
            }
            for v in variants
        ],
        "likely_faults": faults,
        "p_at_least": config["p_at_least"],
        "conditional": config["conditional"],
        "halves": config["halves"],
        "rounds": config["rounds"],
        "prompts": len(traces),
        "draft_tokens": K,
        "max_new_tokens": max_new_tokens,
        "chat_template": template_used,
        "format": info["format"],
        "best_variant": None
        if best is None
        else {
            "fault": best.fault,
            "label": best.label,
            "acceptance_rate": best.result["acceptance_rate"],
            "p_at_least": best.result["p_at_least"],
        },
    }
    if not faults:
        report["suggestions"] = suggestions(config, coverage, read_tau_sim(str(drafter_path)), K)
    return report


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() and os.environ.get("CUDA_VISIBLE_DEVICES", "0") != "" else "cpu"
