"""Tiny MoE models of the four families the fused kernel serves, with routing that spreads
tokens over experts (random router weights and correction biases)."""

from __future__ import annotations

import torch

from kernel_hub.models.tiny import PAD_TOKEN_ID, tiny_config

TOKENS = dict(
    max_position_embeddings=128, pad_token_id=PAD_TOKEN_ID, bos_token_id=1, eos_token_id=None
)


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    config = tiny_config(MixtralConfig, intermediate_size=96, num_local_experts=4,
                         num_experts_per_tok=2, **TOKENS)  # fmt: skip
    return MixtralForCausalLM(config)


def qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = tiny_config(Qwen3MoeConfig, intermediate_size=96, moe_intermediate_size=32,
                         num_experts=8, num_experts_per_tok=3, norm_topk_prob=True, head_dim=16,
                         **TOKENS)  # fmt: skip
    return Qwen3MoeForCausalLM(config)


def gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    config = tiny_config(GptOssConfig, intermediate_size=64, num_local_experts=4,
                         num_experts_per_tok=2, head_dim=16, sliding_window=8,
                         **TOKENS)  # fmt: skip
    return GptOssForCausalLM(config)


def deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = tiny_config(
        DeepseekV3Config, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=None,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        num_key_value_heads=4, **TOKENS,
    )  # fmt: skip
    return DeepseekV3ForCausalLM(config)


MODELS = {"mixtral": mixtral, "qwen3_moe": qwen3_moe, "gpt_oss": gpt_oss,
          "deepseek_v3": deepseek_v3}  # fmt: skip


def build(name: str, dtype=torch.float32) -> torch.nn.Module:
    """The tiny model, seeded, eval mode; routers and biases randomised (the default init puts
    zeros in some, which would tie every expert)."""
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    with torch.no_grad():
        for name_, p in model.named_parameters():
            if "router" in name_ or ".gate." in name_ or name_.endswith("_bias"):
                p.normal_(0, 0.5)
        for name_, b in model.named_buffers():
            if "e_score_correction_bias" in name_:
                b.normal_(0, 0.1)
    return model.to(dtype)


def experts_modules(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "gate_up_proj")]
