"""mla_prefill: causal attention of many query rows with q/k head size != v head size. The op's reference
against fp64, its flash-attention template against the reference and fp64 (no less accurate than SDPA's
own math path), and the rewrite of SDPA calls in transformers' DeepSeek V2 / V3 prefill and where it must
not fire."""

import functools

import pytest
import torch
import torch.nn.functional as F

import mla_inductor
from graph_utils import declined, fired, rewrite_and_run, tiny_gqa_model
from mla_inductor import isa
from mla_inductor.models.hf import build_hf_model
from mla_inductor.patterns.gqa_decode import repeat_kv
from torch._inductor.utils import run_and_get_code

OP = torch.ops.mla.prefill_attention


def attention_fp64(q, k, v, mask=None, is_causal=False, scale=None, softcap=0.0):
    """An independent reference: fp64, one query head at a time over its key/value head; query row i is
    key row i + Tk - Tq when causal; a query row that no key row admits gets zeros."""
    batch, heads, rows, head_dim = q.shape
    kv_heads, key_rows = k.shape[1], k.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    if mask is not None:
        mask = mask.view([1] * (4 - mask.dim()) + list(mask.shape)).expand(batch, heads, rows, key_rows)
    out = torch.zeros(batch, heads, rows, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            kvh = h // (heads // kv_heads)
            scores = q[b, h].double() @ k[b, kvh].double().T * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            if mask is not None:
                m = mask[b, h]
                scores = scores.masked_fill(~m, -torch.inf) if m.dtype == torch.bool else scores + m.double()
            if is_causal:
                later = torch.arange(key_rows)[None, :] > torch.arange(rows)[:, None] + key_rows - rows
                scores = scores.masked_fill(later, -torch.inf)
            for i in range(rows):
                if torch.isinf(scores[i]).all():
                    continue
                out[b, h, i] = scores[i].softmax(-1) @ v[b, kvh].double()
    return out


def make_inputs(batch, heads, kv_heads, rows, key_rows, d, dv, dtype=torch.bfloat16, seed=0, strided_value=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, rows, d, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, key_rows, d, generator=g).to(dtype)
    if strided_value:  # transformers' value: heads split from a projection's rows, [B, T, H, dv] transposed
        v = torch.randn(batch, key_rows, kv_heads, dv, generator=g).to(dtype).transpose(1, 2)
    else:
        v = torch.randn(batch, kv_heads, key_rows, dv, generator=g).to(dtype)
    return q, k, v


def masks(kind, batch, heads, rows, key_rows, seed=1):
    g = torch.Generator().manual_seed(seed)
    if kind is None:
        return None
    if kind == "padding":  # transformers' bool [B, 1, Tq, Tk]: causal and left padding, a fully masked row
        causal = torch.ones(rows, key_rows, dtype=torch.bool).tril(key_rows - rows)
        pad = torch.arange(key_rows)[None, :] >= torch.tensor([0, 3] * batch)[:batch, None]
        mask = causal[None, None] & pad[:, None, None, :]
        mask[-1, 0, 0] = False
        return mask
    if kind == "random_heads":  # bool per head, holes inside the range
        return torch.rand(1, heads, rows, key_rows, generator=g) > 0.3
    if kind == "additive":  # float bias per row and key, some -inf
        bias = torch.randn(batch, 1, rows, key_rows, generator=g)
        return bias.masked_fill(torch.rand(bias.shape, generator=g) > 0.8, -torch.inf)
    raise ValueError(kind)


# --- the op's reference ---------------------------------------------------------------------------

REFERENCE_CASES = [
    # batch, heads, kv_heads, rows, key_rows, d, dv, mask, causal, softcap
    (1, 1, 1, 1, 1, 8, 4, None, True, 0.0),
    (1, 2, 1, 1, 9, 16, 8, None, True, 0.0),  # one query row after a prefix
    (2, 4, 2, 5, 9, 24, 16, "padding", True, 0.0),  # grouped heads, a prefix, a mask and the causal order
    (1, 3, 3, 7, 7, 12, 20, "additive", False, 0.0),  # dv > d
    (2, 2, 1, 6, 6, 16, 8, "random_heads", False, 30.0),
    (1, 2, 2, 300, 300, 16, 8, None, True, 0.0),  # more rows than a reference block
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", REFERENCE_CASES)
def test_reference_matches_fp64(case, dtype):
    batch, heads, kv_heads, rows, key_rows, d, dv, mask_kind, causal, softcap = case
    q, k, v = make_inputs(batch, heads, kv_heads, rows, key_rows, d, dv, dtype)
    mask = masks(mask_kind, batch, heads, rows, key_rows)
    out = OP(q, k, v, mask, causal, 0.3, softcap)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.double(), attention_fp64(q, k, v, mask, causal, 0.3, softcap), atol=tol, rtol=tol)


def test_fully_masked_rows_get_zeros():
    q, k, v = make_inputs(1, 2, 2, 4, 4, 8, 4)
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[1] = False
    out = OP(q, k, v, mask)
    assert out[:, :, 1].abs().max() == 0 and out[:, :, 0].abs().max() > 0


@pytest.mark.parametrize(
    "args, message",
    [
        ((torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8, dtype=torch.bfloat16), torch.zeros(1, 2, 3, 4)), "key and value"),
        ((torch.zeros(1, 3, 3, 8), torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 4)), "not a multiple"),
        ((torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 4), None, True), "fewer than query"),
        ((torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 4, 4)), "value must be"),
        ((torch.zeros(2, 3, 8), torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 4)), "query must be"),
        ((torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 4), torch.ones(1, 3, 3, 3)),
         "attn_mask must broadcast"),
        ((torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 4), torch.ones(3, 3, dtype=torch.int32)),
         "bool or a float"),
    ],
)
def test_bad_arguments_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        OP(*args)


