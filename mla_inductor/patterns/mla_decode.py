"""mla_decode: absorbed MLA decode attention over the latent cache into `mla::latent_decode_attention`.

Spellings found in real graphs, each written below as the model code it matches:
- serving style (SGLang / vLLM torch-native backends, models/mla.py): every query head attends over
  the request's paged latent rows gathered by block table (K = c_kv | k_pe, V = c_kv), masked by
  length, then the latent output is de-absorbed through W_vc with a bmm;
- transformers DeepseekV3/V2 decode: the cache holds the compressed latent, but every step runs
  kv_b_proj over the *whole* cache, assembles full keys and runs SDPA's math path. The replacement
  absorbs kv_b_proj instead (W_kc into the query, W_vc after the attention: slices of its weight) and
  attends over the latent rows the mask admits, which cuts the step from
  O(T * kv_lora_rank * heads * 256) to O(heads * T * 576). The cache writes stay as they were.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch._inductor.pattern_matcher import Match
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..ops.mla_decode import check_args, latent_decode_attention_dense
from . import contraction
from .attention_scores import (SINKS, Logits, as_rows_mask, logits_of_softmax, mask_argument, next_contraction,
                               node_is, read_logits, roles_of_contraction, scale_by_tensors, scores_beside_sinks,
                               softmax_divisions)
from .contraction import Decline, Emitter, axis_roles, from_role_order, operand_in_role_order, same
from .registry import node_value, register_anchored_rewrite, register_fusion, upcast

FUSION = "mla_decode"
# Magic values the traced patterns turn back into arguments (distinct from every size and literal).
_SCALE = 0.0625
# transformers' math SDPA multiplies q and k^T by sqrt(scale) each, so the scale is matched as that
# square root (both multiplications must bind the same value) and squared in the replacement.
_SQRT_SCALE = 0.3125
_END = 9223372036854775807  # an open slice end, as traced


# --- search functions: the model code ------------------------------------------------------------


def paged_absorbed_decode(q, kv_cache, block_tables, seq_lens, w_vc, scale):
    """q [B, H, L + R], cache [blocks, block_size, L + R], w_vc [H, v_head_dim, L] -> [H, B, v_head_dim]."""
    kv_lora_rank = w_vc.shape[-1]
    kv = kv_cache[block_tables].flatten(1, 2)
    c, k_pe = kv[..., :kv_lora_rank], kv[..., kv_lora_rank:]
    q_lat, q_pe = q[..., :kv_lora_rank], q[..., kv_lora_rank:]
    scores = torch.bmm(q_lat, c.transpose(1, 2)) + torch.bmm(q_pe, k_pe.transpose(1, 2))
    scores = upcast(scores) * scale
    valid = torch.arange(kv.shape[1], device=q.device)[None, :] < seq_lens[:, None]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(c.dtype)
    o_latent = torch.bmm(probs, c)
    return torch.bmm(o_latent.transpose(0, 1), w_vc.transpose(1, 2))


def _op(q, kv_cache, block_tables, seq_lens, kv_lora_rank, scale, **kwargs):
    if isinstance(scale, torch.Tensor):  # a float attribute under dynamic=True
        kwargs["scale_tensor"], scale = scale, 1.0
    return torch.ops.mla.latent_decode_attention(q, kv_cache, block_tables, seq_lens, kv_lora_rank, scale, **kwargs)


def paged_absorbed_decode_replacement(q, kv_cache, block_tables, seq_lens, w_vc, scale):
    return _op(q, kv_cache, block_tables, seq_lens, w_vc.shape[-1], scale, w_vc=w_vc).transpose(0, 1)


def _hf_attention(c_kv, k_pe, kv_b_weight, query, nope, mask, sqrt_scale):
    """transformers' MLA attention (5.x) from the updated caches on: c_kv [B, 1, T, L] and k_pe [B, 1, T,
    rope] (after the cache write), the query [B, H, S, nope + rope], kv_b_proj expanding the whole cache."""
    batch, _, seq_len, kv_lora_rank = c_kv.shape
    heads = query.shape[1]
    v_head_dim = kv_b_weight.shape[0] // heads - nope
    kv = F.linear(c_kv, kv_b_weight).view(batch, seq_len, -1, nope + v_head_dim).transpose(1, 2)
    k_nope, value = torch.split(kv, [nope, v_head_dim], dim=-1)
    k_rot = k_pe.expand(-1, k_nope.shape[1], -1, -1)
    key = kv.new_empty(*kv.shape[:-1], nope + k_pe.shape[-1])
    key[..., :nope].copy_(k_nope)
    key[..., nope:].copy_(k_rot)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=0.0, scale=sqrt_scale * sqrt_scale, is_causal=False
    )


def hf_decode(c_kv, k_pe, kv_b_weight, q_nope, q_pe, mask, sqrt_scale):
    """transformers DeepseekV3Attention: q_nope [B, H, S, nope] and the roped q_pe [B, H, S, rope] joined."""
    return _hf_attention(c_kv, k_pe, kv_b_weight, torch.cat((q_nope, q_pe), dim=-1), q_nope.shape[-1], mask,
                         sqrt_scale)


def hf_decode_whole_query(c_kv, k_pe, kv_b_weight, query, mask, sqrt_scale):
    """Kimi-Linear's MLA layers: no RoPE, so the query reaches the attention whole, as its projection made it."""
    return _hf_attention(c_kv, k_pe, kv_b_weight, query, query.shape[-1] - k_pe.shape[-1], mask, sqrt_scale)


