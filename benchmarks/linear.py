"""The Linears no other fusion takes, at a Llama-3-8B-shaped decoder layer: o_proj (4096 -> 4096) and
transformers' own LlamaMLP (gate and up 4096 -> 14336, SiLU, down 14336 -> 4096), 368 MiB of bf16
weights a layer, in a stack past the last-level cache, so that decode streams them from memory.

On a CPU without a native bf16 GEMM (no AVX512-BF16) the linear fusion gives them mla::linear; where
the GEMM is native it fires on nothing and the table shows stock against itself.

Prints `benchmarking.weight_stream_table` (medians of interleaved rounds against the roofline
measured in the same rounds). Asserts nothing. Stock's bf16 GEMMs run seconds a call at hundreds of
rows on such CPUs: add `--rows 512` knowingly.

    python benchmarks/linear.py [--rows 1 8 64] [--layers N] [--rounds N]
"""

import torch
import transformers
from torch import nn
from transformers.models.llama import modeling_llama

from mla_inductor import benchmarking

CONFIG = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                  intermediate_size=14336)


class LeftToLinear(nn.Module):
    """What a LlamaDecoderLayer leaves after its attention: o_proj, the residual add, the MLP."""

    def __init__(self):
        super().__init__()
        self.o_proj = nn.Linear(CONFIG.hidden_size, CONFIG.hidden_size, bias=False)
        self.mlp = modeling_llama.LlamaMLP(CONFIG)

    def forward(self, x):
        h = x + self.o_proj(x)
        return h + self.mlp(h)


def main():
    layer_bytes = 2 * CONFIG.hidden_size * (CONFIG.hidden_size + 3 * CONFIG.intermediate_size)
    p = benchmarking.projection_arg_parser(__doc__.splitlines()[0], layer_bytes, 1, "368 MiB of bf16 weights")
    p.set_defaults(rows=[1, 8, 64], rounds=7)
    args = p.parse_args()
    benchmarking.fresh_compiles()

    torch.manual_seed(0)
    model = nn.Sequential(*(LeftToLinear() for _ in range(args.layers))).to(torch.bfloat16).eval()
    flop_per_row = 2 * sum(p.numel() for p in model.parameters())
    benchmarking.weight_stream_table(
        model, lambda rows: (torch.randn(rows, CONFIG.hidden_size).to(torch.bfloat16),), args.rows, flop_per_row,
        "linear", args.rounds,
    )


if __name__ == "__main__":
    main()
