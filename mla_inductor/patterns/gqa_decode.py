"""gqa_decode: grouped-query decode attention run on the key/value heads as they are stored.

For one query row, the heads that share a key/value head can be rows of one query instead: q
[B, heads, 1, d] viewed as [B, kv_heads, heads / kv_heads, d] attends over k and v [B, kv_heads, T, d]
themselves (query head h uses key/value head h // (heads / kv_heads) in both forms, so the rewrite is
exact). Eager transformers does this (`pack_gqa`), but not while Dynamo traces; spellings found in
compiled graphs, each written below as the model code it matches:
- `repeat_kv` of k and v (or `repeat_interleave(n_rep, dim=1)`, which traces the same), then SDPA:
  transformers' `sdpa_attention_forward` under torch.compile whenever there is a mask, i.e. every
  StaticCache decode. Inductor writes K and V expanded to every query head (heads / kv_heads times
  the cache, every step) before the attention reads them;
- SDPA with `enable_gqa=True` (transformers without a mask): ATen's CPU flash attention runs it about
  9x slower than the packed form on one query row (docs/gqa_decode.md).
- attention written out, without SDPA: transformers' `eager_attention_forward` (attn_implementation=
  "eager", and the only attention of Gemma-2, whose logits are softcapped), serving code's own
  `q @ k.transpose(-1, -2)`, einsums. The anchored match below reads its math, whatever the spelling.
- multi-head attention, groups of one: SDPA of one query row over as many key/value heads (Llama-2,
  Phi-3-mini, GPT-NeoX, OLMo). Nothing is repeated, but ATen's CPU flash attention runs one query row
  at a fraction of the memory's rate where bf16 is not native (docs/gqa_decode.md), and reads a
  StaticCache's unfilled tail.
All become `mla::gqa_decode_attention` (ops/gqa_decode.py), which reads each key/value row once for
all its query heads: a flash-decoding template that skips the blocks of rows the mask excludes (a
StaticCache's unfilled tail), or, where the template cannot serve, SDPA of the packed query.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch._inductor.pattern_matcher import Match
from torch.fx.operator_schemas import normalize_function
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..ops.gqa_decode import check_args
from . import contraction
from .attention_scores import (SINKS, Logits, as_rows_mask, logits_of_softmax, mask_argument, next_contraction,
                               read_logits, roles_of_contraction, scale_by_tensors, score_contraction,
                               scores_beside_sinks, softmax_divisions)
from .contraction import Decline, Emitter, axis_roles, from_role_order, operand_in_role_order, same
from .registry import node_value, register_anchored_rewrite, register_fusion

FUSION = "gqa_decode"
_SCALE = 0.0625  # a magic value: the literal becomes the argument
aten = torch.ops.aten
_FLASH_ATTENTION = aten._scaled_dot_product_flash_attention_for_cpu.default


def repeat_kv(x, n_rep):
    """transformers' repeat_kv: [B, kv_heads, T, d] -> [B, kv_heads * n_rep, T, d]."""
    batch, kv_heads, rows, head_dim = x.shape
    return x[:, :, None, :, :].expand(batch, kv_heads, n_rep, rows, head_dim).reshape(
        batch, kv_heads * n_rep, rows, head_dim
    )


# --- search functions: the model code ------------------------------------------------------------
# The matcher fills a graph node's absent keywords from the op's defaults, so these also match
# attention without a mask or an explicit scale: `mask` and `scale` then bind as None.


def repeated(query, key, value, mask, scale):
    n_rep = query.shape[1] // key.shape[1]
    return F.scaled_dot_product_attention(
        query, repeat_kv(key, n_rep), repeat_kv(value, n_rep), attn_mask=mask, scale=scale
    )


def grouped(query, key, value, mask, scale):
    """Also multi-head SDPA (enable_gqa is no argument of ATen's CPU flash attention: both trace alike).
    Registered after `repeated`, whose graphs it would match with repeat_kv's copies bound as the cache."""
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=True)


# --- replacement ----------------------------------------------------------------------------------


def fused(query, key, value, mask, scale):
    return torch.ops.mla.gqa_decode_attention(query, key, value, mask, scale)


# --- preconditions --------------------------------------------------------------------------------


