"""q_b_absorb: the op, its C++ template (NT and packed GEMM), the pattern (where it fires and where not),
the serving model."""

import functools

import expecttest
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.utils import run_and_get_code

import mla_inductor
from mla_inductor import benchmarking
from mla_inductor.lowerings.segment_gemm import can_pack
from mla_inductor.ops.q_b_absorb import reference_fp64
from mla_inductor.ops.weight_quant import quantize_weight_fp8_blocks, quantize_weight_int8

from graph_utils import rewritten, serving_model_decode
from quant_utils import dequantize_fp64, quantize_rows_int8_fp64

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-4}
op = torch.ops.mla.q_b_absorb


def make_args(tokens, dtype, heads=3, nope=16, rope=8, latent=40, q_lora_rank=48, seed=0):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    angles = torch.rand(tokens, rope // 2, generator=g) * 6.3
    return dict(
        q_a=randn(tokens, q_lora_rank),
        q_b_weight=randn(heads * (nope + rope), q_lora_rank, scale=q_lora_rank**-0.5),
        w_kc=randn(heads, nope, latent, scale=nope**-0.5),
        cos=angles.cos().to(dtype),
        sin=angles.sin().to(dtype),
    )


def assert_matches_fp64(out, args, rope_style):
    reference = reference_fp64(**args, rope_style=rope_style)
    tol = TOLERANCE[args["q_a"].dtype]
    assert out.dtype == args["q_a"].dtype and out.shape == reference.shape
    torch.testing.assert_close(out.double(), reference, atol=tol, rtol=tol)
    return (out.double() - reference).abs().max().item()


# --- the op ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("rope_style", ["interleaved", "neox", "interleaved_to_halves"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_op_matches_fp64_reference(dtype, rope_style):
    args = make_args(5, dtype)
    assert_matches_fp64(op(**args, rope_style=rope_style), args, rope_style)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(q_a=torch.zeros(2, 5, 48)), r"q_a must be \[tokens, q_lora_rank\]"),
        (dict(q_b_weight=torch.zeros(71, 48)), r"q_b_weight must be \[heads \* \(qk_nope_head_dim \+ rope\)"),
        (dict(w_kc=torch.zeros(3, 16)), r"w_kc must be \[heads, qk_nope_head_dim, kv_lora_rank\]"),
        (dict(w_kc=torch.zeros(3, 16, 40, dtype=torch.float64)), "w_kc has dtype torch.float64"),
        (dict(cos=torch.zeros(4, 4)), r"cos must be a floating \[tokens=5, rope / 2\]"),
        (dict(sin=torch.zeros(5, 3)), r"sin must be torch.float32\[5, 4\] like cos"),
        (dict(q_a=torch.zeros(5, 48, device="meta")), "q_a must be on the CPU"),
    ],
)
def test_op_rejects_bad_input_naming_the_argument(change, message):
    args = dict(make_args(5, torch.float32), **change)
    with pytest.raises(ValueError, match=message):
        op(**args, rope_style="interleaved")


# --- the template ----------------------------------------------------------------------------------


@functools.cache
def compiled_op(rope_style):
    """Token count dynamic: one compile per rotation style (and dtype) serves every row count."""
    return torch.compile(lambda q_a, q_b_weight, w_kc, cos, sin: op(q_a, q_b_weight, w_kc, cos, sin, rope_style))


