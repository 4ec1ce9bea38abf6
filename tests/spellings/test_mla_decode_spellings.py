"""mla_decode (and the q_b_absorb that follows it) on spellings of latent attention written as others write
them: the corpus in latent_decode.py, DeepSeek's reference model (deepseek_reference.py), and where
the fusion must not fire. The graphs are rewritten and run on the ops' references (graph_utils.
rewrite_and_run); one compile of DeepSeek's model runs the C++ templates end to end."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mla_inductor
from graph_utils import declined, fired, has_dynamic_sizes, rewrite_and_run
from spellings import deepseek_reference as ds
from spellings import latent_decode as ld

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(ld.SPELLINGS))
def test_spelling_fires_and_is_no_less_accurate_than_eager(name, dtype):
    inputs = ld.make_inputs(dtype)
    args = ld.spelling_args(name, inputs)
    out, events = rewrite_and_run(ld.SPELLINGS[name], *args)
    assert fired(events, "mla_decode") == 1, declined(events, "mla_decode")
    lengths = [ld.ROWS] * inputs.batch if name == "deepseek_two_caches" else None  # it reads every row
    expected = ld.reference_fp64(inputs, lengths, w_vc=name != "latent_output_only")
    error = (out.double() - expected).abs().max().item()
    eager_error = (ld.SPELLINGS[name](*args).double() - expected).abs().max().item()
    assert out.dtype == dtype and out.shape == expected.shape
    assert error <= max(TOLERANCE[dtype], 1.5 * eager_error), (error, eager_error)


@pytest.mark.parametrize("name", list(ld.SPELLINGS))
def test_spelling_fires_with_dynamic_batch_and_rows(name):
    """As a server compiles it: one graph for every batch and cache length (symbolic sizes)."""
    inputs = ld.make_inputs(torch.float32)
    args = ld.mark_dynamic(ld.spelling_args(name, inputs), inputs)
    out, events = rewrite_and_run(ld.SPELLINGS[name], *args)
    assert has_dynamic_sizes(rewrite_and_run.graph)
    assert fired(events, "mla_decode") == 1, declined(events, "mla_decode")
    torch.testing.assert_close(out, ld.SPELLINGS[name](*args), atol=1e-5, rtol=1e-5)


@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(sorted(ld.SPELLINGS)), batch=st.integers(1, 3), block_size=st.sampled_from([1, 2, 4, 16]),
       heads=st.sampled_from([1, 2, 4]), lengths=st.lists(st.integers(1, ld.ROWS), min_size=3, max_size=3),
       dynamic=st.booleans())
def test_spellings_fire_where_dynamo_specializes_a_size_of_one(name, batch, block_size, heads, lengths, dynamic):
    """Sizes the match reasons about at 1 after specialization (a batch of one, a block size of one:
    SGLang's token pool, a table of one block, one head: a tensor-parallel rank's, one cached row), as
    well as larger, static or marked dynamic."""
    inputs = ld.make_inputs(torch.float32, batch=batch, block_size=block_size, heads=heads, seq_lens=lengths[:batch])
    args = ld.spelling_args(name, inputs)
    if dynamic:
        args = ld.mark_dynamic(args, inputs)
    out, events = rewrite_and_run(ld.SPELLINGS[name], *args)
    if name == "deepseek_two_caches" and dynamic and batch == 1:
        # A known miss: Dynamo gives the two caches' rows two symbols here (one with a batch of 2), which
        # the walk cannot prove equal; the op would read the rope rows where the latent ones lie.
        assert declined(events, "mla_decode") == ["the latent and rope caches are not laid out alike"] * 2
        return
    assert fired(events, "mla_decode") == 1, declined(events, "mla_decode")
    reads_every_row = name == "deepseek_two_caches"
    expected = ld.reference_fp64(inputs, [ld.ROWS] * batch if reads_every_row else None, w_vc=name != "latent_output_only")
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_reference_is_independent_of_the_spellings():
    """reference_fp64 against the op's own reference at fp32 (a different computation of the same math)."""
    x = ld.make_inputs(torch.float32)
    op = torch.ops.mla.latent_decode_attention(torch.cat([x.q_lat, x.q_pe], -1), x.paged, x.block_tables,
                                               x.seq_lens, ld.LATENT, ld.SCALE, w_vc=x.w_vc)
    torch.testing.assert_close(op.double(), ld.reference_fp64(x), atol=1e-5, rtol=1e-5)


