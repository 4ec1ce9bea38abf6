"""qkv_proj_with_rope: the whole MLA input chain of a layer, found once its parts are fused.

SGLang's `qkv_proj_with_rope` is one kernel call for: the q_a / kv_a projections, both RMSNorms,
q_b_proj, the W_kc absorption and RoPE of q_pe and k_pe. Under torch.compile our op
(`ops/qkv_proj_with_rope.py`) decomposes into two templates, `qkv_a_proj` with k_pe rotated in its
epilogue and `q_b_absorb` reading its normed q latent; model code that spells the chain out reaches
exactly that pair through the qkv_a_proj, q_b_absorb and rope fusions. This module only recognises
the pair, so that `fusion_counts()` says in how many layers the whole chain runs as the op would.

(One kernel instead of two would save one parallel region per layer: q_b_proj needs every column
of the normed q latent, a barrier either way.)
"""

from __future__ import annotations

import operator

import torch

from ..record import record_fired

FUSION = "qkv_proj_with_rope"
_Q_B_ABSORB = torch.ops.mla.q_b_absorb.default
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default)


def count_whole_chains(projections: list[torch.fx.Node], stage: str) -> None:
    """Record every projection (one that now also rotates k_pe) whose normed q latent feeds a q_b_absorb.
    Called once per projection, when its k_pe rotation moves in."""
    for proj in projections:
        q_latents = [user for user in proj.users if user.target is operator.getitem and user.args[1] == 0]
        # transformers' q latent is [B, 1, q_lora_rank]: q_b_absorb reads it flattened
        q_latents += [view for q_a in q_latents for view in q_a.users if view.target in _VIEWS]
        for q_a in q_latents:
            for user in q_a.users:
                if user.target is _Q_B_ABSORB and user.args[0] is q_a:
                    record_fired(FUSION, "", user.name, stage)
