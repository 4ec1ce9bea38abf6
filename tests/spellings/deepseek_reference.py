"""An MLA layer spelled as DeepSeek-V3's reference inference code spells it (`inference/model.py`,
"absorb" mode): `F.rms_norm` norms, RoPE through complex multiplication, W_kc absorbed by an einsum over a
view of `wkv_b`'s weight, the latent and rope parts of the cache in two dense buffers written in place,
scores as the sum of two einsums scaled in the model dtype, softmax in fp32 by `dtype=`, an additive
causal mask, P.V and W_vc as einsums, and a `@torch.inference_mode()` forward. Written for these tests
from the structure of that code; sizes are tiny."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class Args:
    dim: int = 64
    n_heads: int = 4
    q_lora_rank: int = 48  # 0: a plain wq
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    max_batch_size: int = 4
    max_seq_len: int = 64
    n_layers: int = 2
    vocab_size: int = 128
    rope_theta: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def complex_freqs(args: Args) -> torch.Tensor:
    dim = args.qk_rope_head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float32), inv)
    return torch.polar(torch.ones_like(angles), angles)


def rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Pairs (x[2i], x[2i+1]) as complex numbers times freqs[position, i]."""
    as_complex = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    freqs = freqs.view(1, as_complex.size(1), 1, as_complex.size(-1))
    return torch.view_as_real(as_complex * freqs).flatten(3).to(x.dtype)


class MLA(nn.Module):
    def __init__(self, args: Args):
        super().__init__()
        self.args = args
        self.n_heads = args.n_heads
        self.qk_head_dim = args.qk_nope_head_dim + args.qk_rope_head_dim
        if args.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank)
            self.wq_b = nn.Linear(args.q_lora_rank, args.n_heads * self.qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(args.dim, args.n_heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        self.softmax_scale = self.qk_head_dim**-0.5
        self.register_buffer("kv_cache", torch.zeros(args.max_batch_size, args.max_seq_len, args.kv_lora_rank),
                             persistent=False)
        self.register_buffer("pe_cache", torch.zeros(args.max_batch_size, args.max_seq_len, args.qk_rope_head_dim),
                             persistent=False)

    def forward(self, x, start_pos: int, freqs: torch.Tensor, mask: Optional[torch.Tensor]):
        a = self.args
        bsz, seqlen, _ = x.size()
        end_pos = start_pos + seqlen
        q = self.wq(x) if not a.q_lora_rank else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(bsz, seqlen, self.n_heads, self.qk_head_dim)
        q_nope, q_pe = torch.split(q, [a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        q_pe = rotate(q_pe, freqs)
        kv, k_pe = torch.split(self.wkv_a(x), [a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)
        k_pe = rotate(k_pe.unsqueeze(2), freqs)
        wkv_b = self.wkv_b.weight.view(self.n_heads, -1, a.kv_lora_rank)
        q_nope = torch.einsum("bshd,hdc->bshc", q_nope, wkv_b[:, : a.qk_nope_head_dim])
        self.kv_cache[:bsz, start_pos:end_pos] = self.kv_norm(kv)
        self.pe_cache[:bsz, start_pos:end_pos] = k_pe.squeeze(2)
        scores = (torch.einsum("bshc,btc->bsht", q_nope, self.kv_cache[:bsz, :end_pos])
                  + torch.einsum("bshr,btr->bsht", q_pe, self.pe_cache[:bsz, :end_pos])) * self.softmax_scale
        if mask is not None:
            scores += mask.unsqueeze(1)
        scores = scores.softmax(dim=-1, dtype=torch.float32).type_as(x)
        x = torch.einsum("bsht,btc->bshc", scores, self.kv_cache[:bsz, :end_pos])
        x = torch.einsum("bshc,hdc->bshd", x, wkv_b[:, -a.v_head_dim :])
        return self.wo(x.flatten(2))


class Block(nn.Module):
    def __init__(self, args: Args):
        super().__init__()
        self.attn = MLA(args)
        self.attn_norm = RMSNorm(args.dim)
        self.ffn_norm = RMSNorm(args.dim)
        self.ffn = nn.Sequential(nn.Linear(args.dim, 2 * args.dim, bias=False), nn.SiLU(),
                                 nn.Linear(2 * args.dim, args.dim, bias=False))

    def forward(self, x, start_pos, freqs, mask):
        x = x + self.attn(self.attn_norm(x), start_pos, freqs, mask)
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: Args):
        super().__init__()
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim)
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("freqs_cis", complex_freqs(args), persistent=False)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int = 0):
        seqlen = tokens.shape[1]
        h = self.embed(tokens)
        freqs = self.freqs_cis[start_pos : start_pos + seqlen]
        mask = None
        if seqlen > 1:
            mask = torch.full((seqlen, seqlen), float("-inf"), device=tokens.device).triu_(1)
        for layer in self.layers:
            h = layer(h, start_pos, freqs, mask)
        return self.head(self.norm(h)[:, -1])


def build(args: Args = Args(), dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(args)
    for p in model.parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=1 / math.sqrt(p.shape[1]))
        p.data = p.data.to(dtype)
    for name, buffer in model.named_buffers():
        if not buffer.is_complex():  # freqs_cis stays complex64, as DeepSeek keeps it
            buffer.data = buffer.data.to(dtype)
    return model.eval()