def test_negative_softcap_is_refused():
    q, k, v = make_inputs(1, 1, 1, 2, 2, 8, 4)
    with pytest.raises(ValueError, match="softcap"):
        OP(q, k, v, None, False, None, -1.0)


# --- the template ---------------------------------------------------------------------------------


@functools.cache
def compiled_op(has_mask, is_causal, softcap, dynamic):
    """One compile per signature, shared by the shapes each test runs (dynamic sizes where asked)."""
    if has_mask:
        fn = lambda q, k, v, m: OP(q, k, v, m, is_causal, 0.125, softcap)  # noqa: E731
    else:
        fn = lambda q, k, v: OP(q, k, v, None, is_causal, 0.125, softcap)  # noqa: E731
    return torch.compile(fn, dynamic=dynamic)


def sdpa_flash(q, k, v, mask, is_causal, scale):
    """ATen's CPU flash attention on the same inputs, the head sizes made equal by zero columns (of v,
    or of q and k, which change no score): the accuracy of PyTorch's own fused attention, which rounds
    the probabilities to bf16 before P . V as the template does. (SDPA's math path, which MLA's head
    sizes get, keeps them in fp32: more accurate, and 2-8x slower than either.)"""
    d, dv = q.shape[-1], v.shape[-1]
    if dv < d:
        v = F.pad(v, (0, d - dv))
    else:
        q, k = F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d))
    if is_causal:
        causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(k.shape[2] - q.shape[2])
        mask = causal if mask is None else (mask & causal if mask.dtype == torch.bool else mask.masked_fill(~causal, -torch.inf))
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[..., :dv]


def check_template(fn, q, k, v, mask, is_causal, softcap=0.0):
    args = (q, k, v) if mask is None else (q, k, v, mask)
    out, code = run_and_get_code(fn, *args)
    assert "prefill_tile" in code[0], "the template did not serve"
    expected = attention_fp64(q, k, v, mask, is_causal, 0.125, softcap)
    torch.testing.assert_close(out.double(), OP(q, k, v, mask, is_causal, 0.125, softcap).double(), atol=1e-2, rtol=1e-2)
    if softcap == 0.0:  # no less accurate than ATen's flash attention (a factor of 2 on the max error)
        flash_error = (sdpa_flash(q, k, v, mask, is_causal, 0.125).double() - expected).abs().max()
        assert (out.double() - expected).abs().max() <= 2 * flash_error + 1e-6
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("shape", [(2, 37, 37), (2, 70, 300), (3, 129, 129)])
def test_template_causal_grouped(shape):
    """Tiles of 32 query rows and 128 key rows cut at every place, a prefix before the query rows, two
    query heads per key/value head."""
    batch, rows, key_rows = shape
    q, k, v = make_inputs(batch, 4, 2, rows, key_rows, 40, 24)
    check_template(compiled_op(False, True, 0.0, True), q, k, v, None, True)


