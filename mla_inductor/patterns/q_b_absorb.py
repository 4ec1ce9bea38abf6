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

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch._inductor.pattern_matcher import Match

from ..lowerings.segment_gemm import template_wins
from ..ops.q_b_absorb import check_args
from . import contraction
from .contraction import same
from .registry import node_value, register_anchored_rewrite, register_fusion, size_hint
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
    register_anchored_rewrite(FUSION, _latent_attention_ops, rewrite_absorbed_query)
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


# --- anchored match: the absorbed query of any latent attention the mla_decode rewrite made ----------
#
# Whatever the spelling, once mla_decode has rewritten the attention its query is `cat([q_lat, q_pe])`
# (contraction.py builds it so): q_lat read from a contraction of q_nope with W_kc, q_pe from an
# `mla::apply_rope`, and both (as einsums over what they read) slices of one q_b_proj GEMM row per
# token: q_nope its heads' first qk_nope columns, q_pe their last rope columns. This walk checks that
# and replaces the query with `mla::q_b_absorb`.


def _linear_of(mm: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node]:
    """(x, weight) of `mm(x, weight.T)`: a Linear without bias."""
    weight = contraction.trace_back(mm.args[1])
    n, k = contraction.shape(weight.origin) if weight.origin.meta["val"].dim() == 2 else (None, None)
    expected = [[contraction.Factor(1, k, 1)], [contraction.Factor(0, n, 1)]]
    if not contraction.same_dims(weight.layout.dims, expected) or weight.layout.offsets or weight.casts:
        raise contraction.Decline("q_b_proj's weight is not read as a plain transposed Linear weight")
    return mm.args[0], weight.origin


def _column_role(f: contraction.Factor, heads: int, row: int, width: int) -> str:
    """token (the GEMM's rows), head (columns by `row`) or feature (`width` columns within a head)."""
    if f.label == 0 and same(f.stride, 1):
        return "token"
    if f.label == 1 and same(f.size, heads) and same(f.stride, row):
        return "head"
    if f.label == 1 and same(f.size, width) and same(f.stride, 1):
        return "feature"
    raise contraction.Decline("a query slice is not whole heads' columns of q_b_proj")


def _slice_roles(operand: contraction.Operand, heads: int, row: int, start: int, width: int) -> list:
    """Per dim of a q_b_proj slice: (role, size, stride in the dim) of its factors (contraction.dim_roles)."""
    offsets = operand.layout.offsets
    if not same(offsets.get(0, 0), 0) or not same(offsets.get(1, 0), start) or operand.casts:
        raise contraction.Decline("a query slice does not start where the heads' columns do")
    return contraction.dim_roles(operand.layout, lambda f: _column_role(f, heads, row, width))


def _roles_in_order(operand: contraction.Operand, source_roles: list) -> list[str]:
    return [contraction.role_through(f, source_roles) for dim in operand.layout.dims for f in dim]


