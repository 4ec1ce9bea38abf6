"""Quantized linears: the spellings of a Linear over int8 or fp8 weights, made the one form the
fusions already match.

Each spelling found is rewritten to `mm(x, permute(mla::dequantize_weight(w, scale, block, dtype)))`:
a plain Linear whose weight is the dequantized one. Every fusion that matches a bf16 Linear then
matches it unchanged, and `fold` hands the fused ops that take quantized weights (qkv_a_proj,
q_b_absorb, gqa_qkv's qkv_projection) the one-byte weight and its scales instead of the dequantized
one: their templates read it as it is. A fusion declines weights its op cannot take as they are
(`decline_reason`: one quantized and one not, or block scales where the op takes per-channel ones).

What no fusion took gets its own spelling back (`restore`), node for node, so that Inductor's own
rewrites see what they would have seen without this pass (the int8 Linear stays torch's
`_weight_int8pack_mm` under freezing, say). A dequantized weight something else still reads (the
W_kc / W_vc views mla_decode takes of kv_b_proj's weight) becomes the aten computation it stands for,
which freezing folds into a constant.

The joint-graph stage is where this pays: it runs with and without freezing, and sees model code's
spelling before any of Inductor's int8 rewrites (post-grad graphs hold Inductor's `woq_int8` lowering
calls instead, and frozen ones constants folded from the scales). The post-grad stage finds nothing
left to canonicalize.

Spellings (verified on torch 2.13 with torchao 0.18):
- torchao's int8 weight-only Linear (`Int8WeightOnlyConfig`, per-row scales):
  `mm(x, permute(w_int8).to(dtype)) * scale.to(dtype).view(N)`, in either operand order.
  (Its group-wise form, `Int8WeightOnlyConfig(granularity=PerGroup(g))`, dequantizes the whole weight
  in the graph first and is not matched.)
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch.fx import Graph, Node

from .contraction import Emitter

aten, prims = torch.ops.aten, torch.ops.prims
DEQUANTIZE = torch.ops.mla.dequantize_weight.default
_ORIGIN = "mla_quantized_linear_origin"  # node.meta key of a canonical mm: the spelling it replaced


@dataclasses.dataclass
class Origin:
    """The nodes a canonical Linear replaced, copied out of the graph: their inputs are placeholders
    named after the canonical nodes' arguments that stand for them (x, weight, scale)."""

    graph: Graph
    inputs: dict[str, Node]


_SCALE_CHAIN = (aten.view.default, aten.reshape.default, prims.convert_element_type.default)


def _per_channel_scale(scale: Node, rows: int) -> Optional[tuple[Node, list[Node]]]:
    """(the source, the reshapes and casts from it to `scale`) of a per-channel scale: a floating
    tensor of `rows` values; or None."""
    chain = []
    while scale.op == "call_function" and scale.target in _SCALE_CHAIN:
        chain.append(scale)
        scale = scale.args[0]
    val = scale.meta.get("val")
    if not isinstance(val, torch.Tensor) or not val.is_floating_point() or val.numel() != rows:
        return None
    return scale, chain


def _int8_weight(node: Node) -> Optional[Node]:
    val = node.meta.get("val")
    return node if isinstance(val, torch.Tensor) and val.dtype == torch.int8 and val.dim() == 2 else None


def _torchao_int8_weight_only(mul: Node) -> Optional[tuple[Node, Node, Node, list[Node]]]:
    """(x, weight, scale, replaced nodes) of `mm(x, permute(w).to(dtype)) * scale`, or None."""
    if mul.target is not aten.mul.Tensor or len(mul.args) != 2:
        return None
    for mm, scale in (mul.args, mul.args[::-1]):
        if not (isinstance(mm, Node) and mm.target is aten.mm.default and len(mm.users) == 1
                and isinstance(scale, Node)):
            continue
        x, transposed = mm.args
        cast = transposed
        if cast.target is not prims.convert_element_type.default or len(cast.users) != 1:
            continue
        permute = cast.args[0]
        if permute.target is not aten.permute.default or list(permute.args[1]) != [1, 0] or len(permute.users) != 1:
            continue
        weight = _int8_weight(permute.args[0])
        if weight is None:
            continue
        rows = weight.meta["val"].shape[0]
        found = _per_channel_scale(scale, rows)
        if found is None or list(scale.meta["val"].shape) != [rows]:
            continue
        source, chain = found
        return x, weight, source, [mul, mm, cast, permute, *chain]
    return None


