"""q_b_absorb: the query side of absorbed MLA decode into `mla::q_b_absorb`.

Serving code (SGLang / vLLM torch-native backends, models/mla.py) builds the decode query as:
q_b_proj of the normed q latent, the split of each head into q_nope | q_pe, q_nope absorbed into
latent space by a bmm with W_kc ([H, nope, L], a view of kv_b_proj's weight), DeepSeek's interleaved RoPE on q_pe,
both written into one [tokens, heads, kv_lora_rank + rope] query. The op computes all of it from
the fp32 GEMM row, on the projection templates' GEMM.

transformers' DeepSeek never absorbs: its decode query is q_b_proj, the head split and RoPE, and
attention runs over decompressed keys. Once mla_decode has rewritten that attention into latent
attention (which absorbs q_nope with W_kc) and rope has made the rotation an `mla::apply_rope`, the
same query is there to fuse, in whichever rotation style the model uses: the pass runs again after
a round of rewrites for this.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch._inductor.pattern_matcher import Match

from ..lowerings.segment_gemm import template_wins
from ..ops.q_b_absorb import check_args
from .registry import node_value, register_fusion, size_hint
from .rope import gptj_upcast

FUSION = "q_b_absorb"


# --- search function: the model code -------------------------------------------------------------


def absorbed_query(q_a, q_b_weight, w_kc, cos, sin):
    """q_a [T, q_lora_rank] (normed), w_kc [H, nope, L], cos/sin [T, rope / 2] -> [T, H, L + rope]."""
    heads, nope, kv_lora_rank = w_kc.shape
    rope = 2 * cos.shape[-1]
    q = F.linear(q_a, q_b_weight)
    q_nope, q_pe = q.view(-1, heads, nope + rope).split([nope, rope], dim=-1)
    q_pe = gptj_upcast(q_pe, cos[:, None, :], sin[:, None, :])  # DeepSeek's interleaved rope, in fp32
    q_input = q_a.new_empty(q_a.shape[0], heads, kv_lora_rank + rope)
    q_input[..., :kv_lora_rank] = torch.bmm(q_nope.transpose(0, 1), w_kc).transpose(0, 1)
    q_input[..., kv_lora_rank:] = q_pe
    return q_input


def absorbed_query_replacement(q_a, q_b_weight, w_kc, cos, sin):
    return torch.ops.mla.q_b_absorb(q_a, q_b_weight, w_kc, cos, sin, "interleaved")


def transformers_absorbed_query(style: str):
    """transformers' decode query (one new token per request), absorbed by mla_decode's rewrite:
    q_a [B, 1, q_lora_rank], cos/sin [B or 1, 1, 1, rope / 2] as `mla::apply_rope` takes them."""

    def search(q_a, q_b_weight, w_kc, cos, sin):
        heads, nope, _ = w_kc.shape
        rope = 2 * cos.shape[-1]
        q = F.linear(q_a, q_b_weight).view(q_a.shape[0], 1, -1, nope + rope).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [nope, rope], dim=-1)
        q_pe = torch.ops.mla.apply_rope(q_pe, cos, sin, style)
        q_lat = torch.bmm(q_nope[:, :, 0].transpose(0, 1), w_kc).transpose(0, 1)
        return torch.cat([q_lat, q_pe[:, :, 0]], dim=-1)

    def replacement(q_a, q_b_weight, w_kc, cos, sin):
        batch, half = q_a.shape[0], cos.shape[-1]
        cos, sin = (t.expand(batch, 1, 1, half).reshape(batch, half) for t in (cos, sin))
        return torch.ops.mla.q_b_absorb(q_a.reshape(batch, -1), q_b_weight, w_kc, cos, sin, style)

    return search, replacement


# --- preconditions --------------------------------------------------------------------------------


def check(match: Match) -> Optional[str]:
    kw = {name: node_value(arg) for name, arg in match.kwargs.items()}
    q_a, w_kc = kw["q_a"], kw["w_kc"]
    if q_a.dim() == 3:  # transformers' [B, 1, q_lora_rank]: rows by batch, cos/sin broadcast over it
        cos = kw["cos"]
        if q_a.shape[1] != 1 or cos.dim() != 4 or cos.shape[0] not in (1, q_a.shape[0]) or cos.shape[1:3] != (1, 1):
            return f"q_a {list(q_a.shape)} with cos {list(cos.shape)} is not one decode token per request"
        batch, half = q_a.shape[0], cos.shape[-1]
        q_a = q_a.reshape(batch, -1)
        kw["cos"], kw["sin"] = (kw[n].expand(batch, 1, 1, half).reshape(batch, half) for n in ("cos", "sin"))
    rows = size_hint(q_a.shape[0])
    if not template_wins(rows, q_a.dtype):
        return f"{rows} rows: the GEMM is compute-bound there and Inductor's own path (oneDNN) is faster"
    try:
        check_args(q_a, kw["q_b_weight"], w_kc, kw["cos"], kw["sin"])
    except ValueError as error:
        return str(error).removeprefix("mla::q_b_absorb: ")
    return None


# --- registration ---------------------------------------------------------------------------------


def _example_inputs(dtype: torch.dtype) -> list:
    """All sizes distinct, so that no view or split traces as a no-op."""
    tokens, q_lora_rank, heads, nope, kv_lora_rank, rope = 5, 24, 3, 8, 20, 6
    return [
        torch.empty(tokens, q_lora_rank, dtype=dtype),
        torch.empty(heads * (nope + rope), q_lora_rank, dtype=dtype),
        torch.empty(heads, nope, kv_lora_rank, dtype=dtype),
        torch.empty(tokens, rope // 2, dtype=dtype),
        torch.empty(tokens, rope // 2, dtype=dtype),
    ]


def _transformers_inputs() -> list:
    batch, q_lora_rank, heads, nope, kv_lora_rank, rope = 2, 24, 3, 8, 20, 6
    return [
        torch.empty(batch, 1, q_lora_rank),
        torch.empty(heads * (nope + rope), q_lora_rank),
        torch.empty(heads, nope, kv_lora_rank),
        torch.empty(batch, 1, 1, rope // 2),
        torch.empty(batch, 1, 1, rope // 2),
    ]


def register() -> None:
    for dtype in (torch.bfloat16, torch.float32):
        register_fusion(
            FUSION,
            absorbed_query,
            absorbed_query_replacement,
            _example_inputs(dtype),
            check,
            functionalize=True,  # the query is assembled in place
        )
    for style in ("interleaved_to_halves", "neox", "interleaved"):  # V3, V3 rope_interleave=False, V2
        search, replacement = transformers_absorbed_query(style)
        register_fusion(FUSION, search, replacement, _transformers_inputs(), check)
