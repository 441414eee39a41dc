"""Layer-index conventions (docs/eagle3.md#layer-ids) — the #1 source of silently low acceptance.

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


def engine_default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high layers in layer-output ids, [1, N//2-1, N-4] clamped into range: what SGLang, vLLM
    and the EAGLE repo assume for a checkpoint that names no aux layers (vLLM: hidden_states ids (2, N//2, N-3)).
    Below 7 layers some of them coincide (N=6: [1, 2, 2]); use this only to read such checkpoints."""
    n = num_layers
    if n < 1:
        raise DraftsmithError(f"a target needs at least one decoder layer (got num_layers={n})")
    return [min(max(i, 0), n - 1) for i in (1, n // 2 - 1, n - 4)]


def default_aux_layers(num_layers: int) -> list[int]:
    """The aux layers draftsmith picks for a new store/drafter, in layer-output ids.

    Rule: EAGLE-3's low/mid/high [1, N//2-1, N-4] whenever those are distinct (N >= 7: the engines' own default,
    so a checkpoint that does not name its layers still serves right). Below that, three consecutive layers
    [a, a+1, a+2] that avoid the last layer where possible (a = 1 for N = 5..6, a = 0 for N = 3..4): N=6 and N=5
    -> [1, 2, 3], N=4 -> [0, 1, 2], N=3 -> [0, 1, 2] (includes the last layer: vLLM captures it, SGLang cannot).
    Only N <= 2 has too few layers for three distinct ids (N=2 -> [0, 1, 1], N=1 -> [0, 0, 0]); such ids train
    and decode in draftsmith but cannot be exported (SGLang captures aux states by set membership and vLLM
    de-duplicates the ids, so either engine would hand fc fewer states than it was trained on).

    Why distinct and why not the last layer: SGLang captures layer-output id k at the entry of decoder layer k+1,
    so the last layer's output (k = N-1) is never captured there."""
    eagle3 = engine_default_aux_layers(num_layers)
    n = num_layers
    if len(set(eagle3)) == len(eagle3) and max(eagle3) <= n - 2:
        return eagle3
    start = 1 if n >= 5 else 0
    return [min(start + j, n - 1) for j in range(3)]


def repeated_aux_problem(layer_output_ids: Sequence[int] | None) -> str | None:
    """A one-line reason why repeated aux ids cannot be served, or None when they are distinct (or unknown)."""
    if layer_output_ids is None:
        return None
    ids = [int(i) for i in layer_output_ids]
    if len(set(ids)) == len(ids):
        return None
    return (
        f"aux layers {ids} (layer-output ids) = {to_hidden_states_ids(ids)} (hidden_states ids) repeat a layer: "
        "SGLang captures aux states by set membership and vLLM de-duplicates the ids, so either engine would "
        f"feed fc {len(set(ids))} states instead of {len(ids)}; train with distinct --aux-layers"
    )


def default_aux_hidden_states_ids(num_layers: int) -> list[int]:
    """The same tensors as `default_aux_layers`, in hidden_states ids (each + 1)."""
    return to_hidden_states_ids(default_aux_layers(num_layers))


def to_hidden_states_ids(layer_output_ids: Sequence[int]) -> list[int]:
    """layer-output ids -> hidden_states ids (HF `output_hidden_states` indices): each + 1."""
    return [int(i) + 1 for i in layer_output_ids]


def to_layer_output_ids(hidden_states_ids: Sequence[int]) -> list[int]:
    """hidden_states ids -> layer-output ids: each - 1, unchecked (hidden_states id 0, the embedding output, gives
    -1). For reporting what a file names; `from_hidden_states_ids` is the checked form for user input."""
    return [int(i) - 1 for i in hidden_states_ids]


def from_hidden_states_ids(hidden_states_ids: Sequence[int], where: str = "") -> list[int]:
    """hidden_states ids -> layer-output ids (each - 1); id 0 (the embedding output) is refused. `where` prefixes
    the error (file and field)."""
    for i in hidden_states_ids:
        if int(i) < 1:
            raise DraftsmithError(
                f"{where + ': ' if where else ''}hidden_states id {i} is the embedding output, not a decoder layer "
                "output; aux layers must be decoder layer outputs (hidden_states ids >= 1)"
            )
    return to_layer_output_ids(hidden_states_ids)


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
