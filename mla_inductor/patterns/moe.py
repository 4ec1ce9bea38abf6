"""moe: a Mixture-of-Experts block's routed experts into `mla::fused_experts` (ops/moe.py).

The spelling found in compiled graphs, written as the model code it matches: transformers' default experts
implementation (`grouped_mm`, integrations/moe.py) of DeepSeek-V2/V3, Qwen2/3-MoE, Mixtral, OLMoE and the
other families whose experts hold `gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]`:

    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    x_sorted = hidden_states[perm // top_k]
    offsets = torch.cumsum(torch.histc(expert_ids.float(), bins=E, min=0, max=E - 1), 0, dtype=torch.int32)
    gate, up = torch._grouped_mm(x_sorted, gate_up_proj.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
    down = torch._grouped_mm(act(gate) * up, down_proj.transpose(-2, -1), offs=offsets)
    weighted = down * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    inverse = torch.empty_like(perm); inverse[perm] = torch.arange(perm.numel())
    out = weighted[inverse].view(tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)

with act SiLU (`_grouped_mm` is transformers' `transformers::grouped_mm_fallback` for weights other than
bf16). The whole chain, from the sort to the sum, becomes one call of the op on hidden_states, the
two weights as they are held, top_k_weights and top_k_index. On CPU `_grouped_mm` is a loop of one mm per
expert, all 64 of V2-Lite's whether they have tokens or not, whose one-row bf16 products stream at half the
memory's rate; the op reads each selected expert once, on both cores (docs/moe.md).

transformers' `batched_mm` implementation is taken too (rewrite_batched_experts): it gathers each (token,
slot) pair's whole expert weights and multiplies them by bmm, top_k copies of experts a token.

Not taken (declined, with the reason in explain()): a prefill of more tokens than `template_wins` gives
the template where the CPU's GEMM is native, another activation than SiLU, experts with biases or
a post-expert norm, expert-parallel plans (sentinel ids masked between the products), the `eager`
implementation (its loop over hit experts is data-dependent: Dynamo breaks the graph there).
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
from torch._inductor import config as inductor_config
from torch.fx import Graph, Node

from .. import isa
from .contraction import GRAPH_INPUT_OPS, Decline, same
from .registry import register_anchored_rewrite

FUSION = "moe"
aten = torch.ops.aten
prims = torch.ops.prims
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


# Tokens up to which the fused experts beat stock's grouped GEMM where the CPU's GEMM is native
# (benchmarks/moe.py, one V2-Lite MoE block, Zen 4 EPYC, docs/moe.md): frozen (packed per expert) 1.95x
# stock at its best at 128 tokens, 1.31x at 512, 0.94x at 2048; unfrozen (tiles over the weights as
# held) 1.07x at 128, 0.90x at 512. On AMX CPUs oneDNN's tiles take a prefill's GEMMs (unmeasured for the
# experts: the projections' limit, segment_gemm.MAX_ROWS_AMX_TILES). Where bf16 is emulated (AVX2,
# AVX-512 without BF16) stock's products crawl at every token count.
MAX_NATIVE_TOKENS_FROZEN = 1024
MAX_NATIVE_TOKENS_UNFROZEN = 128
MAX_NATIVE_TOKENS_AMX = 16


def template_wins(tokens, dtype: torch.dtype) -> bool:
    """Whether the fused experts beat stock here for `tokens` rows of hidden states. A token count known
    only at run time (a server's one graph) is taken: its decode steps are most of its calls."""
    if not isa.native_gemm(dtype) or not isinstance(tokens, int):
        return True
    if isa.host_isa() == "amx":
        return tokens <= MAX_NATIVE_TOKENS_AMX
    packed = inductor_config.freezing and dtype == torch.bfloat16
    return tokens <= (MAX_NATIVE_TOKENS_FROZEN if packed else MAX_NATIVE_TOKENS_UNFROZEN)


def register() -> None:
    register_anchored_rewrite(FUSION, _gate_up_products, rewrite_grouped_experts)
    register_anchored_rewrite(FUSION, _batched_products, rewrite_batched_experts)


def _is_grouped_mm(node: Node) -> bool:
    """`torch._grouped_mm`, or the custom op transformers calls in its place under torch.compile for
    weights other than bf16 (`transformers::grouped_mm_fallback`, a loop of mm: the same product)."""
    if node.target is aten._grouped_mm.default:
        return True
    fallback = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    return fallback is not None and node.target is fallback.default


def _gate_up_products(graph: Graph) -> list[Node]:
    """Every grouped GEMM whose weight is a stacked [E, out, in] parameter read transposed."""
    return [n for n in graph.nodes if n.op == "call_function" and _is_grouped_mm(n) and _stacked_weight(n.args[1])]


def _stacked_weight(operand: Node) -> Optional[Node]:
    """The [E, out, in] graph input that `operand` reads as [E, in, out], else None."""
    if not isinstance(operand, Node) or operand.target is not aten.permute.default or list(operand.args[1]) != [0, 2, 1]:
        return None
    weight = operand.args[0]
    return weight if weight.op in GRAPH_INPUT_OPS and weight.meta["val"].dim() == 3 else None


def _value(node: Node):
    return node.meta["val"]


def _through_converts(node: Node) -> Node:
    """node with its dtype conversions (`.float()`, `.to(dtype)`) looked through."""
    while isinstance(node, Node) and node.target is prims.convert_element_type.default:
        node = node.args[0]
    return node


def _through_views(node: Node) -> Node:
    while isinstance(node, Node) and node.target in _VIEWS:
        node = node.args[0]
    return node


def _only_user(node: Node, what: str) -> Node:
    if len(node.users) != 1:
        raise Decline(f"{what} is read elsewhere too ({len(node.users)} users)")
    return next(iter(node.users))


def _is_call(node, target) -> bool:
    return isinstance(node, Node) and node.target is target


def _is_sort_output(node, sort: Node, index: int) -> bool:
    """Whether node is sort's values (index 0) or its permutation (index 1)."""
    return _is_call(node, operator.getitem) and node.args[0] is sort and node.args[1] == index


def _silu_input(node: Node) -> Optional[Node]:
    """x where node is silu(x) in x's dtype: `aten.silu`, or its decomposition x / (1 + exp(-x)) in fp32
    (or x * sigmoid(x)), converted back."""
    node = _through_converts(node)
    if not isinstance(node, Node):
        return None
    if node.target is aten.silu.default:
        return node.args[0]
    if node.target is aten.div.Tensor:
        x, denominator = node.args
        exp = denominator.args[0] if _is_call(denominator, aten.add.Tensor) and denominator.args[1] == 1 else None
        negated = exp.args[0] if _is_call(exp, aten.exp.default) else None
        if _is_call(negated, aten.neg.default) and negated.args[0] is x:
            return _through_converts(x)
    if node.target is aten.mul.Tensor:
        for x, sigmoid in (node.args, reversed(node.args)):
            if _is_call(sigmoid, aten.sigmoid.default) and sigmoid.args[0] is x:
                return _through_converts(x)
    return None


def _gate_and_up(product: Node, width: int) -> tuple[Node, Node]:
    """The two halves of the gate-and-up product's last dim (chunk(2) traces as a split)."""
    split = _only_user(product, "the gate and up product")
    halves = {}
    last_dim = split.args[2:] in ((-1,), (1,))
    in_halves = (split.target is aten.split.Tensor and split.args[1] == width) or (
        split.target is aten.split_with_sizes.default and list(split.args[1]) == [width, width])
    if not (last_dim and in_halves):
        raise Decline("the gate and up product is not cut into its two halves")
    for user in split.users:
        if user.target is not operator.getitem:
            raise Decline("the halves of the gate and up product are read whole")
        halves[user.args[1]] = user
    if sorted(halves) != [0, 1]:
        raise Decline("one half of the gate and up product is unused")
    return halves[0], halves[1]


def _gated_product(gate: Node, up: Node) -> Node:
    """act(gate) * up, with act SiLU."""
    users = [u for u in up.users if u.target is aten.mul.Tensor]
    if len(up.users) != 1 or not users:
        raise Decline("the up half is not multiplied by the activated gate alone")
    product = users[0]
    other = product.args[0] if product.args[1] is up else product.args[1]
    if _silu_input(other) is not gate:
        raise Decline("the experts' activation is not SiLU (silu(gate) * up)")
    return product


def _routing(gathered: Node) -> tuple[Node, Node, Node, int]:
    """hidden_states [M, K], the sort of the flattened top-k ids, those ids [M, topk] and topk, from
    x_sorted = hidden_states[perm // topk]."""
    if gathered.target is not aten.index.Tensor or len(gathered.args[1]) != 1:
        raise Decline("the experts' rows are not the hidden states gathered by one index")
    hidden, (row_index,) = gathered.args
    if row_index.target is not aten.div.Tensor_mode or row_index.kwargs.get("rounding_mode") != "floor" \
            or not isinstance(row_index.args[1], int):
        raise Decline("the rows gathered are not perm // top_k")
    perm, topk = row_index.args
    sort = perm.args[0] if perm.target is operator.getitem and perm.args[1] == 1 else None
    if sort is None or sort.target is not aten.sort.default or sort.args[1:] not in ((), (-1,), (0,)) \
            or sort.kwargs.get("descending", False):
        raise Decline("the rows are not gathered in the order of the sorted expert ids")
    flat = sort.args[0]
    ids = _through_views(flat)
    if flat is ids or _value(flat).dim() != 1 or _value(ids).dim() != 2 or _value(ids).shape[1] != topk:
        raise Decline("the sorted ids are not the [tokens, top_k] expert ids flattened")
    if _value(hidden).dim() != 2 or not same(_value(hidden).shape[0], _value(ids).shape[0]):
        raise Decline("the hidden states are not [tokens, hidden] for the ids' tokens")
    if _value(ids).dtype not in (torch.int32, torch.int64):
        raise Decline(f"the expert ids are {_value(ids).dtype}")
    return hidden, sort, ids, topk


def _check_offsets(offsets: Node, sort: Node, experts: int) -> None:
    """offsets = cumsum(histc(sorted ids, bins=E, min=0, max=E - 1), 0): each expert's rows' end."""
    if offsets.target is not aten.cumsum.default or offsets.args[1] != 0:
        raise Decline("the group offsets are not a cumulative sum of the tokens per expert")
    histc = offsets.args[0]
    if histc.target is aten.histc.default:
        bins, low, high = (list(histc.args[1:]) + [100, 0, 0])[:3]
        counted = _through_converts(histc.args[0])
        if (bins, low, high) != (experts, 0, experts - 1):
            raise Decline(f"the tokens per expert are counted in {bins} bins over [{low}, {high}], not the "
                          f"{experts} experts")
    elif histc.target is aten.bincount.default:
        counted = histc.args[0]
    else:
        raise Decline("the tokens per expert are not counted by histc or bincount")
    if not _is_sort_output(counted, sort, 0):
        raise Decline("the tokens per expert are not counted over the sorted ids")


def _weighted_by_routing(down: Node, sort: Node) -> tuple[Node, Node]:
    """(weighted, topk_weights): weighted = down * topk_weights.reshape(-1)[perm].unsqueeze(-1)."""
    weighted = _only_user(down, "the down product")
    if weighted.target is not aten.mul.Tensor:
        raise Decline("the down product is not weighed by the routing weights")
    scale = weighted.args[1] if weighted.args[0] is down else weighted.args[0]
    if scale.target is not aten.unsqueeze.default:
        raise Decline("the routing weights are not one per row of the down product")
    gathered = scale.args[0]
    perm = gathered.args[1][0] if gathered.target is aten.index.Tensor and len(gathered.args[1]) == 1 else None
    if not _is_sort_output(perm, sort, 1):
        raise Decline("the routing weights are not gathered in the order of the sorted ids")
    topk_weights = _through_views(gathered.args[0])
    if _value(topk_weights).dim() != 2:
        raise Decline("the routing weights are not [tokens, top_k]")
    return weighted, topk_weights


def _summed_per_token(weighted: Node, sort: Node, tokens, topk: int, hidden_size: int) -> Node:
    """The node that holds sum over each token's slots, restored from the sorted order:
    weighted[inverse].view(tokens, topk, hidden).sum(1), inverse[perm] = arange."""
    restored = _only_user(weighted, "the weighted down product")
    if restored.target is not aten.index.Tensor or len(restored.args[1]) != 1:
        raise Decline("the weighted rows are not put back in token order")
    inverse = restored.args[1][0]
    if inverse.target not in (aten.index_put.default, aten.index_put_.default) or len(inverse.args[1]) != 1:
        raise Decline("the weighted rows are not put back by the inverse of the sort")
    perm, positions = inverse.args[1][0], inverse.args[2]
    if not _is_sort_output(perm, sort, 1) \
            or positions.target not in (prims.iota.default, aten.arange.default, aten.arange.start):
        raise Decline("the weighted rows are not put back by the inverse of the sort")
    return _summed_over_slots(restored, tokens, topk, hidden_size)


def _summed_over_slots(rows: Node, tokens, topk: int, hidden_size: int) -> Node:
    """The node that holds rows.view(tokens, topk, hidden).sum(1), rows being the weighted (token, slot)
    pairs in token order."""
    view = _only_user(rows, "the weighted rows in token order")
    total = _only_user(view, "the slots of each token")
    if view.target not in _VIEWS or total.target is not aten.sum.dim_IntList or list(total.args[1]) not in ([1], [-2]):
        raise Decline("the weighted rows are not summed over each token's slots")
    shape = _value(view).shape
    if len(shape) != 3 or not same(shape[0], tokens) or shape[1] != topk or shape[2] != hidden_size:
        raise Decline("the weighted rows are not summed over each token's slots")
    return total


def rewrite_grouped_experts(graph: Graph, first_product: Node) -> bool:
    gate_up_proj = _stacked_weight(first_product.args[1])
    gathered, offsets = first_product.args[0], first_product.args[2]
    if gathered.target is not aten.index.Tensor:
        return False  # a second product (the down projection's) or another grouped GEMM
    hidden, sort, ids, topk = _routing(gathered)
    experts, two_n, hidden_size = _value(gate_up_proj).shape
    _check_offsets(offsets, sort, experts)
    gate, up = _gate_and_up(first_product, two_n // 2)
    gated = _gated_product(gate, up)
    down = _only_user(gated, "the gated product")
    down_proj = _stacked_weight(down.args[1]) if _is_grouped_mm(down) else None
    if down_proj is None or down.args[0] is not gated or down.args[2] is not offsets:
        raise Decline("the gated product is not the down projection's input over the same groups")
    weighted, topk_weights = _weighted_by_routing(down, sort)
    total = _summed_per_token(weighted, sort, _value(hidden).shape[0], topk, hidden_size)
    return _replace_with_fused_experts(graph, total, hidden, gate_up_proj, down_proj, topk_weights, ids, topk)


def _batched_products(graph: Graph) -> list[Node]:
    """Every bmm of a stacked [E, out, in] parameter gathered by an index (transformers' batched_mm)."""
    return [n for n in graph.nodes if _is_call(n, aten.bmm.default) and _gathered_weight(n.args[0]) is not None]


def _gathered_weight(operand: Node) -> Optional[tuple[Node, Node]]:
    """(weight, ids) where operand is weight[ids], weight a [E, out, in] graph input, else None."""
    if not _is_call(operand, aten.index.Tensor) or len(operand.args[1]) != 1:
        return None
    weight, (ids,) = operand.args
    if weight.op not in GRAPH_INPUT_OPS or _value(weight).dim() != 3:
        return None
    return weight, ids


def _batched_product_of(node: Node) -> Optional[Node]:
    """x where node is bmm(weight[ids], x.unsqueeze(-1)).squeeze(-1) read back (the product node's user)."""
    if not (_is_call(node, aten.unsqueeze.default) and node.args[1] in (-1, 2)):
        return None
    return node.args[0]


def _repeated_rows(selected: Node, topk: int) -> Optional[Node]:
    """hidden [M, K] where selected is hidden.repeat_interleave(topk, dim=0): [M, topk, K] expanded from
    hidden.unsqueeze(1), copied and viewed [M * topk, K]."""
    expanded = selected
    while isinstance(expanded, Node) and (expanded.target in _VIEWS or expanded.target is aten.clone.default):
        expanded = expanded.args[0]
    if not _is_call(expanded, aten.expand.default) or not _is_call(expanded.args[0], aten.unsqueeze.default):
        return None
    hidden, dim = expanded.args[0].args
    sizes = list(expanded.args[1])
    if dim != 1 or len(sizes) != 3 or sizes[1] != topk or _value(hidden).dim() != 2:
        return None
    return hidden


def rewrite_batched_experts(graph: Graph, first_product: Node) -> bool:
    """transformers' `batched_mm` experts: each (token, slot) pair's expert weights gathered
    (`gate_up_proj[expert_ids]`, a copy of top_k whole experts per token) and multiplied by bmm:

        x = hidden_states.repeat_interleave(top_k, dim=0)
        gate, up = torch.bmm(gate_up_proj[expert_ids], x.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
        down = torch.bmm(down_proj[expert_ids], (act(gate) * up).unsqueeze(-1)).squeeze(-1)
        out = (down * top_k_weights.reshape(-1).unsqueeze(-1)).view(tokens, top_k, hidden).sum(dim=1)
    """
    gate_up_proj, flat_ids = _gathered_weight(first_product.args[0])
    x = _batched_product_of(first_product.args[1])
    if x is None or _is_call(x, aten.mul.Tensor):
        return False  # the down projection's product (its x is the gated product) or another bmm
    ids = _through_views(flat_ids)
    if ids is flat_ids or _value(flat_ids).dim() != 1 or _value(ids).dim() != 2:
        raise Decline("the gathered experts are not chosen by the [tokens, top_k] ids flattened")
    topk = _value(ids).shape[1]
    hidden = _repeated_rows(x, topk)
    if hidden is None or not same(_value(hidden).shape[0], _value(ids).shape[0]):
        raise Decline("the rows multiplied are not each token's hidden states repeated top_k times")
    two_n, hidden_size = _value(gate_up_proj).shape[1:]
    squeezed = _only_user(first_product, "the gate and up product")
    if not (_is_call(squeezed, aten.squeeze.dim) and squeezed.args[1] in (-1, 2)):
        raise Decline("the gate and up product is not read back as [pairs, 2 * width]")
    gate, up = _gate_and_up(squeezed, two_n // 2)
    gated = _gated_product(gate, up)
    unsqueezed = _only_user(gated, "the gated product")
    down = _only_user(unsqueezed, "the gated product's column") if _batched_product_of(unsqueezed) is gated else None
    gathered = _gathered_weight(down.args[0]) if down is not None and _is_call(down, aten.bmm.default) else None
    if gathered is None or gathered[1] is not flat_ids or down.args[1] is not unsqueezed:
        raise Decline("the gated product is not the down projection's input over the same experts")
    down_proj = gathered[0]
    squeezed = _only_user(down, "the down product")
    weighted = _only_user(squeezed, "the down product's rows")
    if not (_is_call(squeezed, aten.squeeze.dim) and _is_call(weighted, aten.mul.Tensor)):
        raise Decline("the down product is not weighed by the routing weights")
    scale = weighted.args[1] if weighted.args[0] is squeezed else weighted.args[0]
    topk_weights = _through_views(scale.args[0]) if _is_call(scale, aten.unsqueeze.default) else None
    if topk_weights is None or _value(topk_weights).dim() != 2:
        raise Decline("the routing weights are not the [tokens, top_k] weights flattened, one per row")
    total = _summed_over_slots(weighted, _value(hidden).shape[0], topk, hidden_size)
    return _replace_with_fused_experts(graph, total, hidden, gate_up_proj, down_proj, topk_weights, ids, topk)


def _replace_with_fused_experts(graph: Graph, total: Node, hidden: Node, gate_up_proj: Node, down_proj: Node,
                                topk_weights: Node, ids: Node, topk: int) -> bool:
    """The checks every spelling shares, then `total` (the per-token sum) as mla::fused_experts."""
    tokens = _value(hidden).shape[0]
    dtype = _value(hidden).dtype
    experts, two_n, hidden_size = _value(gate_up_proj).shape
    if two_n % 2:
        raise Decline(f"gate_up_proj has {two_n} rows: not a gate and an up half")
    if list(_value(down_proj).shape) != [experts, hidden_size, two_n // 2]:
        raise Decline(f"down_proj is {list(_value(down_proj).shape)}, not [{experts}, {hidden_size}, {two_n // 2}]")
    if not (_value(gate_up_proj).dtype == _value(down_proj).dtype == dtype):
        raise Decline(f"the experts' weights are not in the hidden states' dtype {dtype}")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise Decline(f"the hidden states are {dtype}")
    if _value(ids).dtype not in (torch.int32, torch.int64):
        raise Decline(f"the expert ids are {_value(ids).dtype}")
    if list(_value(topk_weights).shape[1:]) != [topk] or not same(_value(topk_weights).shape[0], tokens):
        raise Decline("the routing weights are not one per slot")
    if not template_wins(tokens, dtype):
        raise Decline(f"{tokens} tokens: stock's grouped GEMM on this CPU's native {dtype} GEMM is faster")

    with graph.inserting_before(total):
        fused = graph.call_function(torch.ops.mla.fused_experts.default,
                                    (hidden, gate_up_proj, down_proj, topk_weights, ids))
        fused.meta["val"] = torch.empty_like(_value(hidden))
        result = fused
        if _value(total).dtype != dtype:
            result = graph.call_function(prims.convert_element_type.default, (fused, _value(total).dtype))
            result.meta["val"] = _value(total).to(_value(total).dtype)
    total.replace_all_uses_with(result)
    return True
