"""The target model: loading any HF causal LM, its facts (sizes, hashes), and the layer-id conventions."""

from __future__ import annotations

from typing import TYPE_CHECKING

from draftsmith.common.lazy import lazy_exports
from draftsmith.target_model.layers import (
    default_aux_hidden_states_ids,
    default_aux_layers,
    from_hidden_states_ids,
    to_hidden_states_ids,
    to_layer_output_ids,
)

if TYPE_CHECKING:
    from draftsmith.target_model.load import Target, load_target, target_from_model

__all__ = [
    "Target",
    "load_target",
    "target_from_model",
    "default_aux_layers",
    "default_aux_hidden_states_ids",
    "to_hidden_states_ids",
    "from_hidden_states_ids",
    "to_layer_output_ids",
]
# torch-free --help: the layer-id helpers (torch-free) are eager, loading a target is not (draftsmith/common/lazy.py)
__getattr__, __dir__ = lazy_exports(
    __name__, {n: "draftsmith.target_model.load" for n in ("Target", "load_target", "target_from_model")}
)
