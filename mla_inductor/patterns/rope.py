"""rope: the rotary embedding of model code into `mla::apply_rope`, each spelling keeping its own layout.

Spellings found in real graphs, each written below as the model code it matches (one tensor at a
time: query and key share the cos/sin nodes, which are therefore the pattern's inputs):
- transformers 5.x DeepseekV3 `apply_rotary_pos_emb_interleave`: step-2 slices, `cat([e c - o s, o c + e s])`,
  the result de-interleaved (and cached so);
- rotate_half (`x cos + cat(-x2, x1) sin`): Llama, Qwen2, DeepseekV3 with `rope_interleave=False`;
- transformers 4.x / DeepSeek's remote code: `view(..., d/2, 2).transpose.reshape`, then rotate_half;
- DeepseekV2's complex form: `view_as_complex`, times `freqs_cis`, `view_as_real`;
- serving code's GPT-J rotation in fp32 (`stack(...).flatten(-2)`), as models/mla.py writes it;
- vLLM's / SGLang's `RotaryEmbedding.forward_native`: cos|sin gathered from `cos_sin_cache[positions]`,
  cast to x's dtype, NeoX or GPT-J pairs, and partial rotary dims (`cat((rotated, x[..., rotary_dim:]))`).
  The gather is shared by query and key and stays as it is; each tensor's rotation becomes an op, so
  query and key may have different head sizes and rotary dims.

rotate_half reads full-width cos/sin, [..., d], and is a rotation of pairs only when both halves
hold the same angles; `check` proves that from the graph (cos/sin are elementwise functions of
`cat((freqs, freqs), -1)`, as every rotary module computes them) and otherwise leaves the code alone.

Where the rotated tensor comes out of a fused projection, `merge_into_qkv_a_proj` moves the rotation
into that kernel's epilogue (k_pe of `mla::qkv_a_proj`).
"""

from __future__ import annotations

import math
import operator
from typing import Optional

import torch
from torch._inductor.pattern_matcher import Match
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..ops.rope import check_apply_args
from .contraction import LAYOUT_OPS, SPLITS, Decline, Emitter, is_split_item, same
from .registry import node_value, register_anchored_rewrite, register_fusion, size_hint, upcast

FUSION = "rope"
aten, prims = torch.ops.aten, torch.ops.prims


# --- search functions: the model code ------------------------------------------------------------


def interleave_to_halves(x, cos, sin):
    """transformers' DeepseekV3 (5.x); cos/sin are its [..., d/2] slices, unsqueezed to x's rank."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rotate_half(x, cos, sin):
    """Llama's and DeepseekV3's `apply_rotary_pos_emb`; cos/sin [..., d]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def deinterleave_rotate_half(x, cos, sin):
    """transformers 4.x DeepseekV3 / DeepSeek's remote code: pairs gathered into halves, then rotate_half."""
    b, h, s, d = x.shape
    x = x.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    return rotate_half(x, cos, sin)


def complex_rotation(x, freqs_cis):
    """DeepseekV2's `apply_rotary_emb` (interleaved in and out, in fp32); freqs_cis [..., d/2] complex.
    Its `flatten(3)` of a 4-D x, written for any rank (DeepSeek's reference code rotates [T, H, d] too)."""
    x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_ * freqs_cis).flatten(-2).type_as(x)


def gptj_upcast(x, cos, sin):
    """Serving code's interleaved rotation, in fp32 (models/mla.py); cos/sin [..., d/2]."""
    x1, x2 = upcast(x[..., 0::2]), upcast(x[..., 1::2])
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)


def _native_rotation(x, cos, sin, is_neox):
    """forward_native's `_apply_rotary_emb`: cos/sin [tokens, r/2], x [tokens, heads, r]."""
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    x1, x2 = torch.chunk(x, 2, dim=-1) if is_neox else (x[..., ::2], x[..., 1::2])
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return torch.cat((o1, o2), dim=-1) if is_neox else torch.stack((o1, o2), dim=-1).flatten(-2)


