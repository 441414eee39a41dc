"""`inspect_drafter`: what a drafter directory is (for `draftsmith inspect DRAFTER [--target T]`)."""

from __future__ import annotations

import os
from typing import Any

from draftsmith.common.errors import DraftsmithError
from draftsmith.drafter.formats import read_checkpoint, state_problems
from draftsmith.target_model.facts import target_facts, target_weight_problems
from draftsmith.target_model.layers import engine_default_aux_layers, to_hidden_states_ids


def inspect_drafter(path: str | os.PathLike, target: Any = None) -> dict[str, Any]:
    """Describe a drafter checkpoint in any readable layout without building the model.

    Keys: path, format, weights_file, dtype, sizes (hidden_size, target_hidden_size, intermediate_size,
    num_attention_heads, num_key_value_heads, head_dim, num_hidden_layers, vocab_size, draft_vocab_size),
    parameters, num_aux, aux_layer_ids (layer-output ids), aux_hidden_states_ids (= +1), aux_ids_source
    ("checkpoint", "engine default for the target" or "unknown"), aux_ids_as_written (raw config fields,
    each labelled with its convention), norm_before_residual, rope_theta, rope_scaling,
    target_name_or_path, target_num_layers (from the config, else the export's draftsmith_export.json; None =
    unknown), weights_problems (where the weights contradict the config), warnings (lines to show), and with
    `target`: target, fits_target (bool) and fit_problems (list of reasons, weights_problems included; empty when
    it fits). Without `target`: fits_target None.
    """
    from draftsmith.drafter.model import fit_problems

    fmt, cfg, sd, notes = read_checkpoint(path)
    aux, source = cfg.aux_layer_ids, "checkpoint" if cfg.aux_layer_ids is not None else "unknown"
    marker = notes.get("export_marker") or {}
    weights_problems = state_problems(cfg, sd)
    warnings: list[str] = []
    out: dict[str, Any] = {
        "path": str(path),
        "format": fmt,
        "weights_file": notes.get("weights_file"),
        "dtype": str(notes.get("dtype")).replace("torch.", ""),
        "hidden_size": cfg.hidden_size,
        "target_hidden_size": cfg.target_hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.num_hidden_layers,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "parameters": int(sum(v.numel() for k, v in sd.items() if k not in ("d2t", "t2d"))),
        "num_aux": cfg.num_aux,
        "norm_before_residual": cfg.norm_before_residual,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "target_name_or_path": cfg.target_name_or_path or marker.get("target"),
        "target_num_layers": cfg.target_num_layers or marker.get("target_num_layers"),
        "weights_problems": weights_problems,
        "warnings": warnings,
        "aux_ids_as_written": notes.get("aux_ids_as_written"),
        "target": None,
        "fits_target": None,
        "fit_problems": [],
    }
    if "speculative_tokens" in notes:
        out["speculative_tokens"] = notes["speculative_tokens"]
    facts = None
    if target is not None:
        try:
            facts = target_facts(target)
        except DraftsmithError as e:
            out.update(target=str(target), fits_target=False, fit_problems=[str(e)])
            facts = None
        if facts is not None:
            if aux is None and cfg.num_aux == 3:
                aux, source = engine_default_aux_layers(facts["num_layers"]), "engine default for the target"
                cfg.aux_layer_ids = aux
            problems = fit_problems(cfg, facts) + [f"drafter weights: {p}" for p in weights_problems]
            problems += [f"target weights: {p}" for p in target_weight_problems(target)]
            if cfg.hidden_size != facts["hidden_size"]:
                problems.append(
                    f"field 'hidden_size': drafter {cfg.hidden_size} != target embedding width "
                    f"{facts['hidden_size']} (the drafter embeds tokens with the target's embedding)"
                )
            trained_layers = out["target_num_layers"]
            if trained_layers is not None and trained_layers != facts["num_layers"]:
                problems.append(
                    f"field 'target_num_layers': trained for a {trained_layers}-layer target, "
                    f"this one has {facts['num_layers']}"
                )
            out.update(target=facts["name_or_path"] or str(target), fits_target=not problems, fit_problems=problems)
    if source == "engine default for the target":
        warnings.append(
            f"the drafter config names no aux layers; assuming the engines' default for this "
            f"{facts['num_layers']}-layer target: layer-output ids {aux} = "
            f"hidden_states ids {to_hidden_states_ids(aux)}"
        )
    elif source == "unknown" and cfg.num_aux == 3:
        warnings.append(
            "the drafter config names no aux layers; engines assume EAGLE-3's default, layer-output ids "
            "[1, N//2-1, N-4] = hidden_states ids [2, N//2, N-3] for an N-layer target (pass --target "
            "to resolve them)"
        )
    out["aux_layer_ids"] = aux
    out["aux_hidden_states_ids"] = None if aux is None else to_hidden_states_ids(aux)
    out["aux_ids_source"] = source
    return out


def _known(value: Any) -> str:
    return "unknown" if value is None else str(value)


def format_report(info: dict[str, Any]) -> str:
    """Human-readable lines for the CLI."""
    lines = [
        f"drafter      {info['path']}  (format: {info['format']}, {info['weights_file']}, {info['dtype']})",
        f"sizes        hidden {info['hidden_size']} (target {info['target_hidden_size']}), intermediate "
        f"{info['intermediate_size']}, heads {info['num_attention_heads']}/{info['num_key_value_heads']} x "
        f"{info['head_dim']}, layers {info['num_hidden_layers']}, {info['parameters']:,} parameters",
        f"vocab        draft {info['draft_vocab_size']} of target {info['vocab_size']}",
        f"aux layers   layer-output ids {info['aux_layer_ids']} = hidden_states ids {info['aux_hidden_states_ids']}"
        f"  ({info['aux_ids_source']})",
        f"variant      norm_before_residual={info['norm_before_residual']}, rope_theta={info['rope_theta']}, "
        f"rope_scaling={info['rope_scaling']}",
        f"trained for  {_known(info['target_name_or_path'])} ({_known(info['target_num_layers'])} layers)",
    ]
    for problem in info.get("weights_problems") or []:
        lines.append(f"WEIGHTS PROBLEM: {problem}")
    for warning in info.get("warnings") or []:
        lines.append(f"warning: {warning}")
    if info["fits_target"] is not None:
        verdict = "yes" if info["fits_target"] else "NO: " + "; ".join(info["fit_problems"])
        lines.append(f"fits target  {info['target']}: {verdict}")
    return "\n".join(lines)
