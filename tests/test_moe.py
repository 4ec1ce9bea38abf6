"""moe: the Mixture-of-Experts ops (fused_experts, shared_expert, the routers) against independent fp64
loops, the fused_experts template against the op's reference, and the rewrite of transformers' experts
in every MoE family it claims (patterns/moe.py)."""

import pytest
import torch
import transformers
from torch._inductor.utils import run_and_get_code

import mla_inductor
from mla_inductor.patterns import moe as moe_patterns
from graph_utils import compiled_greedy_decode, declined, fired, rewrite_and_run
from mla_inductor.ops.weight_quant import quantize_weight_fp8_blocks, quantize_weight_int8


def randn(*shape, dtype=torch.bfloat16, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def routing(tokens, experts, topk, seed=0):
    """Random distinct expert ids per token and positive weights."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]).to(torch.int32)
    return torch.rand(tokens, topk, generator=g) + 0.1, ids


def fp64_experts(x, w1, w2, weights, ids):
    """Token by token, slot by slot, in fp64: sum_j w_j * down(silu(gate) * up); ids outside the experts add 0."""
    x, w1, w2 = x.double(), w1.double(), w2.double()
    n = w1.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for m in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[m, j])
            if not 0 <= e < w1.shape[0]:
                continue
            gate, up = w1[e, :n] @ x[m], w1[e, n:] @ x[m]
            out[m] += float(weights[m, j]) * (w2[e] @ (gate * torch.sigmoid(gate) * up))
    return out


def assert_near_fp64(actual, expected, dtype):
    tol = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-4}[dtype]
    torch.testing.assert_close(actual.double(), expected, atol=tol * expected.abs().max().item(), rtol=tol)


# --- the ops ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_experts_reference_against_fp64(dtype):
    x, w1, w2 = randn(7, 40, dtype=dtype), randn(6, 2 * 24, 40, dtype=dtype, seed=1, scale=0.2), \
        randn(6, 40, 24, dtype=dtype, seed=2, scale=0.2)
    weights, ids = routing(7, 6, 3)
    out = torch.ops.mla.fused_experts(x, w1, w2, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    assert_near_fp64(out, fp64_experts(x, w1, w2, weights, ids), dtype)


def test_fused_experts_sentinel_ids_add_nothing():
    """An expert-parallel plan marks experts on other ranks with ids >= E (or -1): their slots add 0."""
    x, w1, w2 = randn(4, 32), randn(4, 32, 32, seed=1, scale=0.2), randn(4, 32, 16, seed=2, scale=0.2)
    weights, ids = routing(4, 4, 2)
    ids[0, 1], ids[2, 0], ids[3] = 4, -1, 7
    out = torch.ops.mla.fused_experts(x, w1, w2, weights, ids.long())
    assert_near_fp64(out, fp64_experts(x, w1, w2, weights, ids), torch.bfloat16)
    assert not out[3].any()


def test_fused_experts_int8_w8a8_and_fp8_blocks_against_fp64():
    """SGLang's int8 W8A8 (per-channel weight scales, per-token activations) and DeepSeek's fp8 128 x 128
    blocks: against fp64 over the dequantized weights, at their formats' tolerance."""
    x, w1, w2 = randn(5, 256), randn(4, 2 * 160, 256, seed=1, scale=0.05), randn(4, 256, 160, seed=2, scale=0.05)
    weights, ids = routing(5, 4, 2)
    q1, s1 = zip(*(quantize_weight_int8(w) for w in w1))
    q2, s2 = zip(*(quantize_weight_int8(w) for w in w2))
    out = torch.ops.mla.fused_experts(x, torch.stack(q1), torch.stack(q2), weights, ids, False, True, False,
                                      torch.stack(s1).squeeze(-1), torch.stack(s2))
    expected = fp64_experts(x, torch.stack(q1).double() * torch.stack(s1).double(),
                            torch.stack(q2).double() * torch.stack(s2).double(), weights, ids)
    torch.testing.assert_close(out.double(), expected, atol=0.05 * expected.abs().max().item(), rtol=0.05)

    f1, b1 = zip(*(quantize_weight_fp8_blocks(w) for w in w1))
    f2, b2 = zip(*(quantize_weight_fp8_blocks(w) for w in w2))
    out = torch.ops.mla.fused_experts(x, torch.stack(f1), torch.stack(f2), weights, ids, False, False, True,
                                      torch.stack(b1), torch.stack(b2), [128, 128])
    dequantized = [torch.stack([f.double() * b.double().repeat_interleave(128, 0)[:f.shape[0]]
                                .repeat_interleave(128, 1)[:, :f.shape[1]] for f, b in zip(fs, bs)])
                   for fs, bs in ((f1, b1), (f2, b2))]
    expected = fp64_experts(x, *dequantized, weights, ids)
    torch.testing.assert_close(out.double(), expected, atol=2e-2 * expected.abs().max().item(), rtol=2e-2)


def test_shared_expert_against_fp64():
    x, w1, w2 = randn(3, 48), randn(2 * 40, 48, seed=1, scale=0.2), randn(48, 40, seed=2, scale=0.2)
    routed = randn(3, 48, seed=3)
    out = torch.ops.mla.shared_expert(x, w1, w2, routed, 2.5)
    ones, zeros = torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.int32)
    expected = fp64_experts(x, w1[None], w2[None], ones, zeros) + 2.5 * routed.double()
    assert_near_fp64(out, expected, torch.bfloat16)


