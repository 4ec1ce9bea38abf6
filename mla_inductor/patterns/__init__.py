"""Fusion patterns: one module per fusion, each with search functions written as eager code
(registry.py has what they share)."""

from __future__ import annotations

import functools

from torch._inductor.pattern_matcher import init_once_fakemode

from . import gqa_decode, gqa_qkv, mla_decode, mla_prefill, moe, q_b_absorb, qkv_a, rope
from .qkv_proj_with_rope import count_whole_chains
from .registry import STAGES, pattern_pass
from .rope import merge_into_qkv_a_proj

# Registered in this order: larger fusions first where they overlap.
FUSION_MODULES = (qkv_a, q_b_absorb, mla_decode, rope, gqa_qkv, gqa_decode, moe, mla_prefill)

__all__ = ["STAGES", "count_whole_chains", "merge_into_qkv_a_proj", "mla_prefill", "pattern_pass", "register_all"]


@functools.cache
@init_once_fakemode
def register_all() -> None:
    for module in FUSION_MODULES:
        module.register()
