"""Quantized projection weights, shared by the projection ops (qkv_a_proj, q_b_absorb): what a weight
and its scale may be, the dequantization the references compute, and SGLang's per-token activation
quantization.

A quantized weight is int8 or float8_e4m3fn, [N, K] as nn.Linear holds it, with an fp32 scale:
  - per output channel: scale [N] or [N, 1] (SGLang's W8A8 and torchao's int8 weights), weight_block_size None;
  - per block of bN rows by bK columns: scale [ceil(N / bN), ceil(K / bK)] with weight_block_size [bN, bK]
    (DeepSeek-V3's released fp8 format, SGLang's W8A16; the last blocks may be partial).
The weight's value is weight.float() * scale of its block, as every anchor dequantizes it.

activation_quant names what happens to the activations first:
  - "none": they stay in their dtype (weight-only quantization, W8A16);
  - "int8": SGLang's W8A8: each token symmetrically to int8 (scale max(|x|, 1e-7) / 127, round half
    to even), and the GEMM's integer sum times both scales. Only with int8 weights.
  - "int8_torchao": the same with torchao's per-token scheme (Int8DynamicActivationInt8WeightConfig):
    scale absmax / 127.5 rounded to the activations' dtype and at least fp32's epsilon, q = round(x /
    scale) in [-128, 127].
  - "fp8_row" and "fp8_static": the Neuron qkv kernel's FP8 quantization of the activations (its
    ROW and STATIC types), with float8_e4m3fn weights: q = e4m3fn(clamp(x * (1 / scale), +-448))
    (round to nearest even), the scale absmax / 448 per token (at least 1e-12 / 448, so that a zero
    row quantizes to zeros) or one given `input_scale` for all of them; the GEMM's fp32 sum of the
    exact products times both scales.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from .checks import check_cpu_tensors

QUANTIZED_WEIGHT_DTYPES = (torch.int8, torch.float8_e4m3fn)
ACTIVATION_QUANT = ("none", "int8", "int8_torchao")  # what every projection op takes
FP8_ACTIVATION_QUANT = ("fp8_row", "fp8_static")  # also mla::qkv_projection (Neuron's qkv kernel)
FP8_E4M3_MAX = 448.0
FP8_MIN_ABSMAX = 1e-12
TORCHAO_INT8_LEVELS = 127.5  # torchao: (qmax - qmin) / 2 for [-128, 127]
INT8_MAX = 127.0
INT8_MIN_ABSMAX = 1e-7


def is_quantized(weight: Tensor) -> bool:
    return weight.dtype in QUANTIZED_WEIGHT_DTYPES


def scale_grid(weight_shape: Sequence[int], block_size: Optional[Sequence[int]]) -> tuple[int, int]:
    """The shape of a weight's scale: [N, 1] per channel, or the ceil-divided block grid."""
    n, k = weight_shape
    if block_size is None:
        return n, 1
    bn, bk = block_size
    return -(-n // bn), -(-k // bk)


def check_quantized_weight(fail: Callable[[str], None], name: str, weight: Tensor, scale_name: str,
                           scale: Optional[Tensor], block_size: Optional[Sequence[int]],
                           activation_quant: str, activation_dtype: torch.dtype,
                           schemes: Sequence[str] = ACTIVATION_QUANT) -> None:
    """A weight is either in the activation dtype with no scale, or quantized with one (module doc);
    `schemes` are the activation_quant values the op takes."""
    if activation_quant not in schemes:
        fail(f"activation_quant must be one of {tuple(schemes)}, got {activation_quant!r}")
    if not is_quantized(weight):
        if scale is not None:
            fail(f"{scale_name} dequantizes an int8 or float8_e4m3fn {name}; {name} is {weight.dtype}")
        if weight.dtype != activation_dtype:
            fail(f"{name} has dtype {weight.dtype}, expected the activations' dtype {activation_dtype} "
                 f"(or int8 / float8_e4m3fn with {scale_name})")
        if activation_quant != "none":
            fail(f"activation_quant={activation_quant!r} needs an int8 {name}, got {weight.dtype}")
        return
    if scale is None:
        fail(f"{name} is {weight.dtype}: it needs its fp32 {scale_name}")
    check_cpu_tensors(fail, {scale_name: scale})
    if scale.dtype != torch.float32:
        fail(f"{scale_name} must be float32, got {scale.dtype}")
    if activation_quant in ACTIVATION_QUANT[1:] and weight.dtype != torch.int8:
        fail(f"activation_quant={activation_quant!r} (W8A8) needs an int8 {name}, got {weight.dtype}")
    if activation_quant in FP8_ACTIVATION_QUANT and weight.dtype != torch.float8_e4m3fn:
        fail(f"activation_quant={activation_quant!r} needs a float8_e4m3fn {name}, got {weight.dtype}")
    if activation_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        fail(f"quantized {name} needs bf16, fp16 or fp32 activations, got {activation_dtype}")
    if weight.dim() != 2:
        fail(f"{name} must be [N, K], got {list(weight.shape)}")
    if block_size is not None:
        if len(block_size) != 2 or any(not isinstance(b, int) or b <= 0 for b in block_size):
            fail(f"weight_block_size must be two positive ints [block_n, block_k], got {list(block_size)}")
        if activation_quant != "none":
            what = "W8A8" if activation_quant in ACTIVATION_QUANT else "FP8 activations"
            fail(f"{what} (activation_quant={activation_quant!r}) takes per-channel weight scales; "
                 "weight_block_size must be None")
    rows, cols = scale_grid(weight.shape, block_size)
    per_channel_1d = block_size is None and tuple(scale.shape) == (rows,)
    if tuple(scale.shape) != (rows, cols) and not per_channel_1d:
        expected = f"[{rows}] or [{rows}, 1] (per channel)" if block_size is None else (
            f"[{rows}, {cols}] (ceil({weight.shape[0]} / {block_size[0]}), ceil({weight.shape[1]} / {block_size[1]}))")
        fail(f"{scale_name} must be {expected} for {name} {list(weight.shape)}, got {list(scale.shape)}")


def dequantize_weight(weight: Tensor, scale: Optional[Tensor], block_size: Optional[Sequence[int]],
                      dtype: torch.dtype = torch.float32) -> Tensor:
    """weight.float() * the scale of each element's block, in `dtype` (no rounding before that)."""
    if scale is None:
        return weight.to(dtype)
    n, k = weight.shape
    if block_size is None:
        return weight.to(dtype) * scale.reshape(n, 1).to(dtype)
    bn, bk = block_size
    expanded = scale.to(dtype).repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return weight.to(dtype) * expanded


def quantize_weight_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """A weight as symmetric int8 per output channel, as SGLang's W8A8 and torchao's int8 weights hold
    it: (int8 [N, K], fp32 scale [N, 1] = absmax / 127 of each row)."""
    scale = weight.float().abs().amax(1, keepdim=True).clamp_min(INT8_MIN_ABSMAX) / INT8_MAX
    return torch.round(weight.float() / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def quantize_weight_fp8_blocks(weight: Tensor, block_size: Sequence[int] = (128, 128)) -> tuple[Tensor, Tensor]:
    """A weight as float8_e4m3fn per block, as DeepSeek-V3's checkpoints hold it: (e4m3 [N, K], fp32
    scale [ceil(N / bN), ceil(K / bK)] = absmax / 448 of each block), partial blocks at the ends."""
    n, k = weight.shape
    bn, bk = block_size
    padded = torch.nn.functional.pad(weight.float(), (0, -k % bk, 0, -n % bn))
    blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = blocks.abs().amax((1, 3)).clamp_min(1e-12) / torch.finfo(torch.float8_e4m3fn).max
    q = (blocks / scale[:, None, :, None]).view_as(padded)[:n, :k]
    return q.to(torch.float8_e4m3fn), scale


def quantize_rows_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """SGLang's per-token symmetric int8 quantization in fp32: (q, scale) with x ~ q * scale,
    q = round(x * 127 / absmax) half to even, scale = absmax / 127 per row ([..., 1]); absmax is
    max(|x|) and at least 1e-7, so that a zero row quantizes to zeros."""
    xf = x.float()
    absmax = xf.abs().amax(-1, keepdim=True).clamp_min(INT8_MIN_ABSMAX)
    q = torch.round(xf * (INT8_MAX / absmax)).clamp(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), absmax / INT8_MAX


def quantize_rows_int8_torchao(x: Tensor) -> tuple[Tensor, Tensor]:
    """torchao's per-token symmetric int8 quantization (Int8DynamicActivationInt8WeightConfig):
    (q, scale), scale = absmax / 127.5 computed and rounded in x's dtype, at least fp32's epsilon,
    then q = round(x / scale) half to even, in [-128, 127]."""
    absmax = x.abs().amax(-1, keepdim=True)
    scale = (absmax / TORCHAO_INT8_LEVELS).float().clamp_min(torch.finfo(torch.float32).eps).to(x.dtype).float()
    q = torch.round(x.float() * (1 / scale)).clamp(-128, 127)
    return q.to(torch.int8), scale


def quantize_rows_fp8(x: Tensor, input_scale: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """The Neuron qkv kernel's FP8 quantization of activations (module doc): (float8_e4m3fn q, fp32
    scale [..., 1]), per token ("fp8_row") or by the one `input_scale` ("fp8_static")."""
    xf = x.float()
    if input_scale is None:
        scale = xf.abs().amax(-1, keepdim=True).clamp_min(FP8_MIN_ABSMAX) / FP8_E4M3_MAX
    else:
        scale = input_scale.float().reshape(1).expand(*x.shape[:-1], 1)
    q = (xf * (1 / scale)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_rows(x: Tensor, activation_quant: str, input_scale: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """x quantized per token by an activation scheme (module doc): (q, fp32 scale [..., 1])."""
    if activation_quant in FP8_ACTIVATION_QUANT:
        return quantize_rows_fp8(x, input_scale if activation_quant == "fp8_static" else None)
    return quantize_rows_int8_torchao(x) if activation_quant == "int8_torchao" else quantize_rows_int8(x)


def linear_fp32(x: Tensor, weight: Tensor, scale: Optional[Tensor], block_size: Optional[Sequence[int]],
                activation_quant: str = "none", input_scale: Optional[Tensor] = None) -> Tensor:
    """x @ dequantized(weight).T in fp32, after the quantization of x's rows that activation_quant
    names: the projection every quantized anchor computes, before its output's one rounding."""
    w = dequantize_weight(weight, scale, block_size)
    if activation_quant != "none":
        q, x_scale = quantize_rows(x, activation_quant, input_scale)
        return (q.float() @ w.T) * x_scale
    return x.float() @ w.T


@torch.library.custom_op("mla::dequantize_weight", mutates_args=())
def dequantize_weight_op(weight: Tensor, scale: Tensor, weight_block_size: Optional[list[int]],
                         dtype: torch.dtype) -> Tensor:
    """A quantized Linear's weight as its GEMM reads it, in the activations' `dtype`: the form the
    patterns give every spelling of a quantized Linear (patterns/quantized_linear.py) so that the
    fusions match it as a Linear. It never reaches Inductor's lowering: the pass folds it into the
    fused ops or writes it back in aten. The scale may be in any floating dtype the model keeps it
    in (torchao's graphs cast it to the activations' dtype); it is widened to fp32 exactly."""
    scale = scale.float()
    check_quantized_weight(_fail_dequantize, "weight", weight, "scale", scale, weight_block_size, "none", dtype)
    return dequantize_weight(weight, scale, weight_block_size).to(dtype)


@dequantize_weight_op.register_fake
def _(weight, scale, weight_block_size, dtype):
    return weight.new_empty(weight.shape, dtype=dtype)


def _fail_dequantize(message: str) -> None:
    raise ValueError(f"mla::dequantize_weight: {message}")
