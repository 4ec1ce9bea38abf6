"""Lowering of mla::qkv_a_proj to the segmented NT GEMM template with RMSNorm epilogues."""

from __future__ import annotations

from typing import Optional

import torch
from torch._inductor import ir
from torch._inductor import lowering as L

from .template import FusedOpTemplate, cpp_rope_style, realize_input, static_sizes, templates_serve
from .segment_gemm import (QUANTIZED_GEMM_HEADERS, packed_weights, packs_rows, quantized_options,
                           quantized_weights, scales_fit_tiles)

OP = torch.ops.mla.qkv_a_proj.default
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class QkvAProjTemplate(FusedOpTemplate):
    template_file = "qkv_a_proj.cpp.j2"

    def __init__(self, inputs: dict, layout: ir.Layout, nq: int, nkv: int, q_eps: float, kv_eps: float,
                 k_rope_style: str, quantized: Optional[dict]) -> None:
        super().__init__("mla_qkv_a_proj", inputs, layout)
        self.nq, self.nkv, self.k_rope_style = nq, nkv, k_rope_style
        self.quantized = quantized  # segment_gemm.quantized_weights
        self.q_eps, self.kv_eps = q_eps, kv_eps

    def packs_rows(self) -> bool:
        return self.inputs["WQ"] is not None and not self.quantized and packs_rows(self.inputs["X"].get_dtype())

    def headers(self) -> tuple[str, ...]:
        packed = ("packed_dot.h",) if self.inputs["WP"] is not None or self.packs_rows() else ()
        rope = ("rope.h",) if self.inputs["K_COS"] is not None else ()
        quantized = QUANTIZED_GEMM_HEADERS if self.quantized else ()
        return ("widen.h", "nt_dot.h") + quantized + packed + rope

    def options(self, kernel) -> dict:
        x, wq, wkv = self.inputs["X"], self.inputs["WQ"], self.inputs["WKV"]
        packed = self.inputs["WP"] is not None
        x_size = x.get_size()
        return dict(
            **quantized_options(kernel, self.quantized, q=wq, kv=wkv),
            M=" * ".join(kernel.size(x, d) for d in range(len(x_size) - 1)) or "1",
            K=kernel.size(x, -1),
            NQ=self.nq,
            NKV=self.nkv,
            L=kernel.size(self.inputs["KVW"], 0),
            ldx=kernel.stride(x, len(x_size) - 2) if len(x_size) > 1 else kernel.size(x, -1),
            ldwq=None if packed else kernel.stride(wq, 0),
            ldwkv=None if packed else kernel.stride(wkv, 0),
            x_origin=[0] * len(x_size),
            y_origin=[0] * len(self.layout.size),
            cos_origin=[0] * len(x_size),
            k_rope_style=cpp_rope_style(self.k_rope_style),
            q_eps=f"{self.q_eps!r}f",
            kv_eps=f"{self.kv_eps!r}f",
            PACKS_ROWS=self.packs_rows(),
        )


def _template_can_serve(x, weights, k_cos, weight_block_size) -> bool:
    if not templates_serve(x):
        return False
    if x.get_dtype() not in SUPPORTED_DTYPES or len(x.get_size()) not in (2, 3):
        return False
    if k_cos is not None and k_cos.get_dtype() not in SUPPORTED_DTYPES:
        return False
    if not static_sizes(*weights):
        return False
    return all(scales_fit_tiles(w, weight_block_size) for w in weights)


@L.register_lowering(OP, type_promotion_kind=None)
def lower_qkv_a_proj(x, q_weight, kv_weight, q_norm_weight, kv_norm_weight, q_eps, kv_eps, q_bias=None,
                     kv_bias=None, q_eps_tensor=None, kv_eps_tensor=None, k_cos=None, k_sin=None,
                     k_rope_style="interleaved", q_weight_scale=None, kv_weight_scale=None, weight_block_size=None,
                     activation_quant="none"):
    args = (x, q_weight, kv_weight, q_norm_weight, kv_norm_weight, q_eps, kv_eps, q_bias, kv_bias, q_eps_tensor,
            kv_eps_tensor, k_cos, k_sin, k_rope_style, q_weight_scale, kv_weight_scale, weight_block_size,
            activation_quant)
    if not _template_can_serve(x, (q_weight, kv_weight), k_cos, weight_block_size):
        return L.fallback_handler(OP, add_to_fallback_set=False)(*args)

    x = realize_input(x, contiguous=len(x.get_size()) == 3)  # 3-D rows are flattened: they must be dense
    nq, nkv = (int(w.get_size()[0]) for w in (q_weight, kv_weight))
    quantized = quantized_weights(q_weight_scale, weight_block_size, activation_quant, q_weight, kv_weight)
    packed = None if quantized else packed_weights(x.get_dtype(), q_weight, kv_weight)
    inputs = {
        "X": x,
        "WQ": None if packed else realize_input(q_weight),
        "WKV": None if packed else realize_input(kv_weight),
        "WP": packed,
        "QW": realize_input(q_norm_weight, True),
        "KVW": realize_input(kv_norm_weight, True),
        "QB": realize_input(q_bias, True),
        "KVB": realize_input(kv_bias, True),
        "Q_EPS": realize_input(q_eps_tensor, True),
        "KV_EPS": realize_input(kv_eps_tensor, True),
        "K_COS": realize_input(k_cos, True),
        "K_SIN": realize_input(k_sin, True),
        "QS": realize_input(q_weight_scale, True),
        "KVS": realize_input(kv_weight_scale, True),
    }
    lead = list(x.get_size()[:-1])
    layout = ir.FixedLayout(x.get_device(), x.get_dtype(), [*lead, nq + nkv])
    # Consumers read q, c_kv and k_pe as views of the one output.
    y = QkvAProjTemplate(inputs, layout, nq, nkv, q_eps, kv_eps, k_rope_style, quantized).select()
    lkv = inputs["KVW"].get_size()[0]
    return (
        L.slice_(y, -1, 0, nq),
        L.slice_(y, -1, nq, nq + lkv),
        L.slice_(y, -1, nq + lkv, nq + nkv),
    )