def _bias_before_scale(q_lat, q_pe, paged, block_tables, seq_lens, w_vc, bias):
    """A finite per-row bias (ALiBi-like) added before the scale, and a length mask by masked_fill."""
    q = torch.cat([q_lat, q_pe], -1)
    kv = paged[block_tables].flatten(1, 2)
    scores = (torch.einsum("bhc,btc->bht", q, kv) + bias[:, None, :]) * ld.SCALE
    scores = scores.masked_fill(~ld._valid(seq_lens)[:, None, :], float("-inf"))
    probs = scores.softmax(-1)
    return torch.einsum("bhc,hdc->bhd", torch.einsum("bht,btc->bhc", probs, kv[..., : ld.LATENT]), w_vc)


def test_a_bias_added_before_the_scale_is_scaled_with_the_scores():
    x = ld.make_inputs(torch.float32)
    args = (x.q_lat, x.q_pe, x.paged, x.block_tables, x.seq_lens, x.w_vc, torch.randn(x.batch, ld.ROWS))
    out, events = rewrite_and_run(_bias_before_scale, *args)
    assert fired(events, "mla_decode") == 1, declined(events, "mla_decode")
    torch.testing.assert_close(out, _bias_before_scale(*args), atol=1e-5, rtol=1e-5)


def _softcapped(q_lat, q_pe, paged, block_tables, seq_lens, w_vc, mask_under_cap=False):
    """Gemma-2's logit softcap, cap * tanh(scores / cap), after the scale; the length mask after it."""
    cap = 0.5  # small enough that the cap changes the probabilities
    q, kv = torch.cat([q_lat, q_pe], -1), paged[block_tables].flatten(1, 2)
    scores = torch.einsum("bhc,btc->bht", q, kv) * ld.SCALE
    masked = ~ld._valid(seq_lens)[:, None, :]
    if mask_under_cap:
        scores = scores.masked_fill(masked, float("-inf"))
    scores = torch.tanh(scores / cap) * cap
    if not mask_under_cap:
        scores = scores.masked_fill(masked, float("-inf"))
    probs = scores.softmax(-1)
    return torch.einsum("bhc,hdc->bhd", torch.einsum("bht,btc->bhc", probs, kv[..., : ld.LATENT]), w_vc)


def test_a_softcap_on_the_scores_goes_to_the_op():
    x = ld.make_inputs(torch.float32)
    args = (x.q_lat, x.q_pe, x.paged, x.block_tables, x.seq_lens, x.w_vc)
    out, events = rewrite_and_run(_softcapped, *args)
    assert fired(events, "mla_decode") == 1, declined(events, "mla_decode")
    torch.testing.assert_close(out, _softcapped(*args), atol=1e-5, rtol=1e-5)


def test_declines_a_mask_under_the_softcap():
    """tanh(-inf) is -1: such a mask does not exclude the row, and the op's mask would."""
    x = ld.make_inputs(torch.float32)
    args = (x.q_lat, x.q_pe, x.paged, x.block_tables, x.seq_lens, x.w_vc, True)
    out, events = rewrite_and_run(_softcapped, *args)
    assert fired(events, "mla_decode") == 0
    assert any("softcap" in r for r in declined(events, "mla_decode")), declined(events, "mla_decode")
    torch.testing.assert_close(out, _softcapped(*args), atol=1e-5, rtol=1e-5)


def _projection_shared_by_heads(q_lat, q_pe, paged, block_tables, seq_lens, w_shared):
    """The latent output times one matrix for every head: not W_vc, so it stays the model's product."""
    kv = paged[block_tables].flatten(1, 2)
    scores = torch.einsum("bhd,btd->bht", torch.cat([q_lat, q_pe], -1), kv) * ld.SCALE
    scores = scores.masked_fill(~ld._valid(seq_lens)[:, None, :], float("-inf"))
    return torch.einsum("bht,btc->bhc", scores.softmax(-1), kv[..., : ld.LATENT]) @ w_shared


