"""torch.compile settings shared by the training and decoding paths."""

from __future__ import annotations

import torch

# dynamo's default recompile limit (8) is per code object; past it, dynamo runs the function EAGER from then on
# (one warning in a log, easy to miss). draftsmith compiles with static shapes on purpose -- one graph per
# sequence length in training, one per draft/verify width in decoding -- so it needs more than 8.
RECOMPILE_LIMIT = 64


def raise_recompile_limit(limit: int = RECOMPILE_LIMIT) -> None:
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            if getattr(cfg, name) < limit:
                setattr(cfg, name, limit)
            break


def compile_seconds() -> tuple[int, float, float]:
    """(frames compiled, seconds compiling them, seconds compiling backward graphs) so far in this process, from
    dynamo's own timers — what a slow first step spent compiling (flex attention compiles even in "eager"
    training). Zeros where this torch's metric names differ."""
    try:
        from torch._dynamo.utils import compilation_time_metrics as m  # in the try: not in every torch version
    except Exception:  # noqa: BLE001 - diagnostics only
        return 0, 0.0, 0.0
    fwd = m.get("_compile.compile_inner", [])
    bwd = m.get("compile_fx.<locals>.bw_compiler", [])
    return len(fwd), float(sum(fwd)), float(sum(bwd))
