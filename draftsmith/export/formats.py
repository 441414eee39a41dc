"""Writers of the layouts serving engines load (SGLang, vLLM, speculators); what each engine reads is in
`draftsmith/export/__init__.py`'s docstring. Reading every layout is the drafter's own job
(`draftsmith.drafter.formats`)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

from draftsmith import __version__
from draftsmith.common.errors import DraftsmithError
from draftsmith.common.io import atomic_save_file, atomic_write_json
from draftsmith.drafter.config import DrafterConfig
from draftsmith.drafter.formats import EXPORT_FORMATS, EXPORT_MARKER, _cpu_tensors, _dtype_name
from draftsmith.target_model.layers import repeated_aux_problem, to_hidden_states_ids

#: What every drafter export writes; with `--overwrite` only these are replaced in --out.
EXPORT_FILES = ("model.safetensors", "config.json", EXPORT_MARKER)


def _rope_fields(cfg: DrafterConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = dict(cfg.rope_scaling)
    return out


def llama_config_fields(cfg: DrafterConfig, dtype_name: str) -> dict[str, Any]:
    out = {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "num_hidden_layers": cfg.num_hidden_layers,
        "vocab_size": cfg.vocab_size,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "tie_word_embeddings": False,
        # Both spellings: transformers 5 reads `dtype`, SGLang/vLLM on older transformers `torch_dtype`; with
        # `--dtype auto` SGLang resolves a float32 draft config to float16, so this must be the target's dtype.
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
        **_rope_fields(cfg),
    }
    return out


def _require_aux(cfg: DrafterConfig, fmt: str) -> list[int]:
    if cfg.aux_layer_ids is None:
        raise DraftsmithError(
            f"drafter field 'aux_layer_ids' is unknown; load it with --target so the default "
            f"layers can be resolved before exporting to {fmt}"
        )
    problem = repeated_aux_problem(cfg.aux_layer_ids)
    if problem:
        raise DraftsmithError(f"drafter field 'aux_layer_ids': {problem}")
    return list(cfg.aux_layer_ids)


def aux_fields(cfg: DrafterConfig) -> dict[str, Any]:
    """The aux layers in both conventions, as every layout writes them: the nested layer-output ids SGLang reads
    and the top-level hidden_states ids vLLM (and speculators) read. With only the nested field vLLM's V1 runner
    would read the layer-output ids as hidden_states ids (every layer one too early, silently low acceptance)."""
    return {
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids), "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": to_hidden_states_ids(cfg.aux_layer_ids),
    }


def _verifier_path(name_or_path: str | None) -> str | None:
    """A local target directory as an absolute path (the export then works from any working directory); a Hub id
    as written."""
    if name_or_path and Path(name_or_path).is_dir():
        return str(Path(name_or_path).resolve())
    return name_or_path


def export_files(
    model,
    fmt: str,
    dtype: torch.dtype | None = None,
    speculative_tokens: int = 3,
    verifier_architectures: list[str] | None = None,
    target_num_layers: int | None = None,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, tensors) of `model` in layout `fmt` (one of EXPORT_FORMATS), weights cast to `dtype`
    (None: as they are). `target_num_layers` (else the drafter config's) lets the SGLang layout refuse the last
    layer's output, which SGLang cannot capture."""
    cfg: DrafterConfig = model.config
    sd = _cpu_tensors(model, dtype)
    dname = _dtype_name(sd)
    aux = _require_aux(cfg, fmt)
    n_target = target_num_layers or cfg.target_num_layers
    if fmt == "sglang" and n_target and max(aux) >= int(n_target) - 1:
        raise DraftsmithError(
            f"drafter field 'aux_layer_ids' {aux} (layer-output ids) includes the last layer's output "
            f"({int(n_target) - 1} of a {n_target}-layer target): SGLang captures layer-output id k at the entry of "
            "layer k+1, so it never captures that one; export to vllm or train with lower --aux-layers"
        )
    if fmt in ("sglang", "vllm"):
        if fmt == "sglang" and cfg.num_hidden_layers > 1:
            raise DraftsmithError(
                f"drafter field 'num_hidden_layers'={cfg.num_hidden_layers}: SGLang's LlamaForCausalLMEagle3 runs "
                "extra layers differently (its BasicDecoderLayer drops the residual); export to vllm or speculators"
            )
        if fmt == "sglang" and cfg.norm_before_residual:
            raise DraftsmithError(
                "drafter field 'norm_before_residual'=true: SGLang's LlamaForCausalLMEagle3 has no "
                "such option; export to vllm or speculators"
            )
        if cfg.num_aux != 3:
            raise DraftsmithError(
                f"drafter field 'aux_layer_ids': {cfg.num_aux} aux layers, SGLang and vLLM build fc for exactly 3"
            )
        # One config for both engines: each reads its own aux field (see `aux_fields`); the layouts differ only in
        # what is refused (SGLang runs neither extra layers the same way nor norm_before_residual).
        d = {
            "architectures": ["LlamaForCausalLMEagle3"],
            **llama_config_fields(cfg, dname),
            "draft_vocab_size": cfg.draft_vocab_size,
            **aux_fields(cfg),
        }
        if cfg.target_hidden_size != cfg.hidden_size:
            d["target_hidden_size"] = cfg.target_hidden_size
        if fmt == "vllm" and cfg.norm_before_residual:
            d["norm_before_residual"] = True
        tensors = {}
        for k, v in sd.items():
            if k.startswith("layers.0."):
                k = "midlayer." + k[len("layers.0.") :]
            tensors[k] = v
        return d, tensors
    if fmt == "speculators":
        if cfg.target_hidden_size != cfg.hidden_size:
            raise DraftsmithError(
                f"drafter field 'target_hidden_size'={cfg.target_hidden_size} != hidden_size="
                f"{cfg.hidden_size}: speculators' Eagle3DraftModel sizes fc from hidden_size only"
            )
        tl = llama_config_fields(cfg, dname)
        tl.pop("torch_dtype")
        tl.pop("rope_theta")
        tl.pop("rope_scaling", None)
        tl["rope_parameters"] = {"rope_theta": cfg.rope_theta, "rope_type": "default", **(cfg.rope_scaling or {})}
        d = {
            "architectures": ["Eagle3DraftModel"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.9.0",
            "draft_vocab_size": cfg.draft_vocab_size,
            "dtype": dname,
            # speculators and vLLM read the top-level hidden_states ids; the nested layer-output ids are there for
            # readers of the Llama-style layouts (speculators' config allows extra fields)
            **aux_fields(cfg),
            "embed_requires_grad": False,
            "fc_norm": False,
            "norm_before_fc": False,
            "norm_before_residual": cfg.norm_before_residual,
            "norm_output": False,
            "target_hidden_size": None,
            "tie_word_embeddings": False,
            "transformer_layer_config": tl,
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": int(speculative_tokens),
                        "accept_tolerance": 0.0,
                        "verifier_accept_k": 1,
                    }
                ],
                "verifier": {
                    "name_or_path": _verifier_path(cfg.target_name_or_path),
                    "architectures": list(verifier_architectures or []),
                },
            },
        }
        # speculators writes its copy of the target embedding, and needs it: Eagle3DraftModel.from_pretrained
        # (0.9.0) leaves a checkpoint's missing embed_tokens zero-initialised instead of reloading it from the
        # verifier (seen with transformers 5.17 and 5.24). vLLM loads it when present, shares the target's if not.
        if model.embed_tokens is not None:
            emb = model.embed_tokens.weight.detach().to("cpu")
            sd["embed_tokens.weight"] = emb.to(sd["fc.weight"].dtype).contiguous().clone()
        else:
            warnings.warn(
                "speculators export without embed_tokens.weight (no target embedding attached; pass "
                "--target): speculators' own Eagle3DraftModel.from_pretrained then runs with a zero "
                "embedding; vLLM is unaffected",
                stacklevel=2,
            )
        return d, sd
    raise DraftsmithError(f"--format: unknown export format {fmt!r} (choose from {', '.join(EXPORT_FORMATS)})")