def native_gptj(x, cos, sin):
    return _native_rotation(x, cos, sin, is_neox=False)


def native_neox(x, cos, sin):
    return _native_rotation(x, cos, sin, is_neox=True)


def native_gptj_partial(x, cos, sin):
    rotary_dim = 2 * cos.shape[-1]
    return torch.cat((_native_rotation(x[..., :rotary_dim], cos, sin, is_neox=False), x[..., rotary_dim:]), dim=-1)


def native_neox_partial(x, cos, sin):
    rotary_dim = 2 * cos.shape[-1]
    return torch.cat((_native_rotation(x[..., :rotary_dim], cos, sin, is_neox=True), x[..., rotary_dim:]), dim=-1)


# --- replacements ---------------------------------------------------------------------------------


def _first_half(t):
    return t[..., : t.shape[-1] // 2]


def interleave_to_halves_replacement(x, cos, sin):
    return torch.ops.mla.apply_rope(x, cos, sin, "interleaved_to_halves")


def rotate_half_replacement(x, cos, sin):
    return torch.ops.mla.apply_rope(x, _first_half(cos), _first_half(sin), "neox")


def deinterleave_rotate_half_replacement(x, cos, sin):
    return torch.ops.mla.apply_rope(x, _first_half(cos), _first_half(sin), "interleaved_to_halves")


def complex_rotation_replacement(x, freqs_cis):
    cos_sin = torch.view_as_real(freqs_cis)
    return torch.ops.mla.apply_rope(x, cos_sin[..., 0], cos_sin[..., 1], "interleaved")


def gptj_upcast_replacement(x, cos, sin):
    return torch.ops.mla.apply_rope(x, cos, sin, "interleaved")


def native_gptj_replacement(x, cos, sin):
    return torch.ops.mla.apply_rope(x, cos.unsqueeze(-2), sin.unsqueeze(-2), "interleaved")


def native_neox_replacement(x, cos, sin):
    return torch.ops.mla.apply_rope(x, cos.unsqueeze(-2), sin.unsqueeze(-2), "neox")


# --- preconditions --------------------------------------------------------------------------------

# Ops through which a tensor's last dim keeps its meaning, value for value (or element for element).
_ELEMENTWISE = {
    aten.unsqueeze.default, prims.convert_element_type.default, aten.cos.default, aten.sin.default,
    aten.clone.default, aten._to_copy.default,
}


def _is_repeat_of_halves(node) -> bool:
    """`cat((f, f), -1)` as Inductor's joint-graph passes leave it: `f.unsqueeze(-2).expand(..., 2, h)`,
    made contiguous and reshaped to [..., 2 h]."""
    shape = node.meta["val"].shape
    source = node.args[0]
    while source.target in (aten.clone.default, prims.convert_element_type.default):
        source = source.args[0]
    source_shape = source.meta["val"].shape
    if source.target != aten.expand.default or list(source_shape[:-2]) != list(shape[:-1]):
        return False
    if source_shape[-2] != 2 or 2 * source_shape[-1] != shape[-1]:
        return False
    return source.args[0].meta["val"].shape[-2] == 1


def _duplicated_halves(node) -> bool:
    """Whether `node`'s last dim is an elementwise function of `cat((f, f), -1)`: its halves are equal."""
    while isinstance(node, torch.fx.Node):
        if node.target in _ELEMENTWISE or (
            node.target in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor) and not isinstance(node.args[1], torch.fx.Node)
        ):
            node = node.args[0]
        elif node.target == aten.cat.default:
            parts, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
            rank = node.meta["val"].dim()
            return len(parts) == 2 and parts[0] is parts[1] and dim in (-1, rank - 1)
        elif node.target in (aten.view.default, aten.reshape.default):
            return _is_repeat_of_halves(node)
        else:
            return False
    return False