@pytest.mark.parametrize("batch, rows", [(2, 45), (3, 20)])
def test_template_v2_lite_heads_with_transformers_mask(batch, rows):
    """DeepSeek's head sizes (192 / 128), the value strided as transformers splits it, a bool mask with
    left padding and a row it excludes whole."""
    q, k, v = make_inputs(batch, 2, 2, rows, rows, 192, 128, strided_value=True)
    check_template(compiled_op(True, False, 0.0, True), q, k, v, masks("padding", batch, 2, rows, rows), False)


def test_template_padding_mask_shared_by_the_query_rows():
    """A [B, 1, 1, Tk] padding mask with the causal flag: the kernel scans each mask row once."""
    q, k, v = make_inputs(2, 2, 2, 20, 30, 48, 32)
    padding = (torch.arange(30) >= torch.tensor([0, 7])[:, None])[:, None, None, :]
    check_template(compiled_op(True, True, 0.0, True), q, k, v, padding, True)


def test_template_additive_mask_per_head_and_softcap():
    q, k, v = make_inputs(2, 3, 3, 33, 40, 64, 48)
    bias = masks("additive", 2, 3, 33, 40)
    check_template(compiled_op(True, True, 50.0, False), q, k, v, bias, True, softcap=50.0)
    holes = masks("random_heads", 2, 3, 33, 40)
    check_template(compiled_op(True, True, 50.0, False), q, k, v, holes, True, softcap=50.0)


def test_template_size_one_dims():
    """One request, one head, one query row over one key row (and over a prefix)."""
    fn = compiled_op(False, True, 0.0, False)
    for key_rows in (1, 5):
        q, k, v = make_inputs(1, 1, 1, 1, key_rows, 16, 8)
        check_template(fn, q, k, v, None, True)


def test_fp32_falls_back_to_the_reference():
    q, k, v = make_inputs(1, 2, 2, 9, 9, 16, 8, torch.float32)
    out, code = run_and_get_code(compiled_op(False, True, 0.0, False), q, k, v)
    assert "prefill_tile" not in code[0]
    torch.testing.assert_close(out.double(), attention_fp64(q, k, v, None, True, 0.125), atol=1e-4, rtol=1e-4)


# --- the rewrite ------------------------------------------------------------------------------------


def sdpa(q, k, v, mask, **kwargs):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)


def test_sdpa_with_differing_head_sizes_is_rewritten():
    q, k, v = make_inputs(2, 4, 4, 12, 12, 24, 16, strided_value=True)
    mask = masks("padding", 2, 4, 12, 12)
    for kwargs in ({"scale": 0.2}, {}):
        out, events = rewrite_and_run(lambda q, k, v, m: sdpa(q, k, v, m, **kwargs), q, k, v, mask)
        assert fired(events, "mla_prefill") == 1
        torch.testing.assert_close(out, sdpa(q, k, v, mask, **kwargs), atol=1e-2, rtol=1e-2)


