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

from .checks import FP8_CACHE_DTYPES, check_cache_scale, check_cpu_tensors

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Query rows per block of the eager reference: its fp32 scores are heads x block x Tk.
_REFERENCE_BLOCK = 256


def _fail(message: str) -> None:
    raise ValueError(f"mla::prefill_attention: {message}")


def check_args(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
               is_causal: bool = False, softcap: float = 0.0) -> None:
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
    if is_causal and key_rows < rows:
        _fail(f"key has {key_rows} rows, fewer than query's {rows}: causal query rows are the last key rows")
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
    check_args(query, key, value, attn_mask, is_causal, softcap)
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
    check_args(query, key, value, attn_mask, is_causal, softcap)
    return query.new_empty(query.shape[0], query.shape[1], query.shape[2], value.shape[-1])


# --- SGLang's extend attention ------------------------------------------------------------------------


def _extend_fail(message: str) -> None:
    raise ValueError(f"mla::extend_attention: {message}")


def check_extend_args(q_extend: Tensor, k_extend: Tensor, v_extend: Tensor, o_extend: Tensor, k_buffer: Tensor,
                      v_buffer: Tensor, k_scale: Optional[Tensor], v_scale: Optional[Tensor], req_to_token: Tensor,
                      req_pool_indices: Tensor, seq_lens: Tensor, extend_seq_lens: Tensor, extend_start_loc: Tensor,
                      logit_cap: float, encoder_lens: Optional[Tensor]) -> None:
    tensors = dict(q_extend=q_extend, k_extend=k_extend, v_extend=v_extend, o_extend=o_extend, k_buffer=k_buffer,
                   v_buffer=v_buffer, req_to_token=req_to_token, req_pool_indices=req_pool_indices,
                   seq_lens=seq_lens, extend_seq_lens=extend_seq_lens, extend_start_loc=extend_start_loc)
    check_cpu_tensors(_extend_fail, tensors)
    dtype = q_extend.dtype
    if dtype not in SUPPORTED_DTYPES:
        _extend_fail(f"q_extend has dtype {dtype}; supported: bfloat16, float16, float32")
    for name in ("k_extend", "v_extend", "o_extend"):
        if tensors[name].dtype != dtype:
            _extend_fail(f"{name} must be {dtype} like q_extend, got {tensors[name].dtype}")
    if k_buffer.dtype != v_buffer.dtype or k_buffer.dtype not in (dtype, *FP8_CACHE_DTYPES):
        _extend_fail(f"k_buffer and v_buffer must be {dtype} or one fp8 dtype, got {k_buffer.dtype} and {v_buffer.dtype}")
    for name, t in tensors.items():
        if name in ("req_to_token", "req_pool_indices", "seq_lens", "extend_seq_lens", "extend_start_loc"):
            if t.dtype not in (torch.int32, torch.int64):
                _extend_fail(f"{name} must be int32 or int64, got {t.dtype}")
        elif t.dim() != 3:
            _extend_fail(f"{name} must be [tokens, heads, head_dim], got {list(t.shape)}")
    tokens, heads, head_dim = q_extend.shape
    kv_heads, v_head_dim = k_extend.shape[1], v_extend.shape[2]
    if list(k_extend.shape) != [tokens, kv_heads, head_dim] or list(v_extend.shape[:2]) != [tokens, kv_heads]:
        _extend_fail(f"k_extend {list(k_extend.shape)} and v_extend {list(v_extend.shape)} do not match "
                     f"q_extend {list(q_extend.shape)}")
    if kv_heads == 0 or heads % kv_heads != 0:
        _extend_fail(f"q_extend's {heads} heads are not a multiple of k_extend's {kv_heads}")
    if list(o_extend.shape) != [tokens, heads, v_head_dim]:
        _extend_fail(f"o_extend must be [{tokens}, {heads}, {v_head_dim}], got {list(o_extend.shape)}")
    buffer_heads = k_buffer.shape[1]
    if k_buffer.shape[2] != head_dim or v_buffer.shape[2] != v_head_dim or v_buffer.shape[:2] != k_buffer.shape[:2]:
        _extend_fail(f"k_buffer {list(k_buffer.shape)} and v_buffer {list(v_buffer.shape)} must be "
                     f"[slots, heads, {head_dim}] and [slots, heads, {v_head_dim}]")
    if buffer_heads not in (1, kv_heads):
        _extend_fail(f"the buffers have {buffer_heads} heads: 1 (MLA's latent) or k_extend's {kv_heads}")
    if req_to_token.dim() != 2:
        _extend_fail(f"req_to_token must be [requests, max_tokens], got {list(req_to_token.shape)}")
    batch = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    for name in ("req_pool_indices", "seq_lens", "extend_seq_lens", "extend_start_loc"):
        if tensors[name].dim() != 1 or tensors[name].shape[0] != batch:
            _extend_fail(f"{name} must be [batch] like seq_lens, got {list(tensors[name].shape)}")
    if encoder_lens is not None and (encoder_lens.dim() != 1 or encoder_lens.shape[0] != batch):
        _extend_fail(f"encoder_lens must be [{batch}], got {list(encoder_lens.shape)}")
    check_cache_scale(_extend_fail, "k_scale", k_scale, k_buffer, "k_buffer")
    check_cache_scale(_extend_fail, "v_scale", v_scale, v_buffer, "v_buffer")
    if not logit_cap >= 0:
        _extend_fail(f"logit_cap must be >= 0 (0: none), got {logit_cap}")


