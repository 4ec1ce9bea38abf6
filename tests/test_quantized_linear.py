"""Quantized Linears (patterns/quantized_linear.py): torchao's int8 weight-only Linears in transformers
models fuse as their bf16 Linears do, and what does not fuse keeps its spelling, so Inductor's own
int8 path (`_weight_int8pack_mm`)."""

import re

import pytest
import torch
import transformers
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.utils import run_and_get_code
from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, PerGroup, quantize_

import mla_inductor
from mla_inductor import benchmarking, isa
from graph_utils import fired, greedy, rewrite_and_run, rewritten, tiny_gqa_model
from mla_inductor.models import get_config
from mla_inductor.models.hf import build_hf_model
from mla_inductor.ops.weight_quant import quantize_weight_fp8_blocks, quantize_weight_int8
from mla_inductor.lowerings import segment_gemm
from mla_inductor.patterns import quantized_linear
from mla_inductor.quantization import BlockFp8Linear, W8A8Linear
from quant_utils import dequantize_fp64, quantize_rows_int8_fp64, quantize_rows_int8_torchao_fp64

DEQUANTIZE = torch.ops.mla.dequantize_weight


def int8_weight_only(module, **config):
    # set_inductor_config=False: torchao would otherwise change Inductor's global config for every
    # later test of this worker
    quantize_(module, Int8WeightOnlyConfig(set_inductor_config=False, **config))
    return module


# --- the op ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["int8", "int8 bf16 scale", "fp8 blocks"])
def test_dequantize_weight_is_the_weight_times_its_scale_rounded_once(fmt):
    w = torch.randn(40, 72, generator=torch.Generator().manual_seed(0))
    block = [16, 32] if fmt == "fp8 blocks" else None
    q, scale = quantize_weight_fp8_blocks(w, block) if block else quantize_weight_int8(w)
    if fmt == "int8 bf16 scale":
        scale = scale.to(torch.bfloat16)  # as torchao's graphs cast it
    out = DEQUANTIZE(q, scale, block, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, dequantize_fp64(q, scale.double(), block).to(torch.bfloat16), atol=0, rtol=0)


def test_dequantize_weight_names_the_bad_argument():
    q, scale = quantize_weight_int8(torch.randn(8, 16))
    with pytest.raises(ValueError, match="scale must be"):
        DEQUANTIZE(q, scale[:4], None, torch.bfloat16)
    with pytest.raises(ValueError, match="scale dequantizes"):
        DEQUANTIZE(q.float(), scale, None, torch.float32)


# --- the canonical form on its own ------------------------------------------------------------------

def forward_graph(fn, *args) -> torch.fx.GraphModule:
    """fn's forward graph as Inductor's joint stage gets it (AOTAutograd, Inductor's decompositions)."""
    graphs = []

    def capture(gm, _):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=aot_autograd(fw_compiler=capture, decompositions=select_decomp_table()))(*args)
    return graphs[0]


def test_torchao_int8_linear_round_trips_through_the_canonical_form():
    linear = int8_weight_only(torch.nn.Linear(64, 48, bias=True).to(torch.bfloat16))
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    gm = forward_graph(linear, x)
    before = [(n.op, n.target) for n in gm.graph.nodes]

    assert quantized_linear.canonicalize(gm.graph) == 1
    (canonical,) = quantized_linear.quantized_linears(gm.graph)
    assert canonical.args[1].args[0].target is DEQUANTIZE.default
    quantized_linear.restore(gm.graph)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    # the same ops in the same order (a restored spelling sits where the canonical mm was)
    assert sorted(map(str, before)) == sorted(map(str, [(n.op, n.target) for n in gm.graph.nodes]))


@pytest.mark.parametrize("case", ["group-wise weights", "mul by activations", "bf16 weight"])
def test_not_canonicalized(case):
    """Only a per-channel scale of an int8 weight's columns: torchao's group-wise form dequantizes the
    whole weight first; a product with activations or a bf16 weight is no quantized Linear."""
    x = torch.randn(3, 64).to(torch.bfloat16)
    if case == "group-wise weights":
        fn = int8_weight_only(torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16), granularity=PerGroup(32))
        args = (x,)
    elif case == "mul by activations":
        w = torch.randint(-127, 128, (48, 64), dtype=torch.int8)
        fn, args = (lambda x, y: (x @ w.t().to(x.dtype)) * y), (x, torch.randn(3, 48).to(torch.bfloat16))
    else:
        w = torch.randn(48, 64).to(torch.bfloat16)
        fn, args = (lambda x, s: (x @ w.t()) * s.to(x.dtype)), (x, torch.rand(48))
    assert quantized_linear.canonicalize(forward_graph(fn, *args).graph) == 0