def _check(match: Match, full_width: bool, partial: bool = False, per_token: bool = False) -> Optional[str]:
    """`per_token`: cos/sin are [tokens, r/2], which the replacement unsqueezes over the heads."""
    kw = {name: node_value(arg) for name, arg in match.kwargs.items()}
    x, out = kw["x"], match.output_node().meta["val"]
    if out.shape != x.shape or out.dtype != x.dtype:
        return f"the rotation gives {out.dtype}{list(out.shape)} from x {x.dtype}{list(x.shape)}: not x's shape and dtype"
    if "freqs_cis" in kw:
        freqs = kw["freqs_cis"]
        if not freqs.is_complex():
            return f"freqs_cis is {freqs.dtype}, not complex"
        cos, sin = torch.view_as_real(freqs).unbind(-1)  # what the replacement passes
    else:
        cos, sin = kw["cos"], kw["sin"]
    if per_token:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if full_width:
        if cos.shape[-1] != x.shape[-1]:
            return f"cos/sin are {list(cos.shape)}, not full width {x.shape[-1]}"
        for name in ("cos", "sin"):
            if not _duplicated_halves(match.kwargs[name]):
                return f"{name}'s two halves are not provably equal (not an elementwise function of cat((f, f), -1))"
        cos, sin = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
    elif partial and not 2 * cos.shape[-1] < x.shape[-1]:
        return f"cos/sin [..., {cos.shape[-1]}] rotate all of x's {x.shape[-1]} values: not a partial rotation"
    elif not partial and cos.shape[-1] != x.shape[-1] // 2:
        return f"cos/sin [..., {cos.shape[-1]}] do not rotate all of x's {x.shape[-1]} values in pairs"
    try:
        check_apply_args(x, cos, sin, "neox")
    except ValueError as error:
        return str(error).removeprefix("mla::apply_rope: ")
    return None


def check_half_width(match: Match) -> Optional[str]:
    return _check(match, full_width=False)


def check_full_width(match: Match) -> Optional[str]:
    return _check(match, full_width=True)


def check_per_token(match: Match) -> Optional[str]:
    return _check(match, full_width=False, per_token=True)


def check_per_token_partial(match: Match) -> Optional[str]:
    return _check(match, full_width=False, partial=True, per_token=True)


# --- registration ---------------------------------------------------------------------------------


def _inputs(rank: int, dtype: torch.dtype, cos_width: str, cos_dtype=None) -> list:
    """x [batch, heads, seq, d] (rank 4), [tokens, heads, d] (rank 3) or [tokens, d] (rank 2), with
    cos/sin broadcast over the heads; all sizes distinct."""
    x_shape, cos_shape = {4: ((2, 3, 5, 8), (2, 1, 5)), 3: ((5, 3, 8), (5, 1)), 2: ((5, 8), (5,))}[rank]
    width = {"full": 8, "half": 4}[cos_width]
    cos = torch.empty(*cos_shape, width, dtype=cos_dtype or dtype)
    return [torch.empty(x_shape, dtype=dtype), cos, torch.empty_like(cos)]


