"""The absorbed decode query, spelled as model code spells it: q_b_proj of the normed q latent, the split
of each head into q_nope | q_pe, q_nope absorbed by W_kc, q_pe rotated, the two concatenated; then a
latent attention (latent_decode.serving_einsum_paged's) that mla_decode rewrites, after which q_b_absorb
takes the query.

Spellings: einsum, bmm, matmul or `@` for the absorption; W_kc as [H, nope, L], as a view of kv_b_proj's
weight, or as a transposed copy [H, L, nope]; the heads split by view, reshape or unflatten and the
parts by split or slicing; RoPE as vLLM / SGLang `forward_native` (GPT-J or NeoX pairs) or serving code's
fp32 GPT-J, cos/sin from `cos_sin_cache[positions]` or `index_select`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from mla_inductor.ops.rope import apply_rope_fp64

from . import latent_decode as ld

Q_LORA, NOPE, MAX_POS = 24, 16, 64
HEADS, LATENT, ROPE = ld.HEADS, ld.LATENT, ld.ROPE


@dataclasses.dataclass
class Inputs:
    q_a: torch.Tensor  # [T, q_lora_rank], normed
    q_b_weight: torch.Tensor  # [H * (nope + rope), q_lora_rank]
    wkv_b: torch.Tensor  # [H * (nope + v_head_dim), L]: W_kc and W_vc
    cos_sin_cache: torch.Tensor  # [max_pos, rope]: cos | sin halves, fp32
    positions: torch.Tensor  # [T]
    cache: ld.Inputs  # the latent cache side

    @property
    def w_kc(self) -> torch.Tensor:
        return self.wkv_b.view(HEADS, -1, LATENT)[:, :NOPE]

    @property
    def w_vc(self) -> torch.Tensor:
        return self.wkv_b.view(HEADS, -1, LATENT)[:, NOPE:]


def make_inputs(dtype=torch.bfloat16, seed: int = 0, batch: int = len(ld.SEQ_LENS)) -> Inputs:
    cache = ld.make_inputs(dtype, batch=batch, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = cache.batch
    inv = 1.0 / 10000 ** (torch.arange(0, ROPE, 2, dtype=torch.float32) / ROPE)
    angles = torch.outer(torch.arange(MAX_POS, dtype=torch.float32), inv)
    return Inputs(
        q_a=torch.randn(tokens, Q_LORA, generator=gen).to(dtype),
        q_b_weight=(torch.randn(HEADS * (NOPE + ROPE), Q_LORA, generator=gen) * Q_LORA**-0.5).to(dtype),
        wkv_b=(torch.randn(HEADS * (NOPE + ld.V_HEAD), LATENT, generator=gen) * LATENT**-0.5).to(dtype),
        cos_sin_cache=torch.cat([angles.cos(), angles.sin()], dim=-1),
        positions=torch.tensor([7, 20, 41][:tokens]),
        cache=cache,
    )


def mark_dynamic(x: Inputs) -> Inputs:
    """x with the dims a server compiles as dynamic marked so: tokens, and the cache's requests and rows
    (latent_decode.mark_dynamic); the weights and the cos / sin table stay static."""
    c = x.cache
    ld.mark_dynamic((c.q_lat, c.q_pe, c.paged, c.block_tables, c.seq_lens), c)
    for t in (x.q_a, x.positions):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    return x


def _attention(q, x: Inputs):
    c = x.cache
    return ld.serving_attention(q, c.paged, c.block_tables, c.seq_lens, x.w_vc)


def _native(q_pe, cos, sin, is_neox):
    """vLLM / SGLang forward_native's rotation: cos/sin [T, rope / 2] in the model dtype."""
    cos, sin = cos.unsqueeze(-2).to(q_pe.dtype), sin.unsqueeze(-2).to(q_pe.dtype)
    x1, x2 = torch.chunk(q_pe, 2, dim=-1) if is_neox else (q_pe[..., ::2], q_pe[..., 1::2])
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return torch.cat((o1, o2), dim=-1) if is_neox else torch.stack((o1, o2), dim=-1).flatten(-2)


