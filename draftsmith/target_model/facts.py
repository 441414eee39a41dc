"""What a drafter needs to know of its target, read from a path (config.json + safetensors, no model load), a
draftsmith `Target`, an HF model or an HF config: sizes, RoPE, vocab (`target_facts`) and the embedding/lm_head
tensors (`target_tensors`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from draftsmith.common.errors import DraftsmithError
from draftsmith.target_model.load import hf_load_error, read_target_config, trust_remote_code


def _is_path(x: Any) -> bool:
    return isinstance(x, (str, os.PathLike))


def _target_config_dict(target: Any) -> tuple[dict, str | None]:
    if _is_path(target):
        d = read_target_config(target)
        name = str(target)
    else:
        cfg = getattr(target, "text_config", None) or getattr(target, "config", target)
        if not hasattr(cfg, "to_dict"):
            raise DraftsmithError(
                f"target: expected a model directory, a draftsmith Target or a HF config, got {type(target).__name__}"
            )
        d = cfg.to_dict()
        name = getattr(target, "path", None) or d.get("_name_or_path") or None
        name = str(name) if name else None
    if isinstance(d.get("text_config"), dict) and "hidden_size" not in d:
        d = {**d["text_config"], "architectures": d.get("architectures")}
    return d, name


def _rope_from_config(d: dict) -> tuple[float, dict | None]:
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and rp:
        theta = float(rp.get("rope_theta", d.get("rope_theta", 10000.0)))
        rtype = rp.get("rope_type", rp.get("type", "default"))
        scaling = None if rtype == "default" else {k: v for k, v in rp.items() if k != "rope_theta"}
        return theta, scaling
    theta = float(d.get("rope_theta", 10000.0) or 10000.0)
    rs = d.get("rope_scaling")
    if isinstance(rs, dict) and rs.get("rope_type", rs.get("type", "default")) != "default":
        return theta, dict(rs)
    return theta, None


def _config_dtype(d: dict) -> str | None:
    """The dtype a config names (`dtype`, transformers 5; `torch_dtype`, older), as "bfloat16"/"float32"/...;
    None when it names none ("auto" included)."""
    v = d.get("dtype") or d.get("torch_dtype")
    if v is None:
        return None
    name = str(v).replace("torch.", "")
    return None if name == "auto" else name


def target_facts(target: Any) -> dict[str, Any]:
    """The numbers of a target (path, draftsmith Target, HF model or config) that size and check a drafter."""
    d, name = _target_config_dict(target)
    try:
        h, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
        theta, scaling = _rope_from_config(d)
        return dict(
            hidden_size=h,
            intermediate_size=int(d["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or h // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            hidden_act=d.get("hidden_act", "silu"),
            vocab_size=int(d["vocab_size"]),
            num_layers=int(d["num_hidden_layers"]),
            model_type=d.get("model_type"),
            name_or_path=name,
            architectures=d.get("architectures") or [],
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            dtype=_config_dtype(d),
        )
    except KeyError as e:
        raise DraftsmithError(f"target config ({name or 'in memory'}): field {e} is missing") from None
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise DraftsmithError(
            f"target config ({name or 'in memory'}): a size field is not a positive number ({e})"
        ) from None


def target_tensors(target: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding [V, H], lm_head [V, H]) of a target; read straight from safetensors for a path."""
    if not _is_path(target):
        if hasattr(target, "embed_tokens") and hasattr(target, "lm_head"):  # draftsmith Target
            e, h = target.embed_tokens, target.lm_head
        elif hasattr(target, "get_input_embeddings"):  # HF model
            e, h = target.get_input_embeddings(), target.get_output_embeddings()
        else:
            raise DraftsmithError(f"target: cannot find the embedding and lm_head of a {type(target).__name__}")
        e = getattr(e, "weight", e)
        h = getattr(h, "weight", h) if h is not None else e
        return e.detach(), h.detach()

    root = Path(target)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        return _target_tensors_via_hf(root)
    emb_key = head_key = None
    where: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():  # noqa: SIM118
                    where[k] = f
        except Exception as e:  # noqa: BLE001 - SafetensorError/OSError: a damaged file, in one line
            raise hf_load_error(f, "target weights", e) from None
    for k in where:
        if k.endswith("embed_tokens.weight") and (emb_key is None or k.count(".") < emb_key.count(".")):
            emb_key = k
        if k.endswith("lm_head.weight") and (head_key is None or k.count(".") < head_key.count(".")):
            head_key = k
    if emb_key is None:
        return _target_tensors_via_hf(root)

    def get(k: str) -> torch.Tensor:
        try:
            with safe_open(str(where[k]), framework="pt") as sf:
                return sf.get_tensor(k)
        except Exception as e:  # noqa: BLE001 - the header parsed but the data is cut short
            raise hf_load_error(where[k], f"target weight '{k}'", e) from None

    emb = get(emb_key)
    return emb, (get(head_key) if head_key else emb)


def _target_tensors_via_hf(root: Path) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import AutoModelForCausalLM  # transformers takes ~1.8 s to import: only loading pays it

    try:
        m = AutoModelForCausalLM.from_pretrained(str(root), trust_remote_code=trust_remote_code())
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - missing/truncated/pickled weights, refused remote code: one line
        raise hf_load_error(root, "target weights", e) from None
    out = m.get_output_embeddings()
    return m.get_input_embeddings().weight.detach(), (
        out if out is not None else m.get_input_embeddings()
    ).weight.detach()


def target_weight_problems(target: Any) -> list[str]:
    """Where a target directory's safetensors contradict its config.json (embedding / lm_head shapes), read from
    the files' headers only; [] when they agree or there is nothing to check (not a path, no safetensors)."""
    if not _is_path(target):
        return []

    facts = target_facts(target)
    want = [facts["vocab_size"], facts["hidden_size"]]
    problems = []
    for f in sorted(Path(target).glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():  # noqa: SIM118
                    if k.endswith(("embed_tokens.weight", "lm_head.weight")):
                        shape = list(sf.get_slice(k).get_shape())
                        if shape != want:
                            problems.append(
                                f"{f.name}: weight '{k}' is {shape}, config.json says "
                                f"[vocab_size={want[0]}, hidden_size={want[1]}]"
                            )
        except Exception as e:  # noqa: BLE001 - a damaged file is a problem to report, not a traceback
            problems.append(str(hf_load_error(f, "target weights", e)))
    return problems
