"""Argument checks shared by the mla:: ops' `check_args`."""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch
from torch import Tensor


def check_cpu_tensors(fail: Callable[[str], None], tensors: Mapping[str, object]) -> None:
    """Each named argument must be a CPU tensor: the templates read host memory. `fail` raises the
    op's error with the message."""
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            fail(f"{name} must be a Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            fail(f"{name} must be on the CPU, got {t.device}")


FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_cache_scale(fail: Callable[[str], None], name: str, scale: Optional[Tensor], cache: Tensor,
                      cache_name: str) -> None:
    """`scale` dequantizes the fp8 `cache` as cache.float() * scale: None (1), or an fp32 tensor that
    broadcasts against the cache and holds one value per row (size 1 in the last dim): per tensor, per
    token, per head."""
    if scale is None:
        return
    if cache.dtype not in FP8_CACHE_DTYPES:
        fail(f"{name} dequantizes an fp8 {cache_name}; {cache_name} is {cache.dtype}")
    check_cpu_tensors(fail, {name: scale})
    if scale.dtype != torch.float32:
        fail(f"{name} must be float32, got {scale.dtype}")
    rows = list(cache.shape[:-1]) + [1]
    aligned = rows[len(rows) - scale.dim():] if scale.dim() else []
    if scale.dim() > cache.dim() or any(s not in (1, r) for s, r in zip(scale.shape, aligned)):
        fail(f"{name} must broadcast against {cache_name}'s rows {rows} (one scale per tensor, token or head), "
             f"got {list(scale.shape)}")
