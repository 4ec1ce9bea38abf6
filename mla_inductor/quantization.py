"""Quantized Linears written in plain PyTorch: keeping a model's fp8 weights fp8 on CPU (Linears over
float8_e4m3fn weights with fp32 block scales, DeepSeek-V3 / R1's released format, whose forward
dequantizes the weight), and SGLang's int8 W8A8 Linear as serving code spells it (`W8A8Linear`).

transformers loads an fp8 DeepSeek checkpoint on CPU only by dequantizing it to bf16 at load time, and
its `FP8Linear` forward runs GPU kernels. `BlockFp8Linear` holds the checkpoint's tensors as they are
(`weight` e4m3 [N, K], `weight_scale_inv` fp32 [ceil(N / bN), ceil(K / bK)]) and spells the
dequantization out, so the mla_inductor backend finds it (patterns/quantized_linear.py): the fused
projections read the fp8 weight in their kernels, and Linears no fusion takes run as the model wrote
them. Under `freezing=True` stock Inductor folds every such dequantization into a bf16 constant;
the fused ones stay one byte a weight.

    model = ...  # built from its config, bf16
    keep_fp8_weights_(model, state_dict)  # the checkpoint's fp8 tensors, e.g. from safetensors
    compiled = torch.compile(model, backend="mla_inductor")
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .ops.weight_quant import (INT8_MAX, INT8_MIN_ABSMAX, check_quantized_weight, quantize_weight_fp8_blocks,
                                quantize_weight_int8)

DEFAULT_BLOCK_SIZE = (128, 128)


class BlockFp8Linear(nn.Module):
    """y = x @ dequantized(weight).T + bias, the weight dequantized per block in fp32 and rounded once
    to the activations' dtype, as DeepSeek's reference dequantizes it."""

    def __init__(self, weight: Tensor, weight_scale_inv: Tensor, block_size: Sequence[int] = DEFAULT_BLOCK_SIZE,
                 bias: Optional[Tensor] = None) -> None:
        super().__init__()
        block_size = [int(b) for b in block_size]
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"BlockFp8Linear: weight must be float8_e4m3fn, got {weight.dtype}")
        check_quantized_weight(_failing("BlockFp8Linear"), "weight", weight, "weight_scale_inv", weight_scale_inv,
                               block_size, "none", torch.bfloat16)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(weight_scale_inv, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.block_size = block_size

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def dequantized_weight(self, dtype: torch.dtype) -> Tensor:
        rows, cols = self.weight.shape
        block_rows, block_cols = self.block_size
        scale = self.weight_scale_inv.repeat_interleave(block_rows, 0)[:rows]
        scale = scale.repeat_interleave(block_cols, 1)[:, :cols]
        return (self.weight.float() * scale).to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, block_size: Sequence[int] = DEFAULT_BLOCK_SIZE) -> "BlockFp8Linear":
        """A Linear's weight quantized as the checkpoints are (absmax / 448 per block): for models built
        with random weights, which stand for the checkpoint here."""
        weight, scale = quantize_weight_fp8_blocks(linear.weight.detach(), block_size)
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(weight, scale, block_size, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block_size={self.block_size}"


class W8A8Linear(nn.Module):
    """SGLang's int8 W8A8 Linear spelled in PyTorch, as serving code without its kernel runs it: x
    quantized per token (absmax / 127, round half to even), `torch._int_mm` with the int8 weight, the
    int32 product times the token's scale and the channel's (`weight_scale` [N, 1] fp32), one rounding."""

    def __init__(self, weight: Tensor, weight_scale: Tensor, bias: Optional[Tensor] = None) -> None:
        super().__init__()
        if weight.dtype != torch.int8:
            raise ValueError(f"W8A8Linear: weight must be int8, got {weight.dtype}")
        check_quantized_weight(_failing("W8A8Linear"), "weight", weight, "weight_scale", weight_scale, None, "int8",
                               torch.bfloat16)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        absmax = rows.float().abs().amax(-1, keepdim=True).clamp(min=INT8_MIN_ABSMAX)
        quantized = torch.round(rows.float() * (INT8_MAX / absmax)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        product = torch._int_mm(quantized, self.weight.t()).float()
        y = (product * (absmax / INT8_MAX) * self.weight_scale.view(1, -1)).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*x.shape[:-1], -1)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "W8A8Linear":
        weight, scale = quantize_weight_int8(linear.weight.detach())
        return cls(weight, scale, None if linear.bias is None else linear.bias.detach())


def keep_fp8_weights_(model: nn.Module, state_dict: Optional[Mapping[str, Tensor]] = None,
                      block_size: Sequence[int] = DEFAULT_BLOCK_SIZE) -> list[str]:
    """Turns the model's fp8 Linears into `BlockFp8Linear`s, in place; returns their names.

    A Linear is fp8 when `state_dict` holds `<name>.weight` in float8_e4m3fn and `<name>.weight_scale_inv`
    (a checkpoint's tensors; `block_size` is the checkpoint's `weight_block_size`), or when the module
    itself holds them (transformers' `FP8Linear`, with its own `block_size`; None there means one scale
    for the whole weight)."""
    replaced = []
    for name, module in list(model.named_modules()):
        if not name:
            continue  # the model itself: there is no parent to hold its replacement
        prefix = f"{name}."
        if state_dict is not None and isinstance(module, nn.Linear) and _is_fp8(state_dict.get(prefix + "weight")):
            scale = state_dict.get(prefix + "weight_scale_inv")
            if scale is None:
                raise ValueError(f"keep_fp8_weights_: state_dict has an fp8 {prefix}weight but no {prefix}weight_scale_inv")
            bias = state_dict.get(prefix + "bias", module.bias)
            new = BlockFp8Linear(state_dict[prefix + "weight"], scale.float(), block_size,
                                 None if bias is None else bias.detach())
        elif not isinstance(module, BlockFp8Linear) and _is_fp8(getattr(module, "weight", None)) and isinstance(
                getattr(module, "weight_scale_inv", None), Tensor):
            weight = module.weight.detach()
            own_block = getattr(module, "block_size", None) or weight.shape  # None: one per-tensor scale
            scale = module.weight_scale_inv.detach().float().reshape(
                -(-weight.shape[0] // own_block[0]), -(-weight.shape[1] // own_block[1]))
            bias = getattr(module, "bias", None)
            new = BlockFp8Linear(weight, scale, own_block, None if bias is None else bias.detach())
        else:
            continue
        _set_submodule(model, name, new)
        replaced.append(name)
    return replaced


def quantize_fp8_(model: nn.Module, block_size: Sequence[int] = DEFAULT_BLOCK_SIZE,
                  exclude: Sequence[str] = ("lm_head",)) -> list[str]:
    """Every Linear of the model (but those named in or under `exclude`) quantized to fp8 blocks as a
    released checkpoint holds it, in place: for models built from a config with random weights,
    standing for the checkpoint. Returns the names."""
    return _replace_linears(model, lambda linear: BlockFp8Linear.from_linear(linear, block_size), exclude)


def quantize_w8a8_(model: nn.Module, exclude: Sequence[str] = ("lm_head",)) -> list[str]:
    """Every Linear of the model (but `exclude`) as SGLang's W8A8 holds it (int8 weights, absmax / 127
    per channel), in place. Returns the names."""
    return _replace_linears(model, W8A8Linear.from_linear, exclude)


def _replace_linears(model: nn.Module, make, exclude: Sequence[str]) -> list[str]:
    replaced = []
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and not any(name == e or name.startswith(f"{e}.") for e in exclude):
            _set_submodule(model, name, make(module))
            replaced.append(name)
    return replaced


def _is_fp8(tensor) -> bool:
    return isinstance(tensor, Tensor) and tensor.dtype == torch.float8_e4m3fn and tensor.dim() == 2


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def _failing(owner: str) -> Callable[[str], None]:
    def fail(message: str) -> None:
        raise ValueError(f"{owner}: {message}")

    return fail


__all__ = ["BlockFp8Linear", "DEFAULT_BLOCK_SIZE", "W8A8Linear", "keep_fp8_weights_", "quantize_fp8_", "quantize_w8a8_"]