def register() -> None:
    register_anchored_rewrite(FUSION, _additions, rewrite_rotation)
    # The slices' dims and steps are not part of a pattern (the strict re-trace of each match checks
    # them), so one registration serves every rank; dtypes differ where the search function casts.
    register_fusion(FUSION, interleave_to_halves, interleave_to_halves_replacement, _inputs(4, torch.float32, "half"),
                    check_half_width)
    register_fusion(FUSION, rotate_half, rotate_half_replacement, _inputs(4, torch.float32, "full"), check_full_width)
    register_fusion(FUSION, deinterleave_rotate_half, deinterleave_rotate_half_replacement,
                    _inputs(4, torch.float32, "full"), check_full_width)
    for dtype in (torch.bfloat16, torch.float32):
        # the fp32 rotation: cos/sin in fp32 whatever x's dtype
        register_fusion(FUSION, gptj_upcast, gptj_upcast_replacement, _inputs(3, dtype, "half", torch.float32),
                        check_half_width)
        register_fusion(FUSION, complex_rotation, complex_rotation_replacement,
                        [torch.empty(2, 3, 5, 8, dtype=dtype), torch.empty(2, 1, 5, 4, dtype=torch.complex64)],
                        check_half_width)
        # forward_native: a cache in another dtype than x is cast (bf16 x), one in x's dtype is not (fp32 x)
        x, x_partial, cos = torch.empty(5, 3, 8, dtype=dtype), torch.empty(5, 3, 12, dtype=dtype), torch.empty(5, 4)
        for search_fn, replace_fn, example, check in (
            (native_gptj, native_gptj_replacement, x, check_per_token),
            (native_neox, native_neox_replacement, x, check_per_token),
            (native_gptj_partial, native_gptj_replacement, x_partial, check_per_token_partial),
            (native_neox_partial, native_neox_replacement, x_partial, check_per_token_partial),
        ):
            register_fusion(FUSION, search_fn, replace_fn, [example, cos, torch.empty_like(cos)], check)


# --- anchored match: x * C + rot(x) * S, whatever builds rot(x) and the full-width C, S -------------
#
# Full-width spellings (Llama's rotate_half by slices or by chunk, GPT-J's rotate_every_two, ...) all
# add x times C to a signed pair swap of x times S. Which swap a chain of slices, splits, negations,
# cats and stacks builds, and whether C and S hold each angle twice (on both members of a pair), are
# read by running the chains on probes: x's elements numbered, or the trig source's, through the
# graph's own layout ops. Casts, and on the trig side the elementwise functions cos / sin / scalings,
# keep equal elements equal and are skipped. A chain with any other op is no rotation.

_ROTATED_OPS = LAYOUT_OPS | SPLITS | {aten.neg.default, aten.cat.default, aten.stack.default}
_TRIG_OPS = LAYOUT_OPS | SPLITS | {aten.cat.default, aten.stack.default, aten.repeat.default}
_CASTS = {prims.convert_element_type.default, aten._to_copy.default}


class _OtherOp(Exception):
    """A chain reaches an op outside the ones it may contain."""


def _passes_value(n: torch.fx.Node, elementwise: bool) -> bool:
    """Whether n is (for the probe) its first argument: a cast, or an elementwise function of it (a scaling
    by one number: a literal, or a one-element tensor, as under `dynamic=True` Dynamo passes a module's
    float, transformers' rotary `attention_scaling`)."""
    if n.target in _CASTS:
        return True
    factor = n.args[1] if n.target in (aten.mul.Tensor, aten.div.Tensor) else None
    scaled = factor is not None and (not isinstance(factor, torch.fx.Node) or _one_number(factor))
    return elementwise and (n.target in (aten.cos.default, aten.sin.default) or scaled)


def _one_number(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and all(isinstance(size, int) and size == 1 for size in val.shape)


def _same_layout(a, b) -> bool:
    """Whether nodes a and b are one layout of one tensor: the same node, or the same layout op with equal
    arguments. Graphs traced through a tensor subclass (torchao's quantized Linears) repeat a projection's
    `view(...).transpose(1, 2)` for each reader, so `x * cos + rotate_half(x) * sin` reads x as three
    equal chains."""
    if a is b:
        return True
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node) and a.op == b.op == "call_function"
            and a.target is b.target and a.target in LAYOUT_OPS and a.kwargs == b.kwargs and len(a.args) == len(b.args)):
        return False
    return all(_same_layout(x, y) if isinstance(x, torch.fx.Node) else x == y for x, y in zip(a.args, b.args))