# --- transformers models -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def deepseek_int8():
    config = get_config("tiny", num_layers=2)
    model = int8_weight_only(build_hf_model(config, arch="v3", dtype=torch.bfloat16))
    prompt = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    return config, model, prompt


def test_deepseek_prefill_graph_fuses_the_int8_a_projections_and_restores_the_other_linears(deepseek_int8):
    """The graphs alone (no C++): per layer qkv_a_proj reads the int8 q_a / kv_a weights and their
    scales (k_pe's rotation inside); every other Linear is torchao's spelling again, for Inductor."""
    config, model, prompt = deepseek_int8
    fn = lambda ids: model(input_ids=ids, use_cache=False).logits  # noqa: E731
    with torch.no_grad():
        expected = fn(prompt)
    actual, events = rewrite_and_run(fn, prompt)
    assert fired(events, "qkv_a_proj") == config.num_layers and fired(events, "rope") == 2 * config.num_layers
    graph = rewrite_and_run.graph
    fused = [n for n in graph.nodes if n.target is torch.ops.mla.qkv_a_proj.default]
    assert len(fused) == config.num_layers
    for node in fused:
        assert node.args[1].meta["val"].dtype == node.args[2].meta["val"].dtype == torch.int8
        assert node.kwargs["q_weight_scale"] is not None and node.kwargs["kv_weight_scale"] is not None
    assert not any(n.target is DEQUANTIZE.default for n in graph.nodes)
    # q_b_proj, kv_b_proj, o_proj, the MLP's three and lm_head: torchao's int8 Linear, for Inductor
    restored = [n for n in graph.nodes if n.target is torch.ops.aten.mm.default
                and n.args[1].target is torch.ops.prims.convert_element_type.default]
    assert len(restored) == 6 * config.num_layers + 1
    torch.testing.assert_close(actual, expected, atol=5e-2, rtol=2e-2)


@pytest.mark.amx_row_limit
def test_on_an_amx_cpu_more_than_four_rows_go_to_onednn_unless_the_weights_are_int8_weight_only(
        deepseek_int8, monkeypatch):
    """Where oneDNN's GEMMs run on AMX tiles they win over the A-projection template above
    segment_gemm.MAX_ROWS_AMX rows (prefill's 24 here); Inductor's int8 weight-only mm has no AMX
    kernel, so int8 weights keep the template. Graphs only: the CPU is said to have AMX."""
    monkeypatch.setattr(isa, "host_isa", lambda: "amx")
    config, model, prompt = deepseek_int8
    bf16 = build_hf_model(config, arch="v3", dtype=torch.bfloat16)
    with torch.no_grad():
        for module, fires in ((model, config.num_layers), (bf16, 0)):
            _, events = rewrite_and_run(lambda ids: module(input_ids=ids, use_cache=False).logits, prompt)
            assert fired(events, "qkv_a_proj") == fires


@pytest.mark.amx_row_limit
@pytest.mark.parametrize("tokens, target, fires", [(8, "amx", True), (9, "amx", False), (8, "avx512_bf16", False)])
def test_on_an_amx_cpu_quantized_weights_on_our_amx_tiles_keep_the_template_up_to_16_rows(
        deepseek_w8a8, tokens, target, fires, monkeypatch):
    """W8A8 A-projections whose K fits quantized_gemm.h's AMX tiles (256 columns) keep the template up
    to segment_gemm.MAX_ROWS_AMX_TILES rows (two prompts of 8 tokens), where the C++ targets AMX; else
    oneDNN's AMX GEMMs take more than MAX_ROWS_AMX. Graphs only: the CPU is said to have AMX."""
    monkeypatch.setattr(isa, "host_isa", lambda: "amx")
    monkeypatch.setattr(isa, "target_isa", lambda: target)
    config, model, prompt = deepseek_w8a8
    assert prompt.shape[0] * tokens in (segment_gemm.MAX_ROWS_AMX_TILES, segment_gemm.MAX_ROWS_AMX_TILES + 2)
    with torch.no_grad():
        _, events = rewrite_and_run(lambda ids: model(input_ids=ids, use_cache=False).logits, prompt[:, :tokens])
    assert fired(events, "qkv_a_proj") == (config.num_layers if fires else 0)


MIN_ROWS = quantized_linear.DEQUANTIZED_GEMM_MIN_ROWS


