"""Lowering of mla::latent_decode_attention to the flash-decoding template."""

from __future__ import annotations

from typing import Optional

import torch
from torch._inductor import ir
from torch._inductor import lowering as L
from torch._inductor.virtualized import V

from ..ops.checks import FP8_CACHE_DTYPES
from .template import FusedOpTemplate, guard_ints, realize_input, row_scale_strides, templates_serve

OP = torch.ops.mla.latent_decode_attention.default
aten = torch.ops.aten
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# What latent_attention.h's kernels need: this template's and gqa_decode's.
ATTENTION_HEADERS = ("widen.h", "amx_tiles.h", "latent_attention.h")


class LatentDecodeAttentionTemplate(FusedOpTemplate):
    template_file = "latent_decode_attention.cpp.j2"
    output = "OUT"

    def __init__(self, inputs: dict, layout: ir.Layout, dims: dict, scale: float, softcap: float) -> None:
        super().__init__("mla_latent_decode_attention", inputs, layout)
        self.dims = dims  # the compile-time sizes: H, D1, D2, L, OUT_DIM
        self.scale, self.softcap = scale, softcap

    def headers(self) -> tuple[str, ...]:
        return ATTENTION_HEADERS

    def options(self, kernel) -> dict:
        q, kv, tables, seq_lens, w_vc, mask = (self.inputs[k] for k in ("Q", "KV", "BT", "SL", "WVC", "MASK"))
        shared_mask = mask is not None and V.graph.sizevars.statically_known_equals(mask.get_size()[0], 1)
        kv_scale = self.inputs["KV_SCALE"]
        return dict(
            # the fp8 cache's scales: (strides per block and per row, origin)
            kv_scale_layout=None if kv_scale is None else row_scale_strides(kernel, kv_scale, rows_dims=2),
            **self.dims,
            BLOCK_SIZE=kernel.size(kv, 1),
            BATCH=kernel.size(q, 0),
            NUM_BLOCKS=kernel.size(kv, 0),
            MAX_BLOCKS=kernel.size(tables, 1),
            q_stride_b=kernel.stride(q, 0),
            q_stride_h=kernel.stride(q, 1),
            table_stride=kernel.stride(tables, 0),
            seq_len_stride=kernel.stride(seq_lens, 0),
            w_stride_h=kernel.stride(w_vc, 0) if w_vc is not None else None,
            w_stride_n=kernel.stride(w_vc, 1) if w_vc is not None else None,
            mask_stride_b=0 if mask is None or shared_mask else kernel.stride(mask, 0),
            scale=f"{float(self.scale)!r}f",
            softcap=f"{float(self.softcap)!r}f",
        )


def _compile_time_dims(q, kv_cache, rope_cache, w_vc, kv_lora_rank) -> Optional[dict]:
    """Heads and row widths shape the kernel's tiles and scratch: compile-time constants (guard_ints)."""
    sizes = dict(
        H=q.get_size()[1],
        D1=kv_cache.get_size()[2],
        D2=rope_cache.get_size()[2] if rope_cache is not None else 0,
        L=kv_lora_rank,
        OUT_DIM=w_vc.get_size()[1] if w_vc is not None else kv_lora_rank,
    )
    return guard_ints(sizes)


def _template_can_serve(q, kv_cache, block_tables, seq_lens) -> bool:
    if not templates_serve(q):
        return False
    if q.get_dtype() not in SUPPORTED_DTYPES or kv_cache.get_dtype() not in (q.get_dtype(), *FP8_CACHE_DTYPES):
        return False
    return block_tables.get_dtype() in (torch.int32, torch.int64) and seq_lens.get_dtype() in (torch.int32, torch.int64)


def _write_new_rows(kv_cache, new_rows, slots):
    """kv_cache[slots // block_size, slots % block_size] = new_rows, as Inductor's own scatter (it tracks
    the mutation, so the template below reads the cache after the write)."""
    block_size = kv_cache.get_size()[1]
    block = L.lowerings[aten.div.Tensor_mode](slots, block_size, rounding_mode="floor")
    offset = L.lowerings[aten.remainder.Scalar](slots, block_size)
    L.lowerings[aten.index_put_](kv_cache, [block, offset], new_rows)


@L.register_lowering(OP, type_promotion_kind=None)
def lower_latent_decode_attention(q, kv_cache, block_tables, seq_lens, kv_lora_rank, scale, softcap=0.0,
                                  new_rows=None, slots=None, w_vc=None, scale_tensor=None, rope_cache=None,
                                  attn_mask=None, kv_scale=None):
    args = (q, kv_cache, block_tables, seq_lens, kv_lora_rank, scale, softcap, new_rows, slots, w_vc, scale_tensor,
            rope_cache, attn_mask, kv_scale)
    dims = _template_can_serve(q, kv_cache, block_tables, seq_lens) and _compile_time_dims(
        q, kv_cache, rope_cache, w_vc, kv_lora_rank
    )
    if not dims:
        return L.fallback_handler(OP, add_to_fallback_set=False)(*args)
    if new_rows is not None:
        _write_new_rows(kv_cache, new_rows, slots)

    inputs = {
        "Q": realize_input(q),
        "KV": realize_input(kv_cache, contiguous=True),
        "ROPE": realize_input(rope_cache, contiguous=True),
        "BT": realize_input(block_tables),
        "SL": realize_input(seq_lens),
        "WVC": realize_input(w_vc),
        "SCALE": realize_input(scale_tensor),
        "MASK": realize_input(attn_mask),
        "KV_SCALE": realize_input(kv_scale),
    }
    layout = ir.FixedLayout(q.get_device(), q.get_dtype(), [q.get_size()[0], dims["H"], dims["OUT_DIM"]])
    return LatentDecodeAttentionTemplate(inputs, layout, dims, scale, softcap).select()