def _probe(node: torch.fx.Node, origin: torch.fx.Node, ops: set, elementwise: bool) -> Optional[torch.Tensor]:
    """`node`'s value when `origin` (or a node of the same layout of the same tensor) holds its elements
    numbered (1, 2, ... in fp64), through `ops` only; None if the chain reaches anything else. Symbolic
    sizes take their example values."""
    values = {}

    def value(n):
        if _same_layout(n, origin):
            shape = [size_hint(size) for size in n.meta["val"].shape]
            return torch.arange(1, math.prod(shape) + 1, dtype=torch.float64).reshape(shape)
        if isinstance(n.meta.get("val"), torch.SymInt):
            return size_hint(n.meta["val"])
        if n not in values:
            if n.op != "call_function":
                raise _OtherOp
            if _passes_value(n, elementwise):
                values[n] = value(n.args[0])
            elif n.target in ops or is_split_item(n):  # a split's items: the split itself is checked
                args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), value)
                values[n] = n.target(*args, **kwargs)
            else:
                raise _OtherOp
        return values[n]

    try:
        return value(node)
    except _OtherOp:
        return None


@unset_fake_temporarily()  # probes are real tensors: passes run under the graph's fake mode
def _swap_style(x: torch.fx.Node, rotated: torch.fx.Node) -> Optional[str]:
    """"neox" or "interleaved" where `rotated` is x with each pair swapped and its first member negated
    (halves: -x[i + d/2], x[i]; neighbours: -x[2i + 1], x[2i]), else None."""
    out = _probe(rotated, x, _ROTATED_OPS, elementwise=False)
    d = x.meta["val"].shape[-1]
    if out is None or not isinstance(d, int) or d % 2:
        return None
    numbered = _probe(x, x, set(), elementwise=False)
    if out.shape != numbered.shape:
        return None
    index = torch.arange(d)
    for style, partner in (("neox", (index + d // 2) % d), ("interleaved", index ^ 1)):
        if torch.equal(out, numbered[..., partner] * torch.where(index < partner, -1.0, 1.0)):
            return style
    return None


def _trig_origin(node: torch.fx.Node) -> torch.fx.Node:
    """The tensor a cos / sin chain starts from: the first node that is none of its ops."""
    while node.op == "call_function":
        if is_split_item(node):
            node = node.args[0].args[0]
        elif node.target in (aten.cat.default, aten.stack.default):
            node = node.args[0][0]
        elif node.target in _TRIG_OPS or _passes_value(node, elementwise=True):
            node = node.args[0]
        else:
            break
    return node


@unset_fake_temporarily()
def _holds_each_angle_twice(trig: torch.fx.Node, style: str) -> bool:
    """Whether the two members of every pair of `trig`'s last dim are provably equal."""
    out = _probe(trig, _trig_origin(trig), _TRIG_OPS, elementwise=True)
    if out is None or out.shape[-1] % 2:
        return False
    half = out.shape[-1] // 2
    if style == "neox":
        return torch.equal(out[..., :half], out[..., half:])
    return torch.equal(out[..., 0::2], out[..., 1::2])


def _additions(graph: torch.fx.Graph) -> list:
    return [n for n in graph.nodes if n.target is aten.add.Tensor]


def rewrite_rotation(graph: torch.fx.Graph, add: torch.fx.Node) -> bool:
    """The anchored match (see above) on an addition that may be x * C + rot(x) * S."""
    terms = add.args[:2]
    if not all(isinstance(t, torch.fx.Node) and t.target is aten.mul.Tensor and len(t.users) == 1
               and all(isinstance(a, torch.fx.Node) for a in t.args) for t in terms):
        return False
    readings = [[(t.args[0], t.args[1]), (t.args[1], t.args[0])] for t in terms]  # (data, trig)
    for plain, swapped in ((0, 1), (1, 0)):
        for x, cos in readings[plain]:
            for rotated, sin in readings[swapped]:
                style = _swap_style(x, rotated) if rotated is not x else None
                if style is not None:  # add is a rotation of x's pairs: from here on, near misses are reported
                    _rotate(graph, add, x, cos, sin, style)
                    return True
    return False


def _rotate(graph: torch.fx.Graph, add: torch.fx.Node, x, cos, sin, style: str) -> None:
    out, val = add.meta["val"], x.meta["val"]
    if out.dtype != val.dtype or out.dim() != val.dim() or not all(same(a, b) for a, b in zip(out.shape, val.shape)):
        raise Decline(f"the rotation gives {out.dtype}{list(out.shape)} from x {val.dtype}{list(val.shape)}: "
                      "not x's shape and dtype")
    if not all(_holds_each_angle_twice(t, style) for t in (cos, sin)):
        raise Decline("cos / sin do not provably hold each angle on both members of a pair")
    emit = Emitter(graph, add)
    d = cos.meta["val"].shape[-1]
    # the last dim by its index, as a traced `cos[..., :half]` has it (gqa_qkv's patterns read these slices)
    last = cos.meta["val"].dim() - 1
    halves = [emit(aten.slice.Tensor, t, last, 0, d // 2) if style == "neox"
              else emit(aten.slice.Tensor, t, last, 0, d, 2) for t in (cos, sin)]
    try:
        check_apply_args(val, *(h.meta["val"] for h in halves), style)
    except ValueError as error:
        raise Decline(str(error).removeprefix("mla::apply_rope: ")) from error
    add.replace_all_uses_with(emit(torch.ops.mla.apply_rope.default, x, *halves, style))


# --- the rotation of k_pe into the projection that produces it -------------------------------------

_QKV_A_PROJ = torch.ops.mla.qkv_a_proj.default
_APPLY_ROPE = torch.ops.mla.apply_rope.default


def _rope_of_k_pe(rope: torch.fx.Node) -> Optional[tuple[torch.fx.Node, Optional[torch.fx.Node]]]:
    """(qkv_a_proj node, view or None) when `rope` rotates k_pe of a qkv_a_proj and nothing else reads
    the unrotated k_pe; the view is transformers' `k_pe.view(B, 1, S, R)`, which keeps the rows."""
    x = rope.args[0]
    view = None
    if x.target in (aten.view.default, aten.reshape.default) and len(x.users) == 1:
        view, x = x, x.args[0]
        if view.meta["val"].shape[-1] != x.meta["val"].shape[-1]:
            return None
    if x.target is not operator.getitem or x.args[1] != 2 or len(x.users) != 1:
        return None
    proj = x.args[0]
    if proj.target is not _QKV_A_PROJ or proj.kwargs.get("k_cos") is not None:
        return None
    return proj, view


def merge_into_qkv_a_proj(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """`apply_rope(k_pe of mla::qkv_a_proj)` -> the projection's k_cos / k_sin epilogue, which rotates
    k_pe from its fp32 GEMM row: one kernel for the whole cache row, and one rounding fewer.
    Returns the projections that took a rotation."""
    merged = []
    for rope in list(graph.nodes):
        if rope.target is not _APPLY_ROPE:
            continue
        found = _rope_of_k_pe(rope)
        if found is None:
            continue
        proj, _ = found
        x, cos, sin, style = rope.args
        half = cos.meta["val"].shape[-1]
        rows = proj.meta["val"][2].shape[:-1]
        rope_rows = x.meta["val"].shape[:-1]
        emit = Emitter(graph, proj, like=rope)
        try:  # the dynamic sizes first, so that a size no node holds leaves the graph as it was
            expand_size, row_size = ([emit.size_arg(n) for n in shape] for shape in ([*rope_rows, half], [*rows, half]))
        except Decline:
            continue
        # one row of cos/sin per k_pe row, in the projection's row order (the view kept it)
        per_row = [emit(aten.reshape.default, emit(aten.expand.default, t, expand_size), row_size) for t in (cos, sin)]
        proj.kwargs = {**proj.kwargs, "k_cos": per_row[0], "k_sin": per_row[1], "k_rope_style": style}
        rope.replace_all_uses_with(x)
        graph.erase_node(rope)
        merged.append(proj)
    return merged