def hf_decode_whole_query_unmasked(c_kv, k_pe, kv_b_weight, query, sqrt_scale):
    return hf_decode_whole_query(c_kv, k_pe, kv_b_weight, query, None, sqrt_scale)


def hf_decode_unmasked(c_kv, k_pe, kv_b_weight, q_nope, q_pe, sqrt_scale):
    """The same without a mask: a DynamicCache decode, whose cache holds exactly the visible rows."""
    return hf_decode(c_kv, k_pe, kv_b_weight, q_nope, q_pe, None, sqrt_scale)


def _absorbed(c_kv, k_pe, kv_b_weight, q_nope, q_pe, attn_mask, sqrt_scale):
    batch, heads, _, nope = q_nope.shape
    kv_lora_rank, rope = c_kv.shape[-1], k_pe.shape[-1]
    w = kv_b_weight.view(heads, -1, kv_lora_rank)
    w_kc, w_vc = w[:, :nope], w[:, nope:]  # [H, nope, L], [H, v_head_dim, L]
    q_latent = torch.bmm(q_nope[:, :, 0].transpose(0, 1), w_kc).transpose(0, 1)  # [B, H, L]
    query = torch.cat([q_latent, q_pe[:, :, 0]], dim=-1)
    # Every cache row is a candidate; the mask (if any) says which count. The op reads no row past the
    # last one the mask admits, so a StaticCache's unfilled tail costs nothing.
    lengths = torch.ones(batch, dtype=torch.int64, device=c_kv.device) * c_kv.shape[2]
    out = latent_decode_attention_dense(
        query,
        c_kv.view(batch, -1, kv_lora_rank),
        lengths,
        kv_lora_rank,
        sqrt_scale * sqrt_scale,
        w_vc=w_vc,
        rope=k_pe.view(batch, -1, rope),
        attn_mask=attn_mask,
    )
    return out.unsqueeze(2)


def hf_decode_replacement(c_kv, k_pe, kv_b_weight, q_nope, q_pe, mask, sqrt_scale):
    return _absorbed(c_kv, k_pe, kv_b_weight, q_nope, q_pe, mask[:, 0, 0], sqrt_scale)


def hf_decode_unmasked_replacement(c_kv, k_pe, kv_b_weight, q_nope, q_pe, sqrt_scale):
    return _absorbed(c_kv, k_pe, kv_b_weight, q_nope, q_pe, None, sqrt_scale)


def hf_decode_whole_query_replacement(c_kv, k_pe, kv_b_weight, query, mask, sqrt_scale):
    nope = query.shape[-1] - k_pe.shape[-1]
    return _absorbed(c_kv, k_pe, kv_b_weight, query[..., :nope], query[..., nope:], mask[:, 0, 0], sqrt_scale)


def hf_decode_whole_query_unmasked_replacement(c_kv, k_pe, kv_b_weight, query, sqrt_scale):
    nope = query.shape[-1] - k_pe.shape[-1]
    return _absorbed(c_kv, k_pe, kv_b_weight, query[..., :nope], query[..., nope:], None, sqrt_scale)


# --- preconditions --------------------------------------------------------------------------------


