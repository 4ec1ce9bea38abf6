"""Which x86 instruction sets the generated C++ may use, and which GEMM is the honest compute roof.

Two questions with different answers on a machine whose code is compiled for another target:
- `host_isa()`: what this CPU runs (the report records it; the roofline's GEMM probe follows it).
- `target_isa()`: what the C++ Inductor emits is compiled for. Inductor builds with `-march=native`
  unless `cpp.march` names another target; the lowerings choose their kernels (VNNI-packed AVX-512
  weights, or AVX2 ones) for the target, so a test can force the AVX2 path on an AVX-512 machine by
  setting `cpp.march` to an AVX2 target, and compile (not run) the AVX-512 path on an AVX2 one.

The levels are ordered: each includes the ones before it ("amx" CPUs take the AVX512-BF16 kernels,
and decode attention with many heads per cached row runs on AMX tiles there: docs/isa.md).
"""

from __future__ import annotations

import functools
import os
import pathlib
import platform

import torch
from torch._inductor import config as inductor_config

LEVELS = ("default", "avx2", "avx512f", "avx512_bf16", "amx")

# gcc -march names this project knows the level of; any other explicit target counts as "default"
# (only the portable kernels are offered for it).
_MARCH_LEVELS = {
    "x86-64": "default",
    "x86-64-v2": "default",
    "x86-64-v3": "avx2",
    "haswell": "avx2",
    "broadwell": "avx2",
    "skylake": "avx2",
    "znver1": "avx2",
    "znver2": "avx2",
    "znver3": "avx2",
    "alderlake": "avx2",
    "x86-64-v4": "avx512f",
    "skylake-avx512": "avx512f",
    "cascadelake": "avx512f",
    "icelake-server": "avx512f",
    "cooperlake": "avx512_bf16",
    "znver4": "avx512_bf16",
    "znver5": "avx512_bf16",
    "sapphirerapids": "amx",
    "graniterapids": "amx",
    "emeraldrapids": "amx",
}


# oneDNN held to an ISA (ONEDNN_MAX_CPU_ISA, as oneDNN spells it) and the level it leaves: what its GEMMs,
# the roofline's and stock Inductor's, run at. Unlisted values leave the CPU's own level.
_ONEDNN_ISA_LEVELS = {
    "SSE41": "default",
    "AVX": "default",
    "AVX2": "avx2",
    "AVX2_VNNI": "avx2",
    "AVX2_VNNI_2": "avx2",
    "AVX512_CORE": "avx512f",
    "AVX512_CORE_VNNI": "avx512f",
    "AVX512_CORE_BF16": "avx512_bf16",
    "AVX512_CORE_FP16": "avx512_bf16",
    "AVX10_1_512": "avx512_bf16",
}


@functools.cache
def host_isa() -> str:
    """The widest level this CPU supports, as far as ATen (ATEN_CPU_CAPABILITY) and oneDNN
    (ONEDNN_MAX_CPU_ISA) are allowed to use it: held lower, with the C++ built for the same level
    (TORCHINDUCTOR_CPP_MARCH), an AVX-512 machine runs the suite as an AVX2 or a Zen 4 one would
    (docs/testing.md)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return "default"
    if capability == "AVX2" or not torch.cpu._is_avx512_supported():
        level = "avx2"
    elif not torch.cpu._is_avx512_bf16_supported():
        level = "avx512f"
    else:
        # AMX implies AVX512-BF16 on every CPU that has it (Sapphire Rapids and newer): never a lower level.
        level = "amx" if torch.cpu._is_amx_tile_supported() else "avx512_bf16"
    held = _ONEDNN_ISA_LEVELS.get(os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper(), level)
    return min(level, held, key=LEVELS.index)


@functools.cache
def cpu_model() -> str:
    """The CPU, for the tables that must name what they ran on: its model name with its family and model
    numbers, and for AMD the core they mean ("AMD EPYC (family 25 model 1: Zen 3)"). A cloud's model
    name can be just "AMD EPYC", and the two kinds of AVX2 EPYC differ: a Zen 1 core splits every
    256-bit op in two, a Zen 3 core runs two 256-bit FMAs a cycle."""
    return describe_cpu(_host_cpuinfo())


@functools.cache
def _host_cpuinfo() -> str:
    """This machine's /proc/cpuinfo ("" where there is none)."""
    try:
        return pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _first_processor(cpuinfo: str) -> dict[str, str]:
    """The fields of the first processor of a /proc/cpuinfo text."""
    fields = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


