"""Targets: loading any HF causal LM, layer-id conventions, and hook-based aux-state capture."""

from draftsmith.target.hooks import AuxCapture
from draftsmith.target.layers import (
    default_aux_hidden_states_ids,
    default_aux_layers,
    from_hidden_states_ids,
    to_hidden_states_ids,
)
from draftsmith.target.load import Target, load_target, target_from_model

__all__ = [
    "AuxCapture",
    "Target",
    "load_target",
    "target_from_model",
    "default_aux_layers",
    "default_aux_hidden_states_ids",
    "to_hidden_states_ids",
    "from_hidden_states_ids",
]