def test_routers_against_their_definitions():
    """topk_softmax, group-limited softmax (DeepSeek-V2) and DeepSeek-V3's noaux_tc, the last against
    transformers' own DeepseekV3TopkRouter."""
    g = randn(9, 16, dtype=torch.float32, seed=4)
    x = randn(9, 8)
    weights, ids = torch.ops.mla.topk_softmax(x, g, 4, False)
    probabilities = g.double().softmax(-1)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    torch.testing.assert_close(weights.double(), probabilities.gather(1, ids.long()))
    assert (probabilities.gather(1, ids.long()).min(1).values >= probabilities.topk(4).values[:, -1] - 1e-12).all()
    weights, _ = torch.ops.mla.topk_softmax(x, g, 4, True)
    torch.testing.assert_close(weights.sum(1), torch.ones(9))

    weights, ids = torch.ops.mla.grouped_topk(x, g, 3, False, 4, 2)
    groups = probabilities.view(9, 4, 4).amax(-1).topk(2).indices
    assert all(set((ids[m].long() // 4).tolist()) <= set(groups[m].tolist()) for m in range(9))

    config = transformers.DeepseekV3Config(hidden_size=8, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                           topk_group=2, norm_topk_prob=True, routed_scaling_factor=1.0)
    router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(config)
    torch.nn.init.normal_(router.weight)
    router.e_score_correction_bias.copy_(randn(16, dtype=torch.float32, seed=5) * 0.1)
    hidden = randn(9, 8, dtype=torch.float32, seed=6)
    logits, expected_weights, expected_ids = router(hidden)
    weights, ids = torch.ops.mla.biased_grouped_topk(hidden, logits, router.e_score_correction_bias, 4, True, 4, 2)
    order, expected_order = ids.long().sort(1), expected_ids.sort(1)
    assert torch.equal(order.values, expected_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), expected_weights.gather(1, expected_order.indices))


@pytest.mark.parametrize("args, message", [
    (dict(inplace=True), "inplace=True is not supported"),
    (dict(w1=randn(4, 31, 32)), r"w1 must be torch.bfloat16\[4, '2N', 32\]"),
    (dict(w2=randn(4, 32, 8)), r"w2 must be torch.bfloat16\[4, 32, 16\]"),
    (dict(topk_ids=torch.zeros(3, 2)), "topk_ids must be int32 or int64"),
    (dict(topk_weights=torch.ones(3, 3)), r"topk_weights must be floating \[3, 2\]"),
    (dict(use_int8_w8a8=True), r"w1 must be torch.int8"),
    (dict(is_vnni=True), "is_vnni=True"),
    (dict(alpha=1.702), "alpha and limit"),
    (dict(hidden_states=randn(3, 32).to("meta")), "hidden_states must be on the CPU"),
])
def test_fused_experts_bad_arguments_name_the_argument(args, message):
    base = dict(hidden_states=randn(3, 32), w1=randn(4, 32, 32), w2=randn(4, 32, 16),
                topk_weights=torch.ones(3, 2), topk_ids=torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=message):
        torch.ops.mla.fused_experts(**(base | args))


def test_routers_bad_arguments_name_the_argument():
    g, x = torch.randn(3, 8), torch.randn(3, 4)
    with pytest.raises(ValueError, match="topk must be in"):
        torch.ops.mla.topk_softmax(x, g, 9, True)
    with pytest.raises(ValueError, match="num_expert_group must divide"):
        torch.ops.mla.grouped_topk(x, g, 2, True, 3, 1)
    with pytest.raises(ValueError, match=r"correction_bias must be floating \[8\]"):
        torch.ops.mla.biased_grouped_topk(x, g, torch.zeros(7), 2, True, 4, 2)
    with pytest.raises(ValueError, match="num_fused_shared_experts must be 0"):
        torch.ops.mla.grouped_topk(x, g, 2, True, 4, 2, 1)


# --- the template -------------------------------------------------------------------------------------


class Experts(torch.nn.Module):
    def __init__(self, w1, w2):
        super().__init__()
        self.w1 = torch.nn.Parameter(w1, requires_grad=False)
        self.w2 = torch.nn.Parameter(w2, requires_grad=False)

    def forward(self, x, weights, ids):
        return torch.ops.mla.fused_experts(x, self.w1, self.w2, weights, ids)


@pytest.mark.parametrize("dtype, freezing", [(torch.bfloat16, False), (torch.bfloat16, True),
                                             (torch.float16, False), (torch.float32, False)])
def test_template_against_reference(dtype, freezing):
    """One compile with the tokens dynamic, run at 1, 3 and 70 tokens (more rows than an expert's tile),
    x a strided view, an N and a K that fill no column block, experts that get no token, sentinel ids
    and int64 ids: against the op's reference (frozen bf16 weights are packed at compile time)."""
    experts, k, n, topk = 5, 72, 40, 2
    module = Experts(randn(experts, 2 * n, k, dtype=dtype, seed=1, scale=0.2),
                     randn(experts, k, n, dtype=dtype, seed=2, scale=0.2)).eval()
    compiled = torch.compile(module, backend="mla_inductor", dynamic=True)
    for tokens in (3, 1, 70):
        x = randn(tokens, 2 * k, dtype=dtype, seed=tokens)[:, ::2]
        weights, ids = routing(tokens, 3, topk, seed=tokens)  # experts 3 and 4 get nothing
        ids = ids.long()
        ids[0, -1] = experts  # a sentinel
        with torch.no_grad(), torch._inductor.config.patch(freezing=freezing):
            out, code = run_and_get_code(compiled, x, weights, ids) if tokens == 3 else (compiled(x, weights, ids), None)
        if code is not None:  # the first call compiles
            assert "route_to_experts" in code[0]
            assert ("packed_block_bf16" in code[0]) == (freezing and dtype == torch.bfloat16)
        expected = module(x, weights, ids)
        tol = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-4}[dtype]
        torch.testing.assert_close(out, expected, atol=tol * expected.abs().max().item(), rtol=tol)


# --- the rewrite on transformers models -----------------------------------------------------------------

COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
MLA = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
FAMILIES = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, num_key_value_heads=2)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(intermediate_size=96, moe_intermediate_size=48, shared_expert_intermediate_size=96,
                       num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, num_key_value_heads=2)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(intermediate_size=96, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                       decoder_sparse_step=1, head_dim=16, num_key_value_heads=2)),
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM,
              dict(intermediate_size=48, num_experts=4, num_experts_per_tok=2, num_key_value_heads=2,
                   eos_token_id=1, pad_token_id=0)),
    "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM,
                    dict(intermediate_size=96, moe_intermediate_size=48, n_routed_experts=8, n_shared_experts=2,
                         num_experts_per_tok=3, first_k_dense_replace=1, q_lora_rank=None, **MLA)),
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
                    dict(intermediate_size=96, moe_intermediate_size=48, n_routed_experts=8, n_shared_experts=1,
                         num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=48,
                         **MLA)),
    "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM,
                 dict(intermediate_size=96, moe_intermediate_size=48, n_routed_experts=8, n_shared_experts=1,
                      num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, head_dim=16,
                      partial_rotary_factor=1.0, num_key_value_heads=4)),
}


