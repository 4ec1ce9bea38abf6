"""qkv_a_proj: the op, its C++ template, the patterns (where they fire and where not), real models."""

import functools

import expecttest
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch._inductor.utils import run_and_get_code

import mla_inductor
from mla_inductor import benchmarking, isa
from mla_inductor.models import get_config
from mla_inductor.models.hf import build_hf_model
from mla_inductor.models.mla import RMSNorm, init_weights_
from mla_inductor.lowerings import segment_gemm
from mla_inductor.lowerings.segment_gemm import can_pack, pack_column_blocks, pack_vnni_blocks
from mla_inductor.ops.qkv_a import reference_fp64
from mla_inductor.ops.rope import rotate_pairs
from mla_inductor.ops.weight_quant import quantize_weight_fp8_blocks, quantize_weight_int8

from graph_utils import rewritten, serving_model_decode
from quant_utils import dequantize_fp64, quantize_rows_int8_fp64, quantize_rows_int8_torchao_fp64

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-4}
op = torch.ops.mla.qkv_a_proj


def make_args(rows, dtype, hidden=96, nq=40, lora=32, rope=8, q_norm=True, bias=False, lead=None, seed=0):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    x = randn(*(lead or (rows,)), hidden)
    return dict(
        x=x,
        q_weight=randn(nq, hidden, scale=hidden**-0.5),
        kv_weight=randn(lora + rope, hidden, scale=hidden**-0.5),
        q_norm_weight=randn(nq, scale=0.1) + 1 if q_norm else None,
        kv_norm_weight=randn(lora, scale=0.1) + 1,
        q_eps=1e-6,
        kv_eps=1e-5,
        q_bias=randn(nq, scale=0.1) if bias else None,
        kv_bias=randn(lora + rope, scale=0.1) if bias else None,
    )


def max_errors(outputs, reference):
    return [(o.double() - r).abs().max().item() for o, r in zip(outputs, reference)]


def assert_close_to_reference(outputs, args, dtype):
    reference = reference_fp64(**args)
    tol = TOLERANCE[dtype]
    for name, out, ref in zip(("q", "c_kv", "k_pe"), outputs, reference):
        assert out.dtype == dtype and out.shape == ref.shape, name
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol, msg=name)


# --- the op ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("q_norm, bias", [(True, False), (False, False), (True, True)])
def test_op_matches_fp64_reference(dtype, q_norm, bias):
    args = make_args(5, dtype, q_norm=q_norm, bias=bias, lead=(2, 3))
    assert_close_to_reference(op(**args), args, dtype)


def test_op_eps_tensor_equals_eps_float():
    args = make_args(4, torch.float32)
    as_tensors = dict(args, q_eps_tensor=torch.tensor(1e-6, dtype=torch.float64),
                      kv_eps_tensor=torch.tensor(1e-5, dtype=torch.float64), q_eps=1.0, kv_eps=1.0)
    for a, b in zip(op(**args), op(**as_tensors)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(kv_weight=torch.zeros(40, 95)), r"kv_weight must be \[N, 96\]"),
        (dict(q_weight=torch.zeros(40, 96, dtype=torch.float64)), "q_weight has dtype torch.float64"),
        (dict(kv_norm_weight=torch.ones(40)), "kv_norm_weight must be \\[kv_lora_rank\\] with 0 < kv_lora_rank < "),
        (dict(q_norm_weight=torch.ones(39)), r"q_norm_weight must be \[40\]"),
        (dict(kv_bias=torch.ones(3)), r"kv_bias must be \[40\]"),
        (dict(q_eps=0.0), "q_eps must be > 0"),
        (dict(x=torch.zeros(3, 96, dtype=torch.int32)), "dtype"),
        (dict(x=torch.zeros(3, 96, device="meta")), "x must be on the CPU"),
    ],
)
def test_op_rejects_bad_input_naming_the_argument(change, message):
    args = make_args(3, torch.float32)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        op(**args)


# --- the template ----------------------------------------------------------------------------------


def compiled_op():
    """The op compiled on its own: the lowering emits our template for it."""

    def fn(x, q_weight, kv_weight, q_norm_weight, kv_norm_weight, q_bias, kv_bias):
        return op(x, q_weight, kv_weight, q_norm_weight, kv_norm_weight, 1e-6, 1e-5, q_bias, kv_bias)

    return torch.compile(fn)


