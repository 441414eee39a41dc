"""Layer-index conventions (GUIDE §2) — the #1 source of silently low acceptance.

draftsmith uses **layer-output ids** internally: id k is the output of decoder layer k (0-based), i.e. the
residual stream after layer k, before any final norm. This is SGLang's nested
`eagle_config.eagle_aux_hidden_state_layer_ids`, SpecForge's and ModelOpt's convention.

The other convention, **hidden_states ids**, indexes HF `output_hidden_states` (0 = embeddings,
k = output of layer k-1): vLLM's top-level `eagle_aux_hidden_state_layer_ids`, speculators'
`--target-layer-ids`, the EAGLE repo. hidden_states id = layer-output id + 1.

Both defaults below name the same three tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

from draftsmith.common.errors import DraftsmithError

LAYER_OUTPUT = "layer-output"
HIDDEN_STATES = "hidden-states"
CONVENTIONS = (LAYER_OUTPUT, HIDDEN_STATES)


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high layers in layer-output ids: [1, N//2-1, N-4] (clamped into range)."""
    n = num_layers
    if n < 1:
        raise DraftsmithError(f"a target needs at least one decoder layer (got num_layers={n})")
    return [min(max(i, 0), n - 1) for i in (1, n // 2 - 1, n - 4)]


def default_aux_hidden_states_ids(num_layers: int) -> list[int]:
    """The same tensors in hidden_states ids: [2, N//2, N-3]."""
    return to_hidden_states_ids(default_aux_layers(num_layers))


def to_hidden_states_ids(layer_output_ids: Sequence[int]) -> list[int]:
    return [int(i) + 1 for i in layer_output_ids]


def from_hidden_states_ids(hidden_states_ids: Sequence[int]) -> list[int]:
    out = []
    for i in hidden_states_ids:
        if int(i) < 1:
            raise DraftsmithError(
                f"hidden_states id {i} is the embedding output, not a decoder layer output; "
                "aux layers must be decoder layer outputs (hidden_states ids >= 1)"
            )
        out.append(int(i) - 1)
    return out


def validate_aux_layers(ids: Sequence[int], num_layers: int, flag: str = "--aux-layers") -> list[int]:
    ids = [int(i) for i in ids]
    if not ids:
        raise DraftsmithError(f"{flag}: at least one aux layer is needed")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise DraftsmithError(
            f"{flag}: layer-output id(s) {bad} out of range for a target with {num_layers} layers "
            f"(valid: 0..{num_layers - 1}; hidden_states ids are these plus one)"
        )
    return ids


def parse_layer_list(text: str, flag: str = "--aux-layers") -> list[int]:
    """Parse '1,4,7' or '1 4 7' or '[1, 4, 7]'."""
    cleaned = text.strip().strip("[]").replace(",", " ").split()
    try:
        return [int(x) for x in cleaned]
    except ValueError:
        raise DraftsmithError(f"{flag}: expected comma-separated integers, got {text!r}") from None