def tiny_moe_model(family, dtype=torch.bfloat16, experts_implementation=None, **overrides):
    config_cls, model_cls, kwargs = FAMILIES[family]
    config = config_cls(**COMMON, **(kwargs | overrides))
    if experts_implementation is not None:
        config._experts_implementation = experts_implementation
    torch.manual_seed(0)
    return model_cls(config).to(dtype).eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_transformers_grouped_mm_experts_fuse(family):
    """transformers' default experts (grouped_mm) in every family that holds gate_up_proj / down_proj
    with SiLU: one fusion per MoE layer, the logits as eager's."""
    model = tiny_moe_model(family)
    moe_layers = sum(1 for m in model.modules() if hasattr(m, "gate_up_proj"))
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    out, events = rewrite_and_run(lambda ids: model(input_ids=ids).logits, ids)
    assert fired(events, "moe") == moe_layers > 0
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


def test_dynamic_tokens_and_fp32_weights_fuse():
    """Tokens symbolic (one graph for prefill and decode), and fp32 experts, which transformers runs
    through its own grouped_mm_fallback op under torch.compile."""
    model = tiny_moe_model("deepseek_v2")
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    _, events = rewrite_and_run(lambda ids: model(input_ids=ids).logits, ids, dynamic=True)
    assert fired(events, "moe") == 1
    model = tiny_moe_model("qwen3_moe", torch.float32)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    out, events = rewrite_and_run(lambda ids: model(input_ids=ids).logits, ids)
    assert fired(events, "moe") == 2
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_prefill_past_the_measured_limit_stays_with_stock(monkeypatch):
    """Where the GEMM is native, a static token count past the limit is declined with its reason, and a
    dynamic one (a server's one graph) is taken."""
    from mla_inductor import isa

    monkeypatch.setattr(isa, "native_gemm", lambda dtype: True)
    monkeypatch.setattr(isa, "host_isa", lambda: "avx512_bf16")
    monkeypatch.setattr(moe_patterns, "MAX_NATIVE_TOKENS_UNFROZEN", 9)
    model = tiny_moe_model("mixtral")
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    _, events = rewrite_and_run(lambda ids: model(input_ids=ids).logits, ids)
    assert fired(events, "moe") == 0 and any("10 tokens" in r for r in declined(events, "moe"))
    _, events = rewrite_and_run(lambda ids: model(input_ids=ids).logits, ids[:, :4])
    assert fired(events, "moe") == 2
    _, events = rewrite_and_run(lambda ids: model(input_ids=ids).logits, ids, dynamic=True)
    assert fired(events, "moe") == 2


