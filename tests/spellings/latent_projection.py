"""The A projections of an MLA layer and their norms, spelled as model code spells them: every function
takes the hidden states and the weights and returns (q latent normed, c_kv normed, k_pe).

Spellings: two Linears (transformers, DeepSeek's reference code) or one over the concatenated weight
(vLLM / SGLang) split by `split` or by slicing; RMSNorm as transformers writes it, as `F.rms_norm`, as
`torch.nn.RMSNorm`, or written out Llama-style; `x @ w.T` for the Linear; with and without bias; with and
without a q LoRA; tokens as [T, hidden] or [B, S, hidden].
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

HIDDEN, Q_LORA, LATENT, ROPE = 64, 24, 32, 8
EPS = 1e-6


@dataclasses.dataclass
class Inputs:
    x: torch.Tensor
    q_weight: torch.Tensor  # [q_lora_rank, hidden]
    kv_weight: torch.Tensor  # [L + R, hidden]
    q_bias: torch.Tensor
    kv_bias: torch.Tensor
    q_norm: torch.Tensor
    kv_norm: torch.Tensor

    @property
    def fused_weight(self) -> torch.Tensor:
        return torch.cat([self.q_weight, self.kv_weight])


def make_inputs(dtype=torch.bfloat16, shape=(3, HIDDEN), seed: int = 0) -> Inputs:
    gen = torch.Generator().manual_seed(seed)

    def randn(*s, std=1.0):
        return (torch.randn(*s, generator=gen) * std).to(dtype)

    return Inputs(randn(*shape), randn(Q_LORA, HIDDEN, std=HIDDEN**-0.5), randn(LATENT + ROPE, HIDDEN, std=HIDDEN**-0.5),
                  randn(Q_LORA, std=0.1), randn(LATENT + ROPE, std=0.1), 1 + randn(Q_LORA, std=0.1),
                  1 + randn(LATENT, std=0.1))


def hf_rms_norm(x, weight):
    xf = x.to(torch.float32)
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def torch_rms_norm(x, weight):
    return F.rms_norm(x, (x.shape[-1],), weight, EPS)


def module_rms_norm(x, weight):
    norm = torch.nn.RMSNorm(x.shape[-1], eps=EPS, dtype=weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm(x)


# --- the spellings ----------------------------------------------------------------------------------


def transformers_two_linears(x: Inputs):
    q = hf_rms_norm(F.linear(x.x, x.q_weight), x.q_norm)
    c_kv, k_pe = F.linear(x.x, x.kv_weight).split([LATENT, ROPE], dim=-1)
    return q, hf_rms_norm(c_kv, x.kv_norm), k_pe


def deepseek_reference(x: Inputs):
    q = torch_rms_norm(F.linear(x.x, x.q_weight), x.q_norm)
    kv, k_pe = torch.split(F.linear(x.x, x.kv_weight), [LATENT, ROPE], dim=-1)
    return q, torch_rms_norm(kv, x.kv_norm), k_pe


def nn_rms_norm(x: Inputs):
    q = F.rms_norm(F.linear(x.x, x.q_weight), (Q_LORA,), x.q_norm, EPS)
    kv = F.linear(x.x, x.kv_weight)
    return q, F.rms_norm(kv[..., :LATENT], (LATENT,), x.kv_norm, EPS), kv[..., LATENT:]


def fused_weight_split(x: Inputs):
    q, c_kv, k_pe = F.linear(x.x, x.fused_weight).split([Q_LORA, LATENT, ROPE], dim=-1)
    return hf_rms_norm(q, x.q_norm), hf_rms_norm(c_kv, x.kv_norm), k_pe


def fused_weight_two_splits(x: Inputs):
    q, kv = F.linear(x.x, x.fused_weight).split([Q_LORA, LATENT + ROPE], dim=-1)
    c_kv, k_pe = kv.split([LATENT, ROPE], dim=-1)
    return torch_rms_norm(q, x.q_norm), torch_rms_norm(c_kv, x.kv_norm), k_pe


def matmul_transposed_weight(x: Inputs):
    q = hf_rms_norm(x.x @ x.q_weight.T, x.q_norm)
    kv = x.x @ x.kv_weight.t()
    c_kv, k_pe = kv.split([LATENT, ROPE], dim=-1)
    return q, hf_rms_norm(c_kv, x.kv_norm), k_pe


def with_bias(x: Inputs):
    q = hf_rms_norm(F.linear(x.x, x.q_weight, x.q_bias), x.q_norm)
    c_kv, k_pe = F.linear(x.x, x.kv_weight, x.kv_bias).split([LATENT, ROPE], dim=-1)
    return q, hf_rms_norm(c_kv, x.kv_norm), k_pe


def no_q_lora(x: Inputs):
    """DeepSeek-V2-Lite: q_proj straight from x, no q norm (its q is returned un-normed)."""
    c_kv, k_pe = F.linear(x.x, x.kv_weight).split([LATENT, ROPE], dim=-1)
    return F.linear(x.x, x.q_weight), torch_rms_norm(c_kv, x.kv_norm), k_pe


def fused_weight_slicing(x: Inputs):
    out = F.linear(x.x, x.fused_weight)
    q, c_kv, k_pe = out[..., :Q_LORA], out[..., Q_LORA : Q_LORA + LATENT], out[..., Q_LORA + LATENT :]
    return hf_rms_norm(q, x.q_norm), hf_rms_norm(c_kv, x.kv_norm), k_pe


def llama_style_norm(x: Inputs):
    """RMSNorm written Llama-style: normalise in fp32, cast back, then multiply by the weight."""

    def norm(t, w):
        tf = t.float()
        return w * (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + EPS)).to(t.dtype)

    q = norm(F.linear(x.x, x.q_weight), x.q_norm)
    c_kv, k_pe = torch.split(F.linear(x.x, x.kv_weight), [LATENT, ROPE], -1)
    return q, norm(c_kv, x.kv_norm), k_pe


SPELLINGS = {fn.__name__: fn for fn in (
    transformers_two_linears, deepseek_reference, nn_rms_norm, fused_weight_split, fused_weight_two_splits,
    matmul_transposed_weight, with_bias, no_q_lora, fused_weight_slicing, llama_style_norm,
)}


def reference_fp64(x: Inputs, bias: bool = False, q_norm: bool = True):
    d = torch.float64

    def norm(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + EPS) * w.to(d)

    q = x.x.to(d) @ x.q_weight.to(d).T + (x.q_bias.to(d) if bias else 0)
    kv = x.x.to(d) @ x.kv_weight.to(d).T + (x.kv_bias.to(d) if bias else 0)
    return (norm(q, x.q_norm) if q_norm else q), norm(kv[..., :LATENT], x.kv_norm), kv[..., LATENT:]