def _gptj_fp32(q_pe, cos, sin):
    """Serving code's interleaved rotation in fp32, cos/sin [T, rope / 2]."""
    x1, x2 = q_pe[..., 0::2].float(), q_pe[..., 1::2].float()
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(q_pe.dtype)


def _cos_sin(x: Inputs):
    return x.cos_sin_cache[x.positions].chunk(2, dim=-1)


# --- the spellings ----------------------------------------------------------------------------------


def _einsum_native(x: Inputs, is_neox: bool):
    q = F.linear(x.q_a, x.q_b_weight).view(-1, HEADS, NOPE + ROPE)
    q_nope, q_pe = q.split([NOPE, ROPE], dim=-1)
    q_lat = torch.einsum("thd,hdc->thc", q_nope, x.w_kc)
    return _attention(torch.cat([q_lat, _native(q_pe, *_cos_sin(x), is_neox=is_neox)], dim=-1), x)


def einsum_native_gptj(x: Inputs):
    return _einsum_native(x, is_neox=False)


def einsum_native_neox(x: Inputs):
    return _einsum_native(x, is_neox=True)


def bmm_heads_first(x: Inputs):
    q = F.linear(x.q_a, x.q_b_weight).view(-1, HEADS, NOPE + ROPE)
    q_nope, q_pe = torch.split(q, [NOPE, ROPE], dim=-1)
    q_lat = torch.bmm(q_nope.transpose(0, 1), x.w_kc).transpose(0, 1)
    return _attention(torch.cat([q_lat, _gptj_fp32(q_pe, *_cos_sin(x))], dim=-1), x)


def wkv_b_view(x: Inputs):
    """W_kc as DeepSeek's reference code reads it: a slice of kv_b_proj's weight viewed per head."""
    q = (x.q_a @ x.q_b_weight.T).view(-1, HEADS, NOPE + ROPE)
    wkv_b = x.wkv_b.view(HEADS, -1, LATENT)
    q_lat = torch.einsum("thd,hdc->thc", q[..., :NOPE], wkv_b[:, :NOPE])
    return _attention(torch.cat([q_lat, _gptj_fp32(q[..., NOPE:], *_cos_sin(x))], dim=-1), x)


def w_uk_transposed_copy(x: Inputs):
    """W_UK stored [H, L, nope], as loaders that pre-transpose kv_b_proj keep it."""
    w_uk = x.w_kc.transpose(1, 2).contiguous()
    q = F.linear(x.q_a, x.q_b_weight).reshape(-1, HEADS, NOPE + ROPE)
    q_nope, q_pe = q.split([NOPE, ROPE], dim=-1)
    q_lat = torch.einsum("thd,hcd->thc", q_nope, w_uk)
    return _attention(torch.cat([q_lat, _native(q_pe, *_cos_sin(x), is_neox=False)], dim=-1), x)


def matmul_broadcast(x: Inputs):
    q = F.linear(x.q_a, x.q_b_weight).unflatten(-1, (HEADS, NOPE + ROPE))
    q_nope, q_pe = q[..., :NOPE], q[..., NOPE:]
    q_lat = (q_nope.unsqueeze(-2) @ x.w_kc).squeeze(-2)  # [T, H, 1, nope] @ [H, nope, L]
    return _attention(torch.cat([q_lat, _native(q_pe, *_cos_sin(x), is_neox=True)], dim=-1), x)


def matmul_heads_first(x: Inputs):
    q = F.linear(x.q_a, x.q_b_weight).view(-1, HEADS, NOPE + ROPE)
    q_nope, q_pe = q.split([NOPE, ROPE], dim=-1)
    q_lat = torch.matmul(q_nope.permute(1, 0, 2), x.w_kc).permute(1, 0, 2)
    return _attention(torch.cat((q_lat, _native(q_pe, *_cos_sin(x), is_neox=False)), -1), x)