def test_causal_and_grouped_sdpa_is_rewritten():
    q, k, v = make_inputs(1, 4, 2, 10, 10, 24, 16)
    fn = lambda q, k, v: sdpa(q, k, v, None, is_causal=True, enable_gqa=True)  # noqa: E731
    out, events = rewrite_and_run(fn, q, k, v)
    assert fired(events, "mla_prefill") == 1
    torch.testing.assert_close(out, fn(q, k, v), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(
    "case, reason",
    [
        ("fp32", "float32"),
        ("top-left causal", "top-left"),
        ("dropout", "dropout_p"),
    ],
)
def test_declined_with_a_reason(case, reason):
    q, k, v = make_inputs(1, 2, 2, 6, 6, 24, 16, torch.float32 if case == "fp32" else torch.bfloat16)
    if case == "top-left causal":
        fn = lambda q, k, v: sdpa(q[:, :, 2:], k, v, None, is_causal=True)  # noqa: E731
    elif case == "dropout":
        fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)  # noqa: E731
    else:
        fn = lambda q, k, v: sdpa(q, k, v, None)  # noqa: E731
    if case == "dropout":
        torch.manual_seed(0)
    _, events = rewrite_and_run(fn, q, k, v)
    assert fired(events, "mla_prefill") == 0
    assert any(reason in r for r in declined(events, "mla_prefill")), declined(events, "mla_prefill")


def test_not_a_candidate_where_others_serve():
    """Equal head sizes (ATen's flash attention) and one query row (the decode fusions): no event at all."""
    q, k, v = make_inputs(1, 2, 2, 6, 6, 16, 16)
    _, events = rewrite_and_run(lambda q, k, v: sdpa(q, k, v, None), q, k, v)
    q, k, v = make_inputs(1, 2, 2, 1, 6, 24, 16)
    _, more = rewrite_and_run(lambda q, k, v: sdpa(q, k, v, None), q, k, v)
    assert not [e for e in events + more if e.fusion == "mla_prefill"]


def transformers_eager(q, k, v, mask):
    """transformers' eager_attention_forward (grouped heads by repeat_kv, its additive min-valued mask)."""
    k, v = repeat_kv(k, q.shape[1] // k.shape[1]), repeat_kv(v, q.shape[1] // v.shape[1])
    weights = torch.matmul(q, k.transpose(2, 3)) * 0.2
    weights = weights + mask[:, :, :, : k.shape[-2]]
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v).transpose(1, 2).contiguous()


def deepseek_naive(q, k, v, mask):
    """DeepSeek's reference `naive` prefill: [B, S, H, D] einsums against the caches, an additive [S, S] mask."""
    scores = torch.einsum("bshd,bthd->bsht", q, k) * 0.2
    scores += mask.unsqueeze(1)
    scores = scores.softmax(dim=-1, dtype=torch.float32).type_as(q)
    return torch.einsum("bsht,bthd->bshd", scores, v)


def serving_masked_fill(q, k, v, lengths):
    """Serving code's own: fp32 scores by bmm over heads in the batch, a length mask by masked_fill."""
    batch, heads, rows, _ = q.shape
    scores = torch.bmm(q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2)).float() * 0.2
    causal = torch.arange(rows)[None, :] <= torch.arange(rows)[:, None]
    visible = causal[None] & (torch.arange(rows)[None, None, :] < lengths.repeat_interleave(heads)[:, None, None])
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1).to(q.dtype)
    return torch.bmm(probs, v.flatten(0, 1)).view(batch, heads, rows, -1)


def test_written_out_prefill_attention_is_rewritten():
    """Attention spelled out by others, read by its math (the SDPA form goes by the pre-grad rewrite)."""
    q, k, v = make_inputs(2, 4, 2, 12, 12, 24, 16)
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    expected = attention_fp64(q, k, v, causal, False, 0.2)
    additive = torch.zeros(2, 1, 12, 12).masked_fill(~causal, torch.finfo(torch.float32).min).bfloat16()
    heads_second = (q.transpose(1, 2).contiguous(), repeat_kv(k, 2).transpose(1, 2).contiguous(),
                    repeat_kv(v, 2).transpose(1, 2).contiguous())
    cases = [
        (transformers_eager, (q, k, v, additive), expected.transpose(1, 2)),
        (deepseek_naive, (*heads_second, torch.full((12, 12), float("-inf")).triu(1)), expected.transpose(1, 2)),
    ]
    lengths = torch.tensor([12, 7])
    full_k, full_v = repeat_kv(k, 2), repeat_kv(v, 2)
    visible = causal[None, None] & (torch.arange(12) < lengths[:, None])[:, None, None, :]
    cases.append((serving_masked_fill, (q, full_k, full_v, lengths), attention_fp64(q, full_k, full_v, visible, False, 0.2)))
    for fn, args, reference in cases:
        out, events = rewrite_and_run(fn, *args)
        assert fired(events, "mla_prefill") == 1, (fn.__name__, declined(events, "mla_prefill"))
        error = (out.double() - reference).abs().max()
        assert error <= max(1e-2, 1.5 * (fn(*args).double() - reference).abs().max()), (fn.__name__, error)


