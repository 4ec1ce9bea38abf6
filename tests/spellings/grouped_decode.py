"""Grouped-query decode attention written out (no SDPA), spelled as model code spells it: every function
takes the decode query, the key and value caches in some layout and a mask or the lengths, and returns
the attention output in the layout its model goes on with.

The spellings are drawn from transformers' `eager_attention_forward` (repeat_kv, matmul, an additive
mask, softmax in fp32 and back; Gemma-2's logit softcap), and from the ways serving code writes the
same step: the query split into key/value heads x groups over caches [B, T, kv_heads, d] or over
pages gathered by a block table, einsum or `@`, `repeat_interleave` or a `repeat` that tiles the heads the other way round, the mask by
masked_fill or where, the scale on the scores or as a division, multi-query attention (one key/value
head), and multi-head attention (groups of one: as many key/value heads as query heads).
"""

from __future__ import annotations

import dataclasses
import math

import torch

HEADS, KV_HEADS, HEAD_DIM, V_DIM = 6, 2, 16, 8
GROUP = HEADS // KV_HEADS
ROWS = 24  # the cache's rows; requests use their first seq_lens
BLOCK_SIZE = 4  # paged_gather's pages
SEQ_LENS = (5, 17, 24)
SCALE = HEAD_DIM**-0.5
SOFTCAP = 0.7  # small enough that the cap changes the probabilities


@dataclasses.dataclass
class Inputs:
    query: torch.Tensor  # [B, H, 1, d]
    key: torch.Tensor  # [B, kv_heads, rows, d]
    value: torch.Tensor  # [B, kv_heads, rows, v]
    seq_lens: torch.Tensor  # [B]

    @property
    def batch(self) -> int:
        return self.query.shape[0]

    def additive_mask(self) -> torch.Tensor:
        """transformers' 4-D mask: 0 where a row counts, the dtype's lowest value elsewhere, [B, 1, 1, rows]."""
        valid = valid_rows(self.seq_lens)[:, None, None, :]
        return torch.where(valid, 0.0, torch.finfo(self.query.dtype).min).to(self.query.dtype)


def make_inputs(dtype=torch.float32, kv_heads: int = KV_HEADS, seed: int = 0) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    batch = len(SEQ_LENS)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    return Inputs(randn(batch, HEADS, 1, HEAD_DIM), randn(batch, kv_heads, ROWS, HEAD_DIM),
                  randn(batch, kv_heads, ROWS, V_DIM), torch.tensor(SEQ_LENS))


def valid_rows(seq_lens, rows=ROWS):
    return torch.arange(rows, device=seq_lens.device)[None, :] < seq_lens[:, None]  # [B, rows]


def repeat_kv(x, n_rep):
    batch, kv_heads, rows, head_dim = x.shape
    return x[:, :, None, :, :].expand(batch, kv_heads, n_rep, rows, head_dim).reshape(
        batch, kv_heads * n_rep, rows, head_dim)


# --- the spellings ----------------------------------------------------------------------------------


def transformers_eager(query, key, value, attention_mask):
    """transformers' eager_attention_forward (5.x), then the transpose its callers reshape."""
    key_states, value_states = repeat_kv(key, GROUP), repeat_kv(value, GROUP)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * SCALE
    causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
    attn_weights = attn_weights + causal_mask
    attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = torch.nn.functional.dropout(attn_weights, p=0.0, training=False)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous()


def gemma2_softcap(query, key, value, attention_mask):
    """Gemma-2's eager attention: the logit softcap between the scale and the mask."""
    key_states, value_states = repeat_kv(key, GROUP), repeat_kv(value, GROUP)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * SCALE
    attn_weights = attn_weights / SOFTCAP
    attn_weights = torch.tanh(attn_weights)
    attn_weights = attn_weights * SOFTCAP
    attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
    attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()


def repeat_interleave_einsum(query, key, value, seq_lens):
    """Heads repeated by repeat_interleave, einsums, the lengths masked by masked_fill, softmax by .float()."""
    k, v = key.repeat_interleave(GROUP, dim=1), value.repeat_interleave(GROUP, dim=1)
    scores = torch.einsum("bhqd,bhtd->bhqt", query, k) / math.sqrt(HEAD_DIM)
    scores = scores.masked_fill(~valid_rows(seq_lens)[:, None, None, :], float("-inf"))
    probs = scores.float().softmax(-1).type_as(query)
    return torch.einsum("bhqt,bhtd->bhqd", probs, v)


