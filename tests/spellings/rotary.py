"""RoPE as model code spells it: every function takes x [tokens, heads, d] (a query after its head
split), positions [tokens] and an fp32 `cos_sin_cache` [max_pos, d] (cos | sin halves, as vLLM and SGLang
keep it) and returns x rotated, in x's dtype. Each notes its pairing: GPT-J / DeepSeek pairs
(x[2i], x[2i+1]) or NeoX / Llama halves (x[i], x[i + d/2]).

Spellings: vLLM / SGLang `forward_native` (both pairings, slicing or chunk, partial rotary dims), serving
code's fp32 GPT-J, Llama's rotate_half with cos/sin duplicated to full width (by cat or by repeat),
DeepSeek's complex multiplication (reference code and transformers' V2), GPT-J's `rotate_every_two`,
angles computed in the graph with a stacked swap.
"""

from __future__ import annotations

import torch

TOKENS, HEADS, DIM, MAX_POS = 3, 4, 16, 64


def make_inputs(dtype=torch.bfloat16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    inv = 1.0 / 10000 ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM)
    angles = torch.outer(torch.arange(MAX_POS, dtype=torch.float32), inv)
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1)
    x = torch.randn(TOKENS, HEADS, DIM, generator=gen).to(dtype)
    return x, torch.tensor([3, 17, 40]), cache


def _cos_sin(positions, cache):
    return cache[positions].chunk(2, dim=-1)  # [T, d/2] each


def native_gptj(x, positions, cache):
    cos, sin = (t.unsqueeze(-2).to(x.dtype) for t in _cos_sin(positions, cache))
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def native_neox(x, positions, cache):
    cos, sin = (t.unsqueeze(-2).to(x.dtype) for t in _cos_sin(positions, cache))
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def native_neox_partial(x, positions, cache):
    """Half the dims rotated (a rotary_dim of d/2: cos/sin of the first d/4 frequencies)."""
    cos, sin = (t[:, : DIM // 4].unsqueeze(-2).to(x.dtype) for t in _cos_sin(positions, cache))
    rot, rest = x[..., : DIM // 2], x[..., DIM // 2 :]
    x1, x2 = torch.chunk(rot, 2, dim=-1)
    return torch.cat((torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1), rest), dim=-1)


def serving_gptj_fp32(x, positions, cache):
    cos, sin = (t[:, None, :] for t in _cos_sin(positions, cache))
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)


def llama_rotate_half(x, positions, cache):
    cos, sin = _cos_sin(positions, cache)
    cos, sin = (torch.cat((t, t), dim=-1)[:, None, :].to(x.dtype) for t in (cos, sin))
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def llama_rotate_half_chunk(x, positions, cache):
    """rotate_half by chunk, cos/sin duplicated by repeat."""
    cos, sin = (t.repeat(1, 2).unsqueeze(1).to(x.dtype) for t in _cos_sin(positions, cache))
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def deepseek_complex(x, positions, cache):
    """DeepSeek's reference code: pairs as complex numbers times cis(angle)."""
    cos, sin = _cos_sin(positions, cache)
    freqs = torch.complex(cos, sin)[:, None, :]
    as_complex = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(as_complex * freqs).flatten(-2).to(x.dtype)


def gptj_rotate_every_two(x, positions, cache):
    """GPT-J's model code: rotate_every_two, with cos/sin repeated per pair."""
    cos, sin = (torch.repeat_interleave(t, 2, dim=-1)[:, None, :].to(x.dtype) for t in _cos_sin(positions, cache))
    rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    return x * cos + rotated * sin


def native_gptj_index_select(x, positions, cache):
    cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def angles_in_graph_stacked_swap(x, positions, cache):
    """The angles computed in the graph from the positions (no cache read), cos/sin repeated per pair,
    the swap stacked and reshaped: GPT-J pairs."""
    inv = 1.0 / 10000 ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM)
    angles = positions[:, None].float() * inv[None, :]
    cos, sin = (t.repeat_interleave(2, dim=-1)[:, None, :].to(x.dtype) for t in (angles.cos(), angles.sin()))
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return x * cos + torch.stack((-x2, x1), dim=-1).reshape(x.shape) * sin


SPELLINGS = {fn.__name__: fn for fn in (
    native_gptj, native_neox, native_neox_partial, serving_gptj_fp32, llama_rotate_half, llama_rotate_half_chunk,
    deepseek_complex, gptj_rotate_every_two, native_gptj_index_select, angles_in_graph_stacked_swap,
)}
STYLE = {"native_neox": "neox", "native_neox_partial": "neox", "llama_rotate_half": "neox",
         "llama_rotate_half_chunk": "neox"}  # the others: GPT-J pairs ("interleaved")
ROTARY = {"native_neox_partial": DIM // 2}
