"""The target model: loading any HF causal LM, its facts (sizes, hashes), and the layer-id conventions."""

from draftsmith.target_model.layers import (
    default_aux_hidden_states_ids,
    default_aux_layers,
    from_hidden_states_ids,
    to_hidden_states_ids,
    to_layer_output_ids,
)
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
