"""gqa_decode's anchored match on grouped-query attention written out (no SDPA): the corpus in
grouped_decode.py, transformers models run with their eager attention, and where it must not fire. The
graphs are rewritten and run on the op's reference (graph_utils.rewrite_and_run); one compile of
Gemma-2, whose only attention is the eager one, runs the C++ template end to end."""

import copy
import math

import pytest
import torch
import transformers
from torch._inductor.utils import run_and_get_code

import mla_inductor
from graph_utils import declined, fired, greedy, has_dynamic_sizes, rewrite_and_run
from spellings import grouped_decode as gd

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(gd.SPELLINGS))
def test_spelling_fires_and_is_no_less_accurate_than_eager(name, dtype):
    inputs = gd.inputs_for(name, dtype)
    args = gd.spelling_args(name, inputs)
    out, events = rewrite_and_run(gd.SPELLINGS[name], *args)
    assert fired(events, "gqa_decode") == 1, declined(events, "gqa_decode")
    assert not declined(events, "mla_decode")  # grouped-query scores are not latent attention's candidates
    expected = gd.reference_fp64(inputs, name)
    error = (out.double() - expected).abs().max().item()
    eager_error = (gd.SPELLINGS[name](*args).double() - expected).abs().max().item()
    assert out.dtype == dtype and out.shape == expected.shape
    assert error <= max(TOLERANCE[dtype], 1.5 * eager_error), (error, eager_error)


# One spelling per way of reading the caches (gemma2_softcap and repeat_interleave_einsum read them as
# transformers_eager does)
@pytest.mark.parametrize("name", ["transformers_eager", "packed_heads_token_major", "paged_gather", "tiled_heads",
                                  "multi_query", "multi_head_token_major"])
def test_spelling_fires_with_dynamic_batch_and_rows(name):
    """As a server compiles it (or a DynamicCache's growing length): symbolic batch and rows."""
    args = gd.mark_dynamic(gd.spelling_args(name, gd.inputs_for(name)))
    out, events = rewrite_and_run(gd.SPELLINGS[name], *args)
    assert has_dynamic_sizes(rewrite_and_run.graph)
    assert fired(events, "gqa_decode") == 1, declined(events, "gqa_decode")
    torch.testing.assert_close(out, gd.SPELLINGS[name](*args), atol=1e-5, rtol=1e-5)


def _scale_argument(query, key, value, mask, scale):
    k, v = gd.repeat_kv(key, gd.GROUP), gd.repeat_kv(value, gd.GROUP)
    return torch.softmax(query @ k.transpose(-1, -2) * scale + mask, -1) @ v


def test_a_float_scale_that_dynamo_passes_as_a_tensor_is_folded_into_the_query():
    """Under dynamic=True a float argument (a module's softmax scale) reaches the graph as a 0-d tensor."""
    x = gd.make_inputs(torch.float32)
    args = (x.query, x.key, x.value, x.additive_mask(), 0.3)
    out, events = rewrite_and_run(_scale_argument, *args, dynamic=True)
    assert fired(events, "gqa_decode") == 1, declined(events, "gqa_decode")
    assert any(n.target is torch.ops.aten.mul.Tensor and isinstance(n.args[1], torch.fx.Node)
               and n.args[1].meta["val"].dim() == 0 for n in rewrite_and_run.graph.nodes)
    torch.testing.assert_close(out, _scale_argument(*args), atol=1e-5, rtol=1e-5)


def _one_head(query, key, value, seq_lens):
    """One head per request (the cache's only batch axis is the request): q [B, d], caches [B, T, d]."""
    scores = torch.einsum("bd,btd->bt", query, key) * gd.SCALE
    scores = scores.masked_fill(~gd.valid_rows(seq_lens), float("-inf"))
    return torch.einsum("bt,btd->bd", scores.softmax(-1), value)


