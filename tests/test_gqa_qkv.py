"""gqa_qkv: mla::qkv (Neuron's contract) and mla::gqa_qkv, their template (mla::qkv_projection), and
the pattern on transformers Llama / Qwen2 / Qwen3 (Gemma-2: tests/spellings/test_gqa_decode_spellings.py)."""

import functools
import itertools

import expecttest
import pytest
import torch
import transformers
from torch._inductor.utils import run_and_get_code
from transformers.models.llama import modeling_llama

import mla_inductor
from graph_utils import (declined, fired, greedy, rewrite_and_run, rewritten, rewritten_and_run,
                         static_cache_greedy_decode, tiny_gqa_model as tiny)
from mla_inductor import isa
from mla_inductor.lowerings.segment_gemm import can_pack, packs_rows
from mla_inductor.ops.gqa_qkv import FP8, reference_fp64

B, S, H, NQ, NKV, D = 2, 3, 96, 4, 2, 16
I = (NQ + 2 * NKV) * D
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


def make_inputs(dtype, seed=0, batch=B, seq=S, hidden=H):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    angles = torch.rand(batch, seq, D // 2, generator=g) * 6.3
    return dict(
        input=randn(batch, seq, hidden), fused_qkv_weights=randn(hidden, I, scale=hidden**-0.5), bias=randn(I),
        mlp_prev=randn(batch, seq, hidden), attention_prev=randn(batch, seq, hidden), gamma=randn(hidden) + 1,
        beta=randn(hidden),
        cos=torch.cat([angles.cos()] * 2, -1).to(dtype), sin=torch.cat([angles.sin()] * 2, -1).to(dtype),
    )


def call_qkv(a, layout="BSD", bias=False, residual=(), norm="none", rope=False, cache=None, fn=None):
    fn = fn or torch.ops.mla.qkv
    k_cache, v_cache, k_scale, v_scale, block, slots = cache or (None,) * 6
    return fn(
        a["input"], a["fused_qkv_weights"], layout, a["bias"] if bias else None, "none", None, None, bool(residual),
        a["mlp_prev"] if "mlp" in residual else None, a["attention_prev"] if "attention" in residual else None,
        norm, a["gamma"] if norm in ("rms_norm", "layer_norm", "gemma_rms_norm") else None,
        a["beta"] if norm == "layer_norm" else None,
        1e-5, rope, a["cos"] if rope else None, a["sin"] if rope else None, D, NQ, NKV,
        k_cache, v_cache, k_scale, v_scale, block is not None, block, slots,
    )


def fp64_of(a, bias, residual, norm, rope):
    return reference_fp64(
        a["input"], a["fused_qkv_weights"], a["bias"] if bias else None,
        tuple(a[f"{r}_prev"] for r in residual),
        (norm, a["gamma"], a["beta"] if norm == "layer_norm" else None, 1e-5),
        (a["cos"], a["sin"], D, NQ + NKV) if rope else None,
    )


def to_bsd(out, layout):
    return out if layout == "BSD" else out.permute(1, 2, 0, 3).reshape(out.shape[1], out.shape[2], -1)


OPTIONS = list(itertools.product(
    ["BSD", "NBSd"], [False, True], [(), ("mlp",), ("mlp", "attention")],
    ["none", "rms_norm", "rms_norm_skip_gamma", "layer_norm", "gemma_rms_norm"], [False, True],
))


@pytest.mark.parametrize("layout, bias, residual, norm, rope", OPTIONS)
def test_op_matches_fp64_for_every_option(layout, bias, residual, norm, rope):
    a = make_inputs(torch.float32)
    out, res = call_qkv(a, layout, bias, residual, norm, rope)
    torch.testing.assert_close(to_bsd(out, layout).double(), fp64_of(a, bias, residual, norm, rope), atol=1e-4, rtol=1e-4)
    if residual:
        torch.testing.assert_close(res, a["input"] + sum(a[f"{r}_prev"] for r in residual))
    else:
        assert res.numel() == 0


def _cache(dtype, block, fp8):
    shape = (6, 8, NKV * D) if block else (B, 16, NKV * D)
    cache_dtype = FP8 if fp8 else dtype
    k_cache, v_cache = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    scales = (torch.tensor(0.5), torch.tensor(0.25)) if fp8 else (None, None)
    slots = torch.tensor([9, 17, 40, 3, 4, 47]) if block else torch.tensor([5, 6, 7, 20, 21, 22])
    return (k_cache, v_cache, *scales, 8 if block else None, slots)


@pytest.mark.parametrize("block, fp8", [(False, False), (True, False), (False, True), (True, True)])
def test_op_writes_the_kv_cache_at_the_slots(block, fp8):
    a = make_inputs(torch.bfloat16)
    cache = _cache(torch.bfloat16, block, fp8)
    out, _ = call_qkv(a, rope=True, cache=cache)
    heads = out.view(B * S, NQ + 2 * NKV, D)
    k_cache, v_cache, k_scale, v_scale, _, slots = cache
    for cached, new, scale in ((k_cache, heads[:, NQ : NQ + NKV], k_scale), (v_cache, heads[:, NQ + NKV :], v_scale)):
        rows = cached.view(-1, NKV * D)[slots].float()
        expected = new.reshape(B * S, -1).float()
        if fp8:  # dequantized, within e4m3's resolution (3 mantissa bits: 1/16 relative)
            torch.testing.assert_close(rows * scale, expected, atol=scale.item() / 8, rtol=1 / 16)
        else:
            torch.testing.assert_close(rows, expected)
        others = torch.ones(cached.view(-1, NKV * D).shape[0], dtype=torch.bool)
        others[slots] = False
        assert not cached.view(-1, NKV * D)[others].float().any()  # nothing else written


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(fused_qkv_weights=torch.zeros(95, I)), "contract dimension mismatch: input's hidden size 96 != the weights' 95"),
        (dict(fused_rope=True, cos_cache=None), "fused_rope needs cos_cache and sin_cache"),
        (dict(fused_norm_type="rms_norm", gamma_norm_weights=None), "fused_norm_type='rms_norm' needs gamma_norm_weights"),
        (dict(fused_norm_type="batch_norm"), "fused_norm_type must be one of"),
        (dict(fused_residual_add=True), "fused_residual_add needs mlp_prev and/or attention_prev"),
        (dict(output_layout="NBSd", d_head=None), "d_head, num_q_heads and num_kv_heads are required"),
        (dict(num_kv_heads=3), r"\(num_q_heads \+ 2 \* num_kv_heads\) \* d_head = \(4 \+ 2 \* 3\) \* 16 != .* 128"),
        (dict(layer_norm_bias=torch.zeros(H)), "layer_norm_bias is only for fused_norm_type='layer_norm'"),
        (dict(k_cache=torch.zeros(2, 16, NKV * D)), "k_cache and v_cache come together"),
        (dict(k_cache=torch.zeros(2, 16, 30), v_cache=torch.zeros(2, 16, 30), slot_mapping=torch.arange(6)),
         r"k_cache must be a contiguous .* kv_dim = num_kv_heads \* d_head = 32"),
        (dict(k_cache=torch.zeros(2, 16, NKV * D, dtype=FP8), v_cache=torch.zeros(2, 16, NKV * D, dtype=FP8),
              slot_mapping=torch.arange(6)), "an FP8 cache needs k_scale and v_scale"),
        (dict(k_cache=torch.zeros(2, 16, NKV * D), v_cache=torch.zeros(2, 16, NKV * D)),
         "writing the KV cache needs slot_mapping"),
        (dict(k_cache=torch.zeros(2, 16, NKV * D), v_cache=torch.zeros(2, 16, NKV * D), use_block_kv=True,
              slot_mapping=torch.arange(6)), "use_block_kv needs block_size"),
        (dict(k_cache=torch.zeros(2, 16, NKV * D), v_cache=torch.zeros(2, 16, NKV * D),
              slot_mapping=torch.tensor([0, 1, 2, 3, 4, 32])), r"slot_mapping must be in \[0, 32\)"),
        (dict(input=torch.zeros(B, S, H, dtype=torch.bfloat16)), "fused_qkv_weights has dtype torch.float32"),
    ],
)
def test_op_rejects_bad_input_naming_the_argument(change, message):
    a = make_inputs(torch.float32)
    args = dict(input=a["input"], fused_qkv_weights=a["fused_qkv_weights"], output_layout="BSD", d_head=D,
                num_q_heads=NQ, num_kv_heads=NKV, fused_rope=True, cos_cache=a["cos"], sin_cache=a["sin"])
    args.update(change)
    with pytest.raises(ValueError, match=message):
        torch.ops.mla.qkv(**args)


