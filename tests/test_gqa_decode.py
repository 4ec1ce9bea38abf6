"""gqa_decode: grouped-query decode attention packed onto the key/value heads: the op, its
flash-decoding template, and the pattern on serving-style code and on transformers Llama / Qwen2 (and
multi-head models, groups of one: Phi-3, GPT-NeoX)."""

import copy
import functools

import expecttest
import pytest
import torch
import torch.nn.functional as F
import transformers

import mla_inductor
from graph_utils import (declined, fired, greedy, rewrite_and_run, rewritten, static_cache_greedy_decode,
                         tiny_gqa_model)
from torch._inductor.utils import run_and_get_code
from mla_inductor.patterns.gqa_decode import repeat_kv

BATCH, KV_HEADS, N_REP, ROWS, HEAD_DIM = 3, 2, 3, 37, 16
HEADS = KV_HEADS * N_REP
SCALE = HEAD_DIM**-0.5
TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 1e-4}


def make_inputs(dtype, seed=0, query_rows=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, HEADS, query_rows, HEAD_DIM, generator=g).to(dtype)
    k, v = (torch.randn(BATCH, KV_HEADS, ROWS, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
    lengths = torch.tensor([ROWS, 1, 20])  # request b sees its first lengths[b] rows
    visible = (torch.arange(ROWS) < lengths[:, None])[:, None, None, :]  # [B, 1, 1, T]
    return q, k, v, visible


def reference_fp64(q, k, v, visible):
    """Query head h attends over key/value head h // N_REP, only where `visible`."""
    q, k, v = q.double(), k.double().repeat_interleave(N_REP, 1), v.double().repeat_interleave(N_REP, 1)
    scores = (q @ k.transpose(-1, -2) * SCALE).masked_fill(~visible, float("-inf"))
    return scores.softmax(-1) @ v


def every_form(q, k, v, visible):
    """The spellings of the pattern, as serving code and transformers write them."""
    additive = torch.zeros(visible.shape, dtype=q.dtype).masked_fill(~visible, float("-inf"))
    return (
        F.scaled_dot_product_attention(q, repeat_kv(k, N_REP), repeat_kv(v, N_REP), attn_mask=visible, scale=SCALE),
        F.scaled_dot_product_attention(q, repeat_kv(k, N_REP), repeat_kv(v, N_REP), attn_mask=additive, scale=SCALE),
        F.scaled_dot_product_attention(q, repeat_kv(k, N_REP), repeat_kv(v, N_REP), scale=SCALE),
        F.scaled_dot_product_attention(q, k, v, attn_mask=additive, scale=SCALE, enable_gqa=True),
        F.scaled_dot_product_attention(q, k, v, scale=SCALE, enable_gqa=True),
    )


def masked_fp64(q, k, v, mask, scale, softcap=0.0):
    """An independent reference: fp64, the query heads of each key/value head against its rows (scores
    capped as softcap * tanh(score / softcap) if softcap); a query that no row admits gets zeros."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(n_rep, 1), v.double().repeat_interleave(n_rep, 1)
    scores = q.double() @ k.transpose(-1, -2) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    admitted = scores.amax(-1, keepdim=True) > float("-inf")
    probs = torch.where(admitted, scores, 0).softmax(-1) * admitted
    return probs @ v


# --- the op and its template --------------------------------------------------------------------------


@functools.cache
def compiled_op(dtype, mask_kind):
    """One compile per dtype and mask kind, shared by the shape cases (dynamic batch and rows)."""
    torch._dynamo.reset()
    fn = lambda q, k, v, mask: torch.ops.mla.gqa_decode_attention(q, k, v, mask, 0.125)  # noqa: E731
    return torch.compile(fn, backend="mla_inductor", dynamic=True)


def op_inputs(dtype, batch, kv_heads, n_rep, rows, head_dim, v_head_dim, lengths, mask_kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, kv_heads * n_rep, 1, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, rows, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, rows, v_head_dim, generator=g).to(dtype)
    visible = (torch.arange(rows) < torch.tensor(lengths)[:, None])[:, None, None, :]
    mask = {
        None: None,
        "bool": visible,
        "additive": torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, float("-inf")),
    }[mask_kind]
    return q, k, v, mask


# (batch, kv_heads, n_rep, rows, head_dim, v_head_dim, lengths): rows around the 128-row blocks and the
# splits, a request with one row and one with none, head dims off the 32-column chunks.
OP_CASES = [
    (1, 8, 4, 300, 128, 128, [300]),
    (3, 2, 3, 129, 64, 32, [129, 1, 0]),
    (2, 1, 5, 1000, 24, 24, [1000, 257]),
    (4, 2, 1, 17, 128, 128, [17, 16, 15, 1]),  # multi-head attention: groups of one
]


# Each mask kind with one dtype or both: every pair would be six compiles of four shapes each (CI time).
@pytest.mark.parametrize(
    "dtype, mask_kind",
    [(torch.bfloat16, None), (torch.bfloat16, "additive"), (torch.float32, "bool"), (torch.float32, "additive")],
)
def test_template_matches_fp64_and_eager(dtype, mask_kind):
    fn = compiled_op(dtype, mask_kind)
    for batch, kv_heads, n_rep, rows, head_dim, v_head_dim, lengths in OP_CASES:
        if mask_kind is None:
            lengths = [rows] * batch
        q, k, v, mask = op_inputs(dtype, batch, kv_heads, n_rep, rows, head_dim, v_head_dim, lengths, mask_kind)
        ours, code = run_and_get_code(fn, q, k, v, mask) if (batch, rows) == (1, 300) else (fn(q, k, v, mask), None)
        if code is not None and head_dim == 128:
            assert "mi::attend_split" in code[0] and "torch.ops.mla" not in code[0], "the template did not serve"
        eager = torch.ops.mla.gqa_decode_attention(q, k, v, mask, 0.125)
        expected = masked_fp64(q, k, v, mask, 0.125)
        torch.testing.assert_close(ours.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
        assert (ours.double() - expected).abs().max() <= 2 * (eager.double() - expected).abs().max() + 1e-6


def test_template_never_reads_the_blocks_the_mask_excludes():
    """A StaticCache's unfilled tail: NaN in the 128-row blocks past the admitted rows changes nothing."""
    q, k, v, mask = op_inputs(torch.bfloat16, 2, 2, 4, 1000, 128, 128, [300, 129], "additive")
    expected = compiled_op(torch.bfloat16, "additive")(q, k, v, mask)
    k[0, :, 384:] = v[0, :, 384:] = float("nan")
    k[1, :, 256:] = v[1, :, 256:] = float("nan")
    torch.testing.assert_close(compiled_op(torch.bfloat16, "additive")(q, k, v, mask), expected, atol=0, rtol=0)


def test_bad_input_names_the_argument():
    q, k, v, mask = op_inputs(torch.float32, 2, 2, 2, 8, 16, 16, [8, 8], "bool")
    op = torch.ops.mla.gqa_decode_attention
    with pytest.raises(ValueError, match="query must be .batch, heads, 1, head_dim"):
        op(q.expand(2, 4, 3, 16), k, v, mask)
    with pytest.raises(ValueError, match="not a multiple of key's 3"):
        op(q, k[:, :1].expand(2, 3, 8, 16), v, mask)
    with pytest.raises(ValueError, match="value must be"):
        op(q, k, v[:, :, :5], mask)
    with pytest.raises(ValueError, match="key and value must be torch.float32"):
        op(q, k.bfloat16(), v, mask)
    with pytest.raises(ValueError, match="one mask for every head"):
        op(q, k, v, mask.expand(2, 4, 1, 8))
    with pytest.raises(ValueError, match="attn_mask must be bool or a float dtype"):
        op(q, k, v, mask.int())


# --- the pattern ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_form_fires_and_matches_fp64(dtype):
    q, k, v, visible = make_inputs(dtype)
    all_visible = torch.ones_like(visible)
    torch._dynamo.reset()
    with torch.no_grad():
        eager = every_form(q, k, v, visible)
        compiled = torch.compile(every_form, backend="mla_inductor")(q, k, v, visible)
    assert mla_inductor.fusion_counts()["gqa_decode"] == 5
    for i, (ours, theirs) in enumerate(zip(compiled, eager)):
        expected = reference_fp64(q, k, v, all_visible if i in (2, 4) else visible)
        torch.testing.assert_close(ours.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
        assert (ours.double() - expected).abs().max() <= 2 * (theirs.double() - expected).abs().max() + 1e-6


def multi_head_forms(q, k, v, visible):
    """Multi-head decode attention through SDPA (Llama-2, Phi-3-mini, GPT-NeoX): groups of one."""
    additive = torch.zeros(visible.shape, dtype=q.dtype).masked_fill(~visible, float("-inf"))
    return (
        F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=SCALE),
        F.scaled_dot_product_attention(q, k, v, attn_mask=additive),
        F.scaled_dot_product_attention(q, k, v),
    )


def test_multi_head_forms_fire_and_match_fp64():
    """The graphs rewritten and run on the op's reference (no C++: OP_CASES builds the template at groups
    of one for every mask kind)."""
    q, _, _, visible = make_inputs(torch.bfloat16)
    k, v = (torch.randn(BATCH, HEADS, ROWS, HEAD_DIM, generator=torch.Generator().manual_seed(3)).bfloat16()
            for _ in range(2))
    compiled, events = rewrite_and_run(multi_head_forms, q, k, v, visible)
    assert fired(events, "gqa_decode") == 3, declined(events, "gqa_decode")
    assert not any(n.target is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
                   for n in rewrite_and_run.graph.nodes)
    eager = multi_head_forms(q, k, v, visible)
    masks, scales = (visible, visible, None), (SCALE, HEAD_DIM**-0.5, HEAD_DIM**-0.5)
    for ours, theirs, mask, scale in zip(compiled, eager, masks, scales):
        expected = masked_fp64(q, k, v, mask, scale)
        torch.testing.assert_close(ours.double(), expected, atol=1e-2, rtol=1e-2)
        assert (ours.double() - expected).abs().max() <= 2 * (theirs.double() - expected).abs().max() + 1e-6


def test_where_it_must_not_fire():
    """Several query rows (prefill), a mask per head (grouped, or ALiBi's bias over multi-head attention)
    and a causal flag (top-left aligned: it would admit other rows once the heads are rows) stay as
    written."""
    q, k, v, visible = make_inputs(torch.float32)
    prefill_q = make_inputs(torch.float32, query_rows=4)[0]
    per_head = visible.expand(BATCH, HEADS, 1, ROWS)
    k_mha, v_mha = repeat_kv(k, N_REP).contiguous(), repeat_kv(v, N_REP).contiguous()
    alibi = -torch.arange(HEADS, dtype=torch.float32)[:, None, None] * torch.arange(ROWS).flip(0)  # [H, 1, T]

    def fn(q, prefill_q, k, v, per_head, k_mha, v_mha, alibi):
        return (
            F.scaled_dot_product_attention(prefill_q, repeat_kv(k, N_REP), repeat_kv(v, N_REP), scale=SCALE),
            F.scaled_dot_product_attention(q, repeat_kv(k, N_REP), repeat_kv(v, N_REP), attn_mask=per_head),
            F.scaled_dot_product_attention(q, repeat_kv(k, N_REP), repeat_kv(v, N_REP), is_causal=True),
            F.scaled_dot_product_attention(q, k_mha, v_mha, attn_mask=alibi[None]),
        )

    result = mla_inductor.explain(fn, q, prefill_q, k, v, per_head, k_mha, v_mha, alibi, verbose=False)
    assert result.counts()["gqa_decode"] == 0
    reasons = "\n".join(e.reason for e in result.rejected if e.fusion == "gqa_decode")
    assert "4 query rows" in reasons
    assert "mask [3, 6, 1, 37] differs between heads" in reasons
    assert "mask [1, 6, 1, 37] differs between heads" in reasons


def test_not_when_switched_off():
    q, k, v, visible = make_inputs(torch.float32)
    graph = rewritten(every_form, q, k, v, visible, stage="post_grad", fusions={"gqa_decode": False})
    assert graph.count("clone(expand") == 6  # repeat_kv's copies of k and v, for three forms


# --- transformers Llama and Qwen2 ---------------------------------------------------------------------


@pytest.mark.parametrize("arch, freezing", [("llama", False), ("qwen2", False), ("llama", True)])
def test_static_cache_decode_fires_per_layer_and_greedy_tokens_equal_eager(arch, freezing):
    """StaticCache: a mask, so transformers repeats k and v under Dynamo (the compiles test_gqa_qkv
    checks too: shared)."""
    counts, (expected_tokens, expected_logits), (tokens, logits) = static_cache_greedy_decode(arch, freezing)
    assert counts["gqa_decode"] == 2
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)


def test_qwen2_dynamic_cache_decode_fires_as_the_cache_grows():
    """DynamicCache at batch 1: no mask, so transformers asks SDPA for `enable_gqa`; from the second
    step on the row count is dynamic (automatic dynamic shapes)."""
    model = tiny_gqa_model("qwen2", torch.bfloat16)
    prompt = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    _, expected = greedy(model, transformers.DynamicCache(config=model.config), prompt, 4)
    cache = transformers.DynamicCache(config=model.config)
    compiled = torch.compile(lambda ids, pos: model(input_ids=ids, past_key_values=cache, position_ids=pos).logits,
                             backend="mla_inductor")
    _, logits = greedy(model, cache, prompt, 4, compiled)
    assert mla_inductor.fusion_counts()["gqa_decode"] == 4  # two layers, in the static and the dynamic graph
    torch.testing.assert_close(logits.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("arch, attention", [("phi3", "sdpa"), ("gpt_neox", "eager")])
def test_multi_head_static_cache_decode_fires_per_layer(arch, attention):
    """Multi-head models as transformers writes them (Phi-3-mini's fused qkv_proj, GPT-NeoX's partial
    rotary and fused [heads, 3, d] projection; SDPA, or the eager attention's math read by the anchored
    match): one query row over the StaticCache, groups of one."""
    config = transformers.AutoConfig.for_model(
        arch, vocab_size=256, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=128, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()
    cache = transformers.StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(1)),
              past_key_values=cache)
    ids, pos = torch.tensor([[3], [5]]), torch.full((2, 1), 6)
    with torch.no_grad():
        expected = model(input_ids=ids, past_key_values=copy.deepcopy(cache), position_ids=pos).logits
    step = lambda i, p: model(input_ids=i, past_key_values=cache, position_ids=p).logits  # noqa: E731
    out, events = rewrite_and_run(step, ids, pos)
    assert fired(events, "gqa_decode") == config.num_hidden_layers, declined(events, "gqa_decode")
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


class TestRewrite(expecttest.TestCase):
    def test_llama_decode_layer(self):
        """The query attends over the cache as written (index_put: StaticCache's update), with the
        model's [B, 1, 1, T] mask, in mla::gqa_decode_attention; no repeated copies."""
        model = tiny_gqa_model("llama", torch.bfloat16, layers=1)
        prompt = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(1))
        cache = transformers.StaticCache(config=model.config, max_cache_len=32)
        with torch.no_grad():
            model(input_ids=prompt, past_key_values=cache)
        step = lambda ids, pos: model(input_ids=ids, past_key_values=cache, position_ids=pos).logits  # noqa: E731
        graph = rewritten(step, torch.tensor([[3], [4]]), torch.full((2, 1), 6), stage="post_grad")
        assert "unsqueeze(index_put" not in graph  # repeat_kv of the updated cache
        lines = graph.splitlines()
        at = next(i for i, line in enumerate(lines) if "gqa_decode_attention" in line)
        self.assertExpectedInline("\n".join(lines[at - 1 : at + 2]), """\
where = where.self(expand, full_default_1, full_default)
gqa_decode_attention_default = mla.gqa_decode_attention(permute_default, index_put, index_put_1, where, 0.2041241452319315)
permute_6 = permute(gqa_decode_attention_default, [0, 2, 1, 3])""")


