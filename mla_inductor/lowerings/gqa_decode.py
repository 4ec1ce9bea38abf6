"""Lowering of mla::gqa_decode_attention to the flash-decoding template of mla_decode, one request per
(batch row, key/value head)."""

from __future__ import annotations

import math

import torch
from torch._inductor import ir
from torch._inductor import lowering as L
from torch._inductor.virtualized import V

from .mla_decode import ATTENTION_HEADERS
from .template import FusedOpTemplate, guard_ints, realize_input, row_scale_strides, templates_serve

OP = torch.ops.mla.gqa_decode_attention.default


class GqaDecodeAttentionTemplate(FusedOpTemplate):
    template_file = "gqa_decode_attention.cpp.j2"
    output = "OUT"

    def __init__(self, inputs: dict, layout: ir.Layout, dims: dict, scale: float, softcap: float,
                 sliding_window: int, window_block: int) -> None:
        super().__init__("mla_gqa_decode_attention", inputs, layout)
        self.dims = dims  # the compile-time sizes: G, D, DV
        self.scale, self.softcap = scale, softcap
        self.sliding_window, self.window_block = sliding_window, window_block

    def headers(self) -> tuple[str, ...]:
        return ATTENTION_HEADERS

    def options(self, kernel) -> dict:
        q, k, v, mask = (self.inputs[name] for name in ("Q", "K", "V", "MASK"))
        strides = dict(q_stride_b=kernel.stride(q, 0), q_stride_h=kernel.stride(q, 1))
        for prefix, t in (("k", k), ("v", v)):
            strides.update({f"{prefix}_stride_b": kernel.stride(t, 0), f"{prefix}_stride_h": kernel.stride(t, 1),
                            f"{prefix}_stride_t": kernel.stride(t, 2)})
        if mask is not None:
            batched = len(mask.get_size()) == 4 and not V.graph.sizevars.statically_known_equals(mask.get_size()[0], 1)
            strides["mask_stride_b"] = kernel.stride(mask, 0) if batched else 0
            strides["mask_origin"] = [0] * len(mask.get_size())
        # an fp8 cache's scales by the RequestRows member they fill: (input, strides, origin)
        row_scales = {member: (t, *row_scale_strides(kernel, t, rows_dims=3))
                      for member, t in (("key", self.inputs["K_SCALE"]), ("value", self.inputs["V_SCALE"]))
                      if t is not None}
        return dict(
            **self.dims,
            **strides,
            BATCH=kernel.size(q, 0),
            KV_HEADS=kernel.size(k, 1),
            ROWS=kernel.size(k, 2),
            scale=f"{float(self.scale)!r}f",
            softcap=f"{float(self.softcap)!r}f",
            sliding_window=self.sliding_window,
            window_block=self.window_block,
            row_scales=row_scales,
        )


@L.register_lowering(OP, type_promotion_kind=None)
def lower_gqa_decode_attention(query, key, value, attn_mask=None, scale=None, softcap=0.0, sliding_window=0,
                               window_block=1, k_scale=None, v_scale=None):
    # The op's fake implementation has checked shapes and dtypes (ops/gqa_decode.py::check_args). Heads
    # per group and row widths shape the kernel's tiles and scratch: compile-time constants. (The heads
    # are guarded one by one: guard_int of a symbolic floor division fails on its value range.) So is
    # the sliding window, which a model does not change between steps (automatic dynamic makes it a
    # symbol once two calls differ).
    serves = templates_serve(query)
    sizes = serves and guard_ints(
        dict(heads=query.get_size()[1], kv_heads=key.get_size()[1], D=query.get_size()[3], DV=value.get_size()[3],
             sliding_window=sliding_window, window_block=window_block)
    )
    if not sizes:
        return L.fallback_handler(OP, add_to_fallback_set=False)(query, key, value, attn_mask, scale, softcap,
                                                                 sliding_window, window_block, k_scale, v_scale)
    dims = dict(G=sizes["heads"] // sizes["kv_heads"], D=sizes["D"], DV=sizes["DV"])
    inputs = {
        "Q": realize_input(query),
        "K": realize_input(key),
        "V": realize_input(value),
        "MASK": realize_input(attn_mask),
        "K_SCALE": realize_input(k_scale),
        "V_SCALE": realize_input(v_scale),
    }
    layout = ir.FixedLayout(query.get_device(), query.get_dtype(),
                            [query.get_size()[0], query.get_size()[1], 1, dims["DV"]])
    scale = 1 / math.sqrt(dims["D"]) if scale is None else scale
    return GqaDecodeAttentionTemplate(inputs, layout, dims, scale, softcap, sizes["sliding_window"],
                                      sizes["window_block"]).select()
