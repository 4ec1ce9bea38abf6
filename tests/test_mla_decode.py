"""mla_decode: the op against per-request SDPA, its C++ template, the patterns (where they fire and
where not), real models."""

import functools

import expecttest
import pytest
import torch
import torch.nn.functional as F
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import mla_inductor
from mla_inductor.models import get_config, make_block_tables
from mla_inductor.models.hf import build_hf_model
from mla_inductor.ops.mla_decode import latent_decode_attention_dense

from graph_utils import fired, greedy, rewrite_and_run, rewritten

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
        if length == 0:  # attends to nothing: zeros, as the op defines it
            out.append(torch.zeros(q.shape[1], LORA if w_vc is None else w_vc.shape[1], dtype=torch.float64))
            continue
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
    attended = expected.flatten(1).abs().sum(-1) > 0  # requests without rows are zeros: no direction
    cos = F.cosine_similarity(actual.double().flatten(1)[attended], expected.flatten(1)[attended], dim=-1)
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


def masked_reference(q, dense, seq_lens, scale, bias):
    """Per request: fp64 softmax over its rows with an additive bias [batch, rows]; zeros where no row is
    admitted."""
    out = torch.zeros(q.shape[0], q.shape[1], LORA, dtype=torch.float64)
    for b, length in enumerate(seq_lens.tolist()):
        k = dense[b, :length].double()
        scores = q[b].double() @ k.T * scale + bias[b, :length].double()
        if length and torch.isfinite(scores).any():
            out[b] = torch.softmax(scores, dim=-1) @ k[:, :LORA]
    return out


