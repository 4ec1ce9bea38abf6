"""mla_prefill (and gqa_prefill): attention of many query rows into `mla::prefill_attention`.

ATen's CPU flash attention needs one head size for q, k and v, so SDPA sends MLA's prefill (q/k heads of
192, v heads of 128) to its math path: the whole [B, heads, Tq, Tk] score tensor in memory (4 GiB a layer at
8192 tokens), ATen's bmm, and Inductor's kernels over the scores. Spellings found in real graphs:
- `F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)`: transformers' `sdpa` attention
  (every MLA family it ships: DeepSeek V2 / V3, and the families built on their attention), serving code's
  torch-native backends. Under torch.compile transformers always passes a materialised mask (bool, [B, 1,
  Tq, Tk], causal and padding), never `is_causal`; the op reads each query row's admitted range from it.
  The call is rewritten in Dynamo's graph (the pre-grad stage), where it is still one node: once AOT
  has decomposed it, the math path is a dozen nodes whose shape depends on the strides of k and v.
- the same attention written out (the anchored walk at the end of this module).
`gqa_prefill` is the same rewrite of SDPA calls whose heads share one size (Llama, Qwen, Gemma, Mistral:
ATen's flash attention serves those), taken where ours measured faster: at Llama-3-8B's heads (32 over 8,
128 wide), 2048 tokens, transformers' bool causal mask, Zen 4: 122 ms against ATen's 419 (and 246 with
`is_causal`, no mask); forced to AVX2 code, 1024 tokens: 62 against 107. Not on AMX CPUs, where ATen's
flash attention multiplies on AMX tiles and ours on dpbf16 (not measured there). transformers repeats k
and v per query head (`repeat_kv`) before SDPA whenever there is a mask: the op reads the key/value heads
the copies were made from.
"""

from __future__ import annotations

import math
import operator
from typing import Optional

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .. import isa
from ..ops.mla_prefill import check_args
from ..record import record_decision
from . import contraction
from .attention_scores import (logits_of_softmax, mask_argument, next_contraction, read_logits, roles_of_contraction,
                               score_contraction, softmax_divisions)
from .contraction import Decline, Emitter, axis_roles, from_role_order, operand_in_role_order, same
from .registry import register_anchored_rewrite

FUSION = "mla_prefill"
GQA_FUSION = "gqa_prefill"
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def _value(arg):
    """A node's example value (Dynamo's graph), or the literal itself."""
    return arg.meta.get("example_value") if isinstance(arg, torch.fx.Node) else arg


def _sdpa_arguments(node: torch.fx.Node) -> dict:
    bound = dict(zip(_SDPA_ARGS, node.args))
    return {**_SDPA_DEFAULTS, **bound, **node.kwargs}


def fusion_of(kw: dict) -> Optional[str]:
    """The fusion an SDPA call over many query rows is a candidate of: mla_prefill where q/k and v heads
    differ (SDPA's math path), gqa_prefill where they share a size and ours beats ATen's flash attention
    (see above); None for the rest (one query row: the decode fusions)."""
    query, key, value = _value(kw["query"]), _value(kw["key"]), _value(kw["value"])
    if not (all(isinstance(t, torch.Tensor) for t in (query, key, value)) and query.dim() == value.dim() == 4
            and query.device.type == "cpu") or statically_known_true(query.shape[2] == 1):
        return None
    if any(t.requires_grad for t in (query, key, value)):
        return None  # training: the op has no backward (inference graphs only)
    if not statically_known_true(query.shape[-1] == value.shape[-1]):
        return FUSION
    return GQA_FUSION if isa.host_isa() != "amx" and query.dtype == torch.bfloat16 else None


