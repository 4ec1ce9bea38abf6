"""linear: the 16-bit Linears no other fusion took, into `mla::linear`: at every row count where the CPU
has no native GEMM for them (bf16 without AVX512-BF16: AVX2 EPYCs, Skylake / Cascade Lake Xeons; fp16
without AVX512-FP16: all but the AMX Xeons), and at decode's few rows where it has one (bf16 with
AVX512-BF16), where oneDNN's one-row GEMV streams the weights at half the memory's rate.

There what Inductor makes of such a Linear, ATen's mm or oneDNN's prepacked linear under freezing,
emulates the dtype at 2-20 GFLOP/s: at 8 rows a Llama-3-8B MLP streamed its bf16 weights at 3.3 GB/s of
the 21 the memory gives, its fp16 ones at 2.5. The projection templates' tiles widen the weights to fp32
in registers instead (docs/linear.md). Their fusions cover the attention input; o_proj, the MLP, an
MoE's shared experts and lm_head are left, and decide a decode step at batch 8 and every prefill.

Where the bf16 GEMM is native, oneDNN's one-row bf16 product streamed a DeepSeek-V2-Lite decode step's
o_proj, MLPs and lm_head at 18-21 GB/s on a Zen 4 EPYC, the templates at 25 (NT tiles) and 31 (weights
packed under freezing) with 33 GB/s of copy bandwidth; oneDNN catches up with more rows. So there the
rewrite takes a Linear whose rows are static and at most `max_native_rows()` (docs/linear.md has the
measurements per CPU kind), and leaves dynamic row counts, prefill and fp16 to oneDNN.

Matched by walking the graph, after every other fusion and after quantized Linears got their own
spelling back (passes.py), so that it takes only what is left: `mm(x, permute(w, [1, 0]))` and
`addmm(bias, x, permute(w, [1, 0]))` of x and a weight of one such dtype, the weight a graph input (a
parameter, nn.Linear's [N, K]; a constant under freezing). GEMMs of activations (attention's, a weight
computed in the graph such as a dequantized one) are no Linears and stay as they are.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from torch._inductor import config as inductor_config

from .. import isa
from ..record import record_decision
from ..lowerings.segment_gemm import MAX_ROWS_AMX
from .contraction import GRAPH_INPUT_OPS

FUSION = "linear"
aten = torch.ops.aten


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
    return weight if weight.op in GRAPH_INPUT_OPS else None


def _dtype(node: Node, dim: int) -> Optional[torch.dtype]:
    """The dtype of a tensor node of `dim` dims, else None."""
    value = node.meta.get("val")
    return value.dtype if isinstance(value, torch.Tensor) and value.dim() == dim else None


def _linear_operands(gemm: Node, dtypes: tuple[torch.dtype, ...]) -> Optional[tuple[Node, Node, Optional[Node]]]:
    """(x, weight, bias) of a GEMM that is a Linear in one of `dtypes`, else None."""
    if gemm.target is aten.mm.default:
        bias, (x, operand) = None, gemm.args
    elif gemm.target is aten.addmm.default and gemm.kwargs.get("beta", 1) == 1 and gemm.kwargs.get("alpha", 1) == 1:
        bias, x, operand = gemm.args[:3]
    else:
        return None
    weight = _parameter(operand)
    dtype = _dtype(x, 2)
    if weight is None or dtype not in dtypes or _dtype(weight, 2) != dtype:
        return None
    if bias is not None and not (_dtype(bias, 1) == dtype and statically_known_true(
            bias.meta["val"].shape[0] == weight.meta["val"].shape[0])):
        return None  # a bias broadcast from another shape: not nn.Linear's
    return x, weight, bias


# Rows up to which the templates beat a native bf16 GEMM (benchmarks/linear.py --native, 2 threads; see
# docs/linear.md): on a Zen 4 EPYC, frozen (the weights packed at compile time) 1.45x oneDNN's prepacked
# GEMM at one row and 1.38x at 16; unfrozen (NT tiles over nn.Linear's rows) 1.35x at one row, 1.18x at
# 8, 1.02x at 16. On an AMX Xeon oneDNN's tiles take over from 8 rows (segment_gemm.MAX_ROWS_AMX).
MAX_NATIVE_ROWS_FROZEN = 16
MAX_NATIVE_ROWS_UNFROZEN = 8


def max_native_rows() -> int:
    """Rows up to which a bf16 Linear is rewritten where oneDNN's bf16 GEMM is native."""
    if isa.host_isa() == "amx":
        return MAX_ROWS_AMX
    return MAX_NATIVE_ROWS_FROZEN if inductor_config.freezing else MAX_NATIVE_ROWS_UNFROZEN


def _template_wins(x: Node, dtype: torch.dtype) -> bool:
    """Whether mla::linear beats the GEMM Inductor would run for this Linear's rows."""
    if not isa.native_gemm(dtype):
        return True
    if dtype != torch.bfloat16:
        return False  # fp16 with AVX512-FP16 (AMX Xeons): not measured against oneDNN's
    rows = x.meta["val"].shape[0]
    return isinstance(rows, int) and rows <= max_native_rows()


def rewrite_linears(graph: Graph, stage: str) -> int:
    """Every Linear left in `graph` that mla::linear serves faster here (`_template_wins`) as mla::linear;
    returns how many."""
    rewritten = 0
    for gemm in list(graph.nodes):
        if gemm.op != "call_function":
            continue
        operands = _linear_operands(gemm, (torch.bfloat16, torch.float16))
        if operands is None or not _template_wins(operands[0], operands[0].meta["val"].dtype):
            continue
        with graph.inserting_before(gemm):
            linear = graph.call_function(torch.ops.mla.linear.default, operands)
        linear.meta.update(gemm.meta)
        gemm.replace_all_uses_with(linear)
        graph.erase_node(gemm)
        record_decision(FUSION, [linear], stage, None)
        rewritten += 1
    return rewritten
