"""mla::qkv_proj_with_rope: the whole MLA input chain of a decode (or prefill) step, SGLang's contract.

    q_a, c_kv, k_pe = qkv_a_proj(hidden)                   A-projections, RMSNorm of q_a and c_kv (eps)
    cos, sin        = cos_sin_cache[positions].chunk(2)     [M, rope / 2] each
    q_input         = q_b_absorb(q_a, q_b_proj_weight, w_kc^T, cos, sin)   [M, H, kv_lora_rank + rope]
    k_input         = c_kv ‖ RoPE(k_pe)                      [M, 1, kv_lora_rank + rope]
    v_input         = k_input[..., :kv_lora_rank]           a view of k_input, as SGLang returns it

w_kc is [H, kv_lora_rank, qk_nope_head_dim] as SGLang passes it (kv_b_proj's key half, Linear-style).
RoPE is DeepSeek's interleaved (GPT-J) rotation. `qkv_proj_with_rope_fused_weight` takes the A weights
concatenated ([q_lora_rank + kv_lora_rank + rope, hidden], serving code's `fused_qkv_a_proj_with_mqa`).

Quantized weights, as SGLang's flags select them (ops/weight_quant.py):
  - use_int8_w8a8: q_a, kv_a and q_b weights int8 with per-channel fp32 scales (`*_proj_scale`, [N] or
    [N, 1]); the hidden state is quantized once per token for both A-projections, the normed q_a again
    before q_b (SGLang's W8A8);
  - use_fp8_w8a16: those weights float8_e4m3fn with fp32 block scales [ceil(N / bN), ceil(K / bK)] for
    block_size [bN, bK]; activations stay in their dtype.
w_kc stays in the activation dtype. Weights are nn.Linear's [N, K] (is_vnni=False): the templates pack
what they pack at compile time, so SGLang's convert_weight_packed layout is refused.

Both are CompositeImplicitAutograd: eager calls run the mla:: ops' references, and under torch.compile
the call decomposes into `mla::qkv_a_proj` (which rotates k_pe too) and `mla::q_b_absorb`, which lower
to their C++ templates; the cos/sin gather and the concatenation are Inductor's own kernels. Rounding: q_a and
c_kv once after their norms, q_input and the rotated k_pe once each (SGLang rounds the q side four times).
"""

from __future__ import annotations

import torch
import torch._guards

from .rope import check_positions, rotate_pairs
from .weight_quant import dequantize_weight, quantize_rows_int8

