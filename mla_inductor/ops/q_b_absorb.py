"""mla::q_b_absorb: the query side of absorbed MLA attention, from the q latent to the decode query.

    q        = q_a · q_b_weight^T                       [T, H, nope + R]   (q_b_proj)
    q_nope, q_pe = q.split([nope, R])
    q_input  = q_nope · W_kc[h]  ‖  RoPE(q_pe; cos, sin)  [T, H, L + R]

W_kc [H, nope, L] is the key half of kv_b_proj's weight seen per head (absorbing it lets attention
run over the latent cache rows directly; mla_decode). cos and sin are each token's [T, R / 2]
values, rotating q_pe in one of mla::apply_rope's styles: "interleaved" pairs (x[2i], x[2i+1]) as
DeepSeek's serving code rotates them, "neox" (rotate_half) pairs, or "interleaved_to_halves", the
layout transformers' DeepseekV3 produces. This is the query part of SGLang's `qkv_proj_with_rope`.

q_b_weight may be quantized (ops/weight_quant.py): int8 or float8_e4m3fn with `q_b_weight_scale` per
channel or per `weight_block_size` block, and `activation_quant="int8"` for SGLang's W8A8 (q_a
quantized per token first). W_kc stays in q_a's dtype, as in every anchor.

The eager implementation is the reference: q, q_lat and the rotation in fp32, one rounding of the
output (eager model code rounds q to bf16 before the bmm; the fused path is more accurate).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .checks import check_cpu_tensors
from .rope import ROPE_STYLES, SUPPORTED_DTYPES, rotate_pairs
from .weight_quant import check_quantized_weight, linear_fp32


def _fail(message: str) -> None:
    raise ValueError(f"mla::q_b_absorb: {message}")


def check_args(q_a, q_b_weight, w_kc, cos, sin, rope_style="interleaved", q_b_weight_scale=None,
               weight_block_size=None, activation_quant="none") -> None:
    if rope_style not in ROPE_STYLES:
        _fail(f"rope_style must be one of {ROPE_STYLES}, got {rope_style!r}")
    check_cpu_tensors(_fail, dict(q_a=q_a, q_b_weight=q_b_weight, w_kc=w_kc, cos=cos, sin=sin))
    if q_a.dtype not in SUPPORTED_DTYPES:
        _fail(f"q_a has dtype {q_a.dtype}; supported: bfloat16, float16, float32")
    if w_kc.dtype != q_a.dtype:
        _fail(f"w_kc has dtype {w_kc.dtype}, expected q_a's dtype {q_a.dtype}")
    check_quantized_weight(_fail, "q_b_weight", q_b_weight, "q_b_weight_scale", q_b_weight_scale, weight_block_size,
                           activation_quant, q_a.dtype)
    if q_a.dim() != 2:
        _fail(f"q_a must be [tokens, q_lora_rank], got {list(q_a.shape)}")
    if w_kc.dim() != 3:
        _fail(f"w_kc must be [heads, qk_nope_head_dim, kv_lora_rank], got {list(w_kc.shape)}")
    heads, nope, _ = w_kc.shape
    if cos.dim() != 2 or cos.shape[0] != q_a.shape[0] or not cos.is_floating_point():
        _fail(f"cos must be a floating [tokens={q_a.shape[0]}, rope / 2] tensor, got {cos.dtype}{list(cos.shape)}")
    if sin.shape != cos.shape or sin.dtype != cos.dtype:
        _fail(f"sin must be {cos.dtype}{list(cos.shape)} like cos, got {sin.dtype}{list(sin.shape)}")
    rope = 2 * cos.shape[1]
    expected = [heads * (nope + rope), q_a.shape[1]]
    if q_b_weight.dim() != 2 or list(q_b_weight.shape) != expected:
        _fail(f"q_b_weight must be [heads * (qk_nope_head_dim + rope), q_lora_rank] = {expected} for w_kc "
              f"{list(w_kc.shape)}, cos {list(cos.shape)} and q_a {list(q_a.shape)}, got {list(q_b_weight.shape)}")


@torch.library.custom_op("mla::q_b_absorb", mutates_args=())
def q_b_absorb(q_a: Tensor, q_b_weight: Tensor, w_kc: Tensor, cos: Tensor, sin: Tensor, rope_style: str,
               q_b_weight_scale: Optional[Tensor] = None, weight_block_size: Optional[list[int]] = None,
               activation_quant: str = "none") -> Tensor:
    check_args(q_a, q_b_weight, w_kc, cos, sin, rope_style, q_b_weight_scale, weight_block_size, activation_quant)
    compute = torch.promote_types(q_a.dtype, torch.float32)
    heads, nope, _ = w_kc.shape
    q = linear_fp32(q_a, q_b_weight, q_b_weight_scale, weight_block_size, activation_quant)
    q = q.view(q_a.shape[0], heads, -1)
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    q_lat = torch.einsum("thd,hdl->thl", q_nope, w_kc.to(compute))
    q_pe = rotate_pairs(q_pe, cos[:, None], sin[:, None], rope_style == "neox", rope_style == "interleaved_to_halves")
    return torch.cat([q_lat, q_pe], dim=-1).to(q_a.dtype)


@q_b_absorb.register_fake
def _(q_a, q_b_weight, w_kc, cos, sin, rope_style, q_b_weight_scale=None, weight_block_size=None,
      activation_quant="none"):
    check_args(q_a, q_b_weight, w_kc, cos, sin, rope_style, q_b_weight_scale, weight_block_size, activation_quant)
    return q_a.new_empty(q_a.shape[0], w_kc.shape[0], w_kc.shape[2] + 2 * cos.shape[1])


def reference_fp64(q_a, q_b_weight, w_kc, cos, sin, rope_style) -> Tensor:
    """An independent fp64 computation, head by head, for tests."""
    d = torch.float64
    heads, nope, latent = w_kc.shape
    half = cos.shape[1]
    q = q_a.to(d) @ q_b_weight.to(d).T
    out = torch.empty(q_a.shape[0], heads, latent + 2 * half, dtype=d)
    for h in range(heads):
        head = q[:, h * (nope + 2 * half) : (h + 1) * (nope + 2 * half)]
        out[:, h, :latent] = head[:, :nope] @ w_kc[h].to(d)
        pe = head[:, nope:]
        for i in range(half):
            ia, ib = (i, i + half) if rope_style == "neox" else (2 * i, 2 * i + 1)
            oa, ob = (i, i + half) if rope_style == "interleaved_to_halves" else (ia, ib)
            c, s = cos[:, i].to(d), sin[:, i].to(d)
            out[:, h, latent + oa] = pe[:, ia] * c - pe[:, ib] * s
            out[:, h, latent + ob] = pe[:, ib] * c + pe[:, ia] * s
    return out
