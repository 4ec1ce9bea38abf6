"""Lowerings of mla::rotary_embedding and mla::apply_rope to vectorized C++ templates: one pass over the heads."""

from __future__ import annotations

from typing import Optional

import sympy
import torch
from torch._inductor import ir
from torch._inductor import lowering as L
from torch._inductor.virtualized import V

from ..ops.rope import token_shape
from .template import FusedOpTemplate, cpp_rope_style, guard_ints, realize_input, templates_serve

OP = torch.ops.mla.rotary_embedding.default
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _compile_time_dims(positions, query, key, head_size, cos_sin_cache) -> Optional[dict]:
    """Head counts and widths shape the kernel's loops: compile-time constants (guard_ints)."""
    token_dims = len(positions.get_size())

    def heads(t):
        size = t.get_size()
        return size[-1] // head_size if len(size) == token_dims + 1 else size[-2]

    sizes = dict(head_size=head_size, rotary_dim=cos_sin_cache.get_size()[1], q_heads=heads(query),
                 k_heads=heads(key))
    return guard_ints(sizes)


class RotaryEmbeddingTemplate(FusedOpTemplate):
    template_file = "rotary_embedding.cpp.j2"

    def __init__(self, inputs: dict, layout: ir.Layout, dims: dict, is_neox: bool) -> None:
        super().__init__("mla_rotary_embedding", inputs, layout)
        self.dims, self.is_neox = dims, is_neox

    def headers(self) -> tuple[str, ...]:
        return ("widen.h", "rope.h")

    def options(self, kernel) -> dict:
        pos, q, k, cache = (self.inputs[n] for n in ("POS", "Q", "K", "CACHE"))
        token_dims = len(pos.get_size())

        def head_stride(t):  # heads are either within the last dim or a dim of their own
            rank = len(t.get_size())
            return self.dims["head_size"] if rank == token_dims + 1 else kernel.stride(t, rank - 2)

        return dict(
            tokens=" * ".join(kernel.size(pos, d) for d in range(token_dims)) or "1",
            **self.dims,
            max_positions=kernel.size(cache, 0),
            # the token dims are one (or, when several, the input is contiguous): the last one's stride
            ldq=kernel.stride(q, token_dims - 1),
            ldk=kernel.stride(k, token_dims - 1),
            ldq_head=head_stride(q),
            ldk_head=head_stride(k),
            pos_origin=[0] * token_dims,
            q_origin=[0] * len(q.get_size()),
            k_origin=[0] * len(k.get_size()),
            rope_style=cpp_rope_style("neox" if self.is_neox else "interleaved"),
        )


def _template_can_serve(positions, query, cos_sin_cache) -> bool:
    return (
        templates_serve(query)
        and query.get_dtype() in SUPPORTED_DTYPES
        and cos_sin_cache.get_dtype() in SUPPORTED_DTYPES
        and len(positions.get_size()) >= 1
    )


@L.register_lowering(OP, type_promotion_kind=None)
def lower_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
    tokens = token_shape(query.get_size(), positions.get_size())
    if len(tokens) != len(positions.get_size()):  # SGLang's flat positions for [B, S, ...]: viewed as [B, S]
        positions = L.view(positions, list(tokens))
    # A layout the token dims do not explain (flat positions of a dynamic [B, S, ...]): the reference serves it
    readable = len(query.get_size()) - len(tokens) in (1, 2) and len(key.get_size()) - len(tokens) in (1, 2)
    dims = _compile_time_dims(positions, query, key, head_size, cos_sin_cache) if readable else None
    if dims is None or not _template_can_serve(positions, query, cos_sin_cache):
        return L.fallback_handler(OP, add_to_fallback_set=False)(positions, query, key, head_size, cos_sin_cache,
                                                                 is_neox)
    several_token_dims = len(positions.get_size()) > 1  # then only a contiguous layout collapses them
    inputs = {
        "POS": realize_input(positions, contiguous=True),
        "Q": realize_input(query, contiguous=several_token_dims),
        "K": realize_input(key, contiguous=several_token_dims),
        "CACHE": realize_input(cos_sin_cache, contiguous=True),
    }
    q_heads, k_heads = dims["q_heads"], dims["k_heads"]
    tokens = sympy.Mul(*positions.get_size())
    layout = ir.FixedLayout(query.get_device(), query.get_dtype(), [tokens, q_heads + k_heads, dims["head_size"]])
    y = RotaryEmbeddingTemplate(inputs, layout, dims, is_neox).select()
    q_out = L.slice_(y, 1, 0, q_heads)
    k_out = L.slice_(y, 1, q_heads, q_heads + k_heads)
    return L.view(q_out, list(query.get_size())), L.view(k_out, list(key.get_size()))


# --- mla::apply_rope -------------------------------------------------------------------------------

APPLY_OP = torch.ops.mla.apply_rope.default


class ApplyRopeTemplate(FusedOpTemplate):
    template_file = "apply_rope.cpp.j2"

    def __init__(self, inputs: dict, layout: ir.Layout, dims: dict, style: str) -> None:
        super().__init__("mla_apply_rope", inputs, layout)
        self.dims, self.style = dims, style

    def headers(self) -> tuple[str, ...]:
        return ("widen.h", "rope.h")

    def options(self, kernel) -> dict:
        x, cos, sin = (self.inputs[n] for n in ("X", "COS", "SIN"))
        row_dims = len(x.get_size()) - 1
        cos_dims = len(cos.get_size()) - 1

        def broadcast_stride(t, d):
            """t's stride along x's leading dim d; 0 where t has no such dim or a size-1 one."""
            td = d - (row_dims - cos_dims)
            if td < 0 or V.graph.sizevars.statically_known_equals(t.get_size()[td], 1):
                return "0"
            return kernel.stride(t, td)

        return dict(
            **self.dims,
            rows=" * ".join(f"({kernel.size(x, d)})" for d in range(row_dims)) or "1",
            row_dims=[
                dict(size=kernel.size(x, d), x=kernel.stride(x, d), cos=broadcast_stride(cos, d),
                     sin=broadcast_stride(sin, d))
                for d in range(row_dims)
            ],
            x_origin=[0] * len(x.get_size()),
            cos_origin=[0] * len(cos.get_size()),
            rope_style=cpp_rope_style(self.style),
        )


@L.register_lowering(APPLY_OP, type_promotion_kind=None)
def lower_apply_rope(x, cos, sin, style):
    dims = guard_ints(dict(head_size=x.get_size()[-1], rotary_dim=2 * cos.get_size()[-1]))
    if (
        dims is None
        or not templates_serve(x)
        or x.get_dtype() not in SUPPORTED_DTYPES
        or cos.get_dtype() not in SUPPORTED_DTYPES
    ):
        return L.fallback_handler(APPLY_OP, add_to_fallback_set=False)(x, cos, sin, style)
    inputs = {"X": realize_input(x), "COS": realize_input(cos), "SIN": realize_input(sin)}
    layout = ir.FixedLayout(x.get_device(), x.get_dtype(), list(x.get_size()))
    return ApplyRopeTemplate(inputs, layout, dims, style).select()
