"""rope: the mla::rotary_embedding op (SGLang's contract), mla::apply_rope (model code's rotation),
their C++ templates, and the patterns that find each spelling of RoPE in model code."""

import functools

import expecttest
import pytest
import torch
from torch._inductor.utils import run_and_get_code

import mla_inductor
from graph_utils import rewritten, rewritten_and_run
from mla_inductor.models import get_config
from mla_inductor.models.hf import build_hf_model
from mla_inductor.ops.rope import apply_rope_fp64, reference_fp64

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-4}
op = torch.ops.mla.rotary_embedding

# (positions shape, query shape, key shape, head_size, rotary_dim): the layouts SGLang's kernel takes
LAYOUTS = {
    "2d": ((7,), (7, 4 * 64), (7, 1 * 64), 64, 64),
    "3d_deepseek": ((5,), (5, 22, 64), (5, 1, 64), 64, 64),
    "4d": ((2, 3), (2, 3, 4, 128), (2, 3, 2, 128), 128, 128),
    "partial": ((6,), (6, 3, 80), (6, 2, 80), 80, 40),  # rotary_dim < head_size, tails of both loops
}


def make_inputs(layout, dtype, seed=0, max_positions=50):
    pos_shape, q_shape, k_shape, _, rotary_dim = LAYOUTS[layout]
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, max_positions, pos_shape, generator=g)
    query = torch.randn(q_shape, generator=g).to(dtype)
    key = torch.randn(k_shape, generator=g).to(dtype)
    cos_sin_cache = torch.randn(max_positions, rotary_dim, generator=g)  # not a real table: any values rotate
    return positions, query, key, cos_sin_cache


def assert_matches_fp64(outputs, positions, query, key, head_size, cache, is_neox):
    tol = TOLERANCE[query.dtype]
    for out, x in zip(outputs, (query, key)):
        assert out.shape == x.shape and out.dtype == x.dtype
        torch.testing.assert_close(out.double(), reference_fp64(positions, x, head_size, cache, is_neox),
                                   atol=tol, rtol=tol)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("is_neox", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_op_matches_fp64_definition(layout, is_neox, dtype):
    positions, query, key, cache = make_inputs(layout, dtype)
    head_size = LAYOUTS[layout][3]
    assert_matches_fp64(op(positions, query, key, head_size, cache, is_neox), positions, query, key, head_size,
                        cache, is_neox)


# SGLang's kernel takes positions flat ([B * S]) for [B, S, ...] tensors too (its tests call it so).
FLAT_POSITIONS = {
    "4d_flat": ((6,), (2, 3, 4, 128), (2, 3, 2, 128), 128, 64),
    "3d_batch_seq_flat": ((6,), (2, 3, 4 * 64), (2, 3, 64), 64, 64),
}


@pytest.mark.parametrize("layout", sorted(FLAT_POSITIONS))
@pytest.mark.parametrize("is_neox", [False, True])
def test_flat_positions_number_the_tokens_of_a_batch_seq_tensor(layout, is_neox):
    pos_shape, q_shape, k_shape, head_size, rotary_dim = FLAT_POSITIONS[layout]
    g = torch.Generator().manual_seed(4)
    positions = torch.randint(0, 50, pos_shape, generator=g)
    query, key = torch.randn(q_shape, generator=g), torch.randn(k_shape, generator=g)
    cache = torch.randn(50, rotary_dim, generator=g)
    expected = op(positions.view(q_shape[:2]), query, key, head_size, cache, is_neox)  # the [B, S] form
    assert_matches_fp64(expected, positions.view(q_shape[:2]), query, key, head_size, cache, is_neox)
    for out, want in zip(op(positions, query, key, head_size, cache, is_neox), expected):
        torch.testing.assert_close(out, want, atol=0, rtol=0)
    torch._dynamo.reset()
    compiled = torch.compile(lambda p, q, k: op(p, q, k, head_size, cache, is_neox), dynamic=False)
    outputs, (code,) = run_and_get_code(compiled, positions, query, key)
    assert "mi::rope_head" in code and "torch.ops.mla.rotary_embedding" not in code
    for out, want in zip(outputs, expected):
        torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)


