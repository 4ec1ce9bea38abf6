"""mla_decode: absorbed MLA decode attention over the latent cache into `mla::latent_decode_attention`.

Spellings found in real graphs, each written below as the model code it matches:
- serving style (SGLang / vLLM torch-native backends, models/mla.py): every query head attends over
  the request's paged latent rows gathered by block table (K = c_kv | k_pe, V = c_kv), masked by
  length, then the latent output is de-absorbed through W_vc with a bmm;
- transformers DeepseekV3/V2 decode: the cache holds the compressed latent, but every step runs
  kv_b_proj over the *whole* cache, assembles full keys and runs SDPA's math path. The replacement
  absorbs kv_b_proj instead (W_kc into the query, W_vc after the attention: slices of its weight) and
  attends over the latent rows the mask admits, which cuts the step from
  O(T * kv_lora_rank * heads * 256) to O(heads * T * 576). The cache writes stay as they were.
"""

from __future__ import annotations

import itertools
from typing import Optional

import torch
import torch.nn.functional as F
from torch._inductor.pattern_matcher import Match
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..ops.mla_decode import check_args, latent_decode_attention_dense
from .registry import node_value, register_fusion, upcast

FUSION = "mla_decode"
# Magic values the traced patterns turn back into arguments (distinct from every size and literal).
_SCALE = 0.0625
# transformers' math SDPA multiplies q and k^T by sqrt(scale) each, so the scale is matched as that
# square root (both multiplications must bind the same value) and squared in the replacement.
_SQRT_SCALE = 0.3125
_END = 9223372036854775807  # an open slice end, as traced


# --- search functions: the model code ------------------------------------------------------------


def paged_absorbed_decode(q, kv_cache, block_tables, seq_lens, w_vc, scale):
    """q [B, H, L + R], cache [blocks, block_size, L + R], w_vc [H, v_head_dim, L] -> [H, B, v_head_dim]."""
    kv_lora_rank = w_vc.shape[-1]
    kv = kv_cache[block_tables].flatten(1, 2)
    c, k_pe = kv[..., :kv_lora_rank], kv[..., kv_lora_rank:]
    q_lat, q_pe = q[..., :kv_lora_rank], q[..., kv_lora_rank:]
    scores = torch.bmm(q_lat, c.transpose(1, 2)) + torch.bmm(q_pe, k_pe.transpose(1, 2))
    scores = upcast(scores) * scale
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


def hf_decode(c_kv, k_pe, kv_b_weight, q_nope, q_pe, mask, sqrt_scale):
    """transformers DeepseekV3Attention (5.x) from the updated caches on: c_kv [B, 1, T, L] and
    k_pe [B, 1, T, rope] (after the cache write), q_nope [B, H, S, nope], roped q_pe [B, H, S, rope]."""
    batch, _, seq_len, kv_lora_rank = c_kv.shape
    nope, heads = q_nope.shape[-1], q_nope.shape[1]
    v_head_dim = kv_b_weight.shape[0] // heads - nope
    kv = F.linear(c_kv, kv_b_weight).view(batch, seq_len, -1, nope + v_head_dim).transpose(1, 2)
    k_nope, value = torch.split(kv, [nope, v_head_dim], dim=-1)
    k_rot = k_pe.expand(-1, k_nope.shape[1], -1, -1)
    key = kv.new_empty(*kv.shape[:-1], nope + k_pe.shape[-1])
    key[..., :nope].copy_(k_nope)
    key[..., nope:].copy_(k_rot)
    query = torch.cat((q_nope, q_pe), dim=-1)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=0.0, scale=sqrt_scale * sqrt_scale, is_causal=False
    )


def hf_decode_unmasked(c_kv, k_pe, kv_b_weight, q_nope, q_pe, sqrt_scale):
    """The same without a mask: a DynamicCache decode, whose cache holds exactly the visible rows."""
    return hf_decode(c_kv, k_pe, kv_b_weight, q_nope, q_pe, None, sqrt_scale)