def call(fn, args):
    """Rows are dynamic (one compile serves all row counts), weight shapes static as for parameters."""
    keys = ("x", "q_weight", "kv_weight", "q_norm_weight", "kv_norm_weight", "q_bias", "kv_bias")
    for d in range(args["x"].dim() - 1):
        torch._dynamo.maybe_mark_dynamic(args["x"], d)
    return fn(*(args[k] for k in keys))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_template_matches_reference_over_rows_and_is_no_less_accurate_than_eager(dtype):
    fn = compiled_op()
    # hidden 100 and 10 + 18 output rows: k tails (not a multiple of 32) and n tails (not of 4)
    shape = dict(hidden=100, nq=10, lora=12, rope=6)
    args = make_args(3, dtype, bias=True, **shape)
    outputs, (code,) = run_and_get_code(call, fn, args)
    assert "mi::nt_task" in code, "our template's C++ is in the module"
    assert "torch.ops.mla.qkv_a_proj" not in code, "no fallback to the eager op"
    if dtype == torch.bfloat16 and torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        assert "_mm512_dpbf16_ps" in code
    for rows in (1, 3, 17, 64, 512):
        args = make_args(rows, dtype, bias=True, seed=rows, **shape)
        outputs = call(fn, args)
        assert_close_to_reference(outputs, args, dtype)
        ours, eager = max_errors(outputs, reference_fp64(**args)), max_errors(op(**args), reference_fp64(**args))
        for o, e in zip(ours, eager):
            assert o <= 2 * e + 1e-7, (rows, ours, eager)


def test_template_strided_x_three_d_and_no_q_norm():
    fn = compiled_op()
    args = make_args(7, torch.bfloat16, q_norm=False)
    wide = torch.randn(7, 2 * 96).to(torch.bfloat16)
    args["x"] = wide[:, ::2]  # a strided row: last dim not contiguous
    assert_close_to_reference(call(fn, args), args, torch.bfloat16)
    args["x"] = wide[:, 96:]  # row stride 192, last dim contiguous
    assert_close_to_reference(call(fn, args), args, torch.bfloat16)
    args3 = make_args(0, torch.bfloat16, q_norm=False, lead=(2, 5))
    assert_close_to_reference(call(fn, args3), args3, torch.bfloat16)


