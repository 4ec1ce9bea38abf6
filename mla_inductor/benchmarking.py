"""Measurement helpers shared by `benchmarks/` and the report.

Rules (docs/DESIGN.md): compare in one process, interleaved, as ratios; quote medians; measure the
roofline (copy bandwidth, oneDNN GEMM throughput) in the same run; time only memory that has been
written (a fresh `torch.empty` reads the shared zero page and looks infinitely fast).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import pathlib
import statistics
import subprocess
import time
import types
from typing import Callable, Mapping, Optional, Sequence

import torch

from . import isa, record


def machine_line() -> str:
    """The CPU, its ISA, its last-level cache and the threads: every benchmark's table names what it was
    measured on."""
    return (f"{isa.cpu_model()}, ISA {isa.host_isa()}, L3 {last_level_cache_bytes() >> 20} MiB; "
            f"threads {torch.get_num_threads()}")


@functools.cache
def last_level_cache_bytes() -> int:
    """The size of this CPU's largest cache (sysfs; 32 MiB if it cannot be read). Memory-bound benchmarks
    size their data past it: the EPYCs here have 32 MiB of L3, the AMX Xeon 300 MiB."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for entry in pathlib.Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip()
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes, default=32 << 20)


def build_harness(source: pathlib.Path, out: pathlib.Path, headers: Sequence[str], flags: Sequence[str],
                  libs: Sequence[str] = ("c10",), templates: Optional[pathlib.Path] = None) -> pathlib.Path:
    """Build a benchmark's own C++ `source` into the executable `out` with g++ `flags`, the template
    headers `headers` (from `templates`, by default the package's) pasted in front as the kernels have
    them, torch's include paths and `libs` from torch's lib directory."""
    # here, not at the top: the report imports this module and needs neither cpp_extension nor
    # Inductor's lowerings, which lowerings.template loads
    import torch.utils.cpp_extension

    from .lowerings.template import TEMPLATE_DIR

    header = out.with_suffix(".h")
    header.write_text("\n".join(((templates or TEMPLATE_DIR) / name).read_text() for name in headers))
    lib = pathlib.Path(torch.__file__).parent / "lib"
    subprocess.run(["g++", "-std=c++20", *flags, *(f"-I{p}" for p in torch.utils.cpp_extension.include_paths()),
                    "-include", str(header), str(source), "-o", str(out), f"-L{lib}", *(f"-l{name}" for name in libs),
                    f"-Wl,-rpath,{lib}"], check=True)
    return out


def fresh_compiles() -> None:
    """Every variant x shape of a benchmark is its own compile of the same code object: keep Dynamo from
    falling back to eager past its recompile limit, and keep Inductor's caches from serving an earlier
    compile (the pattern pass would not run and the fusion counts would read 0)."""
    torch._dynamo.config.recompile_limit = 64
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False


