"""rope: the mla::rotary_embedding op (SGLang's contract) and its C++ template."""

import functools

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from mla_inductor.ops.rope import reference_fp64

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
