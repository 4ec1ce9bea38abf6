"""Lowering of mla::q_b_absorb: the q_b GEMM (the projection templates' building block, packed under
freezing), then per head the W_kc absorption and the RoPE of q_pe from the fp32 GEMM row."""

from __future__ import annotations

import sympy
import torch
from torch._inductor import ir
from torch._inductor import lowering as L

from .template import FusedOpTemplate, cpp_rope_style, realize_input, templates_serve
from .segment_gemm import (QUANTIZED_GEMM_HEADERS, frozen_values, packed_constant, quantized_options,
                           quantized_weights, scales_fit_tiles)

OP = torch.ops.mla.q_b_absorb.default
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class QBAbsorbTemplate(FusedOpTemplate):
    template_file = "q_b_absorb.cpp.j2"

    def __init__(self, inputs: dict, layout: ir.Layout, dims: dict, rope_style: str, quantized) -> None:
        super().__init__("mla_q_b_absorb", inputs, layout)
        self.dims, self.rope_style = dims, rope_style
        self.quantized = quantized  # segment_gemm.quantized_weights of q_b_weight

    def headers(self) -> tuple[str, ...]:
        packed = ("packed_dot.h",) if self.inputs["WP"] is not None else ()
        quantized = QUANTIZED_GEMM_HEADERS if self.quantized else ()
        return ("widen.h", "nt_dot.h") + quantized + packed + ("absorb.h", "rope.h")

    def options(self, kernel) -> dict:
        x, wqb, w_kc = self.inputs["Q_A"], self.inputs["WQB"], self.inputs["W_KC"]
        packed = self.inputs["WP"] is not None  # then W_kc is packed too (WKC_P), and W_KC absent
        return dict(
            **quantized_options(kernel, self.quantized, q_b=wqb),
            M=kernel.size(x, 0),
            ldx=kernel.stride(x, 0),
            ldw=None if packed else kernel.stride(wqb, 0),
            w_kc_stride_h=None if packed else kernel.stride(w_kc, 0),
            w_kc_stride_d=None if packed else kernel.stride(w_kc, 1),
            ld_cos=kernel.stride(self.inputs["COS"], 0),
            ld_sin=kernel.stride(self.inputs["SIN"], 0),
            rope_style=cpp_rope_style(self.rope_style),
            **self.dims,
        )


def _static_dims(q_a, q_b_weight, w_kc, cos) -> dict | None:
    heads, nope, latent = w_kc.get_size()
    sizes = dict(K=q_a.get_size()[1], H=heads, NOPE=nope, L=latent, ROPE=2 * cos.get_size()[1])
    if not all(isinstance(s, (int, sympy.Integer)) for s in sizes.values()):
        return None  # weights are parameters: static in every graph we rewrite
    return {k: int(v) for k, v in sizes.items()}


@L.register_lowering(OP, type_promotion_kind=None)
def lower_q_b_absorb(q_a, q_b_weight, w_kc, cos, sin, rope_style, q_b_weight_scale=None, weight_block_size=None,
                     activation_quant="none"):
    dims = _static_dims(q_a, q_b_weight, w_kc, cos)
    if (
        dims is None
        or not templates_serve(q_a)
        or q_a.get_dtype() not in SUPPORTED_DTYPES
        or cos.get_dtype() not in SUPPORTED_DTYPES
        or not scales_fit_tiles(q_b_weight, weight_block_size)
    ):
        return L.fallback_handler(OP, add_to_fallback_set=False)(q_a, q_b_weight, w_kc, cos, sin, rope_style,
                                                                 q_b_weight_scale, weight_block_size, activation_quant)
    quantized = quantized_weights(q_b_weight_scale, weight_block_size, activation_quant, q_b_weight)
    # a quantized q_b weight streams as it is, and then W_kc stays unpacked too
    frozen = None if quantized else frozen_values(q_a.get_dtype(), q_b_weight, w_kc)
    packed = packed_w_kc = None
    if frozen is not None:
        packed = packed_constant(frozen[0])
        # each head's W_kc^T [kv_lora_rank, nope] as a Linear-style weight: the absorption of a head
        # is then one packed GEMM over its tokens
        packed_w_kc = packed_constant(*(w.T for w in frozen[1]))
    inputs = {
        "Q_A": realize_input(q_a),
        "WQB": None if packed else realize_input(q_b_weight),
        "WP": packed,
        "W_KC": None if packed else realize_input(w_kc),
        "WKC_P": packed_w_kc,
        "COS": realize_input(cos),
        "SIN": realize_input(sin),
        "QBS": realize_input(q_b_weight_scale, True),
    }
    tokens = q_a.get_size()[0]
    layout = ir.FixedLayout(q_a.get_device(), q_a.get_dtype(), [tokens, dims["H"], dims["L"] + dims["ROPE"]])
    return QBAbsorbTemplate(inputs, layout, dims, rope_style, quantized).select()
