"""The engine, decode-mode and sampling settings of `draftsmith generate`, `eval` and `serve`, declared once.

Each is a schema dataclass (draftsmith/common/schema.py): its fields give the commands their flags, help lines
(one rich panel per group) and parse-time checks (`--draft-tokens: must be in [1, 250], got 0`). `settings(...)`
attaches them to a typer command next to the command's own options and hands the command built configs:

    @settings(engine=EngineConfig, mode=ModeConfig)
    def serve(target: str = typer.Option(...), *, engine: EngineConfig, mode: ModeConfig): ...

A new engine setting is one field on EngineConfig (it then appears, checked, in all three commands) plus its use
in `draftsmith.decode.setup.engine_from`. This module does not import torch: it is on `draftsmith --help`'s path.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from draftsmith.common import dtypes
from draftsmith.common.errors import DraftsmithError
from draftsmith.common.schema import (
    AT_LEAST_ONE,
    DEVICE,
    MAX_NEW_TOKENS,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    Check,
    between,
    build,
    check_fields,
    cli_parameter,
    fields_of,
    one_of,
    setting,
    values_from_flags,
)

# draftsmith.decode.llama.ATTENTION_IMPLS plus "auto" (that module imports torch; a unit test keeps them equal)
ATTN_IMPLS = ("auto", "sdpa", "bmm", "split")
KERNELS = ("torch", "triton")
# --kernel-rows 0 (auto): the T-row kernels for chain verifies of up to 7 draft tokens on small, launch-bound
# targets, where they beat cuBLAS in every run (pycode-small, d=384: chain6 1.64x vs 1.39x the fastest plain
# step, BENCHMARKS.md 2026-12-02); on the 8B shape cuBLAS wins (a 49-row verify 6.97 vs 11.9 ms), so 1 above this.
AUTO_KERNEL_ROWS = 8
AUTO_KERNEL_ROWS_MAX_HIDDEN = 1024
# ... and up to this many rows when the chain asked for is longer (one tensor-core tile of rows: a 9-16-row verify
# costs the row kernels about what 8 rows do, while past `kernel_rows` it falls back to cuBLAS and eager glue —
# chain8 at --kernel-rows 8 ran 1.50x against chain7's 1.83x, BENCHMARKS.md 2026-12-02 thirteenth session)
AUTO_KERNEL_ROWS_FOR_CHAINS = 16
BACKENDS = ("auto", "llama", "hf")
# --cluster-gemm: how much of a wide forward's layer goes through experimental.cluster_gemm (KernelConfig's
# cluster_gemm, cluster_gemm_fused, cluster_gemm_rope)
CLUSTER_GEMM = ("off", "on", "fused", "fusedrope")


def cluster_gemm_refusal(cluster_gemm: str, kernels: str) -> str:
    """Why --cluster-gemm cannot run with these --kernels ("" when it can): its route is the Triton engine's."""
    if cluster_gemm != "off" and kernels != "triton":
        return f"--cluster-gemm {cluster_gemm} needs --kernels triton (it replaces that engine's matmuls)"
    return ""


_ATTN_HELP = (
    "Attention of the compact forward and the drafter: auto (on CUDA SDPA while cache slots x head_dim "
    "<= 65,536, batched matmuls beyond: 512 slots for head_dim 128) | sdpa | bmm | split."
)
_KERNELS_HELP = (
    "Decode kernels of the compact forward: torch (cuBLAS + separate norms/RoPE/attention) | triton "
    "(one-token steps through draftsmith's fused kernels, 7 a layer, tiles tuned on the GPU at start: "
    "0.87-0.90 of copy bandwidth on an 8B shape vs 0.61 for torch; the rounds' verify, hand-off and "
    "draft-step attention through one tree-mask kernel, a tree level's top-k through two). Fastest: "
    "--kernels triton --compile (8B shape: 3.1x projected for tree rounds against this plain step)."
)
# dtype names as load_target reads them (case-insensitive there, so here too)
_DTYPE = Check(
    "one of auto, bf16, fp16, fp32",
    lambda v: isinstance(v, str) and v.lower() in dtypes.WITH_AUTO,
    choices=("auto", *dtypes.SHORT_NAMES),
    in_help=False,
)


