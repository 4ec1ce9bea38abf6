"""mla::qkv_proj_with_rope: the whole MLA input chain of a decode (or prefill) step, SGLang's contract.

    q_a, c_kv, k_pe = qkv_a_proj(hidden)                   A-projections, RMSNorm of q_a and c_kv (eps)
    cos, sin        = cos_sin_cache[positions].chunk(2)     [M, rope / 2] each
    q_input         = q_b_absorb(q_a, q_b_proj_weight, w_kc^T, cos, sin)   [M, H, kv_lora_rank + rope]
    k_input         = c_kv ‖ RoPE(k_pe)                      [M, 1, kv_lora_rank + rope]
    v_input         = k_input[..., :kv_lora_rank]           a view of k_input, as SGLang returns it

w_kc is [H, kv_lora_rank, qk_nope_head_dim] as SGLang passes it (kv_b_proj's key half, Linear-style).
RoPE is DeepSeek's interleaved (GPT-J) rotation. `qkv_proj_with_rope_fused_weight` takes the A weights
concatenated ([q_lora_rank + kv_lora_rank + rope, hidden], serving code's `fused_qkv_a_proj_with_mqa`).

Both are CompositeImplicitAutograd: eager calls run the mla:: ops' references, and under torch.compile
the call decomposes into `mla::qkv_a_proj` (which rotates k_pe too) and `mla::q_b_absorb`, which lower
to their C++ templates; the cos/sin gather and the concatenation are Inductor's own kernels. Rounding: q_a and
c_kv once after their norms, q_input and the rotated k_pe once each (SGLang rounds the q side four times).
"""

from __future__ import annotations

import torch
import torch._guards

from .rope import check_positions, rotate_pairs

_LIB = torch.library.Library("mla", "FRAGMENT")
_LIB.define(
    "qkv_proj_with_rope(Tensor hidden, Tensor q_a_proj_weight, Tensor q_b_proj_weight, Tensor kv_a_proj_weight, "
    "Tensor w_kc, Tensor q_a_norm_weight, Tensor kv_a_norm_weight, Tensor positions, Tensor cos_sin_cache, "
    "float eps) -> (Tensor, Tensor, Tensor)"
)
_LIB.define(
    "qkv_proj_with_rope_fused_weight(Tensor hidden, Tensor fused_qkv_a_proj_weight, Tensor q_b_proj_weight, "
    "Tensor w_kc, Tensor q_a_norm_weight, Tensor kv_a_norm_weight, Tensor positions, Tensor cos_sin_cache, "
    "float eps) -> (Tensor, Tensor, Tensor)"
)


def _fail(message: str) -> None:
    raise ValueError(f"mla::qkv_proj_with_rope: {message}")


def _check(hidden, w_kc, kv_a_norm_weight, kv_a_rows, positions, cos_sin_cache) -> None:
    """What the composed ops do not check themselves; theirs name their own arguments."""
    if hidden.dim() != 2:
        _fail(f"hidden must be [tokens, hidden_size], got {list(hidden.shape)}")
    if positions.dim() != 1 or positions.shape[0] != hidden.shape[0] or positions.dtype not in (torch.int32, torch.int64):
        _fail(f"positions must be int32/int64 [tokens={hidden.shape[0]}], got {positions.dtype}{list(positions.shape)}")
    if cos_sin_cache.dim() != 2 or not cos_sin_cache.is_floating_point():
        _fail(f"cos_sin_cache must be a floating [max_positions, rope] tensor, got "
              f"{cos_sin_cache.dtype}{list(cos_sin_cache.shape)}")
    kv_lora_rank, rope = kv_a_norm_weight.shape[0], cos_sin_cache.shape[1]
    if kv_a_rows != kv_lora_rank + rope:
        _fail(f"kv_a_proj_weight has {kv_a_rows} rows, expected kv_lora_rank + rope = {kv_lora_rank} + {rope} "
              f"(kv_a_norm_weight and cos_sin_cache)")
    if w_kc.dim() != 3 or w_kc.shape[1] != kv_lora_rank:
        _fail(f"w_kc must be [heads, kv_lora_rank={kv_lora_rank}, qk_nope_head_dim], got {list(w_kc.shape)}")
    if torch._guards.detect_fake_mode(positions) is None:  # eager: the values exist
        check_positions(positions, cos_sin_cache, _fail)