def check(match: Match) -> Optional[str]:
    # The pattern names only the mask and the scale: the matcher does not compare the other keywords.
    attention = next(node for node in match.nodes if node.target == _FLASH_ATTENTION)
    flags = normalize_function(attention.target, attention.args, attention.kwargs, normalize_to_only_use_kwargs=True)
    if flags.kwargs["dropout_p"] != 0.0 or flags.kwargs["is_causal"]:
        return "the attention has dropout or the causal flag (top-left aligned: it would differ per packed head)"
    kw = {name: node_value(arg) for name, arg in match.kwargs.items()}
    query, key, value, mask = kw["query"], kw["key"], kw["value"], kw["mask"]
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return f"query, key, value have {query.dim()}, {key.dim()}, {value.dim()} dims, not [B, heads, rows, d]"
    if not statically_known_true(query.shape[2] == 1):
        return f"{query.shape[2]} query rows: packing heads into rows is for one query row (decode)"
    heads, kv_heads = query.shape[1], key.shape[1]
    if value.shape[1] != kv_heads or heads % kv_heads != 0:
        return f"{heads} query heads over {kv_heads} key and {value.shape[1]} value heads: not grouped-query attention"
    if mask is not None:
        # The packed query's rows are heads: a mask must be the same for every head of the row.
        shape = [1] * (4 - mask.dim()) + list(mask.shape)
        if mask.dim() > 4 or not all(statically_known_true(size == 1) for size in shape[1:3]):
            return f"mask {list(mask.shape)} differs between heads; packing needs one shared by them ([B, 1, 1, T])"
    try:
        check_args(query, key, value, mask)
    except ValueError as error:
        return str(error).removeprefix("mla::gqa_decode_attention: ")
    return None


# --- registration ---------------------------------------------------------------------------------


def _example_inputs() -> list:
    """Small inputs with all sizes distinct (3 key/value heads of 2 query heads each)."""
    batch, kv_heads, n_rep, rows, head_dim = 2, 3, 2, 7, 5
    return [
        torch.empty(batch, kv_heads * n_rep, 1, head_dim),
        torch.empty(batch, kv_heads, rows, head_dim),
        torch.empty(batch, kv_heads, rows, head_dim),
        # A float mask: transformers builds an additive one, and a bool mask's conversion to it traces
        # as a `where` in front of the pattern, which then binds as the mask.
        torch.empty(batch, 1, 1, rows),
        _SCALE,
    ]


def register() -> None:
    for search_fn in (repeated, grouped):
        register_fusion(FUSION, search_fn, fused, _example_inputs(), check, scalar_workaround={"scale": _SCALE})
    register_anchored_rewrite(FUSION, softmax_divisions, rewrite_grouped_attention)


# --- anchored match: grouped-query attention written out ---------------------------------------------
#
# Eager attention spells the SDPA above as its math: q @ repeat_kv(k)^T, scaled (softcapped), plus a
# mask, a softmax (in fp32 and back), @ repeat_kv(v). The walk anchors on the softmax and reads its
# logits as mla_decode's anchored match does (attention_scores.py), then the score contraction's axes by
# role (contraction.py):
#   - feature: contracted; the key cache's last dim;
#   - group: the query heads that share a key/value head: a batch axis along which the key cache is
#     broadcast (repeat_kv's expand, or a repeat), or, where the query was split into key/value heads x
#     groups (the packed form serving code writes), the query's free axis;
#   - kv_head: a batch axis of the cache read from the same query dim as the group (in either order:
#     the roles, not the order, decide which key/value head a query head reads);
#   - request: the other batch axis the query and the cache share;
#   - rows: free in the cache, the softmax's dim.
# The probabilities must be contracted over those rows with a value cache read at the same rows by
# request and key/value head, broadcast over the group. Caches are passed as views of the tensors the
# model reads (the cache buffer itself, not repeat_kv's copy), the query from the graph's operand.
_ORDER = ("request", "kv_head", "group")


def _score_roles(c: contraction.Contraction, query_is_a: bool) -> dict:
    """Axis -> role of the score contraction, by which operand each axis is a factor of. Unsupported
    where the scores are not attention's of one query row per head (one query for all heads)."""
    roles, cache_batch, query_free, groups = {}, [], [], []
    for axis, (fa, fb, _) in c.axes.items():
        fc = fb if query_is_a else fa
        if axis[0] == "k":
            roles[axis] = "feature"
        elif axis[0] == "batch":
            (groups if fc.label is None else cache_batch).append(axis)
        elif fc is not None:
            roles[axis] = "rows"
        else:
            query_free.append(axis)
    if len(groups) > 1:
        raise contraction.Unsupported("keys broadcast over two axes")
    if groups and query_free:
        raise Decline("the queries have more than one row per request and head (prefill?)")

    def query_dim(axis):
        return c.axes[axis][0 if query_is_a else 1].label

    if not groups and not query_free:  # multi-head attention: groups of one
        if not cache_batch or len(cache_batch) > 2:
            raise contraction.Unsupported("not one query row per request and head")
        # the outer of two batch axes is the request (a mask's), the inner the heads, as SDPA has them; one
        # alone is a request (with groups of one, every request and head attends on its own)
        request, *kv_head = sorted(cache_batch, key=query_dim)
        return {**roles, request: "request", **{axis: "kv_head" for axis in kv_head}}
    if not groups:  # the packed form: the query's heads split into key/value heads x a free group axis
        packed = [a for a in query_free if any(query_dim(a) == query_dim(b) for b in cache_batch)]
        if len(query_free) != 1 or len(packed) != 1:
            raise contraction.Unsupported("no query heads grouped over a key/value head")
        groups = packed
    (group,) = groups
    roles[group] = "group"
    for axis in cache_batch:
        roles[axis] = "kv_head" if query_dim(axis) == query_dim(group) else "request"
    if sum(r == "request" for r in roles.values()) > 1 or sum(r == "kv_head" for r in roles.values()) > 1:
        raise Decline("the cache has more than a request and a key/value head dim besides its rows")
    return roles