# --- Neuron's FP8 quantization types: float8_e4m3fn weights, the activations quantized to fp8 -----------


def fp8_case(kind, seed=0, hidden=H):
    """Inputs of quantization_type `kind` ("row" or "static") with rotary q / k heads, and its fp64
    result: weights and activations quantized as the Neuron types say (a tensor's fp8 rounding is
    torch's cast), the products and the scales in fp64."""
    a = make_inputs(torch.bfloat16, seed=seed, hidden=hidden)
    w = a["fused_qkv_weights"].double()
    if kind == "row":  # a scale per weight column; each token by its own absmax
        w_scale = (w.abs().amax(0) / 448).float()[None]
        columns = w_scale[0].double()
        x_scale = a["input"].double().abs().amax(-1, keepdim=True) / 448
        in_scale = None
    else:  # a scale per q, k, v section; every token by one input scale
        w_scale = torch.tensor([[0.004, 0.003, 0.005]])
        columns = torch.cat([w_scale[0, i].double().expand(n) for i, n in enumerate((NQ * D, NKV * D, NKV * D))])
        in_scale = torch.tensor([[0.02]])
        x_scale = torch.full((B, S, 1), 0.02, dtype=torch.float64)
    weights = (w / columns).clamp(-448, 448).to(FP8)
    x = (a["input"].double() / x_scale).clamp(-448, 448).float().to(FP8)
    qkv = (x.double() @ weights.double()) * x_scale * columns
    heads = qkv.view(B, S, -1, D)
    cos, sin = a["cos"].double()[:, :, None], a["sin"].double()[:, :, None]
    rotated = heads[:, :, : NQ + NKV]
    rotated = rotated * cos + torch.cat([-rotated[..., D // 2 :], rotated[..., : D // 2]], -1) * sin
    expected = torch.cat([rotated, heads[:, :, NQ + NKV :]], 2).reshape(B, S, -1)
    args = dict(input=a["input"], fused_qkv_weights=weights, quantization_type=kind, qkv_w_scale=w_scale,
                qkv_in_scale=in_scale, fused_rope=True, cos_cache=a["cos"], sin_cache=a["sin"], d_head=D,
                num_q_heads=NQ, num_kv_heads=NKV)
    return args, expected


def test_fp8_quantization_types_match_fp64_eager_and_compiled():
    """ROW and STATIC (their fp8 is float8_e4m3fn, largest value 448), the GEMM in the template over
    the fp8 weights with the activations quantized inside it; one compile for both, at a hidden size
    with a partial vector and at one the AMX tiles serve (quantized_gemm.h; on an AMX CPU)."""
    cases = {(kind, hidden): fp8_case(kind, hidden=hidden) for hidden in (H, 128) for kind in ("row", "static")}
    layouts = ("BSD", "NBSd") * 2

    def each(*calls):
        return [torch.ops.mla.qkv(**args, output_layout=layout)[0] for args, layout in zip(calls, layouts)]

    torch._dynamo.reset()
    compiled, (code,) = run_and_get_code(torch.compile(each, backend="mla_inductor"), *(c[0] for c in cases.values()))
    assert "kFp8Row" in code and "kFp8Static" in code and "mla.qkv_projection" not in code, "the template did not run"
    eager = each(*(c[0] for c in cases.values()))
    for (args, expected), ours, theirs, layout in zip(cases.values(), compiled, eager, layouts):
        for out in (ours, theirs):  # bf16 outputs of magnitude ~3: a bf16 step or two
            torch.testing.assert_close(to_bsd(out, layout).double(), expected, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(quantization_type="mx"), "quantization_type must be one of"),
        (dict(qkv_w_scale=None), "quantization_type='row' needs qkv_w_scale"),
        (dict(qkv_w_scale=torch.ones(1, I - 1)), rf"qkv_w_scale must be \[1, {I}\] or \[{I}\] for 'row'"),
        (dict(qkv_in_scale=torch.ones(1, 1)), "qkv_in_scale is STATIC quantization's"),
        (dict(quantization_type="static", qkv_w_scale=torch.ones(1, 3)), "'static' needs qkv_in_scale"),
        (dict(quantization_type="static", qkv_w_scale=torch.ones(1, 3), qkv_in_scale=torch.ones(2)),
         r"qkv_in_scale must hold one value"),
        (dict(quantization_type="static", qkv_w_scale=torch.ones(I)), r"must be \[1, 3\] or \[3\] \(q, k, v\)"),
        (dict(qkv_w_scale=torch.ones(1, I, dtype=torch.bfloat16)), "qkv_w_scale has dtype torch.bfloat16"),
        (dict(fused_qkv_weights=torch.zeros(H, I, dtype=torch.bfloat16)),
         "expected quantization_type='row': torch.float8_e4m3fn"),
        (dict(quantization_type="none"), "fused_qkv_weights has dtype torch.float8_e4m3fn, expected input's"),
    ],
)
def test_fp8_quantization_rejects_bad_arguments_naming_them(change, message):
    args, _ = fp8_case("row")
    args.update(change)
    with pytest.raises(ValueError, match=message):
        torch.ops.mla.qkv(**args)


# --- the template ----------------------------------------------------------------------------------


@functools.cache
def compiled_qkv(layout, bias, residual, norm, rope):
    return torch.compile(functools.partial(call_qkv, layout=layout, bias=bias, residual=residual, norm=norm, rope=rope),
                         dynamic=False)


@pytest.mark.parametrize("layout, bias, residual, norm, rope", [
    ("BSD", False, (), "none", False),  # the plain GEMM (no head structure)
    ("BSD", True, ("mlp",), "rms_norm", True),  # what Qwen2's layers need
    ("NBSd", False, ("mlp", "attention"), "layer_norm", True),
])
def test_template_matches_fp64_and_is_no_less_accurate_than_eager(layout, bias, residual, norm, rope):
    for dtype, seq in ((torch.bfloat16, 3), (torch.float32, 1)):
        a = make_inputs(dtype, seed=seq, seq=seq)
        torch._dynamo.reset()
        (out, res), (code,) = run_and_get_code(compiled_qkv(layout, bias, residual, norm, rope), a)
        assert "mla_qkv_projection" in code or "seg_task" in code, "the template did not run"
        expected = fp64_of(a, bias, residual, norm, rope)
        ours = (to_bsd(out, layout).double() - expected).abs().max().item()
        eager = (to_bsd(call_qkv(a, layout, bias, residual, norm, rope)[0], layout).double() - expected).abs().max().item()
        assert ours <= 2 * eager + TOLERANCE[dtype] / 10, (ours, eager)
        torch.testing.assert_close(to_bsd(out, layout).double(), expected, atol=TOLERANCE[dtype] * 4,
                                   rtol=TOLERANCE[dtype])


class ThreeLinears(torch.nn.Module):
    def __init__(self, dtype, bias):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(H, n * D, bias=bias).to(dtype) for n in (NQ, NKV, NKV))
        self.gamma = torch.nn.Parameter(torch.rand(H).to(dtype) + 0.5)

    def forward(self, x, cos, sin):
        return torch.ops.mla.gqa_qkv(x, self.q.weight, self.k.weight, self.v.weight, self.q.bias, self.k.bias,
                                     self.v.bias, "NBSd", False, None, "rms_norm", self.gamma, 1e-6, True, cos, sin,
                                     D, NQ, NKV)[0]