def packed_heads_token_major(query, key_nhd, value_nhd, seq_lens):
    """Serving style: caches [B, rows, kv_heads, d], the query [B, H, d] split into kv_heads x group,
    no copy of the caches per head; `where` for the mask; the output flattened for o_proj."""
    batch = query.shape[0]
    q = query.reshape(batch, KV_HEADS, GROUP, HEAD_DIM)
    scores = torch.einsum("bkgd,btkd->bkgt", q, key_nhd) * SCALE
    scores = torch.where(valid_rows(seq_lens)[:, None, None, :], scores, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.einsum("bkgt,btkd->bkgd", probs, value_nhd).reshape(batch, HEADS * V_DIM)


def paged_gather(query, key_pages, value_pages, block_tables, seq_lens):
    """Serving style over paged caches [blocks, block_size, kv_heads, d]: each request's pages gathered by
    its block table, then the packed heads' einsums."""
    batch = query.shape[0]
    k, v = key_pages[block_tables].flatten(1, 2), value_pages[block_tables].flatten(1, 2)  # [B, rows, kv, d]
    q = query.reshape(batch, KV_HEADS, GROUP, HEAD_DIM)
    scores = torch.einsum("bkgd,btkd->bkgt", q, k) * SCALE
    scores = scores.masked_fill(~valid_rows(seq_lens)[:, None, None, :], float("-inf"))
    return torch.einsum("bkgt,btkd->bkgd", scores.softmax(-1), v).reshape(batch, HEADS * V_DIM)


def tiled_heads(query, key, value, attention_mask):
    """`repeat` tiles the key/value heads: query head h reads key/value head h % kv_heads (a model trained
    so); `@`; the scale on the query."""
    k, v = key.repeat(1, GROUP, 1, 1), value.repeat(1, GROUP, 1, 1)
    scores = (query * SCALE) @ k.transpose(-1, -2) + attention_mask
    return torch.softmax(scores.float(), -1).to(query.dtype) @ v


def multi_query(query, key, value, seq_lens):
    """One key/value head for every query head (multi-query attention), broadcast by expand."""
    batch = query.shape[0]
    k, v = key.expand(batch, HEADS, ROWS, HEAD_DIM), value.expand(batch, HEADS, ROWS, V_DIM)
    scores = query @ k.transpose(-1, -2) * SCALE
    scores = scores.masked_fill(~valid_rows(seq_lens)[:, None, None, :], float("-inf"))
    return (scores.softmax(-1) @ v).squeeze(2)


def multi_head_eager(query, key, value, attention_mask):
    """transformers' eager_attention_forward of a multi-head model (Llama-2, Phi-3-mini): repeat_kv
    returns its input for groups of one."""
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * SCALE + attention_mask[:, :, :, : key.shape[-2]]
    attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(attn_weights, value).transpose(1, 2).contiguous()


def multi_head_token_major(query, key_nhd, value_nhd, seq_lens):
    """Serving style, multi-head: caches [B, rows, heads, d], einsums, the lengths by masked_fill."""
    scores = torch.einsum("bhd,bthd->bht", query, key_nhd) * SCALE
    scores = scores.masked_fill(~valid_rows(seq_lens)[:, None, :], float("-inf"))
    return torch.einsum("bht,bthd->bhd", scores.softmax(-1), value_nhd)


SPELLINGS = {fn.__name__: fn for fn in (
    transformers_eager, gemma2_softcap, repeat_interleave_einsum, packed_heads_token_major, paged_gather, tiled_heads,
    multi_query, multi_head_eager, multi_head_token_major,
)}
MULTI_HEAD = ("multi_head_eager", "multi_head_token_major")


def inputs_for(name: str, dtype=torch.float32) -> Inputs:
    return make_inputs(dtype, kv_heads=1 if name == "multi_query" else HEADS if name in MULTI_HEAD else KV_HEADS)


def spelling_args(name: str, inputs: Inputs) -> tuple:
    """The arguments each spelling takes, in its layouts."""
    x = inputs
    if name in ("packed_heads_token_major", "multi_head_token_major"):
        return x.query.squeeze(2), x.key.transpose(1, 2).contiguous(), x.value.transpose(1, 2).contiguous(), x.seq_lens
    if name == "paged_gather":  # the rows of x's caches in pages, in shuffled order, two pages unused
        blocks = x.batch * ROWS // BLOCK_SIZE
        order = torch.randperm(blocks + 2, generator=torch.Generator().manual_seed(1))[:blocks]
        tables = order.view(x.batch, -1)

        def pages(cache):
            per_block = cache.transpose(1, 2).reshape(blocks, BLOCK_SIZE, *cache.shape[1:2], cache.shape[-1])
            out = torch.zeros(blocks + 2, *per_block.shape[1:], dtype=cache.dtype)
            out[order] = per_block
            return out

        return x.query.squeeze(2), pages(x.key), pages(x.value), tables, x.seq_lens
    if name in ("repeat_interleave_einsum", "multi_query"):
        return x.query, x.key, x.value, x.seq_lens
    return x.query, x.key, x.value, x.additive_mask()


def mark_dynamic(args: tuple) -> tuple:
    """`args` with the dims a server compiles as dynamic marked so: every tensor's batch, and the rows of
    the caches and the mask (the dims of ROWS, a size no other dim has)."""
    for t in args:
        for dim, size in enumerate(t.shape):
            if dim == 0 or size == ROWS:
                torch._dynamo.maybe_mark_dynamic(t, dim)
    return args


def reference_fp64(inputs: Inputs, name: str) -> torch.Tensor:
    """Independent of every spelling: per request and query head, a softmax over the request's rows in
    fp64, in the layout `name` returns."""
    x = inputs
    kv_heads = x.key.shape[1]
    out = torch.zeros(x.batch, HEADS, V_DIM, dtype=torch.float64)
    for b, n in enumerate(x.seq_lens.tolist()):
        for h in range(HEADS):
            kv = h % kv_heads if name == "tiled_heads" else h // (HEADS // kv_heads)
            scores = x.key[b, kv, :n].double() @ x.query[b, h, 0].double() * SCALE
            if name == "gemma2_softcap":
                scores = SOFTCAP * torch.tanh(scores / SOFTCAP)
            out[b, h] = torch.softmax(scores, 0) @ x.value[b, kv, :n].double()
    if name in ("transformers_eager", "gemma2_softcap", "multi_head_eager"):
        return out[:, None]  # [B, 1, H, v]
    if name in ("packed_heads_token_major", "paged_gather"):
        return out.reshape(x.batch, HEADS * V_DIM)
    if name in ("multi_query", "multi_head_token_major"):
        return out
    return out[:, :, None]  # [B, H, 1, v]
