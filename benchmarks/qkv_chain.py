"""The whole MLA input chain at the deepseek-v3-tp22 shape, as serving code runs it per layer: the
fused q_a / kv_a projection, both RMSNorms, q_b_proj, the W_kc absorption, RoPE of q_pe and k_pe,
the query [tokens, 22, 576] and the cache row [tokens, 576]. What SGLang's `qkv_proj_with_rope` is;
mla_inductor compiles it to qkv_a_proj (k_pe rotated in its epilogue) and q_b_absorb.

A stack of layers whose weights read per call exceed 128 MiB and the last-level cache, so that decode streams them from
memory. Prints `benchmarking.weight_stream_table` (medians of interleaved rounds against the roofline
measured in the same rounds). Asserts nothing.

    python benchmarks/qkv_chain.py [--rows 1 8 512] [--layers N]
"""

import torch
from torch import nn

from mla_inductor import benchmarking
from mla_inductor.models import get_config
from mla_inductor.models.mla import MLAAttention, init_weights_

CONFIG = get_config("deepseek-v3-tp22")


class InputChain(nn.Module):
    """One layer's `MLAAttention._project` and the absorbed query of its decode step (models/mla.py)."""

    def __init__(self):
        super().__init__()
        self.attn = MLAAttention(CONFIG)

    def forward(self, x, cos, sin):
        attn, L = self.attn, CONFIG.kv_lora_rank
        q_nope, q_pe, k_input = attn._project(x, cos, sin)
        q_input = x.new_empty(x.shape[0], attn.num_heads, L + CONFIG.qk_rope_head_dim)
        q_input[..., :L] = torch.bmm(q_nope.transpose(0, 1), attn.w_kc.transpose(1, 2)).transpose(0, 1)
        q_input[..., L:] = q_pe
        return q_input, k_input


class Stack(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(InputChain() for _ in range(layers))

    def forward(self, x, cos, sin):
        return [layer(x, cos, sin) for layer in self.layers]


def main():
    p = benchmarking.projection_arg_parser(__doc__.splitlines()[0], 46.05 * 2**20, 4,
                                           "30.9 (q_a/kv_a) + 12.4 (q_b) + 2.75 (W_kc) MiB of bf16 weights read")
    args = p.parse_args()
    benchmarking.fresh_compiles()

    model = init_weights_(Stack(args.layers), seed=0).to(torch.bfloat16).eval()
    c = CONFIG
    weights_read = args.layers * (
        c.hidden_size * (c.q_lora_rank + c.kv_lora_rank + c.qk_rope_head_dim)  # fused q_a / kv_a
        + c.q_lora_rank * c.num_heads * c.qk_head_dim  # q_b_proj
        + c.num_heads * c.qk_nope_head_dim * c.kv_lora_rank  # W_kc, the half of kv_b_proj the query reads
    )

    def make_input(rows):
        angles = torch.rand(rows, c.qk_rope_head_dim // 2) * 6.3
        x = torch.randn(rows, c.hidden_size).to(torch.bfloat16)
        return x, angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)

    benchmarking.weight_stream_table(model, make_input, args.rows, 2 * weights_read, "qkv_proj_with_rope",
                                     args.rounds, weight_bytes=2 * weights_read)


if __name__ == "__main__":
    main()
