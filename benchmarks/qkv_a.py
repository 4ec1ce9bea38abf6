"""qkv_a_proj at the deepseek-v3-tp22 shape (hidden 7168 -> 1536 + 576): a stack of layers whose
A-projection weights exceed 128 MiB and the last-level cache, so that decode streams them from memory.

Prints `benchmarking.weight_stream_table`: medians of interleaved rounds for eager, stock, stock at
its best and mla_inductor, against the roofline measured in the same rounds. Asserts nothing.

    python benchmarks/qkv_a.py [--rows 1 8 512] [--layers N] [--template-max-rows N]
"""

import torch
from torch import nn

from mla_inductor import benchmarking
from mla_inductor.lowerings import segment_gemm
from mla_inductor.models.mla import RMSNorm, init_weights_


class APprojections(nn.Module):
    """The A-projections of one MLA layer as serving code holds them (one fused weight)."""

    def __init__(self, hidden=7168, q_lora_rank=1536, kv_lora_rank=512, rope=64):
        super().__init__()
        self.sizes = (q_lora_rank, kv_lora_rank + rope)
        self.kv_lora_rank = kv_lora_rank
        self.fused_qkv_a_proj_with_mqa = nn.Linear(hidden, sum(self.sizes), bias=False)
        self.q_a_layernorm = RMSNorm(q_lora_rank, 1e-6)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, 1e-6)

    def forward(self, x):
        q, latent = self.fused_qkv_a_proj_with_mqa(x).split(self.sizes, dim=-1)
        c_kv, k_pe = latent.split([self.kv_lora_rank, latent.shape[-1] - self.kv_lora_rank], dim=-1)
        return self.q_a_layernorm(q), self.kv_a_layernorm(c_kv), k_pe


class Stack(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(APprojections() for _ in range(layers))

    def forward(self, x):
        return [layer(x) for layer in self.layers]


def main():
    p = benchmarking.projection_arg_parser(__doc__.splitlines()[0], 30 << 20, 6,
                                           "30 MiB of bf16 weights")
    p.add_argument("--template-max-rows", type=int, default=None, help="fire the fusion up to this many rows")
    args = p.parse_args()
    if args.template_max_rows is not None:  # to measure the template where the cost model declines it
        segment_gemm.MAX_ROWS_PACKED = segment_gemm.MAX_ROWS_FROZEN = args.template_max_rows
        segment_gemm.MAX_ROWS_UNFROZEN = args.template_max_rows
    benchmarking.fresh_compiles()

    model = init_weights_(Stack(args.layers), seed=0).to(torch.bfloat16).eval()
    flop_per_row = 2 * sum(l.fused_qkv_a_proj_with_mqa.weight.numel() for l in model.layers)
    benchmarking.weight_stream_table(
        model, lambda rows: (torch.randn(rows, 7168).to(torch.bfloat16),), args.rows, flop_per_row, "qkv_a_proj",
        args.rounds,
    )


if __name__ == "__main__":
    main()