@functools.cache
def shared_compiled_op():
    return compiled_op()


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), row_stride_pad=st.integers(0, 40), seed=st.integers(0, 2**16))
def test_template_over_rows_and_row_strides(rows, row_stride_pad, seed):
    """One compile (dynamic rows) serves every example; x rows may be padded (row stride > hidden)."""
    args = make_args(rows, torch.bfloat16, hidden=72, nq=20, lora=16, rope=8, seed=seed)
    padded = torch.randn(rows, 72 + row_stride_pad, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    args["x"] = padded[:, :72]
    assert_close_to_reference(call(shared_compiled_op(), args), args, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_k_pe_rotated_in_the_template_and_in_eager(dtype):
    """With k_cos / k_sin, k_pe leaves rotated (DeepSeek's interleaved pairs), from the fp32 row in the
    template; c_kv and q are unchanged."""
    args = make_args(5, dtype, hidden=99, nq=40, lora=36, rope=8)
    angles = torch.rand(5, 4, generator=torch.Generator().manual_seed(1)) * 6.3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q_ref, c_ref, k_pe_ref = reference_fp64(**args)
    k_ref = rotate_pairs(k_pe_ref, cos.double(), sin.double(), is_neox=False)
    fn = torch.compile(lambda x, qw, kvw, qn, kvn, c, s: op(x, qw, kvw, qn, kvn, 1e-6, 1e-5, k_cos=c, k_sin=s))
    compiled, (code,) = run_and_get_code(
        fn, args["x"], args["q_weight"], args["kv_weight"], args["q_norm_weight"], args["kv_norm_weight"], cos, sin
    )
    assert "mi::rope<mla_inductor::RopeStyle::kInterleaved>" in code and "torch.ops.mla.qkv_a_proj" not in code
    tol = TOLERANCE[dtype]
    for outputs in (op(**args, k_cos=cos, k_sin=sin), compiled):
        for out, ref in zip(outputs, (q_ref, c_ref, k_ref)):
            torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_k_cos_and_k_sin_come_together_in_the_rows_shape():
    args = make_args(5, torch.float32)
    with pytest.raises(ValueError, match="k_cos and k_sin come together"):
        op(**args, k_cos=torch.zeros(5, 4))
    with pytest.raises(ValueError, match=r"k_sin must be a floating CPU tensor \[5, 4\]"):
        op(**args, k_cos=torch.zeros(5, 4), k_sin=torch.zeros(4, 4))
    with pytest.raises(ValueError, match="k_sin has dtype torch.float64, expected k_cos's dtype torch.float32"):
        op(**args, k_cos=torch.zeros(5, 4), k_sin=torch.zeros(5, 4, dtype=torch.float64))


# --- quantized weights -------------------------------------------------------------------------------

# (weight format, activation_quant, weight_block_size, x dtype): SGLang's W8A8 (1-D per-channel scales),
# torchao's int8 weight-only ([N, 1] scales) under fp16 activations, fp8 blocks that split K into
# 32-wide blocks (hidden 100: a partial last K block and a K tail) and the rows into partial blocks
# of 8, and fp8 with one K block (scales per 4 rows, applied to the sums).
QUANTIZED_CASES = [
    ("int8", "int8", None, torch.bfloat16),
    ("int8", "int8_torchao", None, torch.bfloat16),
    ("int8", "none", None, torch.float16),
    ("fp8", "none", [8, 32], torch.bfloat16),
    ("fp8", "none", [4, 128], torch.bfloat16),
]


def quantized_args(case, rows, seed=0, hidden=100, nq=10, lora=12, rope=6, bias=False):
    fmt, activation_quant, block, dtype = case
    args = make_args(rows, dtype, hidden=hidden, nq=nq, lora=lora, rope=rope, bias=bias, seed=seed)
    for name in ("q", "kv"):
        w = args[f"{name}_weight"]
        weight, scale = quantize_weight_int8(w) if fmt == "int8" else quantize_weight_fp8_blocks(w, block)
        args[f"{name}_weight"] = weight
        args[f"{name}_weight_scale"] = scale.view(-1) if activation_quant != "none" else scale
    return dict(args, weight_block_size=block, activation_quant=activation_quant)


def quantized_reference_fp64(args):
    """fp64 math on the dequantized weights (and, for W8A8, the quantized-dequantized activations)."""
    block = args["weight_block_size"]
    x = {"int8": quantize_rows_int8_fp64, "int8_torchao": quantize_rows_int8_torchao_fp64,
         "none": lambda x: x}[args["activation_quant"]](args["x"])
    plain = {k: v for k, v in args.items() if k in (
        "q_norm_weight", "kv_norm_weight", "q_eps", "kv_eps", "q_bias", "kv_bias")}
    return reference_fp64(x, dequantize_fp64(args["q_weight"], args["q_weight_scale"], block),
                          dequantize_fp64(args["kv_weight"], args["kv_weight_scale"], block), **plain)


def assert_close_to_quantized_reference(outputs, args):
    tol = TOLERANCE[args["x"].dtype]
    for name, out, ref in zip(("q", "c_kv", "k_pe"), outputs, quantized_reference_fp64(args)):
        assert out.dtype == args["x"].dtype and out.shape == ref.shape, name
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol, msg=name)


@pytest.mark.parametrize("case", QUANTIZED_CASES, ids=str)
def test_quantized_op_matches_fp64_reference(case):
    args = quantized_args(case, 5, bias=True)
    assert_close_to_quantized_reference(op(**args), args)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(q_weight_scale=None), "q_weight is torch.int8: it needs its fp32 q_weight_scale"),
        (dict(kv_weight_scale=torch.ones(17)), r"kv_weight_scale must be \[18\] or \[18, 1\]"),
        (dict(weight_block_size=[8, 32]), "W8A8 .* takes per-channel weight scales"),
        (dict(activation_quant="int4"), "activation_quant must be one of"),
        (dict(kv_weight=torch.zeros(18, 100, dtype=torch.float8_e4m3fn)), "W8A8.* needs an int8 kv_weight"),
        (dict(kv_weight=torch.zeros(18, 100, dtype=torch.float8_e4m3fn), activation_quant="none"), "quantized alike"),
    ],
)
def test_quantized_op_rejects_bad_input_naming_the_argument(change, message):
    args = dict(quantized_args(QUANTIZED_CASES[0], 2), **change)
    with pytest.raises(ValueError, match=message):
        op(**args)