def index_select_cos_sin(x: Inputs):
    cos, sin = x.cos_sin_cache.index_select(0, x.positions).chunk(2, dim=-1)
    q = F.linear(x.q_a, x.q_b_weight).view(x.q_a.shape[0], HEADS, -1)
    q_nope, q_pe = q.split([NOPE, ROPE], dim=-1)
    q_lat = torch.einsum("thd,hdc->thc", q_nope, x.w_kc)
    return _attention(torch.cat([q_lat, _native(q_pe, cos, sin, is_neox=False)], dim=-1), x)


def per_request_3d(x: Inputs):
    """DeepSeek's [batch, seq, heads, dim] layout (one token per request) with forward_native's rotation."""
    q = F.linear(x.q_a.unsqueeze(1), x.q_b_weight).view(-1, 1, HEADS, NOPE + ROPE)
    q_nope, q_pe = torch.split(q, [NOPE, ROPE], dim=-1)
    q_lat = torch.einsum("bshd,hdc->bshc", q_nope, x.w_kc)
    q_pe = _native(q_pe.squeeze(1), *_cos_sin(x), is_neox=False)
    return _attention(torch.cat([q_lat.squeeze(1), q_pe], dim=-1), x)


def bmm_transposed_copy(x: Inputs):
    """bmm against W_UK [H, L, nope] transposed back."""
    w_uk = x.w_kc.transpose(1, 2).contiguous()
    q = F.linear(x.q_a, x.q_b_weight).view(-1, HEADS, NOPE + ROPE)
    q_lat = torch.bmm(q[:, :, :NOPE].transpose(0, 1), w_uk.transpose(1, 2)).transpose(0, 1)
    return _attention(torch.cat([q_lat, _gptj_fp32(q[:, :, NOPE:], *_cos_sin(x))], dim=-1), x)


def with_q_b_bias(x: Inputs):
    """q_b_proj with a bias (not the op's contract): q_b_absorb must decline, mla_decode still fires."""
    bias = torch.linspace(-1, 1, x.q_b_weight.shape[0]).to(x.q_a.dtype)
    q = F.linear(x.q_a, x.q_b_weight, bias).view(-1, HEADS, NOPE + ROPE)
    q_nope, q_pe = q.split([NOPE, ROPE], dim=-1)
    q_lat = torch.einsum("thd,hdc->thc", q_nope, x.w_kc)
    return _attention(torch.cat([q_lat, _native(q_pe, *_cos_sin(x), is_neox=False)], dim=-1), x)


SPELLINGS = {fn.__name__: fn for fn in (
    einsum_native_gptj, einsum_native_neox, bmm_heads_first, wkv_b_view, w_uk_transposed_copy, matmul_broadcast,
    matmul_heads_first, index_select_cos_sin, per_request_3d, bmm_transposed_copy,
)}
STYLE = {"einsum_native_neox": "neox", "matmul_broadcast": "neox"}  # the others: GPT-J pairs


def reference_fp64(x: Inputs, style: str) -> torch.Tensor:
    """From the definitions in fp64, independent of every spelling: the query, then ld.reference_fp64."""
    q = (x.q_a.double() @ x.q_b_weight.double().T).view(-1, HEADS, NOPE + ROPE)
    cos, sin = (t.double() for t in _cos_sin(x))
    q_lat = torch.einsum("thd,hdc->thc", q[..., :NOPE], x.w_kc.double())
    q_pe = apply_rope_fp64(q[..., NOPE:], cos[:, None], sin[:, None], style)
    c = x.cache
    cache = dataclasses.replace(c, q_lat=q_lat, q_pe=q_pe, w_vc=x.w_vc.contiguous())
    return ld.reference_fp64(cache)
