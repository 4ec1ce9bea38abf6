"""Argument checks shared by the mla:: ops' `check_args`."""

from __future__ import annotations

from typing import Callable, Mapping

from torch import Tensor


def check_cpu_tensors(fail: Callable[[str], None], tensors: Mapping[str, object]) -> None:
    """Each named argument must be a CPU tensor: the templates read host memory. `fail` raises the
    op's error with the message."""
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            fail(f"{name} must be a Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            fail(f"{name} must be on the CPU, got {t.device}")