def _chain(hidden, q_a_proj_weight, q_b_proj_weight, kv_a_proj_weight, w_kc, q_a_norm_weight, kv_a_norm_weight,
           positions, cos_sin_cache, eps):
    _check(hidden, w_kc, kv_a_norm_weight, kv_a_proj_weight.shape[0], positions, cos_sin_cache)
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    q_a, c_kv, k_pe = torch.ops.mla.qkv_a_proj(
        hidden, q_a_proj_weight, kv_a_proj_weight, q_a_norm_weight, kv_a_norm_weight, eps, eps, k_cos=cos, k_sin=sin
    )
    q_input = torch.ops.mla.q_b_absorb(q_a, q_b_proj_weight, w_kc.transpose(1, 2), cos, sin, "interleaved")
    k_input = torch.cat([c_kv, k_pe], dim=-1).unsqueeze(1)
    return q_input, k_input, k_input[..., : c_kv.shape[-1]]


@torch.library.impl(_LIB, "qkv_proj_with_rope", "CompositeImplicitAutograd")
def qkv_proj_with_rope(hidden, q_a_proj_weight, q_b_proj_weight, kv_a_proj_weight, w_kc, q_a_norm_weight,
                       kv_a_norm_weight, positions, cos_sin_cache, eps):
    return _chain(hidden, q_a_proj_weight, q_b_proj_weight, kv_a_proj_weight, w_kc, q_a_norm_weight,
                  kv_a_norm_weight, positions, cos_sin_cache, eps)


@torch.library.impl(_LIB, "qkv_proj_with_rope_fused_weight", "CompositeImplicitAutograd")
def qkv_proj_with_rope_fused_weight(hidden, fused_qkv_a_proj_weight, q_b_proj_weight, w_kc, q_a_norm_weight,
                                    kv_a_norm_weight, positions, cos_sin_cache, eps):
    q_lora_rank = q_a_norm_weight.shape[0]
    return _chain(hidden, fused_qkv_a_proj_weight[:q_lora_rank], q_b_proj_weight,
                  fused_qkv_a_proj_weight[q_lora_rank:], w_kc, q_a_norm_weight, kv_a_norm_weight, positions,
                  cos_sin_cache, eps)


def reference_per_stage(hidden, q_a_proj_weight, q_b_proj_weight, kv_a_proj_weight, w_kc, q_a_norm_weight,
                        kv_a_norm_weight, positions, cos_sin_cache, eps, exact: bool = False):
    """SGLang's test reference: fp32 math rounded to the activation dtype after every stage. With
    `exact`, fp64 math and no rounding at all: the yardstick both are measured against."""
    dtype = hidden.dtype
    compute = torch.float64 if exact else torch.float32

    def stage(t):
        return t if exact else t.to(dtype).to(compute)

    def norm(t, w):
        return stage(t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w.to(compute))

    x = hidden.to(compute)
    kv_lora_rank = kv_a_norm_weight.shape[0]
    q_a = norm(stage(x @ q_a_proj_weight.to(compute).T), q_a_norm_weight)
    kv = stage(x @ kv_a_proj_weight.to(compute).T)
    c_kv, k_pe = norm(kv[:, :kv_lora_rank], kv_a_norm_weight), kv[:, kv_lora_rank:]
    heads, _, nope = w_kc.shape
    q = stage(q_a @ q_b_proj_weight.to(compute).T).view(-1, heads, q_b_proj_weight.shape[0] // heads)
    q_lat = stage(torch.einsum("thd,hld->thl", q[..., :nope], w_kc.to(compute)))
    cos, sin = cos_sin_cache[positions].to(compute).chunk(2, dim=-1)
    q_pe = stage(rotate_pairs(q[..., nope:], cos[:, None], sin[:, None], is_neox=False))
    k_pe = stage(rotate_pairs(k_pe, cos, sin, is_neox=False))
    q_input, k_input = torch.cat([q_lat, q_pe], -1), torch.cat([c_kv, k_pe], -1).unsqueeze(1)
    return (q_input, k_input) if exact else (q_input.to(dtype), k_input.to(dtype))