def test_a_projection_shared_by_the_heads_is_not_taken_for_w_vc():
    x = ld.make_inputs(torch.float32)
    args = (x.q_lat, x.q_pe, x.paged, x.block_tables, x.seq_lens, torch.randn(ld.LATENT, ld.V_HEAD))
    out, events = rewrite_and_run(_projection_shared_by_heads, *args)
    assert fired(events, "mla_decode") == 1, declined(events, "mla_decode")
    torch.testing.assert_close(out, _projection_shared_by_heads(*args), atol=1e-5, rtol=1e-5)


# --- where it must not fire ------------------------------------------------------------------------


def _scaled_apart(q_lat, q_pe, paged, block_tables, seq_lens, w_vc):
    """The latent and rope products scaled differently: not one attention scale."""
    kv = paged[block_tables].flatten(1, 2)
    scores = (torch.bmm(q_lat, kv[..., : ld.LATENT].transpose(1, 2)) * 0.5
              + torch.bmm(q_pe, kv[..., ld.LATENT :].transpose(1, 2)) * 0.25)
    scores = scores.masked_fill(~ld._valid(seq_lens)[:, None, :], float("-inf"))
    return torch.bmm(torch.bmm(scores.softmax(-1), kv[..., : ld.LATENT]).transpose(0, 1), w_vc.transpose(1, 2))


def test_declines_scores_scaled_apart():
    x = ld.make_inputs(torch.float32)
    args = (x.q_lat, x.q_pe, x.paged, x.block_tables, x.seq_lens, x.w_vc)
    out, events = rewrite_and_run(_scaled_apart, *args)
    assert fired(events, "mla_decode") == 0
    assert "the score contractions are scaled differently" in declined(events, "mla_decode")
    torch.testing.assert_close(out, _scaled_apart(*args))


def _prefill_two_rows(q, paged, block_tables, seq_lens, w_vc):
    """Two query rows per request (prefill or speculative decode): not the decode op's contract."""
    kv = paged[block_tables].flatten(1, 2)
    scores = torch.einsum("bshd,btd->bsht", q, kv).float() * ld.SCALE
    scores = scores.masked_fill(~ld._valid(seq_lens)[:, None, None, :], float("-inf"))
    probs = scores.softmax(-1).to(q.dtype)
    return torch.einsum("bshc,hdc->bshd", torch.einsum("bsht,btc->bshc", probs, kv[..., : ld.LATENT]), w_vc)


def _values_apart(q, keys, values):
    """Single-head attention whose values are not the keys' leading columns: not latent attention."""
    probs = torch.softmax(torch.einsum("bhd,btd->bht", q, keys) * ld.SCALE, dim=-1)
    return torch.einsum("bht,btc->bhc", probs, values)


def _softmax_over_features(q_lat, paged, block_tables):
    """A softmax over the latent columns, not over cache rows."""
    kv = paged[block_tables].flatten(1, 2)
    return torch.softmax(torch.einsum("bhc,btc->bht", q_lat, kv[..., : ld.LATENT]).transpose(1, 2), dim=-1)


def test_declines_two_query_rows_and_says_why():
    x = ld.make_inputs(torch.float32)
    q = torch.cat([x.q_lat, x.q_pe], -1)[:, None].expand(-1, 2, -1, -1).contiguous()
    out, events = rewrite_and_run(_prefill_two_rows, q, x.paged, x.block_tables, x.seq_lens, x.w_vc)
    assert fired(events, "mla_decode") == 0
    assert any("more than one row" in r for r in declined(events, "mla_decode")), declined(events, "mla_decode")
    torch.testing.assert_close(out, _prefill_two_rows(q, x.paged, x.block_tables, x.seq_lens, x.w_vc))


def test_values_apart_from_the_keys_are_not_latent_attention():
    """Values of their own are grouped-query or multi-head attention (gqa_decode's anchored match): not
    a latent candidate, so mla_decode has nothing to explain."""
    x = ld.make_inputs(torch.float32)
    keys, values = x.dense(), x.dense()[..., : ld.LATENT] * 2
    q = torch.cat([x.q_lat, x.q_pe], -1)
    _, events = rewrite_and_run(_values_apart, q, keys, values)
    assert fired(events, "mla_decode") == 0 and declined(events, "mla_decode") == []