@pytest.mark.parametrize("freezing", [False, True])
def test_template_three_weights_packed_under_freezing(freezing):
    """Frozen bf16 weights are packed at compile time where the target can pack them (can_pack), one
    segment's blocks after another; elsewhere the NT tiles read nn.Linear's layout, and on AVX-512 without
    BF16 from 12 rows the weights are packed as the tiles go (packs_rows)."""
    module = ThreeLinears(torch.bfloat16, bias=True).eval()
    for rows in (1, 20):
        a = make_inputs(torch.bfloat16, seed=rows, batch=1, seq=rows)
        torch._dynamo.reset()
        with torch.no_grad(), torch._inductor.config.patch(freezing=freezing):
            out, (code,) = run_and_get_code(torch.compile(module), a["input"], a["cos"], a["sin"])
            expected = module(a["input"], a["cos"], a["sin"])
        assert ("mi::packed_task(" in code) == (freezing and can_pack(torch.bfloat16))
        assert ("mi::packed_task_from_rows(" in code) == (not freezing and packs_rows(torch.bfloat16))
        torch.testing.assert_close(out, expected, atol=3e-2, rtol=2e-2)


class NormedHeads(ThreeLinears):
    """Qwen3's attention input (Gemma-3's with `gemma`): each q and k head RMS-normalised by a weight of
    its own before RoPE."""

    def __init__(self, dtype, gemma=False):
        super().__init__(dtype, bias=False)
        self.q_norm, self.k_norm = (torch.nn.Parameter(torch.rand(D).to(dtype) + 0.5) for _ in range(2))
        self.head_norm_type = "gemma_rms_norm" if gemma else "rms_norm"

    def forward(self, x, cos, sin):
        return self.project(x, cos, sin, self.q_norm, self.k_norm)

    def project(self, x, cos, sin, q_norm, k_norm):
        return torch.ops.mla.gqa_qkv(x, self.q.weight, self.k.weight, self.v.weight, None, None, None, "BSD", False,
                                     None, "rms_norm", self.gamma, 1e-6, True, cos, sin, D, NQ, NKV, q_norm, k_norm,
                                     1e-5, self.head_norm_type)[0]

    def fp64(self, x, cos, sin):
        """Norm, GEMM, per-head norm and rotate_half in fp64, each step written out."""
        d = torch.float64
        h = x.to(d) / torch.sqrt((x.to(d) ** 2).mean(-1, keepdim=True) + 1e-6) * self.gamma.to(d)
        heads = (h @ torch.cat([self.q.weight, self.k.weight, self.v.weight]).to(d).T).unflatten(-1, (-1, D))
        for first, end, w in ((0, NQ, self.q_norm), (NQ, NQ + NKV, self.k_norm)):
            t = heads[:, :, first:end]
            scale = w.to(d) + (1 if self.head_norm_type == "gemma_rms_norm" else 0)
            heads[:, :, first:end] = t / torch.sqrt((t * t).mean(-1, keepdim=True) + 1e-5) * scale
        c, s = cos.to(d)[:, :, None], sin.to(d)[:, :, None]
        qk = heads[:, :, : NQ + NKV]
        heads[:, :, : NQ + NKV] = qk * c + torch.cat([-qk[..., D // 2:], qk[..., : D // 2]], -1) * s
        return heads.flatten(2)


@pytest.mark.parametrize("gemma", [False, True], ids=["qwen3", "gemma3"])
def test_template_normalises_each_q_and_k_head_as_the_model(gemma):
    for dtype, seq in ((torch.bfloat16, 1), (torch.float32, 3)):
        module = NormedHeads(dtype, gemma).eval()
        a = make_inputs(dtype, seed=seq, seq=seq)
        torch._dynamo.reset()
        with torch.no_grad():
            out, (code,) = run_and_get_code(torch.compile(module), a["input"], a["cos"], a["sin"])
            eager = module(a["input"], a["cos"], a["sin"])
            expected = module.fp64(a["input"], a["cos"], a["sin"])
        assert "mi::rms_norm_head<" in code, "the template did not normalise the heads"  # the call, not nt_dot.h
        ours, theirs = ((t.double() - expected).abs().max().item() for t in (out, eager))
        assert ours <= 2 * theirs + TOLERANCE[dtype] / 10, (ours, theirs)
        torch.testing.assert_close(out, eager, atol=TOLERANCE[dtype] * 2, rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("q_norm, k_norm, message", [
    (torch.ones(D), None, "mla::gqa_qkv: q_norm_weight and k_norm_weight come together"),
    (torch.ones(D), torch.ones(D + 1), r"k_norm_weight must be \[16\], got \[17\]"),
    (torch.ones(D, dtype=torch.bfloat16), torch.ones(D), "q_norm_weight has dtype torch.bfloat16, expected .*float32"),
    (torch.ones(D), torch.ones(D), "head_norm_type must be one of"),
])
def test_head_norms_reject_bad_weights_naming_them(q_norm, k_norm, message):
    module, a = NormedHeads(torch.float32), make_inputs(torch.float32)
    module.head_norm_type = "layer_norm" if "head_norm_type" in message else module.head_norm_type
    with pytest.raises(ValueError, match=message):
        module.project(a["input"], a["cos"], a["sin"], q_norm, k_norm)


def test_gqa_qkv_takes_the_norm_eps_as_a_tensor():
    """`norm_eps_tensor` (a model's eps under dynamic=True) computes what `norm_eps` does; anything but one
    number is refused by name."""
    a = make_inputs(torch.float32)
    q_w, k_w, v_w = a["fused_qkv_weights"].t().split([NQ * D, NKV * D, NKV * D])

    def call(eps, eps_tensor):
        return torch.ops.mla.gqa_qkv(a["input"], q_w, k_w, v_w, None, None, None, "NBSd", False, None, "rms_norm",
                                     a["gamma"], eps, True, a["cos"], a["sin"], D, NQ, NKV,
                                     norm_eps_tensor=eps_tensor)[0]

    torch.testing.assert_close(call(1.0, torch.tensor(1e-5)), call(1e-5, None), atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"mla::gqa_qkv: norm_eps_tensor must be a one-element tensor, got \[2\]"):
        call(1.0, torch.tensor([1e-5, 1e-5]))


class FusedWeight(torch.nn.Module):
    """Neuron's layout: one [H, I] weight; the template reads it as [I, H] rows (packed under freezing)."""

    def __init__(self, a):
        super().__init__()
        self.weight = torch.nn.Parameter(a["fused_qkv_weights"], requires_grad=False)

    def forward(self, x, cos, sin):
        return torch.ops.mla.qkv(x, self.weight, "BSD", fused_rope=True, cos_cache=cos, sin_cache=sin, d_head=D,
                                 num_q_heads=NQ, num_kv_heads=NKV)[0]


@pytest.mark.parametrize("freezing", [False, True])
def test_template_fused_weight(freezing):
    a = make_inputs(torch.bfloat16, batch=1, seq=2)
    module = FusedWeight(a).eval()
    torch._dynamo.reset()
    with torch.no_grad(), torch._inductor.config.patch(freezing=freezing):
        out, (code,) = run_and_get_code(torch.compile(module), a["input"], a["cos"], a["sin"])
    assert ("mi::packed_task(" in code) == (freezing and can_pack(torch.bfloat16))
    torch.testing.assert_close(out.double(), fp64_of(a, False, (), "none", True), atol=5e-2, rtol=2e-2)


def test_template_writes_an_fp8_block_cache_as_eager_does():
    a = make_inputs(torch.bfloat16)
    eager_cache, compiled_cache = _cache(torch.bfloat16, True, True), _cache(torch.bfloat16, True, True)
    expected, _ = call_qkv(a, rope=True, cache=eager_cache)
    torch._dynamo.reset()
    out, _ = torch.compile(functools.partial(call_qkv, rope=True))(a, cache=compiled_cache)
    torch.testing.assert_close(out, expected, atol=3e-2, rtol=2e-2)
    for ours, theirs in zip(compiled_cache[:2], eager_cache[:2]):  # within one e4m3 step
        torch.testing.assert_close(ours.float(), theirs.float(), atol=0.5, rtol=1 / 8)


# --- the pattern on transformers Llama and Qwen2 ----------------------------------------------------


# Llama without freezing: the first half of the recompile test below.
@pytest.mark.parametrize("arch, freezing", [("qwen2", False), ("llama", True), ("qwen3", False)])
def test_static_cache_decode_fires_per_layer_and_greedy_tokens_equal_eager(arch, freezing):
    counts, (expected_tokens, expected_logits), (tokens, logits) = static_cache_greedy_decode(arch, freezing)
    assert counts["gqa_qkv"] == 2
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)


def test_static_cache_decode_greedy_tokens_equal_eager_and_fire_after_a_recompile_with_dynamic_shapes():
    """Llama: fp32 greedy tokens equal eager's with both layers fused; then a second batch size
    recompiles with a dynamic batch (automatic dynamic), and it fuses there too."""
    model = tiny("llama", torch.float32)
    state = {}
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda ids, pos: model(input_ids=ids, past_key_values=state["cache"], position_ids=pos).logits,
        backend="mla_inductor",
    )
    for batch, steps in ((2, 16), (3, 3)):
        prompt = torch.randint(0, 256, (batch, 6), generator=torch.Generator().manual_seed(batch))
        expected_tokens, expected = greedy(model, transformers.StaticCache(config=model.config, max_cache_len=32),
                                           prompt, steps)
        state["cache"] = transformers.StaticCache(config=model.config, max_cache_len=32)
        tokens, logits = greedy(model, state["cache"], prompt, steps, compiled)
        if batch == 2:  # the static graph
            assert mla_inductor.fusion_counts()["gqa_qkv"] == 2
            assert torch.equal(tokens, expected_tokens)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert mla_inductor.fusion_counts()["gqa_qkv"] == 4  # two layers, in the static and the dynamic graph


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefill_fires_per_layer_and_matches_eager(arch):
    """Layer 0 from the embedding, layer 1 with the residual add of layer 0's MLP folded in."""
    model = tiny(arch, torch.bfloat16)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    fn = lambda ids: model(input_ids=ids, use_cache=False).logits  # noqa: E731
    with torch.no_grad():
        expected = fn(ids)
        mla_inductor.reset_counts()
        graph, actual = rewritten_and_run(fn, ids, stage="post_grad")
        assert graph.count("mla.qkv_projection") == 2 and "mla.apply_rope" not in graph, graph
    assert mla_inductor.fusion_counts()["gqa_qkv"] == 2
    torch.testing.assert_close(actual, expected, atol=5e-2, rtol=2e-2)


class FusedQKVInput(torch.nn.Module):
    """Llama's attention input over one fused q/k/v weight, the [B, S, H] layout of transformers: cut
    by slices (Phi-3's qkv_proj) or by one split in three (serving code's QKVParallelLinear). `v_dim`
    other than D makes the last cut no key-sized one (not q, k, v)."""

    def __init__(self, dtype, cut, v_dim=D):
        super().__init__()
        a = make_inputs(dtype, seed=5)
        self.cut, self.v_dim = cut, v_dim
        self.norm_weight = torch.nn.Parameter(a["gamma"])
        self.qkv_weight = torch.nn.Parameter(a["fused_qkv_weights"].t()[: (NQ + NKV) * D + NKV * v_dim].contiguous())
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D))

    def cos_sin(self, positions, dtype):
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, x, positions):
        xf = x.float()
        h = self.norm_weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
        qkv = torch.nn.functional.linear(h, self.qkv_weight)
        sizes = [NQ * D, NKV * D, NKV * self.v_dim]
        if self.cut == "slices":
            q, k, v = qkv[..., : sizes[0]], qkv[..., sizes[0] : sizes[0] + sizes[1]], qkv[..., sizes[0] + sizes[1] :]
        else:
            q, k, v = qkv.split(sizes, dim=-1)
        q, k = (t.view(*x.shape[:2], -1, D).transpose(1, 2) for t in (q, k))
        v = v.view(*x.shape[:2], -1, self.v_dim).transpose(1, 2)
        cos, sin = (t.unsqueeze(1) for t in self.cos_sin(positions, x.dtype))

        def rotate_half(t):
            return torch.cat((-t[..., D // 2 :], t[..., : D // 2]), dim=-1)

        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def fp64(self, x, positions):
        """q, k and v by reference_fp64, laid out as forward returns them."""
        cos, sin = self.cos_sin(positions, torch.float64)
        out = reference_fp64(x, self.qkv_weight.t(), norm=("rms_norm", self.norm_weight, None, 1e-5),
                             rope=(cos, sin, D, NQ + NKV))
        q, k, v = out.split([NQ * D, NKV * D, NKV * D], dim=-1)
        return tuple(t.view(*x.shape[:2], -1, D).transpose(1, 2) for t in (q, k, v))


def decode_inputs(dtype):
    x = make_inputs(dtype, seed=6, seq=1)["input"]
    return x, torch.tensor([[7], [11]])


@pytest.mark.parametrize("cut", ["slices", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_weight_forms_fire_and_match_fp64(cut, dtype):
    """gqa_qkv's fused forms (the weight's rows cut into q, k and v views for the op), on the rewritten
    graph run eagerly."""
    module = FusedQKVInput(dtype, cut)
    x, positions = decode_inputs(dtype)
    out, events = rewrite_and_run(module, x, positions)
    assert fired(events, "gqa_qkv") == 1, declined(events, "gqa_qkv")
    for actual, expected in zip(out, module.fp64(x, positions)):
        torch.testing.assert_close(actual.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_fused_weight_whose_values_are_no_key_sized_cut_is_left_alone():
    module = FusedQKVInput(torch.float32, "split", v_dim=8)
    x, positions = decode_inputs(torch.float32)
    out, events = rewrite_and_run(module, x, positions)
    assert fired(events, "gqa_qkv") == 0
    with torch.no_grad():
        for actual, expected in zip(out, module(x, positions)):
            torch.testing.assert_close(actual, expected)


def test_fused_weight_template_reads_the_rows_of_each_cut_in_place():
    """Compiled (not frozen): the template's three weights are row views of the one parameter, at
    offsets into its storage."""
    module = FusedQKVInput(torch.bfloat16, "slices")
    x, positions = decode_inputs(torch.bfloat16)
    torch._dynamo.reset()
    mla_inductor.reset_counts()
    with torch.no_grad():
        out = torch.compile(module, backend="mla_inductor")(x, positions)
    assert mla_inductor.fusion_counts()["gqa_qkv"] == 1
    for actual, expected in zip(out, module.fp64(x, positions)):
        torch.testing.assert_close(actual.double(), expected, atol=5e-2, rtol=2e-2)


def test_phi3_static_cache_decode_fires_per_layer():
    """transformers' Phi-3 (qkv_proj cut by slices, its partial-rotary code at full width, the no-op slice
    gone as Inductor's joint passes remove it): every layer's norm, fused projection and rotations in one
    op. (Its numbers: the fused forms above, against fp64.)"""
    config = transformers.Phi3Config(vocab_size=256, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(config).to(torch.bfloat16).eval()
    cache = transformers.StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(1)),
              past_key_values=cache)
    step = lambda i, p: model(input_ids=i, past_key_values=cache, position_ids=p).logits  # noqa: E731
    graph = rewritten(step, torch.tensor([[3], [5]]), torch.full((2, 1), 6), stage="post_grad")
    assert graph.count("mla.qkv_projection") == config.num_hidden_layers and "mla.apply_rope" not in graph, graph


class LlamaAttentionInput(torch.nn.Module):
    """A LlamaDecoderLayer's attention input from transformers' own modules (LlamaRMSNorm, the q/k/v
    Linears, LlamaRotaryEmbedding, apply_rotary_pos_emb) at the tiny models' shape."""

    def __init__(self):
        super().__init__()
        config = tiny("llama", torch.float32, layers=1).config
        self.norm = modeling_llama.LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary = modeling_llama.LlamaRotaryEmbedding(config)
        self.q_proj, self.k_proj, self.v_proj = (
            torch.nn.Linear(config.hidden_size, heads * config.head_dim, bias=False)
            for heads in (config.num_attention_heads, config.num_key_value_heads, config.num_key_value_heads))
        self.head_dim = config.head_dim

    def forward(self, x, position_ids):
        cos, sin = self.rotary(x, position_ids)
        h = self.norm(x)
        q, k, v = (p(h).view(*x.shape[:2], -1, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        return (*modeling_llama.apply_rotary_pos_emb(q, k, cos, sin), v)


def test_llama_under_dynamic_true_fires_with_its_floats_as_tensors():
    """`dynamic=True` makes the model's floats graph inputs (0-d tensors): LlamaRotaryEmbedding's
    `attention_scaling`, by which cos and sin are multiplied (one number: each angle is still on both
    members of a pair, so rope fires), and the RMSNorm's eps (the op's `norm_eps_tensor`). Graph level,
    one decode row of two requests, against eager. (Compiled, transformers' Llama and Phi-3 decode over a
    StaticCache fire both in every layer and give eager's greedy tokens: by hand, 2026-11-28.)"""
    torch.manual_seed(0)
    module = LlamaAttentionInput().to(torch.bfloat16)
    x, positions = torch.randn(2, 1, 96).to(torch.bfloat16), torch.tensor([[7], [11]])
    with torch.no_grad():
        expected = module(x, positions)
    out, events = rewrite_and_run(module, x, positions, dynamic=True)
    assert fired(events, "rope") == 2 and fired(events, "gqa_qkv") == 1, declined(events, "rope")
    for actual, reference in zip(out, expected):
        torch.testing.assert_close(actual, reference, atol=2e-2, rtol=2e-2)


class TestRewrite(expecttest.TestCase):
    def test_qwen2_layer(self):
        """Norm, the three projections with their biases and both rotations: one op; the q, k and v the
        model reads are transposed slices of its NBSd output."""
        model = tiny("qwen2", torch.bfloat16, layers=1)
        ids = torch.randint(0, 256, (1, 4), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            graph = rewritten(lambda ids: model(input_ids=ids, use_cache=False).logits, ids, stage="post_grad",
                              fusions={"linear": False})  # o_proj, the MLP and lm_head: test_linear.py
        mla_lines = [line for line in graph.splitlines() if "mla." in line or "qkv_projection" in line]
        self.assertExpectedInline("\n".join(mla_lines), """\
qkv_projection_default = mla.qkv_projection(mul_tensor_1, [arg4_1, arg6_1, arg8_1], cat_default, select_int, select_int_1, 24, 4, 2, NBSd)
slice_tensor_4 = slice.Tensor(qkv_projection_default, 0, 0, 4)
slice_tensor_5 = slice.Tensor(qkv_projection_default, 0, 4, 6)
slice_tensor_6 = slice.Tensor(qkv_projection_default, 0, 6, 9223372036854775807)""")


def test_prefill_rows_fire_only_where_the_template_wins():
    """65 rows: beyond the unfrozen row limit where oneDNN has a native bf16 GEMM; without one the
    template wins at every row count (segment_gemm.template_wins)."""
    model = tiny("llama", torch.bfloat16, layers=1)
    ids = torch.randint(0, 256, (1, 65), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        graph = rewritten(lambda ids: model(input_ids=ids, use_cache=False).logits, ids, stage="post_grad")
    if isa.native_bf16_gemm():
        assert "qkv_projection" not in graph and "mla.apply_rope" in graph  # the rotations fuse on their own
    else:
        assert "mla.qkv_projection" in graph


def test_not_when_switched_off():
    model = tiny("llama", torch.bfloat16, layers=1)
    ids = torch.randint(0, 256, (1, 4), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        graph = rewritten(lambda ids: model(input_ids=ids, use_cache=False).logits, ids, stage="post_grad",
                          fusions={"gqa_qkv": False})
    assert "qkv_projection" not in graph


def test_compiled_cache_write_rejects_a_slot_outside_the_cache():
    """Compiled, the write is Inductor's scatter with its bounds check: an error, never a write out of bounds."""
    a = make_inputs(torch.float32)
    cache = _cache(torch.float32, False, False)
    bad = (*cache[:5], torch.tensor([5, 6, 7, 20, 21, 32]))  # the cache has 2 x 16 rows
    torch._dynamo.reset()
    compiled = torch.compile(functools.partial(call_qkv, rope=True))
    compiled(a, cache=cache)
    with pytest.raises(RuntimeError, match="index out of bounds"):
        compiled(a, cache=bad)