def test_written_out_attention_of_one_head_size_is_no_candidate():
    q, k, v = make_inputs(1, 4, 2, 10, 10, 16, 16)
    mask = torch.zeros(1, 1, 10, 10).bfloat16()
    _, events = rewrite_and_run(transformers_eager, q, k, v, mask)
    assert not [e for e in events if e.fusion == "mla_prefill"]


def test_written_out_fp32_is_declined_with_the_reason():
    q, k, v = make_inputs(1, 2, 2, 10, 10, 24, 16, torch.float32)
    _, events = rewrite_and_run(transformers_eager, q, k, v, torch.zeros(1, 1, 10, 10))
    assert any("bf16" in reason for reason in declined(events, "mla_prefill")), declined(events, "mla_prefill")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_transformers_gqa_prefill_reads_the_key_value_heads(arch):
    """gqa_prefill: transformers' SDPA prefill of a grouped-query model (one head size), k and v repeated
    per query head by repeat_kv, where ours beats ATen's flash attention (not on AMX CPUs)."""
    model = tiny_gqa_model(arch, torch.bfloat16)
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    out, events = rewrite_and_run(lambda i: model(input_ids=i).logits, ids)
    taken = isa.host_isa() != "amx"
    assert fired(events, "gqa_prefill") == (2 if taken else 0), declined(events, "gqa_prefill")
    assert not [e for e in events if e.fusion == "mla_prefill"]
    ops = [n for n in rewrite_and_run.graph.nodes if n.target == torch.ops.mla.prefill_attention.default]
    assert len(ops) == (2 if taken else 0)
    assert all(op.args[1].meta["val"].shape[1] == model.config.num_key_value_heads for op in ops)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_transformers_deepseek_prefill_compiled():
    """transformers' DeepSeek-V3 attention (sdpa, the default) at prefill through the backend: every layer's
    attention runs the template, and the logits stay those of eager."""
    model = build_hf_model("tiny", arch="v3", num_hidden_layers=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    mla_inductor.reset_counts()
    torch._dynamo.reset()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        actual = torch.compile(model, backend="mla_inductor")(input_ids=ids).logits
    assert mla_inductor.fusion_counts()["mla_prefill"] == 2
    torch.testing.assert_close(actual.float(), expected.float(), atol=0.15, rtol=0.05)


def assert_prefill_rewritten_per_layer(model, rows):
    """A prefill of `model` (2 layers) on its rewritten graph: each layer's attention is the op, and the
    logits stay those of eager."""
    ids = torch.randint(0, model.config.vocab_size, (2, rows), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    out, events = rewrite_and_run(lambda i: model(input_ids=i).logits, ids)
    assert fired(events, "mla_prefill") == 2, declined(events, "mla_prefill")
    torch.testing.assert_close(out.float(), expected.float(), atol=0.15, rtol=0.05)


def test_transformers_deepseek_v2_prefill():
    """DeepSeek-V2 (complex RoPE) at prefill: the SDPA call of each layer rewritten (graph only)."""
    assert_prefill_rewritten_per_layer(build_hf_model("tiny", arch="v2", num_hidden_layers=2), 24)


def test_transformers_deepseek_eager_attention_prefill():
    """attn_implementation="eager": the attention written out (bf16 matmuls, fp32 softmax), read by its math."""
    assert_prefill_rewritten_per_layer(
        build_hf_model("tiny", arch="v3", num_hidden_layers=2, attn_implementation="eager"), 20)


# --- SGLang's extend attention ------------------------------------------------------------------------


def extend_case(prefix_lens, new_lens, heads, kv_heads, d, dv, buffer_heads=None, cache_dtype=torch.bfloat16,
                encoder_lens=None, seed=0):
    """A batch of requests as a radix-cache server holds them: each request's slots in a token pool (its
    encoder rows, its prefix, then its new tokens), the new tokens' q, k and v packed one request after
    another. Non-contiguous q/k/v and buffers, as SGLang's own test passes them."""
    g = torch.Generator().manual_seed(seed)
    batch = len(prefix_lens)
    buffer_heads = buffer_heads or kv_heads
    encoder_lens = encoder_lens or [0] * batch
    lengths = [p + n for p, n in zip(prefix_lens, new_lens)]
    total = sum(lengths) + sum(encoder_lens)
    req_to_token = torch.zeros(batch + 1, max(l + e for l, e in zip(lengths, encoder_lens)), dtype=torch.int32)
    order = torch.randperm(total, generator=g).to(torch.int32)  # slots scattered over the pool
    at = 0
    for i, (length, enc) in enumerate(zip(lengths, encoder_lens)):
        req_to_token[i + 1, :length + enc] = order[at:at + length + enc]  # pool row i + 1: indices matter
        at += length + enc
    k_buffer = torch.randn(total, buffer_heads, d, generator=g).to(torch.bfloat16)
    v_buffer = torch.randn(total, buffer_heads, dv, generator=g).to(torch.bfloat16)
    k_scale = v_scale = None
    if cache_dtype == torch.float8_e4m3fn:  # per-token scales
        k_scale, v_scale = (torch.rand(total, 1, 1, generator=g) * 0.1 + 0.01 for _ in range(2))
        k_buffer, v_buffer = (k_buffer.float() / k_scale).to(cache_dtype), (v_buffer.float() / v_scale).to(cache_dtype)
    elif cache_dtype != torch.bfloat16:
        k_buffer, v_buffer = k_buffer.to(cache_dtype), v_buffer.to(cache_dtype)
    k_rows = k_buffer.float() * (k_scale if k_scale is not None else 1)
    v_rows = v_buffer.float() * (v_scale if v_scale is not None else 1)
    tokens = sum(new_lens)
    q = (torch.randn(heads, tokens, d, generator=g) * 3).to(torch.bfloat16).transpose(0, 1)
    k_extend = torch.empty(kv_heads, tokens, d, dtype=torch.bfloat16).transpose(0, 1)
    v_extend = torch.empty(kv_heads, tokens, dv, dtype=torch.bfloat16).transpose(0, 1)
    starts = torch.tensor([0] + list(torch.tensor(new_lens).cumsum(0)[:-1]), dtype=torch.int64)
    for i, (prefix, new, enc) in enumerate(zip(prefix_lens, new_lens, encoder_lens)):
        slots = req_to_token[i + 1, enc + prefix:enc + prefix + new].long()
        k_extend[starts[i]:starts[i] + new] = k_rows[slots].to(torch.bfloat16)
        v_extend[starts[i]:starts[i] + new] = v_rows[slots].to(torch.bfloat16)
    return dict(q_extend=q, k_extend=k_extend, v_extend=v_extend, k_buffer=k_buffer, v_buffer=v_buffer,
                k_scale=k_scale, v_scale=v_scale, req_to_token=req_to_token,
                req_pool_indices=torch.arange(1, batch + 1), seq_lens=torch.tensor(lengths),
                extend_seq_lens=torch.tensor(new_lens), extend_start_loc=starts,
                encoder_lens=torch.tensor(encoder_lens), k_rows=k_rows, v_rows=v_rows)


def extend_fp64(case, scale, logit_cap=0.0, is_cross_attn=False):
    """Each request's new tokens against its rows in the pool, in fp64, from the pool's dequantized rows."""
    q = case["q_extend"]
    out = torch.zeros(q.shape[0], q.shape[1], case["v_rows"].shape[-1], dtype=torch.float64)
    for i in range(len(case["seq_lens"])):
        start, new, length = (int(case[n][i]) for n in ("extend_start_loc", "extend_seq_lens", "seq_lens"))
        enc = int(case["encoder_lens"][i])
        slots = case["req_to_token"][int(case["req_pool_indices"][i])].long()
        rows = slots[:enc] if is_cross_attn else slots[enc:enc + length]
        k, v = (case[n][rows].transpose(0, 1)[None] for n in ("k_rows", "v_rows"))
        query = q[start:start + new].transpose(0, 1)[None]
        out[start:start + new] = attention_fp64(query, k, v, None, not is_cross_attn, scale, logit_cap)[0].transpose(0, 1)
    return out


def run_extend(case, scale, logit_cap=0.0, is_cross_attn=False):
    out = torch.full((case["q_extend"].shape[0], case["q_extend"].shape[1], case["v_buffer"].shape[-1]), float("nan"),
                     dtype=torch.bfloat16)
    torch.ops.mla.extend_attention(
        case["q_extend"], case["k_extend"], case["v_extend"], out, case["k_buffer"], case["v_buffer"],
        case["k_scale"], case["v_scale"], case["req_to_token"], case["req_pool_indices"], case["seq_lens"],
        case["extend_seq_lens"], case["extend_start_loc"], int(case["extend_seq_lens"].max()), scale, logit_cap,
        is_cross_attn, case["encoder_lens"])
    return out


@pytest.mark.parametrize(
    "prefix_lens, new_lens, heads, kv_heads, d, dv, buffer_heads, cache_dtype",
    [
        ([5, 0, 17], [7, 3, 1], 4, 2, 48, 32, None, torch.bfloat16),  # grouped heads, D != DV, a request with no prefix
        ([0, 0], [9, 4], 4, 4, 48, 32, 1, torch.bfloat16),  # MLA: one latent head in the buffers, new tokens only
        ([6], [5], 2, 1, 24, 24, 1, torch.bfloat16),  # MLA over a cached latent prefix
        ([4, 8], [3, 2], 2, 2, 32, 16, None, torch.float8_e4m3fn),  # fp8 pool with per-token scales
        ([4], [3], 2, 2, 32, 16, None, torch.float8_e5m2),
    ],
)
def test_extend_attention_matches_fp64(prefix_lens, new_lens, heads, kv_heads, d, dv, buffer_heads, cache_dtype):
    case = extend_case(prefix_lens, new_lens, heads, kv_heads, d, dv, buffer_heads, cache_dtype)
    out = run_extend(case, d**-0.5, logit_cap=0.0)
    torch.testing.assert_close(out.double(), extend_fp64(case, d**-0.5), atol=1e-2, rtol=1e-2)


def test_extend_attention_cross_attention_and_logit_cap():
    case = extend_case([2, 3], [4, 2], 2, 2, 16, 8, encoder_lens=[5, 3])
    for cross in (True, False):
        out = run_extend(case, 0.25, logit_cap=5.0, is_cross_attn=cross)
        torch.testing.assert_close(out.double(), extend_fp64(case, 0.25, 5.0, cross), atol=1e-2, rtol=1e-2)


def test_extend_attention_bad_arguments_are_named():
    case = extend_case([2], [3], 2, 2, 16, 8)
    with pytest.raises(ValueError, match="o_extend must be"):
        torch.ops.mla.extend_attention(
            case["q_extend"], case["k_extend"], case["v_extend"], torch.empty(3, 2, 9, dtype=torch.bfloat16),
            case["k_buffer"], case["v_buffer"], None, None, case["req_to_token"], case["req_pool_indices"],
            case["seq_lens"], case["extend_seq_lens"], case["extend_start_loc"], 3, 0.25)
    with pytest.raises(ValueError, match="does not fit"):
        torch.ops.mla.extend_attention(
            case["q_extend"], case["k_extend"], case["v_extend"], torch.empty(3, 2, 8, dtype=torch.bfloat16),
            case["k_buffer"], case["v_buffer"], None, None, case["req_to_token"], case["req_pool_indices"],
            case["seq_lens"], torch.tensor([9]), case["extend_start_loc"], 3, 0.25)
