"""rope on rotations as others spell them (rotary.py), against an independent fp64 rotation."""

import pytest
import torch

from graph_utils import declined, fired, has_dynamic_sizes, rewrite_and_run
from mla_inductor.ops.rope import apply_rope_fp64
from spellings import rotary

TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(rotary.SPELLINGS))
def test_spelling_fires_and_is_no_less_accurate_than_eager(name, dtype):
    x, positions, cache = rotary.make_inputs(dtype)
    fn = rotary.SPELLINGS[name]
    out, events = rewrite_and_run(fn, x, positions, cache)
    half = rotary.ROTARY.get(name, rotary.DIM) // 2
    cos_sin = cache[positions].double()
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, rotary.DIM // 2 : rotary.DIM // 2 + half]
    expected = apply_rope_fp64(x, cos, sin, rotary.STYLE.get(name, "interleaved"))
    error = (out.double() - expected).abs().max().item()
    eager_error = (fn(x, positions, cache).double() - expected).abs().max().item()
    assert error <= max(TOLERANCE[dtype], 1.5 * eager_error), (error, eager_error)
    assert fired(events, "rope") == 1, declined(events, "rope")


def test_a_full_width_rotation_fires_with_dynamic_tokens():
    x, positions, cache = rotary.make_inputs(torch.float32)
    for t in (x, positions):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    out, events = rewrite_and_run(rotary.llama_rotate_half_chunk, x, positions, cache)
    assert has_dynamic_sizes(rewrite_and_run.graph)
    assert fired(events, "rope") == 1, declined(events, "rope")
    torch.testing.assert_close(out, rotary.llama_rotate_half_chunk(x, positions, cache))


def _unequal_halves(x, positions, cache):
    """x * C + rotate_half(x) * S where C is cos | sin (not one angle per pair): no rotation of pairs."""
    cos_sin = cache[positions][:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos_sin + torch.cat((-x2, x1), dim=-1) * cos_sin.flip(-1)


def _rotation_backwards(x, positions, cache):
    """The swap negated on the second member: a rotation by -angle, which apply_rope is not."""
    cos, sin = (t.repeat(1, 2)[:, None, :] for t in rotary._cos_sin(positions, cache))
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, -x1), dim=-1) * sin


def _two_tensors(x, positions, cache):
    """A sum of two products of different tensors, one a swap of the other's halves: no x * C term."""
    y = x * 2
    cos, sin = (t.repeat(1, 2)[:, None, :] for t in rotary._cos_sin(positions, cache))
    y1, y2 = y.chunk(2, dim=-1)
    return (x + 1) * cos + torch.cat((-y2, y1), dim=-1) * sin


def test_declines_cos_sin_that_do_not_hold_one_angle_per_pair():
    x, positions, cache = rotary.make_inputs(torch.float32)
    out, events = rewrite_and_run(_unequal_halves, x, positions, cache)
    assert fired(events, "rope") == 0
    assert any("angle" in r for r in declined(events, "rope")), declined(events, "rope")
    torch.testing.assert_close(out, _unequal_halves(x, positions, cache))


@pytest.mark.parametrize("fn", [_rotation_backwards, _two_tensors])
def test_does_not_fire_where_no_pair_rotation_of_x_is_computed(fn):
    x, positions, cache = rotary.make_inputs(torch.float32)
    out, events = rewrite_and_run(fn, x, positions, cache)
    assert fired(events, "rope") == 0
    torch.testing.assert_close(out, fn(x, positions, cache))