def test_one_head_per_request_reads_the_batch_axis_as_the_request():
    """Multi-head attention's lone batch axis is the request, so a mask per request is admitted."""
    x = gd.make_inputs(torch.float32, kv_heads=gd.HEADS)
    args = (x.query[:, 0, 0], x.key[:, 0], x.value[:, 0], x.seq_lens)
    out, events = rewrite_and_run(_one_head, *args)
    assert fired(events, "gqa_decode") == 1, declined(events, "gqa_decode")
    expected = torch.stack([torch.softmax(x.key[b, 0, :n].double() @ x.query[b, 0, 0].double() * gd.SCALE, 0)
                            @ x.value[b, 0, :n].double() for b, n in enumerate(x.seq_lens.tolist())])
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_reference_is_independent_of_the_spellings():
    """reference_fp64 against the op's own reference (SDPA on the packed query) at fp32."""
    x = gd.make_inputs(torch.float32)
    mask = gd.valid_rows(x.seq_lens)[:, None, None, :]
    op = torch.ops.mla.gqa_decode_attention(x.query, x.key, x.value, mask, gd.SCALE)
    torch.testing.assert_close(op.double(), gd.reference_fp64(x, "repeat_interleave_einsum"), atol=1e-5, rtol=1e-5)


# --- where it must not fire -------------------------------------------------------------------------


def _alibi_multi_head(query, key, value, bias):
    """Multi-head attention with a bias per head (ALiBi: BLOOM, MPT, Falcon's alibi variants)."""
    return torch.softmax(query @ key.transpose(-1, -2) * gd.SCALE + bias, -1) @ value


def _prefill(query, key, value, mask):
    """Two query rows per head (prefill) under a causal mask."""
    k, v = gd.repeat_kv(key, gd.GROUP), gd.repeat_kv(value, gd.GROUP)
    return torch.softmax(query @ k.transpose(-1, -2) * gd.SCALE + mask, -1) @ v


def _mask_per_head(query, key, value, mask):
    """A mask that differs between the heads of a group (ALiBi-like per-head bias)."""
    k, v = gd.repeat_kv(key, gd.GROUP), gd.repeat_kv(value, gd.GROUP)
    return torch.softmax(query @ k.transpose(-1, -2) * gd.SCALE + mask, -1) @ v


def _values_per_head(query, key, value, mask):
    """Keys shared by a group, values per query head."""
    k = gd.repeat_kv(key, gd.GROUP)
    return torch.softmax(query @ k.transpose(-1, -2) * gd.SCALE + mask, -1) @ value


def _classifier(x, w):
    return torch.softmax(x @ w, -1)


def _not_firing_cases():
    x = gd.make_inputs(torch.float32)
    mask, batch = x.additive_mask(), x.batch
    causal = torch.triu(torch.full((2, gd.ROWS), float("-inf")), gd.ROWS - 1)
    per_head = torch.randn(batch, gd.HEADS, 1, gd.ROWS)
    full = gd.make_inputs(torch.float32, kv_heads=gd.HEADS)
    return {
        "alibi_multi_head": (_alibi_multi_head, (full.query, full.key, full.value, per_head), "differs between heads"),
        "prefill": (_prefill, (torch.randn(batch, gd.HEADS, 2, gd.HEAD_DIM), x.key, x.value, causal), "prefill"),
        "mask_per_head": (_mask_per_head, (x.query, x.key, x.value, per_head), "differs between heads"),
        "values_per_head": (_values_per_head, (x.query, x.key, torch.randn(batch, gd.HEADS, gd.ROWS, gd.V_DIM), mask),
                            "values differ between the query heads"),
        "classifier": (_classifier, (torch.randn(4, 8), torch.randn(8, 5)), None),
    }


