"""q_b_absorb on the absorbed decode query as others spell it (absorbed_query.py): after mla_decode has
rewritten the attention, the query becomes one `mla::q_b_absorb`; and where it must not."""

import pytest
import torch

from graph_utils import declined, fired, has_dynamic_sizes, rewrite_and_run
from spellings import absorbed_query as aq

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(aq.SPELLINGS))
def test_spelling_fires_and_is_no_less_accurate_than_eager(name, dtype):
    x = aq.make_inputs(dtype)
    out, events = rewrite_and_run(aq.SPELLINGS[name], x)
    for fusion in ("rope", "mla_decode", "q_b_absorb"):
        assert fired(events, fusion) == 1, (fusion, declined(events, fusion))
    expected = aq.reference_fp64(x, aq.STYLE.get(name, "interleaved"))
    error = (out.double() - expected).abs().max().item()
    eager_error = (aq.SPELLINGS[name](x).double() - expected).abs().max().item()
    assert error <= max(TOLERANCE[dtype], 1.5 * eager_error), (error, eager_error)


@pytest.mark.parametrize("name", list(aq.SPELLINGS))
def test_spelling_fires_at_batch_one(name):
    """One decode token: Dynamo specializes the size of 1, and the graph has no token axis."""
    x = aq.make_inputs(torch.float32, batch=1)
    out, events = rewrite_and_run(aq.SPELLINGS[name], x)
    for fusion in ("rope", "mla_decode", "q_b_absorb"):
        assert fired(events, fusion) == 1, (fusion, declined(events, fusion))
    expected = aq.reference_fp64(x, aq.STYLE.get(name, "interleaved"))
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(aq.SPELLINGS))
def test_spelling_fires_with_dynamic_tokens_and_rows(name):
    """As a server compiles it: one graph for every batch and cache length (symbolic sizes)."""
    x = aq.mark_dynamic(aq.make_inputs(torch.float32))
    out, events = rewrite_and_run(aq.SPELLINGS[name], x)
    assert has_dynamic_sizes(rewrite_and_run.graph)
    for fusion in ("rope", "mla_decode", "q_b_absorb"):
        assert fired(events, fusion) == 1, (fusion, declined(events, fusion))
    torch.testing.assert_close(out, aq.SPELLINGS[name](x), atol=1e-5, rtol=1e-5)


def test_declines_a_q_b_proj_with_bias_and_says_why():
    x = aq.make_inputs(torch.float32)
    out, events = rewrite_and_run(aq.with_q_b_bias, x)
    assert fired(events, "mla_decode") == 1 and fired(events, "q_b_absorb") == 0
    assert any("q_b_proj" in r for r in declined(events, "q_b_absorb")), declined(events, "q_b_absorb")
    torch.testing.assert_close(out, aq.with_q_b_bias(x))
