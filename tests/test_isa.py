"""The ISA each kernel path is built for: detection, and the path of the *other* kind of CPU.

One machine runs one path natively (AVX2-only EPYCs the portable FMA kernels; AVX512-BF16 EPYCs the
dpbf16 kernels and packed weights), and the other tests run that one. Here an AVX-512 machine compiles
and runs the templates for an AVX2 target, and a machine without AVX512-BF16 compiles (cannot run) them
for one that has it.
"""

import os
import pathlib

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

import mla_inductor
from mla_inductor import benchmarking, isa
from mla_inductor.lowerings.segment_gemm import can_pack, pack_blocks
from mla_inductor.ops.q_b_absorb import reference_fp64 as q_b_reference
from mla_inductor.ops.weight_quant import quantize_weight_fp8_blocks, quantize_weight_int8

AVX2_TARGET = {"cpp.march": "haswell", "cpp.simdlen": 256}  # AVX2, FMA, F16C; 8-lane Vectorized<float>
AVX512_TARGET = {"cpp.march": "cascadelake"}  # AVX-512 without BF16 (Skylake / Cascade Lake / Ice Lake Xeons)
AVX512_BF16_TARGET = {"cpp.march": "sapphirerapids"}
AVX512_BF16_WITHOUT_AMX_TARGET = {"cpp.march": "cooperlake"}  # as on Zen 4: dpbf16, no AMX tiles


def test_host_isa_follows_the_cpu_flags():
    level = isa.host_isa()
    assert level in isa.LEVELS
    assert isa.at_least("avx2", level) == torch.cpu._is_avx2_supported()
    # ATen or oneDNN held to a narrower ISA play a narrower CPU (docs/testing.md): its flags above that do
    # not count
    played = torch.backends.cpu.get_cpu_capability() == "AVX2" or "ONEDNN_MAX_CPU_ISA" in os.environ
    assert isa.at_least("avx512_bf16", level) <= torch.cpu._is_avx512_bf16_supported()
    assert isa.at_least("avx512_bf16", level) == torch.cpu._is_avx512_bf16_supported() or played
    if torch.cpu._is_amx_tile_supported() and not played:  # an AMX CPU takes the AVX512-BF16 kernels too
        assert level == "amx" and isa.native_bf16_gemm()
    assert isa.roof_gemm_dtype(torch.bfloat16) == (torch.bfloat16 if isa.native_bf16_gemm() else torch.float32)
    # fp16 GEMMs are native only with AVX512-FP16, which only the AMX Xeons have
    assert isa.native_gemm(torch.float32) and (not isa.native_gemm(torch.float16) or level == "amx")


@pytest.fixture
def host_isa_under(monkeypatch):
    """host_isa() with ONEDNN_MAX_CPU_ISA set to a value (None: unset), its cache cleared around it."""
    def level(onednn_hold):
        if onednn_hold is None:
            monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
        else:
            monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", onednn_hold)
        isa.host_isa.cache_clear()
        return isa.host_isa()

    yield level
    monkeypatch.undo()
    isa.host_isa.cache_clear()


def test_a_onednn_hold_plays_a_narrower_cpu_never_a_wider_one(host_isa_under):
    own = host_isa_under(None)
    narrower = lambda level: min(own, level, key=isa.LEVELS.index)  # noqa: E731
    assert host_isa_under("AVX2") == host_isa_under("avx2_vnni") == narrower("avx2")
    assert host_isa_under("AVX512_CORE_BF16") == narrower("avx512_bf16")
    assert host_isa_under("AVX512_CORE_AMX") == own  # a hold at or above the CPU's level, or unknown to us
    assert host_isa_under("SOME_FUTURE_ISA") == own