def _cache_view(emit: Emitter, operand: contraction.Operand, factor_roles: dict, order: tuple) -> torch.fx.Node:
    """The tensor a cache operand reads, as a view of dims `order` (a role the operand lacks: a dim of 1).
    Each dim of its origin must be read in order as one role (a slice of it at most), or not at all (a
    select, or a dim of 1). The rows may span adjacent dims read whole (a paged cache gathered by a
    block table: [batch, blocks, block_size, ...]), which are merged."""
    origin, layout = operand.origin, operand.layout
    sizes = contraction.shape(origin)
    view, dim_roles = origin, {}
    for dim in reversed(range(len(sizes))):  # from the last: a select leaves the dims before it in place
        factors = [f for f in factor_roles if f.label == dim]
        start = layout.offsets.get(dim, 0)
        if not factors:
            if not (same(sizes[dim], 1) or dim in layout.offsets):
                raise Decline(f"the cache's dim {dim} is broadcast or summed over, not read")
            view = emit(aten.select.int, view, dim, start)
            continue
        if len(factors) > 1 or not same(factors[0].stride, 1):
            raise Decline(f"the cache's dim {dim} is not read in order as one dim")
        (f,) = factors
        whole = same(start, 0) and same(f.size, sizes[dim])
        if not whole:
            view = emit(aten.slice.Tensor, view, dim, start, start + f.size)
        dim_roles[dim] = factor_roles[f], whole
    dims = sorted(dim_roles)
    present = [dim_roles[d][0] for d in dims]
    rows = [d for d in dims if dim_roles[d][0] == "rows"]
    if not rows or rows != list(range(rows[0], rows[0] + len(rows))) or not all(dim_roles[d][1] for d in rows[1:]):
        raise Decline("the cache's rows are not one run of its dims (adjacent, the inner ones whole)")
    if len(set(present)) != len(present) - len(rows) + 1 or not set(present) <= set(order):
        raise Decline("the cache's dims do not hold one request, key/value head, row and column each")
    view = emit(aten.permute.default, view, [i for role in order for i, r in enumerate(present) if r == role])
    if len(rows) > 1:  # merged into one dim of rows
        permuted = [r for role in order for r in present if r == role]
        shape = contraction.shape(view)
        view = emit(aten.reshape.default, view, [math.prod(n for n, r in zip(shape, permuted) if r == role)
                                                 for role in order if role in present])
    for i, role in enumerate(order):
        if role not in present:
            view = emit(aten.unsqueeze.default, view, i)
    return view


@dataclasses.dataclass
class _Candidate:
    logits: Logits
    scores: contraction.Contraction
    query_is_a: bool
    roles: dict  # the score contraction's axis -> role
    scores_roles: list  # per dim of the logits: [(role, size, stride)]
    value: contraction.Contraction
    value_roles: dict
    probs_is_a: bool


def _find_candidate(div: torch.fx.Node) -> Optional[_Candidate]:
    """Softmaxes of grouped-query attention scores; None for anything else (latent attention, plain
    multi-head attention, a softmax that is not attention's)."""
    logits_node = logits_of_softmax(div)
    found = next_contraction(div) if logits_node is not None else None
    if found is None:
        return None
    sinks_beside = scores_beside_sinks(logits_node)
    try:
        logits = read_logits(sinks_beside or logits_node)
        if len(logits.terms) != 1:
            return None
        (term,) = logits.terms
        scores = contraction.Contraction.of(contraction.trace_back(term).origin)
        value, probs_is_a = found
        if {value.a.origin, value.b.origin} & {scores.a.origin, scores.b.origin}:
            return None  # values read from the keys' tensor: latent attention (mla_decode)
        if sinks_beside is not None:
            raise Decline(SINKS)
        scores, layout, query_is_a = score_contraction(term)
        last = layout.dims[-1]
        roles = _score_roles(scores, query_is_a)
    except contraction.Unsupported:
        return None
    # From here on the softmax reads a grouped query's scores: near misses are reported.
    if [f.label for f in last] != [a for a in scores.axes if roles[a] == "rows"]:
        raise Decline("the softmax dim does not hold every cache row")
    scores_roles = axis_roles(layout, roles)
    try:
        value_roles = roles_of_contraction(value, probs_is_a, scores_roles, "value_column", "group")
    except Decline as why:  # the probabilities' heads read whole: values of their own per query head
        raise Decline("the values differ between the query heads of a group") from why
    if not all((axis[0] == "k") == (role == "rows") for axis, role in value_roles.items()):
        raise Decline("P.V does not contract the probabilities' rows with the value rows")
    return _Candidate(logits, scores, query_is_a, roles, scores_roles, value, value_roles, probs_is_a)