@pytest.mark.parametrize("family, dynamic", [("deepseek_v2", False), ("mixtral", True)])
def test_transformers_batched_mm_experts_fuse(family, dynamic):
    """transformers' `batched_mm` experts (each pair's expert weights gathered, then bmm): the same op,
    which reads each selected expert once instead of top_k copies a token."""
    model = tiny_moe_model(family, experts_implementation="batched_mm")
    moe_layers = sum(1 for m in model.modules() if hasattr(m, "gate_up_proj"))
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    out, events = rewrite_and_run(lambda ids: model(input_ids=ids).logits, ids, dynamic=dynamic)
    assert fired(events, "moe") == moe_layers
    assert not moe_patterns._batched_products(rewrite_and_run.graph)  # no expert gathered whole any more
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


def test_not_taken():
    """Another activation than SiLU is declined with its reason, in both spellings; a fusion switched
    off by name fires nothing."""
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    for implementation in ("grouped_mm", "batched_mm"):
        model = tiny_moe_model("mixtral", hidden_act="gelu", experts_implementation=implementation)
        _, events = rewrite_and_run(lambda ids: model(input_ids=ids).logits, ids)
        assert fired(events, "moe") == 0 and any("not SiLU" in r for r in declined(events, "moe")), implementation
    model = tiny_moe_model("mixtral")
    torch._dynamo.reset()
    compiled = torch.compile(lambda ids: model(input_ids=ids).logits, backend="mla_inductor",
                             options={"mla_inductor.fusions": {"moe": False}})
    with torch.no_grad():
        compiled(ids)
    assert mla_inductor.fusion_counts()["moe"] == 0


@pytest.mark.parametrize("freezing", [False, True])
def test_deepseek_v2_static_cache_decode_compiled(freezing):
    """The compiled decode of a DeepSeek-V2 with its MoE (the first layer dense): the template is built and
    run, and the tokens equal eager's."""
    counts, (expected, _), (actual, _) = compiled_greedy_decode(tiny_moe_model("deepseek_v2"), freezing, 4)
    assert counts["moe"] == 1
    assert torch.equal(actual, expected)