@pytest.mark.parametrize("native_bf16, rows, gemm_dtype", [
    (True, MIN_ROWS[torch.bfloat16], torch.bfloat16),
    (True, MIN_ROWS[torch.bfloat16] - 1, None),
    (False, MIN_ROWS[torch.float32], torch.float32),
    (False, MIN_ROWS[torch.float32] - 1, None),
])
def test_restore_keeps_a_prefill_gemm_over_the_weight_dequantized_per_call(native_bf16, rows, gemm_dtype,
                                                                           monkeypatch):
    """Graphs only: torchao's int8 weight-only Linear comes back in its spelling (mm over the int8 weight
    converted, for `_weight_int8pack_mm`), except over enough rows: then an mm over the weight
    dequantized in aten (converted to bf16, times its scale in fp32), in bf16 where bf16 GEMMs are native
    and else in fp32, x widened and the product rounded once."""
    monkeypatch.setattr(isa, "native_bf16_gemm", lambda: native_bf16)
    linear = int8_weight_only(torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16))
    gm = forward_graph(linear, torch.randn(rows, 64).to(torch.bfloat16))
    assert quantized_linear.canonicalize(gm.graph) == 1
    quantized_linear.restore(gm.graph)
    gm.graph.eliminate_dead_code()
    (mm,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    weight = mm.args[1]
    if gemm_dtype is None:
        assert weight.target is torch.ops.prims.convert_element_type.default  # torchao's spelling
        return
    assert weight.target is torch.ops.aten.permute.default and mm.meta["val"].dtype == gemm_dtype
    dequantized = weight.args[0]
    product = dequantized.args[0] if gemm_dtype == torch.bfloat16 else dequantized
    assert product.target is torch.ops.aten.mul.Tensor and product.meta["val"].dtype == torch.float32
    widened = product.args[0]
    assert widened.args[1] == torch.bfloat16 and widened.args[0].meta["val"].dtype == torch.int8
    if gemm_dtype == torch.float32:
        (rounded,) = mm.users
        assert rounded.meta["val"].dtype == torch.bfloat16 and mm.args[0].meta["val"].dtype == torch.float32


@pytest.mark.parametrize("native_bf16", [True, False])
def test_deepseek_prefill_keeps_its_unfused_int8_linears_gemms_over_the_dequantized_weights(
        deepseek_int8, native_bf16, monkeypatch):
    """transformers DeepseekV3 with torchao's int8 weight-only Linears, a prefill of each route's
    DEQUANTIZED_GEMM_MIN_ROWS (as two sequences), graphs only: qkv_a_proj still takes the int8 q_a / kv_a
    weights; every other Linear (q_b_proj, kv_b_proj, o_proj, the MLP and lm_head) is a GEMM over its
    weight dequantized per call, none is torchao's spelling any more, and each weight is dequantized once."""
    monkeypatch.setattr(isa, "native_bf16_gemm", lambda: native_bf16)
    config, model, _ = deepseek_int8
    gemm_dtype = torch.bfloat16 if native_bf16 else torch.float32
    prompt = torch.randint(0, config.vocab_size, (2, MIN_ROWS[gemm_dtype] // 2),
                           generator=torch.Generator().manual_seed(1))
    fn = lambda ids: model(input_ids=ids, use_cache=False).logits  # noqa: E731
    with torch.no_grad():
        expected = fn(prompt)
    actual, events = rewrite_and_run(fn, prompt)
    assert fired(events, "qkv_a_proj") == config.num_layers
    graph = rewrite_and_run.graph
    mms = [n for n in graph.nodes if n.target is torch.ops.aten.mm.default]
    assert not any(mm.args[1].target is torch.ops.prims.convert_element_type.default for mm in mms)
    assert len(mms) == 6 * config.num_layers + 1 and all(mm.meta["val"].dtype == gemm_dtype for mm in mms)
    widened = [n for n in graph.nodes if n.target is torch.ops.prims.convert_element_type.default
               and n.args[0].meta["val"].dtype == torch.int8]
    assert len(widened) == len(mms)  # each weight dequantized once
    torch.testing.assert_close(actual, expected, atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("native_bf16", [True, False])
def test_prefill_int8_weight_only_linears_are_gemms_over_int8_constants(native_bf16, monkeypatch):
    """One torchao int8 weight-only Linear called on a prefill's rows (DEQUANTIZED_GEMM_MIN_ROWS) and on
    a decode's (4), compiled frozen, the CPU said to have native bf16 GEMMs or not (the shapes are small
    enough for any CPU's bf16 mm): the prefill call is an mm (bf16, or fp32) over the weight dequantized by
    a pointwise kernel, the decode call keeps Inductor's `_weight_int8pack_mm`, and the weight they share
    stays one int8 constant. The dequantized GEMM is as accurate as eager torchao against fp64."""
    monkeypatch.setattr(isa, "native_bf16_gemm", lambda: native_bf16)
    g = torch.Generator().manual_seed(0)
    linear = int8_weight_only(torch.nn.Linear(96, 80, bias=True).to(torch.bfloat16))
    prefill = torch.randn(max(MIN_ROWS.values()), 96, generator=g).to(torch.bfloat16)
    decode = torch.randn(4, 96, generator=g).to(torch.bfloat16)
    fn = lambda a, b: (linear(a), linear(b))  # noqa: E731
    torch._dynamo.reset()
    with torch.no_grad(), benchmarking.inference_freezing():
        expected = fn(prefill, decode)
        (actual_prefill, actual_decode), (code,) = run_and_get_code(torch.compile(fn, backend="mla_inductor"),
                                                                    prefill, decode)
    assert len(re.findall(r"extern_kernels\.(?:add)?mm\(", code)) == 1 and code.count("_weight_int8pack_mm(") == 1
    assert "torch.int8 (80, 96)" in code  # the frozen weight, and no dequantized copy of it
    assert "torch.bfloat16 (80, 96)" not in code and "torch.float32 (80, 96)" not in code
    weight = linear.weight.qdata.double() * linear.weight.scale.double().view(80, 1)
    exact = prefill.double() @ weight.t() + linear.bias.double()
    assert (actual_prefill.double() - exact).abs().max() <= 2 * (expected[0].double() - exact).abs().max()
    torch.testing.assert_close(actual_prefill, expected[0], atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(actual_decode, expected[1], atol=5e-2, rtol=2e-2)


def static_cache_decode(model, prompt, steps, freezing=False):
    """Greedy decoding with a StaticCache, eager and through the backend (fusion counts reset first):
    both (tokens, logits), and the generated code of the compiled step's first call, which compiles."""
    make_cache = lambda: transformers.StaticCache(config=model.config, max_cache_len=24)  # noqa: E731
    expected = greedy(model, make_cache(), prompt, steps)
    cache = make_cache()
    step = torch.compile(lambda ids, pos: model(input_ids=ids, past_key_values=cache, position_ids=pos).logits,
                         backend="mla_inductor")
    codes = []

    def compiled_step(ids, pos):
        out, code = run_and_get_code(step, ids, pos) if not codes else (step(ids, pos), [])
        codes.extend(code)
        return out

    torch._dynamo.reset()
    mla_inductor.reset_counts()
    with torch._inductor.config.patch(freezing=freezing):  # read while tracing: the first call
        compiled = greedy(model, cache, prompt, steps, compiled_step)
    return expected, compiled, "\n".join(codes)


def test_deepseek_decode_compiled_frozen_keeps_int8_weights_and_matches_eager(deepseek_int8):
    """Through the backend with freezing: the fused templates read the int8 constants, the Linears no
    fusion took are Inductor's `_weight_int8pack_mm`, and greedy decoding equals eager's."""
    config, model, prompt = deepseek_int8
    (expected_tokens, expected_logits), (tokens, logits), code = static_cache_decode(model, prompt, 3, freezing=True)
    counts = mla_inductor.fusion_counts()
    assert counts["qkv_a_proj"] == counts["q_b_absorb"] == counts["mla_decode"] == config.num_layers, counts
    assert "gemm.run(" in code and "using weight_t = int8_t;  // q_b_proj's" in code  # q_b_absorb on the int8 q_b_proj
    assert "_weight_int8pack_mm" in code
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logits, expected_logits, atol=5e-2, rtol=2e-2)


def test_llama_fires_gqa_qkv_over_int8_weights_weight_only_and_w8a8():
    """Compiled, one graph of two Llamas, torchao's int8 weight-only and dynamic int8 (W8A8): the three
    int8 projections as one segmented GEMM reading them as they are (with the norm and both rotations;
    for W8A8, x quantized in the template by torchao's scheme); o_proj and the MLP keep Inductor's
    `_weight_int8pack_mm` and `_int_mm`."""
    weight_only = int8_weight_only(tiny_gqa_model("llama", torch.bfloat16, layers=1))
    w8a8 = tiny_gqa_model("llama", torch.bfloat16, layers=1)
    quantize_(w8a8, Int8DynamicActivationInt8WeightConfig(set_inductor_config=False))
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(1))
    fn = lambda ids: [m(input_ids=ids, use_cache=False).logits for m in (weight_only, w8a8)]  # noqa: E731
    torch._dynamo.reset()
    mla_inductor.reset_counts()
    with torch.no_grad():
        expected = fn(ids)
        actual, (code,) = run_and_get_code(torch.compile(fn, backend="mla_inductor"), ids)
    assert mla_inductor.fusion_counts()["gqa_qkv"] == 2
    assert code.count("gemm.run(") == 2 and "const mi::WeightScales scales[S]" in code
    assert "mi::QuantizedGemm<mi::ActivationQuant::kTorchao," in code
    assert "_weight_int8pack_mm" in code and "_int_mm" in code
    torch.testing.assert_close(actual[0], expected[0], atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(actual[1], expected[1], atol=0.15, rtol=0.05)  # W8A8 (see the DeepSeek test)


def int8_prefill_rewritten(arch):
    """A one-layer tiny transformers `arch` under torchao's int8 weight-only, prefill of 5 tokens: the
    rewritten graph's logits (run eagerly), eager's, and the record (graph level, no C++)."""
    model = int8_weight_only(tiny_gqa_model(arch, torch.bfloat16, layers=1))
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(1))
    fn = lambda ids: model(input_ids=ids, use_cache=False).logits  # noqa: E731
    with torch.no_grad():
        expected = fn(ids)
    actual, events = rewrite_and_run(fn, ids)
    return actual, expected, events


def test_qwen3_fires_gqa_qkv_over_int8_weights_passed_by_position():
    """Qwen3's head norms make the traced qkv_projection call pass every argument up to k_norm_weight by
    position, weight_scales' slot included: the int8 weights' scales go there (a keyword as well was a
    call the op rejected, and the compile failed; Mixtral's eps of 1e-5 did the same)."""
    actual, expected, events = int8_prefill_rewritten("qwen3")
    assert fired(events, "gqa_qkv") == 1
    fused = [n for n in rewrite_and_run.graph.nodes if n.target is torch.ops.mla.qkv_projection.default]
    assert all(w.meta["val"].dtype == torch.int8 for n in fused for w in n.args[1])
    torch.testing.assert_close(actual, expected, atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("scheme", ["weight_only", "w8a8"])
def test_phi3_fused_int8_qkv_proj_reaches_the_template_as_int8_row_views(scheme):
    """Phi-3's one int8 qkv_proj under torchao: gqa_qkv cuts the dequantized weight into q, k and v rows,
    and the fold hands the template those rows of the int8 weight with the same rows of its scales (not
    a bf16 copy of the weight dequantized every call). The real pipeline's graph (Inductor's joint
    passes first), not run; compiled, its greedy tokens equal eager's (by hand, 2026-11-28)."""
    config = transformers.Phi3Config(vocab_size=256, hidden_size=96, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(config).to(torch.bfloat16).eval()
    if scheme == "weight_only":
        int8_weight_only(model)
    else:
        quantize_(model, Int8DynamicActivationInt8WeightConfig(set_inductor_config=False))
    ids = torch.randint(0, 256, (1, 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        graph = rewritten(lambda ids: model(input_ids=ids, use_cache=False).logits, ids)
    fused = [line for line in graph.splitlines() if "mla.qkv_projection" in line]
    assert len(fused) == 1, graph
    weights = re.search(r"qkv_projection\(\w+, \[(.*?)\]", fused[0]).group(1)
    scales, activation_quant = re.search(r"NBSd, \[(.*?)\], (\w+)", fused[0]).groups()
    assert activation_quant == ("none" if scheme == "weight_only" else "int8_torchao")
    for names in (weights, scales):
        for name in names.split(", "):
            assert re.search(rf"^{name} = slice.Tensor\((\w+), 0, \d+, \d+\)", graph, re.M), name


def test_qwen2_int8_weight_only_rotations_fire():
    """torchao's biased int8 Linears (Qwen2's q/k/v) trace each reader's `view(...).transpose(1, 2)` of
    the projection apart: the rotation reads x, and rotate_half(x), through equal chains of views, which
    the rope match takes as one x. (gqa_qkv does not take a biased int8 projection yet: the bias is
    added after the canonical Linear's unflattening, where the pattern has nn.Linear's addmm.)"""
    actual, expected, events = int8_prefill_rewritten("qwen2")
    assert fired(events, "rope") == 2
    torch.testing.assert_close(actual, expected, atol=5e-2, rtol=2e-2)


def test_gqa_qkv_declines_block_scaled_weights():
    """qkv_projection takes per-channel scales only; every fused op, weights quantized alike."""
    dequantize = torch.ops.mla.dequantize_weight.default
    graph = torch.fx.Graph()
    nodes = {}
    for name in ("q_weight", "k_weight"):
        w, scale = (graph.placeholder(f"{name}_{part}") for part in ("q", "scale"))
        w.meta["val"] = torch.empty(256, 256, dtype=torch.float8_e4m3fn)
        nodes[name] = graph.call_function(dequantize, (w, scale, [128, 128], torch.bfloat16))
    reason = quantized_linear.decline_reason(nodes, per_channel_only=True)
    assert reason is not None and "per-channel" in reason
    assert quantized_linear.decline_reason(nodes) is None  # quantized alike: qkv_a_proj takes them
    nodes["q_weight"].meta["mla_activation_quant"] = "int8"
    assert "quantized differently" in quantized_linear.decline_reason(nodes)  # one W8A8, one weight-only
    assert "not" in quantized_linear.decline_reason({**nodes, "v_weight": graph.placeholder("v_weight")})


@pytest.mark.parametrize("activation_quant", ["none", "int8", "int8_torchao"])
def test_qkv_projection_reference_with_int8_weights_against_fp64(activation_quant):
    """gqa_qkv's GEMM op over per-channel int8 weights: the fp64 product of the dequantized weights
    (and for W8A8 of x quantized per token by the scheme), plus bias, rounded once."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 3, 64, generator=g).to(torch.bfloat16)
    weights, scales = zip(*(quantize_weight_int8(torch.randn(n, 64, generator=g)) for n in (32, 16, 16)))
    bias = torch.randn(64, generator=g).to(torch.bfloat16)
    out = torch.ops.mla.qkv_projection(x, list(weights), bias, None, None, 0, 0, 0, "BSD", weight_scales=list(scales),
                                       activation_quant=activation_quant)
    w = torch.cat([dequantize_fp64(q, s) for q, s in zip(weights, scales)])
    xq = {"none": lambda x: x.double(), "int8": quantize_rows_int8_fp64,
          "int8_torchao": quantize_rows_int8_torchao_fp64}[activation_quant](x)
    expected = (xq @ w.T + bias.double()).to(torch.bfloat16)
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="weight_scales has 2 scales for 3 weights"):
        torch.ops.mla.qkv_projection(x, list(weights), bias, None, None, 0, 0, 0, "BSD", weight_scales=list(scales[:2]))


# --- weight dequantizations, recognized by what they compute ------------------------------------------

class DequantizingLinear(torch.nn.Module):
    """A Linear whose forward dequantizes its one-byte weight by `dequantize(weight, scale)`."""

    def __init__(self, weight, scale, dequantize):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.scale = torch.nn.Parameter(scale, requires_grad=False)
        self.dequantize = dequantize

    def forward(self, x):
        return torch.nn.functional.linear(x, self.dequantize(self.weight, self.scale).to(x.dtype))


def _by_expand(w, s):  # blocks that divide the weight: the scale broadcast over a blocked view
    n, k = w.shape
    return (w.float().view(s.shape[0], n // s.shape[0], s.shape[1], k // s.shape[1]) * s[:, None, :, None]).view(n, k)


def _by_index(w, s):  # the scale gathered by block index (a partial last block)
    rows, cols = torch.arange(w.shape[0]) // 16, torch.arange(w.shape[1]) // 32
    return w.float() * s[rows][:, cols]


def _with_bf16_scale(weight, scale):
    return weight, scale.to(torch.bfloat16)


def _fp8(rows, cols):
    return quantize_weight_fp8_blocks(torch.randn(rows, cols), [16, 32])


SPELLINGS = {  # name: (the Linear, the block size found)
    "BlockFp8Linear (repeat_interleave, partial blocks)": (lambda: BlockFp8Linear(*_fp8(40, 72), [16, 32]), [16, 32]),
    "blocked view and broadcast": (lambda: DequantizingLinear(*_fp8(48, 64), _by_expand), [16, 32]),
    "gather by block index": (lambda: DequantizingLinear(*_fp8(40, 72), _by_index), [16, 32]),
    "per channel, int8, transposed first": (  # torchao's fp8 weight-only spelling
        lambda: DequantizingLinear(*quantize_weight_int8(torch.randn(40, 72)), lambda w, s: (w.t().float() * s.t()).t()),
        None),
    "per channel, int8, bf16 scale and multiply": (  # one rounding of an exact product: the same values
        lambda: DequantizingLinear(*_with_bf16_scale(*quantize_weight_int8(torch.randn(40, 72))),
                                   lambda w, s: w.to(torch.bfloat16) * s),
        None),
}


def canonicalized_and_restored(fn, *args):
    """(the block size and activation quantization of each dequantization canonicalize found, fn's
    output through the graph `restore` gave back)."""
    blocks = []

    def compiler(gm, _):
        quantized_linear.canonicalize(gm.graph)
        blocks.extend((n.args[2], quantized_linear._activation_quant(n))
                      for n in gm.graph.nodes if n.target is DEQUANTIZE.default)
        quantized_linear.restore(gm.graph)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        return gm

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(fn, backend=aot_autograd(fw_compiler=compiler, decompositions=select_decomp_table()))(*args)
    return blocks, out


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_weight_dequantization_spellings_become_the_canonical_form_and_back(spelling):
    """However the scales are expanded, a chain that reads only a one-byte weight and its scale and
    computes dequantize_weight's values becomes that op; restored, the graph computes what it did."""
    make_linear, block = SPELLINGS[spelling]
    linear = make_linear()
    x = torch.randn(3, linear.weight.shape[1]).to(torch.bfloat16)
    blocks, out = canonicalized_and_restored(linear, x)
    assert blocks == [(block, "none")]
    with torch.no_grad():
        torch.testing.assert_close(out, linear(x), atol=0, rtol=0)


@pytest.mark.parametrize("case", ["scale rounded to bf16 first", "blocks in another order", "activation in the scale"])
def test_weight_dequantization_not_canonicalized(case):
    """A chain whose values differ from dequantize_weight's for every block size (another rounding,
    another assignment of scales to blocks) or that reads more than the weight and its scale stays."""
    weight, scale = _fp8(48, 64)
    x = torch.randn(3, 64).to(torch.bfloat16)
    expand = lambda s: s.repeat_interleave(16, 0).repeat_interleave(32, 1)  # noqa: E731
    dequantize = {
        "scale rounded to bf16 first": lambda w, s: w.to(torch.bfloat16) * expand(s.to(torch.bfloat16)),
        "blocks in another order": lambda w, s: w.float() * expand(s.flip(0)),
        "activation in the scale": lambda w, s: w.float() * expand(s * x.float().abs().amax()),
    }[case]
    assert canonicalized_and_restored(DequantizingLinear(weight, scale, dequantize), x)[0] == []


@pytest.mark.parametrize("rows", [1, 20])
def test_sglang_w8a8_linear_becomes_the_canonical_form_and_back(rows):
    """Serving code's W8A8 Linear (per-token quantize, `_int_mm`, both scales) becomes the canonical
    Linear marked W8A8, so that the fused ops quantize x as it did; restored, it computes what it did."""
    linear = W8A8Linear.from_linear(torch.nn.Linear(64, 48, bias=False))
    x = torch.randn(rows, 64).to(torch.bfloat16)
    found, out = canonicalized_and_restored(linear, x)
    assert found == [(None, "int8")]
    with torch.no_grad():
        torch.testing.assert_close(out, linear(x), atol=0, rtol=0)


@pytest.mark.parametrize("vnni", [False, True], ids=["s8s8", "u8s8 (CPUs with VNNI)"])
def test_torchao_dynamic_int8_linear_becomes_the_canonical_form_and_back(vnni, monkeypatch):
    """torchao's Int8DynamicActivationInt8WeightConfig Linear, in both of its CPU spellings (the u8s8 one
    adds 128 to x's levels and subtracts the weight's column sums), on 3-D activations: the canonical
    Linear marked with torchao's scheme; restored, it computes what it did."""
    import torchao.kernel.intmm

    monkeypatch.setattr(torchao.kernel.intmm, "_cpu_is_vnni_supported", lambda: vnni)
    linear = torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16)
    quantize_(linear, Int8DynamicActivationInt8WeightConfig(set_inductor_config=False))
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    found, out = canonicalized_and_restored(linear, x)
    assert found == [(None, "int8_torchao")]
    with torch.no_grad():
        torch.testing.assert_close(out, linear(x), atol=0, rtol=0)


def test_w8a8_linear_after_a_gated_product_reads_that_product():
    """Phi-3's MLP under torchao's W8A8: down_proj quantizes `up * silu(gate)`, a mul over rows of the
    same width as the quantizer's own muls, of two halves of gate_up_proj's output. x is that product
    (walking on to `up` left gate's half outside the chain: a KeyError that stopped the compile)."""
    config = transformers.Phi3Config(hidden_size=64, intermediate_size=48)
    mlp = transformers.models.phi3.modeling_phi3.Phi3MLP(config).to(torch.bfloat16)
    quantize_(mlp, Int8DynamicActivationInt8WeightConfig(set_inductor_config=False))
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    found, out = canonicalized_and_restored(mlp, x)
    assert found == [(None, "int8_torchao")] * 2
    with torch.no_grad():
        torch.testing.assert_close(out, mlp(x), atol=0, rtol=0)


def test_an_activation_scheme_of_neither_anchor_is_not_w8a8():
    """Activations quantized by another rule (here absmax / 126) are another op: not canonicalized."""
    weight, scale = quantize_weight_int8(torch.randn(48, 64))
    x = torch.randn(4, 64).to(torch.bfloat16)

    def other_scheme(x):
        absmax = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-7)
        q = torch.round(x.float() * (126 / absmax)).clamp(-127, 127).to(torch.int8)
        return (torch._int_mm(q, weight.t()).float() * (absmax / 126) * scale.view(1, -1)).to(x.dtype)

    assert canonicalized_and_restored(other_scheme, x)[0] == []


def test_deepseek_prefill_with_torchao_dynamic_int8_fuses_the_a_projections(deepseek_w8a8):
    """transformers DeepseekV3 under Int8DynamicActivationInt8WeightConfig (graph level): qkv_a_proj
    reads the int8 q_a / kv_a weights and quantizes x as torchao does. Within W8A8's own noise of
    eager: q_a rounded once where torchao rounds it twice moves some of q_b's input levels by one."""
    config, model, prompt = deepseek_w8a8
    fn = lambda ids: model(input_ids=ids, use_cache=False).logits  # noqa: E731
    with torch.no_grad():
        expected = fn(prompt)
    actual, events = rewrite_and_run(fn, prompt)
    assert fired(events, "qkv_a_proj") == config.num_layers and fired(events, "rope") == 2 * config.num_layers
    fused = [n for n in rewrite_and_run.graph.nodes if n.target is torch.ops.mla.qkv_a_proj.default]
    assert [(n.args[1].meta["val"].dtype, n.kwargs["activation_quant"]) for n in fused] == [(torch.int8, "int8_torchao")]
    assert (actual.float() - expected.float()).abs().mean() < 0.03 * expected.float().abs().mean()
    torch.testing.assert_close(actual, expected, atol=0.15, rtol=0.05)


def test_deepseek_decode_with_torchao_dynamic_int8_compiled_fires_every_fusion_of_bf16(deepseek_w8a8):
    """The StaticCache decode step through the backend (not frozen: W8A8's int8 weights are inputs of
    the templates either way): every fusion of the bf16 step fires. qkv_a_proj and q_b_absorb quantize
    their x in the template by torchao's scheme. kv_b_proj's W_kc and W_vc are its dequantized weight,
    as SGLang absorbs a W8A8 kv_b_proj, so the attention no longer quantizes the cache rows per token:
    greedy tokens equal, logits within W8A8's noise."""
    config, model, prompt = deepseek_w8a8
    (expected_tokens, expected_logits), (tokens, logits), code = static_cache_decode(model, prompt, 2)
    counts = mla_inductor.fusion_counts()
    for fusion in ("qkv_a_proj", "q_b_absorb", "mla_decode", "qkv_proj_with_rope"):
        assert counts[fusion] == config.num_layers, counts
    assert counts["rope"] == 2 * config.num_layers, counts
    assert code.count("mi::QuantizedGemm<mi::ActivationQuant::kTorchao,") == 2, "qkv_a_proj's x and q_b_absorb's q_a"
    assert "using weight_t = int8_t;  // q_b_proj's" in code
    assert torch.equal(tokens, expected_tokens)
    assert (logits.float() - expected_logits.float()).abs().mean() < 0.03 * expected_logits.float().abs().mean()
    torch.testing.assert_close(logits, expected_logits, atol=0.15, rtol=0.05)


def test_a_one_token_w8a8_linear_compiles_right():
    """torchao's W8A8 Linear over one token, x of [1, 1, K]: stock Inductor hands `_int_mm` a [1, K]
    view with row stride 0, which ATen's CPU `_int_mm` takes as its leading dimension (products that
    change between calls); the backend gives that operand a copy (int_mm_rows_with_a_row_stride)."""
    linear = torch.nn.Sequential(torch.nn.Linear(512, 256, bias=False)).to(torch.bfloat16)
    quantize_(linear, Int8DynamicActivationInt8WeightConfig(set_inductor_config=False))
    x = torch.randn(1, 1, 512, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    torch._dynamo.reset()
    with torch.no_grad():
        expected = linear(x)
        compiled = torch.compile(linear, backend="mla_inductor")
        first, second = compiled(x), compiled(x)
    assert torch.equal(first, second)
    torch.testing.assert_close(first, expected, atol=2e-2, rtol=2e-2)


@pytest.fixture(scope="module")
def deepseek_w8a8():
    config = get_config("tiny", num_layers=1)
    model = build_hf_model(config, arch="v3", dtype=torch.bfloat16)
    quantize_(model, Int8DynamicActivationInt8WeightConfig(set_inductor_config=False))
    prompt = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    return config, model, prompt
