"""Tiny random HF models of several architectures, built from transformers configs (no downloads)."""

from __future__ import annotations

import torch

COMMON = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _build(config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def llama():
    from transformers import LlamaConfig

    return _build(LlamaConfig(**COMMON, head_dim=8))


def qwen2():
    from transformers import Qwen2Config

    return _build(Qwen2Config(**COMMON))


def qwen3():
    from transformers import Qwen3Config

    return _build(Qwen3Config(**COMMON, head_dim=8))


def mistral():
    from transformers import MistralConfig

    return _build(MistralConfig(**COMMON, head_dim=8, sliding_window=16))


def mixtral():
    from transformers import MixtralConfig

    return _build(MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2))


def deepseek_v3():
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        max_position_embeddings=256,
    )
    return _build(cfg)


def gpt_oss():
    from transformers import GptOssConfig

    cfg = GptOssConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"] * 3,
    )
    return _build(cfg)


ARCHS = {
    "llama": llama,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "mistral": mistral,
    "mixtral": mixtral,
    "deepseek_v3": deepseek_v3,
    "gpt_oss": gpt_oss,
}