def _paged_literal_mismatch(match: Match, kv_lora_rank: int) -> Optional[str]:
    """The literals the size-agnostic pattern does not compare: where q and the rows are cut into
    latent and rope parts, which dims are transposed, reduced and unsqueezed."""
    aten = torch.ops.aten
    for node in match.nodes:
        args = node.args
        if node.target == aten.slice.Tensor:
            dim, start, end = args[1], args[2], args[3]
            step = args[4] if len(args) > 4 else 1
            if dim not in (-1, 2) or step != 1 or (start, end) not in ((0, kv_lora_rank), (kv_lora_rank, _END)):
                return f"{node.name} slices [{start}:{end}:{step}] on dim {dim}, not at kv_lora_rank {kv_lora_rank}"
        elif node.target == aten.permute.default and list(args[1]) not in ([0, 2, 1], [1, 0, 2]):
            return f"{node.name} permutes {list(args[1])}"
        elif node.target in (aten.amax.default, aten.sum.dim_IntList) and (
            list(args[1]) not in ([-1], [2]) or args[2:3] != (True,)
        ):
            return f"{node.name} reduces dims {list(args[1])}, not the rows' dim with keepdim"
        elif node.target == aten.unsqueeze.default:
            source = args[0]
            expected = 0 if source.target == torch.ops.prims.iota.default else 1
            if args[1] != expected:
                return f"{node.name} unsqueezes dim {args[1]}, expected {expected}"
        elif node.target == torch.ops.prims.iota.default and (node.kwargs.get("start"), node.kwargs.get("step")) != (0, 1):
            return f"{node.name} is not arange(rows)"
    return None


def check_paged(match: Match) -> Optional[str]:
    kw = {name: node_value(arg) for name, arg in match.kwargs.items()}
    q, cache, tables, lens, w_vc = (kw[k] for k in ("q", "kv_cache", "block_tables", "seq_lens", "w_vc"))
    if cache.dtype != q.dtype or w_vc.dtype != q.dtype:
        return f"q, kv_cache and w_vc have dtypes {q.dtype}, {cache.dtype}, {w_vc.dtype}; the op takes one"
    if tables.is_floating_point() or lens.is_floating_point():
        return "block_tables and seq_lens must be integer tensors"
    if w_vc.dim() != 3 or not isinstance(w_vc.shape[2], int):
        return f"w_vc {list(w_vc.shape)} is not [heads, v_head_dim, kv_lora_rank]"
    try:
        check_args(q, cache, tables, lens, w_vc.shape[2], 0.0, None, None, w_vc)
    except ValueError as error:
        return str(error).removeprefix("mla::latent_decode_attention: ")
    return _paged_literal_mismatch(match, w_vc.shape[2])


def _hf_literal_mismatch(match: Match, nope: int, v_head_dim: int, heads: int) -> Optional[str]:
    """What the strict re-trace would compare, for the size-agnostic (dynamic cache length) form: how
    kv_b_proj's output is split into heads, k_nope and v, and how the key is assembled."""
    aten = torch.ops.aten
    for node in match.nodes:
        args = node.args
        if node.target == aten.split_with_sizes.default:
            if (list(args[1]), args[2:3]) not in (([nope, v_head_dim], (-1,)), ([nope, v_head_dim], (3,))):
                return f"{node.name} splits {list(args[1])}, not k_nope {nope} | v {v_head_dim}"
            heads_view = args[0].args[0]  # split(permute(view(kv_b_proj(c_kv), [B, T, H, nope + v])))
            if tuple(heads_view.meta["val"].shape[2:]) != (heads, nope + v_head_dim):
                return f"{heads_view.name} does not split kv_b_proj's output into {heads} heads"
        if node.target == aten.permute.default and list(args[1]) not in ([0, 2, 1, 3], [0, 1, 3, 2], [1, 0]):
            return f"{node.name} permutes {list(args[1])}"
        if node.target in (aten.slice.Tensor, aten.slice_scatter.default):
            dim, start, end = args[-3], args[-2], args[-1]
            if dim not in (3, -1) or (start, end) not in ((0, nope), (nope, _END)):
                return f"{node.name} cuts the key at [{start}:{end}] on dim {dim}, not at nope {nope}"
        if node.target in (aten.amax.default, aten.sum.dim_IntList, aten.any.dim):
            dims = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
            if list(dims) not in ([-1], [3]):
                return f"{node.name} reduces dims {list(dims)}, not the rows' dim"
        if node.target == aten.expand.default and node.meta["val"].shape[1] not in (1, heads):
            return f"{node.name} expands to {list(node.meta['val'].shape)}"
    return None