@functools.cache
def slow_subnormal_inputs() -> bool:
    """Whether this CPU's vector FMAs take a microcode assist when an operand is subnormal: Intel cores
    do (the AMX Xeon: 90x slower FMAs with one subnormal operand, measured), AMD's Zen cores run them at
    full speed (Zen 3, measured). Kernels that would widen values into fp32 subnormals avoid it here."""
    return _first_processor(_host_cpuinfo()).get("vendor_id") != "AuthenticAMD"


def describe_cpu(cpuinfo: str) -> str:
    """cpu_model() of the text of /proc/cpuinfo (its first processor)."""
    fields = _first_processor(cpuinfo)
    name = fields.get("model name") or platform.processor() or platform.machine()
    if not (fields.get("cpu family", "").isdigit() and fields.get("model", "").isdigit()):
        return name
    family, model = int(fields["cpu family"]), int(fields["model"])
    core = _amd_core(family, model) if fields.get("vendor_id") == "AuthenticAMD" else None
    return f"{name} (family {family} model {model}{': ' + core if core else ''})"


def _amd_core(family: int, model: int) -> str | None:
    """The Zen generation of an AMD family and model (AMD's processor programming references)."""
    if family == 0x17:
        return "Zen 2" if model >= 0x30 else "Zen 1"
    if family == 0x19:
        zen4 = 0x10 <= model < 0x20 or 0x60 <= model < 0x80 or 0xA0 <= model < 0xB0
        return "Zen 4" if zen4 else "Zen 3"
    if family == 0x1A:
        return "Zen 5"
    return None


def target_isa() -> str:
    """The level the C++ of the compile in progress is built for (`cpp.march`, else the host's)."""
    march = inductor_config.cpp.march
    if march is None or march == "native":
        return host_isa()
    if march not in _MARCH_LEVELS:
        return "default"
    return _MARCH_LEVELS[march]


def at_least(level: str, isa: str) -> bool:
    return LEVELS.index(isa) >= LEVELS.index(level)


def native_bf16_gemm() -> bool:
    """Whether oneDNN has a native bf16 GEMM here: without AVX512-BF16 a bf16 `torch.mm` runs a scalar
    fallback (0.3-1 GFLOP/s on an AVX2 EPYC), and bf16 work is done widened to fp32."""
    return at_least("avx512_bf16", host_isa())


def native_fp16_gemm() -> bool:
    """Whether oneDNN has a native fp16 GEMM here: AVX512-FP16, which the AMX Xeons have (Sapphire Rapids
    and newer); elsewhere fp16 GEMMs are emulated (a Llama-3-8B MLP Linear streamed 2.5 GB/s at 8 rows
    on a Cascade Lake Xeon, docs/linear.md)."""
    return host_isa() == "amx" and "avx512_fp16" in cpu_flags()


def cpu_flags() -> set[str]:
    """The first processor's flags in /proc/cpuinfo (what the CPU has, whatever ATen or oneDNN are held to)."""
    return set(_first_processor(_host_cpuinfo()).get("flags", "").split())


def native_gemm(dtype: torch.dtype) -> bool:
    """Whether oneDNN multiplies `dtype` natively here (fp32 always)."""
    return {torch.bfloat16: native_bf16_gemm, torch.float16: native_fp16_gemm}.get(dtype, lambda: True)()


def concat_linear_is_slow(dtype: torch.dtype) -> bool:
    """Whether Inductor's concat-linear (freezing) makes GEMMs in `dtype` crawl here: it folds linears that
    share an input into one constant laid out [K, N], which for bf16 without a native bf16 GEMM runs
    ATen's scalar fallback: two deepseek-v3-tp22 A-projection layers took 441 ms at 1 row and 29.8 s at
    64 rows with it, 6.1 ms and 285 ms without (frozen both; an AVX2 EPYC)."""
    return dtype == torch.bfloat16 and not native_bf16_gemm()


def roof_gemm_dtype(dtype: torch.dtype = torch.bfloat16) -> torch.dtype:
    """The dtype whose oneDNN GEMM is the compute roof for work in `dtype`: bf16 where it is native,
    else fp32 (the throughput bf16 widened to fp32 in registers can reach)."""
    if dtype == torch.bfloat16 and not native_bf16_gemm():
        return torch.float32
    if dtype == torch.float16:  # the kernels widen fp16 to fp32 (F16C) on every CPU
        return torch.float32
    return dtype


def roof_gemm_name(dtype: torch.dtype = torch.bfloat16) -> str:
    """`roof_gemm_dtype` as tables and the report's JSON name it ("float32")."""
    return str(roof_gemm_dtype(dtype)).removeprefix("torch.")
