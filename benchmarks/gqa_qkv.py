"""gqa_qkv at a Llama-3-8B-shaped layer (hidden 4096, 32 q heads, 8 kv heads, d_head 128): transformers'
own modules (LlamaRMSNorm, the q/k/v Linears, LlamaRotaryEmbedding, apply_rotary_pos_emb) from the
residual add of the previous block to the rotated heads, in a stack of layers whose weights exceed
128 MiB and the last-level cache, so that decode streams them from memory. `--arch qwen3` adds Qwen3's
q_norm and k_norm (Qwen3RMSNorm of each head before RoPE; Qwen3-8B has this shape); `--arch phi3` projects
by one fused qkv_proj cut into q, k and v by slices, as transformers' Phi3Attention does.

Prints `benchmarking.weight_stream_table` (medians of interleaved rounds against the roofline
measured in the same rounds). Asserts nothing.

    python benchmarks/gqa_qkv.py [--rows 1 8 512] [--layers N] [--arch llama|qwen3|phi3]
"""

import torch
import transformers
from torch import nn
from transformers.models.llama import modeling_llama
from transformers.models.qwen3 import modeling_qwen3

from mla_inductor import benchmarking

CONFIG = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                  intermediate_size=14336, max_position_embeddings=8192, rope_theta=500000.0)


class AttentionInput(nn.Module):
    """One LlamaDecoderLayer (or Qwen3DecoderLayer, `head_norms`; Phi3DecoderLayer, `fused`) from
    `residual + mlp_out` to the rotated q, k and v heads."""

    def __init__(self, head_norms: bool, fused: bool):
        super().__init__()
        c = CONFIG
        self.input_layernorm = modeling_llama.LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.sizes = [c.num_attention_heads * c.head_dim] + [c.num_key_value_heads * c.head_dim] * 2
        if fused:
            self.qkv_proj = nn.Linear(c.hidden_size, sum(self.sizes), bias=False)
        else:
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(c.hidden_size, n, bias=False) for n in self.sizes)
        norm = (lambda: modeling_qwen3.Qwen3RMSNorm(c.head_dim, eps=c.rms_norm_eps)) if head_norms else nn.Identity
        self.q_norm, self.k_norm = norm(), norm()

    def forward(self, residual, mlp_out, cos, sin):
        hidden = residual + mlp_out
        x = self.input_layernorm(hidden)
        shape = (*x.shape[:-1], -1, CONFIG.head_dim)
        if hasattr(self, "qkv_proj"):
            qkv, (q_end, k_end) = self.qkv_proj(x), (self.sizes[0], self.sizes[0] + self.sizes[1])
            q, k, v = qkv[..., :q_end], qkv[..., q_end:k_end], qkv[..., k_end:]
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = self.q_norm(q.view(shape)).transpose(1, 2)
        k = self.k_norm(k.view(shape)).transpose(1, 2)
        v = v.view(shape).transpose(1, 2)
        q, k = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v, hidden


class Stack(nn.Module):
    def __init__(self, layers, head_norms, fused):
        super().__init__()
        self.rotary_emb = modeling_llama.LlamaRotaryEmbedding(CONFIG)
        self.layers = nn.ModuleList(AttentionInput(head_norms, fused) for _ in range(layers))

    def forward(self, residual, mlp_out, position_ids):
        cos, sin = self.rotary_emb(residual, position_ids)
        return [layer(residual, mlp_out, cos, sin) for layer in self.layers]


def main():
    p = benchmarking.projection_arg_parser(__doc__.splitlines()[0], 48 << 20, 3,
                                           "48 MiB of bf16 q/k/v weights")
    p.add_argument("--arch", choices=["llama", "qwen3", "phi3"], default="llama")
    args = p.parse_args()
    benchmarking.fresh_compiles()

    torch.manual_seed(0)
    model = Stack(args.layers, head_norms=args.arch == "qwen3", fused=args.arch == "phi3").to(torch.bfloat16).eval()
    for linear in model.modules():
        if isinstance(linear, nn.Linear):
            nn.init.normal_(linear.weight, std=CONFIG.hidden_size**-0.5)
    weights = sum(p.numel() for layer in model.layers for p in layer.parameters() if p.dim() == 2)

    def make_input(rows):
        residual, mlp_out = (torch.randn(1, rows, CONFIG.hidden_size).to(torch.bfloat16) for _ in range(2))
        return residual, mlp_out, torch.arange(100, 100 + rows)[None]

    benchmarking.weight_stream_table(model, make_input, args.rows, 2 * weights, "gqa_qkv", args.rounds,
                                     weight_bytes=2 * weights)


if __name__ == "__main__":
    main()