def _moe_router(x, gate_weight):
    """DeepSeek-V2's / Qwen-MoE's gate: a softmax over x's experts scores, then top-k, no contraction."""
    scores = torch.nn.functional.linear(x, gate_weight).softmax(dim=-1, dtype=torch.float32)
    return torch.topk(scores, k=2, dim=-1)


def test_a_moe_router_softmax_is_not_a_candidate():
    _, events = rewrite_and_run(_moe_router, torch.randn(3, 16), torch.randn(8, 16))
    assert [e for e in events if e.fusion in ("mla_decode", "gqa_decode")] == []


def test_not_a_candidate_when_the_softmax_is_not_over_rows():
    x = ld.make_inputs(torch.float32)
    _, events = rewrite_and_run(_softmax_over_features, x.q_lat, x.paged, x.block_tables)
    assert fired(events, "mla_decode") == 0


# --- DeepSeek's reference model ------------------------------------------------------------------------


def _decode_step(args: ds.Args, dtype, prompt_len=6):
    """A model after an eager prefill of `prompt_len` tokens, and the next step's tokens."""
    model = ds.build(args, dtype)
    gen = torch.Generator().manual_seed(1)
    model(torch.randint(0, args.vocab_size, (2, prompt_len), generator=gen), 0)
    return model, torch.randint(0, args.vocab_size, (2, 1), generator=gen)


def _restoring(model):
    state = [b.clone() for b in model.buffers()]

    def restore():
        for b, s in zip(model.buffers(), state):
            b.copy_(s)

    return restore


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("q_lora_rank", [48, 0], ids=["q_lora", "v2_lite"])
def test_deepseek_reference_decode_fuses_every_layer(q_lora_rank, dynamic):
    """Static, and with torch.compile(dynamic=True): batch, start_pos and the softmax scale (a float
    attribute, passed as a 0-d tensor) are then graph inputs."""
    args = ds.Args(q_lora_rank=q_lora_rank)
    model, step = _decode_step(args, torch.float32)
    restore = _restoring(model)
    expected = model(step, 6)
    restore()
    out, events = rewrite_and_run(lambda t, pos: ds.Transformer.forward.__wrapped__(model, t, pos), step, 6,
                                  dynamic=dynamic)
    assert has_dynamic_sizes(rewrite_and_run.graph) == dynamic
    for fusion in ("qkv_a_proj", "mla_decode"):
        assert fired(events, fusion) == args.n_layers, (fusion, declined(events, fusion))
    assert fired(events, "q_b_absorb") == (args.n_layers if q_lora_rank else 0), declined(events, "q_b_absorb")
    assert fired(events, "rope") == 2 * args.n_layers
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_deepseek_reference_prefill_keeps_its_attention():
    model = ds.build(ds.Args(), torch.float32)
    tokens = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(2))
    restore = _restoring(model)
    expected = model(tokens, 0)
    restore()
    out, events = rewrite_and_run(lambda t: ds.Transformer.forward.__wrapped__(model, t, 0), tokens)
    assert fired(events, "mla_decode") == 0
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_deepseek_reference_generate_loop_fuses_in_cpp_at_every_position():
    """The decorated forward through the backend, bf16, as DeepSeek's generate loop calls it: a new
    start_pos each step, so from the second step Dynamo compiles one graph for every position (the
    cache length symbolic). Both graphs run every layer's attention on our templates."""
    args = ds.Args()
    model, step = _decode_step(args, torch.bfloat16)
    twin = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(twin, backend="mla_inductor")
    for pos, compiles in ((6, True), (7, True), (8, False)):
        mla_inductor.reset_counts()
        out, expected = compiled(step, pos), model(step, pos)
        counts = mla_inductor.fusion_counts()
        fused = args.n_layers if compiles else 0  # the third step reuses the second's graph
        assert counts["mla_decode"] == counts["q_b_absorb"] == counts["qkv_a_proj"] == fused, (pos, counts)
        torch.testing.assert_close(out.float(), expected.float(), atol=0.1, rtol=0.05)
        step = expected.argmax(-1, keepdim=True)