def compiled_cases_match_the_reference(cases, row_counts, **shape) -> str:
    """Every case in one graph, compiled once with dynamic rows and run at each of `row_counts`, each
    output against quantized_reference_fp64. Returns the code compiled for the first row count."""
    keys = ("x", "q_weight", "kv_weight", "q_norm_weight", "kv_norm_weight", "q_weight_scale", "kv_weight_scale")

    def fn(*flat):
        outputs = []
        for i, case in enumerate(cases):
            x, qw, kvw, qn, kvn, qs, kvs = flat[i * len(keys):(i + 1) * len(keys)]
            outputs.append(op(x, qw, kvw, qn, kvn, 1e-6, 1e-5, q_weight_scale=qs, kv_weight_scale=kvs,
                              weight_block_size=case[2], activation_quant=case[1]))
        return outputs

    compiled, code = torch.compile(fn), None
    for rows in row_counts:
        all_args = [quantized_args(case, rows, seed=rows, **shape) for case in cases]
        flat = [args[k] for args in all_args for k in keys]
        for args in all_args:
            torch._dynamo.maybe_mark_dynamic(args["x"], 0)
        if code is None:
            outputs, (code,) = run_and_get_code(compiled, *flat)
        else:
            outputs = compiled(*flat)
        for args, out in zip(all_args, outputs):
            assert_close_to_quantized_reference(out, args)
    return code


def test_quantized_templates_in_one_compile():
    """One graph holds every case of QUANTIZED_CASES and one the tiles cannot serve (fp8 blocks of 3
    rows with several K blocks: a tile of 4 rows would straddle two blocks' scales), which must fall
    back to the eager op. One compile with dynamic rows: 3 (a partial tile) and 17 (two whole panels and
    a one-row tile, the decode tile)."""
    code = compiled_cases_match_the_reference(QUANTIZED_CASES + [("fp8", "none", [3, 32], torch.bfloat16)], (3, 17))
    assert code.count("gemm.run(") == 2 * len(QUANTIZED_CASES), "two calls per template"
    for scheme in ("kSglang", "kTorchao"):  # W8A8 quantizes x in the template
        assert f"mi::QuantizedGemm<mi::ActivationQuant::{scheme}," in code
    assert code.count("torch.ops.mla.qkv_a_proj.default(") == 1, "the case the tiles cannot serve"


# Shapes the AMX tiles serve (quantized_gemm.h: K in whole 64-column chunks, K blocks of whole chunks,
# scale blocks of 16 rows), with weight rows past the last whole tile of 16 (40 and 24 rows): every
# format, int8 weight-only under bf16 activations too, fp8 with K blocks of 64 and with one of 128 over
# K = 192 (a partial last K block), and an odd count of chunks (W8A8's pairs of chunks).
AMX_CASES = [
    ("int8", "int8", None, torch.bfloat16),
    ("int8", "int8_torchao", None, torch.bfloat16),
    ("int8", "none", None, torch.bfloat16),
    ("fp8", "none", [16, 64], torch.bfloat16),
    ("fp8", "none", [16, 128], torch.bfloat16),
]


@pytest.mark.skipif(isa.host_isa() != "amx", reason="elsewhere these run the FMA and integer tiles, which "
                    "test_quantized_templates_in_one_compile covers (this compile costs half a minute cold)")
def test_quantized_templates_at_shapes_the_amx_tiles_serve():
    """The AMX tiles: one compile with dynamic rows, 8, 1 (decode) and 17 (a whole block of 16 x rows and
    one more). (test_isa builds them on CPUs without AMX.)"""
    code = compiled_cases_match_the_reference(AMX_CASES, (8, 1, 17), hidden=192, nq=40, lora=16, rope=8)
    assert code.count("gemm.run(") == 2 * len(AMX_CASES) and "torch.ops.mla" not in code