def _absorbed(c_kv, k_pe, kv_b_weight, q_nope, q_pe, attn_mask, sqrt_scale):
    batch, heads, _, nope = q_nope.shape
    kv_lora_rank, rope = c_kv.shape[-1], k_pe.shape[-1]
    w = kv_b_weight.view(heads, -1, kv_lora_rank)
    w_kc, w_vc = w[:, :nope], w[:, nope:]  # [H, nope, L], [H, v_head_dim, L]
    q_latent = torch.bmm(q_nope[:, :, 0].transpose(0, 1), w_kc).transpose(0, 1)  # [B, H, L]
    query = torch.cat([q_latent, q_pe[:, :, 0]], dim=-1)
    # Every cache row is a candidate; the mask (if any) says which count. The op reads no row past the
    # last one the mask admits, so a StaticCache's unfilled tail costs nothing.
    lengths = torch.ones(batch, dtype=torch.int64, device=c_kv.device) * c_kv.shape[2]
    out = latent_decode_attention_dense(
        query,
        c_kv.view(batch, -1, kv_lora_rank),
        lengths,
        kv_lora_rank,
        sqrt_scale * sqrt_scale,
        w_vc=w_vc,
        rope=k_pe.view(batch, -1, rope),
        attn_mask=attn_mask,
    )
    return out.unsqueeze(2)


def hf_decode_replacement(c_kv, k_pe, kv_b_weight, q_nope, q_pe, mask, sqrt_scale):
    return _absorbed(c_kv, k_pe, kv_b_weight, q_nope, q_pe, mask[:, 0, 0], sqrt_scale)


def hf_decode_unmasked_replacement(c_kv, k_pe, kv_b_weight, q_nope, q_pe, sqrt_scale):
    return _absorbed(c_kv, k_pe, kv_b_weight, q_nope, q_pe, None, sqrt_scale)


# --- preconditions --------------------------------------------------------------------------------


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


def check_paged(match: Match) -> Optional[str]:
    kw = {name: node_value(arg) for name, arg in match.kwargs.items()}
    q, cache, tables, lens, w_vc = (kw[k] for k in ("q", "kv_cache", "block_tables", "seq_lens", "w_vc"))
    if cache.dtype != q.dtype or w_vc.dtype != q.dtype:
        return f"q, kv_cache and w_vc have dtypes {q.dtype}, {cache.dtype}, {w_vc.dtype}; the op takes one"
    if tables.is_floating_point() or lens.is_floating_point():
        return "block_tables and seq_lens must be integer tensors"
    if w_vc.dim() != 3 or not isinstance(w_vc.shape[2], int):
        return f"w_vc {list(w_vc.shape)} is not [heads, v_head_dim, kv_lora_rank]"
    try:
        check_args(q, cache, tables, lens, w_vc.shape[2], 0.0, None, None, w_vc)
    except ValueError as error:
        return str(error).removeprefix("mla::latent_decode_attention: ")
    return _paged_literal_mismatch(match, w_vc.shape[2])


def _hf_literal_mismatch(match: Match, nope: int, v_head_dim: int, heads: int) -> Optional[str]:
    """What the strict re-trace would compare, for the size-agnostic (dynamic cache length) form: how
    kv_b_proj's output is split into heads, k_nope and v, and how the key is assembled."""
    aten = torch.ops.aten
    for node in match.nodes:
        args = node.args
        if node.target == aten.split_with_sizes.default:
            if (list(args[1]), args[2:3]) not in (([nope, v_head_dim], (-1,)), ([nope, v_head_dim], (3,))):
                return f"{node.name} splits {list(args[1])}, not k_nope {nope} | v {v_head_dim}"
            heads_view = args[0].args[0]  # split(permute(view(kv_b_proj(c_kv), [B, T, H, nope + v])))
            if tuple(heads_view.meta["val"].shape[2:]) != (heads, nope + v_head_dim):
                return f"{heads_view.name} does not split kv_b_proj's output into {heads} heads"
        if node.target == aten.permute.default and list(args[1]) not in ([0, 2, 1, 3], [0, 1, 3, 2], [1, 0]):
            return f"{node.name} permutes {list(args[1])}"
        if node.target in (aten.slice.Tensor, aten.slice_scatter.default):
            dim, start, end = args[-3], args[-2], args[-1]
            if dim not in (3, -1) or (start, end) not in ((0, nope), (nope, _END)):
                return f"{node.name} cuts the key at [{start}:{end}] on dim {dim}, not at nope {nope}"
        if node.target in (aten.amax.default, aten.sum.dim_IntList, aten.any.dim):
            dims = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
            if list(dims) not in ([-1], [3]):
                return f"{node.name} reduces dims {list(dims)}, not the rows' dim"
        if node.target == aten.expand.default and node.meta["val"].shape[1] not in (1, heads):
            return f"{node.name} expands to {list(node.meta['val'].shape)}"
    return None


