"""Lowering of mla::prefill_attention to the flash-attention template (templates/prefill_attention.cpp.j2,
flash_attention.h): bf16 where the C++ targets AVX2 or AVX-512 (packed_dot.h's tiles); the op's reference
otherwise."""

from __future__ import annotations

import torch
from torch._inductor import ir
from torch._inductor import lowering as L
from torch._inductor.virtualized import V

from .. import isa
from .mla_decode import ATTENTION_HEADERS
from .template import FusedOpTemplate, guard_ints, realize_input, templates_serve

OP = torch.ops.mla.prefill_attention.default


class PrefillAttentionTemplate(FusedOpTemplate):
    template_file = "prefill_attention.cpp.j2"
    output = "OUT"

    def __init__(self, inputs: dict, layout: ir.Layout, dims: dict, is_causal: bool, scale: float,
                 softcap: float) -> None:
        super().__init__("mla_prefill_attention", inputs, layout)
        self.dims = dims  # the compile-time sizes: G, D, DV
        self.is_causal, self.scale, self.softcap = is_causal, scale, softcap

    def headers(self) -> tuple[str, ...]:
        return ATTENTION_HEADERS + ("packed_dot.h", "flash_attention.h")

    def options(self, kernel) -> dict:
        q, k, v, mask = (self.inputs[name] for name in ("Q", "K", "V", "MASK"))
        options = {f"{name}_strides": [kernel.stride(t, dim) for dim in range(3)]
                   for name, t in (("q", q), ("k", k), ("v", v))}
        if mask is not None:
            size = mask.get_size()
            lead = 4 - len(size)
            broadcast = [dim < lead or V.graph.sizevars.statically_known_equals(size[dim - lead], 1) for dim in range(4)]
            options.update(
                mask_strides=[0 if broadcast[dim] else kernel.stride(mask, dim - lead) for dim in range(4)],
                mask_origin=[0] * len(size),
                mask_batch=1 if broadcast[0] else kernel.size(q, 0),
                mask_heads=1 if broadcast[1] else kernel.size(q, 1),
            )
        return dict(
            **self.dims,
            **options,
            BATCH=kernel.size(q, 0),
            KV_HEADS=kernel.size(k, 1),
            ROWS=kernel.size(q, 2),
            KEY_ROWS=kernel.size(k, 2),
            is_causal=self.is_causal,
            scale=f"{float(self.scale)!r}f",
            softcap=f"{float(self.softcap)!r}f",
        )


def template_serves(query) -> bool:
    """bf16 on a target with packed_dot.h's tiles (AVX2 with FMA, or AVX-512)."""
    return (templates_serve(query) and query.get_dtype() == torch.bfloat16
            and isa.at_least("avx2", isa.target_isa()))


@L.register_lowering(OP, type_promotion_kind=None)
def lower_prefill_attention(query, key, value, attn_mask=None, is_causal=False, scale=None, softcap=0.0):
    # The op's fake implementation has checked shapes and dtypes (ops/mla_prefill.py::check_args). Head
    # counts and widths shape the kernel's tiles: compile-time constants (a model's do not change).
    sizes = template_serves(query) and guard_ints(
        dict(heads=query.get_size()[1], kv_heads=key.get_size()[1], D=query.get_size()[3], DV=value.get_size()[3]))
    if not sizes:
        return L.fallback_handler(OP, add_to_fallback_set=False)(query, key, value, attn_mask, is_causal, scale,
                                                                 softcap)
    dims = dict(G=sizes["heads"] // sizes["kv_heads"], D=sizes["D"], DV=sizes["DV"])
    inputs = {
        "Q": realize_input(query),
        "K": realize_input(key),
        "V": realize_input(value),
        "MASK": realize_input(attn_mask),
    }
    layout = ir.FixedLayout(query.get_device(), query.get_dtype(),
                            [*query.get_size()[:3], dims["DV"]])
    scale = sizes["D"] ** -0.5 if scale is None else scale
    return PrefillAttentionTemplate(inputs, layout, dims, is_causal, scale, softcap).select()