def _query_cat(query: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The `cat` the op's query is, element for element (through reshapes and casts), or None."""
    read = contraction.trace_back(query)
    cat = read.origin
    if cat.target is not torch.ops.aten.cat.default:
        return None
    rank = cat.meta["val"].dim()
    if cat.args[1:] and cat.args[1] % rank != rank - 1:
        return None
    plain = [[contraction.Factor(d, n, 1)] for d, n in enumerate(contraction.shape(cat)) if not same(n, 1)]
    whole = contraction.same_dims([d for d in read.layout.dims if d], plain) and not read.layout.offsets
    return cat if whole else None


def _absorbed_query(graph: torch.fx.Graph, op: torch.fx.Node, cat: torch.fx.Node) -> None:
    aten = torch.ops.aten
    Decline = contraction.Decline
    if len(cat.args[0]) != 2:
        raise Decline("the attention's query is not a latent part and a rope part")
    q_lat, q_pe = (contraction.trace_back(piece) for piece in cat.args[0])
    if q_lat.origin.target is not aten.bmm.default or q_pe.origin.target is not torch.ops.mla.apply_rope.default:
        raise Decline("the query's latent part is not a contraction or its rope part not mla::apply_rope")
    absorb = contraction.Contraction.of(q_lat.origin)
    x_is_a = absorb.a.origin.target is aten.mm.default
    x = absorb.a if x_is_a else absorb.b
    if x.origin.target is not aten.mm.default:
        raise Decline("q_nope is not read from a q_b_proj Linear (without a q LoRA there is none to fuse)")
    q_a, q_b_weight = _linear_of(x.origin)
    x_pe = contraction.trace_back(q_pe.origin.args[0])
    if x_pe.origin is not x.origin:
        raise Decline("q_nope and q_pe are not parts of one q_b_proj")
    query = op.args[0]
    tokens, heads, kv_lora_rank = contraction.shape(query)
    if not same(contraction.shape(x.origin)[0], tokens):  # the op projects every row of q_a
        raise Decline("the query reads some of q_b_proj's rows, not all")
    row = contraction.shape(x.origin)[1] // heads
    cos, sin, style = q_pe.origin.args[1:4]
    rope = 2 * contraction.shape(cos)[-1]
    kv_lora_rank -= rope
    nope = row - rope
    sizes = {"token": tokens, "head": heads, "nope": nope, "latent": kv_lora_rank, "feature": rope}
    _slice_roles(x, heads, row, 0, nope)
    pe_roles = _slice_roles(x_pe, heads, row, nope, rope)
    if _roles_in_order(q_pe, pe_roles) != [r for r in ("token", "head", "feature") if not same(sizes[r], 1)]:
        raise Decline("the query's rope part is not [tokens, heads, rope] of q_b_proj")
    # the absorption's axes: token and head from q_nope, its columns contracted, W_kc's latent free
    axis_role = {}
    for axis, (fa, fb, _) in absorb.axes.items():
        fx = fa if x_is_a else fb
        if fx is None:
            axis_role[axis] = "latent"
        else:
            role = _column_role(fx, heads, row, nope)
            axis_role[axis] = "nope" if role == "feature" else role
        if (axis[0] == "k") != (axis_role[axis] == "nope"):
            raise Decline("the absorption does not contract q_nope's columns alone")
    lat_roles = contraction.axis_roles(absorb.output_layout(), axis_role)
    if _roles_in_order(q_lat, lat_roles) != [r for r in ("token", "head", "latent") if not same(sizes[r], 1)]:
        raise Decline("the query's latent part is not [tokens, heads, kv_lora_rank]")
    emit = contraction.Emitter(graph, op, like=op)
    w_kc = contraction.operand_in_role_order(emit, absorb, not x_is_a, axis_role, ("head", "nope", "latent"), sizes)
    trig = []
    for t in (cos, sin):
        rows = math.prod(contraction.shape(t)[:-1])
        if not same(rows, 1) and not same(rows, tokens):
            raise Decline("cos / sin are not one row per token")
        t = emit(aten.reshape.default, t, [rows, rope // 2])
        trig.append(emit(aten.expand.default, t, [tokens, rope // 2]) if same(rows, 1) else t)
    try:
        check_args(*(n.meta["val"] for n in (q_a, q_b_weight, w_kc, *trig)), style)
    except ValueError as error:
        raise Decline(str(error).removeprefix("mla::q_b_absorb: ")) from error
    if not template_wins(size_hint(tokens), q_a.meta["val"].dtype):
        raise Decline(f"{tokens} rows: the GEMM is compute-bound there and Inductor's own path (oneDNN) is faster")
    fused = emit(torch.ops.mla.q_b_absorb.default, q_a, q_b_weight, w_kc, *trig, style)
    op.replace_input_with(query, emit.cast(fused, query.meta["val"].dtype))


def _latent_attention_ops(graph: torch.fx.Graph) -> list:
    return [n for n in graph.nodes if n.target is torch.ops.mla.latent_decode_attention.default]


def rewrite_absorbed_query(graph: torch.fx.Graph, op: torch.fx.Node) -> bool:
    """The anchored match (see above) on the query of a latent attention op."""
    cat = _query_cat(op.args[0])
    if cat is None:
        return False  # a query built otherwise (or already fused): no candidate
    _absorbed_query(graph, op, cat)
    return True
