"""mla::linear: nn.Linear's product, y = x . weight^T + bias, for the Linears no fusion takes.

    x [M, K], weight [N, K] (nn.Linear's layout), bias [N] or None  ->  y [M, N] in x's dtype

On a CPU without a native bf16 GEMM (no AVX512-BF16: AVX2 EPYCs, Skylake / Cascade Lake Xeons) a bf16
Linear runs ATen's or oneDNN's emulated path at 2-20 GFLOP/s, and an fp16 one wherever AVX512-FP16 is
missing, where widening the weights to fp32 in registers reaches the fp32 FMA rate or, at decode, the
memory bandwidth (docs/linear.md). The linear
fusion (patterns/linear.py) gives such Linears this op, which lowers to the projection templates' GEMM
(lowerings/linear.py): the output rounded once from fp32 sums, the bias added to them first.

The eager implementation is `F.linear` itself, what the model ran before the rewrite: the op changes
where the product runs, not what it is.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .checks import check_cpu_tensors

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _fail(message: str) -> None:
    raise ValueError(f"mla::linear: {message}")


def check_args(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> None:
    check_cpu_tensors(_fail, dict(x=x, weight=weight) | ({} if bias is None else dict(bias=bias)))
    if x.dtype not in SUPPORTED_DTYPES:
        _fail(f"x has dtype {x.dtype}; supported: bfloat16, float16, float32")
    if x.dim() != 2:
        _fail(f"x must be [rows, in_features], got {list(x.shape)}")
    if weight.dtype != x.dtype or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        _fail(f"weight must be {x.dtype}[out_features, {x.shape[1]}] (nn.Linear's layout) for x "
              f"{list(x.shape)}, got {weight.dtype}{list(weight.shape)}")
    if bias is not None and (bias.dtype != x.dtype or list(bias.shape) != [weight.shape[0]]):
        _fail(f"bias must be {x.dtype}[{weight.shape[0]}] or None, got {bias.dtype}{list(bias.shape)}")


@torch.library.custom_op("mla::linear", mutates_args=())
def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    check_args(x, weight, bias)
    return F.linear(x, weight, bias)


@linear.register_fake
def _(x, weight, bias=None):
    check_args(x, weight, bias)
    return x.new_empty(x.shape[0], weight.shape[0])
