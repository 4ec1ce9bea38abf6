"""mla::gqa_decode_attention: grouped-query attention of one query row over a dense KV cache.

    out = F.scaled_dot_product_attention(query, key, value, attn_mask, scale=scale, enable_gqa=True)

for query [B, heads, 1, d], key [B, kv_heads, T, d] and value [B, kv_heads, T, dv] (heads a multiple
of kv_heads; query head h reads key/value head h // (heads / kv_heads)) and a mask shared by the heads:
None, bool (True: the row takes part) or additive, of shape [B or 1, 1, 1, T] (or fewer leading dims).
A query that no row admits gets zeros, as ATen's CPU attention gives.

The eager implementation is ATen's on the packed query, [B, kv_heads, heads / kv_heads, d], which reads
each key/value row once for all the heads of its group; under torch.compile the op becomes a
flash-decoding template (lowerings/gqa_decode.py) that also skips the blocks of rows the mask excludes.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .checks import check_cpu_tensors

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _fail(message: str) -> None:
    raise ValueError(f"mla::gqa_decode_attention: {message}")


def check_args(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor]) -> None:
    check_cpu_tensors(_fail, dict(query=query, key=key, value=value))
    if query.dtype not in SUPPORTED_DTYPES:
        _fail(f"query has dtype {query.dtype}; supported: bfloat16, float16, float32")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        _fail(f"key and value must be {query.dtype} like query, got {key.dtype} and {value.dtype}")
    if query.dim() != 4 or query.shape[2] != 1:
        _fail(f"query must be [batch, heads, 1, head_dim] (one query row), got {list(query.shape)}")
    batch, heads, _, head_dim = query.shape
    if key.dim() != 4 or key.shape[0] != batch or key.shape[-1] != head_dim:
        _fail(f"key must be [{batch}, kv_heads, rows, {head_dim}] to match query, got {list(key.shape)}")
    kv_heads, rows = key.shape[1], key.shape[2]
    if kv_heads == 0 or heads % kv_heads != 0:
        _fail(f"query's {heads} heads are not a multiple of key's {kv_heads} key/value heads")
    if value.dim() != 4 or list(value.shape[:3]) != [batch, kv_heads, rows]:
        _fail(f"value must be [{batch}, {kv_heads}, {rows}, v_head_dim] to match key, got {list(value.shape)}")
    if attn_mask is not None:
        check_cpu_tensors(_fail, dict(attn_mask=attn_mask))
        shape = [1] * (4 - attn_mask.dim()) + list(attn_mask.shape)
        if attn_mask.dim() > 4 or shape[0] not in (1, batch) or shape[1:] != [1, 1, rows]:
            _fail(f"attn_mask must be [{batch} or 1, 1, 1, {rows}], one mask for every head, "
                  f"got {list(attn_mask.shape)}")
        if attn_mask.dtype != torch.bool and attn_mask.dtype not in SUPPORTED_DTYPES:
            _fail(f"attn_mask must be bool or a float dtype, got {attn_mask.dtype}")


def packed_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor],
                     scale: Optional[float]) -> Tensor:
    """SDPA with each key/value head's query heads as the rows of one query."""
    batch, heads, _, head_dim = query.shape
    kv_heads = key.shape[1]
    rows = query.reshape(batch, kv_heads, heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=attn_mask, scale=scale)
    return out.reshape(batch, heads, 1, value.shape[-1])


@torch.library.custom_op("mla::gqa_decode_attention", mutates_args=())
def gqa_decode_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                         scale: Optional[float] = None) -> Tensor:
    check_args(query, key, value, attn_mask)
    return packed_attention(query, key, value, attn_mask, scale).contiguous()  # the layout the fake promises


@gqa_decode_attention.register_fake
def _(query, key, value, attn_mask=None, scale=None):
    check_args(query, key, value, attn_mask)
    return query.new_empty(query.shape[0], query.shape[1], 1, value.shape[-1])
