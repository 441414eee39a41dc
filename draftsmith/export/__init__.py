"""Export a drafter to the layouts serving engines load: SGLang (also EAGLE/SpecForge/ModelOpt), vLLM,
speculators. Import is the other direction and lives in `Drafter.from_pretrained` (auto-detected).

What each engine reads (checked against their sources):
- SGLang `LlamaForCausalLMEagle3` (python/sglang/srt/models/llama_eagle3.py): Llama config with
  `num_hidden_layers`, `vocab_size` (target), `draft_vocab_size`, `target_hidden_size` (fc width),
  `tie_word_embeddings` (must be false or lm_head would be the embedding); weights `fc`, `midlayer.*`,
  `norm`, `lm_head` with or without `model.`; `d2t` becomes `hot_token_id = d2t + arange`, `t2d` is
  skipped. The aux layers come from the nested `eagle_config.eagle_aux_hidden_state_layer_ids`
  (layer-output ids). SGLang's extra layers (`BasicDecoderLayer`) drop the midlayer's residual and
  it has no `norm_before_residual`, so such drafters are refused for this format.
- vLLM `Eagle3LlamaForCausalLM` (vllm/model_executor/models/llama_eagle3.py): the same checkpoint;
  it renames `midlayer.` -> `layers.0.`, `d2t` -> `draft_id_to_target_id`, skips `t2d`, prefixes
  `model.` itself (so no prefix may be written), reads top-level `norm_before_residual`, and takes the
  aux layers from the TOP-LEVEL `eagle_aux_hidden_state_layer_ids` in hidden_states ids (absent: its
  default (2, N//2, N-3)). Both aux fields are written.
- speculators 0.9.0 `Eagle3DraftModel` (speculators/models/eagle3/{core,config}.py): `architectures
  ["Eagle3DraftModel"]`, `speculators_model_type "eagle3"`, nested `transformer_layer_config` (Llama),
  `draft_vocab_size`, `norm_before_residual`, `eagle_aux_hidden_state_layer_ids` in hidden_states ids
  (`resolve_target_layer_ids` defaults to [2, N//2, N-3] and accepts ids up to N: HF
  output_hidden_states indices), `speculators_config{algorithm, proposal_methods[greedy,
  speculative_tokens], default_proposal_method, verifier{name_or_path, architectures}}`; weights `fc`,
  `layers.N.*`, `norm`, `lm_head`, `d2t`, `t2d`, and, like speculators itself, its copy of the target's
  `embed_tokens` (speculators 0.9.0's `Eagle3DraftModel.from_pretrained` zero-initialises a missing one
  instead of reloading it from the verifier; vLLM is fine either way). This is the only layout that
  carries the embedding. `auto_map` is not written (no config.py is shipped).
- Converting our sglang export with `speculators convert --algorithm eagle3` works, but the converter
  ignores `eagle_config`'s aux ids: pass them as
  `--algorithm-kwargs '{"eagle_aux_hidden_state_layer_ids": [hidden_states ids]}'` (printed on export).
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

from draftsmith.export.formats import EXPORT_FORMATS, export_files  # noqa: F401
from draftsmith.common.errors import DraftsmithError

__all__ = ["EXPORT_FORMATS", "convert_command", "export", "export_files", "serve_command"]


def export(drafter: Any, out: str | os.PathLike, format: str, target: Any = None, dtype: Any = None,
           speculative_tokens: int = 3) -> dict:
    """Write `drafter` (a Drafter or a path in any readable layout) to `out` in `format`.
    Returns {"out", "format", "serve_command", "speculators_convert_command" (sglang only), "aux_layer_ids",
    "aux_hidden_states_ids", "notes" (warnings to show)}."""
    import torch

    from draftsmith.drafter import Drafter
    from draftsmith.export.formats import export_drafter
    from draftsmith.target_model.facts import target_facts

    if format not in EXPORT_FORMATS:
        raise DraftsmithError(f"--format: unknown format {format!r} (choose from {', '.join(EXPORT_FORMATS)})")
    if not isinstance(drafter, torch.nn.Module):
        drafter = Drafter.from_pretrained(drafter, target=target)
    elif target is not None:
        if drafter.config.aux_layer_ids is None and drafter.config.num_aux == 3:
            from draftsmith.target_model.layers import default_aux_layers

            drafter.config.aux_layer_ids = default_aux_layers(target_facts(target)["num_layers"])
        drafter.check_fits(target)
        if drafter.embed_tokens is None and drafter.config.hidden_size == drafter.config.target_hidden_size:
            from draftsmith.target_model.facts import target_tensors

            drafter.set_embedding(target_tensors(target)[0])
    cfg = drafter.config
    local_target = cfg.target_name_or_path if (cfg.target_name_or_path and target is None and
                                               (Path(cfg.target_name_or_path) / "config.json").is_file()) else None
    if drafter.embed_tokens is None and local_target and not drafter.fit_problems(local_target):
        from draftsmith.target_model.facts import target_tensors

        drafter.set_embedding(target_tensors(local_target)[0])
    archs: list[str] = []
    target_path = None
    if target is not None:
        facts = target_facts(target)
        archs, target_path = facts["architectures"], facts["name_or_path"]
    elif local_target:
        facts = target_facts(local_target)
        archs, target_path = facts["architectures"], local_target
    if target_path and not cfg.target_name_or_path:
        cfg.target_name_or_path = str(target_path)
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise DraftsmithError(f"--out {out}: exists and is not a drafter directory; choose an empty or new directory")
    export_drafter(drafter, out, format, dtype=dtype, speculative_tokens=speculative_tokens,
                   verifier_architectures=archs)
    notes = []
    if cfg.aux_layer_ids is not None and len(set(cfg.aux_layer_ids)) != len(cfg.aux_layer_ids) and format in (
            "speculators", "sglang"):
        notes.append(f"aux layers {cfg.aux_layer_ids} repeat a layer: speculators' loader "
                     "(resolve_target_layer_ids) refuses repeated ids; SGLang/vLLM serving is unaffected")
    return {
        "notes": notes,
        "out": str(out),
        "format": format,
        "serve_command": serve_command(format, out, target_path or cfg.target_name_or_path or "TARGET",
                                       speculative_tokens),
        "aux_layer_ids": cfg.aux_layer_ids,
        "aux_hidden_states_ids": cfg.aux_hidden_states_ids,
        "speculators_convert_command": (convert_command(out, target_path or cfg.target_name_or_path or "TARGET",
                                                        cfg.aux_hidden_states_ids) if format == "sglang" else None),
    }


def convert_command(sglang_dir: str | os.PathLike, target: str | os.PathLike, aux_hidden_states_ids) -> str:
    """`speculators convert` for an sglang-layout export; the aux ids must be passed (hidden_states ids):
    the converter does not read eagle_config."""
    kw = json.dumps({"eagle_aux_hidden_state_layer_ids": list(aux_hidden_states_ids or [])})
    return (f"speculators convert {shlex.quote(str(sglang_dir))} --algorithm eagle3 --verifier "
            f"{shlex.quote(str(target))} --output-path {shlex.quote(str(sglang_dir) + '-speculators')} "
            f"--algorithm-kwargs {shlex.quote(kw)}")


def serve_command(format: str, drafter_dir: str | os.PathLike, target: str | os.PathLike,
                  speculative_tokens: int = 3) -> str:
    """The command that serves the exported drafter with the engine of `format`."""
    d, t = shlex.quote(str(drafter_dir)), shlex.quote(str(target))
    if format == "sglang":
        return (f"python -m sglang.launch_server --model-path {t} --speculative-algorithm EAGLE3 "
                f"--speculative-draft-model-path {d} --speculative-num-steps {speculative_tokens} "
                f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {speculative_tokens + 1} --dtype bfloat16")
    if format == "vllm":
        spec = ('{"method": "eagle3", "model": "' + str(drafter_dir).replace('"', '\\"') +
                f'", "num_speculative_tokens": {speculative_tokens}}}')
        return f"vllm serve {t} --speculative-config {shlex.quote(spec)}"
    if format == "speculators":
        return f"vllm serve {d}    # speculators layout: vLLM reads the verifier ({target}) from its config"
    raise DraftsmithError(f"--format: unknown format {format!r} (choose from {', '.join(EXPORT_FORMATS)})")
