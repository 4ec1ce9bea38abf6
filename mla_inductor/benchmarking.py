"""Measurement helpers shared by `benchmarks/` and the report.

Rules (docs/DESIGN.md): compare in one process, interleaved, as ratios; quote medians; measure the
roofline (copy bandwidth, oneDNN GEMM throughput) in the same run; time only memory that has been
written (a fresh `torch.empty` reads the shared zero page and looks infinitely fast).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable, Mapping

import torch


def _time_calls(fn: Callable[[], object], calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def interleaved_medians(
    fns: Mapping[str, Callable[[], object]], rounds: int = 7, calls: int = 5, warmup: int = 2
) -> dict[str, float]:
    """Median seconds per call of each fn, timed in interleaved rounds (order reversed every round)
    so that a noisy neighbour or a frequency change hits every variant alike."""
    names = list(fns)
    for name in names:
        _time_calls(fns[name], warmup)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            samples[name].append(statistics.median(_time_calls(fns[name], calls)))
    return {name: statistics.median(s) for name, s in samples.items()}


def copy_bandwidth(nbytes: int = 512 << 20, rounds: int = 7) -> float:
    """Bytes per second of a large tensor copy, reads and writes counted (the decode roofline)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).normal_()
    dst = torch.empty_like(src).normal_()
    seconds = interleaved_medians({"copy": lambda: dst.copy_(src)}, rounds=rounds, calls=3, warmup=1)["copy"]
    return 2 * nbytes / seconds


def copy_probe(nbytes: int = 256 << 20) -> tuple[Callable[[], object], int]:
    """A large copy to time among the variants of a benchmark, and the bytes it moves (reads and
    writes): its time in the same interleaved rounds gives the copy bandwidth the variants actually
    had, on a machine whose bandwidth moves by 20% from minute to minute."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).normal_()
    dst = torch.empty_like(src).normal_()
    return (lambda: dst.copy_(src)), 2 * nbytes


def read_bandwidth(nbytes: int = 512 << 20, rounds: int = 7) -> float:
    """Bytes per second of a streaming read (a sum over a large tensor): what weight streaming can reach.

    Lower bound of the decode roofline's denominator alongside `copy_bandwidth`, which counts a
    copy's reads and writes but not the write-allocate reads it also pays, and so reads lower.
    """
    src = torch.empty(nbytes // 4, dtype=torch.float32).normal_()
    seconds = interleaved_medians({"read": lambda: src.sum()}, rounds=rounds, calls=3, warmup=1)["read"]
    return nbytes / seconds


def gemm_throughput(dtype: torch.dtype = torch.bfloat16, m: int = 512, n: int = 2112, k: int = 7168) -> float:
    """FLOP per second of oneDNN's GEMM (`torch.mm`) at a prefill-like shape (the prefill roofline)."""
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(k, n).to(dtype)
    seconds = interleaved_medians({"mm": lambda: torch.mm(a, b)}, rounds=5, calls=3)["mm"]
    return 2 * m * n * k / seconds


@contextlib.contextmanager
def inference_freezing(enable_concat_linear: bool = True):
    """Freezing for the traces and compiles inside the block.

    Dynamo reads `freezing` while tracing, so `options={"freezing": True}` alone does nothing;
    the first call of a compiled function (which traces) must run inside this block.
    """
    with torch._inductor.config.patch(freezing=True, **{"cpp.enable_concat_linear": enable_concat_linear}):
        yield
