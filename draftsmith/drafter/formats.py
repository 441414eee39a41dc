"""Checkpoint layouts: draftsmith's own, SGLang/SpecForge/ModelOpt, vLLM, speculators, official EAGLE-3.

Reading (`load_drafter`, behind `Drafter.from_pretrained`) detects the layout from config.json and the
weight names; writing: `save_native` here, the engines' layouts in `draftsmith.export.formats`. What each engine expects
(checked against their sources, see docs in `draftsmith.export`):

| layout       | config.json                                              | weights                            | aux ids |
|--------------|----------------------------------------------------------|------------------------------------|---------|
| draftsmith   | architectures [DraftsmithEagle3Drafter] + DrafterConfig   | fc, layers.N.*, norm, lm_head, d2t, t2d | `aux_layer_ids`, layer-output |
| sglang       | LlamaForCausalLMEagle3, Llama fields, eagle_config{...}   | fc, midlayer.*, norm, lm_head, d2t, t2d (opt. `model.` prefix) | `eagle_config.eagle_aux_hidden_state_layer_ids`, layer-output |
| vllm         | as sglang + top-level eagle_aux_hidden_state_layer_ids   | same (vLLM maps midlayer.->layers.0., d2t->draft_id_to_target_id) | top-level, hidden_states ids |
| speculators  | Eagle3DraftModel, speculators_model_type eagle3, transformer_layer_config | fc, layers.N.*, norm, lm_head, d2t, t2d | `eagle_aux_hidden_state_layer_ids`, hidden_states ids |
| eagle        | LlamaForCausalLMEagle3 without any aux ids; pytorch_model.bin (weights_only) or safetensors | as sglang | none: engine default [2, N//2, N-3] hidden_states ids |

draftsmith's own exports write BOTH aux fields in every layout (so each engine reads its own), and a marker file
`draftsmith_export.json` naming the layout; sglang and vllm exports then differ only in what was refused, and the
marker tells them apart (without it: the sglang layout unless the drafter is one SGLang cannot run).

The token embedding is never written; one found in a checkpoint (speculators writes its copy) is ignored:
the target's own embedding is attached instead.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from draftsmith.common.dtypes import dtype_name, torch_dtypes
from draftsmith.common.errors import DraftsmithError
from draftsmith.common.io import read_json
from draftsmith.drafter.config import NATIVE_ARCH, NATIVE_MODEL_TYPE, DrafterConfig
from draftsmith.drafter.vocab import check_mappings, identity_draft_vocab
from draftsmith.target_model.facts import _rope_from_config, target_facts, target_tensors
from draftsmith.target_model.layers import engine_default_aux_layers, from_hidden_states_ids, to_hidden_states_ids

FORMATS = ("draftsmith", "sglang", "vllm", "speculators", "eagle")
EXPORT_FORMATS = ("sglang", "vllm", "speculators")
EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
SPECULATORS_ARCHS = ("Eagle3DraftModel", "Eagle3Speculator")
_IGNORED_KEYS = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
#: Written with every drafter export (`draftsmith.export`): what was exported, in which layout, for which target.
EXPORT_MARKER = "draftsmith_export.json"
_DTYPE_NAMES = torch_dtypes()  # config dtype name -> torch dtype (draftsmith.common.dtypes)


# ============================================================================================ reading
def _read_json(p: Path) -> dict:
    return read_json(p, f"drafter file (is {p.parent} a drafter directory?)")


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """safetensors' load_file with a one-line error naming the file (truncated, corrupted, missing)."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise DraftsmithError(f"{path}: weights file not found") from None
    except Exception as e:  # noqa: BLE001 - SafetensorError / OSError: a damaged file, said in one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DraftsmithError(f"{path}: unreadable safetensors file, truncated or corrupted ({first})") from None


