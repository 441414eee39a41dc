"""dtype names in one place: what every `--dtype`-like flag and config field accepts, and how each maps to torch
and to safetensors.

Flags take the short names (bf16, fp16, fp32) and the torch/HF spellings (bfloat16, float16, float32); configs
written by draftsmith use the torch spelling ("torch_dtype": "bfloat16"). torch is imported only by the functions
that return torch dtypes, so the stage schemas can list the names without importing torch (`draftsmith --help`
stays fast).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from draftsmith.common.errors import DraftsmithError

if TYPE_CHECKING:
    import torch

#: Accepted name -> torch attribute name, for the floating-point dtypes weights and autocast use.
FLOAT_NAMES: dict[str, str] = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float32": "float32",
}
SHORT_NAMES = ("bf16", "fp16", "fp32")  # what help texts offer
WITH_AUTO = ("auto", *FLOAT_NAMES)  # a flag whose "auto" means "decided by the device or the target"

#: torch dtype name -> safetensors header dtype code.
SAFETENSORS_CODES: dict[str, str] = {
    "torch.float32": "F32",
    "torch.float16": "F16",
    "torch.bfloat16": "BF16",
    "torch.float8_e4m3fn": "F8_E4M3",
    "torch.int64": "I64",
    "torch.int32": "I32",
    "torch.int16": "I16",
    "torch.int8": "I8",
    "torch.uint8": "U8",
    "torch.bool": "BOOL",
    "torch.float64": "F64",
}


@functools.lru_cache(maxsize=1)
def torch_dtypes() -> dict[str, torch.dtype]:
    """Every accepted float name -> its torch dtype (bf16 and bfloat16 both map to torch.bfloat16, ...)."""
    import torch  # torch-free --help (the stage schemas name dtypes)

    return {name: getattr(torch, attr) for name, attr in FLOAT_NAMES.items()}


def parse_dtype(name: Any, flag: str = "--dtype", *, allow_auto: bool = True) -> Any:
    """A dtype flag's value as a torch dtype; "auto" stays "auto" when allowed; a torch dtype passes through.
    Case-insensitive. An unknown name is one line naming the flag and the choices."""
    import torch  # torch-free --help (the stage schemas name dtypes)

    if isinstance(name, torch.dtype):
        return name
    key = str(name).strip().lower()
    if key == "auto" and allow_auto:
        return "auto"
    table = torch_dtypes()
    if key not in table:
        choices = ", ".join((("auto",) if allow_auto else ()) + tuple(FLOAT_NAMES))
        raise DraftsmithError(f"{flag}: unknown dtype {name!r} (choose from {choices})")
    return table[key]


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16' (the spelling HF configs and the engines read)."""
    return str(dtype).replace("torch.", "")