@dataclass
class EngineConfig:
    """How the target and drafter run: device, dtype, forward backend, CUDA graphs, compile, attention, kernels."""

    device: str = setting(
        "auto",
        group="engine",
        checks=(DEVICE,),
        help="auto (cuda when available) | cpu | cuda | cuda:N | mps | xpu[:N].",
    )
    dtype: str = setting("auto", group="engine", checks=(_DTYPE,), help="auto = bf16 on CUDA, fp32 on CPU.")
    backend: str = setting(
        "auto", group="engine", checks=(one_of(*BACKENDS),), help="auto | llama (compact forward) | hf (generic)."
    )
    cuda_graphs: bool = setting(
        True, group="engine", default_help="on", help="Replay rounds from CUDA graphs on GPUs (compact forward)."
    )
    compile: bool = setting(False, group="engine", help="torch.compile the round forwards (slow start).")
    attn_impl: str = setting("auto", group="engine", checks=(one_of(*ATTN_IMPLS),), help=_ATTN_HELP)
    kernels: str = setting("torch", group="engine", checks=(one_of(*KERNELS),), help=_KERNELS_HELP)
    kernel_rows: int = setting(
        0,
        group="engine",
        checks=(between(0, 64),),
        default_help="0 = auto",
        help="With --kernels triton: target forwards of up to this many tokens (a chain verify: draft tokens + 1) "
        "run all through the kernels, the matmuls as T-row kernels that read the weights once with the norms and "
        "residuals folded in — fewer launches, for small launch-bound targets (pycode-small: BENCHMARKS.md "
        "'small-target round census'); 1 = the one-token step only (cuBLAS verifies, best on large targets); "
        f"0 = auto: {AUTO_KERNEL_ROWS} for hidden sizes up to {AUTO_KERNEL_ROWS_MAX_HIDDEN:,} (more for a longer "
        f"chain's verify, up to {AUTO_KERNEL_ROWS_FOR_CHAINS}), else 1.",
    )

    cluster_gemm: str = setting(
        "off",
        group="engine",
        checks=(one_of(*CLUSTER_GEMM),),
        help="Experimental, Hopper GPUs (sm_90) with --kernels triton: the verify's layer matmuls through draftsmith's "
        "CUDA few-row GEMM (TMA + wgmma, split-K inside a thread-block cluster, PDL). on: the matmuls; fused: with the "
        "RMSNorms, silu * up and residual adds folded in; fusedrope: and RoPE with the cache writes. On an 8B shape "
        "(H200, 49-row tree verify) fusedrope takes 4.95-4.98 ms against 5.13-5.21 for the default; on small targets "
        "(hidden <= 1,024) it is slower (docs/verify-persistent-kernel.md). Off: cuBLAS.",
    )
    prefill_graphs: bool = setting(
        True,
        group="engine",
        default_help="on with CUDA graphs",
        help="Prefill prompts of up to 512 tokens padded to a length bucket, from one CUDA graph per bucket (captured "
        "on its first use, ~50 ms): a small target's eager prefill is mostly host time (pycode-small on an H200: "
        "~8 ms a prompt eager, ~1 ms from its graph; BENCHMARKS.md 2026-12-02, twelfth session). No effect without "
        "CUDA graphs.",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        why = cluster_gemm_refusal(self.cluster_gemm, self.kernels)  # before any model loads
        if why:
            raise DraftsmithError(why)


@dataclass
class ModeConfig:
    """The decode mode: plain, a chain of K draft tokens, or an EAGLE-2 dynamic tree (DecodeMode's bounds)."""

    plain: bool = setting(False, group="decode mode", help="Plain decoding even with a drafter (baseline).")
    draft_tokens: int = setting(
        4, group="decode mode", checks=(between(1, 250),), help="Chain: draft tokens per round (K)."
    )
    tree: bool = setting(False, group="decode mode", help="EAGLE-2 dynamic tree instead of a chain.")
    top_k_draft: int = setting(
        8, group="decode mode", checks=(AT_LEAST_ONE,), help="Tree: frontier width / children per node."
    )
    depth: int = setting(5, group="decode mode", checks=(between(1, 250),), help="Tree: max draft tokens on one path.")
    tree_tokens: int = setting(
        32, group="decode mode", checks=(AT_LEAST_ONE,), help="Tree: draft nodes verified per round."
    )

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass
class SamplingConfig:
    """How `generate` samples (T = 0 is greedy)."""

    max_new_tokens: int = setting(128, group="sampling", checks=MAX_NEW_TOKENS, help="New tokens to generate.")
    temperature: float = setting(0.0, group="sampling", checks=TEMPERATURE, help="0 = greedy; > 0 samples.")
    top_p: float = setting(1.0, group="sampling", checks=TOP_P, help="Nucleus sampling mass.")
    top_k: int = setting(
        0, group="sampling", checks=TOP_K, help="Sampling top-k (0 = off). The tree width is --top-k-draft."
    )
    seed: int | None = setting(None, group="sampling", help="Seed for sampling (reproducible output).")

    def __post_init__(self) -> None:
        check_fields(self)


def parse_temperatures(text: str) -> list[float]:
    """'0,0.7' -> [0.0, 0.7]; ValueError unless every item is a finite number >= 0 and there is at least one."""
    temps = [float(x) for x in text.split(",") if x.strip()]
    if not temps or any(not math.isfinite(t) or t < 0 for t in temps):
        raise ValueError(text)
    return temps


def _temperatures_ok(text: str) -> bool:
    try:
        parse_temperatures(text)
    except ValueError:
        return False
    return True


@dataclass
class EvalSamplingConfig(SamplingConfig):
    """`eval`'s sampling: every prompt at each of --temperatures (--temperature is not an eval flag)."""

    max_new_tokens: int = setting(256, group="sampling", checks=MAX_NEW_TOKENS, help="New tokens per prompt.")
    top_p: float = setting(1.0, group="sampling", checks=TOP_P, help="Nucleus sampling mass at T > 0.")
    top_k: int = setting(0, group="sampling", checks=TOP_K, help="Sampling top-k at T > 0 (0 = off).")
    seed: int = setting(0, group="sampling", help="Sampling seed (prompt i uses seed + i).")
    temperatures: str = setting(
        "0,1",
        group="sampling",
        checks=(Check("comma-separated numbers >= 0, e.g. '0,0.7'", _temperatures_ok, in_help=False),),
        help="Comma-separated, e.g. '0,0.7'.",
    )

    @property
    def temps(self) -> list[float]:
        return parse_temperatures(self.temperatures)


EVAL_SKIP = ("temperature",)  # EvalSamplingConfig fields that are not eval flags


# ------------------------------------------------------------------------------------------------ commands
def options(schema: type, skip: Sequence[str] = ()) -> list[inspect.Parameter]:
    """The typer options of a schema's settings, less `skip`."""
    return [cli_parameter(info) for name, info in fields_of(schema).items() if name not in skip]


def settings(**groups: type | tuple[type, Sequence[str]]) -> Callable[[Callable[..., Any]], Callable[..., None]]:
    """Give a typer command the options of each schema in `groups` (name=Schema or name=(Schema, fields to skip));
    the command receives name=<the built config>, its values checked as they are parsed (one line naming the
    flag). The command's own options stay in its signature. `command.check_settings(params)` converts and checks
    the values without running the command."""
    specs = {name: (g, ()) if isinstance(g, type) else (g[0], tuple(g[1])) for name, g in groups.items()}

    def wrap(fn: Callable[..., Any]) -> Callable[..., None]:
        own = [p for n, p in inspect.signature(fn, eval_str=True).parameters.items() if n not in specs]
        generated = [p for schema, skip in specs.values() for p in options(schema, skip)]
        names = [p.name for p in own]
        clash = set(names) & {p.name for p in generated}
        if clash:
            raise TypeError(f"{fn.__name__}: options declared twice: {sorted(clash)}")

        def check_settings(kw: dict[str, Any]) -> dict[str, Any]:
            """Pop the settings' values (None = not given) out of `kw`; {group name: built config}."""
            built = {}
            for name, (schema, skip) in specs.items():
                given = {f: kw.pop(f, None) for f in fields_of(schema) if f not in skip}
                built[name] = build(schema, values_from_flags(schema, given))
            return built

        def command(**kw: Any) -> None:
            built = check_settings(kw)
            fn(**kw, **built)

        # the pipeline checks a section's values before any stage runs (draftsmith/pipeline/runner.py)
        command.check_settings = lambda params: check_settings(dict(params))

        command.__signature__ = inspect.Signature(
            [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + generated
        )
        command.__doc__ = fn.__doc__
        command.__name__ = fn.__name__
        return command

    return wrap
