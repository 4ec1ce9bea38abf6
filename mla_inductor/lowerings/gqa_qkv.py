"""Lowering of mla::qkv_projection (the GEMM, bias, head norms, RoPE and layout of mla::qkv / mla::gqa_qkv)
to the segmented GEMM template of the projection ops, with bias, head norms and RoPE as its epilogue."""

from __future__ import annotations

from typing import Optional

import torch
from torch._inductor import ir
from torch._inductor import lowering as L

from .template import FusedOpTemplate, guard_ints, realize_input, static_sizes, templates_serve
from .segment_gemm import (QUANTIZED_GEMM_HEADERS, packed_weights, packs_rows, quantized_options,
                           quantized_weights, scales_fit_tiles)

OP = torch.ops.mla.qkv_projection.default
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class QkvProjectionTemplate(FusedOpTemplate):
    template_file = "gqa_qkv.cpp.j2"

    def __init__(self, inputs: dict, segments: list, scales: list, layout: ir.Layout, segment_rows: list[int],
                 d_head: int, rotated_heads: int, output_layout: str, quantized: Optional[dict],
                 head_norms: tuple[int, int, float, str]) -> None:
        named = {**{f"W{i}": w for i, w in enumerate(segments)}, **{f"WS{i}": s for i, s in enumerate(scales)}}
        super().__init__("mla_qkv_projection", {**inputs, **named}, layout)
        self.segments, self.scales, self.segment_rows = segments, scales, segment_rows
        self.d_head, self.rotated_heads, self.output_layout = d_head, rotated_heads, output_layout
        self.quantized = quantized  # segment_gemm.quantized_weights
        self.num_q_heads, self.num_kv_heads, self.head_norm_eps, self.head_norm_type = head_norms  # for QN, KN

    def _quantized_options(self, kernel) -> dict:
        """quantize_x (the W8A8 scheme, or None) and weight_scales: per weight (scale input, nt_dot.h's
        WeightScales)."""
        if not self.scales:
            return dict(quantize_x=None, weight_scales=[])
        options = quantized_options(kernel, self.quantized, **{f"w{i}": w for i, w in enumerate(self.segments)})
        scales = [options[f"w{i}_scales"] for i in range(len(self.segments))]
        return dict(quantize_x=options["quantize_x"], weight_scales=list(zip(self.scales, scales)))

    def packs_rows(self) -> bool:
        return self.inputs["WP"] is None and not self.quantized and packs_rows(self.inputs["X"].get_dtype())

    def headers(self) -> tuple[str, ...]:
        packed = ("packed_dot.h",) if self.inputs["WP"] is not None or self.packs_rows() else ()
        rope = ("rope.h",) if self.inputs["COS"] is not None else ()
        quantized = QUANTIZED_GEMM_HEADERS if self.quantized else ()
        return ("widen.h", "nt_dot.h") + quantized + packed + rope

    def options(self, kernel) -> dict:
        x = self.inputs["X"]
        return dict(
            M=kernel.size(x, 0),
            K=kernel.size(x, 1),
            N=sum(self.segment_rows),
            ldx=kernel.stride(x, 0),
            segments=self.segments,
            segment_rows=self.segment_rows,
            ld_segments=[kernel.stride(w, 0) for w in self.segments],
            **self._quantized_options(kernel),
            y_origin=[0] * len(self.layout.size),
            d_head=self.d_head,
            rotated_heads=self.rotated_heads,
            num_q_heads=self.num_q_heads,
            normed_heads=self.num_q_heads + self.num_kv_heads,
            head_norm_eps=f"{float(self.head_norm_eps)!r}f",
            gemma_head_norms=self.head_norm_type == "gemma_rms_norm",
            output_layout=self.output_layout,
            PACKS_ROWS=self.packs_rows(),
        )


def _template_can_serve(x, weights, cos, weight_scales) -> bool:
    if not templates_serve(x):
        return False
    weight_dtype = weights[0].get_dtype() if weight_scales is not None else x.get_dtype()
    if x.get_dtype() not in SUPPORTED_DTYPES or any(w.get_dtype() != weight_dtype for w in weights):
        return False
    if cos is not None and cos.get_dtype() not in SUPPORTED_DTYPES:
        return False
    if not static_sizes(*weights):
        return False
    return all(scales_fit_tiles(w, None) for w in weights)


@L.register_lowering(OP, type_promotion_kind=None)
def lower_qkv_projection(x, weights, bias, cos_cache, sin_cache, d_head, num_q_heads, num_kv_heads, output_layout,
                         weight_scales=None, activation_quant="none", input_scale=None, q_norm_weight=None,
                         k_norm_weight=None, head_norm_eps=1e-6, head_norm_type="rms_norm"):
    args = (x, weights, bias, cos_cache, sin_cache, d_head, num_q_heads, num_kv_heads, output_layout)
    dims = guard_ints(dict(hidden=x.get_size()[-1]))
    if dims is None or not _template_can_serve(x, weights, cos_cache, weight_scales):
        return L.fallback_handler(OP, add_to_fallback_set=False)(
            *args, weight_scales=weight_scales, activation_quant=activation_quant, input_scale=input_scale,
            q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, head_norm_eps=head_norm_eps,
            head_norm_type=head_norm_type)
    batch, seq, hidden = x.get_size()
    rows = batch * seq
    x2d = L.view(realize_input(x, contiguous=True), [rows, hidden])  # [B, S, H] rows: dense after realize
    segment_rows = [int(w.get_size()[0]) for w in weights]
    # quantized weights stream as they are, one byte an element (segment_gemm.quantized_weights)
    packed = packed_weights(x.get_dtype(), *weights) if weight_scales is None else None
    segments = [] if packed is not None else [realize_input(w) for w in weights]
    scales = [realize_input(s, contiguous=True) for s in weight_scales or ()]
    quantized = quantized_weights(weight_scales, None, activation_quant, *weights)
    as_rows = lambda t: None if t is None else L.view(realize_input(t, contiguous=True), [rows, d_head])  # noqa: E731
    inputs = {
        "X": realize_input(x2d),
        "WP": packed,
        "BIAS": realize_input(bias, contiguous=True),
        "COS": as_rows(cos_cache),
        "SIN": as_rows(sin_cache),
        "XS": realize_input(input_scale, contiguous=True),  # fp8_static's activation scale
        "QN": realize_input(q_norm_weight, contiguous=True),  # Qwen3's, Gemma-3's q_norm / k_norm: [d_head]
        "KN": realize_input(k_norm_weight, contiguous=True),
    }
    out_features = sum(segment_rows)
    size = [batch, seq, out_features] if output_layout == "BSD" else [out_features // d_head, batch, seq, d_head]
    layout = ir.FixedLayout(x.get_device(), x.get_dtype(), size)
    rotated_heads = num_q_heads + num_kv_heads if cos_cache is not None else 0
    head_norms = (num_q_heads, num_kv_heads, head_norm_eps, head_norm_type)
    return QkvProjectionTemplate(inputs, segments, scales, layout, segment_rows, d_head, rotated_heads,
                                 output_layout, quantized, head_norms).select()
