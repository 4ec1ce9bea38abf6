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
Both become SDPA of the packed query, which reads each key/value row once for all its query heads.
The attention stays ATen's CPU flash attention: the rewrite removes the copies, not the kernel.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
import torch.nn.functional as F
from torch._inductor.pattern_matcher import Match
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import node_value, register_fusion

FUSION = "gqa_decode"
_SCALE = 0.0625  # a magic value: the literal becomes the argument


def repeat_kv(x, n_rep):
    """transformers' repeat_kv: [B, kv_heads, T, d] -> [B, kv_heads * n_rep, T, d]."""
    batch, kv_heads, rows, head_dim = x.shape
    return x[:, :, None, :, :].expand(batch, kv_heads, n_rep, rows, head_dim).reshape(
        batch, kv_heads * n_rep, rows, head_dim
    )


# --- search functions: the model code ------------------------------------------------------------
# Each with and without a mask, and with and without an explicit scale (absent arguments trace as
# absent keywords, so each combination is a pattern of its own).


def repeated(query, key, value, mask, scale):
    n_rep = query.shape[1] // key.shape[1]
    return F.scaled_dot_product_attention(
        query, repeat_kv(key, n_rep), repeat_kv(value, n_rep), attn_mask=mask, scale=scale
    )


def repeated_unmasked(query, key, value, scale):
    return repeated(query, key, value, None, scale)


def repeated_unscaled(query, key, value, mask):
    return repeated(query, key, value, mask, None)


def repeated_plain(query, key, value):
    return repeated(query, key, value, None, None)


def grouped(query, key, value, mask, scale):
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=True)


def grouped_unmasked(query, key, value, scale):
    return grouped(query, key, value, None, scale)


def grouped_unscaled(query, key, value, mask):
    return grouped(query, key, value, mask, None)


def grouped_plain(query, key, value):
    return grouped(query, key, value, None, None)


# --- replacements ---------------------------------------------------------------------------------


def packed(query, key, value, mask, scale):
    batch, heads, _, head_dim = query.shape
    kv_heads = key.shape[1]
    rows = query.reshape(batch, kv_heads, heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scale)
    return out.reshape(batch, heads, 1, value.shape[-1])


def packed_unmasked(query, key, value, scale):
    return packed(query, key, value, None, scale)


def packed_unscaled(query, key, value, mask):
    return packed(query, key, value, mask, None)


def packed_plain(query, key, value):
    return packed(query, key, value, None, None)


# --- preconditions --------------------------------------------------------------------------------


def _unmatched_keyword(match: Match) -> Optional[str]:
    """The matcher ignores keywords of a graph node that its pattern does not name, so the pattern
    without a mask also matches attention with one: every keyword the form does not bind must hold
    its default value."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    attention = next(node for node in match.nodes if node.target == flash)
    bound = {"attn_mask": "mask", "scale": "scale"}
    defaults = {"dropout_p": 0.0, "is_causal": False, "attn_mask": None, "scale": None}
    for name, value in attention.kwargs.items():
        if bound.get(name) not in match.kwargs and value != defaults.get(name, value):
            return f"the attention has {name}={value}, which this form does not carry"
    return None


def check(match: Match) -> Optional[str]:
    unmatched = _unmatched_keyword(match)
    if unmatched:
        return unmatched
    kw = {name: node_value(arg) for name, arg in match.kwargs.items()}
    query, key, value, mask = kw["query"], kw["key"], kw["value"], kw.get("mask")
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
    return None


# --- registration ---------------------------------------------------------------------------------

_FORMS = (
    (repeated, grouped, packed),
    (repeated_unmasked, grouped_unmasked, packed_unmasked),
    (repeated_unscaled, grouped_unscaled, packed_unscaled),
    (repeated_plain, grouped_plain, packed_plain),
)


def _example_inputs(search_fn) -> list:
    """Small inputs with all sizes distinct (3 key/value heads of 2 query heads each), for the
    arguments `search_fn` takes."""
    batch, kv_heads, n_rep, rows, head_dim = 2, 3, 2, 7, 5
    inputs = {
        "query": torch.empty(batch, kv_heads * n_rep, 1, head_dim),
        "key": torch.empty(batch, kv_heads, rows, head_dim),
        "value": torch.empty(batch, kv_heads, rows, head_dim),
        # A float mask: transformers builds an additive one, and a bool mask's conversion to it traces
        # as a `where` in front of the pattern, which then binds as the mask.
        "mask": torch.empty(batch, 1, 1, rows),
        "scale": _SCALE,
    }
    return [inputs[name] for name in inspect.signature(search_fn).parameters]


def register() -> None:
    for repeated_fn, grouped_fn, replace_fn in _FORMS:
        for search_fn in (repeated_fn, grouped_fn):
            register_fusion(
                FUSION, search_fn, replace_fn, _example_inputs(search_fn), check, scalar_workaround={"scale": _SCALE}
            )
