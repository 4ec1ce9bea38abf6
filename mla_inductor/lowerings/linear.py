"""Lowering of mla::linear to the projection templates' GEMM (NT tiles over nn.Linear's weight, or the
weight packed at compile time under freezing), the bias and the one rounding in each task's epilogue
(nt_task_rounded, packed_task_rounded)."""

from __future__ import annotations

import torch
from torch._inductor import ir
from torch._inductor import lowering as L
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from ..ops.linear import SUPPORTED_DTYPES
from .segment_gemm import packed_weights, packs_rows
from .template import FusedOpTemplate, realize_input, static_sizes, templates_serve

OP = torch.ops.mla.linear.default


class LinearTemplate(FusedOpTemplate):
    template_file = "linear.cpp.j2"

    def packs_rows(self) -> bool:
        return self.inputs["W"] is not None and packs_rows(self.inputs["X"].get_dtype())

    def headers(self) -> tuple[str, ...]:
        packed = ("packed_dot.h",) if self.inputs["WP"] is not None or self.packs_rows() else ()
        return ("widen.h", "nt_dot.h") + packed

    def options(self, kernel) -> dict:
        x, w = self.inputs["X"], self.inputs["W"]
        return dict(
            M=kernel.size(x, 0),
            K=kernel.size(x, 1),
            N=self.layout.size[1],
            ldx=kernel.stride(x, 0),
            ldw=None if w is None else kernel.stride(w, 0),
            PACKS_ROWS=self.packs_rows(),
        )


def _template_can_serve(x, weight) -> bool:
    if not templates_serve(x) or x.get_dtype() not in SUPPORTED_DTYPES or not static_sizes(weight):
        return False
    return not free_unbacked_symbols(x.get_size()[0])  # rows only known at run time (an MoE expert's)


@L.register_lowering(OP, type_promotion_kind=None)
def lower_linear(x, weight, bias=None):
    if not _template_can_serve(x, weight):
        return L.fallback_handler(OP, add_to_fallback_set=False)(x, weight, bias)
    packed = packed_weights(x.get_dtype(), weight)
    inputs = {
        "X": realize_input(x),
        "W": None if packed else realize_input(weight),
        "WP": packed,
        "B": realize_input(bias, True),
    }
    n = int(weight.get_size()[0])
    layout = ir.FixedLayout(x.get_device(), x.get_dtype(), [x.get_size()[0], n])
    return LinearTemplate("mla_linear", inputs, layout).select()
