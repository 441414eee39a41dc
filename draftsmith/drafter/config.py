"""`DrafterConfig`: every number that shapes an EAGLE-3 drafter, plus where it came from.

Layer ids are **layer-output ids** (draftsmith's internal convention, see `draftsmith.target_model.layers`):
`aux_layer_ids=[1, 4, 7]` means the outputs of decoder layers 1, 4 and 7 of the target (HF
`output_hidden_states` indices 2, 5, 8). Engines' own conventions are converted at the edges
(`draftsmith.drafter.formats`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from draftsmith.common.errors import DraftsmithError

#: `architectures` entry of draftsmith's own config.json (what `detect_format` keys on).
NATIVE_ARCH = "DraftsmithEagle3Drafter"
NATIVE_MODEL_TYPE = "draftsmith_eagle3"
FORMAT_VERSION = 1

SUPPORTED_ACTS = ("silu", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass
class DrafterConfig:
    # drafter shape
    hidden_size: int
    target_hidden_size: int | None = None  # None -> same as hidden_size
    intermediate_size: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int | None = None  # None -> num_attention_heads
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    vocab_size: int = 0  # the TARGET's vocabulary (embedding rows, t2d length)
    draft_vocab_size: int | None = None  # None -> vocab_size
    num_hidden_layers: int = 1
    # aux layers of the target, layer-output ids; None = unknown (an imported checkpoint that does not
    # say: the engines' default [1, N//2-1, N-4] is assumed once the target's N is known, with a warning)
    aux_layer_ids: list[int] | None = None
    num_aux: int | None = None  # fc takes num_aux * target_hidden_size inputs; None -> len(aux_layer_ids) or 3
    # provenance of the target
    target_num_layers: int | None = None
    target_model_type: str | None = None
    target_name_or_path: str | None = None
    # variants
    norm_before_residual: bool = False  # speculators/vLLM flag: residual = hidden_norm(h) instead of h
    attention_bias: bool = False
    mlp_bias: bool = False
    # Llama-3 style rope scaling ({"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}) or {"rope_type": "linear", "factor"}; None = plain RoPE
    rope_scaling: dict | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # free-form notes (training settings, source format)

    def __post_init__(self) -> None:
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and self.num_attention_heads:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.aux_layer_ids is not None:
            self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
            if self.num_aux is None:
                self.num_aux = len(self.aux_layer_ids)
        if self.num_aux is None:
            self.num_aux = 3
        if self.rope_scaling is not None:
            rs = dict(self.rope_scaling)
            rtype = rs.get("rope_type", rs.get("type", "default"))
            rs["rope_type"] = rtype
            rs.pop("type", None)
            rs.pop("rope_theta", None)
            self.rope_scaling = None if rtype == "default" else rs
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        def bad(fld: str, why: str) -> DraftsmithError:
            return DraftsmithError(f"drafter config: field '{fld}': {why}")

        for name in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "draft_vocab_size",
            "num_hidden_layers",
            "target_hidden_size",
            "num_aux",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise bad(name, f"must be a positive integer, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad(
                "num_key_value_heads",
                f"{self.num_key_value_heads} does not divide num_attention_heads={self.num_attention_heads}",
            )
        if self.draft_vocab_size > self.vocab_size:
            raise bad(
                "draft_vocab_size", f"{self.draft_vocab_size} is larger than the target vocab_size {self.vocab_size}"
            )
        if self.hidden_act not in SUPPORTED_ACTS:
            raise bad("hidden_act", f"{self.hidden_act!r} not supported (supported: {', '.join(SUPPORTED_ACTS)})")
        if self.aux_layer_ids is not None:
            if len(self.aux_layer_ids) != self.num_aux:
                raise bad("aux_layer_ids", f"{len(self.aux_layer_ids)} ids but num_aux={self.num_aux}")
            if any(i < 0 for i in self.aux_layer_ids):
                raise bad("aux_layer_ids", f"negative layer-output id in {self.aux_layer_ids}")
            if self.target_num_layers is not None and max(self.aux_layer_ids) >= self.target_num_layers:
                raise bad(
                    "aux_layer_ids",
                    f"{self.aux_layer_ids} (layer-output ids) out of range for a target "
                    f"with {self.target_num_layers} layers",
                )
        if self.rope_scaling is not None:
            rtype = self.rope_scaling.get("rope_type")
            if rtype not in SUPPORTED_ROPE_TYPES:
                raise bad(
                    "rope_scaling", f"rope_type {rtype!r} not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
                )
            need = {
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                "linear": ("factor",),
            }.get(rtype, ())
            missing = [k for k in need if k not in self.rope_scaling]
            if missing:
                raise bad("rope_scaling", f"rope_type {rtype!r} needs {missing}")
        if self.head_dim % 2:
            raise bad("head_dim", f"must be even for RoPE, got {self.head_dim}")

    # --------------------------------------------------------------- helpers
    @property
    def aux_hidden_states_ids(self) -> list[int] | None:
        """The aux layers in hidden_states ids (vLLM / speculators / EAGLE convention) = layer-output + 1."""
        from draftsmith.target_model.layers import to_hidden_states_ids

        return None if self.aux_layer_ids is None else to_hidden_states_ids(self.aux_layer_ids)

    @property
    def fc_in_features(self) -> int:
        return self.num_aux * self.target_hidden_size

    def replace(self, **changes: Any) -> DrafterConfig:
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise DraftsmithError(f"drafter config: unknown field(s) {sorted(unknown)}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "drafter config") -> DrafterConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise DraftsmithError(f"{where}: unknown field(s) {unknown}")
        if "hidden_size" not in d:
            raise DraftsmithError(f"{where}: field 'hidden_size' is missing")
        try:
            return cls(**d)
        except TypeError as e:
            raise DraftsmithError(f"{where}: {e}") from None

    def to_json_dict(self) -> dict[str, Any]:
        """draftsmith's own config.json content."""
        out = {
            "architectures": [NATIVE_ARCH],
            "model_type": NATIVE_MODEL_TYPE,
            "draftsmith_format_version": FORMAT_VERSION,
            "aux_layer_ids_convention": "layer-output",
        }
        out.update(self.to_dict())
        return out

    @classmethod
    def from_json_dict(cls, d: dict[str, Any], where: str = "config.json") -> DrafterConfig:
        d = dict(d)
        for k in (
            "architectures",
            "model_type",
            "draftsmith_format_version",
            "aux_layer_ids_convention",
            "torch_dtype",
            "dtype",
            "draftsmith_version",
        ):
            d.pop(k, None)
        return cls.from_dict(d, where)

    def __str__(self) -> str:  # compact, for logs
        return json.dumps(self.to_dict(), sort_keys=True)
