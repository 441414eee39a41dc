"""Describe a target: architecture, sizes, default aux layers in both conventions."""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.common.errors import DraftsmithError
from draftsmith.common.hf import text_config
from draftsmith.target_model.facts import target_weight_problems
from draftsmith.target_model.layers import default_aux_layers, to_hidden_states_ids
from draftsmith.target_model.load import (
    config_hash,
    hf_load_error,
    read_target_config,
    tokenizer_hash,
    trust_remote_code,
)


def inspect_target(path: str | Path, trust_remote_code_flag: bool | None = None) -> dict:
    """Read config.json only (no weights loaded): fast even for a 1T-parameter target. The weights' header is
    checked against the config's sizes when they are safetensors (`weights_problems`)."""
    p = Path(path)
    cfg_path = p / "config.json"
    if not cfg_path.is_file():
        raise DraftsmithError(f"{cfg_path}: not found — is {p} a Hugging Face model directory?")
    try:
        from transformers import AutoConfig  # transformers takes ~1.8 s to import: only reading a config pays it

        # never runs code from the directory (auto_map) unless opted in; transformers then never asks on stdin
        config = AutoConfig.from_pretrained(str(p), trust_remote_code=trust_remote_code(trust_remote_code_flag))
    except (ValueError, KeyError, OSError, TypeError) as e:
        raise hf_load_error(cfg_path, "config", e) from None
    text = text_config(config)
    n = int(text.num_hidden_layers)
    aux = default_aux_layers(n)
    raw = read_target_config(p)
    moe = {
        k: raw[k] for k in ("num_local_experts", "n_routed_experts", "num_experts", "num_experts_per_tok") if k in raw
    }
    tok_cfg = p / "tokenizer_config.json"
    try:
        tok_has_template = tok_cfg.is_file() and "chat_template" in json.loads(tok_cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as e:
        raise DraftsmithError(f"{tok_cfg}: invalid JSON ({e})") from None
    chat = (p / "chat_template.jinja").is_file() or tok_has_template
    return {
        "path": str(p),
        "kind": "target",
        "architectures": list(getattr(config, "architectures", None) or []),
        "model_type": getattr(text, "model_type", None),
        "num_layers": n,
        "hidden_size": int(text.hidden_size),
        "vocab_size": int(text.vocab_size),
        "num_attention_heads": getattr(text, "num_attention_heads", None),
        "num_key_value_heads": getattr(text, "num_key_value_heads", None),
        "moe": moe or None,
        "chat_template": bool(chat),
        "default_aux_layers": {"layer-output ids": aux, "hidden_states ids": to_hidden_states_ids(aux)},
        "distinct_aux_layers": len(set(aux)) == len(aux),
        "weights_problems": target_weight_problems(p),
        "config_hash": config_hash(p),
        "tokenizer_hash": tokenizer_hash(p),
    }


def format_target_info(info: dict) -> str:
    aux = info["default_aux_layers"]
    lines = [
        f"target        {info['path']}",
        f"architecture  {', '.join(info['architectures']) or '?'} (model_type {info['model_type']})",
        f"layers        {info['num_layers']}",
        f"hidden size   {info['hidden_size']}",
        f"vocab         {info['vocab_size']}",
        f"heads         {info['num_attention_heads']} (kv {info['num_key_value_heads']})",
    ]
    if info.get("moe"):
        lines.append(f"moe           {info['moe']}")
    lines += [
        f"chat template {'yes' if info['chat_template'] else 'no (use text mode)'}",
        "default aux layers (EAGLE-3 low/mid/high, distinct; rule in draftsmith/target_model/layers.py):",
        f"  layer-output ids   {aux['layer-output ids']}   (SGLang eagle_config, SpecForge, draftsmith --aux-layers)",
        f"  hidden_states ids  {aux['hidden_states ids']}   (vLLM top-level, speculators --target-layer-ids, HF output_hidden_states)",
    ]
    for problem in info.get("weights_problems") or []:
        lines.append(f"WEIGHTS PROBLEM: {problem}")
    if not info["distinct_aux_layers"]:
        lines.append(
            "  note: with this few layers three distinct aux layers do not exist; such a drafter trains and "
            "decodes in draftsmith but cannot be exported (engines need distinct ids)"
        )
    return "\n".join(lines)
