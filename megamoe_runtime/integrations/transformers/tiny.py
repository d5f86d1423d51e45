"""Tiny real transformers MoE models with random weights: what the demo serves and the tests prove against.

Each is a real architecture (DeepSeek-V3 / V2, GLM-4 MoE, Qwen3-MoE, Mixtral) built from a config with a
fixed seed and written by ``save_pretrained``, the way a user's checkpoint is written: 3 layers, 4 experts,
top-2, each family's own routing and shared expert, hidden 128. Nothing is downloaded.
"""
from __future__ import annotations

from pathlib import Path

import torch
import transformers

__all__ = ["ARCHS", "save_tiny_model", "tiny_config"]

_COMMON = dict(vocab_size=96, hidden_size=128, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
               max_position_embeddings=64, initializer_range=0.08, tie_word_embeddings=False)


def tiny_config(arch: str):
    """A tiny config of one real architecture: 3 layers, 4 experts, top-2, the family's own routing."""
    t = transformers
    moe = dict(moe_intermediate_size=128, num_experts_per_tok=2)
    mla = {**_COMMON, "num_key_value_heads": _COMMON["num_attention_heads"]}  # MLA: as many KV heads as heads
    if arch == "deepseek_v3":
        return t.DeepseekV3Config(**mla, intermediate_size=256, n_routed_experts=4, n_shared_experts=1,
                                  first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                  kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=32,
                                  v_head_dim=32, **moe)
    if arch == "deepseek_v2":
        return t.DeepseekV2Config(**mla, intermediate_size=256, n_routed_experts=4, n_shared_experts=1,
                                  first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
                                  qk_nope_head_dim=32, v_head_dim=32, routed_scaling_factor=2.0,
                                  topk_method="greedy", n_group=1, topk_group=1, **moe)
    if arch == "glm4_moe":
        return t.Glm4MoeConfig(**_COMMON, intermediate_size=256, n_routed_experts=4, n_shared_experts=1,
                               first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.5,
                               head_dim=64, **moe)
    if arch == "qwen3_moe":
        return t.Qwen3MoeConfig(**_COMMON, intermediate_size=256, num_experts=4, norm_topk_prob=True, head_dim=64,
                                **moe)
    if arch == "mixtral":
        return t.MixtralConfig(**_COMMON, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
                               head_dim=64)
    raise KeyError(arch)


#: the architectures the integration covers, by model_type
ARCHS = ("deepseek_v3", "deepseek_v2", "glm4_moe", "qwen3_moe", "mixtral")


def save_tiny_model(arch: str, path: Path, seed: int = 0) -> Path:
    """``XForCausalLM(config)`` in bf16 with random weights, routers included (DeepSeek's start at zero,
    which would make routing degenerate), saved as a user's checkpoint is."""
    cfg = tiny_config(arch)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            elif name.endswith("e_score_correction_bias"):
                p.uniform_(-0.05, 0.05)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.uniform_(-0.05, 0.05)
    model.save_pretrained(path)
    return path