# --- the peers' contracts: fp8 caches (SGLang), softcap, sliding window (vLLM) --------------------------

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# SGLang's decode-attention cases (test/srt/cpu/test_decode.py): (batch, heads, kv_heads, head_dim, v_head_dim)
SGLANG_CASES = [
    (2, 16, 16, 64, 64), (2, 16, 1, 16, 16), (2, 32, 8, 33, 55), (2, 16, 1, 64, 64), (2, 64, 1, 13, 13),
    (2, 128, 1, 80, 80), (2, 128, 2, 512, 512), (1, 16, 1, 576, 512), (1, 16, 16, 576, 512), (1, 22, 1, 576, 512),
    (1, 40, 8, 128, 128),
]


def quantize_per_token(x, dtype):
    """x [B, T, heads, d] in fp8 with one fp32 scale per token (absmax over its heads and columns / the
    format's largest value), as SGLang's cache quantizes; e5m2 without a scale, as SGLang stores it."""
    if dtype == E5M2:
        return x.to(dtype), None
    scale = x.float().abs().amax((-2, -1), keepdim=True).clamp_min(1e-12) / torch.finfo(dtype).max
    return (x.float() / scale).to(dtype), scale


def sglang_case(batch, heads, kv_heads, head_dim, v_head_dim, dtype, cache_dtype, rows=1024, seed=0):
    """q [B, heads, 1, d], the cache as our op takes it (key/value [B, kv_heads, T, d] views of token-major
    buffers, as SGLang's [tokens, kv_heads, d] pool gathered per request; scales [B, 1, T, 1]), and the
    reference's cache: the fp8 values dequantized to the query's dtype, as SGLang's test does."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, 1, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, rows, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, rows, kv_heads, v_head_dim, generator=g).to(dtype)
    if cache_dtype == dtype:
        return q, k.transpose(1, 2), v.transpose(1, 2), None, None, k.transpose(1, 2), v.transpose(1, 2)
    (k8, k_scale), (v8, v_scale) = quantize_per_token(k, cache_dtype), quantize_per_token(v, cache_dtype)
    dequantized = [(x.float() * (1 if s is None else s)).to(dtype).transpose(1, 2) for x, s in ((k8, k_scale), (v8, v_scale))]
    scales = [None if s is None else s.transpose(1, 2) for s in (k_scale, v_scale)]
    return q, k8.transpose(1, 2), v8.transpose(1, 2), *scales, *dequantized


def assert_sglang_close(out, q, k_ref, v_ref):
    """SGLang's check: cosine similarity > 0.99 and atol 3e-2 against SDPA over the dequantized cache."""
    expected = F.scaled_dot_product_attention(q, k_ref, v_ref, scale=q.shape[-1] ** -0.5, enable_gqa=True)
    assert F.cosine_similarity(out.double().flatten(), expected.double().flatten(), dim=0) > 0.99
    torch.testing.assert_close(out, expected, atol=3e-2, rtol=1e-6)


