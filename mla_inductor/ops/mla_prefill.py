"""mla::prefill_attention: causal attention of many query rows, q/k head size != v head size allowed.

    out[b, h] = softmax(scale * q[b, h] . k[b, h // G]^T (+ mask)) . v[b, h // G]

for query [B, heads, Tq, D], key [B, kv_heads, Tk, D] and value [B, kv_heads, Tk, DV] (G = heads /
kv_heads query heads per key/value head, read without repeating k and v). DV may differ from D: MLA's
prefill has D = 192 (nope + rope) and DV = 128, which ATen's CPU flash attention does not take (it
needs one head size), so SDPA runs its math path there, the whole [B, heads, Tq, Tk] score tensor in
memory.

- `is_causal`: the query rows are the last Tq of the Tk key rows (a cached prefix before them, Tk - Tq
  rows, which every query row sees): query row i admits key row j <= i + Tk - Tq. (SDPA's own is_causal
  aligns the first rows instead; the two agree where Tq == Tk.)
- `attn_mask`: None, bool (True: the key row takes part) or additive (a float dtype), broadcast against
  [B, heads, Tq, Tk]; with `is_causal` both apply.
- `softcap` > 0 caps the scaled scores as softcap * tanh(score / softcap), before the mask.
A query row that no key row admits gets zeros, as SDPA's math path gives.

The eager implementation is the reference: fp32 scores, softmax and products, query rows a block at a
time (memory O(block * Tk), not O(Tq * Tk)), the output rounded once. Under torch.compile the op
becomes a flash-attention template (lowerings/mla_prefill.py) that skips the key tiles the mask and the
causal order exclude.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .checks import check_cpu_tensors

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Query rows per block of the eager reference: its fp32 scores are heads x block x Tk.
_REFERENCE_BLOCK = 256


def _fail(message: str) -> None:
    raise ValueError(f"mla::prefill_attention: {message}")


def check_args(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
               softcap: float = 0.0) -> None:
    check_cpu_tensors(_fail, dict(query=query, key=key, value=value))
    if query.dtype not in SUPPORTED_DTYPES:
        _fail(f"query has dtype {query.dtype}; supported: bfloat16, float16, float32")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        _fail(f"key and value must be {query.dtype} like query, got {key.dtype} and {value.dtype}")
    if query.dim() != 4:
        _fail(f"query must be [batch, heads, query_rows, head_dim], got {list(query.shape)}")
    batch, heads, rows, head_dim = query.shape
    if key.dim() != 4 or key.shape[0] != batch or key.shape[-1] != head_dim:
        _fail(f"key must be [{batch}, kv_heads, key_rows, {head_dim}] to match query, got {list(key.shape)}")
    kv_heads, key_rows = key.shape[1], key.shape[2]
    if kv_heads == 0 or heads % kv_heads != 0:
        _fail(f"query's {heads} heads are not a multiple of key's {kv_heads} key/value heads")
    if value.dim() != 4 or list(value.shape[:3]) != [batch, kv_heads, key_rows]:
        _fail(f"value must be [{batch}, {kv_heads}, {key_rows}, v_head_dim] to match key, got {list(value.shape)}")
    if key_rows < rows:
        _fail(f"key has {key_rows} rows, fewer than query's {rows}: the query rows are the last key rows")
    if attn_mask is not None:
        check_cpu_tensors(_fail, dict(attn_mask=attn_mask))
        if attn_mask.dtype != torch.bool and attn_mask.dtype not in SUPPORTED_DTYPES:
            _fail(f"attn_mask must be bool or a float dtype, got {attn_mask.dtype}")
        full = [batch, heads, rows, key_rows]
        aligned = full[4 - attn_mask.dim():] if attn_mask.dim() else []
        if attn_mask.dim() > 4 or any(m not in (1, f) for m, f in zip(attn_mask.shape, aligned)):
            _fail(f"attn_mask must broadcast against {full}, got {list(attn_mask.shape)}")
    if not softcap >= 0:
        _fail(f"softcap must be >= 0 (0: none), got {softcap}")


def as_4d(attn_mask: Tensor) -> Tensor:
    return attn_mask.view([1] * (4 - attn_mask.dim()) + list(attn_mask.shape))


def _block_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], diagonal: Optional[int], scale: float,
                     softcap: float) -> Tensor:
    """fp32 attention of a block of query rows, k and v per query head; with `diagonal`, the block's
    query row m admits key rows j <= m + diagonal only."""
    scores = q.float() @ k.float().transpose(-1, -2) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    if diagonal is not None:
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool).tril(diagonal)
        scores = scores.masked_fill(~causal, float("-inf"))
    admitted = scores.amax(-1, keepdim=True) != float("-inf")  # a row nothing admits gets zeros
    probs = torch.where(admitted, scores, 0).softmax(-1) * admitted
    return probs @ v.float()


@torch.library.custom_op("mla::prefill_attention", mutates_args=())
def prefill_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                      is_causal: bool = False, scale: Optional[float] = None, softcap: float = 0.0) -> Tensor:
    check_args(query, key, value, attn_mask, softcap)
    batch, heads, rows, head_dim = query.shape
    kv_heads, key_rows = key.shape[1], key.shape[2]
    scale = head_dim ** -0.5 if scale is None else scale
    group = heads // kv_heads
    k = key.repeat_interleave(group, dim=1) if group > 1 else key
    v = value.repeat_interleave(group, dim=1) if group > 1 else value
    mask = as_4d(attn_mask) if attn_mask is not None else None
    out = query.new_empty(batch, heads, rows, value.shape[-1])
    for r0 in range(0, rows, _REFERENCE_BLOCK):
        r1 = min(rows, r0 + _REFERENCE_BLOCK)
        block_mask = mask[:, :, r0:r1] if mask is not None and mask.shape[2] != 1 else mask
        diagonal = r0 + key_rows - rows if is_causal else None
        out[:, :, r0:r1] = _block_attention(query[:, :, r0:r1], k, v, block_mask, diagonal, scale, softcap)
    return out


@prefill_attention.register_fake
def _(query, key, value, attn_mask=None, is_causal=False, scale=None, softcap=0.0):
    check_args(query, key, value, attn_mask, softcap)
    return query.new_empty(query.shape[0], query.shape[1], query.shape[2], value.shape[-1])
