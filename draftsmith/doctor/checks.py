"""doctor's static checks: what the drafter's files say against what the target is. Each check is one
{"name", "ok", "detail"} line; a failing one says the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from draftsmith.common.io import read_json
from draftsmith.target_model.facts import target_facts
from draftsmith.target_model.layers import default_aux_layers, to_hidden_states_ids, to_layer_output_ids
from draftsmith.target_model.load import config_hash, tokenizer_hash

# which config field holds the aux ids in each layout, and its convention ("lo": layer-output, "hs": hidden_states)
AUX_FIELDS = {
    "draftsmith": [("aux_layer_ids", "lo")],
    "sglang": [("eagle_config.eagle_aux_hidden_state_layer_ids", "lo"), ("eagle_aux_hidden_state_layer_ids", "hs")],
    "vllm": [("eagle_config.eagle_aux_hidden_state_layer_ids", "lo"), ("eagle_aux_hidden_state_layer_ids", "hs")],
    "eagle": [("eagle_config.eagle_aux_hidden_state_layer_ids", "lo"), ("eagle_aux_hidden_state_layer_ids", "hs")],
    "speculators": [("eagle_aux_hidden_state_layer_ids", "hs")],
}


def check(name: str, ok: bool, detail: str) -> dict:
    return {"name": name, "ok": bool(ok), "detail": detail}


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(d, dict):
            return None
        d = d.get(part)
    return d


def aux_fix(fmt: str, layer_output_ids: list[int]) -> str:
    """The config edit that makes a drafter of layout `fmt` read the layers `layer_output_ids`."""
    lo = [int(i) for i in layer_output_ids]
    hs = to_hidden_states_ids(lo)
    if fmt == "draftsmith":
        return f"set aux_layer_ids to {lo} (layer-output ids)"
    if fmt == "speculators":
        return f"set eagle_aux_hidden_state_layer_ids to {hs} (hidden_states ids)"
    return (
        f"set eagle_config.eagle_aux_hidden_state_layer_ids to {lo} (layer-output ids) and the top-level "
        f"eagle_aux_hidden_state_layer_ids to {hs} (hidden_states ids)"
    )


def d2t_readings(d2t: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor | None]:
    """The target ids d2t names read as offsets (the convention) and as absolute ids; None = not a valid
    vocabulary under that reading (out of range or repeated ids)."""
    d2t = d2t.to(torch.int64)
    out: dict[str, torch.Tensor | None] = {}
    for name, ids in (("offsets", d2t + torch.arange(d2t.numel())), ("absolute", d2t.clone())):
        ok = bool(ids.numel()) and int(ids.min()) >= 0 and int(ids.max()) < vocab_size
        ok = ok and torch.unique(ids).numel() == ids.numel()
        out[name] = ids if ok else None
    return out


def static_checks(
    target, path: str, fmt: str, cfg, sd: dict, notes: dict, load_error: str | None, store: str | None = None
) -> list[dict]:
    facts = target_facts(target)
    raw = read_json(Path(path) / "config.json", "drafter config")
    N, H, V = facts["num_layers"], facts["hidden_size"], facts["vocab_size"]
    out = [
        check(
            "loads",
            load_error is None,
            f"{fmt} layout, loads with Drafter.from_pretrained"
            if load_error is None
            else f"Drafter.from_pretrained refuses it: {load_error}",
        )
    ]

    # sizes and vocab fit
    problems = []
    if cfg.vocab_size != V:
        problems.append(
            f"vocab_size {cfg.vocab_size} != target's {V}: a drafter for another tokenizer; retrain it for this target"
        )
    if cfg.target_hidden_size != H:
        problems.append(f"target_hidden_size {cfg.target_hidden_size} != target hidden size {H}")
    if cfg.hidden_size != H and notes.get("embedding") is None:
        problems.append(f"hidden_size {cfg.hidden_size} != target's {H} and no own embedding in the checkpoint")
    out.append(
        check(
            "sizes",
            not problems,
            "; ".join(problems)
            or f"hidden {cfg.hidden_size}, target hidden {cfg.target_hidden_size}, vocab {cfg.vocab_size}, "
            f"draft vocab {cfg.draft_vocab_size}, {cfg.num_hidden_layers} layer(s)",
        )
    )

    # aux ids: valid and distinct for this target
    ids = cfg.aux_layer_ids if cfg.aux_layer_ids is not None else (default_aux_layers(N) if cfg.num_aux == 3 else None)
    assumed = cfg.aux_layer_ids is None
    if ids is None:
        out.append(
            check(
                "aux_ids",
                False,
                f"no aux layer ids and fc takes {cfg.num_aux} states: "
                + aux_fix(fmt, default_aux_layers(N)[: cfg.num_aux]),
            )
        )
    else:
        bad = [i for i in ids if not 0 <= i < N]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        distinct = sorted({i for i in ids if 0 <= i < N})
        if bad:
            detail, ok = f"layer-output ids {bad} do not exist in a {N}-layer target (valid 0..{N - 1})", False
        elif dup:
            spare = [i for i in range(N) if i not in distinct]
            fix = sorted(distinct + spare[: len(ids) - len(distinct)])
            detail, ok = (
                (
                    f"layer-output ids {ids} repeat {dup}: SGLang and vLLM capture each layer once (set "
                    f"membership / de-duplication), so fc gets fewer states than it takes; retrain with "
                    f"distinct layers, e.g. {fix}"
                ),
                False,
            )
        else:
            detail, ok = f"layer-output ids {ids} (hidden_states ids {to_hidden_states_ids(ids)})", True
            if ids != sorted(ids):
                ok = False
                detail += (
                    f": not ascending -- draftsmith concatenates aux states in this order, SGLang/vLLM in "
                    f"layer order {sorted(ids)}; reorder fc.weight's column blocks to ascending layers"
                )
        if assumed:
            detail += " (none written: the engines' default for this target is assumed)"
        out.append(check("aux_ids", ok, detail))

    # both id conventions as written in each field the engines read
    written = []
    named = {}
    for fld, conv in AUX_FIELDS.get(fmt, []):
        v = _get(raw, fld)
        if v is None:
            continue
        v = [int(i) for i in v]
        lo = v if conv == "lo" else to_layer_output_ids(v)
        named[fld] = lo
        written.append(f"{fld}={v} ({'layer-output' if conv == 'lo' else 'hidden_states'} ids -> layer outputs {lo})")
    ok = len({tuple(v) for v in named.values()}) <= 1
    detail = "; ".join(written) or "no aux id field written"
    if not ok:
        detail += ": the fields name different layers -- " + aux_fix(fmt, cfg.aux_layer_ids or [])
    elif fmt == "sglang" and "eagle_aux_hidden_state_layer_ids" not in named and named:
        lo = next(iter(named.values()))
        ok = False
        detail += (
            f": vLLM (V1) reads these nested ids raw as hidden_states ids, i.e. layer outputs "
            f"{to_layer_output_ids(lo)}; add the top-level eagle_aux_hidden_state_layer_ids {to_hidden_states_ids(lo)}"
        )
    out.append(check("aux_id_conventions", ok, detail))

    # draft vocab mapping: d2t (offsets) vs t2d
    d2t = sd.get("d2t")
    t2d = sd.get("t2d")
    if d2t is None:
        out.append(
            check(
                "draft_vocab_mapping",
                cfg.draft_vocab_size == cfg.vocab_size,
                "no d2t: identity draft vocab"
                if cfg.draft_vocab_size == cfg.vocab_size
                else f"no d2t but draft_vocab_size {cfg.draft_vocab_size} != vocab_size {cfg.vocab_size}",
            )
        )
    else:
        readings = d2t_readings(d2t, cfg.vocab_size)
        in_t2d = None
        if t2d is not None and t2d.numel() == cfg.vocab_size:
            t2d_ids = torch.nonzero(t2d.to(torch.bool)).flatten()
            in_t2d = {k: (v is not None and torch.equal(torch.sort(v).values, t2d_ids)) for k, v in readings.items()}
        if readings["offsets"] is not None and (in_t2d is None or in_t2d["offsets"]):
            out.append(
                check(
                    "draft_vocab_mapping",
                    True,
                    f"d2t offsets name {d2t.numel()} distinct target ids" + ("" if in_t2d is None else ", t2d agrees"),
                )
            )
        elif readings["absolute"] is not None and (in_t2d is None or in_t2d["absolute"]):
            out.append(
                check(
                    "draft_vocab_mapping",
                    False,
                    "d2t holds absolute target ids, engines read offsets (target = draft + d2t[draft]): "
                    "write d2t[i] - i" + ("" if in_t2d is None else " (t2d agrees with the absolute reading)"),
                )
            )
        else:
            out.append(
                check(
                    "draft_vocab_mapping",
                    False,
                    "d2t and t2d do not describe one draft vocab of this target (under either reading): "
                    "rebuild the draft vocab from this target's token counts",
                )
            )

    # dtype against the target (engine layouts only: draftsmith's own engine casts the drafter to its dtype, and
    # `draftsmith export` writes the serving dtype)
    ddt = str(notes.get("dtype")).replace("torch.", "")
    tcfg = getattr(target, "config", None)
    tdt = str(getattr(tcfg, "dtype", None) or getattr(tcfg, "torch_dtype", None) or target.dtype)
    tdt = tdt.replace("torch.", "")
    ok = fmt == "draftsmith" or ddt == tdt
    out.append(
        check(
            "dtype",
            ok,
            f"drafter {ddt}, target {tdt}"
            + (
                ""
                if ok
                else f": set torch_dtype to {tdt} in config.json (SGLang's --dtype auto turns a float32 draft "
                f"config into float16 beside a {tdt} target)"
            ),
        )
    )

    # RoPE vs the target
    same = abs(float(cfg.rope_theta) - float(facts["rope_theta"])) < 1e-6 * max(1.0, float(facts["rope_theta"])) and (
        cfg.rope_scaling or None
    ) == (facts["rope_scaling"] or None)
    out.append(
        check(
            "rope",
            same,
            f"theta {cfg.rope_theta:g}, scaling {cfg.rope_scaling}"
            + (
                " = target's"
                if same
                else f"; target: theta {facts['rope_theta']:g}, scaling {facts['rope_scaling']}: "
                f"set rope_theta to {facts['rope_theta']:g} and rope_scaling to "
                f"{facts['rope_scaling']} unless the drafter was trained with its own"
            ),
        )
    )

    # norm_before_residual as each engine reads it
    if fmt == "speculators":
        written_nbr = raw.get("norm_before_residual")
        ok = written_nbr is not None
        out.append(
            check(
                "norm_before_residual",
                ok,
                f"norm_before_residual={written_nbr}"
                + ("" if ok else ": not written; vLLM's speculators config defaults it to true -- write it explicitly"),
            )
        )
    elif fmt in ("sglang", "vllm", "eagle") and cfg.norm_before_residual:
        out.append(
            check(
                "norm_before_residual",
                False,
                "norm_before_residual=true: SGLang does not read it (its "
                "residual is always the un-normed hidden); serve with vLLM or retrain without it",
            )
        )

    if store:
        out.extend(store_checks(target, store, cfg))
    return out


def store_checks(target, store: str, cfg) -> list[dict]:
    """The store's target identity vs T, and its aux layers vs the drafter's."""
    m = read_json(Path(store) / "manifest.json", "store manifest")
    ident = m.get("target") or {}
    out = []
    tpath = target.path
    ch, th = config_hash(tpath), tokenizer_hash(tpath)
    ok = ident.get("config_hash") == ch
    out.append(
        check(
            "store_config_hash",
            ok,
            "store made from this target's config"
            if ok
            else f"store target.config_hash {str(ident.get('config_hash'))[:12]} != {ch[:12]} of {tpath}: the "
            f"drafter was trained on another model's states ({ident.get('path')})",
        )
    )
    ok = ident.get("tokenizer_hash") == th
    out.append(
        check(
            "store_tokenizer_hash",
            ok,
            "store made with this target's tokenizer"
            if ok
            else f"store target.tokenizer_hash {str(ident.get('tokenizer_hash'))[:12]} != {th[:12]}: another "
            "tokenizer (its draft vocab names other tokens)",
        )
    )
    aux = m.get("aux_layers")
    if aux is not None and cfg.aux_layer_ids is not None:
        ok = [int(i) for i in aux] == list(cfg.aux_layer_ids)
        out.append(
            check(
                "store_aux_layers",
                ok,
                f"store aux_layers {aux} (layer-output ids)"
                + (
                    " = drafter's"
                    if ok
                    else f" != drafter's {cfg.aux_layer_ids}: the drafter was trained on layers {aux}"
                ),
            )
        )
    return out


def read_tau_sim(drafter_path: str) -> dict[str, Any] | None:
    """The last held-out τ_sim of the training run the drafter came from (RUN/final -> RUN/metrics.jsonl)."""
    p = Path(drafter_path)
    for cand in (p / "metrics.jsonl", p.parent / "metrics.jsonl"):
        if cand.is_file():
            last = None
            for line in cand.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if "eval_tau_sim" in rec or "tau_sim" in rec:
                    last = rec
            if last is not None:
                return {
                    "file": str(cand),
                    "step": last.get("step"),
                    "tau_sim": last.get("eval_tau_sim", last.get("tau_sim")),
                    "acc": last.get("eval_acc", last.get("acc")),
                    "held_out": "eval_tau_sim" in last,
                }
    return None
