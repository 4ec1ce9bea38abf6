"""Lowering of mla::latent_decode_attention to the flash-decoding template."""

from __future__ import annotations

import sympy
import torch
from torch._inductor import ir
from torch._inductor import lowering as L
from torch._inductor.codegen.cpp import get_export_declaration
from torch._inductor.codegen.cpp_template import CppTemplate
from torch._inductor.select_algorithm import autotune_select_algorithm
from torch._inductor.utils import parallel_num_threads

from .. import config as mla_config
from . import template_source

OP = torch.ops.mla.latent_decode_attention.default
aten = torch.ops.aten
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class LatentDecodeAttentionTemplate(CppTemplate):
    def __init__(self, inputs: dict, layout: ir.Layout, kv_lora_rank: int, scale: float, softcap: float) -> None:
        self.present_inputs = {k: v for k, v in inputs.items() if v is not None}
        super().__init__(
            "mla_latent_decode_attention", list(self.present_inputs.values()), layout, parallel_num_threads()
        )
        self.inputs = inputs
        self.kv_lora_rank, self.scale, self.softcap = kv_lora_rank, scale, softcap

    def render(self, kernel, template_buffer_node=None, flag_template_buffer_has_other_users=None,
               epilogue_nodes=None, **kwargs) -> str:
        assert not epilogue_nodes, "epilogue fusion is disabled for this template"
        out = template_buffer_node if template_buffer_node is not None else self.output_node
        q, kv, rope, tables, seq_lens, w_vc = (self.inputs[k] for k in ("Q", "KV", "ROPE", "BT", "SL", "WVC"))
        signature = kernel.def_kernel(inputs=self.present_inputs, outputs={"OUT": out})  # before any size
        options = dict(
            template=self,
            kernel=kernel,
            signature=signature,
            OUT=out,
            H=kernel.size(q, 1),
            D1=kernel.size(kv, 2),
            D2=kernel.size(rope, 2) if rope is not None else 0,
            L=self.kv_lora_rank,
            OUT_DIM=kernel.size(out, 2),
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
            scale=f"{float(self.scale)!r}f",
            softcap=f"{float(self.softcap)!r}f",
            num_threads=self.num_threads,
            export_declaration=get_export_declaration(),
            micro_kernels=template_source("latent_attention.h"),
            **self.inputs,
        )
        return self._template_from_string(template_source("latent_decode_attention.cpp.j2")).render(**options)


def _static(*sizes) -> bool:
    return all(isinstance(s, (int, sympy.Integer)) for s in sizes)


def _template_can_serve(q, kv_cache, block_tables, seq_lens, w_vc) -> bool:
    if not mla_config.active().cpp_templates or q.get_device().type != "cpu":
        return False
    if q.get_dtype() not in SUPPORTED_DTYPES or kv_cache.get_dtype() != q.get_dtype():
        return False
    if block_tables.get_dtype() not in (torch.int32, torch.int64) or seq_lens.get_dtype() not in (
        torch.int32,
        torch.int64,
    ):
        return False
    # Heads and row width shape the kernel's tiles and scratch; they must be compile-time.
    return _static(*q.get_size()[1:]) and (w_vc is None or _static(*w_vc.get_size()[1:]))


def _write_new_rows(kv_cache, new_rows, slots):
    """kv_cache[slots // block_size, slots % block_size] = new_rows, as Inductor's own scatter (it tracks
    the mutation, so the template below reads the cache after the write)."""
    block_size = kv_cache.get_size()[1]
    block = L.lowerings[aten.div.Tensor_mode](slots, block_size, rounding_mode="floor")
    offset = L.lowerings[aten.remainder.Scalar](slots, block_size)
    L.lowerings[aten.index_put_](kv_cache, [block, offset], new_rows)


@L.register_lowering(OP, type_promotion_kind=None)
def lower_latent_decode_attention(q, kv_cache, block_tables, seq_lens, kv_lora_rank, scale, softcap=0.0,
                                  new_rows=None, slots=None, w_vc=None, scale_tensor=None, rope_cache=None):
    args = (q, kv_cache, block_tables, seq_lens, kv_lora_rank, scale, softcap, new_rows, slots, w_vc, scale_tensor,
            rope_cache)
    if not _template_can_serve(q, kv_cache, block_tables, seq_lens, w_vc):
        return L.fallback_handler(OP, add_to_fallback_set=False)(*args)
    if new_rows is not None:
        _write_new_rows(kv_cache, new_rows, slots)

    def realize(t, contiguous=False):
        if t is None:
            return None
        t = ir.ExternKernel.realize_input(t)
        return ir.ExternKernel.require_contiguous(t) if contiguous else ir.ExternKernel.require_stride1(t)

    inputs = {
        "Q": realize(q),
        "KV": realize(kv_cache, contiguous=True),
        "ROPE": realize(rope_cache, contiguous=True),
        "BT": realize(block_tables),
        "SL": realize(seq_lens),
        "WVC": realize(w_vc),
        "SCALE": realize(scale_tensor),
    }
    batch, heads, _ = q.get_size()
    out_dim = kv_lora_rank if w_vc is None else w_vc.get_size()[1]
    layout = ir.FixedLayout(q.get_device(), q.get_dtype(), [batch, heads, out_dim])
    template = LatentDecodeAttentionTemplate(inputs, layout, kv_lora_rank, scale, softcap)
    choices = []
    template.maybe_append_choice(choices)
    out, _ = autotune_select_algorithm("mla_latent_decode_attention", choices, template.input_nodes, layout)
    out.data.data.allow_epilogue_fusion = False  # merged rows are written in a phase after a barrier
    return out