_LIB = torch.library.Library("mla", "FRAGMENT")
_LIB.define(
    "qkv_proj_with_rope(Tensor hidden, Tensor q_a_proj_weight, Tensor q_b_proj_weight, Tensor kv_a_proj_weight, "
    "Tensor w_kc, Tensor q_a_norm_weight, Tensor kv_a_norm_weight, Tensor positions, Tensor cos_sin_cache, "
    "float eps, bool use_int8_w8a8=False, bool use_fp8_w8a16=False, Tensor? q_a_proj_scale=None, "
    "Tensor? q_b_proj_scale=None, Tensor? kv_a_proj_scale=None, bool is_vnni=False, int[]? block_size=None) "
    "-> (Tensor, Tensor, Tensor)"
)
_LIB.define(
    "qkv_proj_with_rope_fused_weight(Tensor hidden, Tensor fused_qkv_a_proj_weight, Tensor q_b_proj_weight, "
    "Tensor w_kc, Tensor q_a_norm_weight, Tensor kv_a_norm_weight, Tensor positions, Tensor cos_sin_cache, "
    "float eps, bool use_int8_w8a8=False, bool use_fp8_w8a16=False, Tensor? qkv_a_proj_scale=None, "
    "Tensor? q_b_proj_scale=None, bool is_vnni=False, int[]? block_size=None) -> (Tensor, Tensor, Tensor)"
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


def _quantization(use_int8_w8a8, use_fp8_w8a16, is_vnni, block_size, weights: dict, scales: dict):
    """(activation_quant, weight_block_size) of the op's weights, checking them against SGLang's flags."""
    if is_vnni:
        _fail("is_vnni=True: SGLang's convert_weight_packed layout is not taken; pass the weights as nn.Linear "
              "holds them ([N, K], is_vnni=False); the compiled templates read them so (and pack bf16 ones under "
              "freezing)")
    if use_int8_w8a8 and use_fp8_w8a16:
        _fail("use_int8_w8a8 and use_fp8_w8a16 exclude each other")
    dtype = torch.int8 if use_int8_w8a8 else torch.float8_e4m3fn if use_fp8_w8a16 else None
    for name, w in weights.items():
        if dtype is not None and w.dtype != dtype:
            flag = "use_int8_w8a8" if use_int8_w8a8 else "use_fp8_w8a16"
            _fail(f"{flag} needs {name} in {dtype}, got {w.dtype}")
    for name, scale in scales.items():
        if (scale is None) != (dtype is None):
            _fail(f"{name} must be given with use_int8_w8a8 or use_fp8_w8a16, and only then")
    if use_fp8_w8a16 and block_size is None:
        _fail("use_fp8_w8a16 needs block_size [block_n, block_k], the weights' scale blocks")
    if not use_fp8_w8a16 and block_size is not None:
        _fail("block_size is the fp8 weights' scale block; give it with use_fp8_w8a16 only")
    return ("int8" if use_int8_w8a8 else "none"), (list(block_size) if block_size is not None else None)


def _chain(hidden, q_a_proj_weight, q_b_proj_weight, kv_a_proj_weight, w_kc, q_a_norm_weight, kv_a_norm_weight,
           positions, cos_sin_cache, eps, use_int8_w8a8=False, use_fp8_w8a16=False, q_a_proj_scale=None,
           q_b_proj_scale=None, kv_a_proj_scale=None, is_vnni=False, block_size=None):
    _check(hidden, w_kc, kv_a_norm_weight, kv_a_proj_weight.shape[0], positions, cos_sin_cache)
    activation_quant, block = _quantization(
        use_int8_w8a8, use_fp8_w8a16, is_vnni, block_size,
        dict(q_a_proj_weight=q_a_proj_weight, q_b_proj_weight=q_b_proj_weight, kv_a_proj_weight=kv_a_proj_weight),
        dict(q_a_proj_scale=q_a_proj_scale, q_b_proj_scale=q_b_proj_scale, kv_a_proj_scale=kv_a_proj_scale),
    )
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    q_a, c_kv, k_pe = torch.ops.mla.qkv_a_proj(
        hidden, q_a_proj_weight, kv_a_proj_weight, q_a_norm_weight, kv_a_norm_weight, eps, eps, k_cos=cos, k_sin=sin,
        q_weight_scale=q_a_proj_scale, kv_weight_scale=kv_a_proj_scale, weight_block_size=block,
        activation_quant=activation_quant,
    )
    q_input = torch.ops.mla.q_b_absorb(q_a, q_b_proj_weight, w_kc.transpose(1, 2), cos, sin, "interleaved",
                                       q_b_weight_scale=q_b_proj_scale, weight_block_size=block,
                                       activation_quant=activation_quant)
    k_input = torch.cat([c_kv, k_pe], dim=-1).unsqueeze(1)
    return q_input, k_input, k_input[..., : c_kv.shape[-1]]


@torch.library.impl(_LIB, "qkv_proj_with_rope", "CompositeImplicitAutograd")
def qkv_proj_with_rope(hidden, q_a_proj_weight, q_b_proj_weight, kv_a_proj_weight, w_kc, q_a_norm_weight,
                       kv_a_norm_weight, positions, cos_sin_cache, eps, use_int8_w8a8=False, use_fp8_w8a16=False,
                       q_a_proj_scale=None, q_b_proj_scale=None, kv_a_proj_scale=None, is_vnni=False, block_size=None):
    return _chain(hidden, q_a_proj_weight, q_b_proj_weight, kv_a_proj_weight, w_kc, q_a_norm_weight,
                  kv_a_norm_weight, positions, cos_sin_cache, eps, use_int8_w8a8, use_fp8_w8a16, q_a_proj_scale,
                  q_b_proj_scale, kv_a_proj_scale, is_vnni, block_size)


def _split_fused_scale(scale, q_lora_rank, block_size):
    """qkv_a_proj_scale of the fused weight as (q_a's, kv_a's): per channel, by rows; per block, by
    block rows, which needs q_lora_rank to end on a block (it does in every DeepSeek config: 1536)."""
    if scale is None:
        return None, None
    if block_size is None:
        return scale[:q_lora_rank], scale[q_lora_rank:]
    if q_lora_rank % block_size[0]:
        _fail(f"qkv_a_proj_scale: q_lora_rank {q_lora_rank} must be a multiple of block_size[0] {block_size[0]}, "
              f"so that no scale block holds rows of both q_a and kv_a")
    return scale[: q_lora_rank // block_size[0]], scale[q_lora_rank // block_size[0]:]


@torch.library.impl(_LIB, "qkv_proj_with_rope_fused_weight", "CompositeImplicitAutograd")
def qkv_proj_with_rope_fused_weight(hidden, fused_qkv_a_proj_weight, q_b_proj_weight, w_kc, q_a_norm_weight,
                                    kv_a_norm_weight, positions, cos_sin_cache, eps, use_int8_w8a8=False,
                                    use_fp8_w8a16=False, qkv_a_proj_scale=None, q_b_proj_scale=None, is_vnni=False,
                                    block_size=None):
    q_lora_rank = q_a_norm_weight.shape[0]
    q_a_scale, kv_a_scale = _split_fused_scale(qkv_a_proj_scale, q_lora_rank, block_size)
    return _chain(hidden, fused_qkv_a_proj_weight[:q_lora_rank], q_b_proj_weight,
                  fused_qkv_a_proj_weight[q_lora_rank:], w_kc, q_a_norm_weight, kv_a_norm_weight, positions,
                  cos_sin_cache, eps, use_int8_w8a8, use_fp8_w8a16, q_a_scale, q_b_proj_scale, kv_a_scale, is_vnni,
                  block_size)


def reference_per_stage(hidden, q_a_proj_weight, q_b_proj_weight, kv_a_proj_weight, w_kc, q_a_norm_weight,
                        kv_a_norm_weight, positions, cos_sin_cache, eps, exact: bool = False, use_int8_w8a8=False,
                        q_a_proj_scale=None, q_b_proj_scale=None, kv_a_proj_scale=None, block_size=None):
    """SGLang's test reference: fp32 math rounded to the activation dtype after every stage. With
    `exact`, fp64 math and no rounding at all: the yardstick both are measured against. Quantized
    weights as SGLang's test takes them: W8A8 with the activations quantized per token (before the
    A-projections and again before q_b), or weights with scales dequantized (and, per stage, rounded
    to the activation dtype, as its fp8 reference does)."""
    dtype = hidden.dtype
    compute = torch.float64 if exact else torch.float32

    def stage(t):
        return t if exact else t.to(dtype).to(compute)

    def norm(t, w):
        return stage(t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w.to(compute))

    def project(x, weight, scale):
        if use_int8_w8a8:
            q, x_scale = quantize_rows_int8(x)
            return stage((q.to(compute) @ weight.to(compute).T) * x_scale.to(compute) * scale.reshape(-1).to(compute))
        w = dequantize_weight(weight, scale, block_size, compute)
        return stage(x @ (w if exact or scale is None else stage(w)).T)

    x = hidden.to(compute)
    kv_lora_rank = kv_a_norm_weight.shape[0]
    q_a = norm(project(x, q_a_proj_weight, q_a_proj_scale), q_a_norm_weight)
    kv = project(x, kv_a_proj_weight, kv_a_proj_scale)
    c_kv, k_pe = norm(kv[:, :kv_lora_rank], kv_a_norm_weight), kv[:, kv_lora_rank:]
    heads, _, nope = w_kc.shape
    q = project(q_a, q_b_proj_weight, q_b_proj_scale).view(-1, heads, q_b_proj_weight.shape[0] // heads)
    q_lat = stage(torch.einsum("thd,hld->thl", q[..., :nope], w_kc.to(compute)))
    cos, sin = cos_sin_cache[positions].to(compute).chunk(2, dim=-1)
    q_pe = stage(rotate_pairs(q[..., nope:], cos[:, None], sin[:, None], is_neox=False))
    k_pe = stage(rotate_pairs(k_pe, cos, sin, is_neox=False))
    q_input, k_input = torch.cat([q_lat, q_pe], -1), torch.cat([c_kv, k_pe], -1).unsqueeze(1)
    return (q_input, k_input) if exact else (q_input.to(dtype), k_input.to(dtype))