def export_drafter(
    model,
    out: str | os.PathLike,
    fmt: str,
    dtype: torch.dtype | None = None,
    speculative_tokens: int = 3,
    verifier_architectures: list[str] | None = None,
    target: str | None = None,
    target_num_layers: int | None = None,
) -> Path:
    """Write `model` into `out` in layout `fmt`: the marker `draftsmith_export.json` (what is exported, for what
    target) by which a later export recognises the directory as its own and `inspect` knows the target the
    engines' layouts do not record, then model.safetensors and config.json. The marker goes first so that a rerun
    after an interrupted export is still recognised as ours."""
    d, tensors = export_files(model, fmt, dtype, speculative_tokens, verifier_architectures, target_num_layers)
    cfg: DrafterConfig = model.config
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_json(
        root / EXPORT_MARKER,
        {
            "export": "drafter",
            "format": fmt,
            "draftsmith_version": __version__,
            "dtype": _dtype_name(tensors),
            "target": _verifier_path(target or cfg.target_name_or_path),
            "target_num_layers": target_num_layers or cfg.target_num_layers,
            "aux_layer_ids": list(cfg.aux_layer_ids),
            "aux_hidden_states_ids": cfg.aux_hidden_states_ids,
            "files": ["model.safetensors", "config.json"],
        },
    )
    atomic_save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    atomic_write_json(root / "config.json", d)
    return root
