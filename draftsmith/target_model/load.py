"""Loading any Hugging Face decoder-only causal LM as a draftsmith `Target`.

We never edit model source: the target is the stock HF module, and everything draftsmith needs
(decoder layers for hooks, final norm and lm_head for the teacher, the embedding for the drafter) is
located on it generically.

Remote code: every transformers loader here (config, tokenizer, model) is called with
`trust_remote_code=False` unless the user opts in, so a model directory whose config names Python files in
`auto_map` never runs them (and transformers never stops to ask on stdin). Opt in with the
`--trust-remote-code` flag of `inspect`, `export`, `capture` and `train` (each a `trust_remote_code_scope` around
its work), or `DRAFTSMITH_TRUST_REMOTE_CODE=1` for every command (generate, eval, serve and doctor have no flag).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftsmith.common import dtypes
from draftsmith.common.dtypes import torch_dtypes
from draftsmith.common.errors import DraftsmithError
from draftsmith.common.hf import text_config
from draftsmith.target_model.layers import default_aux_layers

DTYPES = {"auto": "auto", **torch_dtypes()}  # the names --dtype/--model-dtype take (draftsmith.common.dtypes)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


TRUST_REMOTE_CODE_ENV = "DRAFTSMITH_TRUST_REMOTE_CODE"
_trust_remote_code_override: list[bool] = []


def trust_remote_code(explicit: bool | None = None) -> bool:
    """Whether transformers may run code from a model directory: `explicit` if given, else the innermost
    `trust_remote_code_scope`, else DRAFTSMITH_TRUST_REMOTE_CODE=1. Off by default."""
    if explicit is not None:
        return bool(explicit)
    if _trust_remote_code_override:
        return _trust_remote_code_override[-1]
    return os.environ.get(TRUST_REMOTE_CODE_ENV, "").strip().lower() in ("1", "true", "yes")


@contextlib.contextmanager
def trust_remote_code_scope(allow: bool):
    """Within the scope, loaders trust remote code iff `allow` or the environment variable says so (a CLI's
    --trust-remote-code flag)."""
    _trust_remote_code_override.append(bool(allow) or trust_remote_code())
    try:
        yield
    finally:
        _trust_remote_code_override.pop()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def hf_load_error(path: str | os.PathLike, what: str, e: BaseException) -> DraftsmithError:
    """A transformers loading failure as one line naming the directory: remote code refused, pickle refused,
    missing / truncated / corrupted weights."""
    msg = _first_line(e)
    low = str(e).lower()
    if "trust_remote_code" in low or "custom code" in low:
        return DraftsmithError(
            f"{path}: {what} needs the Python code shipped in the directory (config auto_map); "
            f"refused by default — pass --trust-remote-code (or {TRUST_REMOTE_CODE_ENV}=1) "
            "if you trust it"
        )
    if isinstance(e, OSError) and ("no file named" in low or "does not appear to have" in low):
        return DraftsmithError(
            f"{path}: {what}: no weights found (model.safetensors, sharded safetensors or pytorch_model.bin)"
        )
    if "weights_only" in low or "unpickl" in low:
        return DraftsmithError(
            f"{path}: {what}: a pickle weights file (.bin) holds more than tensors and was "
            "refused (only plain tensors are loaded, with weights_only=True); convert it to "
            "safetensors"
        )
    if "safetensor" in low or "header" in low or "incomplete" in low or "deserializ" in low:
        return DraftsmithError(f"{path}: {what}: a safetensors file is truncated or corrupted ({msg})")
    return DraftsmithError(f"{path}: cannot load {what} ({type(e).__name__}: {msg})")


def parse_dtype(name: str | torch.dtype) -> Any:
    return dtypes.parse_dtype(name, "--dtype")


def _canonical_config(config_dict: dict) -> dict:
    # Fields that change with how a model is loaded or saved, not with what it computes.
    volatile = {
        "transformers_version",
        "_name_or_path",
        "torch_dtype",
        "dtype",
        "use_cache",
        "_attn_implementation",
        "_commit_hash",
        "tp_plan",
        "base_model_tp_plan",
    }
    return {k: v for k, v in sorted(config_dict.items()) if k not in volatile}


def read_target_config(path: str | os.PathLike) -> dict:
    """The raw config.json of a target directory, with a one-line error naming the file."""
    p = Path(path) / "config.json"
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        raise DraftsmithError(f"{p}: not found — is {path} a Hugging Face model directory?") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DraftsmithError(f"{p}: invalid JSON ({e})") from None
    if not isinstance(d, dict):
        raise DraftsmithError(f"{p}: expected a JSON object, got {type(d).__name__}")
    return d


def config_hash(path: str | os.PathLike) -> str:
    """sha256 of the target's config.json (volatile fields removed): names the architecture + sizes."""
    cfg = read_target_config(path)
    blob = json.dumps(_canonical_config(cfg), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()


def tokenizer_hash(path: str | os.PathLike) -> str:
    """sha256 over the tokenizer files present in the target directory."""
    h = hashlib.sha256()
    found = False
    for name in TOKENIZER_FILES:
        p = Path(path) / name
        if p.is_file():
            found = True
            h.update(name.encode() + b"\0")
            h.update(p.read_bytes())
    return h.hexdigest() if found else ""


def _find_decoder_layers(model: torch.nn.Module, num_layers: int) -> torch.nn.ModuleList:
    base = getattr(model, "model", None)
    if base is not None and isinstance(getattr(base, "layers", None), torch.nn.ModuleList):
        return base.layers
    # Generic fallback: the ModuleList with one entry per hidden layer (GPT-2's `h`, etc.).
    for _, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == num_layers:
            return mod
    raise DraftsmithError(f"cannot find the {num_layers} decoder layers of {type(model).__name__}")


def _find_final_norm(model: torch.nn.Module) -> torch.nn.Module:
    base = getattr(model, "model", None) or getattr(model, "transformer", None)
    for name in ("norm", "final_layernorm", "ln_f", "final_norm"):
        mod = getattr(base, name, None)
        if isinstance(mod, torch.nn.Module):
            return mod
    raise DraftsmithError(f"cannot find the final norm of {type(model).__name__}")


@dataclass
class Target:
    """A loaded HF causal LM plus the handles draftsmith uses."""

    path: str
    model: torch.nn.Module
    tokenizer: Any
    config: Any
    config_hash: str
    tokenizer_hash: str
    layers: torch.nn.ModuleList = field(repr=False)
    final_norm: torch.nn.Module = field(repr=False)

    @property
    def decoder(self) -> torch.nn.Module:
        """The base decoder (no lm_head): capture runs this, skipping the [T, V] logits it does not need."""
        return self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model

    @property
    def text_config(self) -> Any:
        return text_config(self.config)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.text_config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.text_config.vocab_size)

    @property
    def embed_tokens(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    @property
    def default_aux_layers(self) -> list[int]:
        return default_aux_layers(self.num_layers)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def identity(self) -> dict:
        """What a store/drafter records about the target that produced it."""
        return {
            "path": self.path,
            "model_type": getattr(self.text_config, "model_type", None),
            "architectures": list(getattr(self.config, "architectures", None) or []),
            "config_hash": self.config_hash,
            "tokenizer_hash": self.tokenizer_hash,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
        }


def load_tokenizer(path: str | os.PathLike, trust_remote_code: bool | None = None):
    """The target's tokenizer alone (cheap: lets a job validate its data before loading weights)."""
    from transformers import AutoTokenizer  # transformers takes ~1.8 s to import: only loading pays it

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=_trust(trust_remote_code))
    except (ValueError, OSError, KeyError, TypeError) as e:
        raise hf_load_error(path, "tokenizer", e) from None


