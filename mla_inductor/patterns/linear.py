"""linear: the bf16 Linears no other fusion took, into `mla::linear`, where the CPU has no native bf16 GEMM.

Without AVX512-BF16 (AVX2 EPYCs, Skylake / Cascade Lake Xeons) what Inductor makes of a bf16 Linear,
ATen's mm or oneDNN's prepacked linear under freezing, emulates bf16 at 2-20 GFLOP/s: at 8 rows a
Qwen3-8B MLP streamed its weights at 2.4 GB/s of the 21 the memory gives. The projection templates'
tiles widen the weights to fp32 in registers instead (docs/linear.md). Their fusions cover the
attention input; o_proj, the MLP, an MoE's shared experts and lm_head are left, and decide a decode
step at batch 8 and every prefill. Where the GEMM is native, oneDNN's stays: nothing is rewritten.

Matched by walking the graph, after every other fusion and after quantized Linears got their own
spelling back (passes.py), so that it takes only what is left: `mm(x, permute(w, [1, 0]))` and
`addmm(bias, x, permute(w, [1, 0]))` of bf16 x and a bf16 weight that is a graph input (a parameter,
nn.Linear's [N, K]; a constant under freezing). GEMMs of activations (attention's, a weight computed in
the graph such as a dequantized one) are no Linears and stay as they are.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Graph, Node

from .. import isa
from ..record import record_decision

FUSION = "linear"
aten = torch.ops.aten
_WEIGHT_SOURCES = ("placeholder", "get_attr")


def _parameter(node: Node) -> Optional[Node]:
    """The [N, K] weight that a GEMM's [K, N] operand transposes, if it is a graph input."""
    if node.op != "call_function":
        return None
    if node.target is aten.permute.default and list(node.args[1]) == [1, 0]:
        weight = node.args[0]
    elif node.target is aten.t.default:
        weight = node.args[0]
    else:
        return None
    return weight if weight.op in _WEIGHT_SOURCES else None


def _is_bf16_matrix(node: Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16 and value.dim() == 2


def _linear_operands(gemm: Node) -> Optional[tuple[Node, Node, Optional[Node]]]:
    """(x, weight, bias) of a GEMM that is a bf16 Linear, else None."""
    if gemm.target is aten.mm.default:
        bias, (x, operand) = None, gemm.args
    elif gemm.target is aten.addmm.default and gemm.kwargs.get("beta", 1) == 1 and gemm.kwargs.get("alpha", 1) == 1:
        bias, x, operand = gemm.args[:3]
        value = bias.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.dtype != torch.bfloat16 or value.dim() != 1:
            return None  # a bias broadcast from another shape: not nn.Linear's
    else:
        return None
    weight = _parameter(operand)
    if weight is None or not (_is_bf16_matrix(x) and _is_bf16_matrix(weight)):
        return None
    return x, weight, bias


def rewrite_linears(graph: Graph, stage: str) -> int:
    """Every bf16 Linear left in `graph` as mla::linear, where bf16 GEMMs are emulated; returns how many."""
    if isa.native_bf16_gemm():
        return 0
    rewritten = 0
    for gemm in list(graph.nodes):
        if gemm.op != "call_function":
            continue
        operands = _linear_operands(gemm)
        if operands is None:
            continue
        with graph.inserting_before(gemm):
            linear = graph.call_function(torch.ops.mla.linear.default, operands)
        linear.meta.update(gemm.meta)
        gemm.replace_all_uses_with(linear)
        graph.erase_node(gemm)
        record_decision(FUSION, [linear], stage, None)
        rewritten += 1
    return rewritten