def _snapshot(nodes: list[Node], inputs: dict[str, Node]) -> Origin:
    """The nodes (any order) copied into a graph of their own, reading `inputs` as placeholders."""
    graph = Graph()
    env = {node: graph.placeholder(name) for name, node in inputs.items()}
    members = set(nodes)
    order = [n for n in nodes[0].graph.nodes if n in members]
    for node in order:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[order[-1]])
    return Origin(graph, {name: env[node] for name, node in inputs.items()})


def _after(graph: Graph, *nodes: Node) -> Node:
    """The node that follows the last of `nodes` in the graph."""
    pending = set(nodes)
    for node in graph.nodes:
        pending.discard(node)
        if not pending:
            return node.next
    raise ValueError("nodes not in the graph")


def _canonical(graph: Graph, output: Node, x: Node, weight: Node, scale: Node) -> Node:
    """`mm(x, dequantize_weight(weight, scale).T)` in place of `output` (2-D [tokens, N] either way).
    The dequantized weight is placed where its inputs are first all defined (the graph's top, for
    parameters): a fusion's replacement goes before the earliest node it replaces and may precede
    `output`, and must find its weights defined there."""
    emit = Emitter(graph, _after(graph, weight, scale), like=output)
    dtype = output.meta["val"].dtype
    transposed = emit(aten.permute.default, emit(DEQUANTIZE, weight, scale, None, dtype), [1, 0])
    emit = Emitter(graph, output, like=output)
    if x.target in (aten.view.default, aten.reshape.default) and -1 in x.args[1]:
        # torchao flattens x by `reshape(-1, K)`, F.linear by its sizes: the patterns' strict re-trace
        # compares those literals, so the view is spelled as F.linear's
        x = emit(x.target, x.args[0], [emit.size_arg(n) for n in x.meta["val"].shape])
    return emit(aten.mm.default, x, transposed)


def canonicalize(graph: Graph) -> int:
    """Every spelling of a quantized Linear (module doc) as a plain Linear over its dequantized weight."""
    rewritten = 0
    for node in list(graph.nodes):
        found = _torchao_int8_weight_only(node)
        if found is None:
            continue
        x, weight, scale, replaced = found
        origin = _snapshot(replaced, {"x": x, "weight": weight, "scale": scale})
        canonical = _canonical(graph, node, x, weight, scale)
        canonical.meta[_ORIGIN] = origin
        node.replace_all_uses_with(canonical)
        for dead in [*replaced, x]:  # outputs first; a node something else still reads stays
            if not dead.users and dead.op == "call_function":
                graph.erase_node(dead)
        rewritten += 1
    return rewritten


def _dequantized(node) -> Optional[Node]:
    """The `dequantize_weight` a fused op's weight argument is, or None."""
    return node if isinstance(node, Node) and node.target is DEQUANTIZE else None


def is_dequantized(node) -> bool:
    return _dequantized(node) is not None


def decline_reason(weights: dict[str, Node], per_channel_only: bool = False) -> Optional[str]:
    """None if a fused op can take these weight nodes (by argument name), else why not: all of them
    quantized alike or none (and, `per_channel_only`, with per-channel scales)."""
    quantized = {name: _dequantized(node) for name, node in weights.items()}
    names = [name for name, node in quantized.items() if node is not None]
    if not names:
        return None
    if len(names) != len(weights):
        return f"{' and '.join(names)} quantized, {' and '.join(set(weights) - set(names))} not: the op takes both alike"
    formats = {(node.args[0].meta["val"].dtype, tuple(node.args[2] or ())) for node in quantized.values()}
    if len(formats) != 1:
        return f"{' and '.join(names)} are quantized differently ({sorted(map(str, formats))})"
    if per_channel_only and any(node.args[2] is not None for node in quantized.values()):
        return f"{' and '.join(names)} have block scales: the fused op takes per-channel scales only"
    return None


