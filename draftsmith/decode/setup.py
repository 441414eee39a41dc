"""Building an engine from user settings: what `generate`, `eval`, `serve` and the benches share (the target and
drafter loaded onto one device/dtype, a DecodeMode from the mode flags, the SpeculativeDecoder with user errors as
one line). The commands pass their EngineConfig/ModeConfig (draftsmith/decode/config.py) to the `*_from` forms; the
benches call the plain ones."""

from __future__ import annotations

from typing import Optional

from draftsmith.common.errors import DraftsmithError
from draftsmith.common.hf import text_config
from draftsmith.decode.config import EngineConfig, ModeConfig, cluster_gemm_refusal


def load_models(target: str, drafter: Optional[str], device: str, dtype: str):
    """(target, drafter or None) on `device` ("auto": cuda when available) in `dtype` ("auto": bf16 on cuda, fp32
    on the CPU); the drafter frozen, in eval mode, with the target's embedding attached."""
    import torch

    from draftsmith.target_model import load_target

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bf16" if device.startswith("cuda") else "fp32"
    t = load_target(target, dtype=dtype, device=device)
    d = None
    if drafter:
        from draftsmith.drafter import Drafter

        d = Drafter.from_pretrained(drafter, target=t)
        d = d.to(device=t.device, dtype=t.dtype).eval()
        d.requires_grad_(False)
    return t, d


def decode_mode(
    plain: bool, tree: bool, draft_tokens: int, top_k_draft: int, depth: int, tree_tokens: int, drafter=True
):
    """The DecodeMode the mode flags ask for; plain decoding without a drafter."""
    from draftsmith.decode.engine import DecodeMode

    if plain or drafter is None:
        return DecodeMode("plain")
    if tree:
        return DecodeMode("tree", top_k=top_k_draft, depth=depth, tree_tokens=tree_tokens)
    return DecodeMode("chain", draft_tokens=draft_tokens)


def build_engine(
    t,
    d,
    max_len: int,
    backend: str,
    cuda_graphs: bool,
    compile: bool = False,
    attn_impl: str = "auto",
    kernels: str = "torch",
    kernel_rows: int = 0,
    prefill_graphs: bool = True,
    modes=(),
    cluster_gemm: str = "off",
):
    """The engine for the CLIs. `modes`: the decode modes it will run (auto --kernel-rows covers their chains);
    `cluster_gemm`: --cluster-gemm (`cluster_gemm_config`)."""
    from draftsmith.decode.engine import SpeculativeDecoder

    if not kernel_rows:
        kernel_rows = auto_kernel_rows(t, kernels, modes)
    kernel_config = cluster_gemm_config(t, kernels, cluster_gemm)
    try:
        eng = SpeculativeDecoder(
            t,
            d,
            max_len=max_len,
            backend=backend,
            cuda_graphs=None if cuda_graphs else False,
            compile=compile,
            attn_impl=attn_impl,
            kernels=kernels,
            kernel_rows=kernel_rows,
            kernel_config=kernel_config,
        )
    except ValueError as e:
        raise DraftsmithError(str(e)) from None
    eng.prefill_graphs = bool(prefill_graphs) and eng.cuda_graphs
    return eng


def cluster_gemm_config(t, kernels: str, cluster_gemm: str):
    """The KernelConfig of --cluster-gemm (None for off), or a one-line error where it cannot run: it needs the Triton
    kernels (its route is theirs) and a CUDA device of compute capability 9 (TMA, wgmma, clusters)."""
    if cluster_gemm == "off":
        return None
    why = cluster_gemm_refusal(cluster_gemm, kernels)
    if why:
        raise DraftsmithError(why)
    import torch

    model = getattr(t, "model", t)
    device = next(model.parameters()).device
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        where = device.type if device.type != "cuda" else "sm_{}{}".format(*torch.cuda.get_device_capability(device))
        raise DraftsmithError(f"--cluster-gemm {cluster_gemm} needs a Hopper GPU (sm_90); the target is on {where}")
    from draftsmith.decode.kernel_config import KernelConfig

    return KernelConfig(
        cluster_gemm=True,
        cluster_gemm_fused=cluster_gemm in ("fused", "fusedrope"),
        cluster_gemm_rope=cluster_gemm == "fusedrope",
    )


def cluster_gemm_setting(eng) -> str:
    """--cluster-gemm as the engine runs it (off | on | fused | fusedrope)."""
    kc = getattr(getattr(eng, "runner", None), "kernel_config", None)
    if kc is None or not getattr(kc, "cluster_gemm", False):
        return "off"
    return "fusedrope" if kc.cluster_gemm_rope else "fused" if kc.cluster_gemm_fused else "on"


def auto_kernel_rows(t, kernels: str, modes=()) -> int:
    """--kernel-rows 0: AUTO_KERNEL_ROWS with the Triton kernels on a target of hidden size up to
    AUTO_KERNEL_ROWS_MAX_HIDDEN (launch-bound: the row kernels win), raised to the widest chain verify among
    `modes` up to AUTO_KERNEL_ROWS_FOR_CHAINS; else 1 (cuBLAS verifies)."""
    from draftsmith.decode.config import AUTO_KERNEL_ROWS, AUTO_KERNEL_ROWS_FOR_CHAINS, AUTO_KERNEL_ROWS_MAX_HIDDEN

    hidden = int(getattr(text_config(t.config), "hidden_size", 1 << 30))
    if kernels != "triton" or hidden > AUTO_KERNEL_ROWS_MAX_HIDDEN:
        return 1
    chains = [m.verify_tokens for m in modes if m is not None and m.kind == "chain"]
    return max([AUTO_KERNEL_ROWS] + [min(n, AUTO_KERNEL_ROWS_FOR_CHAINS) for n in chains])


def max_positions(t) -> int:
    cfg = text_config(t.config)
    return int(getattr(cfg, "max_position_embeddings", None) or 1 << 20)


def models_from(target: str, drafter: Optional[str], cfg: EngineConfig):
    return load_models(target, drafter, cfg.device, cfg.dtype)


def mode_from(cfg: ModeConfig, drafter=True):
    """The DecodeMode of the mode flags, checked (one line naming the flag); plain without a drafter. Unless
    --plain, the shape asked for is checked even without a drafter: a bad --tree-tokens fails before models load."""
    asked = decode_mode(cfg.plain, cfg.tree, cfg.draft_tokens, cfg.top_k_draft, cfg.depth, cfg.tree_tokens)
    try:
        asked.validate()
    except ValueError as e:
        raise DraftsmithError(str(e)) from None
    return decode_mode(cfg.plain, cfg.tree, cfg.draft_tokens, cfg.top_k_draft, cfg.depth, cfg.tree_tokens, drafter)


def engine_from(t, d, max_len: int, cfg: EngineConfig, modes=()):
    """`build_engine` from the engine flags; `modes`: the decode modes the command will run."""
    return build_engine(
        t,
        d,
        max_len,
        cfg.backend,
        cfg.cuda_graphs,
        cfg.compile,
        cfg.attn_impl,
        cfg.kernels,
        cfg.kernel_rows,
        cfg.prefill_graphs,
        modes,
        cfg.cluster_gemm,
    )
