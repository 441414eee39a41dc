"""Random-weight models of real LLM shapes, built directly on the GPU (no download, no disk)."""

from __future__ import annotations

import torch


def llama31_8b_config(num_layers: int = 32):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=num_layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )


def random_model(config, device="cuda", dtype=torch.bfloat16, std: float = 0.02):
    """An HF causal LM with N(0, std) weights, allocated on `device` in `dtype` (fast: no CPU init)."""
    from transformers import AutoModelForCausalLM

    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    finally:
        torch.set_default_dtype(prev)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, std)
            elif "norm" in name:
                p.fill_(1.0)
    return model.eval().requires_grad_(False)