def test_op_matches_the_models_interleaved_rope():
    from mla_inductor.models.mla import apply_rope_interleaved

    positions, query, key, cache = make_inputs("3d_deepseek", torch.float32)
    cos, sin = cache[positions].chunk(2, dim=-1)
    q_out, k_out = op(positions, query, key, 64, cache, False)
    torch.testing.assert_close(q_out, apply_rope_interleaved(query, cos[:, None], sin[:, None]))
    torch.testing.assert_close(k_out, apply_rope_interleaved(key, cos[:, None], sin[:, None]))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(query=torch.zeros(7, 250)), "query .* last dim 250, not a multiple of head_size=64"),
        (dict(key=torch.zeros(6, 64)), r"key must be \[\*tokens, heads \* head_size\]"),
        (dict(key=torch.zeros(7, 64, dtype=torch.float64)), "key has dtype torch.float64"),
        (dict(positions=torch.zeros(7)), "positions must be int32 or int64"),
        (dict(cos_sin_cache=torch.zeros(50, 63)), "rotary_dim .* must be even"),
        (dict(cos_sin_cache=torch.zeros(50, 66)), r"must be even and in \[2, head_size=64\]"),
        (dict(positions=torch.tensor([0, 1, 2, 3, 4, 5, 50])), r"positions must be in \[0, 50\)"),
        (dict(positions=torch.tensor([0, 1, 2, 3, -1, 5, 6])), r"positions must be in \[0, 50\)"),
        (dict(query=torch.zeros(7, 256, device="meta")), "query must be on the CPU"),
    ],
)
def test_op_rejects_bad_input_naming_the_argument(change, message):
    positions, query, key, cache = make_inputs("2d", torch.float32)
    args = dict(positions=positions, query=query, key=key, head_size=64, cos_sin_cache=cache, is_neox=True)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        op(**args)


# --- the template ----------------------------------------------------------------------------------


@functools.cache
def compiled_op(is_neox):
    """Token counts dynamic: one compile per rotation style serves every case below."""
    return torch.compile(lambda p, q, k, c, head_size: op(p, q, k, head_size, c, is_neox), dynamic=True)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("is_neox", [False, True])
def test_template_matches_fp64_definition(layout, is_neox):
    head_size = LAYOUTS[layout][3]
    for dtype in (torch.bfloat16, torch.float32):
        positions, query, key, cache = make_inputs(layout, dtype, seed=1)
        outputs, (code,) = run_and_get_code(compiled_op(is_neox), positions, query, key, cache.to(dtype), head_size)
        assert "mi::rope_head" in code and "torch.ops.mla.rotary_embedding" not in code
        assert_matches_fp64(outputs, positions, query, key, head_size, cache.to(dtype), is_neox)


def test_template_strided_heads_the_deepseek_q_pe_slice():
    """q_pe is the last 64 of each 192-wide head of q: a strided view, read in place."""
    positions, _, key, cache = make_inputs("3d_deepseek", torch.bfloat16)
    q = torch.randn(5, 22, 192).to(torch.bfloat16)
    q_pe = q[..., 128:]
    outputs = compiled_op(False)(positions, q_pe, key, cache.to(torch.bfloat16), 64)
    assert_matches_fp64(outputs, positions, q_pe, key, 64, cache.to(torch.bfloat16), False)


def test_template_rejects_a_position_outside_the_cache():
    positions, query, key, cache = make_inputs("2d", torch.float32)
    positions[3] = 50
    with pytest.raises(RuntimeError, match=r"positions\[3\] = 50 is outside \[0, 50\)"):
        compiled_op(True)(positions, query, key, cache, 64)


# --- mla::apply_rope: model code's rotation by per-row cos/sin ------------------------------------

STYLES = ("neox", "interleaved", "interleaved_to_halves")
apply_rope = torch.ops.mla.apply_rope

# (x shape, cos shape): transformers' [B, H, S, d] by [B, 1, S, d/2], serving [T, H, d] by [T, 1, r/2]
# (partial rotary), a k_pe [T, d] by [T, d/2], and an odd number of pairs (the scalar tails)
APPLY_SHAPES = [((2, 4, 3, 64), (2, 1, 3, 32)), ((5, 3, 80), (5, 1, 20)), ((6, 64), (6, 32)), ((3, 2, 22), (3, 1, 11))]


