"""transformers DeepSeek models built from our configs with random weights (nothing is downloaded).

These are the unmodified third-party graphs the patterns must find: `DeepseekV3ForCausalLM`
(interleaved rope by default) and `DeepseekV2ForCausalLM` (complex rope). With `moe=True` a config's
released MoE layout (MLAConfig.n_routed_experts and the rest: routed and shared experts, the first
layers dense); otherwise every MLP is dense (`first_k_dense_replace` = all layers), the stand-in the
attention tests use.
"""

from __future__ import annotations

from typing import Optional

import torch

from .configs import MLAConfig, get_config
from .mla import init_weights_


def hf_config(config: MLAConfig, arch: str = "v3", moe: bool = False, **overrides):
    import transformers

    if moe and not config.n_routed_experts:
        raise ValueError(f"{config.name} has no MoE layout")

    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.yarn:
        rope = {"rope_type": "yarn", "rope_theta": config.rope_theta, **config.yarn}
    common = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        first_k_dense_replace=config.first_k_dense_replace if moe else config.num_layers,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters=rope,
        attention_bias=False,
    )
    if moe:
        common.update(n_routed_experts=config.n_routed_experts, n_shared_experts=config.n_shared_experts,
                      num_experts_per_tok=config.num_experts_per_tok,
                      moe_intermediate_size=config.moe_intermediate_size, routed_scaling_factor=1.0)
        if arch == "v2":
            common.update(topk_method="greedy")  # V2-Lite's released routing: softmax top-k over all experts
        else:
            common.update(n_group=config.n_group, topk_group=config.topk_group)
    common.update(overrides)
    if arch == "v3":
        return transformers.DeepseekV3Config(**common)
    if arch == "v2":
        return transformers.DeepseekV2Config(**common)
    raise ValueError(f"arch must be 'v3' or 'v2', got {arch!r}")


def build_hf_model(
    config: MLAConfig | str,
    arch: Optional[str] = None,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    moe: bool = False,
    **overrides,
):
    """A transformers DeepSeek model with seeded random weights, `.eval()` in `dtype`; `moe`: with the
    config's MoE layout.

    `arch` defaults to "v2" for deepseek-v2-lite and "v3" otherwise; `overrides` go to the
    transformers config (e.g. `rope_interleave=False`, `num_hidden_layers=2`).
    """
    import transformers

    if isinstance(config, str):
        config = get_config(config)
    arch = arch or ("v2" if config.name.startswith("deepseek-v2") else "v3")
    cfg = hf_config(config, arch, moe, **overrides)
    cls = transformers.DeepseekV3ForCausalLM if arch == "v3" else transformers.DeepseekV2ForCausalLM
    with torch.device("cpu"):
        model = cls(cfg)
    init_weights_(model, seed)
    return model.to(dtype).eval()
