"""mla::latent_decode_attention: absorbed MLA decode over a paged latent KV cache.

Every query head attends over cache rows K_j = c_kv_j ‖ k_pe_j ([kv_lora_rank + rope]) with
V_j = c_kv_j (the first kv_lora_rank columns of the same row). Serving engines keep the whole row in
one cache; transformers keeps c_kv and k_pe in two, which `rope_cache` (the k_pe rows, paged alike)
expresses without a copy:

    out[b, h] = softmax_j(scale · q[b, h] · K_j) · V_j          j < seq_lens[b]
    out[b, h] = out[b, h] · W_vc[h]^T                            if w_vc is given ([H, v_head_dim, L])

Row j of request b lives at kv_cache[block_tables[b, j // block_size], j % block_size]; a block
size of 1 is SGLang's per-token index layout, 16 vLLM's. When `new_rows` and `slots` are given,
the op first writes new_rows[b] into flat row slots[b] of the cache (the new token's latent row), so
the caller's separate cache write can be fused away. Rows at or past seq_lens[b] are never read.
A 0-d `scale_tensor` overrides `scale` (what a float module attribute becomes under dynamic=True).
The cache may be fp8 (float8_e4m3fn or float8_e5m2; rope_cache alike, q stays bf16/fp16/fp32), its rows
read as kv_cache.float() * kv_scale: None (1) or fp32, broadcast against the rows (last dim 1), per
tensor or per row [num_blocks, block_size, 1]; the k_pe rows of a rope_cache share their row's scale.
`attn_mask` [batch or 1, max_blocks * block_size] masks row j of request b by attn_mask[b, j]: a bool
admits the row where true, a float is added to its scores (after the softcap). A request whose rows
the mask all excludes, like one of length 0, returns zeros. Rows past the last one the mask admits are
never read; rows it excludes before that are (as by SDPA), so they must hold finite values.

The eager implementation is the reference: fp32 scores, softmax and accumulation, one rounding of
the output (after the W_vc de-absorption when present).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .checks import FP8_CACHE_DTYPES, check_cache_scale, check_cpu_tensors

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _fail(message: str) -> None:
    raise ValueError(f"mla::latent_decode_attention: {message}")


def check_args(q, kv_cache, block_tables, seq_lens, kv_lora_rank, softcap, new_rows, slots, w_vc,
               scale_tensor=None, rope_cache=None, attn_mask=None, kv_scale=None) -> None:
    if q.dtype not in SUPPORTED_DTYPES:
        _fail(f"q has dtype {q.dtype}; supported: bfloat16, float16, float32")
    if q.dim() != 3:
        _fail(f"q must be [batch, heads, kv_lora_rank + rope], got {list(q.shape)}")
    rope = 0 if rope_cache is None else rope_cache.shape[-1]
    if kv_cache.dim() != 3 or kv_cache.shape[-1] + rope != q.shape[-1]:
        _fail(
            f"kv_cache must be [num_blocks, block_size, {q.shape[-1] - rope}] to match q"
            f"{' and rope_cache' if rope_cache is not None else ''}, got {list(kv_cache.shape)}"
        )
    if rope_cache is not None:
        if rope_cache.dim() != 3 or rope_cache.shape[:2] != kv_cache.shape[:2] or rope_cache.dtype != kv_cache.dtype:
            _fail(
                f"rope_cache must be {kv_cache.dtype}[{kv_cache.shape[0]}, {kv_cache.shape[1]}, rope] like kv_cache, "
                f"got {rope_cache.dtype}{list(rope_cache.shape)}"
            )
        if not rope_cache.is_contiguous():
            _fail("rope_cache must be contiguous")
        if new_rows is not None:
            _fail("new_rows is not supported with a separate rope_cache")
    check_cpu_tensors(_fail, dict(q=q, kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens))
    if not kv_cache.is_contiguous():
        _fail("kv_cache must be contiguous (rows are addressed as block * block_size + offset)")
    if kv_cache.dtype not in (q.dtype, *FP8_CACHE_DTYPES):
        _fail(f"kv_cache has dtype {kv_cache.dtype}, expected q's dtype {q.dtype} or an fp8 dtype "
              "(float8_e4m3fn, float8_e5m2)")
    check_cache_scale(_fail, "kv_scale", kv_scale, kv_cache, "kv_cache")
    batch = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.is_floating_point():
        _fail(f"block_tables must be an integer [{batch}, max_blocks] tensor, got {block_tables.dtype}{list(block_tables.shape)}")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != batch or seq_lens.is_floating_point():
        _fail(f"seq_lens must be an integer [{batch}] tensor, got {seq_lens.dtype}{list(seq_lens.shape)}")
    if not 0 < kv_lora_rank <= kv_cache.shape[-1]:
        _fail(f"kv_lora_rank must be in (0, {kv_cache.shape[-1]}], got {kv_lora_rank}")
    if softcap < 0:
        _fail(f"softcap must be >= 0 (0 disables it), got {softcap}")
    if (new_rows is None) != (slots is None):
        _fail("new_rows and slots go together: give both or neither")
    if new_rows is not None:
        if kv_cache.dtype in FP8_CACHE_DTYPES:
            _fail("new_rows cannot be written into an fp8 kv_cache (its scale is the writer's choice): "
                  "quantize and write the row before the call")
        if tuple(new_rows.shape) != (batch, q.shape[-1]) or new_rows.dtype != q.dtype:
            _fail(f"new_rows must be {q.dtype}[{batch}, {q.shape[-1]}], got {new_rows.dtype}{list(new_rows.shape)}")
        if slots.dim() != 1 or slots.shape[0] != batch or slots.is_floating_point():
            _fail(f"slots must be an integer [{batch}] tensor, got {slots.dtype}{list(slots.shape)}")
    if scale_tensor is not None and (scale_tensor.dim() != 0 or not scale_tensor.is_floating_point()):
        _fail(f"scale_tensor must be a 0-d floating tensor, got {scale_tensor.dtype}{list(scale_tensor.shape)}")
    if w_vc is not None:
        if w_vc.dim() != 3 or w_vc.shape[0] != q.shape[1] or w_vc.shape[2] != kv_lora_rank or w_vc.dtype != q.dtype:
            _fail(
                f"w_vc must be {q.dtype}[{q.shape[1]}, v_head_dim, {kv_lora_rank}], got {w_vc.dtype}{list(w_vc.shape)}"
            )
    if attn_mask is not None:
        check_cpu_tensors(_fail, dict(attn_mask=attn_mask))
        rows = block_tables.shape[1] * kv_cache.shape[1]
        if attn_mask.dim() != 2 or attn_mask.shape[0] not in (1, batch) or attn_mask.shape[1] != rows:
            _fail(f"attn_mask must be [{batch} or 1, {rows}] (block_tables columns x block_size), "
                  f"got {list(attn_mask.shape)}")
        if attn_mask.dtype != torch.bool and attn_mask.dtype not in SUPPORTED_DTYPES:
            _fail(f"attn_mask must be bool or a float dtype, got {attn_mask.dtype}")


def _check_indices(kv_cache, block_tables, seq_lens, slots) -> None:
    """The data-dependent bounds: no read or write outside the cache."""
    num_blocks, block_size = kv_cache.shape[0], kv_cache.shape[1]
    capacity = block_tables.shape[1] * block_size
    if seq_lens.numel() and (seq_lens.min() < 0 or seq_lens.max() > capacity):
        _fail(f"seq_lens must be in [0, {capacity}] (block_tables columns x block_size), got {seq_lens.tolist()}")
    for b, length in enumerate(seq_lens.tolist()):
        used = block_tables[b, : -(-length // block_size)]
        if used.numel() and (used.min() < 0 or used.max() >= num_blocks):
            _fail(f"block_tables[{b}] names blocks outside [0, {num_blocks}): {used.tolist()}")
    if slots is not None and slots.numel() and (slots.min() < 0 or slots.max() >= num_blocks * block_size):
        _fail(f"slots must be in [0, {num_blocks * block_size}), got {slots.tolist()}")


@torch.library.custom_op("mla::latent_decode_attention", mutates_args=("kv_cache",))
def latent_decode_attention(
    q: Tensor,
    kv_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    kv_lora_rank: int,
    scale: float,
    softcap: float = 0.0,
    new_rows: Optional[Tensor] = None,
    slots: Optional[Tensor] = None,
    w_vc: Optional[Tensor] = None,
    scale_tensor: Optional[Tensor] = None,
    rope_cache: Optional[Tensor] = None,
    attn_mask: Optional[Tensor] = None,
    kv_scale: Optional[Tensor] = None,
) -> Tensor:
    check_args(q, kv_cache, block_tables, seq_lens, kv_lora_rank, softcap, new_rows, slots, w_vc, scale_tensor,
               rope_cache, attn_mask, kv_scale)
    _check_indices(kv_cache, block_tables, seq_lens, slots)
    if scale_tensor is not None:
        scale = float(scale_tensor)
    rows = kv_cache.view(-1, kv_cache.shape[-1])
    if new_rows is not None:
        rows[slots] = new_rows
    rope_rows = None if rope_cache is None else rope_cache.view(-1, rope_cache.shape[-1])
    row_scales = None if kv_scale is None else kv_scale.expand(*kv_cache.shape[:-1], 1).reshape(-1, 1)
    block_size = kv_cache.shape[1]
    batch, heads = q.shape[0], q.shape[1]
    out_dim = kv_lora_rank if w_vc is None else w_vc.shape[1]
    out = q.new_zeros(batch, heads, out_dim)  # a request with no rows attends to nothing: zeros
    for b, length in enumerate(seq_lens.tolist()):
        if attn_mask is not None:
            bias = attn_mask[b % attn_mask.shape[0], :length]
            if bias.dtype == torch.bool:
                bias = torch.zeros(length).masked_fill(~bias, float("-inf"))
            admitted = torch.nonzero(bias != float("-inf"))
            length = int(admitted[-1]) + 1 if admitted.numel() else 0  # rows past the last admitted one: unread
            bias = bias[:length].float()
        if length == 0:
            continue
        positions = torch.arange(length)
        index = block_tables[b, positions // block_size].long() * block_size + positions % block_size
        keys = rows[index] if rope_rows is None else torch.cat([rows[index], rope_rows[index]], dim=-1)
        keys = keys.float()  # only this request's rows: never a copy of the whole cache
        if row_scales is not None:
            keys = keys * row_scales[index]
        scores = (q[b].float() @ keys.T) * scale  # [heads, length]
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        if attn_mask is not None:
            scores = scores + bias
        latent = torch.softmax(scores, dim=-1) @ keys[:, :kv_lora_rank]  # [heads, kv_lora_rank]
        if w_vc is not None:
            latent = torch.bmm(latent.unsqueeze(1), w_vc.float().transpose(1, 2)).squeeze(1)
        out[b] = latent.to(q.dtype)
    return out


@latent_decode_attention.register_fake
def _(q, kv_cache, block_tables, seq_lens, kv_lora_rank, scale, softcap=0.0, new_rows=None, slots=None, w_vc=None,
      scale_tensor=None, rope_cache=None, attn_mask=None, kv_scale=None):
    check_args(q, kv_cache, block_tables, seq_lens, kv_lora_rank, softcap, new_rows, slots, w_vc, scale_tensor,
               rope_cache, attn_mask, kv_scale)
    return q.new_empty(q.shape[0], q.shape[1], kv_lora_rank if w_vc is None else w_vc.shape[1])


def latent_decode_attention_dense(
    q: Tensor,
    kv: Tensor,
    seq_lens: Tensor,
    kv_lora_rank: int,
    scale: float,
    softcap: float = 0.0,
    w_vc: Optional[Tensor] = None,
    scale_tensor: Optional[Tensor] = None,
    rope: Optional[Tensor] = None,
    attn_mask: Optional[Tensor] = None,
    kv_scale: Optional[Tensor] = None,
) -> Tensor:
    """The same attention over a dense cache kv [batch, max_len, kv_lora_rank + rope] (or kv_lora_rank
    columns, with the k_pe rows in `rope` [batch, max_len, rope]): one block per request, viewed as a
    paged cache without a copy. attn_mask is [batch or 1, max_len]; kv_scale, for an fp8 kv, broadcasts
    against [batch, max_len, 1]."""
    if kv.dim() != 3 or kv.shape[0] != q.shape[0]:
        _fail(f"kv must be [{q.shape[0]}, max_len, columns] for the dense form, got {list(kv.shape)}")
    block_tables = torch.arange(kv.shape[0], device=kv.device).view(-1, 1)
    return torch.ops.mla.latent_decode_attention(
        q, kv, block_tables, seq_lens, kv_lora_rank, scale, softcap,
        w_vc=w_vc, scale_tensor=scale_tensor, rope_cache=rope, attn_mask=attn_mask, kv_scale=kv_scale,
    )