def mask_case(dtype, shared=False):
    """A paged case with a mask per request: scattered holes, a request wholly excluded, and a tail past
    the last admitted row that holds NaN (it must never be read)."""
    q, cache, block_tables, lens, dense = paged_case(4, 6, [300, 140, 64, 1], 16, dtype, nan_beyond=True)
    g = torch.Generator().manual_seed(3)
    admit = torch.rand(4, block_tables.shape[1] * 16, generator=g) > 0.25
    admit[0, 200:] = False  # rows 200..299 are NaN in the cache below: past the last admitted row
    admit[2] = False
    admit[:, 0] = admit[:, 0] | torch.tensor([True, True, False, True])
    rows = cache.view(-1, LORA + ROPE)
    pos = torch.arange(200, 300)
    rows[block_tables[0, pos // 16] * 16 + pos % 16] = float("nan")
    if shared:
        admit = admit[:1].expand(4, -1)
    bias = torch.zeros(admit.shape).masked_fill(~admit, float("-inf"))
    return q, cache, block_tables, lens, dense, (admit[:1] if shared else admit), bias


@pytest.mark.parametrize("kind", ["bool", "additive", "shared bool"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mask_admits_rows_and_the_tail_past_the_last_admitted_row_is_never_read(kind, dtype):
    q, cache, block_tables, lens, dense, admit, bias = mask_case(dtype, shared=kind == "shared bool")
    expected = masked_reference(q, torch.nan_to_num(dense), lens, 0.05, bias)
    mask = admit if "bool" in kind else (bias + torch.randn(bias.shape) * 0.5).to(dtype)
    if kind == "additive":  # finite biases weigh rows too
        expected = masked_reference(q, torch.nan_to_num(dense), lens, 0.05, mask.float())
    out = op(q, cache, block_tables, lens, LORA, 0.05, attn_mask=mask)
    compiled, _ = run_template(compiled_op(scale=0.05), q, cache, block_tables, lens, attn_mask=mask)
    for actual in (out, compiled):
        assert torch.isfinite(actual).all(), "a NaN row past the last admitted one was read"
        assert kind == "shared bool" or (actual[2] == 0).all(), "a request the mask wholly excludes is not zeros"
        assert_matches(actual, expected, dtype)


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
        (dict(attn_mask=torch.ones(2, 11, dtype=torch.bool)), r"attn_mask must be \[2 or 1, 12\]"),
        (dict(attn_mask=torch.ones(2, 12, dtype=torch.int32)), "attn_mask must be bool or a float dtype"),
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
        (2, 32, [300, 129], 16, torch.bfloat16),  # head tiles past the fourth take no share of the prefetch
        (2, 40, [300, 129], 16, torch.bfloat16),  # on AMX tiles three groups of 14 heads, the last with 12
        # each block size once, each dtype (block size and dtype meet nowhere in the kernel)
        *[(8, 16, [1, 15, 16, 17, 64, 100, 33, 7], bs, dt)
          for bs, dt in ((1, torch.bfloat16), (16, torch.float32), (64, torch.bfloat16))],
    ],
)
def test_template_matches_per_request_sdpa_and_never_reads_past_seq_len(batch, heads, seq_lens, block_size, dtype):
    q, cache, block_tables, lens, dense = paged_case(batch, heads, seq_lens, block_size, dtype)
    scale = (LORA + ROPE) ** -0.5
    out, _ = run_template(compiled_op(scale=scale), q, cache, block_tables, lens)
    assert torch.isfinite(out).all(), "a NaN row past seq_len was read"
    assert_matches(out, sdpa_reference(q, dense, lens, scale), dtype)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_template_keeps_a_nan_in_an_attended_row(cache_dtype):
    """A NaN in a row a request attends makes every head of it NaN, as in SDPA: in the first block, where
    the running max starts at -inf (a NaN max must not read as a block of -inf scores, skipped), and in
    a later one through the rope columns alone. The other requests are untouched."""
    q, cache, block_tables, lens, dense = paged_case(3, 16, [300, 129, 50], 16, torch.bfloat16)
    kv_scale = None
    if cache_dtype != torch.bfloat16:
        cache, kv_scale, values = fp8_cache(cache, cache_dtype, per_row=True)
        positions = torch.arange(300)
        dense = values.view(-1, LORA + ROPE)[block_tables[:, positions // 16] * 16 + positions % 16]
    rows = cache.view(-1, LORA + ROPE)
    rows[block_tables[0, 0] * 16 + 3, 7] = float("nan")  # request 0, row 3: a latent column (key and value)
    rows[block_tables[1, 8] * 16 + 0, LORA + 5] = float("nan")  # request 1, row 128: a rope column
    tensors = {} if kv_scale is None else {"kv_scale": kv_scale}
    out, _ = run_template(compiled_op(scale=0.07), q, cache, block_tables, lens, **tensors)
    assert out[:2].isnan().all() and not out[2].isnan().any()
    assert_matches(out[2:], sdpa_reference(q[2:], dense[2:], lens[2:], 0.07), torch.bfloat16)
    eager = op(q, cache, block_tables, lens, LORA, 0.07, **tensors)
    assert eager[:2].isnan().all()


def test_template_on_two_threads_merges_every_split():
    """The suite runs one thread per worker; the template's num_threads is fixed at compile time, so
    compile one on two threads: tasks of several splits run concurrently and merge after the barrier."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q, cache, block_tables, lens, dense = paged_case(3, 7, [700, 1, 300], 16, torch.bfloat16)
        w_vc = (torch.randn(7, 24, LORA) * LORA**-0.5).to(torch.bfloat16)
        fn = torch.compile(lambda q, c, t, n, w: op(q, c, t, n, LORA, 0.07, w_vc=w), backend="mla_inductor")
        out, code = run_template(fn, q, cache, block_tables, lens, w_vc)
    finally:
        torch.set_num_threads(threads)
    assert "num_threads(2)" in code
    assert_matches(out, sdpa_reference(q, dense, lens, 0.07, w_vc), torch.bfloat16)


def test_one_request_on_two_threads_splits_and_merges():
    """One request of 200 rows on two threads: fewer requests than threads split it into blocks (128 +
    72 rows) rather than leave a thread idle."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q, cache, block_tables, lens, dense = paged_case(1, 5, [200], 16, torch.bfloat16)
        fn = torch.compile(lambda q, c, t, n: op(q, c, t, n, LORA, 0.07), backend="mla_inductor")
        out, code = run_template(fn, q, cache, block_tables, lens)
    finally:
        torch.set_num_threads(threads)
    assert "num_threads(2)" in code
    assert_matches(out, sdpa_reference(q, dense, lens, 0.07), torch.bfloat16)


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


def test_template_serves_dynamic_shapes_by_specializing_heads_and_widths():
    """Under dynamic=True heads and row widths are symbols; the template guards on them and serves."""
    fn = torch.compile(lambda q, cache, tables, lens: op(q, cache, tables, lens, LORA, 0.05), backend="mla_inductor",
                       dynamic=True)
    q, cache, block_tables, lens, dense = paged_case(3, 5, [7, 90, 33], 16, torch.bfloat16)  # no two sizes equal: duck sizing would tie them
    out, _ = run_template(fn, q, cache, block_tables, lens)
    assert_matches(out, sdpa_reference(q, dense, lens, 0.05), torch.bfloat16)
    # Another batch, block size and cache size: the same compiled code.
    graphs = counters["stats"]["unique_graphs"]
    q, cache, block_tables, lens, dense = paged_case(2, 5, [40, 9], 4, torch.bfloat16)
    out = fn(q, cache, block_tables, lens)
    assert counters["stats"]["unique_graphs"] == graphs
    assert_matches(out, sdpa_reference(q, dense, lens, 0.05), torch.bfloat16)


@functools.cache
def dynamic_compiled_op():
    return torch.compile(lambda q, cache, tables, lens: op(q, cache, tables, lens, LORA, 0.05),
                         backend="mla_inductor", dynamic=True)


@settings(max_examples=20, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 300), min_size=2, max_size=5),
    block_size=st.sampled_from([1, 3, 16, 64]),
    q_row_pad=st.sampled_from([0, 8]),
    seed=st.integers(0, 2**16),
)
def test_template_over_lengths_block_sizes_and_query_strides(lengths, block_size, q_row_pad, seed):
    q, cache, block_tables, lens, dense = paged_case(len(lengths), 5, [max(n, 1) for n in lengths], block_size,
                                                     torch.bfloat16, seed=seed)
    lens = torch.tensor(lengths)  # zero lengths too: those requests attend to nothing
    if q_row_pad:  # heads q_row_pad elements apart in memory: a strided view, as a cat would leave it
        q = torch.nn.functional.pad(q, (0, q_row_pad))[..., : LORA + ROPE]
    # Equal sizes must not force recompiles; sizes of 1 and the q strides still do (a few graphs): keep
    # them under the limit, past which Dynamo would silently run eager and the template go untested.
    with torch.fx.experimental._config.patch(use_duck_shape=False), torch._dynamo.config.patch(recompile_limit=32):
        out = dynamic_compiled_op()(q, cache, block_tables, lens)
    assert torch.isfinite(out).all(), "a NaN row past seq_len was read"
    assert_matches(out, sdpa_reference(q, dense, lens, 0.05), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_template_odd_widths_take_the_portable_paths(dtype):
    """A latent width that is no multiple of 32 (P.V in fp32 FMAs) and a key width that is no multiple
    of 32 either (masked tail of the score tile), with W_vc: 6 requests and 7 output columns make
    partial de-absorption tiles (of 4 requests x 4 columns) in both directions."""
    lora, rope, heads = 40, 13, 3
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(24, 5, lora + rope, generator=g).to(dtype)
    q = torch.randn(6, heads, lora + rope, generator=g).to(dtype)
    tables = torch.randperm(24, generator=g).view(6, 4)
    lens = torch.tensor([17, 1, 20, 9, 0, 11])
    w_vc = torch.randn(heads, 7, lora, generator=g).to(dtype)
    expected = op(q, cache, tables, lens, lora, 0.1, w_vc=w_vc)
    fn = torch.compile(lambda q, c, t, n, w: op(q, c, t, n, lora, 0.1, w_vc=w), backend="mla_inductor")
    out, _ = run_template(fn, q, cache, tables, lens, w_vc)
    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


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


def fp8_cache(cache, dtype, per_row):
    """The cache in fp8 with its kv_scale (per row [num_blocks, block_size, 1] or per tensor [1]; e5m2
    without one), and its values (the fp8 values times the scale) for the reference."""
    if dtype == torch.float8_e5m2:
        quantized = cache.to(dtype)
        return quantized, None, quantized.float()
    absmax = cache.float().nan_to_num().abs().amax(-1, keepdim=True) if per_row else cache.float().nan_to_num().abs().amax().view(1)
    scale = absmax.clamp_min(1e-12) / torch.finfo(dtype).max
    quantized = (cache.float() / scale).to(dtype)
    return quantized, scale, quantized.float() * scale


def test_fp8_rows_are_read_exactly_for_every_finite_value():
    """Every finite value of both fp8 formats in one latent row, attended alone by 16 heads (on an AMX
    CPU: the tile path, which converts the row to bf16 by table lookup; elsewhere the widening): the
    output is that row, exactly. (NaN and infinity cannot be keys here: their scores would be NaN.)"""
    torch._dynamo.reset()
    fn = torch.compile(lambda q, e4m3, e5m2, tables, lens: (op(q, e4m3, tables, lens, LORA, 0.1),
                                                            op(q, e5m2, tables, lens, LORA, 0.1)),
                       backend="mla_inductor", dynamic=False)
    caches, expected = [], []
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        values = torch.arange(256, dtype=torch.uint8).view(dtype)
        finite = values[torch.isfinite(values.float())]
        cache = torch.zeros(1, 16, LORA + ROPE, dtype=dtype)
        cache[0, 0, :finite.numel()] = finite
        caches.append(cache)
        expected.append(cache[0, 0, :LORA].float().expand(1, 16, LORA))
    q = torch.zeros(1, 16, LORA + ROPE, dtype=torch.bfloat16)
    outs = fn(q, *caches, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1]))
    for out, exact in zip(outs, expected):
        torch.testing.assert_close(out.float(), exact, atol=0, rtol=0)


@pytest.mark.parametrize("cache_dtype, per_row", [(torch.float8_e4m3fn, True), (torch.float8_e4m3fn, False),
                                                  (torch.float8_e5m2, False)])
def test_fp8_cache_reads_its_values_eager_and_compiled(cache_dtype, per_row):
    """An fp8 latent cache (DeepSeek's 22 heads, blocks of 16, NaN past every length): both the eager
    op and the template attend over the cache's values, dequantized in fp32 (to bf16 accuracy), in one
    cache of rows of 576 and with a separate k_pe cache that shares its rows' scales (on an AMX CPU both
    are converted a 32-column step at a time, the k_pe columns from their own rows). Compiled for per-row
    e4m3 only (the widening of both formats is exact in test_gqa_decode.py and
    test_fp8_rows_are_read_exactly_for_every_finite_value, a per-tensor scale is a stride of 0)."""
    q, cache, block_tables, lens, _ = paged_case(3, 22, [300, 1, 129], 16, torch.bfloat16)
    quantized, kv_scale, values = fp8_cache(cache, cache_dtype, per_row)
    positions = torch.arange(300)
    dense = values.view(-1, LORA + ROPE)[block_tables[:, positions // 16] * 16 + positions % 16]
    expected = sdpa_reference(q, dense, lens, 0.07)
    eager = op(q, quantized, block_tables, lens, LORA, 0.07, kv_scale=kv_scale)
    assert_matches(eager, expected, torch.bfloat16)
    if not per_row or cache_dtype != torch.float8_e4m3fn:
        return
    latent, rope = quantized[..., :LORA].contiguous(), quantized[..., LORA:].contiguous()
    for kv_cache, rope_cache in ((quantized, {}), (latent, dict(rope_cache=rope))):
        out, code = run_template(compiled_op(scale=0.07), q, kv_cache, block_tables, lens, **rope_cache,
                                 kv_scale=kv_scale)
        assert "using cache_t = at::Float8_e" in code
        assert torch.isfinite(out).all(), "a NaN row past seq_len was read"
        assert_matches(out, expected, torch.bfloat16)


def test_fp8_cache_at_a_few_heads_a_rank():
    """Four heads (DeepSeek-V3 over 32 ranks): one score tile holds them all, so on AVX512-BF16 CPUs with
    VBMI and without AMX (Zen 4, Zen 5) the dpbf16 tiles read the fp8 rows where they lie, converting them
    in registers (elsewhere the FMA tiles widen them). One compile: e4m3 with per-row scales, its k_pe in
    a cache of its own, and e5m2 in one cache, NaN past every length, against fp64."""
    q, cache, block_tables, lens, _ = paged_case(3, 4, [300, 1, 129], 16, torch.bfloat16, seed=4)
    e4m3, e4m3_scale, e4m3_values = fp8_cache(cache, torch.float8_e4m3fn, per_row=True)
    e5m2, _, e5m2_values = fp8_cache(cache, torch.float8_e5m2, per_row=False)
    latent, rope = e4m3[..., :LORA].contiguous(), e4m3[..., LORA:].contiguous()
    fn = torch.compile(lambda q, latent, rope, scale, e5m2, tables, lens: (
        op(q, latent, tables, lens, LORA, 0.07, rope_cache=rope, kv_scale=scale),
        op(q, e5m2, tables, lens, LORA, 0.07)), backend="mla_inductor", dynamic=False)
    outs, code = run_template(fn, q, latent, rope, e4m3_scale, e5m2, block_tables, lens)
    assert "using cache_t = at::Float8_e4m3fn" in code and "using cache_t = at::Float8_e5m2" in code
    positions = torch.arange(300)
    for out, values in zip(outs, (e4m3_values, e5m2_values)):
        dense = values.view(-1, LORA + ROPE)[block_tables[:, positions // 16] * 16 + positions % 16]
        assert torch.isfinite(out).all(), "a NaN row past seq_len was read"
        assert_matches(out, sdpa_reference(q, dense, lens, 0.07), torch.bfloat16)


@pytest.mark.parametrize("change, message", [
    (dict(kv_scale=torch.ones(1)), "kv_scale dequantizes an fp8 kv_cache; kv_cache is torch.float32"),
    (dict(kv_cache=torch.float8_e4m3fn, kv_scale=torch.ones(5, 4)), r"kv_scale must broadcast against kv_cache's rows"),
    (dict(kv_cache=torch.float8_e4m3fn, new_rows=torch.zeros(2, 576), slots=torch.tensor([0, 1])),
     "new_rows cannot be written into an fp8 kv_cache"),
    (dict(kv_cache=torch.float8_e4m3fn, rope_cache=torch.zeros(5, 4, 64)), "rope_cache must be torch.float8_e4m3fn"),
])
def test_bad_fp8_cache_arguments_name_the_argument(change, message):
    q, cache, block_tables, lens, _ = paged_case(2, 3, [12, 5], 4, torch.float32, nan_beyond=False)
    change = dict(change)
    if "kv_cache" in change:
        cache = cache.to(change.pop("kv_cache"))
        if "rope_cache" in change:
            cache = cache[..., :LORA].contiguous()
    with pytest.raises(ValueError, match=message):
        op(q, cache, block_tables, lens, LORA, 0.1, **change)


# --- the patterns ----------------------------------------------------------------------------------


def serving_decode(q, kv_cache, block_tables, seq_lens, w_vc, scale=0.125, inclusive=False):
    """Absorbed decode as serving code writes it (models/mla.py); `inclusive` attends one row too many."""
    kv = kv_cache[block_tables].flatten(1, 2)
    c, k_pe = kv[..., :LORA_SMALL], kv[..., LORA_SMALL:]
    scores = torch.bmm(q[..., :LORA_SMALL], c.transpose(1, 2)) + torch.bmm(q[..., LORA_SMALL:], k_pe.transpose(1, 2))
    scores = scores.float() * scale
    rows = torch.arange(kv.shape[1])[None, :]
    valid = rows <= seq_lens[:, None] if inclusive else rows < seq_lens[:, None]
    probs = torch.softmax(scores.masked_fill(~valid[:, None, :], float("-inf")), dim=-1).to(c.dtype)
    o = torch.bmm(probs, c)
    return torch.bmm(o.transpose(0, 1), w_vc.transpose(1, 2)).transpose(0, 1) * 2


LORA_SMALL = 32


def serving_inputs(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    block_tables, num_blocks = make_block_tables(2, 24, 8, seed=0)
    cache = torch.randn(num_blocks, 8, LORA_SMALL + 16, generator=g).to(dtype)
    q = torch.randn(2, 3, LORA_SMALL + 16, generator=g).to(dtype)
    w_vc = torch.randn(3, 8, LORA_SMALL, generator=g).to(dtype)
    return q, cache, block_tables, torch.tensor([5, 24]), w_vc


class TestRewrite(expecttest.TestCase):
    def test_serving_decode_joint(self):
        graph = rewritten(serving_decode, *serving_inputs())
        self.assertExpectedInline(graph, """\
latent_decode_attention_default = mla.latent_decode_attention(arg2_1, arg0_1, arg1_1, arg3_1, 32, 0.125, 0.0, None, None, arg4_1)
permute_default = permute(latent_decode_attention_default, [1, 0, 2])
permute_4 = permute(permute_default, [1, 0, 2])
mul_1 = mul.Tensor(permute_4, 2)""")

    def test_a_mask_past_the_length_passes_to_the_op_as_the_mask(self):
        """The paged pattern reads seq_lens rows and must decline a mask that admits one more; the
        anchored match takes the mask itself (seq_lens then cover every row), so the numbers hold."""
        inclusive = functools.partial(serving_decode, inclusive=True)
        inputs = serving_inputs(torch.float32)
        out, events = rewrite_and_run(inclusive, *inputs)
        self.assertEqual(fired(events, "mla_decode"), 1)
        torch.testing.assert_close(out, inclusive(*inputs), atol=1e-5, rtol=1e-5)
        graph = rewritten(inclusive, *serving_inputs())
        op = next(line for line in graph.splitlines() if "latent_decode_attention(" in line)
        self.assertTrue(op.rstrip(")").split(", ")[-1].startswith("logical_not"), op)  # attn_mask: the model's

    def test_not_when_switched_off(self):
        graph = rewritten(serving_decode, *serving_inputs(), fusions={"mla_decode": False})
        self.assertNotIn("latent_decode_attention", graph)


# --- real models -----------------------------------------------------------------------------------


# The serving model's decode (models/mla.py) is compiled once per shape mode for all of its fusions:
# mla_decode is asserted there, static in test_qkv_a.py, dynamic with and without freezing in test_q_b_absorb.py.


def hf_case(arch, dtype, batch, prompt_len=12, hf_overrides=None, **overrides):
    """`overrides` change our config, `hf_overrides` the transformers config built from it."""
    config = get_config("tiny", num_layers=2, **overrides)
    model = build_hf_model(config, arch=arch, dtype=dtype, **(hf_overrides or {}))
    prompt = torch.randint(0, config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    return config, model, prompt


def eager_and_compiled(model, prompt, make_cache, steps):
    """Greedy decoding in eager and with mla_inductor, each from its own fresh cache."""
    torch._dynamo.reset()  # the step below is one code object for all tests: no shapes carried over
    expected = greedy(model, make_cache(), prompt, steps)
    cache = make_cache()
    compiled = torch.compile(
        lambda ids, pos: model(input_ids=ids, past_key_values=cache, position_ids=pos).logits, backend="mla_inductor"
    )
    return expected, greedy(model, cache, prompt, steps, step_fn=compiled)


def test_transformers_v3_static_cache_fp32_tokens_equal_eager_and_fire_again_once_shapes_turn_dynamic():
    """fp32 greedy tokens equal eager's with every layer fused; then the compiled step sees a second
    batch size and recompiles with dynamic shapes (automatic dynamic): the StaticCache pattern must fire
    there too."""
    config, model, _ = hf_case("v3", torch.float32, batch=2)
    torch._dynamo.reset()
    state = {}
    compiled = torch.compile(
        lambda ids, pos: model(input_ids=ids, past_key_values=state["cache"], position_ids=pos).logits,
        backend="mla_inductor",
    )
    for batch, steps in ((2, 16), (3, 2)):
        prompt = torch.randint(0, config.vocab_size, (batch, 12), generator=torch.Generator().manual_seed(batch))
        expected_tokens, expected = greedy(model, transformers.StaticCache(config=model.config, max_cache_len=48),
                                           prompt, steps=steps)
        state["cache"] = transformers.StaticCache(config=model.config, max_cache_len=48)
        tokens, logits = greedy(model, state["cache"], prompt, steps=steps, step_fn=compiled)
        if batch == 2:  # the static graph
            assert_whole_layer_fused(mla_inductor.fusion_counts(), config.num_layers)
            assert torch.equal(tokens, expected_tokens)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert mla_inductor.fusion_counts()["mla_decode"] == 2 * config.num_layers  # the static and the dynamic graph


def assert_whole_layer_fused(counts, layers, q_lora=True):
    """Per layer: qkv_a_proj rotating k_pe, latent attention and, with a q LoRA, q_b_absorb for its query
    (without one, q_proj is part of qkv_a_proj and the absorption stays a bmm)."""
    assert counts["mla_decode"] == counts["qkv_a_proj"] == layers, counts
    assert counts["q_b_absorb"] == counts["qkv_proj_with_rope"] == (layers if q_lora else 0), counts
    assert counts["rope"] == 2 * layers, counts  # q_pe and k_pe


def test_transformers_v3_rotate_half_static_cache_fp32_greedy_tokens_equal_eager():
    """DeepseekV3 with rope_interleave=False (rotate_half); the interleaved default: above."""
    config, model, prompt = hf_case("v3", torch.float32, batch=2, hf_overrides={"rope_interleave": False})
    make_cache = lambda: transformers.StaticCache(config=model.config, max_cache_len=48)  # noqa: E731
    (expected_tokens, expected_logits), (tokens, logits) = eager_and_compiled(model, prompt, make_cache, steps=16)
    assert_whole_layer_fused(mla_inductor.fusion_counts(), config.num_layers)
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("q_lora", [False, True], ids=["v2_lite", "q_lora"])
def test_transformers_v2_static_cache_bf16_batch_1_logits_within_tolerance(q_lora):
    """DeepseekV2: complex rope. V2-Lite has no q LoRA; with one, the query is absorbed by q_b_absorb."""
    config, model, prompt = hf_case("v2", torch.bfloat16, batch=1, **({} if q_lora else {"q_lora_rank": None}))
    make_cache = lambda: transformers.StaticCache(config=model.config, max_cache_len=40)  # noqa: E731
    (_, expected_logits), (_, logits) = eager_and_compiled(model, prompt, make_cache, steps=4)
    assert_whole_layer_fused(mla_inductor.fusion_counts(), config.num_layers, q_lora=q_lora)
    torch.testing.assert_close(logits, expected_logits, atol=5e-2, rtol=2e-2)


def test_transformers_v2_dynamic_cache_bf16_fires_in_static_and_dynamic_length_graphs():
    config, model, prompt = hf_case("v2", torch.bfloat16, batch=1, q_lora_rank=None)
    make_cache = lambda: transformers.DynamicCache(config=model.config)  # noqa: E731
    (_, expected_logits), (_, logits) = eager_and_compiled(model, prompt, make_cache, steps=4)
    # The first step compiles for its length, the second recompiles with a dynamic one: both rewritten.
    assert mla_inductor.fusion_counts()["mla_decode"] == 2 * config.num_layers
    torch.testing.assert_close(logits, expected_logits, atol=5e-2, rtol=2e-2)


def test_transformers_generate_with_a_static_cache_and_a_padded_batch_fires_and_equals_eager():
    """What users run: `generate` with a StaticCache, whose 4-D mask arrives as an input of the compiled
    step, on a left-padded batch (a mask that is no prefix of the cache), fp32: same tokens as eager."""
    _, model, _ = hf_case("v3", torch.float32, batch=2)
    prompt = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    attention_mask = torch.ones_like(prompt)
    attention_mask[1, :4] = 0
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                  cache_implementation="static")
    torch._dynamo.reset()
    mla_inductor.reset_counts()
    with torch.no_grad():
        expected = model.generate(prompt, **kwargs)
        forward = model.forward
        model.forward = torch.compile(forward, backend="mla_inductor")
        try:
            tokens = model.generate(prompt, **kwargs)
        finally:
            model.forward = forward
    assert mla_inductor.fusion_counts()["mla_decode"] == model.config.num_hidden_layers  # the decode graph
    assert torch.equal(tokens, expected)
