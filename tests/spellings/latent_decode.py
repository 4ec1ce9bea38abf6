"""Absorbed MLA decode attention, spelled as model code spells it: every function takes the decode query
(latent part q_lat [B, H, L] and rope part q_pe [B, H, R], or their concatenation), the latent cache in
some layout, the lengths and W_vc, and returns [B, H, v_head_dim] (or the latent output [B, H, L]).

The spellings are drawn from the ways serving code, DeepSeek's reference code and transformers'
remote code write this attention: einsum / bmm / matmul / `@`; the cache paged by a block table,
gathered by a per-token index, or dense per sequence (one tensor, or latent + rope in two); the query
as one tensor or two; the scale on the scores, on q or as a division; the mask by masked_fill,
where, or an additive bias; softmax in fp32 by `.float()` or by `dtype=`; heads before or after batch.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

HEADS, LATENT, ROPE, V_HEAD = 4, 32, 8, 16
BLOCK_SIZE, MAX_BLOCKS = 4, 4
ROWS = BLOCK_SIZE * MAX_BLOCKS
SEQ_LENS = (5, 9, 16)
SCALE = (16 + ROPE) ** -0.5  # 1 / sqrt(qk_nope + rope), as DeepSeek scales


@dataclasses.dataclass
class Inputs:
    q_lat: torch.Tensor  # [B, H, L]
    q_pe: torch.Tensor  # [B, H, R]
    paged: torch.Tensor  # [blocks, block_size, L + R]
    block_tables: torch.Tensor  # [B, max_blocks]
    seq_lens: torch.Tensor  # [B]
    w_vc: torch.Tensor  # [H, v_head_dim, L]

    @property
    def batch(self) -> int:
        return self.q_lat.shape[0]

    def dense(self) -> torch.Tensor:
        """The same rows as one dense [B, rows, L + R] cache (a request's rows, then its unused tail)."""
        return self.paged[self.block_tables].flatten(1, 2).contiguous()

    def per_token(self) -> tuple[torch.Tensor, torch.Tensor]:
        """SGLang's layout: a [tokens, L + R] pool and a request-to-token index [B, rows]."""
        block_size = self.paged.shape[1]
        pool = self.paged.flatten(0, 1)
        rows = torch.arange(ROWS)
        index = self.block_tables[:, rows // block_size] * block_size + rows % block_size
        return pool, index


def make_inputs(dtype=torch.bfloat16, batch: int = len(SEQ_LENS), seed: int = 0, block_size: int = BLOCK_SIZE,
                heads: int = HEADS, seq_lens=None) -> Inputs:
    """A batch of requests whose ROWS cache rows lie in blocks of `block_size` (a divisor of ROWS; 1 is
    SGLang's token-granular pool), request b seeing its first seq_lens[b] rows (SEQ_LENS by default)."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = ROWS // block_size
    blocks = batch * max_blocks + 3
    tables = torch.randperm(blocks, generator=gen)[: batch * max_blocks].view(batch, max_blocks).to(torch.int32)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    return Inputs(
        q_lat=randn(batch, heads, LATENT),
        q_pe=randn(batch, heads, ROPE),
        paged=randn(blocks, block_size, LATENT + ROPE),
        block_tables=tables,
        seq_lens=torch.tensor(SEQ_LENS[:batch] if seq_lens is None else seq_lens),
        w_vc=randn(heads, V_HEAD, LATENT, std=LATENT**-0.5),
    )


def _valid(seq_lens, rows=ROWS):
    return torch.arange(rows, device=seq_lens.device)[None, :] < seq_lens[:, None]  # [B, rows]


# --- the spellings ----------------------------------------------------------------------------------


def serving_einsum_paged(q_lat, q_pe, paged, block_tables, seq_lens, w_vc):
    """An independent serving layer: query by cat, fp32 einsums over a paged gather, masked_fill."""
    return serving_attention(torch.cat([q_lat, q_pe], dim=-1), paged, block_tables, seq_lens, w_vc)


def serving_attention(q, paged, block_tables, seq_lens, w_vc):
    kv = paged[block_tables].flatten(1, 2).float()
    scores = torch.einsum("bhc,btc->bht", q.float(), kv) * SCALE
    scores = scores.masked_fill(~_valid(seq_lens)[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bht,btc->bhc", probs, kv[..., :LATENT])
    return torch.einsum("bhc,hdc->bhd", out, w_vc.float()).to(q.dtype)


def deepseek_two_caches(q_lat, q_pe, latent_cache, rope_cache, w_vc):
    """DeepSeek's reference "absorb" attention: dense kv_cache and pe_cache, one query row per request
    ([B, 1, H, ...]), scores summed and scaled in the model dtype, softmax in fp32 by `dtype=`."""
    end = latent_cache.shape[1]
    q_nope, q_pe = q_lat.unsqueeze(1), q_pe.unsqueeze(1)
    scores = (torch.einsum("bshc,btc->bsht", q_nope, latent_cache[:, :end])
              + torch.einsum("bshr,btr->bsht", q_pe, rope_cache[:, :end])) * SCALE
    scores = scores.softmax(dim=-1, dtype=torch.float32).type_as(q_lat)
    x = torch.einsum("bsht,btc->bshc", scores, latent_cache[:, :end])
    return torch.einsum("bshc,hdc->bshd", x, w_vc).squeeze(1)


def matmul_broadcast_heads(q_lat, q_pe, paged, block_tables, seq_lens, w_vc):
    """`@` with the cache broadcast over a heads dim, the mask by where, W_vc by a heads-first matmul."""
    q = torch.cat([q_lat, q_pe], dim=-1).unsqueeze(2)  # [B, H, 1, D]
    kv = paged[block_tables].flatten(1, 2).unsqueeze(1)  # [B, 1, T, D]
    scores = (q @ kv.transpose(-1, -2)).float() * SCALE  # [B, H, 1, T]
    scores = torch.where(_valid(seq_lens)[:, None, None, :], scores, float("-inf"))
    probs = scores.softmax(-1).to(q.dtype)
    o = (probs @ kv[..., :LATENT]).squeeze(2)  # [B, H, L]
    return (o.transpose(0, 1) @ w_vc.transpose(1, 2)).transpose(0, 1)


def heads_in_batch_bmm(q_lat, q_pe, paged, block_tables, seq_lens, w_vc):
    """bmm over batch x heads (the cache expanded to every head), an additive -inf bias."""
    b, h, _ = q_lat.shape
    q = torch.cat([q_lat, q_pe], dim=-1).reshape(b * h, 1, -1)
    kv = paged[block_tables].flatten(1, 2)
    k = kv[:, None].expand(b, h, ROWS, kv.shape[-1]).reshape(b * h, ROWS, -1)
    bias = torch.zeros(b, ROWS).masked_fill(~_valid(seq_lens), float("-inf"))
    scores = torch.bmm(q, k.transpose(1, 2)).view(b, h, ROWS).float() * SCALE + bias[:, None, :]
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(b * h, 1, ROWS)
    o = torch.bmm(probs, k[..., :LATENT]).view(b, h, LATENT)
    return torch.einsum("bhc,hvc->bhv", o, w_vc)


def scale_on_query(q_lat, q_pe, paged, block_tables, seq_lens, w_vc):
    """The scale multiplies q before the product; fp32 by `.float()` on both sides."""
    q = torch.cat([q_lat, q_pe], dim=-1).float() * SCALE
    kv = paged[block_tables].flatten(1, 2).float()
    scores = torch.matmul(q, kv.transpose(1, 2)).masked_fill(~_valid(seq_lens)[:, None], float("-inf"))
    o = torch.matmul(F.softmax(scores, dim=-1), kv[:, :, :LATENT])
    return torch.matmul(o.transpose(0, 1), w_vc.float().transpose(1, 2)).transpose(0, 1).to(q_lat.dtype)


def divide_by_sqrt(q_lat, q_pe, paged, block_tables, seq_lens, w_vc):
    """Scores divided by sqrt(d), separate products of the two query parts with one cache's columns."""
    kv = paged[block_tables].flatten(1, 2)
    c, k_pe = kv[..., :LATENT], kv[..., LATENT:]
    scores = torch.bmm(q_lat, c.transpose(1, 2)) + torch.bmm(q_pe, k_pe.transpose(1, 2))
    scores = scores.float() / math.sqrt(1 / SCALE**2)
    scores = scores.masked_fill(~_valid(seq_lens).unsqueeze(1), float("-inf"))
    probs = scores.softmax(dim=-1).to(c.dtype)
    o = torch.bmm(probs, c)
    return torch.bmm(o.transpose(0, 1), w_vc.transpose(1, 2)).transpose(0, 1)


def per_token_index(q_lat, q_pe, pool, req_to_token, seq_lens, w_vc):
    """SGLang's token pool: rows gathered by a request-to-token index, one row per token."""
    q = torch.cat([q_lat, q_pe], dim=-1)
    kv = pool[req_to_token]  # [B, rows, L + R]
    scores = torch.einsum("bhd,btd->bht", q, kv).float() * SCALE
    scores = scores.masked_fill(~_valid(seq_lens)[:, None, :], float("-inf"))
    probs = scores.softmax(-1).to(q.dtype)
    return torch.einsum("bhc,hdc->bhd", torch.einsum("bht,btc->bhc", probs, kv[..., :LATENT]), w_vc)


def latent_output_only(q_lat, q_pe, paged, block_tables, seq_lens):
    """No W_vc in the attention: the latent output leaves for a separate projection."""
    q = torch.cat([q_lat, q_pe], dim=-1)
    kv = paged[block_tables].flatten(1, 2)
    scores = (q.float() @ kv.float().transpose(-2, -1)) * SCALE
    scores = scores.masked_fill(~_valid(seq_lens)[:, None], float("-inf"))
    return (scores.softmax(-1) @ kv[..., :LATENT].float()).to(q.dtype)


def w_uv_latent_by_value(q_lat, q_pe, paged, block_tables, seq_lens, w_vc):
    """W_vc held as [H, L, v_head_dim] (a transposed copy, as some loaders store W_UV), heads first."""
    w_uv = w_vc.transpose(1, 2).contiguous()
    q = torch.cat([q_lat, q_pe], dim=-1).transpose(0, 1)  # [H, B, D]
    kv = paged[block_tables].flatten(1, 2)  # [B, T, D]
    scores = torch.einsum("hbd,btd->hbt", q, kv) * SCALE
    scores = scores.float().masked_fill(~_valid(seq_lens)[None], float("-inf"))
    probs = scores.softmax(dim=-1).type_as(q)
    o = torch.einsum("hbt,btc->hbc", probs, kv[..., :LATENT])
    return torch.bmm(o, w_uv).transpose(0, 1)


def dense_one_cache(q_lat, q_pe, dense, seq_lens, w_vc):
    """One dense [B, max_len, L + R] cache per sequence, lengths masked by where on positions."""
    q = torch.cat([q_lat, q_pe], dim=-1)
    scores = torch.einsum("bhd,btd->bht", q.float(), dense.float()) * SCALE
    positions = torch.arange(dense.shape[1])
    scores = torch.where(positions[None, None, :] < seq_lens[:, None, None], scores, -math.inf)
    probs = torch.softmax(scores, -1).to(dense.dtype)
    return torch.einsum("bhc,hdc->bhd", torch.einsum("bht,btc->bhc", probs, dense[..., :LATENT]), w_vc)


def spelling_args(name: str, inputs: Inputs) -> tuple:
    """The arguments each spelling takes, in its cache layout."""
    x = inputs
    if name == "deepseek_two_caches":
        dense = x.dense()
        # DeepSeek's caches hold max_seq_len rows; a decode step reads [:end_pos], here every row
        return x.q_lat, x.q_pe, dense[..., :LATENT].contiguous(), dense[..., LATENT:].contiguous(), x.w_vc
    if name == "per_token_index":
        pool, index = x.per_token()
        return x.q_lat, x.q_pe, pool, index, x.seq_lens, x.w_vc
    if name == "dense_one_cache":
        return x.q_lat, x.q_pe, x.dense(), x.seq_lens, x.w_vc
    if name == "latent_output_only":
        return x.q_lat, x.q_pe, x.paged, x.block_tables, x.seq_lens
    return x.q_lat, x.q_pe, x.paged, x.block_tables, x.seq_lens, x.w_vc


def mark_dynamic(args: tuple, inputs: Inputs) -> tuple:
    """`args` with the dims a server compiles as dynamic (once for every batch and length) marked so:
    the batch of every per-request tensor, the rows of block tables, indices and dense caches, the
    blocks (or tokens) of a pool. W_vc, a weight, stays static."""
    for t in args:
        if t is inputs.w_vc:
            continue
        per_row = t.dtype in (torch.int32, torch.int64) or tuple(t.shape[:2]) == (inputs.batch, ROWS)
        for dim in range(min(t.dim(), 2) if per_row else 1):
            torch._dynamo.maybe_mark_dynamic(t, dim)
    return args


SPELLINGS = {fn.__name__: fn for fn in (
    serving_einsum_paged, deepseek_two_caches, matmul_broadcast_heads, heads_in_batch_bmm, scale_on_query,
    divide_by_sqrt, per_token_index, latent_output_only, w_uv_latent_by_value, dense_one_cache,
)}


def reference_fp64(inputs: Inputs, lengths=None, w_vc: bool = True) -> torch.Tensor:
    """Independent of every spelling: per request, per head, softmax over its rows in fp64."""
    x = inputs
    dense = x.dense().double()
    lengths = x.seq_lens.tolist() if lengths is None else lengths
    out = []
    for b, n in enumerate(lengths):
        q = torch.cat([x.q_lat[b], x.q_pe[b]], -1).double()  # [H, D]
        p = torch.softmax(q @ dense[b, :n].T * SCALE, dim=-1)
        o = p @ dense[b, :n, :LATENT]  # [H, L]
        out.append(torch.einsum("hc,hdc->hd", o, x.w_vc.double()) if w_vc else o)
    return torch.stack(out)