def fresh_function(fn: Callable) -> Callable:
    """fn with a code object of its own. Dynamo keeps compiled graphs per code object, so a function made
    twice from one `def` (or lambda) and compiled twice is served from the first compile whenever its
    guards pass: two versions of the templates compiled in one process (benchmarks/template_ab.py) would
    both run the first version's kernels."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def layers_past_the_cache(bytes_per_layer: float, at_least: int, times: float = 1.2) -> int:
    """Layers enough for their data to exceed `times` the last-level cache (and at least `at_least`): a
    stack sized for the EPYCs' 32 MiB of L3 sits in the AMX Xeon's 300 MiB, and would stream from it."""
    return max(at_least, math.ceil(times * last_level_cache_bytes() / bytes_per_layer))


def projection_arg_parser(description: str, layer_bytes: float, at_least: int, layer_help: str
                          ) -> argparse.ArgumentParser:
    """The options of the weight-streaming benchmarks (`weight_stream_table`): by default as many layers
    of `layer_bytes` of weights (the smallest format's) as exceed the last-level cache, `at_least` of them."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 512])
    layers = layers_past_the_cache(layer_bytes, at_least)
    p.add_argument("--layers", type=int, default=layers,
                   help=f"layers of {layer_help}; default {layers}: at least {at_least}, and past this CPU's "
                        f"{last_level_cache_bytes() >> 20} MiB last-level cache")
    p.add_argument("--rounds", type=int, default=9)
    return p


def _time_calls(fn: Callable[[], object], calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def interleaved_medians(
    fns: Mapping[str, Callable[[], object]], rounds: int = 7, calls: int = 5, warmup: int = 2,
    budget_s: Optional[float] = None,
) -> dict[str, float]:
    """Median seconds per call of each fn, timed in interleaved rounds (order reversed every round)
    so that a noisy neighbour or a frequency change hits every variant alike.

    `budget_s` bounds the timing: where one call of every variant takes longer than the budget allows
    (bf16 prefill where oneDNN has no native bf16 runs seconds per call), calls per round drop to
    fit, down to one, and rounds to three, after a warm-up of one call (the one that is timed to decide).
    Where even three rounds of one call would take over the budget (a stock bf16 GEMM at ~1 GFLOP/s
    runs minutes per call), that timed call is the one sample. The variants have run once before
    (their compile), so the timed call is past their first run."""
    names = list(fns)
    warm = {name: _time_calls(fns[name], 1)[0] for name in names}
    per_round = sum(warm.values())
    if budget_s is not None and 3 * per_round > budget_s:
        return warm
    if budget_s is not None and rounds * calls * per_round > budget_s:
        calls = max(1, int(budget_s / (rounds * per_round)))
        if rounds * calls * per_round > budget_s:
            rounds = min(rounds, 3)
    else:
        for name in names:
            _time_calls(fns[name], warmup - 1)
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


def gemm_probe(dtype: torch.dtype = torch.bfloat16, m: int = 512, n: int = 2112, k: int = 7168
               ) -> tuple[Callable[[], object], int]:
    """oneDNN's GEMM (`torch.mm`) at a prefill-like shape to time among the variants of a benchmark,
    and the FLOPs it does: the compute roofline the variants actually had (see `copy_probe`).

    The GEMM timed is the best this CPU has for work in `dtype` (`isa.roof_gemm_dtype`): a bf16 probe
    where oneDNN has no native bf16 would run a scalar fallback for minutes and understate the roof."""
    dtype = isa.roof_gemm_dtype(dtype)
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(k, n).to(dtype)
    return (lambda: torch.mm(a, b)), 2 * m * n * k


def gemm_throughput(dtype: torch.dtype = torch.bfloat16, m: int = 512, n: int = 2112, k: int = 7168) -> float:
    """FLOP per second of the best oneDNN GEMM for `dtype` (see `gemm_probe`) at a prefill-like shape."""
    mm, flops = gemm_probe(dtype, m, n, k)
    return flops / interleaved_medians({"mm": mm}, rounds=5, calls=3)["mm"]


def frozen_options(dtype: torch.dtype = torch.bfloat16) -> dict:
    """Stock Inductor's best freezing options for work in `dtype`: freezing with concat-linear, except
    where that makes its GEMMs crawl (`isa.concat_linear_is_slow`)."""
    return {"freezing": True, "cpp.enable_concat_linear": not isa.concat_linear_is_slow(dtype)}


@contextlib.contextmanager
def inference_freezing(enable_concat_linear: bool = True):
    """Freezing for the traces and compiles inside the block.

    Dynamo reads `freezing` while tracing, so `options={"freezing": True}` alone does nothing;
    the first call of a compiled function (which traces) must run inside this block.
    """
    with torch._inductor.config.patch(freezing=True, **{"cpp.enable_concat_linear": enable_concat_linear}):
        yield


VARIANTS = ("eager", "stock", "stock frozen", "mla", "mla frozen")


def compiled_variants(model: torch.nn.Module, inputs: tuple) -> dict[str, Callable[[], object]]:
    """A call of `model(*inputs)` for each of VARIANTS, compiled (and run once) here: eager, stock
    torch.compile frozen (`frozen_options`) and not, mla_inductor frozen and not."""
    frozen = frozen_options()
    variants = {
        "eager": (model, False),
        "stock": (torch.compile(model, dynamic=False), False),
        "stock frozen": (torch.compile(model, dynamic=False, options=frozen), True),
        "mla": (torch.compile(model, backend="mla_inductor", dynamic=False), False),
        "mla frozen": (torch.compile(model, backend="mla_inductor", dynamic=False, options=frozen), True),
    }
    fns = {}
    for name, (fn, freeze) in variants.items():
        with torch.no_grad(), (inference_freezing(frozen["cpp.enable_concat_linear"]) if freeze
                               else contextlib.nullcontext()):
            fn(*inputs)
        fns[name] = lambda fn=fn: fn(*inputs)
    return fns


def weight_stream_table(
    model: torch.nn.Module,
    make_input: Callable[[int], tuple],
    rows_list: Sequence[int],
    flop_per_row: float,
    fusion: str,
    rounds: int = 9,
    weight_bytes: Optional[int] = None,
) -> None:
    """Print, per row count, a projection stack's medians for eager, stock torch.compile, stock frozen
    (`frozen_options`: "stock at its best" is the faster of the two) and mla_inductor (frozen and
    not), against the roofline: the larger of the weight bytes at the copy bandwidth (timed as one
    more variant in the same interleaved rounds, so that it saw the same machine) and the FLOPs at
    best oneDNN GEMM throughput for bf16 on this CPU (`gemm_throughput`). `fusion` names the count to
    report; `weight_bytes` are the bytes a call must read (default: all of the model's parameters)."""
    if weight_bytes is None:
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    read = read_bandwidth()
    gemm = gemm_throughput()
    print(f"{machine_line()}; weights {weight_bytes / 2**20:.0f} MiB; read bandwidth {read / 1e9:.1f} GB/s; "
          f"oneDNN {isa.roof_gemm_name()} GEMM {gemm / 1e9:.0f} GFLOP/s")
    copy, copy_bytes = copy_probe()
    print("| rows | eager ms | stock ms | stock frozen ms | mla ms | mla frozen ms | x stock best "
          "| copy GB/s in the rounds | roofline: copy bw | roofline: read bw | weights GB/s | fired |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for rows in rows_list:
        inputs = make_input(rows)
        record.reset_counts()
        fns = compiled_variants(model, inputs)
        fired = record.fusion_counts()[fusion]
        fns["copy"] = copy
        with torch.no_grad():
            t = interleaved_medians(fns, rounds=rounds, calls=5)
        copy_in_rounds = copy_bytes / t["copy"]
        best_stock = min(t["stock"], t["stock frozen"])
        best_mla = min(t["mla"], t["mla frozen"])
        compute = rows * flop_per_row / gemm
        roofline_copy = max(weight_bytes / copy_in_rounds, compute)
        roofline_read = max(weight_bytes / read, compute)
        print(f"| {rows} | " + " | ".join(f"{t[k] * 1e3:.2f}" for k in VARIANTS)
              + f" | {best_stock / best_mla:.2f} | {copy_in_rounds / 1e9:.1f} | {roofline_copy / best_mla:.0%}"
              f" | {roofline_read / best_mla:.0%} | {weight_bytes / best_mla / 1e9:.1f} | {fired} |", flush=True)
        torch._dynamo.reset()