def apply_inputs(x_shape, cos_shape, dtype, cos_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(x_shape, generator=g).to(dtype)
    cos, sin = (torch.randn(cos_shape, generator=g).to(cos_dtype or dtype) for _ in range(2))
    return x, cos, sin


@pytest.mark.parametrize("shapes", APPLY_SHAPES)
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_apply_rope_matches_fp64_definition(shapes, style, dtype):
    x, cos, sin = apply_inputs(*shapes, dtype)
    out = apply_rope(x, cos, sin, style)
    assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), apply_rope_fp64(x, cos, sin, style), atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(style="gptj"), "style must be one of"),
        (dict(cos=torch.zeros(5, 1, 16, dtype=torch.float16)), "cos and sin must be floating tensors of one dtype and shape"),
        (dict(cos=torch.zeros(5, 3, 16)), "cos and sin must be floating tensors of one dtype and shape"),
        (dict(cos=torch.zeros(5, 1, 40), sin=torch.zeros(5, 1, 40)), r"rotary_dim = 2 \* cos.shape\[-1\] = 80"),
        (dict(cos=torch.zeros(4, 1, 16), sin=torch.zeros(4, 1, 16)), r"does not broadcast against x's rows \[5, 3\]"),
        (dict(x=torch.zeros(5, 3, 64, dtype=torch.int32)), "x has dtype torch.int32"),
        (dict(x=torch.zeros(5, 3, 64, device="meta")), "x must be on the CPU"),
    ],
)
def test_apply_rope_rejects_bad_input_naming_the_argument(change, message):
    x, cos, sin = apply_inputs((5, 3, 64), (5, 1, 16), torch.float32)
    args = dict(x=x, cos=cos, sin=sin, style="neox")
    args.update(change)
    with pytest.raises(ValueError, match=message):
        apply_rope(**args)


@functools.cache
def compiled_apply_rope(style):
    """x arrives as a strided view (heads transposed, a slice of each head): read in place."""
    return torch.compile(lambda x, cos, sin: apply_rope(x.transpose(0, 1)[..., 16:], cos, sin, style), dynamic=True)


@pytest.mark.parametrize("style", STYLES)
def test_apply_rope_template_matches_the_op_on_strided_views(style):
    for dtype, cos_dtype in ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32,) * 2):
        x, cos, sin = apply_inputs((3, 7, 16 + 64), (7, 1, 32), dtype, cos_dtype)
        out, (code,) = run_and_get_code(compiled_apply_rope(style), x, cos, sin)
        assert "mi::rope_head" in code and "torch.ops.mla.apply_rope" not in code
        expected = apply_rope(x.transpose(0, 1)[..., 16:], cos, sin, style)
        torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


# --- the patterns: each spelling of model code, against its own eager output ----------------------


def rotary_cos_sin(positions, dim, dtype, base=10000.0):
    """What every rotary module computes: cat((freqs, freqs)), its cos and sin (equal halves)."""
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def v3_interleave(q, k, positions):
    """transformers 5.x DeepseekV3 `apply_rotary_pos_emb_interleave`, q [B, H, S, d], k [B, 1, S, d]."""
    cos, sin = rotary_cos_sin(positions, q.shape[-1], q.dtype)
    cos, sin = cos[..., : cos.shape[-1] // 2].unsqueeze(1), sin[..., : sin.shape[-1] // 2].unsqueeze(1)
    out = []
    for x in (q, k):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out.append(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))
    return out


def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)


def llama_rotate_half(q, k, positions, cos_sin=None):
    """Llama / DeepseekV3 (`rope_interleave=False`) `apply_rotary_pos_emb`."""
    cos, sin = cos_sin or rotary_cos_sin(positions, q.shape[-1], q.dtype)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def remote_code_deinterleave(q, k, positions):
    """DeepSeek's remote code / transformers 4.x: pairs gathered into halves, then rotate_half."""
    cos, sin = rotary_cos_sin(positions, q.shape[-1], q.dtype)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    out = []
    for x in (q, k):
        b, h, s, d = x.shape
        x = x.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
        out.append(x * cos + _rotate_half(x) * sin)
    return out


def v2_complex(q, k, positions):
    """DeepseekV2's `apply_rotary_emb`: complex multiplication by freqs_cis, in fp32."""
    d = q.shape[-1]
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs_cis = torch.polar(torch.ones(*positions.shape, d // 2), positions[..., None].float() * inv_freq)
    freqs_cis = freqs_cis.unsqueeze(1)
    out = []
    for x in (q, k):
        x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        out.append(torch.view_as_real(x_ * freqs_cis).flatten(3).type_as(x))
    return out


SPELLINGS = {"v3_interleave": v3_interleave, "rotate_half": llama_rotate_half,
             "remote_code_deinterleave": remote_code_deinterleave, "v2_complex": v2_complex}


def spelling_inputs(dtype):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 5, 16, generator=g).to(dtype).transpose(1, 2)  # [B, H, S, d], as after the head split
    k = torch.randn(2, 1, 3, 16, generator=g).to(dtype)
    return q, k, torch.tensor([[7, 8, 9], [0, 1, 2]])


# The casting spelling (complex) is registered per dtype; the others trace alike for both.
@pytest.mark.parametrize("spelling, dtype", [
    ("v3_interleave", torch.bfloat16), ("rotate_half", torch.float32), ("remote_code_deinterleave", torch.bfloat16),
    ("v2_complex", torch.bfloat16), ("v2_complex", torch.float32),
])
def test_each_spelling_fires_and_matches_its_eager_code(spelling, dtype):
    fn = SPELLINGS[spelling]
    q, k, positions = spelling_inputs(dtype)
    graph, actual = rewritten_and_run(fn, q, k, positions, stage="post_grad")
    assert graph.count("mla.apply_rope") == 2, graph
    for out, expected in zip(actual, fn(q, k, positions)):
        # bf16 model code rounds after every product; the op once
        torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype] * 2, rtol=TOLERANCE[dtype])


