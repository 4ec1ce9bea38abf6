"""DeepSeek MLA configurations shared by the serving-style model and the transformers builder."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    name: str
    hidden_size: int
    num_heads: int
    q_lora_rank: Optional[int]  # None: one q_proj instead of q_a_proj -> q_a_layernorm -> q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_layers: int
    vocab_size: int
    intermediate_size: int  # dense MLP of the transformers model; the serving model has none
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[tuple[tuple[str, float], ...]] = None  # YaRN parameters as in the released configs
    max_position_embeddings: int = 4096
    # The released MoE layout (transformers' names): routed experts of moe_intermediate_size, shared
    # experts as one MLP of n_shared_experts times that, num_experts_per_tok routed per token; the first
    # first_k_dense_replace layers have a dense MLP of intermediate_size. n_routed_experts 0: every MLP
    # dense (the serving model has none).
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    # DeepSeek-V3's grouped routing: experts in n_group groups, a token's experts from its topk_group best
    n_group: int = 1
    topk_group: int = 1

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one latent KV-cache row: c_kv ‖ k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def yarn(self) -> Optional[dict[str, float]]:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        yarn = self.yarn
        if yarn and yarn.get("mscale_all_dim"):
            m = yarn_mscale(yarn["factor"], yarn["mscale_all_dim"])
            scale *= m * m
        return scale

    def replace(self, **changes) -> MLAConfig:
        return dataclasses.replace(self, **changes)


def yarn_mscale(factor: float, mscale: float) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


_DEEPSEEK_V3_YARN = (
    ("factor", 40.0),
    ("original_max_position_embeddings", 4096),
    ("beta_fast", 32.0),
    ("beta_slow", 1.0),
    ("mscale", 1.0),
    ("mscale_all_dim", 1.0),
)

DEEPSEEK_V3 = MLAConfig(
    name="deepseek-v3",
    hidden_size=7168,
    num_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    num_layers=61,
    vocab_size=129280,
    intermediate_size=18432,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    moe_intermediate_size=2048,
    first_k_dense_replace=3,
    n_group=8,
    topk_group=4,
    rope_scaling=_DEEPSEEK_V3_YARN,
    max_position_embeddings=163840,
)

# One tensor-parallel rank of DeepSeek-V3 at TP=6 with heads padded 128 -> 132: 22 heads per rank,
# q_b_proj [22*192, 1536] = [4224, 1536], w_kc [22, 512, 128]. The shape SGLang's CPU kernels are tuned for.
DEEPSEEK_V3_TP22 = DEEPSEEK_V3.replace(name="deepseek-v3-tp22", num_heads=22)

# One rank of DeepSeek-V3 at TP=16 as transformers' tp_plan shards it: 8 heads, the dense MLP's 18432 and
# every expert's 2048 split 16 ways (the shared expert's too), all 256 experts on every rank with their
# grouped routing (8 groups, 4 chosen, top-8); 1.4 GiB of experts a MoE layer, what one machine holds
# for a few layers. One dense layer first (the released model has 3) so that the report's few layers
# are mostly MoE.
DEEPSEEK_V3_TP16 = DEEPSEEK_V3.replace(name="deepseek-v3-tp16", num_heads=8, intermediate_size=18432 // 16,
                                       moe_intermediate_size=2048 // 16, first_k_dense_replace=1)

DEEPSEEK_V2_LITE = MLAConfig(
    name="deepseek-v2-lite",
    hidden_size=2048,
    num_heads=16,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    num_layers=27,
    vocab_size=102400,
    intermediate_size=10944,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    moe_intermediate_size=1408,
    first_k_dense_replace=1,
    rope_scaling=(
        ("factor", 40.0),
        ("original_max_position_embeddings", 4096),
        ("beta_fast", 32.0),
        ("beta_slow", 1.0),
        ("mscale", 0.707),
        ("mscale_all_dim", 0.707),
    ),
    max_position_embeddings=163840,
)

# All dimensions distinct (qk_head_dim 48 != v_head_dim 32, as 192 != 128 in the real model) so that
# a pattern cannot match by a coincidence of sizes.
TINY = MLAConfig(
    name="tiny",
    hidden_size=256,
    num_heads=4,
    q_lora_rank=96,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    num_layers=2,
    vocab_size=512,
    intermediate_size=512,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=3,
    moe_intermediate_size=96,
    first_k_dense_replace=1,
    n_group=4,
    topk_group=2,
    rope_scaling=_DEEPSEEK_V3_YARN,
    max_position_embeddings=4096,
)

CONFIGS = {c.name: c for c in (DEEPSEEK_V3, DEEPSEEK_V3_TP22, DEEPSEEK_V3_TP16, DEEPSEEK_V2_LITE, TINY)}


def get_config(name: str, **overrides) -> MLAConfig:
    if name not in CONFIGS:
        raise ValueError(f"unknown config {name!r}; known: {', '.join(CONFIGS)}")
    return CONFIGS[name].replace(**overrides) if overrides else CONFIGS[name]
