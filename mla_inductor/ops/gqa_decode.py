"""mla::gqa_decode_attention: grouped-query attention of one query row over a dense KV cache.

    out = F.scaled_dot_product_attention(query, key, value, attn_mask, scale=scale, enable_gqa=True)

for query [B, heads, 1, d], key [B, kv_heads, T, d] and value [B, kv_heads, T, dv] (heads a multiple
of kv_heads; query head h reads key/value head h // (heads / kv_heads)) and a mask shared by the heads:
None, bool (True: the row takes part) or additive, of shape [B or 1, 1, 1, T] (or fewer leading dims).
A query that no row admits gets zeros, as ATen's CPU attention gives.

What serving kernels add to that (SGLang's and vLLM's CPU decode attention):
- `softcap` > 0 caps the scaled scores as softcap * tanh(score / softcap) (Gemma-2's logit softcap,
  SGLang's `logit_cap`), before the mask's bias is added.
- `sliding_window` W > 0 admits only the last W rows up to the query's own, which is the last row the
  mask admits (the last row without a mask): rows j >= end - W. `window_block` rounds that first row
  down to a multiple of itself: vLLM's CPU paged decode drops only whole blocks (its block size).
- An fp8 cache: key and value in float8_e4m3fn or float8_e5m2 (the query stays bf16/fp16/fp32), read as
  key.float() * k_scale and value.float() * v_scale; a scale is None (1) or fp32, broadcast against the
  rows (last dim 1): per tensor, per token [B or 1, 1, T, 1], per head and token.

The eager implementation is ATen's SDPA on the packed query, [B, kv_heads, heads / kv_heads, d], which
reads each key/value row once for all the heads of its group (fp32 scores written out for a softcap or
an fp8 cache, which SDPA does not take); under torch.compile the op becomes a flash-decoding template
(lowerings/gqa_decode.py) that also skips the blocks of rows the mask or the window excludes.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .checks import FP8_CACHE_DTYPES, check_cache_scale, check_cpu_tensors

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _fail(message: str) -> None:
    raise ValueError(f"mla::gqa_decode_attention: {message}")


def check_args(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor], softcap: float = 0.0,
               sliding_window: int = 0, window_block: int = 1, k_scale: Optional[Tensor] = None,
               v_scale: Optional[Tensor] = None) -> None:
    check_cpu_tensors(_fail, dict(query=query, key=key, value=value))
    if query.dtype not in SUPPORTED_DTYPES:
        _fail(f"query has dtype {query.dtype}; supported: bfloat16, float16, float32")
    if value.dtype != key.dtype or key.dtype not in (query.dtype, *FP8_CACHE_DTYPES):
        _fail(f"key and value must be {query.dtype} like query, or both one fp8 dtype (float8_e4m3fn, "
              f"float8_e5m2), got {key.dtype} and {value.dtype}")
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
    if not softcap >= 0:
        _fail(f"softcap must be >= 0 (0: none), got {softcap}")
    if sliding_window < 0:
        _fail(f"sliding_window must be >= 0 (0: none), got {sliding_window}")
    if window_block < 1:
        _fail(f"window_block must be >= 1, got {window_block}")
    check_cache_scale(_fail, "k_scale", k_scale, key, "key")
    check_cache_scale(_fail, "v_scale", v_scale, value, "value")


def _as_4d(attn_mask: Tensor) -> Tensor:
    return attn_mask.view([1] * (4 - attn_mask.dim()) + list(attn_mask.shape))


def _with_window(attn_mask: Optional[Tensor], rows: int, sliding_window: int, window_block: int) -> Optional[Tensor]:
    """attn_mask that also excludes the rows before the sliding window, as a [B or 1, 1, 1, T] mask."""
    if sliding_window == 0:
        return attn_mask
    if attn_mask is None:
        ends = torch.tensor([rows])
    else:
        attn_mask = _as_4d(attn_mask)
        admitted = (attn_mask if attn_mask.dtype == torch.bool else attn_mask != float("-inf"))[:, 0, 0]
        ends = torch.where(admitted.any(-1), rows - admitted.flip(-1).int().argmax(-1), 0)
    begins = torch.where(ends > sliding_window, (ends - sliding_window) // window_block * window_block, 0)
    inside = (torch.arange(rows) >= begins[:, None])[:, None, None, :]
    if attn_mask is None or attn_mask.dtype == torch.bool:
        return inside if attn_mask is None else attn_mask & inside
    return attn_mask.masked_fill(~inside, float("-inf"))


def attention_fp32(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor], scale: float,
                   softcap: float) -> Tensor:
    """Scores, softmax and products in fp32 (key and value given as their values), written out:
    what SDPA cannot take (a softcap)."""
    batch, heads, _, head_dim = query.shape
    kv_heads = key.shape[1]
    q = query.float().reshape(batch, kv_heads, heads // kv_heads, head_dim)
    scores = q @ key.float().transpose(-1, -2) * scale  # [B, kv_heads, G, T]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if attn_mask is not None:
        attn_mask = _as_4d(attn_mask)
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    # a query no row admits gets zeros; a NaN score (a NaN in a key row) keeps its NaN, as in SDPA
    admitted = scores.amax(-1, keepdim=True) != float("-inf")
    probs = torch.where(admitted, scores, 0).softmax(-1) * admitted
    return (probs @ value.float()).reshape(batch, heads, 1, value.shape[-1]).to(query.dtype)


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
                         scale: Optional[float] = None, softcap: float = 0.0, sliding_window: int = 0,
                         window_block: int = 1, k_scale: Optional[Tensor] = None,
                         v_scale: Optional[Tensor] = None) -> Tensor:
    check_args(query, key, value, attn_mask, softcap, sliding_window, window_block, k_scale, v_scale)
    attn_mask = _with_window(attn_mask, key.shape[2], sliding_window, window_block)
    if key.dtype in FP8_CACHE_DTYPES:  # dequantized in fp32, as the template does in registers
        key = key.float() if k_scale is None else key.float() * k_scale
        value = value.float() if v_scale is None else value.float() * v_scale
    if softcap > 0 or key.dtype != query.dtype:
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        return attention_fp32(query, key, value, attn_mask, scale, softcap)
    return packed_attention(query, key, value, attn_mask, scale).contiguous()  # the layout the fake promises


@gqa_decode_attention.register_fake
def _(query, key, value, attn_mask=None, scale=None, softcap=0.0, sliding_window=0, window_block=1, k_scale=None,
      v_scale=None):
    check_args(query, key, value, attn_mask, softcap, sliding_window, window_block, k_scale, v_scale)
    return query.new_empty(query.shape[0], query.shape[1], 1, value.shape[-1])