def _native_rotation(x, cos, sin, is_neox):
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    x1, x2 = torch.chunk(x, 2, dim=-1) if is_neox else (x[..., ::2], x[..., 1::2])
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return torch.cat((o1, o2), dim=-1) if is_neox else torch.stack((o1, o2), dim=-1).flatten(-2)


def serving_forward_native(positions, query, key, cos_sin_cache, is_neox):
    """vLLM's / SGLang's RotaryEmbedding.forward_native on [T, H, head_size] heads: cos|sin gathered by
    positions, the first rotary_dim values rotated, the rest passed through."""
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    out = []
    for x in (query, key):
        x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
        out.append(torch.cat((_native_rotation(x_rot, cos, sin, is_neox), x_pass), dim=-1))
    return out


@pytest.mark.parametrize("is_neox, rotary_dim, dtype", [  # each search function, each with and without the cast
    (False, 16, torch.bfloat16), (True, 16, torch.float32), (False, 10, torch.float32), (True, 10, torch.bfloat16),
])
def test_serving_forward_native_fires_and_matches_its_eager_code(is_neox, rotary_dim, dtype):
    g = torch.Generator().manual_seed(4)
    positions = torch.tensor([5, 0, 9, 3])
    query, key = torch.randn(4, 6, 16, generator=g).to(dtype), torch.randn(4, 1, 16, generator=g).to(dtype)
    cos, sin = rotary_cos_sin(torch.arange(12), rotary_dim, torch.float32)
    cache = torch.cat([cos[:, : rotary_dim // 2], sin[:, : rotary_dim // 2]], dim=-1)  # fp32, as engines keep it
    fn = functools.partial(serving_forward_native, is_neox=is_neox)
    graph, actual = rewritten_and_run(fn, positions, query, key, cache, stage="post_grad")
    assert graph.count("mla.apply_rope") == 2, graph
    for out, expected in zip(actual, fn(positions, query, key, cache)):
        torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype] * 2, rtol=TOLERANCE[dtype])


def test_serving_rotation_written_back_in_place_into_q():
    """DeepSeek serving code: q_pe rotated by forward_native and written back into q[..., nope:]
    (a slice_scatter once functionalized); k_pe rotated alongside."""
    g = torch.Generator().manual_seed(6)
    positions = torch.tensor([2, 7, 0])
    q, k_pe = torch.randn(3, 4, 24, generator=g).to(torch.bfloat16), torch.randn(3, 1, 8, generator=g).to(torch.bfloat16)
    cache = torch.randn(10, 8, generator=g)

    def fn(positions, q, k_pe, cache):
        q = q.clone()
        q_pe, k_pe = serving_forward_native(positions, q[..., 16:], k_pe, cache, False)
        q[..., 16:] = q_pe
        return q, k_pe

    graph, actual = rewritten_and_run(fn, positions, q, k_pe, cache, stage="post_grad")
    assert graph.count("mla.apply_rope") == 2 and "slice_scatter" in graph, graph
    for out, expected in zip(actual, fn(positions, q, k_pe, cache)):
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=1e-2)


def test_query_and_key_with_different_rotary_dims():
    """Each tensor's rotation is its own match: q rotates 16 of 24 values, k 8 of 12."""
    g = torch.Generator().manual_seed(5)
    positions = torch.tensor([1, 4, 2])
    query, key = torch.randn(3, 4, 24, generator=g), torch.randn(3, 1, 12, generator=g)
    q_cache, k_cache = (torch.randn(8, r, generator=g) for r in (16, 8))

    def fn(positions, query, key, q_cache, k_cache):
        return (serving_forward_native(positions, query, query, q_cache, False)[0],
                serving_forward_native(positions, key, key, k_cache, True)[1])

    graph, actual = rewritten_and_run(fn, positions, query, key, q_cache, k_cache, stage="post_grad")
    assert "interleaved)" in graph and "neox)" in graph, graph
    for out, expected in zip(actual, fn(positions, query, key, q_cache, k_cache)):
        torch.testing.assert_close(out, expected)