def check_hf(match: Match) -> Optional[str]:
    kw = {name: node_value(arg) for name, arg in match.kwargs.items()}
    if "query" in kw:  # the query whole (no RoPE): its parts as the absorption reads them
        nope = kw["query"].shape[-1] - kw["k_pe"].shape[-1]
        kw["q_nope"], kw["q_pe"] = kw["query"][..., :nope], kw["query"][..., nope:]
    c_kv, k_pe, w, q_nope, q_pe = (kw[k] for k in ("c_kv", "k_pe", "kv_b_weight", "q_nope", "q_pe"))
    if q_nope.shape[2] != 1:
        return f"{q_nope.shape[2]} query rows: absorbing pays for decode, not for prefill"
    if c_kv.shape[1] != 1 or k_pe.shape[1] != 1:
        return "the latent cache has a head dim other than 1"
    if len({c_kv.dtype, k_pe.dtype, w.dtype, q_nope.dtype, q_pe.dtype}) != 1:
        return "caches, weight and queries differ in dtype"
    if not (c_kv.is_contiguous() and k_pe.is_contiguous()):
        return "the latent caches are not contiguous: the op reads them as rows in place"
    heads, nope = q_nope.shape[1], q_nope.shape[-1]
    if w.dim() != 2 or w.shape[1] != c_kv.shape[-1] or w.shape[0] % heads != 0 or w.shape[0] // heads <= nope:
        return f"kv_b_proj weight {list(w.shape)} does not fit {heads} heads of the latent"
    mismatch = _hf_literal_mismatch(match, nope, w.shape[0] // heads - nope, heads)
    if mismatch or "mask" not in kw:
        return mismatch
    mask = kw["mask"]
    shape = list(mask.shape)
    if mask.dim() != 4 or not (shape[0] == 1 or shape[0] == q_nope.shape[0]) or shape[1:3] != [1, 1]:
        return f"mask is {shape}, expected one mask for all heads, [batch or 1, 1, 1, rows]"
    if not statically_known_true(shape[3] == c_kv.shape[2]):
        return f"the mask covers {shape[3]} rows, the cache {c_kv.shape[2]}"
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        return f"mask is {mask.dtype}, expected bool or additive floats"
    return None


# --- registration ---------------------------------------------------------------------------------


def _paged_inputs(batch: int, dtype: torch.dtype) -> list:
    """Small inputs with all sizes distinct, so that no view or slice traces as a no-op."""
    heads, lora, rope, blocks, block_size, max_blocks, v_head_dim = 3, 12, 5, 9, 4, 2, 7
    return [
        torch.empty(batch, heads, lora + rope, dtype=dtype),
        torch.empty(blocks, block_size, lora + rope, dtype=dtype),
        torch.zeros(batch, max_blocks, dtype=torch.int32),
        torch.ones(batch, dtype=torch.int32),
        torch.empty(heads, v_head_dim, lora, dtype=dtype),
        _SCALE,
    ]


def _hf_inputs(batch: int, dtype: torch.dtype) -> list:
    heads, nope, rope, v_head_dim, lora, rows = 2, 8, 4, 6, 16, 8
    return [
        torch.empty(batch, 1, rows, lora, dtype=dtype),
        torch.empty(batch, 1, rows, rope, dtype=dtype),
        torch.empty(heads * (nope + v_head_dim), lora, dtype=dtype),
        torch.empty(batch, heads, 1, nope, dtype=dtype),
        torch.empty(batch, heads, 1, rope, dtype=dtype),
        torch.ones(batch, 1, 1, rows, dtype=torch.bool),
        _SQRT_SCALE,
    ]


def register() -> None:
    register_anchored_rewrite(FUSION, softmax_divisions, rewrite_latent_attention)
    for dtype in (torch.bfloat16, torch.float32):
        register_fusion(
            FUSION,
            paged_absorbed_decode,
            paged_absorbed_decode_replacement,
            _paged_inputs(2, dtype),
            check_paged,
            scalar_workaround={"scale": _SCALE},
            # Serving code compiles with a dynamic batch and cache size, whose sizes appear in mixed
            # spellings a strict re-trace cannot reproduce; check_paged compares the literals instead.
            size_agnostic=True,
        )
    # The math SDPA graph differs by dtype (casts to fp32) and batch (B > 1 clones the expanded value).
    for dtype, batch in itertools.product((torch.bfloat16, torch.float32), (1, 2)):
        register_fusion(
            FUSION,
            hf_decode,
            hf_decode_replacement,
            _hf_inputs(batch, dtype),
            check_hf,
            scalar_workaround={"sqrt_scale": _SQRT_SCALE},
            functionalize=True,  # the key is assembled in place
            # Sizes turn dynamic as soon as a compiled step sees a second batch or cache size (automatic
            # dynamic shapes) and then appear in mixed spellings a strict re-trace cannot reproduce;
            # check_hf compares the literals instead.
            size_agnostic=True,
        )
        # DynamicCache: no mask, and after the first steps a dynamic row count.
        register_fusion(
            FUSION,
            hf_decode_unmasked,
            hf_decode_unmasked_replacement,
            _hf_inputs(batch, dtype)[:5] + [_SQRT_SCALE],
            check_hf,
            scalar_workaround={"sqrt_scale": _SQRT_SCALE},
            functionalize=True,
            size_agnostic=True,
        )
        # Kimi-Linear's MLA: the query whole (its rows: q_nope and q_pe of _hf_inputs, side by side)
        c_kv, k_pe, weight, q_nope, q_pe, mask, _ = _hf_inputs(batch, dtype)
        query = torch.empty(*q_nope.shape[:-1], q_nope.shape[-1] + q_pe.shape[-1], dtype=dtype)
        for search, replace, inputs in (
            (hf_decode_whole_query, hf_decode_whole_query_replacement, [c_kv, k_pe, weight, query, mask]),
            (hf_decode_whole_query_unmasked, hf_decode_whole_query_unmasked_replacement, [c_kv, k_pe, weight, query]),
        ):
            register_fusion(FUSION, search, replace, inputs + [_SQRT_SCALE], check_hf,
                            scalar_workaround={"sqrt_scale": _SQRT_SCALE}, functionalize=True, size_agnostic=True)


# --- anchored match: the math of latent attention, however it is spelled ----------------------------
#
# The patterns above match the text of two spellings. The walk below matches the math: it anchors on a
# softmax over the last dim, reads its logits as (a sum of contractions) x scale (+ mask)
# (attention_scores.py, shared with gqa_decode's anchored match), and reads every contraction as an
# einsum over the tensors it reads (contraction.py). Attention whose values are not read from the
# keys' tensor is no candidate here (grouped-query or multi-head: gqa_decode's). It fires where
#   - one operand of each score contraction reads a latent cache (a dense [batch, rows, columns]
#     buffer, or rows gathered by a block table or a per-token index) and the other the queries, with
#     one query row per request and head;
#   - the scores contract the whole latent (and rope) columns of the cache;
#   - the probabilities contract the same cache's latent columns over the same rows, and the result is
#     optionally de-absorbed by a contraction with W_vc over the latent.
# So einsum, bmm, matmul or `@`; heads before or after batch; the cache as one tensor or as latent +
# rope tensors, dense, paged or gathered; the query as one tensor or two; a scale anywhere on the scores;
# the mask by masked_fill, where or an additive bias: all are one match. A candidate that anchors but
# fails a condition is recorded with the reason (explain()).


@dataclasses.dataclass
class _CacheRead:
    """Rows of a latent cache read by a score or value contraction."""

    cache: torch.fx.Node  # dense [batch, rows, columns]; or paged [blocks, block_size, columns]
    tables: Optional[torch.fx.Node]  # block table [batch, blocks] or per-token index [batch, rows]
    rows: contraction.Size
    start: int  # the first column read
    columns: int


def _same_rows(a: _CacheRead, b: _CacheRead) -> bool:
    return a.tables is b.tables and same(a.rows, b.rows)


def _cache_read(operand: contraction.Operand, roles: dict) -> _CacheRead:
    """The cache behind `operand`, whose factors carry `roles` (request / rows / columns) by axis."""
    aten = torch.ops.aten
    origin, layout = operand.origin, operand.layout
    by_role = {}
    for factor, role in roles.items():
        by_role.setdefault(role, []).append(factor)
    columns = by_role.get("columns", [])
    if len(columns) != 1 or columns[0].stride != 1:
        raise Decline("the contracted columns are not one run of the cache's last dim")
    (col,) = columns
    if not isinstance(col.size, int) or not isinstance(layout.offsets.get(col.label, 0), int):
        raise Decline("the columns read from the cache are dynamic")
    rank = origin.meta["val"].dim()
    if col.label != rank - 1:
        raise Decline("the contraction does not run over the cache's last dim")
    start = layout.offsets.get(col.label, 0)
    request = by_role.get("request", [])
    if node_is(origin, aten.index.Tensor):
        indices = origin.args[1]
        if len(indices) != 1 or indices[0] is None or indices[0].meta["val"].dim() != 2:
            raise Decline("the cache is gathered by something other than one 2-D index on its first dim")
        cache, tables = origin.args[0], indices[0]
        # gathered dims: 0 request, 1 table column, then the cache's own dims after its first
        expected_rows = [(1, tables.meta["val"].shape[1])] + ([(2, cache.meta["val"].shape[1])]
                                                              if cache.meta["val"].dim() == 3 else [])
    else:
        cache, tables = origin, None
        if rank != 3:
            raise Decline(f"the cache read is {rank}-D, not [batch, rows, columns]")
        expected_rows = [(1, None)]
    # a dim of one row (a block size of 1, a table of one block) has no factor: it is read whole anyway
    expected_rows = [(lab, size) for lab, size in expected_rows if size is None or not same(size, 1)]
    rows = by_role.get("rows", [])
    if [f.label for f in rows] != [lab for lab, _ in expected_rows] or any(not same(f.stride, 1) for f in rows):
        raise Decline("the rows reduced over are not the cache's rows in order")
    for f, (lab, size) in zip(rows, expected_rows):
        if not same(layout.offsets.get(lab, 0), 0) or (size is not None and not same(f.size, size)):
            raise Decline("the rows read do not start at the first row of each request")
    # a batch of one (Dynamo specializes it): no request axis, the request read is where dim 0 starts
    if request and (len(request) != 1 or request[0].label != 0 or not same(request[0].stride, 1)):
        raise Decline("the cache's requests are not read in order from the first")
    if not same(layout.offsets.get(0, 0), 0):
        raise Decline("the cache's requests are not read in order from the first")
    return _CacheRead(cache, tables, math.prod(f.size for f in rows), start, col.size)


@dataclasses.dataclass
class _Term:
    """One score contraction: q (one role per axis) against cache rows."""

    contraction: contraction.Contraction
    query_is_a: bool
    axis_role: dict  # axis -> request / head / rows / feature
    cache: _CacheRead
    scores_roles: list  # per scores dim: [(role, size, stride)]


def _score_term(node: torch.fx.Node) -> _Term:
    c = contraction.Contraction.of(contraction.trace_back(node).origin)
    at, layout = c.node, c.output_layout()
    while at is not node:  # the layout ops from the bmm to the term
        if len(at.users) != 1:
            raise Decline(f"{c.node.name}'s result is used before the softmax")
        (at,) = at.users
        layout = contraction.apply(layout, at)
    last = layout.dims[-1]
    if last and all(f.label[0] == "n" for f in last):
        query_is_a = True
    elif last and all(f.label[0] == "m" for f in last):
        query_is_a = False
    else:
        raise Decline("the softmax runs over a dim that is not all cache rows")
    axis_role, cache_roles = {}, {}
    for axis, (fa, fb, _) in c.axes.items():
        fq, fc = (fa, fb) if query_is_a else (fb, fa)
        kind = axis[0]
        if kind == "k":
            axis_role[axis], cache_roles[fc] = "feature", "columns"
        elif kind == "batch":
            if fc.label is None:  # the cache broadcast over this axis: heads in the bmm's batch
                axis_role[axis] = "head"
            else:
                axis_role[axis], cache_roles[fc] = "request", "request"
        elif (kind == "n") == query_is_a:  # free in the cache operand
            axis_role[axis], cache_roles[fc] = "rows", "rows"
        else:
            axis_role[axis] = "head"
    if [f.label for f in last] != [a for a in c.axes if axis_role[a] == "rows"]:
        raise Decline("the softmax dim does not hold every cache row")
    heads = [a for a in c.axes if axis_role[a] == "head"]
    if len(heads) > 1:
        raise Decline("the queries have more than one row per request and head (prefill?)")
    cache = _cache_read(c.b if query_is_a else c.a, cache_roles)
    return _Term(c, query_is_a, axis_role, cache, axis_roles(layout, axis_role))


@dataclasses.dataclass
class _Candidate:
    terms: list
    logits: Logits
    probs: torch.fx.Node
    value: contraction.Contraction
    value_roles: dict
    w_vc: Optional[contraction.Contraction]
    w_roles: Optional[dict]
    result: torch.fx.Node
    result_roles: list  # per result dim: [(role, size, stride)]


def _find_candidate(div: torch.fx.Node) -> Optional[_Candidate]:
    logits_node = logits_of_softmax(div)
    found = next_contraction(div) if logits_node is not None else None
    if found is None:
        return None  # no softmax, or probabilities no contraction reads (a MoE router's): not attention
    sinks_beside = scores_beside_sinks(logits_node)
    try:
        logits = read_logits(sinks_beside or logits_node)
    except contraction.Unsupported:
        return None  # a softmax over something other than scores: not a candidate at all
    try:
        if not _values_from_the_scores_cache(logits, found[0]):
            return None
        if sinks_beside is not None:
            raise Decline(SINKS)
        terms = [_score_term(t) for t in logits.terms]
    except contraction.Unsupported:
        return None
    # From here on the softmax reads contractions of queries with cache rows: near misses are reported.
    if not 1 <= len(terms) <= 2:
        raise Decline(f"the scores sum {len(terms)} contractions")
    roles = terms[0].scores_roles
    if any(t.scores_roles != roles for t in terms[1:]):
        raise Decline("the score contractions are added with different layouts")
    if any(not _same_rows(t.cache, terms[0].cache) for t in terms[1:]):
        raise Decline("the score contractions read different rows")
    value, probs_is_a = found
    value_roles = roles_of_contraction(value, probs_is_a, roles, "latent", "head")
    cache_roles = {}
    for axis, (fa, fb, _) in value.axes.items():
        f = fb if probs_is_a else fa
        if f is not None and f.label is not None:
            cache_roles[f] = {"rows": "rows", "request": "request", "latent": "columns"}.get(value_roles[axis], "?")
    summed_rows = all((axis[0] == "k") == (role == "rows") for axis, role in value_roles.items())
    if "?" in cache_roles.values() or not summed_rows:
        raise Decline("P.V does not contract the probabilities' rows with the cache rows")
    vread = _cache_read(value.b if probs_is_a else value.a, cache_roles)
    latent_term = next((t for t in terms if t.cache.start == 0 and t.cache.cache is vread.cache), None)
    if latent_term is None or vread.start != 0:
        raise Decline("P.V does not read the latent columns the scores read")
    # one score contraction reads the latent and rope columns, two read them apart
    if vread.columns > latent_term.cache.columns or (len(terms) == 2 and vread.columns != latent_term.cache.columns):
        raise Decline("P.V does not read the latent columns the scores read")
    if not _same_rows(vread, latent_term.cache):
        raise Decline("P.V reads other rows than the scores")
    end, layout, _ = value.result()
    latent_roles = axis_roles(layout, value_roles)
    w_vc, w_roles = None, None
    after = next_contraction(value.node)
    if after is not None:
        c, o_is_a = after
        out_roles = axis_roles(value.output_layout(), value_roles)
        candidate_roles = roles_of_contraction(c, o_is_a, out_roles, "value", "request")
        contracted = {candidate_roles[a] for a in c.axes if a[0] == "k"}
        w = c.b if o_is_a else c.a
        # W_vc: one matrix per head (a weight shared by the heads stays the model's own product)
        per_head = any(role == "head" and c.axes[a][1 if o_is_a else 0] is not None
                       and c.axes[a][1 if o_is_a else 0].label is not None for a, role in candidate_roles.items())
        if contracted == {"latent"} and per_head and not _reads_cache(w, terms):
            w_vc, w_roles = c, candidate_roles
            end, layout, _ = c.result()
            latent_roles = axis_roles(layout, w_roles)
    return _Candidate(terms, logits, div, value, value_roles, w_vc, w_roles, end, latent_roles)


def _values_from_the_scores_cache(logits: Logits, value: contraction.Contraction) -> bool:
    """Whether P.V reads a tensor the scores read: latent attention takes its values from the cache its
    keys are in (the latent columns). Values of their own are grouped-query or multi-head attention,
    which gqa_decode's anchored match reads."""
    read = set()
    for term in logits.terms:
        c = contraction.Contraction.of(contraction.trace_back(term).origin)
        read |= {c.a.origin, c.b.origin}
    return value.a.origin in read or value.b.origin in read


def _reads_cache(operand: contraction.Operand, terms) -> bool:
    return any(operand.origin is t.cache.cache or operand.origin is t.contraction.b.origin for t in terms)


def _cache_argument(emit: Emitter, read: _CacheRead, batch: int) -> torch.fx.Node:
    """The cache as the op reads it: paged [blocks, block_size, columns] (a per-token index: block size 1),
    or a dense cache's first `batch` requests as one block each."""
    aten = torch.ops.aten
    cache = read.cache
    if read.tables is not None:
        return cache if cache.meta["val"].dim() == 3 else emit(aten.unsqueeze.default, cache, 1)
    if same(contraction.shape(cache)[0], batch):
        return cache
    return emit(aten.slice.Tensor, cache, 0, 0, batch)


def _rewrite(graph: torch.fx.Graph, cand: _Candidate) -> None:
    aten = torch.ops.aten
    latent = next(t for t in cand.terms if t.cache.start == 0)
    rope = next((t for t in cand.terms if t is not latent), None)
    lat_read = latent.cache
    dtype = lat_read.cache.meta["val"].dtype
    sizes = {"request": 1, "head": 1}
    for t in cand.terms:
        for axis, role in t.axis_role.items():
            if role in sizes:
                sizes[role] = t.contraction.axes[axis][2]
    batch, heads = sizes["request"], sizes["head"]
    columns = contraction.shape(lat_read.cache)[-1]
    emit = Emitter(graph, cand.result, like=cand.probs)
    if rope is None:
        if (lat_read.start, lat_read.columns) != (0, columns):
            raise Decline("the scores read part of the cache row only")
        kv_lora_rank, rope_cache = _latent_columns(cand), None
    elif rope.cache.cache is lat_read.cache:
        if rope.cache.start != lat_read.columns or lat_read.columns + rope.cache.columns != columns:
            raise Decline("the rope columns do not follow the latent ones to the end of the cache row")
        kv_lora_rank, rope_cache = lat_read.columns, None
    else:
        if lat_read.columns != columns or (rope.cache.start, rope.cache.columns) != (0, contraction.shape(rope.cache.cache)[-1]):
            raise Decline("the latent and rope caches are not read whole")
        rope_rows, lat_rows = contraction.shape(rope.cache.cache)[:-1], contraction.shape(lat_read.cache)[:-1]
        if (rope.cache.tables is None) != (lat_read.tables is None) or len(rope_rows) != len(lat_rows) or not all(
                same(a, b) for a, b in zip(rope_rows, lat_rows)):
            raise Decline("the latent and rope caches are not laid out alike")
        kv_lora_rank, rope_cache = lat_read.columns, _cache_argument(emit, rope.cache, batch)

    queries = []
    for t in (latent, rope) if rope is not None else (latent,):
        q = operand_in_role_order(emit, t.contraction, t.query_is_a, t.axis_role, ("request", "head", "feature"),
                                  dict(sizes, feature=t.cache.columns))
        queries.append(emit.cast(q, dtype))
    q = queries[0] if len(queries) == 1 else emit(aten.cat.default, queries, -1)

    kv = _cache_argument(emit, lat_read, batch)
    if lat_read.tables is None:
        requests = emit(torch.ops.prims.iota.default, batch, start=0, step=1, dtype=torch.int64,
                        device=lat_read.cache.meta["val"].device, requires_grad=False)
        tables = emit(aten.reshape.default, requests, [batch, 1])
    else:
        tables = lat_read.tables
    lens = emit(aten.full.default, [batch], lat_read.rows, dtype=torch.int64,
                device=lat_read.cache.meta["val"].device, pin_memory=False)
    mask = mask_argument(emit, cand.logits,
                         lambda m: as_rows_mask(emit, latent.scores_roles, m, batch, lat_read.rows))

    w_vc = None
    if cand.w_vc is not None:
        c = cand.w_vc
        w_is_a = c.b.origin is cand.value.node
        v_sizes = {"head": heads, "value": next(s for a, (_, _, s) in c.axes.items() if cand.w_roles[a] == "value"),
                   "latent": kv_lora_rank}
        w_vc = emit.cast(operand_in_role_order(emit, c, w_is_a, cand.w_roles, ("head", "value", "latent"),
                                               dict(sizes, **v_sizes)), dtype)
        out_order, out_sizes = ("request", "head", "value"), dict(sizes, value=v_sizes["value"])
    else:
        out_order, out_sizes = ("request", "head", "latent"), dict(sizes, latent=kv_lora_rank)
    scale, scale_tensor = cand.logits.scale, None
    if cand.logits.scale_tensors:  # the op's scale_tensor overrides its scale: it carries both
        device = cand.logits.scale_tensors[0][0].meta["val"].device
        scale = emit(aten.full.default, [], scale, dtype=torch.float64, device=device, pin_memory=False)
        scale_tensor, scale = scale_by_tensors(emit, scale, cand.logits), 1.0
    try:
        out = emit(torch.ops.mla.latent_decode_attention.default, q, kv, tables, lens, kv_lora_rank,
                   scale, cand.logits.softcap, None, None, w_vc, scale_tensor, rope_cache, mask)
    except ValueError as error:
        raise Decline(str(error).removeprefix("mla::latent_decode_attention: ")) from error
    cand.result.replace_all_uses_with(from_role_order(emit, out, out_order, out_sizes, cand.result, cand.result_roles))


def _latent_columns(cand: _Candidate) -> int:
    return next(s for a, (_, _, s) in cand.value.axes.items() if cand.value_roles[a] == "latent")


def rewrite_latent_attention(graph: torch.fx.Graph, div: torch.fx.Node) -> bool:
    """The anchored match (see above) on a softmax that may read latent attention scores."""
    cand = _find_candidate(div)
    if cand is None:
        return False
    _rewrite(graph, cand)
    return True
