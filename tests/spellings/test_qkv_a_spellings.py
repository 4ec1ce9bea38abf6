"""qkv_a_proj on the A projections and norms as others spell them (latent_projection.py)."""

import pytest
import torch

from graph_utils import declined, fired, rewrite_and_run
from spellings import latent_projection as lp

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("shape", [(3, lp.HIDDEN), (2, 1, lp.HIDDEN)], ids=["tokens", "batch_seq"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(lp.SPELLINGS))
def test_spelling_fires_and_is_no_less_accurate_than_eager(name, dtype, shape):
    x = lp.make_inputs(dtype, shape)
    out, events = rewrite_and_run(lp.SPELLINGS[name], x)
    assert fired(events, "qkv_a_proj") == 1, declined(events, "qkv_a_proj")
    expected = lp.reference_fp64(x, bias=name == "with_bias", q_norm=name != "no_q_lora")
    eager = lp.SPELLINGS[name](x)
    for got, ref, plain in zip(out, expected, eager):
        error, eager_error = ((t.double() - ref).abs().max().item() for t in (got, plain))
        assert error <= max(TOLERANCE[dtype], 1.5 * eager_error), (error, eager_error)


def test_a_projection_whose_pieces_overlap_is_left_alone():
    """Slices of one GEMM that do not tile its columns (the latent read twice) are not a cut."""

    def overlapping(x: lp.Inputs):
        out = torch.nn.functional.linear(x.x, x.fused_weight)
        q = lp.torch_rms_norm(out[..., : lp.Q_LORA], x.q_norm)
        return q, lp.torch_rms_norm(out[..., lp.Q_LORA - 4 : lp.Q_LORA - 4 + lp.LATENT], x.kv_norm)

    x = lp.make_inputs(torch.float32)
    out, events = rewrite_and_run(overlapping, x)
    assert fired(events, "qkv_a_proj") == 0
    for got, want in zip(out, overlapping(x)):
        torch.testing.assert_close(got, want)