class TestRewrite(expecttest.TestCase):
    def test_v3_interleave_graph(self):
        graph = rewritten(v3_interleave, *spelling_inputs(torch.bfloat16), stage="post_grad")
        self.assertExpectedInline(graph, """\
unsqueeze = unsqueeze(arg1_1, 2)
convert_element_type_1 = prims.convert_element_type(unsqueeze, torch.float32)
iota = prims.iota(8)
mul = mul.Tensor(iota, 2)
add = add.Tensor(mul, 0)
convert_element_type = prims.convert_element_type(add, torch.float32)
div = div.Tensor(convert_element_type, 16)
pow_1 = pow.Scalar(10000.0, div)
reciprocal = reciprocal(pow_1)
mul_1 = mul.Tensor(reciprocal, 1.0)
mul_2 = mul.Tensor(convert_element_type_1, mul_1)
unsqueeze_1 = unsqueeze(mul_2, 2)
expand = expand(unsqueeze_1, [2, 3, 2, 8])
clone = clone(expand)
view = reshape(clone, [2, 3, 16])
cos = cos(view)
convert_element_type_2 = prims.convert_element_type(cos, torch.bfloat16)
slice_1 = slice.Tensor(convert_element_type_2, 2, 0, 8)
unsqueeze_2 = unsqueeze(slice_1, 1)
sin = sin(view)
convert_element_type_3 = prims.convert_element_type(sin, torch.bfloat16)
slice_2 = slice.Tensor(convert_element_type_3, 2, 0, 8)
unsqueeze_3 = unsqueeze(slice_2, 1)
apply_rope_default_1 = mla.apply_rope(arg0_1, unsqueeze_2, unsqueeze_3, interleaved_to_halves)
apply_rope_default = mla.apply_rope(arg2_1, unsqueeze_2, unsqueeze_3, interleaved_to_halves)""")

    def test_not_rotate_half_when_the_halves_of_cos_may_differ(self):
        """cos/sin from the caller: nothing proves cos[i] == cos[i + d/2], and then rotate_half is no rotation of pairs."""
        q, k, positions = spelling_inputs(torch.float32)
        cos_sin = rotary_cos_sin(positions, 16, torch.float32)
        graph = rewritten(lambda q, k, c, s: llama_rotate_half(q, k, None, (c, s)), q, k, *cos_sin, stage="post_grad")
        self.assertNotIn("apply_rope", graph)

    def test_not_when_cos_promotes_the_result(self):
        """fp32 cos/sin against bf16 x: the model's result is fp32, the op's would be bf16."""
        q, k, positions = spelling_inputs(torch.bfloat16)

        def promoting(q, k, positions):
            cos, sin = rotary_cos_sin(positions, 16, torch.float32)
            cos, sin = cos[..., :8].unsqueeze(1), sin[..., :8].unsqueeze(1)
            x1, x2 = q[..., 0::2], q[..., 1::2]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

        self.assertNotIn("apply_rope", rewritten(promoting, q, k, positions, stage="post_grad"))

    def test_not_when_switched_off(self):
        graph = rewritten(v3_interleave, *spelling_inputs(torch.bfloat16), stage="post_grad", fusions={"rope": False})
        self.assertNotIn("apply_rope", graph)


# --- real models -----------------------------------------------------------------------------------

def test_transformers_prefill_fires_per_layer_and_matches_eager():
    """q_pe and k_pe of every layer (v3's interleaved rotation); k_pe's rotation then moves into
    qkv_a_proj's epilogue. v2's complex rotation and v3's rotate_half spelling (rope_interleave=False)
    fire the same way in every decode layer of test_mla_decode.py's transformers models."""
    model = build_hf_model(get_config("tiny", num_layers=2), arch="v3", dtype=torch.bfloat16)
    ids = torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        graph, actual = rewritten_and_run(lambda ids: model(ids, use_cache=False).logits, ids, stage="post_grad")
    assert graph.count("mla.apply_rope") == 2 and graph.count("k_cos=") == 2, graph
    counts = mla_inductor.fusion_counts()
    assert counts["rope"] == 4 and counts["q_b_absorb"] == 0, counts  # a prefill query is not absorbed
    torch.testing.assert_close(actual, expected, atol=5e-2, rtol=2e-2)  # bf16 logits after 2 layers