# fused op -> (its weight arguments by position, the scale keyword of each); the block size and
# activation quantization are shared keywords of both ops
_QUANTIZED_WEIGHT_ARGS = {
    torch.ops.mla.qkv_a_proj.default: ((1, "q_weight_scale"), (2, "kv_weight_scale")),
    torch.ops.mla.q_b_absorb.default: ((1, "q_b_weight_scale"),),
}
# fused ops that take a list of weights (by position) with a list of per-channel scales (keyword)
_QUANTIZED_WEIGHT_LISTS = {torch.ops.mla.qkv_projection.default: (1, "weight_scales")}


def _fp32_scale(graph: Graph, node: Node, dequantized: Node) -> Node:
    """The dequantized weight's scale as the fused ops take it: fp32, read ahead of `node`."""
    return Emitter(graph, node).cast(dequantized.args[1], torch.float32)


def fold(graph: Graph) -> int:
    """Fused ops reading dequantized weights take the quantized weight and its scale instead."""
    folded = 0
    for node in graph.nodes:
        for index, scale_kwarg in _QUANTIZED_WEIGHT_ARGS.get(node.target, ()):
            dequantized = _dequantized(node.args[index])
            if dequantized is None:
                continue
            node.update_arg(index, dequantized.args[0])
            node.kwargs = {**node.kwargs, scale_kwarg: _fp32_scale(graph, node, dequantized),
                           "weight_block_size": dequantized.args[2]}
            folded += 1
        if node.target in _QUANTIZED_WEIGHT_LISTS:
            index, scale_kwarg = _QUANTIZED_WEIGHT_LISTS[node.target]
            dequantized = [_dequantized(w) for w in node.args[index]]
            if any(d is None or d.args[2] is not None for d in dequantized):
                continue  # the fusion's check declined mixed and block-scaled weights
            node.update_arg(index, [d.args[0] for d in dequantized])
            node.kwargs = {**node.kwargs, scale_kwarg: [_fp32_scale(graph, node, d) for d in dequantized]}
            folded += 1
    return folded


def _dequantize_in_aten(graph: Graph, node: Node) -> Node:
    """A per-channel `dequantize_weight` as the aten ops it stands for: weight.float() * scale, rounded."""
    weight, scale, block_size, dtype = node.args
    if block_size is not None:
        raise NotImplementedError("block-scaled weights are not canonicalized yet")
    emit = Emitter(graph, node, like=node)
    rows = weight.meta["val"].shape[0]
    product = emit(aten.mul.Tensor, emit(prims.convert_element_type.default, weight, torch.float32),
                   emit(aten.reshape.default, emit.cast(scale, torch.float32), [rows, 1]))
    return emit(prims.convert_element_type.default, product, dtype)


def restore(graph: Graph) -> int:
    """Canonical Linears no fusion took back in their spelling; other reads of a dequantized weight in aten."""
    restored = 0
    for node in list(graph.nodes):
        origin = node.meta.get(_ORIGIN)
        if origin is None or node.target is not aten.mm.default:
            continue
        x, transposed = node.args
        dequantized = transposed.args[0]
        current = {"x": x, "weight": dequantized.args[0], "scale": dequantized.args[1]}
        with graph.inserting_before(node):
            value = graph.graph_copy(origin.graph, {origin.inputs[k]: current[k] for k in origin.inputs})
        node.replace_all_uses_with(value)
        graph.erase_node(node)
        if not transposed.users:
            graph.erase_node(transposed)
        restored += 1
    for node in list(graph.nodes):
        if node.target is DEQUANTIZE:
            if node.users:
                node.replace_all_uses_with(_dequantize_in_aten(graph, node))
            graph.erase_node(node)
    return restored


def quantized_linears(graph: Graph) -> list[Node]:
    """The canonical Linears of a graph (for tests)."""
    return [n for n in graph.nodes if _ORIGIN in n.meta]


__all__ = ["canonicalize", "decline_reason", "fold", "is_dequantized", "quantized_linears", "restore"]