def test_target_isa_follows_cpp_march():
    assert isa.target_isa() == isa.host_isa()
    weight = torch.arange(40 * 6, dtype=torch.bfloat16).view(40, 6)
    with torch._inductor.config.patch(AVX2_TARGET):
        assert isa.target_isa() == "avx2" and can_pack(torch.bfloat16)
        assert pack_blocks(weight).shape == (3, 6 * 16)  # 16-column blocks, k-major
    with torch._inductor.config.patch(AVX512_BF16_TARGET):
        assert isa.target_isa() == "amx" and can_pack(torch.bfloat16)
        assert pack_blocks(weight).shape == (2, 3 * 2 * 32)  # 32-column VNNI blocks of k pairs
    with torch._inductor.config.patch(AVX512_TARGET):
        # AVX-512 without BF16: the same VNNI blocks, widened to fp32 in registers
        assert isa.target_isa() == "avx512f" and can_pack(torch.bfloat16)
        assert pack_blocks(weight).shape == (2, 3 * 2 * 32)
    with torch._inductor.config.patch({"cpp.march": "some-future-cpu"}):
        assert isa.target_isa() == "default" and not can_pack(torch.bfloat16)  # unknown: the portable kernels


@pytest.mark.parametrize("vendor, name, family, model, described", [
    ("AuthenticAMD", "AMD EPYC", 23, 1, "AMD EPYC (family 23 model 1: Zen 1)"),
    ("AuthenticAMD", "AMD EPYC", 23, 49, "AMD EPYC (family 23 model 49: Zen 2)"),
    ("AuthenticAMD", "AMD EPYC", 25, 1, "AMD EPYC (family 25 model 1: Zen 3)"),
    ("AuthenticAMD", "AMD EPYC 9654", 25, 17, "AMD EPYC 9654 (family 25 model 17: Zen 4)"),
    ("AuthenticAMD", "AMD EPYC", 26, 2, "AMD EPYC (family 26 model 2: Zen 5)"),
    ("GenuineIntel", "Intel(R) Xeon(R) Platinum 8480+", 6, 143, "Intel(R) Xeon(R) Platinum 8480+ (family 6 model 143)"),
])
def test_cpu_model_names_the_core_a_generic_model_name_hides(vendor, name, family, model, described):
    first = f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\nmodel name\t: {name}\n"
    assert isa.describe_cpu(first + "\nprocessor\t: 1\ncpu family\t: 99\n") == described  # the first processor's
    assert isa.describe_cpu(f"model name\t: {name}\n") == name  # without a family and model: the name alone
    assert isa.cpu_model() == isa.describe_cpu(pathlib.Path("/proc/cpuinfo").read_text())


def test_gemm_probe_times_the_roof_dtype_quickly():
    """Where oneDNN has no native bf16 the probe is an fp32 GEMM: a bf16 one would take minutes."""
    mm, flops = benchmarking.gemm_probe(torch.bfloat16, m=64, n=256, k=512)
    out = mm()
    assert out.dtype == isa.roof_gemm_dtype(torch.bfloat16) and flops == 2 * 64 * 256 * 512


FP8_BLOCK = [8, 32]