class EveryFiniteE4m3fn(nn.Module):
    """Frozen e4m3fn weights holding every finite value (its two NaN bytes zeroed), which the template
    widens NaN-free (widen.h's Float8_e4m3fn_finite): q has no norm, so row m of x = I gives q[m, n] =
    q_weight[n, m] times its scale, exactly (powers of two; 3 mantissa bits fit bf16's 7). With scales
    per [8, 32] block (K blocked: they scale x) and per 8 rows over all of K (they scale the sums)."""

    def __init__(self, hidden=64, nq=16, lora=8, rope=8):
        super().__init__()
        bits = torch.arange(256, dtype=torch.int32).repeat(nq * hidden // 256).view(nq, hidden)
        bits[(bits & 0x7F) == 0x7F] = 0
        constant = lambda t: nn.Parameter(t, requires_grad=False)  # noqa: E731
        self.q_weight = constant(bits.to(torch.uint8).view(torch.float8_e4m3fn))
        self.kv_weight = constant(torch.ones(lora + rope, hidden).to(torch.float8_e4m3fn))
        self.kv_norm_weight = constant(torch.ones(lora, dtype=torch.bfloat16))
        self.blocks = {(8, 32): 2.0 ** torch.arange(-2.0, 2.0).view(2, 2), (8, hidden): torch.tensor([[0.25], [4.0]])}
        self.scales = nn.ParameterList(constant(scale) for scale in self.blocks.values())

    def forward(self, x):
        return [op(x, self.q_weight, self.kv_weight, None, self.kv_norm_weight, 1e-6, 1e-6, q_weight_scale=scale,
                   kv_weight_scale=scale, weight_block_size=list(block))[0]
                for block, scale in zip(self.blocks, self.scales)]

    def expected(self, block, scale):
        return dequantize_fp64(self.q_weight, scale, block).t().bfloat16()


def test_frozen_fp8_weights_widen_every_finite_value_exactly():
    """Rows 0..63 in tiles of several rows, row 64 (e_0 again) in a one-row tile: both kinds of tile.
    x = 2^-24 I too: the widened weights times x stay clear of fp32's subnormals (nt_dot.h's kXPrescale).
    (Where subnormal FMA operands are slow, this weight's subnormals would keep it on the fp16 route:
    the rule is tested below, the fp16 route's exactness in test_gqa_decode.py.)"""
    model = EveryFiniteE4m3fn().eval()
    eye = torch.cat([torch.eye(64), torch.eye(64)[:1]])
    torch._dynamo.reset()
    with benchmarking.inference_freezing(), torch.no_grad():
        compiled = torch.compile(model)
        _, (code,) = run_and_get_code(compiled, eye.bfloat16())
        assert code.count("using weight_t = mla_inductor::Float8_e4m3fn_finite;") == 2 and "torch.ops.mla" not in code
        for x_scale in (1.0, 2.0**-24):
            for out, block, scale in zip(compiled((eye * x_scale).bfloat16()), model.blocks, model.scales):
                expected = model.expected(block, scale) * x_scale
                torch.testing.assert_close(out, torch.cat([expected, expected[:1]]), atol=0, rtol=0,
                                           msg=f"{block}, x times {x_scale}")


def test_int8_weight_only_weights_reach_the_sums_exactly_for_every_int8_value():
    """An int8 weight holding every value, -128 included (the AMX tiles' table covers magnitudes up to 127:
    quantized_gemm.h's weights_to_bf16x64), with power-of-two per-channel scales; q has no norm, so row m
    of x = I gives q[m, n] = q_weight[n, m] times its scale, exactly. 65 rows: whole blocks of x rows and
    a last one of one row."""
    hidden, nq, lora, rope = 64, 16, 8, 8
    weight = torch.arange(-128, 128, dtype=torch.int32).repeat(nq * hidden // 256).view(nq, hidden).to(torch.int8)
    scale = 2.0 ** torch.arange(-8.0, 8.0).view(nq, 1)
    kv_weight, kv_scale = torch.ones(lora + rope, hidden, dtype=torch.int8), torch.ones(lora + rope, 1)
    kv_norm_weight = torch.ones(lora, dtype=torch.bfloat16)

    def q_of(x):
        return op(x, weight, kv_weight, None, kv_norm_weight, 1e-6, 1e-6, q_weight_scale=scale,
                  kv_weight_scale=kv_scale, activation_quant="none")[0]

    eye = torch.cat([torch.eye(hidden), torch.eye(hidden)[:1]]).bfloat16()
    expected = (weight.double() * scale.double()).t().bfloat16()
    torch._dynamo.reset()
    out, (code,) = run_and_get_code(torch.compile(q_of), eye)
    assert "using weight_t = int8_t;" in code and "torch.ops.mla" not in code
    torch.testing.assert_close(out, torch.cat([expected, expected[:1]]), atol=0, rtol=0)


def test_a_nan_in_fp8_weights_reaches_exactly_the_outputs_it_multiplies():
    """e4m3fn's NaN in weight row 5 (at a shape the AMX tiles serve, whose table maps it to bf16's NaN;
    the FMA tiles' fp16 route keeps it too): q column 5 is NaN in every row, nothing else is, and the
    rest equals the op's eager reference."""
    args = quantized_args(("fp8", "none", [16, 64], torch.bfloat16), 3, hidden=128, nq=32, lora=16, rope=8)
    args["q_norm_weight"] = None  # a norm would spread the NaN over the row
    args["q_weight"].view(torch.uint8)[5, 70] = 0x7F
    fn = functools.partial(op, **{k: v for k, v in args.items() if k != "x"})
    torch._dynamo.reset()
    (q, *_), (code,) = run_and_get_code(torch.compile(fn), args["x"])
    assert "gemm.run(" in code and "torch.ops.mla" not in code
    assert q[:, 5].isnan().all() and q[:, :5].isfinite().all() and q[:, 6:].isfinite().all()
    torch.testing.assert_close(q, fn(args["x"])[0], atol=1e-2, rtol=1e-2, equal_nan=True)


@pytest.mark.parametrize("slow_subnormals", [False, True])
def test_fp8_weights_widen_into_fp32_bits_unless_a_nan_or_a_slow_subnormal(slow_subnormals, monkeypatch):
    """segment_gemm.widens_to_fp32_bits on frozen e4m3fn values: never with a NaN; with a subnormal only
    where FMAs take subnormal operands at full speed (the CPU said to be either kind)."""
    monkeypatch.setattr(isa, "slow_subnormal_inputs", lambda: slow_subnormals)
    finite = torch.tensor([0.0, -448.0, 2.0**-6, 1.5, -0.25]).to(torch.float8_e4m3fn)  # normals and zero
    subnormal = torch.cat([finite, torch.tensor([0x01], dtype=torch.uint8).view(torch.float8_e4m3fn)])
    nan = torch.cat([finite, torch.tensor([0xFF], dtype=torch.uint8).view(torch.float8_e4m3fn)])
    assert segment_gemm.widens_to_fp32_bits(finite) and not segment_gemm.widens_to_fp32_bits(nan)
    assert segment_gemm.widens_to_fp32_bits(subnormal) is not slow_subnormals


class DirectCall(nn.Module):
    """The op called by a model on its own parameters: under freezing they become graph constants."""

    def __init__(self, args):
        super().__init__()
        self.weights = nn.ParameterDict(
            {k: nn.Parameter(v, requires_grad=False) for k, v in args.items() if isinstance(v, torch.Tensor) and k != "x"}
        )

    def forward(self, x):
        w = self.weights
        return op(x, w["q_weight"], w["kv_weight"], w.get("q_norm_weight"), w["kv_norm_weight"], 1e-6, 1e-5,
                  w.get("q_bias"), w.get("kv_bias"))


def test_pack_vnni_blocks_layout():
    q, kv = torch.randn(40, 7), torch.randn(3, 7)  # a partial block each and an odd K
    packed = pack_vnni_blocks(q, kv)
    assert packed.shape == (3, 4 * 2 * 32)
    blocks = packed.view(3, 4, 32, 2)
    for block, weight, n0 in ((0, q, 0), (1, q, 32), (2, kv, 0)):
        for kp, c, e in ((0, 0, 0), (3, 5, 0), (2, 31, 1), (1, 17, 1)):
            n, k = n0 + c, 2 * kp + e
            expected = weight[n, k] if n < weight.shape[0] and k < weight.shape[1] else 0.0
            assert blocks[block, kp, c, e] == expected, (block, kp, c, e)


def test_pack_column_blocks_layout():
    q, kv = torch.randn(20, 7), torch.randn(3, 7)  # a partial block each
    packed = pack_column_blocks(q, kv)
    assert packed.shape == (3, 7 * 16)
    blocks = packed.view(3, 7, 16)
    for block, weight, n0 in ((0, q, 0), (1, q, 16), (2, kv, 0)):
        for k, c in ((0, 0), (6, 5), (3, 15), (2, 3)):
            n = n0 + c
            assert blocks[block, k, c] == (weight[n, k] if n < weight.shape[0] else 0.0), (block, k, c)


@pytest.mark.skipif(not can_pack(torch.bfloat16), reason="packing needs AVX2 or AVX-512")
def test_template_with_weights_packed_under_freezing():
    """Frozen bf16 weights are packed at compile time (odd K, partial blocks in both segments), and one
    compile with dynamic rows serves 1 to 512 rows and strided x."""
    shape = dict(hidden=99, nq=40, lora=36, rope=8)
    weights = make_args(1, torch.bfloat16, bias=True, **shape)
    model = DirectCall(weights).eval()
    torch._dynamo.reset()
    with benchmarking.inference_freezing(), torch.no_grad():
        fn = torch.compile(model, dynamic=True)
        x = torch.randn(3, 99).to(torch.bfloat16)
        _, (code,) = run_and_get_code(fn, x)
        assert "mi::packed_task" in code and "mi::nt_task" not in code
        wide = torch.randn(512, 2 * 99).to(torch.bfloat16)
        for rows in (1, 3, 17, 64, 512):
            for x in (wide[:rows, :99].contiguous(), wide[:rows, 99:]):
                args = dict(weights, x=x)
                outputs = fn(x)
                assert_close_to_reference(outputs, args, torch.bfloat16)
                ours, eager = max_errors(outputs, reference_fp64(**args)), max_errors(op(**args), reference_fp64(**args))
                for o, e in zip(ours, eager):
                    assert o <= 2 * e + 1e-7, (rows, ours, eager)


# --- the patterns ----------------------------------------------------------------------------------


class FusedWeightAttention(nn.Module):
    """The A-projections as vLLM and SGLang hold them: one weight, then split."""

    def __init__(self, hidden=64, q_lora_rank=24, kv_lora_rank=16, rope=8):
        super().__init__()
        self.sizes = [q_lora_rank, kv_lora_rank + rope]
        self.kv_lora_rank, self.rope = kv_lora_rank, rope
        self.fused_qkv_a_proj_with_mqa = nn.Linear(hidden, sum(self.sizes), bias=False)
        self.q_a_layernorm = RMSNorm(q_lora_rank, 1e-6)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, 1e-6)
        init_weights_(self, seed=0)

    def forward(self, x):
        q, latent = self.fused_qkv_a_proj_with_mqa(x).split(self.sizes, dim=-1)
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.rope], dim=-1)
        return self.q_a_layernorm(q) * 2, self.kv_a_layernorm(c_kv) + 1, k_pe * 3


