"""gqa_decode: grouped-query decode attention packed onto the key/value heads: the op, its
flash-decoding template, and the pattern on serving-style code and on transformers Llama / Qwen2."""

import functools

import expecttest
import pytest
import torch
import torch.nn.functional as F
import transformers

import mla_inductor
from graph_utils import greedy, rewritten, static_cache_greedy_decode, tiny_gqa_model
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


def masked_fp64(q, k, v, mask, scale):
    """An independent reference: fp64, the query heads of each key/value head against its rows; a
    query that no row admits gets zeros."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(n_rep, 1), v.double().repeat_interleave(n_rep, 1)
    scores = q.double() @ k.transpose(-1, -2) * scale
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
    (4, 2, 2, 17, 128, 128, [17, 16, 15, 1]),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mask_kind", [None, "bool", "additive"])
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


def test_where_it_must_not_fire():
    """Several query rows (prefill), a mask per head, a causal flag (top-left aligned: it would admit
    other rows once the heads are rows) and plain multi-head attention stay as written."""
    q, k, v, visible = make_inputs(torch.float32)
    prefill_q = make_inputs(torch.float32, query_rows=4)[0]
    per_head = visible.expand(BATCH, HEADS, 1, ROWS)

    def fn(q, prefill_q, k, v, per_head):
        return (
            F.scaled_dot_product_attention(prefill_q, repeat_kv(k, N_REP), repeat_kv(v, N_REP), scale=SCALE),
            F.scaled_dot_product_attention(q, repeat_kv(k, N_REP), repeat_kv(v, N_REP), attn_mask=per_head),
            F.scaled_dot_product_attention(q, repeat_kv(k, N_REP), repeat_kv(v, N_REP), is_causal=True),
            F.scaled_dot_product_attention(q, q, q),
        )

    result = mla_inductor.explain(fn, q, prefill_q, k, v, per_head, verbose=False)
    assert result.counts()["gqa_decode"] == 0
    reasons = "\n".join(e.reason for e in result.rejected if e.fusion == "gqa_decode")
    assert "4 query rows" in reasons
    assert "differs between heads" in reasons
    assert "6 query heads over 6 key and 6 value heads" in reasons


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