def _without_repeat_kv(node) -> tuple[object, int]:
    """The key/value heads a query-head copy was made from, and the copies per head: transformers'
    `repeat_kv` (x[:, :, None].expand(b, h, n, t, d).reshape(b, h * n, t, d)) or `repeat_interleave(n, 1)`,
    as Dynamo records them; (node, 1) for anything else."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_method"):
        return node, 1
    if node.target == "repeat_interleave" and isinstance(node.args[1], int) and (
            node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else None) == 1):
        return node.args[0], node.args[1]
    expand = node.args[0] if node.target == "reshape" else None
    if not (isinstance(expand, torch.fx.Node) and expand.op == "call_method" and expand.target == "expand"
            and len(expand.users) == 1):
        return node, 1
    index = expand.args[0]
    whole = slice(None, None, None)
    if not (isinstance(index, torch.fx.Node) and index.op == "call_function" and index.target is operator.getitem
            and index.args[1] == (whole, whole, None, whole, whole)):
        return node, 1
    source, copies = index.args[0], _value(expand).shape[2]
    before, after = _value(source), _value(node)
    if not isinstance(copies, int) or list(after.shape) != [before.shape[0], before.shape[1] * copies, *before.shape[2:]]:
        return node, 1
    return source, copies


def _decline_reason(kw: dict) -> Optional[str]:
    """Why the candidate SDPA call with arguments `kw` is not rewritten (None: it is)."""
    query, key, value, mask = (_value(kw[name]) for name in ("query", "key", "value", "attn_mask"))
    if query.dtype != torch.bfloat16:
        return f"the attention is {query.dtype}; the template serves bf16"
    if not isinstance(key, torch.Tensor) or key.dim() != 4:
        return "key is not [batch, heads, rows, head_dim]"
    if kw["dropout_p"] != 0.0:
        return f"dropout_p is {kw['dropout_p']}"
    if not isinstance(kw["scale"], (float, int, type(None))) or not isinstance(kw["is_causal"], bool):
        return "the scale or the causal flag is not a constant"
    if kw["is_causal"] and (mask is not None or not statically_known_true(query.shape[2] == key.shape[2])):
        # SDPA's is_causal aligns the first rows; the op's, the last: they agree where Tq == Tk
        return "is_causal with a mask, or with fewer query rows than key rows (top-left aligned)"
    if query.shape[1] != key.shape[1] and not kw["enable_gqa"]:
        return "query and key heads differ without enable_gqa"
    if mask is not None and not isinstance(mask, torch.Tensor):
        return "the mask has no example value"
    try:
        check_args(query, key, value, mask, kw["is_causal"])
    except ValueError as error:
        return str(error).removeprefix("mla::prefill_attention: ")
    return None


def rewrite_sdpa(graph: torch.fx.Graph, stage: str, enabled) -> int:
    """Every SDPA call of Dynamo's graph over many query rows that mla_prefill or gqa_prefill takes (see
    fusion_of; `enabled(fusion)` says which are on), as mla::prefill_attention; returns how many."""
    fired = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not F.scaled_dot_product_attention:
            continue
        kw = _sdpa_arguments(node)
        fusion = fusion_of(kw)
        if fusion is None or not enabled(fusion):
            continue
        reason = _decline_reason(kw)
        record_decision(fusion, [node], stage, reason)
        if reason is not None:
            continue
        (key, copies), (value, value_copies) = _without_repeat_kv(kw["key"]), _without_repeat_kv(kw["value"])
        if copies != value_copies:
            key, value = kw["key"], kw["value"]
        args = (kw["query"], key, value, kw["attn_mask"], kw["is_causal"], kw["scale"])
        with graph.inserting_before(node):
            fused = graph.call_function(torch.ops.mla.prefill_attention.default, args)
        fused.meta.update(node.meta)
        with _value(kw["query"]).fake_mode:  # Dynamo's, which made every example value of this graph
            fused.meta["example_value"] = torch.ops.mla.prefill_attention.default(*(_value(a) for a in args))
        node.replace_all_uses_with(fused)
        graph.erase_node(node)
        fired += 1
    return fired


# --- anchored match: attention of many query rows written out ----------------------------------------
#
# Model code that writes its prefill attention out (transformers' `attn_implementation="eager"`, DeepSeek's
# reference `naive` einsums, serving code's own) spells SDPA's math: q . k^T (scaled, softcapped), a mask,
# a softmax (in fp32 and back), . v. The walk anchors on the softmax, reads its logits as mla_decode's and
# gqa_decode's walks do (attention_scores.py), and the score contraction's axes by role:
#   - feature: contracted (the key's last dim);
#   - rows: free in the keys (the softmax's dim); query_rows: free in the queries (more than one);
#   - group: a batch axis along which the keys are broadcast (repeat_kv's expand: grouped heads);
#   - request, kv_head: the batch axes both read (the outer one the request; one alone: heads).
# P.V must contract the probabilities' rows with values read like the keys, broadcast over the group.
# The op then reads q, k and v as the graph already holds them, in role order (views where the layout
# allows), and the mask as [request or 1, heads or 1, query rows or 1, rows]. It runs after the decode
# walks, which take one query row per head.
_QUERY_ORDER = ("request", "kv_head", "group", "query_rows", "feature")
_MASK_ORDER = (("request",), ("kv_head", "group"), ("query_rows",), ("rows",))
_MASK_ROLES = tuple(role for group in _MASK_ORDER for role in group)


def _score_roles(c: contraction.Contraction, query_is_a: bool) -> dict:
    roles, shared = {}, []
    for axis, (fa, fb, _) in c.axes.items():
        fk = fb if query_is_a else fa
        if axis[0] == "k":
            roles[axis] = "feature"
        elif axis[0] == "batch":
            if fk.label is None:
                roles[axis] = "group"
            else:
                shared.append(axis)
        else:
            roles[axis] = "rows" if fk is not None else "query_rows"
    values = list(roles.values())
    if values.count("query_rows") != 1 or values.count("rows") != 1 or values.count("group") > 1 or len(shared) > 2:
        raise contraction.Unsupported("not one run of query rows against one of key rows per request and head")
    shared.sort(key=lambda a: c.axes[a][0 if query_is_a else 1].label)
    roles.update(zip(shared, ("request", "kv_head") if len(shared) == 2 else ("kv_head",)))
    return roles


def _mask_view(emit: Emitter, mask: torch.fx.Node, scores_roles: list) -> torch.fx.Node:
    """A mask broadcast against the logits (dims `scores_roles`) as [request or 1, heads or 1, query rows
    or 1, rows or 1]. A logits dim that merges roles (heads in the batch) is split for the mask first."""
    aten = torch.ops.aten
    shape = contraction.shape(mask)
    rank = len(scores_roles)
    if len(shape) > rank:
        raise Decline("the mask has more dims than the scores")
    split, roles = [], []  # the mask's dims one role each (None: broadcast)
    for size, entries in zip([1] * (rank - len(shape)) + list(shape), scores_roles):
        live = [(role, n) for role, n, _ in entries if not same(n, 1)]
        if same(size, 1) or not live:
            split.append(1)
            roles.append(None)
        elif same(size, math.prod(n for _, n in live)):
            split += [n for _, n in live]
            roles += [role for role, _ in live]
        else:
            raise Decline("the mask covers part of a dim of the scores")
    if any(role not in _MASK_ROLES for role in roles if role is not None) or len(set(roles) - {None}) != sum(
            role is not None for role in roles):
        raise Decline("the mask's dims are not one request, head, query row and key row each")
    view = emit(aten.reshape.default, mask, split)
    kept = sorted((d for d, role in enumerate(roles) if role is not None), key=lambda d: _MASK_ROLES.index(roles[d]))
    view = emit(aten.permute.default, view, kept + [d for d, role in enumerate(roles) if role is None])
    sizes = dict(zip((roles[d] for d in kept), (split[d] for d in kept)))
    return emit(aten.reshape.default, view, [math.prod(sizes.get(role, 1) for role in group) for group in _MASK_ORDER])


def rewrite_written_attention(graph: torch.fx.Graph, div: torch.fx.Node) -> bool:
    """The anchored match (see above) on a softmax that may be prefill attention written out."""
    aten = torch.ops.aten
    logits_node = logits_of_softmax(div)
    found = next_contraction(div) if logits_node is not None else None
    if found is None:
        return False
    try:
        logits = read_logits(logits_node)
        if len(logits.terms) != 1:
            return False
        scores, layout, query_is_a = score_contraction(logits.terms[0])
        roles = _score_roles(scores, query_is_a)
    except contraction.Unsupported:
        return False
    value, probs_is_a = found
    feature = math.prod(size for axis, (_, _, size) in scores.axes.items() if roles[axis] == "feature")
    free = "n" if probs_is_a else "m"  # the values' own free axis
    value_width = math.prod(size for axis, (_, _, size) in value.axes.items() if axis[0] == free)
    if same(feature, value_width):
        return False  # q/k and v heads of one size: not MLA's (grouped-query attention keeps its own)
    # From here on the softmax reads MLA attention scores of many query rows: near misses are reported.
    if [f.label for f in layout.dims[-1]] != [a for a in scores.axes if roles[a] == "rows"]:
        raise Decline("the softmax dim does not hold every key row")
    scores_roles = axis_roles(layout, roles)
    value_roles = roles_of_contraction(value, probs_is_a, scores_roles, "value_column", "group")
    if not all((axis[0] == "k") == (role == "rows") for axis, role in value_roles.items()):
        raise Decline("P.V does not contract the probabilities' rows with the value rows")
    for axis, role in value_roles.items():
        factor = value.axes[axis][1 if probs_is_a else 0]
        if role == "group" and factor is not None and factor.label is not None:
            raise Decline("the values differ between the query heads of a group")
    if logits.scale_tensors:
        raise Decline("the scale is a tensor (dynamic=True): not taken yet")
    if logits.bias is not None and logits.admit is not None:
        raise Decline("an additive and a boolean mask both")
    operands = (scores.a, scores.b, value.a, value.b)
    if {o.node.meta["val"].dtype for o in operands} != {torch.bfloat16}:
        raise Decline("the products are not bf16 (the template serves bf16)")
    sizes = {"request": 1, "kv_head": 1, "group": 1}
    for role in set(roles.values()):
        sizes[role] = math.prod(size for axis, (_, _, size) in scores.axes.items() if roles[axis] == role)
    sizes["value_column"] = math.prod(size for axis, (_, _, size) in value.axes.items()
                                      if value_roles[axis] == "value_column")
    if not same(math.prod(size for axis, (_, _, size) in value.axes.items() if value_roles[axis] == "rows"),
                sizes["rows"]):
        raise Decline("P.V reads another number of rows than the scores")
    end, out_layout, _ = value.result()
    emit = Emitter(graph, end, like=div)
    heads = sizes["kv_head"] * sizes["group"]
    query = operand_in_role_order(emit, scores, query_is_a, roles, _QUERY_ORDER, sizes)
    query = emit(aten.reshape.default, query, [sizes["request"], heads, sizes["query_rows"], sizes["feature"]])
    key = operand_in_role_order(emit, scores, not query_is_a, roles, ("request", "kv_head", "rows", "feature"), sizes)
    values = operand_in_role_order(emit, value, not probs_is_a, value_roles,
                                   ("request", "kv_head", "rows", "value_column"), sizes)
    mask = mask_argument(emit, logits, lambda m: _mask_view(emit, m, scores_roles))
    try:
        out = emit(torch.ops.mla.prefill_attention.default, query, key, values, mask, False, logits.scale,
                   logits.softcap)
    except ValueError as error:
        raise Decline(str(error).removeprefix("mla::prefill_attention: ")) from error
    out = emit(aten.reshape.default, out, [sizes["request"], sizes["kv_head"], sizes["group"], sizes["query_rows"],
                                           sizes["value_column"]])
    order = ("request", "kv_head", "group", "query_rows", "value_column")
    end.replace_all_uses_with(from_role_order(emit, out, order, sizes, end, axis_roles(out_layout, value_roles)))
    return True


def register() -> None:
    register_anchored_rewrite(FUSION, softmax_divisions, rewrite_written_attention)