class TwoLinears(nn.Module):
    """transformers' spelling: q_a_proj and kv_a_proj_with_mqa over the same x."""

    def __init__(self, hidden=64, q_lora_rank=24, kv_lora_rank=16, rope=8, bias=False):
        super().__init__()
        self.kv_lora_rank, self.rope = kv_lora_rank, rope
        self.q_a_proj = nn.Linear(hidden, q_lora_rank, bias=bias)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, kv_lora_rank + rope, bias=bias)
        self.q_a_layernorm = RMSNorm(q_lora_rank, 1e-6)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, 1e-6)
        init_weights_(self, seed=0)

    def forward(self, x, x_for_kv=None):
        c_kv, k_pe = self.kv_a_proj_with_mqa(x if x_for_kv is None else x_for_kv).split(
            [self.kv_lora_rank, self.rope], dim=-1
        )
        return self.q_a_layernorm(self.q_a_proj(x)) * 2, self.kv_a_layernorm(c_kv) + 1, k_pe * 3


class TestRewrite(expecttest.TestCase):
    def test_fused_weight_2d_joint(self):
        model = FusedWeightAttention().to(torch.bfloat16)
        graph = rewritten(model, torch.randn(3, 64).to(torch.bfloat16))
        self.assertExpectedInline(graph, """\
slice_tensor = slice.Tensor(arg0_1, 0, 0, 24)
slice_tensor_1 = slice.Tensor(arg0_1, 0, 24, 9223372036854775807)
qkv_a_proj_default = mla.qkv_a_proj(arg1_1, slice_tensor, slice_tensor_1, arg2_1, arg3_1, 1e-06, 1e-06)
getitem_4 = <built-in function getitem>(qkv_a_proj_default, 0)
getitem_5 = <built-in function getitem>(qkv_a_proj_default, 1)
getitem_6 = <built-in function getitem>(qkv_a_proj_default, 2)
mul_2 = mul.Tensor(getitem_4, 2)
add_2 = add.Tensor(getitem_5, 1)
mul_5 = mul.Tensor(getitem_6, 3)""")

    def test_two_linears_3d_post_grad(self):
        model = TwoLinears().to(torch.bfloat16)
        graph = rewritten(model, torch.randn(2, 3, 64).to(torch.bfloat16), stage="post_grad")
        self.assertExpectedInline(graph, """\
qkv_a_proj_default = mla.qkv_a_proj(arg1_1, arg2_1, arg0_1, arg3_1, arg4_1, 1e-06, 1e-06)
getitem_2 = <built-in function getitem>(qkv_a_proj_default, 0)
getitem_3 = <built-in function getitem>(qkv_a_proj_default, 1)
getitem_4 = <built-in function getitem>(qkv_a_proj_default, 2)
mul_2 = mul.Tensor(getitem_2, 2)
add_2 = add.Tensor(getitem_3, 1)
mul_5 = mul.Tensor(getitem_4, 3)""")

    def test_two_linears_3d_dynamic_fp32_with_bias(self):
        model = TwoLinears(bias=True)
        graph = rewritten(model, torch.randn(1, 5, 64), dynamic=True)
        self.assertIn("mla.qkv_a_proj", graph)
        self.assertNotIn(" = mm(", graph)
        self.assertNotIn("addmm", graph)

    def test_under_freezing_the_joint_pass_takes_it_before_weight_packing(self):
        model = TwoLinears().to(torch.bfloat16)
        graph = rewritten(model, torch.randn(1, 3, 64).to(torch.bfloat16), freezing=True)  # decode-sized
        self.assertIn("mla.qkv_a_proj", graph)
        self.assertNotIn("mkldnn", graph)

    def test_explain_names_the_module_where_it_fired(self):
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.self_attn = FusedWeightAttention()

            def forward(self, x):
                return self.self_attn(x)

        result = mla_inductor.explain(Block().to(torch.bfloat16), torch.randn(2, 64).to(torch.bfloat16), verbose=False)
        self.assertEqual([(e.fusion, e.where) for e in result.fired], [("qkv_a_proj", "self_attn")])
        self.assertIn("fired     qkv_a_proj           self_attn", str(result))

    # --- where it must not fire ---

    def test_not_when_the_projections_read_different_inputs(self):
        model = TwoLinears().to(torch.bfloat16)
        x = torch.randn(3, 64).to(torch.bfloat16)
        graph = rewritten(model, x, x + 1, fusions={"linear": False})  # else they become mla::linear here
        self.assertNotIn("qkv_a_proj", graph)
        self.assertEqual(graph.count(" = mm("), 2)

    def test_a_norm_weight_of_another_dtype_stays_outside_the_op(self):
        model = TwoLinears().to(torch.bfloat16)
        model.q_a_layernorm.float()  # its output is fp32: the op cannot produce it
        x = torch.randn(3, 64).to(torch.bfloat16)
        result = mla_inductor.explain(model, x, verbose=False)
        self.assertTrue(any("q_norm_weight has dtype torch.float32" in e.reason for e in result.rejected))
        graph = rewritten(model, x)  # the projections still fuse, without the q norm
        self.assertIn("mla.qkv_a_proj", graph)
        self.assertEqual(graph.count("rsqrt("), 1)
        self.assertEqual(graph.count(" = mm("), 0)

    def test_not_when_switched_off(self):
        model = FusedWeightAttention().to(torch.bfloat16)
        graph = rewritten(model, torch.randn(3, 64).to(torch.bfloat16), fusions={"qkv_a_proj": False})
        self.assertNotIn("qkv_a_proj", graph)

    def test_not_for_many_rows_under_freezing_where_onednn_is_faster(self):
        # bf16 weights are packed and the template wins up to 8 rows (at every row count where oneDNN has
        # no native bf16: test_gqa_qkv covers that); fp32 ones are not, and it wins up to 4
        cases = ((torch.bfloat16, 16), (torch.float32, 8)) if isa.native_bf16_gemm() else ((torch.float32, 8),)
        for dtype, rows in cases:
            model = FusedWeightAttention().to(dtype)
            torch._dynamo.reset()
            with torch._inductor.config.patch(freezing=True):
                result = mla_inductor.explain(model, torch.randn(rows, 64).to(dtype), verbose=False)
            self.assertEqual(result.counts()["qkv_a_proj"], 0)
            self.assertIn(f"{rows} rows", str(result))


# --- real models -----------------------------------------------------------------------------------


def test_serving_model_decode_fires_per_layer_and_matches_eager():
    expected, actual = serving_model_decode(3, [17, 33])
    counts = mla_inductor.fusion_counts()
    assert counts["qkv_a_proj"] == counts["mla_decode"] == 3, counts  # static shapes
    torch.testing.assert_close(actual, expected, atol=5e-2, rtol=2e-2)  # bf16 logits after 3 layers


@pytest.mark.parametrize(
    "name, overrides",
    [("tiny", {}), ("tiny-no-q-lora", {"q_lora_rank": None})],
)
def test_transformers_deepseek_fires_per_layer_and_matches_eager(name, overrides):
    config = get_config("tiny", **overrides)
    arch = "v2" if overrides else "v3"
    model = build_hf_model(config, arch=arch, dtype=torch.float32)
    ids = torch.randint(0, config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
        actual = torch.compile(lambda i: model(input_ids=i, use_cache=False).logits, backend="mla_inductor")(ids)
    assert mla_inductor.fusion_counts()["qkv_a_proj"] == config.num_layers
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