def _cache_factors(c: contraction.Contraction, of_a: bool, roles: dict) -> dict:
    """The factors of c's operand (a if of_a) that read its origin, by role."""
    factors = {}
    for axis, (fa, fb, _) in c.axes.items():
        f = fa if of_a else fb
        if f is not None and f.label is not None:
            factors[f] = roles[axis]
    return factors


def _role_sizes(c: contraction.Contraction, roles: dict) -> dict:
    """Role -> its extent: the product of its axes' sizes (a request, key/value head or group absent: 1)."""
    sizes = {"request": 1, "kv_head": 1, "group": 1}
    for role in set(roles.values()):
        sizes[role] = math.prod(size for axis, (_, _, size) in c.axes.items() if roles[axis] == role)
    return sizes


def _starts(operand: contraction.Operand, factor_roles: dict) -> dict:
    """Role -> where each of its dims is read from in the operand's origin, outer dims first."""
    starts = {}
    for f, role in sorted(factor_roles.items(), key=lambda item: item[0].label):
        starts.setdefault(role, []).append(operand.layout.offsets.get(f.label, 0))
    return starts


def rewrite_grouped_attention(graph: torch.fx.Graph, div: torch.fx.Node) -> bool:
    """The anchored match (see above) on a softmax that may read grouped-query attention scores."""
    cand = _find_candidate(div)
    if cand is None:
        return False
    scores, value, roles, value_roles = cand.scores, cand.value, cand.roles, cand.value_roles
    key_operand = scores.b if cand.query_is_a else scores.a
    value_operand = value.b if cand.probs_is_a else value.a
    key_factors = _cache_factors(scores, not cand.query_is_a, roles)
    value_factors = _cache_factors(value, not cand.probs_is_a, value_roles)
    if "group" in value_factors.values():
        raise Decline("the values differ between the query heads of a group")
    value_sizes = _role_sizes(value, value_roles)
    sizes = {**_role_sizes(scores, roles), "value_column": value_sizes["value_column"]}
    for role, name in (("request", "requests"), ("kv_head", "key/value heads"), ("rows", "rows")):
        if role in value_sizes and not same(value_sizes[role], sizes[role]):
            raise Decline(f"P.V reads another number of {name} than the scores")
    key_starts, value_starts = _starts(key_operand, key_factors), _starts(value_operand, value_factors)
    for role in ("request", "kv_head", "rows"):
        k_starts, v_starts = key_starts.get(role, []), value_starts.get(role, [])
        if len(k_starts) != len(v_starts) or not all(same(a, b) for a, b in zip(k_starts, v_starts)):
            raise Decline("P.V reads other rows than the scores")

    batch, heads = sizes["request"], sizes["kv_head"] * sizes["group"]
    end, out_layout, _ = value.result()
    emit = Emitter(graph, end, like=div)
    key = _cache_view(emit, key_operand, key_factors, ("request", "kv_head", "rows", "feature"))
    values = _cache_view(emit, value_operand, value_factors, ("request", "kv_head", "rows", "value_column"))
    query = operand_in_role_order(emit, scores, cand.query_is_a, roles, (*_ORDER, "feature"), sizes)
    if cand.logits.scale_tensors:  # a scale the graph holds as a tensor, folded into the query
        query = scale_by_tensors(emit, emit.cast(query, torch.float32), cand.logits)
    query = emit(aten.reshape.default, emit.cast(query, key.meta["val"].dtype), [batch, heads, 1, sizes["feature"]])
    mask = mask_argument(emit, cand.logits,
                         lambda m: as_rows_mask(emit, cand.scores_roles, m, batch, sizes["rows"]))
    if mask is not None:
        mask = emit(aten.reshape.default, mask, [-1, 1, 1, sizes["rows"]])
    try:
        out = emit(torch.ops.mla.gqa_decode_attention.default, query, key, values, mask, cand.logits.scale,
                   cand.logits.softcap)
    except ValueError as error:
        raise Decline(str(error).removeprefix("mla::gqa_decode_attention: ")) from error
    out = emit(aten.reshape.default, out, [batch, sizes["kv_head"], sizes["group"], sizes["value_column"]])
    end.replace_all_uses_with(
        from_role_order(emit, out, (*_ORDER, "value_column"), sizes, end, axis_roles(out_layout, value_roles)))
    return True
