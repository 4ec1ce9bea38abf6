"""q_b_absorb at the deepseek-v3-tp22 shape (q_lora 1536 -> 22 heads x (128 + 64), W_kc 22 x 128 x 512,
interleaved RoPE): a stack of layers whose q_b_proj and kv_b_proj weights exceed 128 MiB and the
last-level cache, so that decode streams them from memory.

Prints `benchmarking.weight_stream_table`: medians of interleaved rounds for eager, stock, stock at
its best and mla_inductor, against the roofline measured in the same rounds. Asserts nothing.

    python benchmarks/q_b_absorb.py [--rows 1 8 512] [--layers N]
"""

import torch
from torch import nn

from mla_inductor import benchmarking
from mla_inductor.models.mla import apply_rope_interleaved, init_weights_

HEADS, NOPE, ROPE, V_HEAD, LATENT, Q_LORA = 22, 128, 64, 128, 512, 1536


class DecodeQuery(nn.Module):
    """One layer's decode query as serving code builds it (models/mla.py)."""

    def __init__(self):
        super().__init__()
        self.q_b_proj = nn.Linear(Q_LORA, HEADS * (NOPE + ROPE), bias=False)
        self.kv_b_proj = nn.Linear(LATENT, HEADS * (NOPE + V_HEAD), bias=False)

    def forward(self, q_a, cos, sin):
        q_nope, q_pe = self.q_b_proj(q_a).view(-1, HEADS, NOPE + ROPE).split([NOPE, ROPE], dim=-1)
        q_pe = apply_rope_interleaved(q_pe, cos[:, None, :], sin[:, None, :])
        w_kc = self.kv_b_proj.weight.view(HEADS, NOPE + V_HEAD, LATENT)[:, :NOPE]
        q_input = q_a.new_empty(q_a.shape[0], HEADS, LATENT + ROPE)
        q_input[..., :LATENT] = torch.bmm(q_nope.transpose(0, 1), w_kc).transpose(0, 1)
        q_input[..., LATENT:] = q_pe
        return q_input


class Stack(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(DecodeQuery() for _ in range(layers))

    def forward(self, q_a, cos, sin):
        return [layer(q_a, cos, sin) for layer in self.layers]


def main():
    p = benchmarking.projection_arg_parser(__doc__.splitlines()[0], 15.15 * 2**20, 10,
                                           "12.4 (q_b) + 2.75 (W_kc) MiB of bf16 weights read")
    args = p.parse_args()
    benchmarking.fresh_compiles()

    model = init_weights_(Stack(args.layers), seed=0).to(torch.bfloat16).eval()
    # q_b_proj and W_kc, the half of kv_b_proj the query reads (W_vc is for after the attention)
    weights_read = args.layers * (Q_LORA * HEADS * (NOPE + ROPE) + HEADS * NOPE * LATENT)
    flop_per_row = 2 * weights_read

    def make_input(rows):
        angles = torch.rand(rows, ROPE // 2) * 6.3
        return torch.randn(rows, Q_LORA).to(torch.bfloat16), angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)

    benchmarking.weight_stream_table(model, make_input, args.rows, flop_per_row, "q_b_absorb", args.rounds,
                                     weight_bytes=2 * weights_read)


if __name__ == "__main__":
    main()