def read_weights(root: Path) -> tuple[dict[str, torch.Tensor], str]:
    """All tensors of a checkpoint dir: model.safetensors, sharded safetensors, or pytorch_model.bin
    (read with torch.load(weights_only=True) only: no code runs)."""
    load_file = _load_safetensors

    single = root / "model.safetensors"
    if single.is_file():
        return load_file(single), single.name
    index = root / "model.safetensors.index.json"
    if index.is_file():
        index_json = _read_json(index)
        weight_map = index_json.get("weight_map") if isinstance(index_json, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise DraftsmithError(f"{index}: field 'weight_map' must map weight names to shard file names")
        if any(Path(v).name != v for v in weight_map.values()):
            raise DraftsmithError(f"{index}: field 'weight_map' names a shard outside the directory")
        shards = sorted(set(weight_map.values()))
        out: dict[str, torch.Tensor] = {}
        for s in shards:
            out.update(load_file(root / s))
        return out, index.name
    others = sorted(root.glob("*.safetensors"))
    if len(others) == 1:
        return load_file(others[0]), others[0].name
    binf = root / "pytorch_model.bin"
    if binf.is_file():
        try:
            sd = torch.load(str(binf), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - anything but plain tensors is refused
            raise DraftsmithError(
                f"{binf}: not loadable with weights_only=True ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''})"
            ) from None
        if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
            sd = sd["state_dict"]
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise DraftsmithError(f"{binf}: expected a flat dict of tensors")
        return dict(sd), binf.name
    raise DraftsmithError(
        f"{root}: no weights found (model.safetensors, model.safetensors.index.json or pytorch_model.bin)"
    )


def read_export_marker(root: str | os.PathLike) -> dict:
    """The `draftsmith_export.json` of a drafter export ({} when absent or unreadable: it is only a hint)."""
    p = Path(root) / EXPORT_MARKER
    if not p.is_file():
        return {}
    try:
        d = read_json(p, "export marker")
    except DraftsmithError:
        return {}
    return d if isinstance(d, dict) else {}


def detect_format(
    config: dict, keys: list[str] | None = None, weights_file: str | None = None, marker: dict | None = None
) -> str:
    """One of FORMATS, from a config.json dict (and the weight names, when known; `marker`: the directory's
    draftsmith_export.json, which names the layout of our own exports)."""
    archs = config.get("architectures") or []
    if NATIVE_ARCH in archs or config.get("model_type") == NATIVE_MODEL_TYPE:
        return "draftsmith"
    if "speculators_model_type" in config or any(a in SPECULATORS_ARCHS for a in archs):
        return "speculators"
    if any(a in EAGLE3_ARCHS for a in archs) or (
        keys
        and any(k.split(".")[0] in ("midlayer", "model") for k in keys)
        and any(k.endswith("fc.weight") for k in keys)
    ):
        top = config.get("eagle_aux_hidden_state_layer_ids") is not None
        eagle_cfg = config.get("eagle_config") or {}
        nested = eagle_cfg.get("eagle_aux_hidden_state_layer_ids") is not None
        if top and nested:
            # Both fields: our own exports since both engines read this one config. The layout read is the same;
            # the name comes from the marker, else from whether SGLang could run the drafter.
            if (marker or {}).get("format") in ("sglang", "vllm"):
                return marker["format"]
            sglang_runs = int(config.get("num_hidden_layers", 1)) == 1 and not config.get("norm_before_residual")
            return "sglang" if sglang_runs else "vllm"
        if top:
            return "vllm"
        if nested:
            return "sglang"
        if weights_file == "pytorch_model.bin" or not eagle_cfg:
            return "eagle"
        return "sglang"
    raise DraftsmithError(
        f"config.json: field 'architectures' {archs}: not a known EAGLE-3 drafter layout "
        f"(expected one of {[NATIVE_ARCH, *EAGLE3_ARCHS, *SPECULATORS_ARCHS]})"
    )


def _normalize_keys(sd: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        n = k
        if n.startswith("model."):
            n = n[len("model.") :]
        if n.startswith("midlayer."):
            n = "layers.0." + n[len("midlayer.") :]
        if n == "draft_id_to_target_id":
            n = "d2t"
        if n in _IGNORED_KEYS or n.endswith("rotary_emb.inv_freq"):
            continue
        if n in out:
            raise DraftsmithError(f"{where}: weight '{k}' appears twice (with and without a prefix)")
        out[n] = v
    # vLLM builds a hidden_norm in every layer; only layer 0 uses it
    for k in [
        k
        for k in out
        if k.startswith("layers.") and k.endswith(".hidden_norm.weight") and not k.startswith("layers.0.")
    ]:
        del out[k]
    return out


def _dtype_of(d: dict) -> torch.dtype | None:
    name = d.get("torch_dtype") or d.get("dtype")
    return _DTYPE_NAMES.get(str(name)) if name else None


def _llama_fields(d: dict, where: str) -> dict[str, Any]:
    try:
        h, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
    except KeyError as e:
        raise DraftsmithError(f"{where}: field {e} is missing") from None
    theta, scaling = _rope_from_config(d)
    return dict(
        hidden_size=h,
        intermediate_size=int(d.get("intermediate_size", 0)),
        num_attention_heads=heads,
        num_key_value_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or h // heads),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
        hidden_act=d.get("hidden_act", "silu"),
        num_hidden_layers=int(d.get("num_hidden_layers", 1)),
        attention_bias=bool(d.get("attention_bias", False)),
        mlp_bias=bool(d.get("mlp_bias", False)),
    )


def config_from_external(fmt: str, d: dict, sd: dict[str, torch.Tensor], where: str) -> tuple[DrafterConfig, dict]:
    """DrafterConfig from an engine's config.json (+ weights for what the config leaves out).
    Returns (config, notes) where notes records the aux ids as written in the file."""
    notes: dict[str, Any] = {"format": fmt}
    if fmt == "speculators":
        for flag in ("norm_before_fc", "fc_norm", "norm_output"):
            if d.get(flag):
                raise DraftsmithError(
                    f"{where}: field '{flag}': true is a speculators variant draftsmith does not implement"
                )
        tl = d.get("transformer_layer_config")
        if not isinstance(tl, dict):
            raise DraftsmithError(f"{where}: field 'transformer_layer_config' is missing")
        f = _llama_fields(tl, f"{where} transformer_layer_config")
        vocab = int(tl.get("vocab_size", 0))
        aux, notes["aux_ids_as_written"] = _aux_from_fields(d, where)
        verifier = (d.get("speculators_config") or {}).get("verifier") or {}
        f.update(
            vocab_size=vocab,
            draft_vocab_size=int(d.get("draft_vocab_size") or vocab),
            target_hidden_size=d.get("target_hidden_size") or f["hidden_size"],
            norm_before_residual=bool(d.get("norm_before_residual", False)),
            aux_layer_ids=aux,
            target_name_or_path=verifier.get("name_or_path"),
            target_model_type=None,
        )
        props = (d.get("speculators_config") or {}).get("proposal_methods") or []
        if props and isinstance(props[0], dict) and "speculative_tokens" in props[0]:
            notes["speculative_tokens"] = props[0]["speculative_tokens"]
    else:  # sglang / vllm / eagle: a Llama config
        f = _llama_fields(d, where)
        vocab = int(d.get("vocab_size", 0))
        aux, notes["aux_ids_as_written"] = _aux_from_fields(d, where)
        f.update(
            vocab_size=vocab,
            draft_vocab_size=int(d.get("draft_vocab_size") or vocab),
            target_hidden_size=int(d.get("target_hidden_size") or f["hidden_size"]),
            norm_before_residual=bool(d.get("norm_before_residual", False)),
            aux_layer_ids=aux,
            target_model_type=None,
        )
        if (d.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
            raise DraftsmithError(
                f"{where}: field 'eagle_config.use_aux_hidden_state' is false (an EAGLE-1/2 style "
                "drafter); only EAGLE-3 drafters are supported"
            )
    if not vocab:
        if "t2d" in sd:
            f["vocab_size"] = int(sd["t2d"].numel())
        else:
            raise DraftsmithError(f"{where}: field 'vocab_size' (the target vocab) is missing")
        f["draft_vocab_size"] = int(d.get("draft_vocab_size") or f["vocab_size"])
    if "lm_head.weight" in sd:
        f["draft_vocab_size"] = int(sd["lm_head.weight"].shape[0])
    if "fc.weight" not in sd:
        raise DraftsmithError(f"{where}: weight 'fc.weight' is missing")
    fc_in = int(sd["fc.weight"].shape[1])
    if fc_in % int(f["target_hidden_size"]):
        raise DraftsmithError(
            f"{where}: weight 'fc.weight' has {fc_in} inputs, not a multiple of "
            f"target_hidden_size={f['target_hidden_size']}"
        )
    f["num_aux"] = fc_in // int(f["target_hidden_size"])
    if f["aux_layer_ids"] is not None and len(f["aux_layer_ids"]) != f["num_aux"]:
        raise DraftsmithError(
            f"{where}: {len(f['aux_layer_ids'])} aux layer ids but fc.weight takes {f['num_aux']} aux states"
        )
    if not f["intermediate_size"] and "layers.0.mlp.gate_proj.weight" in sd:
        f["intermediate_size"] = int(sd["layers.0.mlp.gate_proj.weight"].shape[0])
    n_layers = 1 + max([int(k.split(".")[1]) for k in sd if k.startswith("layers.")] or [0])
    f["num_hidden_layers"] = n_layers
    return DrafterConfig(**f), notes


def _aux_from_fields(d: dict, where: str) -> tuple[list[int] | None, dict]:
    """The aux layers (layer-output ids) from a config's nested `eagle_config.eagle_aux_hidden_state_layer_ids`
    (layer-output ids, SGLang) and/or top-level `eagle_aux_hidden_state_layer_ids` (hidden_states ids, vLLM and
    speculators); when both are present they must name the same layers. Also returns the fields as written."""
    nested = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = d.get("eagle_aux_hidden_state_layer_ids")
    as_written = {
        "eagle_config.eagle_aux_hidden_state_layer_ids (layer-output ids)": nested,
        "eagle_aux_hidden_state_layer_ids (hidden_states ids)": top,
    }
    try:
        aux = [int(i) for i in nested] if nested is not None else None
        top_ids = [int(i) for i in top] if top is not None else None
    except (TypeError, ValueError):
        raise DraftsmithError(
            f"{where}: fields 'eagle_aux_hidden_state_layer_ids': expected lists of integers, got {nested!r} / {top!r}"
        ) from None
    if top_ids is not None:
        top_lo = from_hidden_states_ids(top_ids, f"{where}: field 'eagle_aux_hidden_state_layer_ids'")
        if aux is not None and aux != top_lo:
            raise DraftsmithError(
                f"{where}: fields 'eagle_config.eagle_aux_hidden_state_layer_ids' {nested} (layer-output ids) and "
                f"'eagle_aux_hidden_state_layer_ids' {top} (hidden_states ids) name different layers"
            )
        aux = top_lo
    return aux, as_written


def read_checkpoint(path: str | os.PathLike, format: str | None = None):
    """(fmt, DrafterConfig, normalized state dict, notes) for a drafter directory in any layout."""
    root = Path(path)
    if not root.is_dir():
        raise DraftsmithError(f"{root}: not a directory (a drafter is a directory with config.json and weights)")
    cfg_path = root / "config.json"
    d = _read_json(cfg_path)
    if not isinstance(d, dict):
        raise DraftsmithError(f"{cfg_path}: expected a JSON object")
    raw, wfile = read_weights(root)
    marker = read_export_marker(root)
    fmt = format or detect_format(d, list(raw), wfile, marker)
    if fmt not in FORMATS:
        raise DraftsmithError(f"--format: unknown format {fmt!r} (choose from {', '.join(FORMATS)})")
    where = str(cfg_path)
    sd = _normalize_keys(raw, str(root / wfile))
    if fmt == "draftsmith":
        cfg = DrafterConfig.from_json_dict(d, where)
        notes = {"format": fmt, "aux_ids_as_written": {"aux_layer_ids (layer-output ids)": cfg.aux_layer_ids}}
    else:
        cfg, notes = config_from_external(fmt, d, sd, where)
    notes["weights_file"] = wfile
    notes["export_marker"] = marker
    # A drafter narrower than its target (hidden_size != target_hidden_size) cannot use the target's embedding;
    # EAGLE trains and ships its own in that case (cnets.py loads the target's only without target_hidden_size).
    own = next((v for k, v in raw.items() if k in ("embed_tokens.weight", "model.embed_tokens.weight")), None)
    notes["embedding"] = (
        own
        if (
            own is not None
            and cfg.hidden_size != cfg.target_hidden_size
            and tuple(own.shape) == (cfg.vocab_size, cfg.hidden_size)
        )
        else None
    )
    notes["dtype"] = _dtype_of(d) or (sd["fc.weight"].dtype if "fc.weight" in sd else torch.float32)
    return fmt, cfg, sd, notes


def load_drafter(cls, path, target=None, dtype=None, format=None):
    from draftsmith.drafter.model import fit_problems

    fmt, cfg, sd, notes = read_checkpoint(path, format)
    facts = None
    if target is not None:
        facts = target_facts(target)
        if cfg.aux_layer_ids is None and cfg.num_aux == 3:  # imported without aux ids: the engines' default
            cfg.aux_layer_ids = assume_engine_default_aux(path, facts["num_layers"])
        if cfg.target_num_layers is None:
            cfg.target_num_layers = facts["num_layers"]
        if cfg.target_model_type is None:
            cfg.target_model_type = facts["model_type"]
        if cfg.target_name_or_path is None:
            cfg.target_name_or_path = facts["name_or_path"]
        problems = fit_problems(cfg, facts)
        if problems:
            raise DraftsmithError(
                f"{path}: drafter does not fit target {facts['name_or_path']}: " + "; ".join(problems)
            )
    cfg.extra = {**cfg.extra, "source_format": fmt} if fmt != "draftsmith" else cfg.extra
    model = cls(cfg)
    _load_state(model, sd, str(path))
    model.to(dtype or notes["dtype"])
    if notes.get("embedding") is not None:
        model.set_embedding(notes["embedding"])  # the drafter's own (narrower than the target)
    elif target is not None:
        emb, _ = target_tensors(target)
        model.set_embedding(emb)
    return model


def assume_engine_default_aux(path: Any, num_layers: int) -> list[int]:
    """The engines' default aux layers for a drafter config that names none, with a warning saying so (in both
    id conventions): a drafter trained on other layers would run without error and accept few tokens."""
    import warnings

    aux = engine_default_aux_layers(num_layers)
    warnings.warn(
        f"{path}: the drafter config names no aux layers (no 'aux_layer_ids' / "
        f"'eagle_aux_hidden_state_layer_ids'); assuming the engines' default for a {num_layers}-layer "
        f"target: layer-output ids {aux} = hidden_states ids {to_hidden_states_ids(aux)}",
        UserWarning,
        stacklevel=3,
    )
    return aux


def state_problems(cfg: DrafterConfig, sd: dict[str, torch.Tensor]) -> list[str]:
    """Where a (normalized) state dict contradicts the drafter config: missing/unexpected weights, shapes,
    d2t/t2d lengths. Built on the meta device: no memory for the weights."""
    from draftsmith.drafter.model import Drafter

    with torch.device("meta"):
        own = Drafter(cfg).state_dict()
    problems = []
    optional = {"d2t", "t2d"}  # rebuilt when absent (identity vocab / from d2t)
    missing = sorted(set(own) - set(sd) - optional)
    unexpected = sorted(set(sd) - set(own))
    if missing:
        problems.append(f"missing weights {missing[:6]}{' ...' if len(missing) > 6 else ''}")
    if unexpected:
        problems.append(f"unexpected weights {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}")
    for k, v in own.items():
        if k in sd and tuple(v.shape) != tuple(sd[k].shape):
            problems.append(f"weight '{k}' has shape {list(sd[k].shape)}, the config implies {list(v.shape)}")
    return problems


def _load_state(model, sd: dict[str, torch.Tensor], where: str) -> None:
    cfg = model.config
    sd = dict(sd)
    if "d2t" not in sd:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise DraftsmithError(
                f"{where}: weight 'd2t' is missing and draft_vocab_size {cfg.draft_vocab_size} != "
                f"vocab_size {cfg.vocab_size}"
            )
        sd["d2t"], sd["t2d"] = identity_draft_vocab(cfg.vocab_size, cfg.draft_vocab_size)
    if "t2d" not in sd:
        d2t = sd["d2t"].to(torch.int64)
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[d2t + torch.arange(d2t.numel())] = True
        sd["t2d"] = t2d
    sd["d2t"], sd["t2d"] = sd["d2t"].to(torch.int64), sd["t2d"].to(torch.bool)
    check_mappings(sd["d2t"], sd["t2d"], cfg.vocab_size, where)
    problems = state_problems(cfg, sd)
    if problems:
        raise DraftsmithError(f"{where}: " + "; ".join(problems))
    own = model.state_dict()
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(sd[k].to(v.dtype))


# ============================================================================================ writing
def _cpu_tensors(model, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Weights + d2t/t2d; plus the embedding only for a drafter narrower than its target (its own then)."""
    out = {}
    items = dict(model.trainable_state_dict())
    c = model.config
    if c.hidden_size != c.target_hidden_size and model.embed_tokens is not None:
        items["embed_tokens.weight"] = model.embed_tokens.weight
    for k, v in items.items():
        v = v.detach().to("cpu")
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        out[k] = v.contiguous().clone()
    return out


def _dtype_name(sd: dict[str, torch.Tensor]) -> str:
    return dtype_name(sd["fc.weight"].dtype)


def save_native(model, path, dtype: torch.dtype | None = None) -> Path:
    from draftsmith import __version__
    from draftsmith.common.io import atomic_save_file, atomic_write_json

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    sd = _cpu_tensors(model, dtype)
    atomic_save_file(sd, root / "model.safetensors", metadata={"format": "pt"})
    cfg = model.config.to_json_dict()
    cfg["torch_dtype"] = _dtype_name(sd)
    cfg["draftsmith_version"] = __version__
    atomic_write_json(root / "config.json", cfg)
    return root
