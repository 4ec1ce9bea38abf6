"""Lowering of mla::fused_experts to the MoE template (templates/moe.cpp.j2): weights in the activations'
dtype, read as the model holds them or, frozen bf16, packed at compile time per expert into packed_dot.h's
column blocks (each expert's gate blocks, then its up blocks; then every expert's down blocks). Quantized
weights, biases and the cases the template does not serve lower to the op's reference."""

from __future__ import annotations

import torch
from torch._inductor import ir
from torch._inductor import lowering as L

from ..ops.moe import ACTIVATION_DTYPES
from .segment_gemm import frozen_values, packed_constant
from .template import FusedOpTemplate, guard_ints, realize_input, static_sizes, templates_serve

OP = torch.ops.mla.fused_experts.default


class FusedExpertsTemplate(FusedOpTemplate):
    template_file = "moe.cpp.j2"

    def __init__(self, inputs: dict, layout: ir.Layout, expert_width: int, experts: int, topk: int) -> None:
        super().__init__("mla_fused_experts", inputs, layout)
        self.expert_width, self.experts, self.topk = expert_width, experts, topk

    def headers(self) -> tuple[str, ...]:
        packed = ("packed_dot.h",) if self.inputs["W1P"] is not None else ()
        return ("widen.h", "nt_dot.h") + packed + ("moe.h",)

    def options(self, kernel) -> dict:
        x = self.inputs["X"]
        return dict(
            M=kernel.size(x, 0),
            K=kernel.size(x, 1),
            N=self.expert_width,
            E=self.experts,
            TOPK=self.topk,
            ldx=kernel.stride(x, 0),
        )


def _template_can_serve(x, w1, w2, use_int8_w8a8, use_fp8_w8a16, w1_bias, w2_bias, alpha, limit,
                        is_vnni) -> bool:
    if not templates_serve(x) or x.get_dtype() not in ACTIVATION_DTYPES:
        return False
    if use_int8_w8a8 or use_fp8_w8a16 or is_vnni or w1_bias is not None or w2_bias is not None:
        return False  # the reference serves these
    if alpha is not None or limit is not None:
        return False
    return w1.get_dtype() == x.get_dtype() and static_sizes(w1, w2)


@L.register_lowering(OP, type_promotion_kind=None)
def lower_fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, inplace=False, use_int8_w8a8=False,
                        use_fp8_w8a16=False, w1_scale=None, w2_scale=None, block_size=None, a1_scale=None,
                        a2_scale=None, w1_bias=None, w2_bias=None, alpha=None, limit=None, is_vnni=False):
    args = (hidden_states, w1, w2, topk_weights, topk_ids, inplace, use_int8_w8a8, use_fp8_w8a16, w1_scale,
            w2_scale, block_size, a1_scale, a2_scale, w1_bias, w2_bias, alpha, limit, is_vnni)
    if not _template_can_serve(hidden_states, w1, w2, use_int8_w8a8, use_fp8_w8a16, w1_bias, w2_bias,
                               alpha, limit, is_vnni):
        return L.fallback_handler(OP, add_to_fallback_set=False)(*args)
    sizes = guard_ints({"topk": topk_ids.get_size()[1]})  # a model's top-k does not change between calls
    if sizes is None:
        return L.fallback_handler(OP, add_to_fallback_set=False)(*args)
    experts, two_n, k = (int(s) for s in w1.get_size())
    n = two_n // 2
    values = frozen_values(hidden_states.get_dtype(), w1, w2)
    packed = {"W1P": None, "W2P": None}
    if values is not None:
        gate_up, down = values
        packed["W1P"] = packed_constant(*(half for e in range(experts) for half in (gate_up[e, :n], gate_up[e, n:])))
        packed["W2P"] = packed_constant(*(down[e] for e in range(experts)))
    if topk_weights.get_dtype() != torch.float32:
        topk_weights = L.to_dtype(topk_weights, torch.float32)
    inputs = {
        "X": realize_input(hidden_states),
        "W1": None if values is not None else realize_input(w1, True),
        "W2": None if values is not None else realize_input(w2, True),
        **packed,
        "TW": realize_input(topk_weights, True),
        "TI": realize_input(topk_ids, True),
    }
    layout = ir.FixedLayout(hidden_states.get_device(), hidden_states.get_dtype(), [hidden_states.get_size()[0], k])
    return FusedExpertsTemplate(inputs, layout, n, experts, sizes["topk"]).select()

