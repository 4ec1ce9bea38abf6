"""mla_decode: absorbed MLA decode attention over the latent cache into `mla::latent_decode_attention`.

Spellings found in real graphs, each written below as the model code it matches:
- serving style (SGLang / vLLM torch-native backends, models/mla.py): every query head attends over
  the request's paged latent rows gathered by block table (K = c_kv | k_pe, V = c_kv), masked by
  length, then the latent output is de-absorbed through W_vc with a bmm;
- transformers DeepseekV3/V2 decode (see hf_decode below).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch._inductor.pattern_matcher import Match

from . import register_fusion

FUSION = "mla_decode"
# Magic values the traced patterns turn back into arguments (distinct from every size and literal).
_SCALE = 0.0625


def _upcast(x):
    return x.to(torch.promote_types(x.dtype, torch.float32))


# --- search functions: the model code ------------------------------------------------------------


def paged_absorbed_decode(q, kv_cache, block_tables, seq_lens, w_vc, scale):
    """q [B, H, L + R], cache [blocks, block_size, L + R], w_vc [H, v_head_dim, L] -> [H, B, v_head_dim]."""
    kv_lora_rank = w_vc.shape[-1]
    kv = kv_cache[block_tables].flatten(1, 2)
    c, k_pe = kv[..., :kv_lora_rank], kv[..., kv_lora_rank:]
    q_lat, q_pe = q[..., :kv_lora_rank], q[..., kv_lora_rank:]
    scores = torch.bmm(q_lat, c.transpose(1, 2)) + torch.bmm(q_pe, k_pe.transpose(1, 2))
    scores = _upcast(scores) * scale
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


# --- preconditions --------------------------------------------------------------------------------


def _value(arg):
    return arg.meta["val"] if isinstance(arg, torch.fx.Node) else arg


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


_END = 9223372036854775807  # an open slice end, as traced


def check_paged(match: Match) -> Optional[str]:
    kw = {name: _value(arg) for name, arg in match.kwargs.items()}
    q, cache, tables, lens, w_vc = (kw[k] for k in ("q", "kv_cache", "block_tables", "seq_lens", "w_vc"))
    if cache.dtype != q.dtype or w_vc.dtype != q.dtype:
        return f"q, kv_cache and w_vc have dtypes {q.dtype}, {cache.dtype}, {w_vc.dtype}; the op takes one"
    if tables.is_floating_point() or lens.is_floating_point():
        return "block_tables and seq_lens must be integer tensors"
    if w_vc.dim() != 3 or w_vc.shape[0] != q.shape[1] or not isinstance(w_vc.shape[2], int):
        return f"w_vc {list(w_vc.shape)} is not [heads, v_head_dim, kv_lora_rank] for {q.shape[1]} heads"
    return _paged_literal_mismatch(match, w_vc.shape[2])


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


def register() -> None:
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