@pytest.mark.parametrize("cache_dtype", ["same", E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sglang_decode_cases_on_bf16_and_fp8_caches(dtype, cache_dtype):
    for case in SGLANG_CASES:
        q, k, v, k_scale, v_scale, k_ref, v_ref = sglang_case(*case, dtype, dtype if cache_dtype == "same" else cache_dtype)
        out = torch.ops.mla.gqa_decode_attention(q, k, v, None, None, k_scale=k_scale, v_scale=v_scale)
        assert_sglang_close(out, q, k_ref, v_ref)


@pytest.mark.parametrize("case", [(2, 32, 8, 33, 55), (2, 32, 2, 64, 64)])
def test_template_reads_an_fp8_cache_at_an_sglang_case(case):
    """Per-token e4m3 scales: widths off the vector (the partial fp8 loads), and groups of 16 query
    heads (on an AMX CPU the tiles, each value row converted to bf16 and its scale on the probabilities).
    The widening of both formats is checked exactly below, and the template is mla_decode's (tested
    there too)."""
    q, k, v, k_scale, v_scale, k_ref, v_ref = sglang_case(*case, torch.bfloat16, E4M3)
    torch._dynamo.reset()
    fn = torch.compile(lambda *a: torch.ops.mla.gqa_decode_attention(*a[:3], k_scale=a[3], v_scale=a[4]),
                       backend="mla_inductor")
    out, (code,) = run_and_get_code(fn, q, k, v, k_scale, v_scale)
    assert "mi::attend_split" in code and "torch.ops.mla" not in code, "the template did not serve"
    assert "using cache_t = at::Float8_e4m3fn" in code
    assert_sglang_close(out, q, k_ref, v_ref)
    eager = torch.ops.mla.gqa_decode_attention(q, k, v, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(out, eager, atol=1e-2, rtol=1e-2)  # both dequantize in fp32: one rounding apart


def test_fp8_widening_is_exact_for_every_value():
    """All 256 values of each fp8 format (subnormals, infinities and NaN included) widened by the
    template: request b admits only row b, whose value row holds value b, so its output is that value."""
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v, mask: torch.ops.mla.gqa_decode_attention(q, k, v, mask),
                       backend="mla_inductor")
    one_row_each = torch.eye(256, dtype=torch.bool).view(256, 1, 1, 256)
    bits = torch.arange(256, dtype=torch.uint8)
    # e4m3fn's NaN bytes (0x7f, 0xff) zeroed: no tile holds a NaN, and the rows skip the widening's NaN fix
    e4m3fn_numbers = torch.where(bits & 0x7F == 0x7F, 0, bits)
    for dtype, values in ((E4M3, bits.view(E4M3)), (E5M2, bits.view(E5M2)), (E4M3, e4m3fn_numbers.view(E4M3))):
        value = values.view(1, 1, 256, 1).expand(256, 1, 256, 16)
        key = torch.zeros(256, 1, 256, 16, dtype=dtype)
        out = fn(torch.ones(256, 1, 1, 16), key, value, one_row_each)
        expected = values.float().view(256, 1, 1, 1).expand(256, 1, 1, 16)
        torch.testing.assert_close(out, expected, atol=0, rtol=0, equal_nan=True)


def test_fp8_rows_read_as_bf16_where_a_group_fits_one_tile():
    """Groups of up to 4 query heads over an fp8 cache with a bf16 query: on AVX512-BF16 CPUs with VBMI and
    without AMX (Zen 4, Zen 5) the dpbf16 tiles read the rows where they lie, converted in registers by
    table (elsewhere the FMA tiles widen them). One compile: e4m3 with per-token scales at head_dim 96
    (a whole 64-value step and a masked half one) over 301 rows (an odd last block, padded by the zero
    row), e5m2 at 128 in groups of one (multi-head), both against fp64 over the dequantized cache; and
    every value of both formats read exactly at head_dim 32 (the masked step alone): request b admits
    only row b, whose value row holds value b."""
    accuracy = [sglang_case(2, 8, 2, 96, 96, torch.bfloat16, E4M3, rows=301, seed=1),
                sglang_case(1, 4, 4, 128, 128, torch.bfloat16, E5M2, rows=257, seed=2)]
    one_row_each = torch.eye(256, dtype=torch.bool).view(256, 1, 1, 256)
    every_value = [torch.arange(256, dtype=torch.uint8).view(dtype) for dtype in (E4M3, E5M2)]
    cases = [(q, k, v, None, k_scale, v_scale) for q, k, v, k_scale, v_scale, *_ in accuracy]
    cases += [(torch.ones(256, 1, 1, 32, dtype=torch.bfloat16), torch.zeros(256, 1, 256, 32, dtype=values.dtype),
               values.view(1, 1, 256, 1).expand(256, 1, 256, 32), one_row_each, None, None) for values in every_value]
    torch._dynamo.reset()
    fn = torch.compile(lambda cases: [torch.ops.mla.gqa_decode_attention(q, k, v, mask, k_scale=ks, v_scale=vs)
                                      for q, k, v, mask, ks, vs in cases], backend="mla_inductor")
    outs, (code,) = run_and_get_code(fn, cases)
    assert code.count("mi::attend_split") >= 4 and "torch.ops.mla" not in code, "the template did not serve"
    for out, (q, *_, k_ref, v_ref) in zip(outs, accuracy):
        expected = F.scaled_dot_product_attention(q.double(), k_ref.double(), v_ref.double(), enable_gqa=True)
        torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)
        assert_sglang_close(out, q, k_ref, v_ref)
    for out, values in zip(outs[2:], every_value):
        exact = values.float().view(256, 1, 1, 1).expand(256, 1, 1, 32)
        torch.testing.assert_close(out.float(), exact, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("group", [4, 8])  # the rows widened in the score tile (4), or once into fp32 copies (8)
def test_an_e4m3fn_nan_reaches_the_heads_that_read_it(group):
    """Tiles of e4m3fn rows without NaN are widened without the NaN fix; a NaN in one key row still makes
    every output of its heads NaN (in the first block, where the running max starts at -inf, and in a
    later one), and a NaN in one value row the column it sits in, as in the reference."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2 * group, 1, 64, generator=g).bfloat16()
    k, v = (torch.randn(2, 2, 300, 64, generator=g).to(E4M3) for _ in range(2))  # blocks of 128, 128 and 44 rows
    k[0, 0, 5, 5] = k[1, 0, 200, 5] = float("nan")
    v[1, 1, 10, 7] = float("nan")
    torch._dynamo.reset()
    fn = torch.compile(torch.ops.mla.gqa_decode_attention, backend="mla_inductor")
    out = fn(q, k, v)
    nan = torch.zeros_like(out, dtype=torch.bool)
    nan[:, :group] = True
    nan[1, group:, :, 7] = True
    assert torch.equal(out.isnan(), nan)
    torch.testing.assert_close(out, torch.ops.mla.gqa_decode_attention(q, k, v), atol=1e-2, rtol=1e-2, equal_nan=True)


VLLM_BLOCK = 16


def vllm_window_case(heads, kv_heads, seq_lens, dtype, head_dim=32, seed=42):
    """vLLM's CPU paged-decode test (tests/kernels/attention/test_cpu_decode_attention.py) on a dense
    cache: values uniform in +-head_dim^-0.5, one request per sequence, a mask for each one's length."""
    g = torch.Generator().manual_seed(seed)
    bound = head_dim**-0.5
    rows = max(seq_lens)
    uniform = lambda *shape: (torch.rand(*shape, generator=g) * 2 - 1) * bound  # noqa: E731
    q = uniform(len(seq_lens), heads, 1, head_dim).to(dtype)
    k, v = (uniform(len(seq_lens), kv_heads, rows, head_dim).to(dtype) for _ in range(2))
    mask = (torch.arange(rows) < torch.tensor(seq_lens)[:, None])[:, None, None, :]
    return q, k, v, mask


def window_reference(q, k, v, seq_lens, window, window_block, softcap=0.0):
    """fp64: request b attends over rows [begin, len) with begin the window's first row rounded down to
    whole blocks (vLLM's block-granular window: only whole blocks before the window are dropped)."""
    rows = torch.arange(k.shape[2])
    bounds = [((n - window) // window_block * window_block if window and n > window else 0, n) for n in seq_lens]
    inside = torch.stack([(rows >= begin) & (rows < end) for begin, end in bounds])[:, None, None, :]
    return masked_fp64(q, k, v, inside, q.shape[-1] ** -0.5, softcap)


VLLM_TOLERANCE = {torch.float32: (1e-5, 1.3e-6), torch.bfloat16: (1e-3, 1.6e-2)}  # vLLM's default atol, rtol
VLLM_SEQ_LENS = [[42], [19, 21, 127, 129], [1234, VLLM_BLOCK - 1, VLLM_BLOCK + 1, VLLM_BLOCK]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads", [(8, 8), (64, 8)])
def test_vllm_sliding_window_cases(heads, kv_heads, dtype):
    atol, rtol = VLLM_TOLERANCE[dtype]
    for seq_lens in VLLM_SEQ_LENS:
        q, k, v, mask = vllm_window_case(heads, kv_heads, seq_lens, dtype)
        for window in (0, VLLM_BLOCK - 1, VLLM_BLOCK, VLLM_BLOCK + 1, 128):
            out = torch.ops.mla.gqa_decode_attention(q, k, v, mask, sliding_window=window, window_block=VLLM_BLOCK)
            expected = window_reference(q, k, v, seq_lens, window, VLLM_BLOCK)
            torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)


def test_template_skips_the_rows_before_the_window_and_caps():
    """Compiled: vLLM's window of 17 rows over blocks of 16 (rows before the window's first block hold
    NaN and are never read), with SGLang's logit cap on scores of a few units, where it bends them."""
    seq_lens = [1234, VLLM_BLOCK - 1, VLLM_BLOCK + 1, VLLM_BLOCK]
    q, k, v, mask = vllm_window_case(64, 8, seq_lens, torch.bfloat16)
    q = q * 200  # scores of a few units
    expected = window_reference(q, k, v, seq_lens, 17, VLLM_BLOCK, softcap=2.0)
    assert (window_reference(q, k, v, seq_lens, 17, VLLM_BLOCK) - expected).abs().max() > 1e-2  # the cap bends
    for b, length in enumerate(seq_lens):
        begin = (length - 17) // VLLM_BLOCK * VLLM_BLOCK if length > 17 else 0
        k[b, :, :begin] = v[b, :, :begin] = float("nan")
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v, mask: torch.ops.mla.gqa_decode_attention(
        q, k, v, mask, softcap=2.0, sliding_window=17, window_block=VLLM_BLOCK), backend="mla_inductor")
    out, (code,) = run_and_get_code(fn, q, k, v, mask)
    assert "mi::window_begin(ends[b], 17, 16)" in code and "constexpr float softcap = 2.0f" in code
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)


def test_softcap_with_an_exact_window():
    """SGLang's logit_cap (softcap * tanh(score / softcap)) and a window of exactly 100 rows, fp32, eager."""
    seq_lens = [300, 99, 100, 101]
    q, k, v, mask = vllm_window_case(8, 2, seq_lens, torch.float32, head_dim=64)
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(q.shape, generator=g), torch.randn(k.shape, generator=g)  # scores of a few units: the cap bends them
    expected = window_reference(q, k, v, seq_lens, 100, 1, softcap=2.0)
    assert (window_reference(q, k, v, seq_lens, 100, 1) - expected).abs().max() > 1e-2
    eager = torch.ops.mla.gqa_decode_attention(q, k, v, mask, softcap=2.0, sliding_window=100)
    torch.testing.assert_close(eager.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("change, message", [
    (dict(key=lambda k: k.to(E4M3)), "or both one fp8 dtype"),
    (dict(k_scale=torch.ones(1)), "k_scale dequantizes an fp8 key; key is torch.float32"),
    (dict(key=lambda k: k.to(E4M3), value=lambda v: v.to(E4M3), k_scale=torch.ones(2, 1, 8, 1, dtype=torch.float64)),
     "k_scale must be float32"),
    (dict(key=lambda k: k.to(E4M3), value=lambda v: v.to(E4M3), v_scale=torch.ones(2, 2, 8)),
     r"v_scale must broadcast against value's rows \[2, 2, 8, 1\]"),
    (dict(softcap=-1.0), "softcap must be >= 0"),
    (dict(sliding_window=-3), "sliding_window must be >= 0"),
    (dict(window_block=0), "window_block must be >= 1"),
])
def test_bad_fp8_window_and_softcap_arguments_name_the_argument(change, message):
    q, k, v, mask = op_inputs(torch.float32, 2, 2, 2, 8, 16, 16, [8, 8], "bool")
    change = dict(change)
    k = change.pop("key", lambda k: k)(k)
    v = change.pop("value", lambda v: v)(v)
    with pytest.raises(ValueError, match=message):
        torch.ops.mla.gqa_decode_attention(q, k, v, mask, **change)