def _buffer_rows(buffer: Tensor, scale: Optional[Tensor], slots: Tensor, dtype: torch.dtype) -> Tensor:
    """Rows `slots` of a cache buffer as [heads, rows, dim] in `dtype` (an fp8 buffer dequantized first)."""
    rows = buffer[slots]
    if rows.dtype in FP8_CACHE_DTYPES:
        rows = rows.float() if scale is None else rows.float() * scale.expand(buffer.shape[0], *scale.shape[1:])[slots]
    return rows.to(dtype).transpose(0, 1)


@torch.library.custom_op("mla::extend_attention", mutates_args=("o_extend",))
def extend_attention(q_extend: Tensor, k_extend: Tensor, v_extend: Tensor, o_extend: Tensor, k_buffer: Tensor,
                     v_buffer: Tensor, k_scale: Optional[Tensor], v_scale: Optional[Tensor], req_to_token: Tensor,
                     req_pool_indices: Tensor, seq_lens: Tensor, extend_seq_lens: Tensor,
                     extend_start_loc: Tensor, max_len_extend: int, sm_scale: float, logit_cap: float = 0.0,
                     is_cross_attn: bool = False, encoder_lens: Optional[Tensor] = None) -> None:
    check_extend_args(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, k_scale, v_scale, req_to_token,
                      req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc, logit_cap, encoder_lens)
    dtype = q_extend.dtype
    for i in range(seq_lens.shape[0]):
        start, new = int(extend_start_loc[i]), int(extend_seq_lens[i])
        length, encoder = int(seq_lens[i]), int(encoder_lens[i]) if encoder_lens is not None else 0
        if new == 0:
            continue
        if not 0 <= new <= length or start + new > q_extend.shape[0] or new > max_len_extend:
            _extend_fail(f"request {i}: {new} new tokens from row {start} of {length} does not fit q_extend's "
                         f"{q_extend.shape[0]} rows and max_len_extend {max_len_extend}")
        slots = req_to_token[int(req_pool_indices[i])]
        if is_cross_attn:  # the new tokens attend to the encoder's rows, all of them
            keys, values = (_buffer_rows(b, s, slots[:encoder].long(), dtype) for b, s in
                            ((k_buffer, k_scale), (v_buffer, v_scale)))
            causal = False
        else:  # the cached prefix from the buffers, then the new tokens' own rows, causal
            prefix = slots[encoder:encoder + length - new].long()
            keys, values = (
                torch.cat([_buffer_rows(b, s, prefix, dtype).expand(new_rows.shape[1], -1, -1),
                           new_rows[start:start + new].transpose(0, 1)], dim=1)
                for b, s, new_rows in ((k_buffer, k_scale, k_extend), (v_buffer, v_scale, v_extend)))
            causal = True
        query = q_extend[start:start + new].transpose(0, 1)[None]
        out = torch.ops.mla.prefill_attention(query, keys[None], values[None], None, causal, sm_scale, logit_cap)
        o_extend[start:start + new] = out[0].transpose(0, 1)


@extend_attention.register_fake
def _(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, k_scale, v_scale, req_to_token, req_pool_indices,
      seq_lens, extend_seq_lens, extend_start_loc, max_len_extend, sm_scale, logit_cap=0.0, is_cross_attn=False,
      encoder_lens=None):
    check_extend_args(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, k_scale, v_scale, req_to_token,
                      req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc, logit_cap, encoder_lens)