class Projections(nn.Module):
    """q_b_absorb on weights that freezing makes constants (bf16 packed in the target's layout; W8A8's
    int8 and fp8 blocks, the integer and the fp8 tiles), and latent decode attention over a paged cache,
    bf16 and fp8, with 16 heads (the AMX tiles on an AMX target; the fp8 cache converted to bf16 for the
    dpbf16 tiles on AVX512-BF16 without AMX, widened for the FMA tiles on AVX2), and
    grouped-query decode over a bf16 and an e4m3 cache (groups of 4 widen the rows from the cache: in
    pairs on AVX2 for bf16), in one graph: one compile covers the kernels."""

    def __init__(self, heads=16, nope=16, rope=8, latent=64, q_lora_rank=99):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        q_b_weight = (torch.randn(heads * (nope + rope), q_lora_rank, generator=g) * q_lora_rank**-0.5).bfloat16()
        constant = lambda t: nn.Parameter(t, requires_grad=False)  # noqa: E731
        self.q_b_weight = constant(q_b_weight)
        self.q_b_int8, self.q_b_int8_scale = map(constant, quantize_weight_int8(q_b_weight))
        self.q_b_fp8, self.q_b_fp8_scale = map(constant, quantize_weight_fp8_blocks(q_b_weight, FP8_BLOCK))
        self.w_kc = constant((torch.randn(heads, nope, latent, generator=g) * nope**-0.5).bfloat16())
        self.o_weight = constant((torch.randn(40, q_lora_rank, generator=g) * q_lora_rank**-0.5).bfloat16())
        self.o_bias = constant(torch.randn(40, generator=g).bfloat16())
        self.latent = latent

    def forward(self, q_a, cos, sin, cache, tables, lens, fp8_cache, fp8_scale, gqa_q, gqa_k, gqa_v):
        gqa = torch.ops.mla.gqa_decode_attention
        q = torch.ops.mla.q_b_absorb(q_a, self.q_b_weight, self.w_kc, cos, sin, "interleaved")
        q_w8a8 = torch.ops.mla.q_b_absorb(q_a, self.q_b_int8, self.w_kc, cos, sin, "interleaved", self.q_b_int8_scale,
                                          None, "int8")
        q_fp8 = torch.ops.mla.q_b_absorb(q_a, self.q_b_fp8, self.w_kc, cos, sin, "interleaved", self.q_b_fp8_scale,
                                         FP8_BLOCK)
        return (q, torch.ops.mla.latent_decode_attention(q, cache, tables, lens, self.latent, 0.1),
                torch.ops.mla.latent_decode_attention(q, fp8_cache, tables, lens, self.latent, 0.1, kv_scale=fp8_scale),
                q_w8a8, q_fp8, gqa(gqa_q, gqa_k.bfloat16(), gqa_v.bfloat16()), gqa(gqa_q, gqa_k, gqa_v),
                torch.ops.mla.linear(q_a, self.o_weight, self.o_bias))


QUANTIZED_KERNELS = ("mi::QuantizedGemm<mi::ActivationQuant::kSglang,", "mla_inductor::Float8_e4m3fn_finite")
PACKED_KERNELS = ("mi::packed_task(", "mi::packed_task_rounded(")


