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
Both become `mla::gqa_decode_attention` (ops/gqa_decode.py), which reads each key/value row once for
all its query heads: a flash-decoding template that skips the blocks of rows the mask excludes (a
StaticCache's unfilled tail), or, where the template cannot serve, SDPA of the packed query.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch._inductor.pattern_matcher import Match
from torch.fx.operator_schemas import normalize_function
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..ops.gqa_decode import check_args
from .registry import node_value, register_fusion

FUSION = "gqa_decode"
_SCALE = 0.0625  # a magic value: the literal becomes the argument
_FLASH_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


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
    if value.shape[1] != kv_heads or heads == kv_heads or heads % kv_heads != 0:
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
