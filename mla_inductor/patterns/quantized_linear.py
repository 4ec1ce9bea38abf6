"""Quantized linears: the spellings of a Linear over int8 or fp8 weights, made the one form the
fusions already match.

Each spelling found is rewritten to `mm(x, permute(mla::dequantize_weight(w, scale, block, dtype)))`:
a plain Linear whose weight is the dequantized one. Every fusion that matches a bf16 Linear then
matches it unchanged, and `fold` hands the fused ops that take quantized weights (qkv_a_proj,
q_b_absorb, gqa_qkv's qkv_projection) the one-byte weight and its scales instead of the dequantized
one: their templates read it as it is (and, for W8A8, quantize x per token as the Linear did). A
fusion declines weights its op cannot take as they are (`decline_reason`: one quantized and one not,
or quantized differently, or block scales where the op takes per-channel ones).

What no fusion took gets its own spelling back (`restore`), node for node, so that Inductor's own
rewrites see what they would have seen without this pass (the int8 Linear stays torch's
`_weight_int8pack_mm` under freezing, say). A dequantized weight something else still reads (the
W_kc / W_vc views mla_decode takes of kv_b_proj's weight) becomes the aten computation it stands for,
which freezing folds into a constant. One exception: an int8 weight-only Linear over enough rows (a
prefill's) stays a GEMM over its weight dequantized per call, in bf16 where bf16 GEMMs are native, else
in fp32 (`DEQUANTIZED_GEMM_MIN_ROWS`).

The joint-graph stage is where this pays: it runs with and without freezing, and sees model code's
spelling before any of Inductor's int8 rewrites (post-grad graphs hold Inductor's `woq_int8` lowering
calls instead, and frozen ones constants folded from the scales). At the post-grad stage the pass
runs again on what is left in a model's spelling.

Spellings (verified on torch 2.13 with torchao 0.18):
- torchao's int8 weight-only Linear (`Int8WeightOnlyConfig`, per-row scales):
  `mm(x, permute(w_int8).to(dtype)) * scale.to(dtype).view(N)`, in either operand order.
  (Its group-wise form, `Int8WeightOnlyConfig(granularity=PerGroup(g))`, is not matched.)
- a weight dequantized in the graph from a one-byte weight and its scale alone (fp8 blocks as
  DeepSeek's checkpoints hold them, per-channel int8 or fp8), however the scales are expanded:
  recognized by its values on a probe (`_dequantizations`);
- W8A8 Linears, `_int_mm` between a per-token quantizer and the two scales: serving code's SGLang
  scheme and torchao's `Int8DynamicActivationInt8WeightConfig` in its s8s8 and u8s8 (VNNI) forms,
  recognized by their values on a probe (`_w8a8_linears`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch.fx import Graph, Node

from .. import isa
from ..lowerings.segment_gemm import amx_tiles_serve
from ..ops.weight_quant import ACTIVATION_QUANT, QUANTIZED_WEIGHT_DTYPES, dequantize_weight, quantize_rows
from .contraction import GRAPH_INPUT_OPS, Decline, Emitter

aten, prims = torch.ops.aten, torch.ops.prims
DEQUANTIZE = torch.ops.mla.dequantize_weight.default
_ORIGIN = "mla_quantized_linear_origin"  # node.meta key of a canonical mm: the spelling it replaced
_FLATTENED = "mla_flattened_x"  # node.meta key of the view that flattens a canonical mm's x
_PER_CALL = "mla_dequantized_per_call"  # node.meta key of a dequantize_weight a GEMM reads (restore)

# From these many rows, an int8 weight-only Linear that no fusion took runs as a GEMM over its weight
# dequantized per call instead of torchao's spelling, which Inductor lowers to `_weight_int8pack_mm`: a
# kernel without AMX, dpbf16 or oneDNN's blocking, whose time grows with the rows. In bf16 where oneDNN's
# bf16 GEMM is native (AVX512-BF16, AMX); else in fp32 (x widened, the weight dequantized in fp32, the
# result rounded once), as a bf16 GEMM there runs ATen's fallback. An int8 MLP of 2048 -> 5632 -> 2048,
# compiled, one process per variant, 2 threads on the AMX Xeon:
# - bf16 GEMM: stock 11.1 / 22.2 / 45.5 / 91 / 367 ms at 16 / 32 / 64 / 128 / 512 rows, ours 10.9 /
#   11.6 / 15.9 / 20 / 41 (eager 46 at 512);
# - fp32 GEMM, with ATen and oneDNN held to AVX2 (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2) and
#   the C++ built for haswell, standing in for an AVX2 CPU: stock 36 / 74 / 143 / 568 ms at 32 / 64 / 128
#   / 512 rows, ours 86 / 101 / 120 / 241-287.
# The compiled module keeps the weight int8 either way: Inductor's constant folding leaves an int8 -> bf16
# conversion of a constant alone, and the dequantization starts with one.
DEQUANTIZED_GEMM_MIN_ROWS = {torch.bfloat16: 32, torch.float32: 128}


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


def _snapshot(nodes: list[Node], inputs: dict[str, Node], also: Optional[Node] = None) -> Origin:
    """The nodes (any order) copied into a graph of their own, reading `inputs` as placeholders; its
    output is the last of them (and `also`, as a second output)."""
    graph = Graph()
    env = {node: graph.placeholder(name) for name, node in inputs.items()}
    members = set(nodes)
    order = [n for n in nodes[0].graph.nodes if n in members]
    for node in order:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[order[-1]] if also is None else (env[order[-1]], env[also]))
    return Origin(graph, {name: env[node] for name, node in inputs.items()})


def _after(graph: Graph, *nodes: Node) -> Node:
    """The node that follows the last of `nodes` in the graph."""
    pending = set(nodes)
    for node in graph.nodes:
        pending.discard(node)
        if not pending:
            return node.next
    raise ValueError("nodes not in the graph")


def _canonical(graph: Graph, output: Node, x: Node, weight: Node, scale: Node) -> tuple[Node, Node]:
    """`mm(x, dequantize_weight(weight, scale).T)` in place of `output` (2-D [tokens, N], or viewed
    as `output` is), and the dequantize_weight node.
    The dequantized weight is placed where its inputs are first all defined (the graph's top, for
    parameters): a fusion's replacement goes before the earliest node it replaces and may precede
    `output`, and must find its weights defined there."""
    emit = Emitter(graph, _after(graph, weight, scale), like=output)
    dtype = output.meta["val"].dtype
    dequantized = emit(DEQUANTIZE, weight, scale, None, dtype)
    transposed = emit(aten.permute.default, dequantized, [1, 0])
    emit = Emitter(graph, output, like=output)
    shape = output.meta["val"].shape
    if x.meta["val"].dim() != 2:  # W8A8's x before its quantizer flattened it: flattened as F.linear does
        rows = math.prod(x.meta["val"].shape[:-1])
        x = emit(aten.view.default, x, [emit.size_arg(rows), x.meta["val"].shape[-1]])
        x.meta[_FLATTENED] = True  # restore reads the x it flattens
    elif x.target in (aten.view.default, aten.reshape.default) and -1 in x.args[1]:
        # torchao flattens x by `reshape(-1, K)`, F.linear by its sizes: the patterns' strict re-trace
        # compares those literals, so the view is spelled as F.linear's
        x = emit(x.target, x.args[0], [emit.size_arg(n) for n in x.meta["val"].shape])
    product = emit(aten.mm.default, x, transposed)
    if len(shape) != 2:
        product = emit(aten.view.default, product, [emit.size_arg(n) for n in shape])
    return product, dequantized


# Weight dequantizations are recognized by what they compute (`_dequantizations`): a chain of ops that
# reads a one-byte weight and a scale and nothing else (no activation) is run once on probe values,
# and taken when its result equals `dequantize_weight`'s bit for bit for some block size. So any
# spelling of the expansion of block scales (repeat_interleave, expand and view, indexing) is found,
# and one that computes other values (a scale rounded to bf16 first, scales assigned to other blocks)
# is left alone. A probe is cached by the chain's structure and shapes: a model's layers share it.
_PROBE_SEED = 0
_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BLOCK_SIZES = (128, 64, 32, 16, 256, 512)  # tried first: released checkpoints use 128 x 128


def _sources(graph: Graph) -> dict[Node, frozenset]:
    """Every node's graph inputs (placeholders, attributes) it is computed from, for nodes computed
    deterministically from at most two of them (a probe of the pair reproduces them)."""
    sources: dict[Node, frozenset] = {}
    for node in graph.nodes:
        if node.op in GRAPH_INPUT_OPS:
            sources[node] = frozenset([node])
        elif node.op == "call_function" and not node.is_impure() and not _seeded(node.target):
            inputs = [sources.get(n) for n in node.all_input_nodes]
            if all(s is not None for s in inputs):
                merged = frozenset().union(*inputs)
                if len(merged) <= 2:
                    sources[node] = merged
    return sources


def _seeded(target) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())


def _static_shape(node: Node) -> Optional[tuple[int, ...]]:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not all(isinstance(d, int) for d in val.shape):
        return None
    return tuple(val.shape)


def _weight_and_scale(pair: frozenset) -> Optional[tuple[Node, Node]]:
    """(weight, scale) of two graph inputs: a 2-D int8 / e4m3fn tensor and a floating one with fewer
    values (one per channel or per block)."""
    if len(pair) != 2:
        return None
    for weight, scale in (tuple(pair), tuple(pair)[::-1]):
        w, s = weight.meta.get("val"), scale.meta.get("val")
        if (isinstance(w, torch.Tensor) and w.dtype in QUANTIZED_WEIGHT_DTYPES and w.dim() == 2
                and isinstance(s, torch.Tensor) and s.is_floating_point()
                and _static_shape(weight) and _static_shape(scale) is not None and s.numel() < w.numel()):
            return weight, scale
    return None


def _block_candidates(weight_shape: tuple[int, int], scale_shape: tuple[int, ...]) -> list[Optional[tuple[int, int]]]:
    """The block sizes a scale of this shape may stand for; None is per output channel."""
    n, k = weight_shape
    if scale_shape in ((n,), (n, 1)):
        return [None]
    if len(scale_shape) != 2:
        return []

    def sizes(extent: int, blocks: int) -> list[int]:
        found = [b for b in (*_BLOCK_SIZES, -(-extent // blocks)) if -(-extent // b) == blocks]
        return list(dict.fromkeys(found))

    return [(bn, bk) for bn in sizes(n, scale_shape[0]) for bk in sizes(k, scale_shape[1])]


def _probe(node: Node, generator: torch.Generator) -> torch.Tensor:
    """A value of a weight or scale's shape and dtype: every finite one-byte code, distinct scales."""
    val = node.meta["val"]
    if val.dtype == torch.int8:
        return torch.randint(-128, 128, val.shape, generator=generator, dtype=torch.int8)
    if val.dtype == torch.float8_e4m3fn:
        codes = torch.randint(0, 256, val.shape, generator=generator, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0  # NaN codes: not a value a dequantization is judged by
        return codes.view(torch.float8_e4m3fn)
    return (torch.rand(val.shape, generator=generator) + 0.5).to(val.dtype)


_probe_cache: dict[tuple, object] = {}


def _probed(chain: Origin, inputs: tuple[Node, ...], identify) -> object:
    """identify() of a chain over these inputs, once per structure, input shapes and dtypes."""
    key = (_structure(chain.graph), *((tuple(n.meta["val"].shape), n.meta["val"].dtype) for n in inputs))
    if key not in _probe_cache:
        with torch.utils._python_dispatch._disable_current_modes():  # real tensors inside a traced compile
            _probe_cache[key] = identify()
    return _probe_cache[key]


def _structure(graph: Graph) -> tuple:
    """What a graph computes, apart from its node names: each node's op, target and arguments, nodes
    by position (the same chain in every layer of a model is probed once)."""
    position = {node: i for i, node in enumerate(graph.nodes)}

    def as_key(arg):
        return ("node", position[arg]) if isinstance(arg, Node) else repr(arg)

    return tuple((n.op, str(n.target), repr(torch.fx.node.map_aggregate((n.args, n.kwargs), as_key)))
                 for n in graph.nodes)


def _identify(chain: Origin, weight: Node, scale: Node) -> Optional[tuple]:
    """(block size, transposed) for which the chain computes `dequantize_weight`, or None."""

    def identify():
        generator = torch.Generator().manual_seed(_PROBE_SEED)
        w, s = _probe(weight, generator), _probe(scale, generator)
        result = _run(chain, w, s)
        for block in _block_candidates(_static_shape(weight), _static_shape(scale)):
            expected = dequantize_weight(w, s.float(), block).to(result.dtype)
            for transposed, value in ((False, expected), (True, expected.T)):
                if result.shape == value.shape and torch.equal(result, value):
                    return block, transposed
        return None

    return _probed(chain, (weight, scale), identify)


def _run(chain: Origin, *inputs: torch.Tensor):
    return torch.fx.Interpreter(torch.fx.GraphModule(torch.nn.Module(), chain.graph)).run(*inputs)


def _dequantizations(graph: Graph) -> int:
    """Each chain that dequantizes a one-byte weight (see above) as `dequantize_weight`, its spelling
    kept aside for `restore`."""
    sources = _sources(graph)
    rewritten = 0
    for node in list(graph.nodes):
        pair = _weight_and_scale(sources.get(node, frozenset()))
        if node.op != "call_function" or node.target is DEQUANTIZE or pair is None:
            continue
        weight, scale = pair
        shape, weight_shape = _static_shape(node), _static_shape(weight)
        if shape not in (weight_shape, weight_shape[::-1]) or node.meta["val"].dtype not in _ACTIVATION_DTYPES:
            continue
        in_chain = [n for n in node.users if sources.get(n) == sources[node]]
        if any(_static_shape(n) == shape for n in in_chain):
            continue  # a later node of the chain (a cast, a copy) ends it
        members = [a for a in _ancestors(node) if a.op == "call_function"]
        if any(m.target is DEQUANTIZE for m in members):
            continue  # the transpose of a chain already rewritten
        if shape != weight_shape and any(_static_shape(m) == weight_shape and sources.get(m) == sources[node]
                                         for m in members):
            continue  # transposed after the [N, K] weight was computed: that is where the chain ends
        chain = _snapshot(members, {"weight": weight, "scale": scale})
        found = _identify(chain, weight, scale)
        if found is None:
            continue
        block, transposed = found
        emit = Emitter(graph, _after(graph, weight, scale), like=node)
        dequantized = emit(DEQUANTIZE, weight, scale, list(block) if block else None, node.meta["val"].dtype)
        if transposed:  # the origin is kept as the [N, K] weight the op stands for
            with chain.graph.inserting_before(chain.graph.output_node()):
                back = chain.graph.call_function(aten.permute.default, (chain.graph.output_node().args[0], [1, 0]))
            chain.graph.output_node().args = (back,)
        dequantized.meta[_ORIGIN] = chain
        value = Emitter(graph, node, like=node)(aten.permute.default, dequantized, [1, 0]) if transposed else dequantized
        _replace(graph, node, value, members)
        rewritten += 1
    return rewritten


def _replace(graph: Graph, old: Node, new: Node, replaced: list[Node]) -> None:
    """`new` in place of `old`, and the replaced nodes nothing reads any more erased (outputs first;
    one something else still reads stays)."""
    old.replace_all_uses_with(new)
    members = set(replaced)
    for dead in [n for n in reversed(graph.nodes) if n in members]:
        if not dead.users and dead.op == "call_function":
            graph.erase_node(dead)


def _ancestors(node: Node) -> list[Node]:
    """node and every node it reads, transitively, in graph order."""
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            stack.extend(current.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]


# W8A8 Linears (SGLang's spelled in PyTorch by serving code, torchao's dynamic int8): x quantized per
# token to int8, `_int_mm` with the transposed int8 weight, the int32 product times the token's and the
# channel's scales, cast back. Found from its `_int_mm`; the quantizer (walked back from the GEMM's
# 8-bit operand) and the epilogue (walked forward) are recognized by what they compute, against each
# scheme of ops/weight_quant.py, as the weight dequantizations are.
_VIEWS = (aten.view.default, aten.reshape.default)
_QUANTIZER_OPS = (prims.convert_element_type.default, aten.mul.Tensor, aten.div.Tensor, aten.round.default,
                  aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default,
                  aten.add.Tensor,  # torchao's zero point (0), and its unsigned operand on CPUs with VNNI: q + 128
                  *_VIEWS)
_EPILOGUE_OPS = (prims.convert_element_type.default, aten.mul.Tensor, aten.sub.Tensor, *_VIEWS)
_ACTIVATION_QUANT = "mla_activation_quant"  # node.meta key of a dequantize_weight: its Linear's x is quantized


def _quantizer_inputs(quantized: Node) -> list[Node]:
    """The floating tensors an 8-bit GEMM operand [M, K] may have been quantized from, farthest first:
    the nodes back along the quantizer's first arguments that hold rows of K (x itself, or x flattened).
    The farthest is not always x: the model's own ops before the quantizer may be of its kinds (Phi-3's
    `up * silu(gate)` is a mul over rows of K), which _w8a8_linears tells by the chain's inputs."""
    found, node = [], quantized
    k = quantized.meta["val"].shape[-1]
    while isinstance(node, Node) and node.op == "call_function" and node.target in _QUANTIZER_OPS:
        node = node.args[0]
        val = node.meta.get("val") if isinstance(node, Node) else None
        if isinstance(val, torch.Tensor) and val.is_floating_point() and val.dim() >= 2 and val.shape[-1] == k:
            found.insert(0, node)
    return found


def _w8a8_epilogue(int_mm: Node, dtype: torch.dtype) -> Optional[tuple[Node, list[Node]]]:
    """(the last cast to `dtype` of the epilogue of an int32 product, the nodes its products and
    differences combine it with), following its only users. torchao casts twice (after each scale),
    and on CPUs with VNNI subtracts the compensation of its unsigned operand first."""
    node, factors, found = int_mm, [], None
    while len(node.users) == 1 and next(iter(node.users)).target in _EPILOGUE_OPS:
        node = next(iter(node.users))
        factors += [a for a in node.args[1:] if isinstance(a, Node)]
        if node.target is prims.convert_element_type.default and node.args[1] == dtype:
            found = node, list(factors)
    return found


def _noop_view(node: Node) -> bool:
    return node.target in (aten.view.default, aten.reshape.default) and node.args[0].meta["val"].shape == node.meta["val"].shape


def _graph_inputs(node: Node) -> set[Node]:
    return {a for a in _ancestors(node) if a.op in GRAPH_INPUT_OPS}


def _probe_activations(x: Node, generator: torch.Generator) -> torch.Tensor:
    rows = [d if isinstance(d, int) else 3 for d in x.meta["val"].shape]  # a dynamic size: any will do
    return torch.randn(rows, generator=generator).to(x.meta["val"].dtype)


def _w8a8_scheme(chain: Origin, x: Node, weight: Node, scale: Node) -> Optional[str]:
    """The W8A8 scheme (ops/weight_quant.py's activation_quant) by which the chain (outputs: the
    Linear's result, the GEMM's 8-bit operand) quantizes x and scales the product by both scales, or
    None. The quantizer is compared level by level (a multiplier Inductor decomposed into a reciprocal
    may move a near-tie: one level, rarely), the result within the fp32 sum's rounding and the
    output's (torchao rounds twice)."""
    def identify():
        generator = torch.Generator().manual_seed(_PROBE_SEED)
        x_probe, w, s = _probe_activations(x, generator), _probe(weight, generator), _probe(scale, generator)
        try:
            out, q = _run(chain, x_probe, w, s)
        except Exception:  # a chain that reads a dynamic size as its own input: not probed, not matched
            return None
        q = q.int() - 128 if q.dtype == torch.uint8 else q.int()
        for scheme in ACTIVATION_QUANT[1:]:
            expected_q, x_scale = quantize_rows(x_probe.reshape(q.shape), scheme)
            moved = (q - expected_q.int()).abs()
            if moved.max() > 1 or moved.sum() > max(2, q.numel() // 1000):
                continue
            expected = (q.double() @ w.double().T) * x_scale.double() * s.double().reshape(1, -1)
            close = out.numel() == expected.numel() and torch.allclose(
                out.double().reshape(expected.shape), expected, rtol=2**-6, atol=1e-6)
            return scheme if close else None
        return None

    return _probed(chain, (x, weight, scale), identify)


def _w8a8_chain(end: Node, candidates: list[Node], weight: Node,
                factors: list[Node]) -> Optional[tuple[Node, Node, list[Node]]]:
    """(x, the weight's scale, the nodes from x to `end`) of the farthest candidate x from which the
    Linear's nodes read nothing but x, the weight and one per-channel scale; or None."""
    for x in candidates:
        while _noop_view(x):
            x = x.args[0]
        scales = [a for f in factors for a in _graph_inputs(f) if a is not weight and x not in _ancestors(f)]
        if len(scales) != 1 or _per_channel_scale(scales[0], weight.meta["val"].shape[0]) is None:
            continue
        before_x = set(_ancestors(x))
        members = [n for n in _ancestors(end) if n.op == "call_function" and n not in before_x]
        readable = {x, weight, scales[0], *members}
        if all(a in readable for n in members for a in n.all_input_nodes):
            return x, scales[0], members
    return None


def _w8a8_linears(graph: Graph) -> int:
    rewritten = 0
    for node in list(graph.nodes):
        if node.target is not aten._int_mm.default:
            continue
        quantized, transposed = node.args
        weight = transposed.args[0] if transposed.target is aten.permute.default and list(transposed.args[1]) == [1, 0] else None
        candidates = _quantizer_inputs(quantized)
        if weight is None or _int8_weight(weight) is None or weight.op not in GRAPH_INPUT_OPS or not candidates:
            continue
        found = _w8a8_epilogue(node, candidates[0].meta["val"].dtype)
        if found is None:
            continue
        end, factors = found
        # A Linear module's flattening of x and unflattening of the result are views to the shapes
        # they have when x is 2-D: the canonical Linear is F.linear's, without them
        while len(end.users) == 1 and _noop_view(next(iter(end.users))):
            end = next(iter(end.users))
        chain = _w8a8_chain(end, candidates, weight, factors)
        if chain is None:
            continue
        x, scale, members = chain
        chain = _snapshot([*members], {"x": x, "weight": weight, "scale": scale}, also=quantized)
        scheme = _w8a8_scheme(chain, x, weight, scale)
        if scheme is None:
            continue
        chain.graph.output_node().args = (chain.graph.output_node().args[0][0],)
        try:
            canonical, dequantized = _canonical(graph, end, x, weight, scale)
        except Decline:  # a dynamic row count no node of the graph holds
            continue
        dequantized.meta[_ACTIVATION_QUANT] = scheme
        canonical.meta[_ORIGIN] = chain
        _replace(graph, end, canonical, members)
        rewritten += 1
    return rewritten


def canonicalize(graph: Graph) -> int:
    """Every spelling of a quantized Linear (module doc) as a plain Linear over its dequantized weight."""
    # First the weight dequantizations: torchao's canonical form holds one (its Linear's is not a
    # weight-only chain: the scale multiplies the product)
    rewritten = _dequantizations(graph) + _w8a8_linears(graph)
    for node in list(graph.nodes):
        found = _torchao_int8_weight_only(node)
        if found is None:
            continue
        x, weight, scale, replaced = found
        origin = _snapshot(replaced, {"x": x, "weight": weight, "scale": scale})
        canonical, _ = _canonical(graph, node, x, weight, scale)
        canonical.meta[_ORIGIN] = origin
        _replace(graph, node, canonical, [*replaced, x])
        rewritten += 1
    return rewritten


def _dequantized(node) -> Optional[Node]:
    """The `dequantize_weight` a fused op's weight argument is, or None."""
    return node if isinstance(node, Node) and node.target is DEQUANTIZE else None


def decline_reason(weights: dict[str, Node], per_channel_only: bool = False) -> Optional[str]:
    """None if a fused op can take these weight nodes (by argument name), else why not: all of them
    quantized alike or none (and, `per_channel_only`, with per-channel scales)."""
    quantized = {name: _dequantized(node) for name, node in weights.items()}
    names = [name for name, node in quantized.items() if node is not None]
    if not names:
        return None
    if len(names) != len(weights):
        return f"{' and '.join(names)} quantized, {' and '.join(set(weights) - set(names))} not: the op takes both alike"
    formats = {(node.args[0].meta["val"].dtype, tuple(node.args[2] or ()), _activation_quant(node))
               for node in quantized.values()}
    if len(formats) != 1:
        return f"{' and '.join(names)} are quantized differently ({sorted(map(str, formats))})"
    if per_channel_only and any(node.args[2] is not None for node in quantized.values()):
        return f"{' and '.join(names)} have block scales: the fused op takes per-channel scales only"
    return None


def int8_weight_only(weights: dict[str, Node]) -> bool:
    """Whether these weight nodes are all int8 weights dequantized for bf16 activations (torchao's
    Int8WeightOnlyConfig, per-channel int8 in model code): stock runs them as _weight_int8pack_mm."""
    dequantized = [_dequantized(node) for node in weights.values()]
    return bool(dequantized) and all(
        node is not None and node.args[0].meta["val"].dtype == torch.int8 and _activation_quant(node) == "none"
        for node in dequantized)


def int_mm_rows_with_a_row_stride(graph: Graph) -> int:
    """Gives the first operand of every one-row `aten._int_mm` a copy of its own; returns how many.

    ATen's CPU _int_mm takes the row stride of its [1, K] operand as the GEMM's leading dimension, and
    Inductor passes the quantized x of a [1, 1, K] (one token) W8A8 Linear as a [1, K] view with row
    stride 0, valid for a size-1 dimension: the products came out as garbage, different on every call,
    in stock torch.compile too (torchao's Int8DynamicActivationInt8WeightConfig at one token). A copy is
    a buffer of its own with contiguous strides, K bytes."""
    copied = 0
    for node in list(graph.nodes):
        if node.target is not aten._int_mm.default:
            continue
        x = node.args[0]
        if not isinstance(x, Node) or x.target is aten.clone.default or x.meta["val"].shape[0] != 1:
            continue
        with graph.inserting_before(node):
            copy = graph.call_function(aten.clone.default, (x,), {"memory_format": torch.contiguous_format})
        copy.meta = dict(x.meta, val=x.meta["val"].clone(memory_format=torch.contiguous_format))
        node.replace_input_with(x, copy)
        copied += 1
    return copied


def on_amx_tiles(weights: dict[str, Node], activation_dtype: torch.dtype) -> bool:
    """Whether these weight nodes are all quantized, as quantized_gemm.h's AMX tiles serve
    (segment_gemm.amx_tiles_serve)."""
    dequantized = [_dequantized(node) for node in weights.values()]
    if not dequantized or None in dequantized:
        return False
    return all(isinstance(k := node.args[0].meta["val"].shape[1], int)
               and amx_tiles_serve(k, node.args[2], _activation_quant(node) == "none", activation_dtype)
               for node in dequantized)


def _activation_quant(dequantized: Node) -> str:
    return dequantized.meta.get(_ACTIVATION_QUANT, "none")


# fused op -> (its weight arguments by position, the scale keyword of each); the block size and
# activation quantization are shared keywords of both ops
_QUANTIZED_WEIGHT_ARGS = {
    torch.ops.mla.qkv_a_proj.default: ((1, "q_weight_scale"), (2, "kv_weight_scale")),
    torch.ops.mla.q_b_absorb.default: ((1, "q_b_weight_scale"),),
}
# fused ops that take a list of weights (by position) with a list of per-channel scales (keyword)
_QUANTIZED_WEIGHT_LISTS = {torch.ops.mla.qkv_projection.default: (1, "weight_scales")}


def _row_slice(node) -> Optional[tuple[Node, int, int]]:
    """(the dequantized weight, first row, end row) of a row slice of one (the q_a and kv_a parts of
    their concatenated weight), or None."""
    if not (isinstance(node, Node) and node.target is aten.slice.Tensor):
        return None
    defaults = (None, 0, 0, None, 1)  # slice.Tensor(self, dim, start, end, step)
    source, dim, start, end, step = (*node.args, *defaults[len(node.args):])
    if _dequantized(source) is None or dim != 0 or step != 1 or not isinstance(start, int):
        return None
    rows = _static_shape(source)[0]
    return source, start, rows if end is None else min(end, rows)


def row_split_reason(weight: Node, rows: int) -> Optional[str]:
    """None if a fused op can take the first `rows` rows of `weight` and the rest as two weights:
    it is not quantized, or its scale blocks do not straddle the boundary."""
    dequantized = _dequantized(weight)
    block = dequantized.args[2] if dequantized is not None else None
    if block is not None and rows % block[0] != 0:
        return f"the concatenated weight's scale blocks of {block[0]} rows straddle its split at row {rows}"
    return None


def _quantized_operand(graph: Graph, node: Node, operand) -> Optional[tuple[Node, Node, Optional[list], str]]:
    """(one-byte weight, fp32 scale, block size, activation quantization) a fused op `node` reads in
    place of `operand` (a dequantized weight or a row slice of one), emitted ahead of `node`; or None."""
    emit = Emitter(graph, node)
    dequantized = _dequantized(operand)
    if dequantized is not None:
        weight, scale, block, _ = dequantized.args
        return weight, emit.cast(scale, torch.float32), block, _activation_quant(dequantized)
    sliced = _row_slice(operand)
    if sliced is None:
        return None
    dequantized, start, end = sliced
    weight, scale, block, _ = dequantized.args
    block_rows = block[0] if block else 1  # checked by row_split_reason: a slice starts at a block
    scale_rows = (start // block_rows, -(-end // block_rows))
    return (emit(aten.slice.Tensor, weight, 0, start, end),
            emit(aten.slice.Tensor, emit.cast(scale, torch.float32), 0, *scale_rows), block,
            _activation_quant(dequantized))


def fold(graph: Graph) -> int:
    """Fused ops reading dequantized weights take the quantized weight and its scale instead."""
    folded = 0
    for node in list(graph.nodes):
        for index, scale_kwarg in _QUANTIZED_WEIGHT_ARGS.get(node.target, ()):
            quantized = _quantized_operand(graph, node, node.args[index])
            if quantized is None:
                continue
            weight, scale, block, activation_quant = quantized
            node.update_arg(index, weight)
            _set_arguments(node, {scale_kwarg: scale, "weight_block_size": block, "activation_quant": activation_quant})
            folded += 1
        if node.target in _QUANTIZED_WEIGHT_LISTS:
            index, scale_kwarg = _QUANTIZED_WEIGHT_LISTS[node.target]
            # each weight dequantized, or a row slice of one (gqa_qkv's cuts of a fused q/k/v weight)
            dequantized = [_dequantized(w) or (_row_slice(w) or (None,))[0] for w in node.args[index]]
            if any(d is None or d.args[2] is not None for d in dequantized):
                continue  # the fusion's check declined mixed and block-scaled weights
            quantized = [_quantized_operand(graph, node, w) for w in node.args[index]]
            node.update_arg(index, [weight for weight, *_ in quantized])
            _set_arguments(node, {scale_kwarg: [scale for _, scale, *_ in quantized],
                                  "activation_quant": quantized[0][3]})  # alike: the fusion's check declined others
            folded += 1
    return folded


def _set_arguments(node: Node, values: dict) -> None:
    """Set arguments of an op node by name, in place where the node passes them by position: a traced call
    passes every argument up to the last that differs from its default by position (Mixtral's head_norm_eps
    of 1e-5 puts qkv_projection's weight_scales there), and the same argument again as a keyword is a
    call the op rejects."""
    names = [argument.name for argument in node.target._schema.arguments]
    for name, value in values.items():
        index = names.index(name)
        if index < len(node.args):
            node.update_arg(index, value)
        else:
            node.update_kwarg(name, value)


def _dequantize_in_aten(graph: Graph, node: Node, per_call: bool = False, dtype: Optional[torch.dtype] = None
                        ) -> Node:
    """A per-channel `dequantize_weight` as the aten ops it stands for: weight.float() * scale, rounded once
    to `dtype` (the node's by default). Freezing folds it into a constant, unless `per_call`: then an int8
    weight is widened through bf16 (exactly), a conversion of a constant that Inductor's constant folding
    leaves alone (it keeps it for its own int8 path), so the weight stays one byte an element in the
    compiled module and is dequantized by one pass per call."""
    weight, scale, block_size, node_dtype = node.args
    if block_size is not None:
        raise NotImplementedError("block-scaled weights are not canonicalized yet")
    emit = Emitter(graph, node, like=node)
    rows = weight.meta["val"].shape[0]
    widened = emit(prims.convert_element_type.default, weight, torch.bfloat16 if per_call else torch.float32)
    product = emit(aten.mul.Tensor, widened, emit(aten.reshape.default, emit.cast(scale, torch.float32), [rows, 1]))
    return emit.cast(product, dtype or node_dtype)


def _dequantized_gemm_dtype(mm: Node, dequantized: Node) -> Optional[torch.dtype]:
    """The dtype of the GEMM a canonical Linear is best left as, over its weight dequantized per call (see
    DEQUANTIZED_GEMM_MIN_ROWS), or None: int8 weight-only, per-channel, bf16, rows known and that many."""
    weight, _, block_size, dtype = dequantized.args
    if not (weight.meta["val"].dtype == torch.int8 and block_size is None and dtype == torch.bfloat16
            and _activation_quant(dequantized) == "none"):
        return None
    gemm_dtype = torch.bfloat16 if isa.native_bf16_gemm() else torch.float32
    rows = mm.args[0].meta["val"].shape[0]
    return gemm_dtype if isinstance(rows, int) and rows >= DEQUANTIZED_GEMM_MIN_ROWS[gemm_dtype] else None


def _gemm_in_fp32(graph: Graph, mm: Node, weight: Node) -> None:
    """`mm` as an fp32 GEMM of x widened and `weight` (its weight dequantized per call in fp32), rounded once."""
    x, transposed = mm.args
    emit = Emitter(graph, mm, like=mm)
    product = emit(aten.mm.default, emit.cast(x, torch.float32), emit(aten.permute.default, weight, [1, 0]))
    mm.replace_all_uses_with(emit.cast(product, mm.meta["val"].dtype))
    graph.erase_node(mm)
    if not transposed.users:
        graph.erase_node(transposed)


def restore(graph: Graph) -> int:
    """Canonical Linears no fusion took back in their spelling (or left GEMMs over their weight dequantized
    per call); other reads of a dequantized weight in aten."""
    restored = 0
    per_call = {}  # (weight, scale, dtype) -> its dequantization per call, one for every GEMM that reads it

    def dequantized_per_call(node: Node, dtype: Optional[torch.dtype] = None) -> Node:
        key = (*node.args[:2], dtype or node.args[3])
        if key not in per_call:
            per_call[key] = _dequantize_in_aten(graph, node, per_call=True, dtype=dtype)
        return per_call[key]

    for node in list(graph.nodes):
        origin = node.meta.get(_ORIGIN)
        if origin is None or node.target not in (aten.mm.default, aten.view.default):
            continue
        mm = node.args[0] if node.target is aten.view.default else node
        x, transposed = mm.args
        dequantized = transposed.args[0]
        gemm_dtype = _dequantized_gemm_dtype(mm, dequantized)
        if gemm_dtype is not None:
            dequantized.meta[_PER_CALL] = True  # for the GEMM in bf16, and for any other reader
            if gemm_dtype == torch.float32:
                _gemm_in_fp32(graph, mm, dequantized_per_call(dequantized, torch.float32))
            continue
        current = {"x": x.args[0] if x.meta.get(_FLATTENED) else x, "weight": dequantized.args[0],
                   "scale": dequantized.args[1]}
        with graph.inserting_before(node):
            value = graph.graph_copy(origin.graph, {origin.inputs[k]: current[k] for k in origin.inputs})
        _replace(graph, node, value, [node, mm, transposed, x])
        restored += 1
    for node in list(graph.nodes):
        if node.target is DEQUANTIZE:
            if node.users:
                node.replace_all_uses_with(dequantized_per_call(node) if node.meta.get(_PER_CALL)
                                           else _spelled(graph, node))
            graph.erase_node(node)
    return restored


def _spelled(graph: Graph, dequantized: Node) -> Node:
    """A dequantized weight as the model computed it, or else as the aten ops it stands for."""
    origin = dequantized.meta.get(_ORIGIN)
    if origin is None:
        return _dequantize_in_aten(graph, dequantized)
    current = {"weight": dequantized.args[0], "scale": dequantized.args[1]}
    with graph.inserting_before(dequantized):
        return graph.graph_copy(origin.graph, {origin.inputs[k]: current[k] for k in origin.inputs})


def quantized_linears(graph: Graph) -> list[Node]:
    """The canonical Linears of a graph (for tests)."""
    return [n for n in graph.nodes if _ORIGIN in n.meta]


__all__ = ["canonicalize", "decline_reason", "fold", "quantized_linears", "restore", "row_split_reason"]