@pytest.mark.parametrize("rope_style", ["interleaved", "neox", "interleaved_to_halves"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_template_matches_reference_and_is_no_less_accurate_than_eager(dtype, rope_style):
    for tokens in (1, 3, 17, 64):
        # nope and kv_lora_rank off the kernels' steps (4 weight rows, one vector): the tails run too
        args = make_args(tokens, dtype, seed=tokens, nope=18, latent=44)
        torch._dynamo.maybe_mark_dynamic(args["q_a"], 0)
        torch._dynamo.maybe_mark_dynamic(args["cos"], 0)
        torch._dynamo.maybe_mark_dynamic(args["sin"], 0)
        out, (code,) = run_and_get_code(compiled_op(rope_style), **args)
        assert "mi::absorb_head" in code and "torch.ops.mla.q_b_absorb" not in code
        ours = assert_matches_fp64(out, args, rope_style)
        eager = (op(**args, rope_style=rope_style).double() - reference_fp64(**args, rope_style=rope_style)).abs().max().item()
        assert ours <= 2 * eager + 1e-7, (tokens, ours, eager)


def test_template_w_kc_as_a_transposed_view():
    """SGLang passes W_kc as [H, L, nope]: its transpose has stride 1 in the middle dim, not the last,
    and must reach the kernel as rows dense along kv_lora_rank."""
    args = make_args(3, torch.bfloat16)
    w_kc_sglang = args["w_kc"].transpose(1, 2).contiguous()
    fn = torch.compile(lambda q_a, q_b_weight, w, cos, sin: op(q_a, q_b_weight, w.transpose(1, 2), cos, sin, "interleaved"))
    assert_matches_fp64(fn(args["q_a"], args["q_b_weight"], w_kc_sglang, args["cos"], args["sin"]), args, "interleaved")


# SGLang's W8A8 (q_a quantized per token, per-channel int8 q_b) and fp8 blocks of [8, 16] over
# q_lora_rank 40 (a partial K block) and 3 heads x (18 + 8) = 78 rows (a partial row block); both again
# at a q_lora_rank the AMX tiles serve (quantized_gemm.h: whole 64-column chunks; blocks of [16, 64]).
QUANTIZED_CASES = [("int8", "int8", None, 40), ("fp8", "none", [8, 16], 40),
                   ("int8", "int8", None, 128), ("fp8", "none", [16, 64], 128)]


def quantized_args(case, tokens, seed=0):
    fmt, activation_quant, block, q_lora_rank = case
    args = make_args(tokens, torch.bfloat16, seed=seed, nope=18, q_lora_rank=q_lora_rank)
    weight = args["q_b_weight"]
    args["q_b_weight"], scale = quantize_weight_int8(weight) if fmt == "int8" else quantize_weight_fp8_blocks(weight, block)
    return dict(args, q_b_weight_scale=scale, weight_block_size=block, activation_quant=activation_quant)


def assert_matches_quantized_fp64(out, args):
    q_a = quantize_rows_int8_fp64(args["q_a"]) if args["activation_quant"] == "int8" else args["q_a"]
    weight = dequantize_fp64(args["q_b_weight"], args["q_b_weight_scale"], args["weight_block_size"])
    reference = reference_fp64(q_a, weight, args["w_kc"], args["cos"], args["sin"], "interleaved")
    assert out.dtype == torch.bfloat16 and out.shape == reference.shape
    torch.testing.assert_close(out.double(), reference, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("case", QUANTIZED_CASES, ids=str)
def test_quantized_op_matches_fp64_reference(case):
    args = quantized_args(case, 5)
    assert_matches_quantized_fp64(op(**args, rope_style="interleaved"), args)


def test_quantized_templates_in_one_compile():
    keys = ("q_a", "q_b_weight", "w_kc", "cos", "sin", "q_b_weight_scale")

    def fn(*flat):
        outputs = []
        for i, (_, activation_quant, block, _) in enumerate(QUANTIZED_CASES):
            q_a, q_b_weight, w_kc, cos, sin, scale = flat[i * len(keys):(i + 1) * len(keys)]
            outputs.append(op(q_a, q_b_weight, w_kc, cos, sin, "interleaved", q_b_weight_scale=scale,
                              weight_block_size=block, activation_quant=activation_quant))
        return outputs

    compiled = torch.compile(fn)
    for tokens in (3, 17):  # one compile (dynamic tokens); 17 ends on a one-row tile, the decode tile
        all_args = [quantized_args(case, tokens, seed=tokens) for case in QUANTIZED_CASES]
        for args in all_args:
            for name in ("q_a", "cos", "sin"):
                torch._dynamo.maybe_mark_dynamic(args[name], 0)
        flat = [args[k] for args in all_args for k in keys]
        if tokens == 3:
            outputs, (code,) = run_and_get_code(compiled, *flat)
            assert code.count("gemm.run(") == len(QUANTIZED_CASES) and "torch.ops.mla" not in code
        else:
            outputs = compiled(*flat)
        for args, out in zip(all_args, outputs):
            assert_matches_quantized_fp64(out, args)


class FrozenWeights(nn.Module):
    """Weights that freezing makes constants: a bf16 q_b_weight and w_kc (packed at compile time), and
    two fp8 q_b weights, the second holding a NaN."""

    def __init__(self, args, fp8_args):
        super().__init__()
        constant = lambda t: nn.Parameter(t, requires_grad=False)  # noqa: E731
        self.q_b_weight, self.w_kc = constant(args["q_b_weight"]), constant(args["w_kc"])
        nan_weight = fp8_args["q_b_weight"].clone()
        nan_weight.view(torch.uint8)[5, 7] = 0x7F  # e4m3fn's NaN
        self.fp8_finite, self.fp8_nan = constant(fp8_args["q_b_weight"]), constant(nan_weight)
        self.fp8_scale, self.fp8_w_kc = constant(fp8_args["q_b_weight_scale"]), constant(fp8_args["w_kc"])
        self.block = fp8_args["weight_block_size"]

    def forward(self, q_a, cos, sin, fp8_q_a, fp8_cos, fp8_sin):
        return [op(q_a, self.q_b_weight, self.w_kc, cos, sin, "interleaved")] + [
            op(fp8_q_a, weight, self.fp8_w_kc, fp8_cos, fp8_sin, "interleaved", q_b_weight_scale=self.fp8_scale,
               weight_block_size=self.block) for weight in (self.fp8_finite, self.fp8_nan)]


@pytest.mark.skipif(not can_pack(torch.bfloat16), reason="packing needs AVX2 or AVX-512")
def test_template_under_freezing_packs_bf16_and_skips_the_fp8_nan_fix_only_without_a_nan():
    """Frozen bf16 weights are packed (odd K, a partial block). A frozen e4m3fn weight proven NaN-free
    widens without the NaN fix; one NaN keeps it, and the NaN reaches the rows it multiplies."""
    args = make_args(3, torch.bfloat16, q_lora_rank=99, heads=2, nope=24, rope=8)
    fp8_args = quantized_args(QUANTIZED_CASES[1], 3)
    model = FrozenWeights(args, fp8_args).eval()
    inputs = [a[k] for a in (args, fp8_args) for k in ("q_a", "cos", "sin")]
    torch._dynamo.reset()
    with benchmarking.inference_freezing(), torch.no_grad():
        (out, fp8_finite, fp8_nan), (code,) = run_and_get_code(torch.compile(model), *inputs)
        fp8_expected = model(*inputs)[2]
    (packed,) = [kernel for kernel in code.split("async_compile.cpp") if "mi::packed_task(" in kernel]
    assert "mi::nt_task(" not in packed and "mi::absorb_head" not in packed, "q_b_weight and w_kc both packed"
    ours = assert_matches_fp64(out, args, "interleaved")
    eager = (op(**args, rope_style="interleaved").double() - reference_fp64(**args, rope_style="interleaved")).abs().max().item()
    assert ours <= 2 * eager + 1e-7, (ours, eager)

    assert code.count("gemm.run(") == 2
    for weight_type in ("mla_inductor::Float8_e4m3fn_finite", "at::Float8_e4m3fn"):  # NaN-free, and with the NaN
        assert f"using weight_t = {weight_type};  // q_b_proj's" in code
    assert_matches_quantized_fp64(fp8_finite, fp8_args)
    # q_b row 5 is in head 0's nope part: it reaches head 0's absorbed latent columns, not its rope
    assert fp8_nan[:, 0, :40].isnan().all() and fp8_nan[:, 0, 40:].isfinite().all() and fp8_nan[:, 1:].isfinite().all()
    torch.testing.assert_close(fp8_nan, fp8_expected, atol=1e-2, rtol=1e-2, equal_nan=True)


# --- the pattern -----------------------------------------------------------------------------------


def rope_interleaved(x, cos, sin):
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)


def rope_neox(x, cos, sin):
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def serving_query(q_a, q_b_weight, kv_b_weight, cos, sin, rope=rope_interleaved):
    """The decode query as serving code builds it (models/mla.py), followed by a consumer."""
    heads, nope, latent = 3, 16, 40
    q = F.linear(q_a, q_b_weight)
    q_nope, q_pe = q.view(-1, heads, nope + 8).split([nope, 8], dim=-1)
    q_pe = rope(q_pe, cos[:, None, :], sin[:, None, :])
    w_kc = kv_b_weight.view(heads, nope + 16, latent)[:, :nope]
    q_input = q_a.new_empty(q_a.shape[0], heads, latent + 8)
    q_input[..., :latent] = torch.bmm(q_nope.transpose(0, 1), w_kc).transpose(0, 1)
    q_input[..., latent:] = q_pe
    return q_input * 2


def serving_inputs():
    args = make_args(5, torch.bfloat16)
    kv_b_weight = torch.randn(3 * (16 + 16), 40).to(torch.bfloat16)
    return args["q_a"], args["q_b_weight"], kv_b_weight, args["cos"], args["sin"]


class TestRewrite(expecttest.TestCase):
    def test_serving_query_joint(self):
        graph = rewritten(serving_query, *serving_inputs())
        self.assertExpectedInline(graph, """\
view_2 = view(arg4_1, [3, 32, 40])
slice_3 = slice.Tensor(view_2, 1, 0, 16)
q_b_absorb_default = mla.q_b_absorb(arg0_1, arg1_1, slice_3, arg2_1, arg3_1, interleaved)
mul_4 = mul.Tensor(q_b_absorb_default, 2)""")

    def test_not_for_a_neox_rotation(self):
        graph = rewritten(functools.partial(serving_query, rope=rope_neox), *serving_inputs())
        self.assertNotIn("q_b_absorb", graph)

    def test_not_when_switched_off(self):
        graph = rewritten(serving_query, *serving_inputs(), fusions={"q_b_absorb": False})
        self.assertNotIn("q_b_absorb", graph)


# --- the serving model -----------------------------------------------------------------------------


@pytest.mark.parametrize("freezing", [False, True])
def test_serving_model_decode_fires_per_layer_and_matches_eager(freezing):
    """Per layer: q_b_absorb on the q latent of qkv_a_proj, which rotates k_pe (q_pe's rotation is
    inside q_b_absorb): the whole chain as qkv_proj_with_rope; and the latent attention as mla_decode,
    batch and cache length symbolic."""
    expected, actual = serving_model_decode(2, [17, 33, 1], dynamic=True, freezing=freezing)
    counts = mla_inductor.fusion_counts()
    assert counts["qkv_proj_with_rope"] == counts["rope"] == counts["q_b_absorb"] == counts["mla_decode"] == 2, counts
    torch.testing.assert_close(actual, expected, atol=5e-2, rtol=2e-2)  # bf16 logits after 2 layers
