"""Checkpoint layouts: draftsmith's own, SGLang/SpecForge/ModelOpt, vLLM, speculators, official EAGLE-3.

Reading (`load_drafter`, behind `Drafter.from_pretrained`) detects the layout from config.json and the
weight names; writing (`save_native`, `export_drafter`) produces each layout. What each engine expects
(checked against their sources, see docs in `draftsmith.export`):

| layout       | config.json                                              | weights                            | aux ids |
|--------------|----------------------------------------------------------|------------------------------------|---------|
| draftsmith   | architectures [DraftsmithEagle3Drafter] + DrafterConfig   | fc, layers.N.*, norm, lm_head, d2t, t2d | `aux_layer_ids`, layer-output |
| sglang       | LlamaForCausalLMEagle3, Llama fields, eagle_config{...}   | fc, midlayer.*, norm, lm_head, d2t, t2d (opt. `model.` prefix) | `eagle_config.eagle_aux_hidden_state_layer_ids`, layer-output |
| vllm         | as sglang + top-level eagle_aux_hidden_state_layer_ids   | same (vLLM maps midlayer.->layers.0., d2t->draft_id_to_target_id) | top-level, hidden_states ids |
| speculators  | Eagle3DraftModel, speculators_model_type eagle3, transformer_layer_config | fc, layers.N.*, norm, lm_head, d2t, t2d | `eagle_aux_hidden_state_layer_ids`, hidden_states ids |
| eagle        | LlamaForCausalLMEagle3 without any aux ids; pytorch_model.bin (weights_only) or safetensors | as sglang | none: engine default [2, N//2, N-3] hidden_states ids |

The token embedding is never written; one found in a checkpoint (speculators writes its copy) is ignored:
the target's own embedding is attached instead.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

from draftsmith.drafter.config import NATIVE_ARCH, NATIVE_MODEL_TYPE, DrafterConfig
from draftsmith.drafter.vocab import check_mappings, identity_draft_vocab
from draftsmith.errors import DraftsmithError
from draftsmith.utils.io import read_json

FORMATS = ("draftsmith", "sglang", "vllm", "speculators", "eagle")
EXPORT_FORMATS = ("sglang", "vllm", "speculators")
EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
SPECULATORS_ARCHS = ("Eagle3DraftModel", "Eagle3Speculator")
_IGNORED_KEYS = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
_DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# ============================================================================================ targets
def _is_path(x: Any) -> bool:
    return isinstance(x, (str, os.PathLike))


def _target_config_dict(target: Any) -> tuple[dict, str | None]:
    if _is_path(target):
        from draftsmith.target.load import read_target_config

        d = read_target_config(target)
        name = str(target)
    else:
        cfg = getattr(target, "text_config", None) or getattr(target, "config", target)
        if not hasattr(cfg, "to_dict"):
            raise DraftsmithError(f"target: expected a model directory, a draftsmith Target or a HF config, got "
                                  f"{type(target).__name__}")
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


def target_facts(target: Any) -> dict[str, Any]:
    """The numbers of a target (path, draftsmith Target, HF model or config) that size and check a drafter."""
    d, name = _target_config_dict(target)
    try:
        h, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
        theta, scaling = _rope_from_config(d)
        return dict(
            hidden_size=h, intermediate_size=int(d["intermediate_size"]), num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or h // heads), rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            hidden_act=d.get("hidden_act", "silu"), vocab_size=int(d["vocab_size"]),
            num_layers=int(d["num_hidden_layers"]), model_type=d.get("model_type"), name_or_path=name,
            architectures=d.get("architectures") or [], tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        )
    except KeyError as e:
        raise DraftsmithError(f"target config ({name or 'in memory'}): field {e} is missing") from None


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
    from safetensors import safe_open

    root = Path(target)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        return _target_tensors_via_hf(root)
    emb_key = head_key = None
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():  # noqa: SIM118
                where[k] = f
    for k in where:
        if k.endswith("embed_tokens.weight") and (emb_key is None or k.count(".") < emb_key.count(".")):
            emb_key = k
        if k.endswith("lm_head.weight") and (head_key is None or k.count(".") < head_key.count(".")):
            head_key = k
    if emb_key is None:
        return _target_tensors_via_hf(root)

    def get(k: str) -> torch.Tensor:
        with safe_open(str(where[k]), framework="pt") as sf:
            return sf.get_tensor(k)

    emb = get(emb_key)
    return emb, (get(head_key) if head_key else emb)


def _target_tensors_via_hf(root: Path) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(root))
    out = m.get_output_embeddings()
    return m.get_input_embeddings().weight.detach(), (out if out is not None else m.get_input_embeddings()).weight.detach()


# ============================================================================================ reading
def _read_json(p: Path) -> dict:
    return read_json(p, f"drafter file (is {p.parent} a drafter directory?)")


def read_weights(root: Path) -> tuple[dict[str, torch.Tensor], str]:
    """All tensors of a checkpoint dir: model.safetensors, sharded safetensors, or pytorch_model.bin
    (read with torch.load(weights_only=True) only: no code runs)."""
    from safetensors.torch import load_file

    single = root / "model.safetensors"
    if single.is_file():
        return load_file(str(single)), single.name
    index = root / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(_read_json(index).get("weight_map", {}).values()))
        out: dict[str, torch.Tensor] = {}
        for s in shards:
            out.update(load_file(str(root / s)))
        return out, index.name
    others = sorted(root.glob("*.safetensors"))
    if len(others) == 1:
        return load_file(str(others[0])), others[0].name
    binf = root / "pytorch_model.bin"
    if binf.is_file():
        try:
            sd = torch.load(str(binf), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - anything but plain tensors is refused
            raise DraftsmithError(f"{binf}: not loadable with weights_only=True ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''})") from None
        if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
            sd = sd["state_dict"]
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise DraftsmithError(f"{binf}: expected a flat dict of tensors")
        return dict(sd), binf.name
    raise DraftsmithError(f"{root}: no weights found (model.safetensors, model.safetensors.index.json or "
                          "pytorch_model.bin)")


def detect_format(config: dict, keys: list[str] | None = None, weights_file: str | None = None) -> str:
    """One of FORMATS, from a config.json dict (and the weight names, when known)."""
    archs = config.get("architectures") or []
    if NATIVE_ARCH in archs or config.get("model_type") == NATIVE_MODEL_TYPE:
        return "draftsmith"
    if "speculators_model_type" in config or any(a in SPECULATORS_ARCHS for a in archs):
        return "speculators"
    if any(a in EAGLE3_ARCHS for a in archs) or (keys and any(k.split(".")[0] in ("midlayer", "model") for k in keys)
                                                  and any(k.endswith("fc.weight") for k in keys)):
        if config.get("eagle_aux_hidden_state_layer_ids") is not None:
            return "vllm"
        eagle_cfg = config.get("eagle_config") or {}
        if eagle_cfg.get("eagle_aux_hidden_state_layer_ids") is not None:
            return "sglang"
        if weights_file == "pytorch_model.bin" or not eagle_cfg:
            return "eagle"
        return "sglang"
    raise DraftsmithError(f"config.json: field 'architectures' {archs}: not a known EAGLE-3 drafter layout "
                          f"(expected one of {[NATIVE_ARCH, *EAGLE3_ARCHS, *SPECULATORS_ARCHS]})")


def _normalize_keys(sd: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        n = k
        if n.startswith("model."):
            n = n[len("model."):]
        if n.startswith("midlayer."):
            n = "layers.0." + n[len("midlayer."):]
        if n == "draft_id_to_target_id":
            n = "d2t"
        if n in _IGNORED_KEYS or n.endswith("rotary_emb.inv_freq"):
            continue
        if n in out:
            raise DraftsmithError(f"{where}: weight '{k}' appears twice (with and without a prefix)")
        out[n] = v
    # vLLM builds a hidden_norm in every layer; only layer 0 uses it
    for k in [k for k in out if k.startswith("layers.") and k.endswith(".hidden_norm.weight") and not k.startswith("layers.0.")]:
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
        hidden_size=h, intermediate_size=int(d.get("intermediate_size", 0)), num_attention_heads=heads,
        num_key_value_heads=int(d.get("num_key_value_heads") or heads), head_dim=int(d.get("head_dim") or h // heads),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)), hidden_act=d.get("hidden_act", "silu"),
        num_hidden_layers=int(d.get("num_hidden_layers", 1)), attention_bias=bool(d.get("attention_bias", False)),
        mlp_bias=bool(d.get("mlp_bias", False)),
    )


def config_from_external(fmt: str, d: dict, sd: dict[str, torch.Tensor], where: str) -> tuple[DrafterConfig, dict]:
    """DrafterConfig from an engine's config.json (+ weights for what the config leaves out).
    Returns (config, notes) where notes records the aux ids as written in the file."""
    notes: dict[str, Any] = {"format": fmt}
    if fmt == "speculators":
        for flag in ("norm_before_fc", "fc_norm", "norm_output"):
            if d.get(flag):
                raise DraftsmithError(f"{where}: field '{flag}': true is a speculators variant draftsmith does not "
                                      "implement")
        tl = d.get("transformer_layer_config")
        if not isinstance(tl, dict):
            raise DraftsmithError(f"{where}: field 'transformer_layer_config' is missing")
        f = _llama_fields(tl, f"{where} transformer_layer_config")
        vocab = int(tl.get("vocab_size", 0))
        hs_ids = d.get("eagle_aux_hidden_state_layer_ids")
        notes["aux_ids_as_written"] = {"eagle_aux_hidden_state_layer_ids (hidden_states ids)": hs_ids}
        aux = None if hs_ids is None else _from_hs(hs_ids, where, "eagle_aux_hidden_state_layer_ids")
        verifier = ((d.get("speculators_config") or {}).get("verifier") or {})
        f.update(vocab_size=vocab, draft_vocab_size=int(d.get("draft_vocab_size") or vocab),
                 target_hidden_size=d.get("target_hidden_size") or f["hidden_size"],
                 norm_before_residual=bool(d.get("norm_before_residual", False)), aux_layer_ids=aux,
                 target_name_or_path=verifier.get("name_or_path"),
                 target_model_type=None)
        props = (d.get("speculators_config") or {}).get("proposal_methods") or []
        if props and isinstance(props[0], dict) and "speculative_tokens" in props[0]:
            notes["speculative_tokens"] = props[0]["speculative_tokens"]
    else:  # sglang / vllm / eagle: a Llama config
        f = _llama_fields(d, where)
        vocab = int(d.get("vocab_size", 0))
        nested = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        top = d.get("eagle_aux_hidden_state_layer_ids")
        notes["aux_ids_as_written"] = {"eagle_config.eagle_aux_hidden_state_layer_ids (layer-output ids)": nested,
                                       "eagle_aux_hidden_state_layer_ids (hidden_states ids)": top}
        aux = [int(i) for i in nested] if nested is not None else None
        if top is not None:
            top_lo = _from_hs(top, where, "eagle_aux_hidden_state_layer_ids")
            if aux is not None and aux != top_lo:
                raise DraftsmithError(
                    f"{where}: fields 'eagle_config.eagle_aux_hidden_state_layer_ids' {nested} (layer-output ids) and "
                    f"'eagle_aux_hidden_state_layer_ids' {top} (hidden_states ids) name different layers")
            aux = top_lo
        f.update(vocab_size=vocab, draft_vocab_size=int(d.get("draft_vocab_size") or vocab),
                 target_hidden_size=int(d.get("target_hidden_size") or f["hidden_size"]),
                 norm_before_residual=bool(d.get("norm_before_residual", False)), aux_layer_ids=aux,
                 target_model_type=None)
        if (d.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
            raise DraftsmithError(f"{where}: field 'eagle_config.use_aux_hidden_state' is false (an EAGLE-1/2 style "
                                  "drafter); only EAGLE-3 drafters are supported")
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
        raise DraftsmithError(f"{where}: weight 'fc.weight' has {fc_in} inputs, not a multiple of "
                              f"target_hidden_size={f['target_hidden_size']}")
    f["num_aux"] = fc_in // int(f["target_hidden_size"])
    if f["aux_layer_ids"] is not None and len(f["aux_layer_ids"]) != f["num_aux"]:
        raise DraftsmithError(f"{where}: {len(f['aux_layer_ids'])} aux layer ids but fc.weight takes "
                              f"{f['num_aux']} aux states")
    if not f["intermediate_size"] and "layers.0.mlp.gate_proj.weight" in sd:
        f["intermediate_size"] = int(sd["layers.0.mlp.gate_proj.weight"].shape[0])
    n_layers = 1 + max([int(k.split(".")[1]) for k in sd if k.startswith("layers.")] or [0])
    f["num_hidden_layers"] = n_layers
    return DrafterConfig(**f), notes


def _from_hs(ids: Any, where: str, fld: str) -> list[int]:
    ids = [int(i) for i in ids]
    if any(i < 1 for i in ids):
        raise DraftsmithError(f"{where}: field '{fld}' {ids}: hidden_states id 0 is the embedding output, not a layer")
    return [i - 1 for i in ids]


def read_checkpoint(path: str | os.PathLike, format: str | None = None):
    """(fmt, DrafterConfig, normalized state dict, notes) for a drafter directory in any layout."""
    root = Path(path)
    if not root.is_dir():
        raise DraftsmithError(f"{root}: not a directory (a drafter is a directory with config.json and weights)")
    cfg_path = root / "config.json"
    d = _read_json(cfg_path)
    raw, wfile = read_weights(root)
    fmt = format or detect_format(d, list(raw), wfile)
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
    # A drafter narrower than its target (hidden_size != target_hidden_size) cannot use the target's embedding;
    # EAGLE trains and ships its own in that case (cnets.py loads the target's only without target_hidden_size).
    own = next((v for k, v in raw.items() if k in ("embed_tokens.weight", "model.embed_tokens.weight")), None)
    notes["embedding"] = own if (own is not None and cfg.hidden_size != cfg.target_hidden_size and
                                 tuple(own.shape) == (cfg.vocab_size, cfg.hidden_size)) else None
    notes["dtype"] = _dtype_of(d) or (sd["fc.weight"].dtype if "fc.weight" in sd else torch.float32)
    return fmt, cfg, sd, notes


def load_drafter(cls, path, target=None, dtype=None, format=None):
    from draftsmith.drafter.model import fit_problems

    fmt, cfg, sd, notes = read_checkpoint(path, format)
    facts = None
    if target is not None:
        facts = target_facts(target)
        if cfg.aux_layer_ids is None:  # imported without aux ids: the engines' default for this target
            from draftsmith.target.layers import default_aux_layers

            cfg.aux_layer_ids = default_aux_layers(facts["num_layers"]) if cfg.num_aux == 3 else None
        if cfg.target_num_layers is None:
            cfg.target_num_layers = facts["num_layers"]
        if cfg.target_model_type is None:
            cfg.target_model_type = facts["model_type"]
        if cfg.target_name_or_path is None:
            cfg.target_name_or_path = facts["name_or_path"]
        problems = fit_problems(cfg, facts)
        if problems:
            raise DraftsmithError(f"{path}: drafter does not fit target {facts['name_or_path']}: " + "; ".join(problems))
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


def _load_state(model, sd: dict[str, torch.Tensor], where: str) -> None:
    cfg = model.config
    sd = dict(sd)
    if "d2t" not in sd:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise DraftsmithError(f"{where}: weight 'd2t' is missing and draft_vocab_size {cfg.draft_vocab_size} != "
                                  f"vocab_size {cfg.vocab_size}")
        sd["d2t"], sd["t2d"] = identity_draft_vocab(cfg.vocab_size, cfg.draft_vocab_size)
    if "t2d" not in sd:
        d2t = sd["d2t"].to(torch.int64)
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[d2t + torch.arange(d2t.numel())] = True
        sd["t2d"] = t2d
    sd["d2t"], sd["t2d"] = sd["d2t"].to(torch.int64), sd["t2d"].to(torch.bool)
    check_mappings(sd["d2t"], sd["t2d"], cfg.vocab_size, where)
    own = model.state_dict()
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing weights {missing[:6]}{' ...' if len(missing) > 6 else ''}")
        if unexpected:
            parts.append(f"unexpected weights {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}")
        raise DraftsmithError(f"{where}: " + "; ".join(parts))
    for k, v in own.items():
        if tuple(v.shape) != tuple(sd[k].shape):
            raise DraftsmithError(f"{where}: weight '{k}' has shape {list(sd[k].shape)}, the config implies "
                                  f"{list(v.shape)}")
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
    return str(sd["fc.weight"].dtype).replace("torch.", "")


def save_native(model, path, dtype: torch.dtype | None = None) -> Path:
    from draftsmith import __version__
    from draftsmith.utils.io import atomic_save_file, atomic_write_json

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    sd = _cpu_tensors(model, dtype)
    atomic_save_file(sd, root / "model.safetensors", metadata={"format": "pt"})
    cfg = model.config.to_json_dict()
    cfg["torch_dtype"] = _dtype_name(sd)
    cfg["draftsmith_version"] = __version__
    atomic_write_json(root / "config.json", cfg)
    return root


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
        "torch_dtype": dtype_name,
        **_rope_fields(cfg),
    }
    return out


def _require_aux(cfg: DrafterConfig, fmt: str) -> list[int]:
    if cfg.aux_layer_ids is None:
        raise DraftsmithError(f"drafter field 'aux_layer_ids' is unknown; load it with --target so the default "
                              f"layers can be resolved before exporting to {fmt}")
    return list(cfg.aux_layer_ids)


def export_files(model, fmt: str, dtype: torch.dtype | None = None,
                 speculative_tokens: int = 3, verifier_architectures: list[str] | None = None
                 ) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, tensors) of `model` in layout `fmt` (one of EXPORT_FORMATS)."""
    cfg: DrafterConfig = model.config
    sd = _cpu_tensors(model, dtype)
    dname = _dtype_name(sd)
    aux = _require_aux(cfg, fmt)
    if fmt in ("sglang", "vllm"):
        if fmt == "sglang" and cfg.num_hidden_layers > 1:
            raise DraftsmithError(
                f"drafter field 'num_hidden_layers'={cfg.num_hidden_layers}: SGLang's LlamaForCausalLMEagle3 runs "
                "extra layers differently (its BasicDecoderLayer drops the residual); export to vllm or speculators")
        if fmt == "sglang" and cfg.norm_before_residual:
            raise DraftsmithError("drafter field 'norm_before_residual'=true: SGLang's LlamaForCausalLMEagle3 has no "
                                  "such option; export to vllm or speculators")
        if cfg.num_aux != 3:
            raise DraftsmithError(f"drafter field 'aux_layer_ids': {cfg.num_aux} aux layers, SGLang and vLLM build "
                                  "fc for exactly 3")
        d = {"architectures": ["LlamaForCausalLMEagle3"], **llama_config_fields(cfg, dname),
             "draft_vocab_size": cfg.draft_vocab_size,
             "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True}}
        if cfg.target_hidden_size != cfg.hidden_size:
            d["target_hidden_size"] = cfg.target_hidden_size
        if fmt == "vllm":
            d["eagle_aux_hidden_state_layer_ids"] = cfg.aux_hidden_states_ids
            if cfg.norm_before_residual:
                d["norm_before_residual"] = True
        tensors = {}
        for k, v in sd.items():
            if k.startswith("layers.0."):
                k = "midlayer." + k[len("layers.0."):]
            tensors[k] = v
        return d, tensors
    if fmt == "speculators":
        if cfg.target_hidden_size != cfg.hidden_size:
            raise DraftsmithError(f"drafter field 'target_hidden_size'={cfg.target_hidden_size} != hidden_size="
                                  f"{cfg.hidden_size}: speculators' Eagle3DraftModel sizes fc from hidden_size only")
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
            "eagle_aux_hidden_state_layer_ids": cfg.aux_hidden_states_ids,
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
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                      "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                "verifier": {"name_or_path": cfg.target_name_or_path,
                             "architectures": list(verifier_architectures or [])},
            },
        }
        # speculators writes its copy of the target embedding, and needs it: Eagle3DraftModel.from_pretrained
        # (0.9.0) leaves a checkpoint's missing embed_tokens zero-initialised instead of reloading it from the
        # verifier (seen with transformers 5.17 and 5.24). vLLM loads it when present, shares the target's if not.
        if model.embed_tokens is not None:
            emb = model.embed_tokens.weight.detach().to("cpu")
            sd["embed_tokens.weight"] = emb.to(sd["fc.weight"].dtype).contiguous().clone()
        else:
            warnings.warn("speculators export without embed_tokens.weight (no target embedding attached; pass "
                          "--target): speculators' own Eagle3DraftModel.from_pretrained then runs with a zero "
                          "embedding; vLLM is unaffected", stacklevel=2)
        return d, sd
    raise DraftsmithError(f"--format: unknown export format {fmt!r} (choose from {', '.join(EXPORT_FORMATS)})")


def export_drafter(model, out: str | os.PathLike, fmt: str, dtype: torch.dtype | None = None,
                   speculative_tokens: int = 3, verifier_architectures: list[str] | None = None) -> Path:
    from draftsmith.utils.io import atomic_save_file, atomic_write_json

    d, tensors = export_files(model, fmt, dtype, speculative_tokens, verifier_architectures)
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    atomic_save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    atomic_write_json(root / "config.json", d)
    return root
