"""mla::latent_decode_attention: the op's reference against per-request SDPA, paging, bounds, bad input."""

import pytest
import torch
import torch.nn.functional as F

from torch._inductor.utils import run_and_get_code

from mla_inductor.models import make_block_tables
from mla_inductor.ops.mla_decode import latent_decode_attention_dense

op = torch.ops.mla.latent_decode_attention
LORA, ROPE = 512, 64
TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 1e-4}


def paged_case(batch, heads, seq_lens, block_size, dtype, seed=0, nan_beyond=True):
    """q, a paged cache holding each request's rows (NaN in every row that is not valid) and a
    dense copy of the valid rows for the reference."""
    g = torch.Generator().manual_seed(seed)
    max_len = max(seq_lens)
    block_tables, num_blocks = make_block_tables(batch, max_len, block_size, seed=seed, spare_blocks=2)
    cache = torch.full((num_blocks, block_size, LORA + ROPE), float("nan") if nan_beyond else 0.0)
    dense = torch.randn(batch, max_len, LORA + ROPE, generator=g)
    rows = cache.view(-1, LORA + ROPE)
    for b, length in enumerate(seq_lens):
        pos = torch.arange(length)
        rows[block_tables[b, pos // block_size] * block_size + pos % block_size] = dense[b, :length]
    q = torch.randn(batch, heads, LORA + ROPE, generator=g)
    return q.to(dtype), cache.to(dtype), block_tables, torch.tensor(seq_lens), dense.to(dtype)


def sdpa_reference(q, dense, seq_lens, scale, w_vc=None):
    """Per request: SDPA of H query heads over one shared latent key/value head, in fp64."""
    out = []
    for b, length in enumerate(seq_lens.tolist()):
        k = dense[b, :length].double()[None, None]  # [1, 1, T, D]
        v = k[..., :LORA]
        o = F.scaled_dot_product_attention(q[b].double()[None, :, None], k, v, scale=scale, enable_gqa=True)
        o = o[0, :, 0]  # [H, LORA]
        if w_vc is not None:
            o = torch.einsum("hl,hvl->hv", o, w_vc.double())
        out.append(o)
    return torch.stack(out)


def assert_matches(actual, expected, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double(), expected, atol=tol, rtol=tol)
    cos = F.cosine_similarity(actual.double().flatten(1), expected.flatten(1), dim=-1)
    assert (cos > 0.99).all()


@pytest.mark.parametrize(
    "batch, heads, seq_lens",
    [(1, 22, [888]), (4, 22, [1024] * 4), (8, 16, [1, 15, 16, 17, 64, 100, 33, 7])],
)
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_per_request_sdpa_and_never_reads_past_seq_len(batch, heads, seq_lens, block_size, dtype):
    q, cache, block_tables, lens, dense = paged_case(batch, heads, seq_lens, block_size, dtype)
    scale = (LORA + ROPE) ** -0.5
    out = op(q, cache, block_tables, lens, LORA, scale)
    assert torch.isfinite(out).all(), "a NaN row past seq_len was read"
    assert_matches(out, sdpa_reference(q, dense, lens, scale), dtype)


def test_de_absorption_and_dense_form():
    q, cache, block_tables, lens, dense = paged_case(2, 4, [40, 9], 16, torch.float32, nan_beyond=False)
    w_vc = torch.randn(4, 128, LORA) * LORA**-0.5
    expected = sdpa_reference(q, dense, lens, 0.1, w_vc)
    assert_matches(op(q, cache, block_tables, lens, LORA, 0.1, w_vc=w_vc), expected, torch.float32)
    assert_matches(latent_decode_attention_dense(q, dense, lens, LORA, 0.1, w_vc=w_vc), expected, torch.float32)


def test_new_row_is_written_before_it_is_attended():
    q, cache, block_tables, lens, dense = paged_case(2, 4, [20, 33], 16, torch.float32, nan_beyond=False)
    new = torch.randn(2, LORA + ROPE)
    positions = lens  # the new token's position; it is counted in the lengths passed below
    slots = block_tables.gather(1, (positions // 16)[:, None]).squeeze(1) * 16 + positions % 16
    out = op(q, cache, block_tables, lens + 1, LORA, 0.1, new_rows=new, slots=slots)
    torch.testing.assert_close(cache.view(-1, LORA + ROPE)[slots], new)
    dense_with_new = torch.cat([dense, torch.zeros(2, 1, LORA + ROPE)], dim=1)
    for b in range(2):
        dense_with_new[b, lens[b]] = new[b]
    assert_matches(out, sdpa_reference(q, dense_with_new, lens + 1, 0.1), torch.float32)


def test_softcap_and_empty_requests():
    q, cache, block_tables, lens, dense = paged_case(2, 3, [12, 5], 4, torch.float32, nan_beyond=False)
    capped = op(q, cache, block_tables, lens, LORA, 1.0, softcap=2.0)
    for b in range(2):
        scores = q[b].double() @ dense[b, : lens[b]].double().T
        p = torch.softmax(2.0 * torch.tanh(scores / 2.0), dim=-1)
        torch.testing.assert_close(capped[b].double(), p @ dense[b, : lens[b], :LORA].double(), atol=1e-4, rtol=1e-4)
    empty = op(q, cache, block_tables, torch.tensor([0, 5]), LORA, 1.0)
    assert (empty[0] == 0).all() and (empty[1] != 0).any()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(q=torch.zeros(2, 3, 100)), r"kv_cache must be \[num_blocks, block_size, 100\]"),
        (dict(seq_lens=torch.tensor([12, 99])), r"seq_lens must be in \[0, 12\]"),
        (dict(block_tables=torch.full((2, 3), 50)), r"block_tables\[0\] names blocks outside"),
        (dict(seq_lens=torch.tensor([1.0, 2.0])), "seq_lens must be an integer"),
        (dict(kv_lora_rank=577), r"kv_lora_rank must be in \(0, 576\]"),
        (dict(rope_cache=torch.zeros(5, 4, 64)), r"kv_cache must be \[num_blocks, block_size, 512\] to match q and rope_cache"),
        (dict(scale_tensor=torch.tensor([1.0])), "scale_tensor must be a 0-d floating tensor"),
        (dict(new_rows=torch.zeros(2, 576)), "new_rows and slots go together"),
        (dict(new_rows=torch.zeros(2, 576), slots=torch.tensor([0, 10**6])), "slots must be in"),
        (dict(w_vc=torch.zeros(3, 128, 500)), r"w_vc must be torch.float32\[3, v_head_dim, 512\]"),
        (dict(softcap=-1.0), "softcap must be >= 0"),
    ],
)
def test_bad_input_raises_naming_the_argument(change, message):
    q, cache, block_tables, lens, _ = paged_case(2, 3, [12, 5], 4, torch.float32, nan_beyond=False)
    args = dict(q=q, kv_cache=cache, block_tables=block_tables, seq_lens=lens, kv_lora_rank=LORA, scale=0.1)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        op(**args)


# --- the C++ template against the reference -------------------------------------------------------

_compiled = {}


def compiled_op(**static):
    """The op compiled alone with mla_inductor, one compile per distinct set of static arguments."""
    key = tuple(sorted(static.items()))
    if key not in _compiled:
        _compiled[key] = torch.compile(
            lambda q, cache, tables, lens, **tensors: op(q, cache, tables, lens, LORA, **static, **tensors),
            backend="mla_inductor",
            dynamic=False,
        )
    return _compiled[key]


def run_template(fn, *args, **kwargs):
    out, (code,) = run_and_get_code(fn, *args, **kwargs)
    assert "mi::attend_split" in code and "torch.ops.mla" not in code, "the template did not serve"
    return out, code


@pytest.mark.parametrize(
    "batch, heads, seq_lens, block_size, dtype",
    [
        (1, 22, [888], 1, torch.bfloat16),
        (4, 22, [1024] * 4, 16, torch.bfloat16),
        *[(8, 16, [1, 15, 16, 17, 64, 100, 33, 7], bs, dt) for bs in (1, 16, 64) for dt in (torch.bfloat16, torch.float32)],
    ],
)
def test_template_matches_per_request_sdpa_and_never_reads_past_seq_len(batch, heads, seq_lens, block_size, dtype):
    q, cache, block_tables, lens, dense = paged_case(batch, heads, seq_lens, block_size, dtype)
    scale = (LORA + ROPE) ** -0.5
    out, _ = run_template(compiled_op(scale=scale), q, cache, block_tables, lens)
    assert torch.isfinite(out).all(), "a NaN row past seq_len was read"
    assert_matches(out, sdpa_reference(q, dense, lens, scale), dtype)


def test_template_de_absorbs_writes_the_new_row_and_caps():
    q, cache, block_tables, lens, dense = paged_case(3, 5, [20, 33, 0], 16, torch.bfloat16)
    new = torch.randn(3, LORA + ROPE).to(torch.bfloat16)
    slots = block_tables.gather(1, (lens // 16)[:, None]).squeeze(1) * 16 + lens % 16
    w_vc = (torch.randn(5, 128, LORA) * LORA**-0.5).to(torch.bfloat16)
    expected_cache = cache.clone()
    expected = op(q, expected_cache, block_tables, lens + 1, LORA, 0.05, 3.0, new_rows=new, slots=slots, w_vc=w_vc)
    out, _ = run_template(compiled_op(scale=0.05, softcap=3.0), q, cache, block_tables, lens + 1, new_rows=new,
                          slots=slots, w_vc=w_vc)
    torch.testing.assert_close(cache, expected_cache, equal_nan=True)
    assert_matches(out, expected.double(), torch.bfloat16)


def test_template_rejects_bad_lengths_and_blocks():
    q, cache, block_tables, lens, _ = paged_case(2, 3, [12, 5], 4, torch.float32)
    fn = compiled_op(scale=0.1)
    with pytest.raises(RuntimeError, match=r"seq_lens\[1\] = 99 is outside \[0, 12\]"):
        fn(q, cache, block_tables, torch.tensor([12, 99]))
    with pytest.raises(RuntimeError, match=r"block_tables\[0, 0\] = 50 names a block outside"):
        fn(q, cache, torch.full_like(block_tables, 50), lens)


def test_separate_rope_cache_equals_the_joint_rows():
    """transformers keeps c_kv and k_pe in two caches; the op reads them as one row without a copy."""
    q, cache, block_tables, lens, dense = paged_case(3, 5, [40, 9, 1], 16, torch.bfloat16, nan_beyond=False)
    latent, rope = cache[..., :LORA].contiguous(), cache[..., LORA:].contiguous()
    expected = op(q, cache, block_tables, lens, LORA, 0.05)
    torch.testing.assert_close(op(q, latent, block_tables, lens, LORA, 0.05, rope_cache=rope), expected)
    out, _ = run_template(compiled_op(scale=0.05), q, latent, block_tables, lens, rope_cache=rope)
    assert_matches(out, expected.double(), torch.bfloat16)