@pytest.mark.parametrize("case", ["alibi_multi_head", "prefill", "mask_per_head", "values_per_head", "classifier"])
def test_where_it_must_not_fire(case):
    fn, args, reason = _not_firing_cases()[case]
    out, events = rewrite_and_run(fn, *args)
    assert fired(events, "gqa_decode") == 0
    reasons = declined(events, "gqa_decode")
    if reason is None:  # not a candidate at all: nothing to explain
        assert reasons == []
    else:
        assert any(reason in r for r in reasons), reasons
    torch.testing.assert_close(out, fn(*args), atol=1e-5, rtol=1e-5)


# --- transformers models, attention as eager code -----------------------------------------------------


def tiny_model(arch: str, dtype: torch.dtype, layers: int = 2):
    """A tiny transformers model of `arch` with its eager attention: 4 query heads over 2 key/value heads."""
    config = transformers.AutoConfig.for_model(
        arch, vocab_size=256, hidden_size=96, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(dtype).eval()


# Gemma-2: softcapped logits, a sliding window on every other layer; Qwen3 and Gemma-3: norms on q and k
# per head (gqa_qkv takes them). (Llama's eager attention is the corpus's transformers_eager.)
@pytest.mark.parametrize("arch", ["gemma2", "qwen3", "gemma3_text"])
def test_transformers_eager_decode_fires_per_layer_and_matches_eager(arch):
    model = tiny_model(arch, torch.float32)
    cache = transformers.StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        prompt = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(1))
        model(input_ids=prompt, past_key_values=cache)
    ids, pos = torch.tensor([[3], [5]]), torch.full((2, 1), 6)
    with torch.no_grad():
        expected = model(input_ids=ids, past_key_values=copy.deepcopy(cache), position_ids=pos).logits
    step = lambda i, p: model(input_ids=i, past_key_values=cache, position_ids=p).logits  # noqa: E731
    out, events = rewrite_and_run(step, ids, pos)
    assert fired(events, "gqa_decode") == model.config.num_hidden_layers, declined(events, "gqa_decode")
    assert fired(events, "gqa_qkv") == model.config.num_hidden_layers, declined(events, "gqa_qkv")
    assert declined(events, "gqa_qkv") == []  # nor the q and k projections bound the other way round
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_gemma2_static_cache_decode_compiled_runs_the_template_and_equals_eager():
    """Gemma-2 in bf16 through the backend: the softcapped template at every layer of both graphs
    transformers' masks lead Dynamo to (a static and a dynamic cache length), and gqa_qkv after Gemma's
    RMSNorm; greedy tokens as eager's."""
    model = tiny_model("gemma2", torch.bfloat16)
    model.config.attn_logit_softcapping = 5.0  # low enough to change the scores of this tiny model
    prompt = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    make_cache = lambda: transformers.StaticCache(config=model.config, max_cache_len=32)  # noqa: E731
    expected_tokens, expected_logits = greedy(model, make_cache(), prompt, 6)
    cache = make_cache()
    torch._dynamo.reset()
    mla_inductor.reset_counts()
    compiled = torch.compile(lambda ids, pos: model(input_ids=ids, past_key_values=cache, position_ids=pos).logits,
                             backend="mla_inductor")
    code = []

    def step(ids, pos):  # the first step's code, from the compile
        if code:
            return compiled(ids, pos)
        out, code[:] = run_and_get_code(compiled, ids, pos)
        return out

    tokens, logits = greedy(model, cache, prompt, 6, step)
    # Two graphs: the sliding-window mask reads the cache's length as an int, which the second step
    # makes dynamic (automatic dynamic shapes); the template serves both.
    assert mla_inductor.fusion_counts().get("gqa_decode") == 2 * model.config.num_hidden_layers
    assert mla_inductor.fusion_counts().get("gqa_qkv") == 2 * model.config.num_hidden_layers  # Gemma's RMSNorm
    assert "mi::attend_split" in code[0] and "torch.ops.mla" not in code[0], "the template did not serve"
    assert torch.equal(tokens, expected_tokens)
    assert (logits.float() - expected_logits.float()).abs().max() < 0.1
    assert math.isfinite(logits.float().abs().max())