def check_hf(match: Match) -> Optional[str]:
    kw = {name: node_value(arg) for name, arg in match.kwargs.items()}
    c_kv, k_pe, w, q_nope, q_pe = (kw[k] for k in ("c_kv", "k_pe", "kv_b_weight", "q_nope", "q_pe"))
    if q_nope.shape[2] != 1:
        return f"{q_nope.shape[2]} query rows: absorbing pays for decode, not for prefill"
    if c_kv.shape[1] != 1 or k_pe.shape[1] != 1:
        return "the latent cache has a head dim other than 1"
    if len({c_kv.dtype, k_pe.dtype, w.dtype, q_nope.dtype, q_pe.dtype}) != 1:
        return "caches, weight and queries differ in dtype"
    if not (c_kv.is_contiguous() and k_pe.is_contiguous()):
        return "the latent caches are not contiguous: the op reads them as rows in place"
    heads, nope = q_nope.shape[1], q_nope.shape[-1]
    if w.dim() != 2 or w.shape[1] != c_kv.shape[-1] or w.shape[0] % heads != 0 or w.shape[0] // heads <= nope:
        return f"kv_b_proj weight {list(w.shape)} does not fit {heads} heads of the latent"
    mismatch = _hf_literal_mismatch(match, nope, w.shape[0] // heads - nope, heads)
    if mismatch or "mask" not in kw:
        return mismatch
    mask = kw["mask"]
    shape = list(mask.shape)
    if mask.dim() != 4 or not (shape[0] == 1 or shape[0] == q_nope.shape[0]) or shape[1:3] != [1, 1]:
        return f"mask is {shape}, expected one mask for all heads, [batch or 1, 1, 1, rows]"
    if not statically_known_true(shape[3] == c_kv.shape[2]):
        return f"the mask covers {shape[3]} rows, the cache {c_kv.shape[2]}"
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        return f"mask is {mask.dtype}, expected bool or additive floats"
    return None


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


def _hf_inputs(batch: int, dtype: torch.dtype) -> list:
    heads, nope, rope, v_head_dim, lora, rows = 2, 8, 4, 6, 16, 8
    return [
        torch.empty(batch, 1, rows, lora, dtype=dtype),
        torch.empty(batch, 1, rows, rope, dtype=dtype),
        torch.empty(heads * (nope + v_head_dim), lora, dtype=dtype),
        torch.empty(batch, heads, 1, nope, dtype=dtype),
        torch.empty(batch, heads, 1, rope, dtype=dtype),
        torch.ones(batch, 1, 1, rows, dtype=torch.bool),
        _SQRT_SCALE,
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
    # The math SDPA graph differs by dtype (casts to fp32) and batch (B > 1 clones the expanded value).
    for dtype, batch in itertools.product((torch.bfloat16, torch.float32), (1, 2)):
        register_fusion(
            FUSION,
            hf_decode,
            hf_decode_replacement,
            _hf_inputs(batch, dtype),
            check_hf,
            scalar_workaround={"sqrt_scale": _SQRT_SCALE},
            functionalize=True,  # the key is assembled in place
            # Sizes turn dynamic as soon as a compiled step sees a second batch or cache size (automatic
            # dynamic shapes) and then appear in mixed spellings a strict re-trace cannot reproduce;
            # check_hf compares the literals instead.
            size_agnostic=True,
        )
        # DynamicCache: no mask, and after the first steps a dynamic row count.
        register_fusion(
            FUSION,
            hf_decode_unmasked,
            hf_decode_unmasked_replacement,
            _hf_inputs(batch, dtype)[:5] + [_SQRT_SCALE],
            check_hf,
            scalar_workaround={"sqrt_scale": _SQRT_SCALE},
            functionalize=True,
            size_agnostic=True,
        )