def projection_inputs(tokens=3, rope=8, latent=64, q_lora_rank=99, rows=40, block_size=16):
    g = torch.Generator().manual_seed(1)
    angles = torch.rand(tokens, rope // 2, generator=g) * 6.3
    cache = torch.randn(tokens * 3, block_size, latent + rope, generator=g).bfloat16()
    tables = torch.randperm(tokens * 3, generator=g).view(tokens, 3)
    lens = torch.tensor([rows, 1, 2 * block_size + 1][:tokens])
    fp8_scale = cache.float().abs().amax(-1, keepdim=True) / 448
    # grouped-query decode: groups of 4 heads, whose tiles widen the rows from the cache
    gqa_q = torch.randn(2, 8, 1, 64, generator=g).bfloat16()
    gqa_k, gqa_v = (torch.randn(2, 2, 300, 64, generator=g).to(torch.float8_e4m3fn) for _ in range(2))
    fp8_cache = (cache.float() / fp8_scale).to(torch.float8_e4m3fn)
    return (torch.randn(tokens, q_lora_rank, generator=g).bfloat16(), angles.cos().bfloat16(),
            angles.sin().bfloat16(), cache, tables, lens, fp8_cache, fp8_scale, gqa_q, gqa_k, gqa_v)


def compile_frozen(module, inputs, backend="mla_inductor"):
    torch._dynamo.reset()
    with benchmarking.inference_freezing(), torch.no_grad():
        return run_and_get_code(torch.compile(module, backend=backend), *inputs)


def run_for_target(target):
    """Projections compiled for `target` and run here, against the ops' references."""
    module, inputs = Projections().eval(), projection_inputs()
    with torch._inductor.config.patch(target):
        outputs, (code,) = compile_frozen(module, inputs)
    # two latent decode attentions (bf16, fp8) and two grouped-query ones (bf16, e4m3)
    assert code.count("mi::attend_split") == 4 and "at::Float8_e4m3fn" in code
    assert all(kernel in code for kernel in QUANTIZED_KERNELS + PACKED_KERNELS)
    with torch.no_grad():
        expected = module(*inputs)  # the ops' eager references
    args = dict(q_a=inputs[0], q_b_weight=module.q_b_weight, w_kc=module.w_kc, cos=inputs[1], sin=inputs[2])
    torch.testing.assert_close(outputs[0].double(), q_b_reference(**args, rope_style="interleaved"), atol=1e-2,
                               rtol=1e-2)
    for actual, reference in zip(outputs[1:], expected[1:]):
        torch.testing.assert_close(actual.float(), reference.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.skipif(isa.host_isa() == "avx2", reason="AVX2 is this CPU's own target: every template test runs it")
@pytest.mark.skipif(not isa.at_least("avx2", isa.host_isa()), reason="this CPU cannot run AVX2 code")
def test_templates_compiled_for_avx2_run_the_portable_kernels_here():
    run_for_target(AVX2_TARGET)


@pytest.mark.skipif(isa.host_isa() != "amx",
                    reason="without AMX this is the CPU's own path (every template test runs it) or one it cannot run")
def test_templates_compiled_for_avx512_bf16_without_amx_run_here():
    """An AVX512-BF16 CPU without AMX (Zen 4) runs the dpbf16 decode tiles for a bf16 cache and for the
    16-head latent fp8 cache converted to bf16 a block at a time (which an AMX CPU's tiles take over), the
    AVX-512 fp8 widening for the grouped-query groups of 4, and its own weight tiles."""
    run_for_target(AVX512_BF16_WITHOUT_AMX_TARGET)


def compile_only(gm, example_inputs):
    """A backend that compiles the graph with mla_inductor (its C++ is built) and runs it eagerly."""
    mla_inductor.backend(gm, example_inputs)
    return gm.forward


class FrozenLinear(nn.Module):
    """mla::linear over a frozen bf16 weight: K odd (a zero-padded pair), N a packed block and a part."""

    def __init__(self, k=99, n=40):
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.weight = nn.Parameter((torch.randn(n, k, generator=g) * k**-0.5).bfloat16(), requires_grad=False)
        self.bias = nn.Parameter(torch.randn(n, generator=g).bfloat16(), requires_grad=False)

    def forward(self, x):
        return torch.ops.mla.linear(x, self.weight, self.bias)


@pytest.mark.skipif(isa.host_isa() == "avx512f", reason="AVX-512 without BF16 is this CPU's own path")
def test_packed_weights_for_avx512_without_bf16():
    """A Skylake / Cascade Lake / Ice Lake Xeon's packed kernel (VNNI blocks widened to fp32 FMAs): run
    where the CPU has AVX512-BF16, built where it has only AVX2."""
    runs_here = isa.at_least("avx512_bf16", isa.host_isa())
    module, x = FrozenLinear().eval(), torch.randn(9, 99, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch._inductor.config.patch(AVX512_TARGET):
        y, (code,) = compile_frozen(module, (x,), backend="mla_inductor" if runs_here else compile_only)
    assert "mi::packed_task_rounded(" in code
    torch.testing.assert_close(y, torch.nn.functional.linear(x, module.weight, module.bias), atol=2e-2, rtol=1e-2)


def test_avx512_bf16_and_amx_kernels_compile_with_avx2_vectors():
    """Built, not run, for an AMX CPU (which has AVX512-BF16): VNNI-packed weights, the dpbf16 and AMX
    decode tiles, and the AMX tiles of quantized weights (quantized_gemm.h). With 8-lane vectors, as an
    AVX2 CPU builds them (Inductor takes cpp.march's instructions with the host's Vectorized width): an
    AVX-512 CPU builds that combination nowhere else, and a compile error in it once turned only the AVX2
    CPUs' CI red (docs/testing.md). The AMX CPU's own build runs in every other test there."""
    module, inputs = Projections().eval(), projection_inputs()
    with torch._inductor.config.patch({**AVX512_BF16_TARGET, "cpp.simdlen": 256}):
        _, (code,) = compile_frozen(module, inputs, backend=compile_only)
    # two latent decode attentions (bf16, fp8) and two grouped-query ones (bf16, e4m3)
    assert code.count("mi::attend_split") == 4 and "at::Float8_e4m3fn" in code
    assert all(kernel in code for kernel in QUANTIZED_KERNELS + PACKED_KERNELS)
