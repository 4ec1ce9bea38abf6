"""rope on rotations as others spell them (rotary.py), against an independent fp64 rotation."""

import pytest
import torch

from graph_utils import declined, fired, rewrite_and_run
from mla_inductor.ops.rope import apply_rope_fp64
from spellings import rotary

TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-2}
# Spellings the rope patterns do not know yet: each would need its own pattern today.
NOT_YET = {
    "llama_rotate_half_chunk": "rotate_half by chunk with cos/sin repeated: a split, not the slices the pattern has",
    "deepseek_complex": "cis built in the graph by torch.complex: the pattern takes freqs_cis as an input",
    "gptj_rotate_every_two": "GPT-J's rotate_every_two with repeat_interleave'd cos/sin: no pattern",
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(reason=NOT_YET[n], strict=True)) if n in NOT_YET else n
    for n in rotary.SPELLINGS
])
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
