"""mla::qkv and mla::gqa_qkv: the fused QKV projection of MHA / GQA attention (Llama, Qwen2, Mistral).

The features of the Neuron `qkv` kernel, where they make sense on a CPU, all around one GEMM:

    x        = input (+ mlp_prev) (+ attention_prev)                  if fused_residual_add
    x        = norm(x)                RMSNorm, RMSNorm without gamma, LayerNorm, Gemma's RMSNorm, or none
    qkv      = x @ W (+ bias)         [B, S, I], I = (num_q_heads + 2 num_kv_heads) d_head
    q, k     = RMSNorm of every q and k head by its own weight [d_head]   (gqa_qkv: Qwen3's, Gemma-3's)
    q, k     = rotate_half RoPE of every q and k head by cos/sin [B, S, d_head]   if fused_rope
    k_cache[slot], v_cache[slot] = k, v  (each [num_kv_heads d_head]), quantized to FP8 as
                                   clamp(k / k_scale) when the cache is float8_e4m3fn
    output   = qkv as [B, S, I] ("BSD") or [heads, B, S, d_head] ("NBSd")

`mla::qkv` takes Neuron's fused weight [H, I]. `mla::gqa_qkv` takes nn.Linear's three weights
[N, H] (what the patterns find in model code; no concatenated copy per call). Both are composite:
the residual sum and the norm are written as model code writes them (Inductor fuses them into one
pass over the input rows), the GEMM, bias, RoPE and output layout are `mla::qkv_projection` (the
C++ template), the cache write is an `index_put_` after it. Both return
(output, residual): the summed input when fused_residual_add (model code needs it for the next
residual connection), else an empty tensor. The KV cache is written in place at `slot_mapping`
(one slot per token; a flat row of the cache seen as [-1, num_kv_heads d_head]: b * max_len + pos
for a contiguous [B, max_len, kv_dim] cache, block * block_size + offset for a block cache).

The eager implementation is the reference and computes what model code computes: the residual sum
and the norm in the input dtype's steps (transformers' RMSNorm rounds x * rsqrt before gamma), the
GEMM with fp32 accumulation rounded to the input dtype, RoPE in fp32 from the rounded values.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .checks import check_cpu_tensors
from .weight_quant import ACTIVATION_QUANT, FP8_ACTIVATION_QUANT, check_quantized_weight, linear_fp32

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OUTPUT_LAYOUTS = ("BSD", "NBSd")
# gemma_rms_norm: Gemma's RMSNorm, which scales by 1 + weight in fp32 before its one rounding (beyond Neuron's)
NORM_TYPES = ("none", "rms_norm", "rms_norm_skip_gamma", "layer_norm", "gemma_rms_norm")
QUANTIZATION_TYPES = ("none", "row", "static")  # Neuron's NONE, ROW, STATIC (MX is Trainium's)
FP8 = torch.float8_e4m3fn


class _Fail:
    def __init__(self, op: str) -> None:
        self.op = op

    def __call__(self, message: str) -> None:
        raise ValueError(f"mla::{self.op}: {message}")


def _check_tensor(fail, name, t, dtype=None, shape=None) -> None:
    check_cpu_tensors(fail, {name: t})
    if dtype is not None and t.dtype != dtype:
        fail(f"{name} has dtype {t.dtype}, expected {dtype}")
    if shape is not None and list(t.shape) != list(shape):
        fail(f"{name} must be {list(shape)}, got {list(t.shape)}")


def _vector(t: Optional[Tensor]) -> Optional[Tensor]:
    """Neuron passes per-channel vectors as [1, N]: accept [N] and [1, N]."""
    return t.reshape(-1) if t is not None and t.dim() == 2 and t.shape[0] == 1 else t


def check_args(fail, input, out_features, hidden, output_layout, bias, fused_residual_add, mlp_prev, attention_prev,
               fused_norm_type, gamma_norm_weights, layer_norm_bias, norm_eps, fused_rope, cos_cache, sin_cache,
               d_head, num_q_heads, num_kv_heads, k_cache, v_cache, k_scale, v_scale, use_block_kv, block_size,
               slot_mapping) -> None:
    """Every precondition that does not depend on values, with a message naming the argument.
    `out_features` / `hidden` are the weights' I and H (checked by the caller against their layout)."""
    _check_tensor(fail, "input", input)
    if input.dtype not in SUPPORTED_DTYPES:
        fail(f"input has dtype {input.dtype}; supported: bfloat16, float16, float32")
    if input.dim() != 3:
        fail(f"input must be [B, S, H], got {list(input.shape)}")
    B, S, H = input.shape
    if H != hidden:
        fail(f"contract dimension mismatch: input's hidden size {H} != the weights' {hidden}")
    if output_layout not in OUTPUT_LAYOUTS:
        fail(f"output_layout must be one of {OUTPUT_LAYOUTS}, got {output_layout!r}")
    if bias is not None:
        _check_tensor(fail, "bias", _vector(bias), input.dtype, [out_features])
    if fused_residual_add:
        if mlp_prev is None and attention_prev is None:
            fail("fused_residual_add needs mlp_prev and/or attention_prev")
        for name, t in (("mlp_prev", mlp_prev), ("attention_prev", attention_prev)):
            if t is not None:
                _check_tensor(fail, name, t, input.dtype, input.shape)
    elif mlp_prev is not None or attention_prev is not None:
        fail("mlp_prev / attention_prev are given but fused_residual_add is False")
    if fused_norm_type not in NORM_TYPES:
        fail(f"fused_norm_type must be one of {NORM_TYPES}, got {fused_norm_type!r}")
    if fused_norm_type in ("rms_norm", "layer_norm", "gemma_rms_norm"):
        if gamma_norm_weights is None:
            fail(f"fused_norm_type={fused_norm_type!r} needs gamma_norm_weights")
        _check_tensor(fail, "gamma_norm_weights", _vector(gamma_norm_weights), input.dtype, [H])
    elif gamma_norm_weights is not None:
        fail(f"gamma_norm_weights is given but fused_norm_type={fused_norm_type!r} takes none")
    if layer_norm_bias is not None:
        if fused_norm_type != "layer_norm":
            fail("layer_norm_bias is only for fused_norm_type='layer_norm'")
        _check_tensor(fail, "layer_norm_bias", _vector(layer_norm_bias), input.dtype, [H])
    if fused_norm_type != "none" and not norm_eps > 0:
        fail(f"norm_eps must be > 0, got {norm_eps}")

    needs_heads = fused_rope or output_layout == "NBSd" or k_cache is not None
    if needs_heads:
        if d_head is None or num_q_heads is None or num_kv_heads is None:
            fail("d_head, num_q_heads and num_kv_heads are required for fused_rope, the NBSd layout and the KV cache")
        if d_head <= 0 or num_q_heads <= 0 or num_kv_heads <= 0:
            fail(f"d_head, num_q_heads, num_kv_heads must be positive, got {d_head}, {num_q_heads}, {num_kv_heads}")
        if (num_q_heads + 2 * num_kv_heads) * d_head != out_features:
            fail(f"(num_q_heads + 2 * num_kv_heads) * d_head = ({num_q_heads} + 2 * {num_kv_heads}) * {d_head} != "
                 f"the weights' output size {out_features}")
        if num_q_heads % num_kv_heads:
            fail(f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if fused_rope:
        if cos_cache is None or sin_cache is None:
            fail("fused_rope needs cos_cache and sin_cache")
        if d_head % 2:
            fail(f"fused_rope needs an even d_head, got {d_head}")
        for name, t in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
            _check_tensor(fail, name, t, shape=[B, S, d_head])
            if not t.is_floating_point():
                fail(f"{name} must be floating, got {t.dtype}")
    elif cos_cache is not None or sin_cache is not None:
        fail("cos_cache / sin_cache are given but fused_rope is False")

    if (k_cache is None) != (v_cache is None):
        fail("k_cache and v_cache come together")
    if (k_scale is None) != (v_scale is None):
        fail("k_scale and v_scale come together")
    if k_cache is None:
        if k_scale is not None or slot_mapping is not None or use_block_kv:
            fail("k_scale / v_scale, slot_mapping and use_block_kv need k_cache and v_cache")
        return
    kv_dim = num_kv_heads * d_head
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(fail, name, t)
        if t.dtype not in (input.dtype, FP8):
            fail(f"{name} has dtype {t.dtype}; expected input's {input.dtype} or {FP8}")
        if t.dim() != 3 or t.shape[-1] != kv_dim or not t.is_contiguous():
            fail(f"{name} must be a contiguous [B, max_seq_len, kv_dim] or [num_blocks, block_size, kv_dim] cache "
                 f"with kv_dim = num_kv_heads * d_head = {kv_dim}, got {list(t.shape)}")
    if v_cache.dtype != k_cache.dtype or v_cache.shape != k_cache.shape:
        fail(f"v_cache {v_cache.dtype}{list(v_cache.shape)} must match k_cache {k_cache.dtype}{list(k_cache.shape)}")
    if k_cache.dtype == FP8:
        if k_scale is None:
            fail("an FP8 cache needs k_scale and v_scale")
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            _check_tensor(fail, name, t, torch.float32)
            if t.numel() != 1:
                fail(f"{name} must hold one scale, got {list(t.shape)}")
    elif k_scale is not None:
        fail(f"k_scale / v_scale quantize to an FP8 cache; k_cache is {k_cache.dtype}")
    if use_block_kv:
        if block_size is None or block_size != k_cache.shape[1]:
            fail(f"use_block_kv needs block_size = the cache's dim 1 ({k_cache.shape[1]}), got {block_size}")
    elif block_size is not None:
        fail("block_size is for use_block_kv=True")
    if slot_mapping is None:
        fail("writing the KV cache needs slot_mapping (one slot per token)")
    _check_tensor(fail, "slot_mapping", slot_mapping)
    if slot_mapping.dtype not in (torch.int32, torch.int64) or slot_mapping.numel() != B * S:
        fail(f"slot_mapping must be int32/int64 with B * S = {B * S} slots, got {slot_mapping.dtype}{list(slot_mapping.shape)}")


def check_slots(fail, slot_mapping: Tensor, k_cache: Tensor) -> None:
    """Slots index rows of the cache: out of range is an error, never an out-of-bounds write."""
    rows = k_cache.shape[0] * k_cache.shape[1]
    if slot_mapping.numel() and (slot_mapping.min() < 0 or slot_mapping.max() >= rows):
        fail(f"slot_mapping must be in [0, {rows}) (the cache's rows), got values in "
             f"[{slot_mapping.min().item()}, {slot_mapping.max().item()}]")


def rotate_half_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """`x cos + rotate_half(x) sin` per head (x [B, S, heads, d], cos/sin [B, S, d]), in fp32, rounded once."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xf, c, s = x.to(compute), cos[:, :, None].to(compute), sin[:, :, None].to(compute)
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * c + torch.cat([-x2, x1], dim=-1) * s).to(x.dtype)


def _norm(x: Tensor, norm_type: str, gamma, beta, eps) -> Tensor:
    if norm_type == "none":
        return x
    if norm_type == "layer_norm":
        return F.layer_norm(x, (x.shape[-1],), gamma, beta, eps)
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if norm_type == "gemma_rms_norm":  # times 1 + weight before rounding
        return (normed * (1.0 + gamma.to(normed.dtype))).to(x.dtype)
    normed = normed.to(x.dtype)  # transformers' Llama rounds before the weight
    return normed if norm_type == "rms_norm_skip_gamma" else gamma * normed


def write_cache(cache: Tensor, slots: Tensor, rows: Tensor, scale: Optional[Tensor]) -> None:
    """cache.view(-1, kv_dim)[slots] = rows, quantized as clamp(rows / scale) for an FP8 cache."""
    if scale is not None:
        limit = torch.finfo(FP8).max
        rows = (rows.float() / scale.float().reshape(())).clamp(-limit, limit)
    cache.view(-1, cache.shape[-1]).index_put_((slots.reshape(-1).long(),), rows.to(cache.dtype))


def _has_heads(fused_rope, output_layout, k_cache) -> bool:
    return fused_rope or output_layout == "NBSd" or k_cache is not None


# --- mla::qkv_projection: the GEMM, bias, RoPE and layout; the template's op -------------------------


# The schema by hand: infer_schema takes no optional list of tensors
@torch.library.custom_op(
    "mla::qkv_projection", mutates_args=(),
    schema="(Tensor x, Tensor[] weights, Tensor? bias, Tensor? cos_cache, Tensor? sin_cache, int d_head, "
           "int num_q_heads, int num_kv_heads, str output_layout, Tensor[]? weight_scales=None, "
           "str activation_quant='none', Tensor? input_scale=None, Tensor? q_norm_weight=None, "
           "Tensor? k_norm_weight=None, float head_norm_eps=1e-06, str head_norm_type='rms_norm') -> Tensor",
)
def qkv_projection(
    x: Tensor,
    weights: list[Tensor],
    bias: Optional[Tensor],
    cos_cache: Optional[Tensor],
    sin_cache: Optional[Tensor],
    d_head: int,
    num_q_heads: int,
    num_kv_heads: int,
    output_layout: str,
    weight_scales: Optional[list[Tensor]] = None,
    activation_quant: str = "none",
    input_scale: Optional[Tensor] = None,
    q_norm_weight: Optional[Tensor] = None,
    k_norm_weight: Optional[Tensor] = None,
    head_norm_eps: float = 1e-6,
    head_norm_type: str = "rms_norm",
) -> Tensor:
    """x [B, S, H] times the weights' rows ([N_i, H] each, concatenated) + bias, the q and k heads
    rotated when cos/sin are given, as [B, S, I] or [heads, B, S, d_head]. d_head is 0 when the
    output has no head structure (BSD, no RoPE).

    With `weight_scales` the weights are int8 or fp8 with one fp32 scale per output channel each
    (ops/weight_quant.py: torchao's int8 Linears, which the patterns fold in here), and with
    `activation_quant` x is quantized first, once for all weights: per token to int8 for W8A8 (int8
    weights), or to fp8 for the Neuron qkv kernel's ROW and STATIC types (fp8 weights; STATIC by the
    one fp32 `input_scale`). The GEMM runs in fp32 and its sum plus bias rounds once.

    With `q_norm_weight` / `k_norm_weight` ([d_head] each) every q and k head is RMS-normalised before
    RoPE from the rounded projection, as Qwen3's q_norm / k_norm do it (`head_norm_type` "rms_norm":
    rounded, then times the weight in the input dtype) or Gemma-3's ("gemma_rms_norm": times 1 + weight
    in fp32, then rounded)."""
    _check_input_scale(activation_quant, input_scale)
    _check_head_norms(_Fail("qkv_projection"), x, d_head, q_norm_weight, k_norm_weight, head_norm_type)
    if weight_scales is None:
        if activation_quant != "none":
            _Fail("qkv_projection")(f"activation_quant={activation_quant!r} needs quantized weights with weight_scales")
        out = F.linear(x, torch.cat(list(weights)), bias)
    else:
        _check_weight_scales(x, weights, weight_scales, activation_quant)
        out = torch.cat([linear_fp32(x, w, s, None, activation_quant, input_scale)
                         for w, s in zip(weights, weight_scales)], dim=-1)
        out = (out if bias is None else out + bias.float()).to(x.dtype)
    if d_head == 0:
        return out
    B, S, _ = out.shape
    heads = out.view(B, S, -1, d_head)
    qk = num_q_heads + num_kv_heads
    if q_norm_weight is not None:
        normed = [_norm(heads[:, :, :num_q_heads], head_norm_type, q_norm_weight, None, head_norm_eps),
                  _norm(heads[:, :, num_q_heads:qk], head_norm_type, k_norm_weight, None, head_norm_eps)]
        heads = torch.cat([*normed, heads[:, :, qk:]], dim=2)
    if cos_cache is not None:
        heads = torch.cat([rotate_half_rope(heads[:, :, :qk], cos_cache, sin_cache), heads[:, :, qk:]], dim=2)
    return (heads.reshape(B, S, -1) if output_layout == "BSD" else heads.permute(2, 0, 1, 3)).contiguous()


HEAD_NORM_TYPES = ("rms_norm", "gemma_rms_norm")


def _check_head_norms(fail, x, d_head, q_norm_weight, k_norm_weight, head_norm_type) -> None:
    if head_norm_type not in HEAD_NORM_TYPES:
        fail(f"head_norm_type must be one of {HEAD_NORM_TYPES}, got {head_norm_type!r}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        fail("q_norm_weight and k_norm_weight come together (Qwen3's q_norm and k_norm) or not at all")
    if q_norm_weight is None:
        return
    if not d_head:
        fail("q_norm_weight and k_norm_weight normalise heads: they need d_head > 0")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        _check_tensor(fail, name, w, x.dtype, [d_head])


def _check_input_scale(activation_quant, input_scale) -> None:
    fail = _Fail("qkv_projection")
    if (activation_quant == "fp8_static") != (input_scale is not None):
        given = "given" if input_scale is not None else "None"
        fail(f"input_scale is the activations' scale of activation_quant='fp8_static' (and only of it), "
             f"got activation_quant={activation_quant!r} with input_scale {given}")
    if input_scale is not None:
        _check_tensor(fail, "input_scale", input_scale, dtype=torch.float32)
        if input_scale.numel() != 1:
            fail(f"input_scale must hold one value, got {list(input_scale.shape)}")


def _check_weight_scales(x, weights, weight_scales, activation_quant) -> None:
    fail = _Fail("qkv_projection")
    if len(weight_scales) != len(weights):
        fail(f"weight_scales has {len(weight_scales)} scales for {len(weights)} weights")
    for i, (w, s) in enumerate(zip(weights, weight_scales)):
        check_quantized_weight(fail, f"weights[{i}]", w, f"weight_scales[{i}]", s, None, activation_quant, x.dtype,
                               schemes=ACTIVATION_QUANT + FP8_ACTIVATION_QUANT)
    if len({w.dtype for w in weights}) != 1:
        fail(f"the weights are quantized alike or not at all, got {[w.dtype for w in weights]}")


@qkv_projection.register_fake
def _(x, weights, bias, cos_cache, sin_cache, d_head, num_q_heads, num_kv_heads, output_layout, weight_scales=None,
      activation_quant="none", input_scale=None, q_norm_weight=None, k_norm_weight=None, head_norm_eps=1e-6,
      head_norm_type="rms_norm"):
    _check_input_scale(activation_quant, input_scale)
    _check_head_norms(_Fail("qkv_projection"), x, d_head, q_norm_weight, k_norm_weight, head_norm_type)
    if weight_scales is not None:
        _check_weight_scales(x, weights, weight_scales, activation_quant)
    out_features = sum(w.shape[0] for w in weights)
    return x.new_empty(_output_shape(x, out_features, output_layout, d_head))


def _forward(fail, input, weights, output_layout, bias, fused_residual_add, mlp_prev, attention_prev,
             fused_norm_type, gamma_norm_weights, layer_norm_bias, norm_eps, fused_rope, cos_cache, sin_cache,
             d_head, num_q_heads, num_kv_heads, k_cache, v_cache, k_scale, v_scale, slot_mapping,
             quantization=(None, "none", None), head_norms=(None, None, 1e-6, "rms_norm")):
    """Both composite ops, after their checks: `weights` are [N_i, H] rows; `quantization` is
    qkv_projection's (weight_scales, activation_quant, input_scale), `head_norms` its (q_norm_weight,
    k_norm_weight, head_norm_eps, head_norm_type)."""
    x, residual = input, input.new_empty(0)
    if fused_residual_add:
        for prev in (mlp_prev, attention_prev):
            if prev is not None:
                x = x + prev
        residual = x
    x = _norm(x, fused_norm_type, _vector(gamma_norm_weights), _vector(layer_norm_bias), norm_eps)
    with_heads = _has_heads(fused_rope, output_layout, k_cache)
    out = torch.ops.mla.qkv_projection(
        x, weights, _vector(bias), cos_cache if fused_rope else None, sin_cache if fused_rope else None,
        d_head if with_heads else 0, num_q_heads or 0, num_kv_heads or 0, output_layout, *quantization, *head_norms,
    )
    if k_cache is not None:
        if torch._guards.detect_fake_mode(slot_mapping) is None:  # eager: the values exist
            check_slots(fail, slot_mapping, k_cache)
        B, S, _ = input.shape
        heads = out.view(B, S, -1, d_head) if output_layout == "BSD" else out.permute(1, 2, 0, 3)
        k = heads[:, :, num_q_heads : num_q_heads + num_kv_heads].reshape(B * S, -1)
        v = heads[:, :, num_q_heads + num_kv_heads :].reshape(B * S, -1)
        write_cache(k_cache, slot_mapping, k, k_scale)
        write_cache(v_cache, slot_mapping, v, v_scale)
    return out, residual


def _output_shape(input, out_features, output_layout, d_head):
    B, S, _ = input.shape
    return [B, S, out_features] if output_layout == "BSD" else [out_features // d_head, B, S, d_head]


# --- mla::qkv: Neuron's contract ------------------------------------------------------------------

_QKV_FAIL = _Fail("qkv")


def _check_qkv(input, fused_qkv_weights, quantization_type, *args):
    _check_tensor(_QKV_FAIL, "fused_qkv_weights", fused_qkv_weights)
    if fused_qkv_weights.dim() != 2:
        _QKV_FAIL(f"fused_qkv_weights must be [H, I], got {list(fused_qkv_weights.shape)}")
    if quantization_type not in QUANTIZATION_TYPES:
        _QKV_FAIL(f"quantization_type must be one of {QUANTIZATION_TYPES}, got {quantization_type!r}")
    expected = input.dtype if quantization_type == "none" else FP8
    if isinstance(input, Tensor) and fused_qkv_weights.dtype != expected:
        what = "input's" if quantization_type == "none" else f"quantization_type={quantization_type!r}:"
        _QKV_FAIL(f"fused_qkv_weights has dtype {fused_qkv_weights.dtype}, expected {what} {expected}")
    hidden, out_features = fused_qkv_weights.shape
    check_args(_QKV_FAIL, input, out_features, hidden, *args)


def _qkv_quantization(quantization_type, out_features, qkv_w_scale, qkv_in_scale, d_head, num_q_heads,
                      num_kv_heads):
    """qkv_projection's (weight_scales, activation_quant, input_scale) for Neuron's quantization types:
    ROW scales each of the I weight columns ([1, I] or [I]) and quantizes each token's activations to
    fp8 by its own absmax; STATIC scales the q, k and v columns by one number each ([1, 3] or [3]) and
    quantizes the activations by the one qkv_in_scale ([1, 1], [1] or []). fp8 is float8_e4m3fn
    (ops/weight_quant.py), whose largest value is 448 (Trainium 1 and 2 clamp at 240)."""
    if quantization_type == "none":
        if qkv_w_scale is not None or qkv_in_scale is not None:
            _QKV_FAIL("qkv_w_scale and qkv_in_scale belong to quantization_type 'row' or 'static'")
        return None, "none", None
    if qkv_w_scale is None:
        _QKV_FAIL(f"quantization_type={quantization_type!r} needs qkv_w_scale")
    _check_tensor(_QKV_FAIL, "qkv_w_scale", qkv_w_scale, dtype=torch.float32)
    if quantization_type == "row":
        if qkv_in_scale is not None:
            _QKV_FAIL("qkv_in_scale is STATIC quantization's; quantization_type 'row' scales each token itself")
        if tuple(qkv_w_scale.shape) not in ((out_features,), (1, out_features)):
            _QKV_FAIL(f"qkv_w_scale must be [1, {out_features}] or [{out_features}] for 'row', "
                      f"got {list(qkv_w_scale.shape)}")
        return [qkv_w_scale.reshape(out_features)], "fp8_row", None
    if tuple(qkv_w_scale.shape) not in ((3,), (1, 3)):
        _QKV_FAIL(f"qkv_w_scale must be [1, 3] or [3] (q, k, v) for 'static', got {list(qkv_w_scale.shape)}")
    if qkv_in_scale is None:
        _QKV_FAIL("quantization_type 'static' needs qkv_in_scale")
    _check_tensor(_QKV_FAIL, "qkv_in_scale", qkv_in_scale, dtype=torch.float32)
    if qkv_in_scale.numel() != 1:
        _QKV_FAIL(f"qkv_in_scale must hold one value ([1, 1]), got {list(qkv_in_scale.shape)}")
    if not (d_head and num_q_heads and num_kv_heads):
        _QKV_FAIL("quantization_type 'static' needs d_head, num_q_heads and num_kv_heads (the q, k, v columns)")
    widths = (num_q_heads * d_head, num_kv_heads * d_head, num_kv_heads * d_head)
    if sum(widths) != out_features:
        _QKV_FAIL(f"(num_q_heads + 2 num_kv_heads) * d_head = {sum(widths)} must equal I = {out_features}")
    w = qkv_w_scale.reshape(3)
    columns = torch.cat([w[i : i + 1].expand(n) for i, n in enumerate(widths)])
    return [columns], "fp8_static", qkv_in_scale.reshape(1)


_LIB = torch.library.Library("mla", "FRAGMENT")
_LIB.define(
    "qkv(Tensor input, Tensor fused_qkv_weights, str output_layout=\"BSD\", Tensor? bias=None, "
    "str quantization_type=\"none\", Tensor? qkv_w_scale=None, Tensor? qkv_in_scale=None, "
    "bool fused_residual_add=False, Tensor? mlp_prev=None, Tensor? attention_prev=None, "
    "str fused_norm_type=\"none\", Tensor? gamma_norm_weights=None, Tensor? layer_norm_bias=None, "
    "float norm_eps=1e-06, bool fused_rope=False, Tensor? cos_cache=None, Tensor? sin_cache=None, "
    "int? d_head=None, int? num_q_heads=None, int? num_kv_heads=None, Tensor(a!)? k_cache=None, "
    "Tensor(b!)? v_cache=None, Tensor? k_scale=None, Tensor? v_scale=None, bool use_block_kv=False, "
    "int? block_size=None, Tensor? slot_mapping=None) -> (Tensor, Tensor)"
)
_LIB.define(
    "gqa_qkv(Tensor input, Tensor q_weight, Tensor k_weight, Tensor v_weight, Tensor? q_bias, Tensor? k_bias, "
    "Tensor? v_bias, str output_layout, bool fused_residual_add, Tensor? mlp_prev, str fused_norm_type, "
    "Tensor? gamma_norm_weights, float norm_eps, bool fused_rope, Tensor? cos_cache, Tensor? sin_cache, "
    "int d_head, int num_q_heads, int num_kv_heads, Tensor? q_norm_weight=None, Tensor? k_norm_weight=None, "
    "float head_norm_eps=1e-06, str head_norm_type=\"rms_norm\", Tensor? norm_eps_tensor=None) -> (Tensor, Tensor)"
)


@torch.library.impl(_LIB, "qkv", "CompositeImplicitAutograd")
def qkv(input, fused_qkv_weights, output_layout="BSD", bias=None, quantization_type="none", qkv_w_scale=None,
        qkv_in_scale=None, fused_residual_add=False, mlp_prev=None, attention_prev=None, fused_norm_type="none",
        gamma_norm_weights=None, layer_norm_bias=None, norm_eps=1e-6, fused_rope=False, cos_cache=None,
        sin_cache=None, d_head=None, num_q_heads=None, num_kv_heads=None, k_cache=None, v_cache=None, k_scale=None,
        v_scale=None, use_block_kv=False, block_size=None, slot_mapping=None):
    options = (output_layout, bias, fused_residual_add, mlp_prev, attention_prev, fused_norm_type, gamma_norm_weights,
               layer_norm_bias, norm_eps, fused_rope, cos_cache, sin_cache, d_head, num_q_heads, num_kv_heads)
    cache = (k_cache, v_cache, k_scale, v_scale)
    _check_qkv(input, fused_qkv_weights, quantization_type, *options, *cache, use_block_kv, block_size, slot_mapping)
    quantization = _qkv_quantization(quantization_type, fused_qkv_weights.shape[1], qkv_w_scale, qkv_in_scale,
                                     d_head, num_q_heads, num_kv_heads)
    # [H, I] -> nn.Linear's [I, H] rows: a view (frozen weights are packed from it at compile time)
    return _forward(_QKV_FAIL, input, [fused_qkv_weights.t()], *options, *cache, slot_mapping, quantization)


def reference_fp64(input, fused_qkv_weights, bias=None, residual=(), norm=("none", None, None, 1e-6), rope=None):
    """An independent fp64 computation of the BSD output for tests: residual terms, norm, GEMM, bias,
    and rotate_half of q and k heads written per element. `rope` = (cos, sin, d_head, num_q_heads + num_kv_heads)."""
    d = torch.float64
    x = input.to(d) + sum((t.to(d) for t in residual), torch.zeros((), dtype=d))
    norm_type, gamma, beta, eps = norm
    if norm_type in ("rms_norm", "rms_norm_skip_gamma", "gemma_rms_norm"):
        x = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
        if norm_type == "rms_norm":
            x = x * gamma.to(d).reshape(-1)
        elif norm_type == "gemma_rms_norm":
            x = x * (1 + gamma.to(d).reshape(-1))
    elif norm_type == "layer_norm":
        mu = x.mean(-1, keepdim=True)
        x = (x - mu) / torch.sqrt(((x - mu) ** 2).mean(-1, keepdim=True) + eps) * gamma.to(d).reshape(-1)
        if beta is not None:
            x = x + beta.to(d).reshape(-1)
    out = x @ fused_qkv_weights.to(d)
    if bias is not None:
        out = out + bias.to(d).reshape(-1)
    if rope is not None:
        cos, sin, d_head, rotated_heads = rope
        half = d_head // 2
        rotated = out.clone()
        for h in range(rotated_heads):
            base = h * d_head
            for i in range(d_head):
                partner = base + (i + half) % d_head
                sign = -1.0 if i < half else 1.0
                rotated[..., base + i] = out[..., base + i] * cos[..., i].to(d) + sign * out[..., partner] * sin[..., i].to(d)
        out = rotated
    return out


# --- mla::gqa_qkv: the same from nn.Linear's three weights ------------------------------------------

_GQA_FAIL = _Fail("gqa_qkv")


def _check_gqa(input, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, output_layout, fused_residual_add,
               mlp_prev, fused_norm_type, gamma_norm_weights, norm_eps, fused_rope, cos_cache, sin_cache, d_head,
               num_q_heads, num_kv_heads, q_norm_weight, k_norm_weight, head_norm_type):
    weights = {"q_weight": q_weight, "k_weight": k_weight, "v_weight": v_weight}
    for name, w in weights.items():
        _check_tensor(_GQA_FAIL, name, w)
        if w.dim() != 2 or w.shape[1] != q_weight.shape[1]:
            _GQA_FAIL(f"{name} must be [N, H] with q_weight's H={q_weight.shape[1]}, got {list(w.shape)}")
        if isinstance(input, Tensor) and w.dtype != input.dtype:
            _GQA_FAIL(f"{name} has dtype {w.dtype}, expected input's {input.dtype}")
    if k_weight.shape != v_weight.shape:
        _GQA_FAIL(f"k_weight {list(k_weight.shape)} and v_weight {list(v_weight.shape)} must have one shape")
    biases = (q_bias, k_bias, v_bias)
    if any(b is not None for b in biases) and any(b is None for b in biases):
        _GQA_FAIL("q_bias, k_bias and v_bias come together (Qwen2) or not at all (Llama)")
    for name, b, w in (("q_bias", q_bias, q_weight), ("k_bias", k_bias, k_weight), ("v_bias", v_bias, v_weight)):
        if b is not None:
            _check_tensor(_GQA_FAIL, name, b, w.dtype, [w.shape[0]])
    out_features = sum(w.shape[0] for w in weights.values())
    check_args(_GQA_FAIL, input, out_features, q_weight.shape[1], output_layout, None, fused_residual_add, mlp_prev,
               None, fused_norm_type, gamma_norm_weights, None, norm_eps, fused_rope, cos_cache, sin_cache, d_head,
               num_q_heads, num_kv_heads, None, None, None, None, False, None, None)
    if q_weight.shape[0] != num_q_heads * d_head:
        _GQA_FAIL(f"q_weight has {q_weight.shape[0]} rows, expected num_q_heads * d_head = {num_q_heads * d_head}")
    _check_head_norms(_GQA_FAIL, input, d_head, q_norm_weight, k_norm_weight, head_norm_type)


@torch.library.impl(_LIB, "gqa_qkv", "CompositeImplicitAutograd")
def gqa_qkv(input, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, output_layout, fused_residual_add, mlp_prev,
            fused_norm_type, gamma_norm_weights, norm_eps, fused_rope, cos_cache, sin_cache, d_head, num_q_heads,
            num_kv_heads, q_norm_weight=None, k_norm_weight=None, head_norm_eps=1e-6, head_norm_type="rms_norm",
            norm_eps_tensor=None):
    """`norm_eps_tensor`, a one-element tensor, is the input norm's eps in place of `norm_eps`: what a model's
    float eps is under `torch.compile(dynamic=True)`, where Dynamo passes it as a graph input."""
    if norm_eps_tensor is not None and (not isinstance(norm_eps_tensor, Tensor) or norm_eps_tensor.numel() != 1):
        got = list(norm_eps_tensor.shape) if isinstance(norm_eps_tensor, Tensor) else type(norm_eps_tensor).__name__
        _GQA_FAIL(f"norm_eps_tensor must be a one-element tensor, got {got}")
    _check_gqa(input, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, output_layout, fused_residual_add,
               mlp_prev, fused_norm_type, gamma_norm_weights, norm_eps, fused_rope, cos_cache, sin_cache, d_head,
               num_q_heads, num_kv_heads, q_norm_weight, k_norm_weight, head_norm_type)
    bias = None if q_bias is None else torch.cat([q_bias, k_bias, v_bias])
    eps = norm_eps if norm_eps_tensor is None else norm_eps_tensor.reshape(())
    return _forward(_GQA_FAIL, input, [q_weight, k_weight, v_weight], output_layout, bias, fused_residual_add,
                    mlp_prev, None, fused_norm_type, gamma_norm_weights, None, eps, fused_rope, cos_cache,
                    sin_cache, d_head, num_q_heads, num_kv_heads, None, None, None, None, None,
                    head_norms=(q_norm_weight, k_norm_weight, head_norm_eps, head_norm_type))
