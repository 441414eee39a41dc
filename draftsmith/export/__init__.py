"""Export a drafter to the layouts serving engines load: SGLang (also EAGLE/SpecForge/ModelOpt), vLLM,
speculators. Import is the other direction and lives in `Drafter.from_pretrained` (auto-detected).
User-facing description: docs/export.md.

What each engine reads (checked against their sources):
- SGLang `LlamaForCausalLMEagle3` (python/sglang/srt/models/llama_eagle3.py): Llama config with
  `num_hidden_layers`, `vocab_size` (target), `draft_vocab_size`, `target_hidden_size` (fc width),
  `tie_word_embeddings` (must be false or lm_head would be the embedding); weights `fc`, `midlayer.*`,
  `norm`, `lm_head` with or without `model.`; `d2t` becomes `hot_token_id = d2t + arange`, `t2d` is
  skipped. The aux layers come from the nested `eagle_config.eagle_aux_hidden_state_layer_ids`
  (layer-output ids; SGLang adds 1 and captures the residual stream at the entry of those layers, so the last
  layer's output cannot be captured: refused). It captures by set membership: repeated ids give fc too few
  states. Its extra draft layers run differently (they use `hidden_norm` as their pre-attention norm) and it
  has no `norm_before_residual`, so such drafters are refused for this format. With `--dtype auto` a float32
  draft config becomes a float16 drafter: the config must carry the target's dtype.
- vLLM `Eagle3LlamaForCausalLM` (vllm/model_executor/models/llama_eagle3.py): the same checkpoint;
  it renames `midlayer.` -> `layers.0.`, `d2t` -> `draft_id_to_target_id`, skips `t2d`, prefixes
  `model.` itself (so no prefix may be written), reads top-level `norm_before_residual`, and takes the
  aux layers from the TOP-LEVEL `eagle_aux_hidden_state_layer_ids` in hidden_states ids; without it the V1
  runner reads the nested layer-output ids as hidden_states ids (every layer one too early: silently low
  acceptance) and the V2 runner falls back to (2, N//2, N-3). The ids are de-duplicated. Hence every layout
  writes BOTH fields, and repeated ids are refused.
- speculators 0.9.0 `Eagle3DraftModel` (speculators/models/eagle3/{core,config}.py): `architectures
  ["Eagle3DraftModel"]`, `speculators_model_type "eagle3"`, nested `transformer_layer_config` (Llama),
  `draft_vocab_size`, `norm_before_residual`, `eagle_aux_hidden_state_layer_ids` in hidden_states ids
  (`resolve_target_layer_ids` defaults to [2, N//2, N-3] and accepts ids up to N: HF
  output_hidden_states indices), `speculators_config{algorithm, proposal_methods[greedy,
  speculative_tokens], default_proposal_method, verifier{name_or_path, architectures}}`; weights `fc`,
  `layers.N.*`, `norm`, `lm_head`, `d2t`, `t2d`, and, like speculators itself, its copy of the target's
  `embed_tokens` (speculators 0.9.0's `Eagle3DraftModel.from_pretrained` zero-initialises a missing one
  instead of reloading it from the verifier; vLLM is fine either way). This is the only layout that
  carries the embedding. `auto_map` is not written (no config.py is shipped). vLLM serves it only as
  `vllm serve TARGET --speculative-config '{"method": "eagle3", "model": DIR, ...}'`: `vllm serve DIR` needs
  the verifier to be a Hub id and raises when that path exists locally. The verifier path is written absolute.
- Every export also writes `draftsmith_export.json` (layout, target, dtype, aux ids in both conventions): a
  later export into the same directory recognises it (anything else non-empty is refused without
  `overwrite`), `Drafter.from_pretrained` names the layout from it and `inspect` the target.
- Converting our sglang export with `speculators convert --algorithm eagle3` works, but the converter
  ignores `eagle_config`'s aux ids: pass them as
  `--algorithm-kwargs '{"eagle_aux_hidden_state_layer_ids": [hidden_states ids]}'` (printed on export).
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from draftsmith.common.errors import DraftsmithError
from draftsmith.common.lazy import lazy_exports

if TYPE_CHECKING:
    from draftsmith.export.formats import EXPORT_FORMATS, export_files

__all__ = ["EXPORT_FORMATS", "convert_command", "export", "export_files", "serve_command"]
# torch-free --help: the export CLI imports this package (draftsmith/common/lazy.py)
__getattr__, __dir__ = lazy_exports(
    __name__, {"EXPORT_FORMATS": "draftsmith.export.formats", "export_files": "draftsmith.export.formats"}
)


def _resolve_dtype(dtype: Any, target_dtype: str | None) -> tuple[Any, str | None]:
    """(torch dtype or None = keep, note) for `dtype` = a torch dtype, None/"keep", "auto" (the target's) or a
    name (fp32, bf16, fp16, ...)."""
    import torch  # torch-free --help

    from draftsmith.drafter.formats import _DTYPE_NAMES  # torch-free --help

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype, None
    name = str(dtype).lower()
    if name == "keep":
        return None, None
    if name == "auto":
        if target_dtype in _DTYPE_NAMES:
            return _DTYPE_NAMES[target_dtype], None
        return None, (
            "the target's dtype is unknown (no --target, or its config names no dtype): weights kept as "
            "they are; pass --dtype bf16/fp16/fp32 to choose"
        )
    if name not in _DTYPE_NAMES:
        raise DraftsmithError(f"--dtype: unknown dtype {dtype!r} (choose from auto, fp32, bf16, fp16, keep)")
    return _DTYPE_NAMES[name], None


def _check_out(out: Path, format: str, overwrite: bool) -> list[str]:
    """Refuse an --out that would clobber something that is not an earlier export of this layout; returns notes."""
    from draftsmith.drafter.formats import read_export_marker  # torch-free --help
    from draftsmith.export.formats import EXPORT_FILES  # torch-free --help

    if out.exists() and not out.is_dir():
        raise DraftsmithError(f"--out {out}: exists and is not a directory; choose a new or empty directory")
    if not out.exists() or not any(out.iterdir()):
        return []
    marker = read_export_marker(out)
    ours = marker.get("export") == "drafter"
    if ours and marker.get("format") == format:
        return []
    if not overwrite:
        what = (
            f"a draftsmith {marker.get('format')} export, not {format}"
            if ours
            else "not a draftsmith drafter export (no draftsmith_export.json)"
        )
        raise DraftsmithError(
            f"--out {out}: directory is not empty and is {what}; choose a new or empty "
            "directory, or pass --overwrite to replace its config.json and model.safetensors"
        )
    others = sorted(
        p.name
        for p in out.iterdir()
        if p.name not in EXPORT_FILES
        and (p.suffix in (".safetensors", ".bin", ".pt", ".pth") or p.name.endswith(".index.json"))
    )
    if others:
        return [f"--overwrite left other weight files in {out} that an engine may also load: {', '.join(others)}"]
    return []


def export(
    drafter: Any,
    out: str | os.PathLike,
    format: str,
    target: Any = None,
    dtype: Any = "auto",
    speculative_tokens: int = 3,
    overwrite: bool = False,
) -> dict:
    """Write `drafter` (a Drafter or a path in any readable layout) to `out` in `format`.

    dtype: "auto" (the target's dtype, from its config; the weights as they are when it is unknown), "keep",
    "fp32"/"bf16"/"fp16" or a torch dtype. A non-empty `out` that is not an earlier export of this format is
    refused unless `overwrite`. Returns {"out", "format", "dtype", "serve_command", "speculators_convert_command"
    (sglang only), "aux_layer_ids", "aux_hidden_states_ids", "notes" (warnings to show)}."""
    import torch  # torch-free --help

    from draftsmith.drafter import Drafter  # torch-free --help
    from draftsmith.export.formats import EXPORT_FORMATS, export_drafter  # torch-free --help
    from draftsmith.target_model.facts import target_facts  # torch-free --help

    if format not in EXPORT_FORMATS:
        raise DraftsmithError(f"--format: unknown format {format!r} (choose from {', '.join(EXPORT_FORMATS)})")
    out = Path(out)
    notes = _check_out(out, format, overwrite)
    if not isinstance(drafter, torch.nn.Module):
        drafter = Drafter.from_pretrained(drafter, target=target)
    elif target is not None:
        if drafter.config.aux_layer_ids is None and drafter.config.num_aux == 3:
            # torch-free --help
            from draftsmith.drafter.formats import assume_engine_default_aux  # torch-free --help

            drafter.config.aux_layer_ids = assume_engine_default_aux("drafter", target_facts(target)["num_layers"])
        drafter.check_fits(target)
        if drafter.embed_tokens is None and drafter.config.hidden_size == drafter.config.target_hidden_size:
            # torch-free --help
            from draftsmith.target_model.facts import target_tensors  # torch-free --help

            drafter.set_embedding(target_tensors(target)[0])
    cfg = drafter.config
    local_target = (
        cfg.target_name_or_path
        if (cfg.target_name_or_path and target is None and (Path(cfg.target_name_or_path) / "config.json").is_file())
        else None
    )
    if drafter.embed_tokens is None and local_target and not drafter.fit_problems(local_target):
        # torch-free --help
        from draftsmith.target_model.facts import target_tensors  # torch-free --help

        drafter.set_embedding(target_tensors(local_target)[0])
    facts = None
    target_path = None
    if target is not None:
        facts = target_facts(target)
        target_path = facts["name_or_path"]
    elif local_target:
        facts = target_facts(local_target)
        target_path = local_target
    if target_path and not cfg.target_name_or_path:
        cfg.target_name_or_path = str(target_path)
    torch_dtype, dtype_note = _resolve_dtype(dtype, facts.get("dtype") if facts else None)
    if dtype_note:
        notes.append(dtype_note)
    export_drafter(
        drafter,
        out,
        format,
        dtype=torch_dtype,
        speculative_tokens=speculative_tokens,
        verifier_architectures=facts["architectures"] if facts else [],
        target=str(target_path) if target_path else None,
        target_num_layers=facts["num_layers"] if facts else None,
    )
    written = json.loads((out / "config.json").read_text())
    target_for_cmd = target_path or cfg.target_name_or_path or "TARGET"
    if Path(target_for_cmd).is_dir():  # absolute, so the printed command works from any directory
        target_for_cmd = str(Path(target_for_cmd).resolve())
    return {
        "notes": notes,
        "out": str(out),
        "format": format,
        "dtype": written.get("dtype"),
        "serve_command": serve_command(
            format, out.resolve(), target_for_cmd, speculative_tokens, (facts or {}).get("dtype")
        ),
        "aux_layer_ids": cfg.aux_layer_ids,
        "aux_hidden_states_ids": cfg.aux_hidden_states_ids,
        "speculators_convert_command": (
            convert_command(out.resolve(), target_for_cmd, cfg.aux_hidden_states_ids) if format == "sglang" else None
        ),
    }


def convert_command(sglang_dir: str | os.PathLike, target: str | os.PathLike, aux_hidden_states_ids) -> str:
    """`speculators convert` for an sglang-layout export; the aux ids must be passed (hidden_states ids):
    the converter does not read eagle_config."""
    kw = json.dumps({"eagle_aux_hidden_state_layer_ids": list(aux_hidden_states_ids or [])})
    return (
        f"speculators convert {shlex.quote(str(sglang_dir))} --algorithm eagle3 --verifier "
        f"{shlex.quote(str(target))} --output-path {shlex.quote(str(sglang_dir) + '-speculators')} "
        f"--algorithm-kwargs {shlex.quote(kw)}"
    )


def serve_command(
    format: str,
    drafter_dir: str | os.PathLike,
    target: str | os.PathLike,
    speculative_tokens: int = 3,
    dtype: str | None = None,
) -> str:
    """The command that serves the exported drafter with the engine of `format`. `dtype`: the target's (SGLang's
    --dtype applies to target and drafter; bfloat16 when unknown or not a half type)."""
    d, t = shlex.quote(str(drafter_dir)), shlex.quote(str(target))
    if format == "sglang":
        half = dtype if dtype in ("bfloat16", "float16") else "bfloat16"
        return (
            f"python -m sglang.launch_server --model-path {t} --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {d} --speculative-num-steps {speculative_tokens} "
            f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {speculative_tokens + 1} --dtype {half}"
        )
    if format in ("vllm", "speculators"):
        # The same for the speculators layout: `vllm serve DIR` would take the verifier from its config, and vLLM
        # accepts only a Hub id there (it raises when the path exists locally).
        spec = json.dumps(
            {"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": int(speculative_tokens)}
        )
        return f"vllm serve {t} --speculative-config {shlex.quote(spec)}"
    from draftsmith.export.formats import EXPORT_FORMATS  # torch-free --help

    raise DraftsmithError(f"--format: unknown format {format!r} (choose from {', '.join(EXPORT_FORMATS)})")