def _trust(explicit: bool | None) -> bool:
    return trust_remote_code(explicit)


_load_tokenizer = load_tokenizer  # (load_target's flag of the same name shadows it)


def load_target(
    path: str | os.PathLike,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    tp_plan: str | None = None,
    attn_implementation: str | None = None,
    load_tokenizer: bool = True,
    tokenizer=None,
    trust_remote_code: bool | None = None,
) -> Target:
    """Load an HF causal LM directory. `tp_plan="auto"` (under torchrun) shards it with tensor parallelism.
    `trust_remote_code`: None = off unless opted in (see the module docstring)."""
    # transformers takes ~1.8 s to import: only loading pays it
    from transformers import AutoConfig, AutoModelForCausalLM

    path = str(path)
    if not Path(path).is_dir():
        raise DraftsmithError(f"{path}: target not found (expected a Hugging Face model directory)")
    chash = config_hash(path)
    trust = _trust(trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
    except (ValueError, KeyError, OSError, TypeError) as e:
        raise hf_load_error(f"{path}/config.json", "config", e) from None
    kwargs: dict[str, Any] = {"dtype": parse_dtype(dtype), "trust_remote_code": trust}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if tp_plan:
        kwargs["tp_plan"] = tp_plan
    model = None
    if not tp_plan and torch.device(device).type == "cuda":
        # Straight from the safetensors files to the GPU: no host copy of a large target (8B: ~2x faster).
        # Any failure here (no accelerate, an old transformers) falls back to the host load below.
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, config=config, device_map=str(torch.device(device)), **kwargs
            )
        except Exception as e:  # noqa: BLE001 - any loader failure: say it once, then the host path decides
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            warnings.warn(
                f"{path}: loading straight to {device} failed ({type(e).__name__}: {first}); "
                f"loading through host memory",
                stacklevel=2,
            )
            model = None
    try:
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(path, config=config, **kwargs)
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - missing/truncated/corrupted/pickled weights: one line, not a traceback
        raise hf_load_error(path, "target weights", e) from None
    if not tp_plan:
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    tok = tokenizer
    if tok is None and load_tokenizer:
        tok = _load_tokenizer(path, trust_remote_code=trust)
    text_cfg = text_config(config)
    layers = _find_decoder_layers(model, int(text_cfg.num_hidden_layers))
    return Target(
        path=path,
        model=model,
        tokenizer=tok,
        config=config,
        config_hash=chash,
        tokenizer_hash=tokenizer_hash(path),
        layers=layers,
        final_norm=_find_final_norm(model),
    )


def target_from_model(model: torch.nn.Module, tokenizer: Any = None, path: str = "<in-memory>") -> Target:
    """Wrap an already-built HF model (tests build tiny random ones from configs)."""
    config = model.config
    text_cfg = text_config(config)
    blob = json.dumps(_canonical_config(config.to_dict()), sort_keys=True, default=str).encode()
    return Target(
        path=path,
        model=model,
        tokenizer=tokenizer,
        config=config,
        config_hash=hashlib.sha256(blob).hexdigest(),
        tokenizer_hash="",
        layers=_find_decoder_layers(model, int(text_cfg.num_hidden_layers)),
        final_norm=_find_final_norm(model),
    )
