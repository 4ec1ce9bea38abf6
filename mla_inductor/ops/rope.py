"""RoPE as two ops: `mla::rotary_embedding` (SGLang's positions + cos/sin cache contract) and
`mla::apply_rope` (one tensor by per-row cos/sin, as model code computes them).

mla::rotary_embedding: RoPE of query and key heads by positions gathered from a cos/sin cache.

The contract of SGLang's `rotary_embedding_cpu(positions, query, key, head_size, cos_sin_cache,
is_neox)`: `cos_sin_cache` is [max_positions, rotary_dim] = cos ‖ sin, each [rotary_dim / 2]; the first
rotary_dim values of every head are rotated, the rest of the head is passed through:

    is_neox=True  (rotate_half):  pairs (x[i], x[i + rotary_dim / 2])
    is_neox=False (GPT-J, DeepSeek's interleaved rope):  pairs (x[2 i], x[2 i + 1])
    (a, b) -> (a cos_i - b sin_i, b cos_i + a sin_i)

Layouts: a tensor is [*tokens, heads * head_size] or [*tokens, heads, head_size], where `tokens` is
positions' shape: 2-D [T, H*d] and 3-D [T, H, d] with positions [T], 4-D [B, S, H, d] with positions
[B, S]. As SGLang's kernel, positions may also be flat ([B * S]) for a [B, S, H, d] or [B, S, H*d]
tensor: they are then read in the tensor's token order. Query and key may have different head counts. Unlike SGLang, which rotates 2-D inputs in
place, the op is functional: it returns new (query, key), so that it can stand in a traced graph.

mla::apply_rope(x, cos, sin, style): x [..., d] rotated by cos/sin [..., rotary_dim / 2] (broadcast
against x's leading dims, so one cos row serves every head), the rest of each row passed through.
`style` says where a pair lives and where its rotation goes:

    "neox"                   pairs (x[i], x[i + r/2]) -> the same places     (rotate_half: Llama, DeepseekV3
                                                                              with rope_interleave=False)
    "interleaved"            pairs (x[2 i], x[2 i + 1]) -> the same places   (GPT-J, DeepseekV2's complex
                                                                              rope, serving DeepSeek)
    "interleaved_to_halves"  pairs (x[2 i], x[2 i + 1]) -> (out[i], out[i + r/2])
                                                                             (transformers' DeepseekV3: its
                                                                              k_pe lands in the cache so)

The eager implementations are the references: fp32 arithmetic, one rounding per output element.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_cpu_tensors

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _fail(message: str) -> None:
    raise ValueError(f"mla::rotary_embedding: {message}")


def token_shape(query_shape, positions_shape) -> tuple:
    """The token dims positions stand for: their own shape, or (SGLang's flat form) the first two
    dims of a [B, S, ...] query whose B * S they number."""
    positions_shape, query_shape = tuple(positions_shape), tuple(query_shape)
    if query_shape[: len(positions_shape)] == positions_shape:
        return positions_shape
    if len(positions_shape) == 1 and len(query_shape) >= 3 and query_shape[0] * query_shape[1] == positions_shape[0]:
        return query_shape[:2]
    return positions_shape


def _heads(name: str, t: Tensor, positions: Tensor, head_size: int, tokens: tuple) -> int:
    """Number of heads of `t`, checking its layout against the token dims and head_size."""
    if t.dim() == len(tokens) + 1 and tuple(t.shape[:-1]) == tokens:
        if t.shape[-1] % head_size:
            _fail(f"{name} [*tokens, heads * head_size] has last dim {t.shape[-1]}, not a multiple of head_size={head_size}")
        return t.shape[-1] // head_size
    if t.dim() == len(tokens) + 2 and tuple(t.shape[:-2]) == tokens:
        if t.shape[-1] != head_size:
            _fail(f"{name} [*tokens, heads, head_size] has head size {t.shape[-1]}, expected head_size={head_size}")
        return t.shape[-2]
    _fail(
        f"{name} must be [*tokens, heads * head_size] or [*tokens, heads, head_size] with tokens = positions' "
        f"shape {list(positions.shape)} (or [B, S] for flat positions of B * S), got {list(t.shape)}"
    )


def check_args(positions, query, key, head_size, cos_sin_cache) -> None:
    """Every precondition that does not depend on the values of positions."""
    check_cpu_tensors(_fail, dict(positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache))
    if positions.dtype not in (torch.int32, torch.int64):
        _fail(f"positions must be int32 or int64, got {positions.dtype}")
    if query.dtype not in SUPPORTED_DTYPES:
        _fail(f"query has dtype {query.dtype}; supported: bfloat16, float16, float32")
    if key.dtype != query.dtype:
        _fail(f"key has dtype {key.dtype}, expected query's dtype {query.dtype}")
    if not cos_sin_cache.is_floating_point() or cos_sin_cache.dim() != 2:
        _fail(f"cos_sin_cache must be a floating [max_positions, rotary_dim] tensor, got "
              f"{cos_sin_cache.dtype}{list(cos_sin_cache.shape)}")
    if not isinstance(head_size, (int, torch.SymInt)) or head_size <= 0:
        _fail(f"head_size must be a positive int, got {head_size!r}")
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim == 0 or rotary_dim % 2 or rotary_dim > head_size:
        _fail(f"cos_sin_cache's rotary_dim (its last dim, {rotary_dim}) must be even and in [2, head_size={head_size}]")
    tokens = token_shape(query.shape, positions.shape)
    _heads("query", query, positions, head_size, tokens)
    _heads("key", key, positions, head_size, tokens)


def check_positions(positions: Tensor, cos_sin_cache: Tensor, fail=_fail) -> None:
    """Positions index rows of the cache: out of range is an error, never an out-of-bounds read.
    `fail` raises with the calling op's name."""
    if positions.numel() and (positions.min() < 0 or positions.max() >= cos_sin_cache.shape[0]):
        fail(f"positions must be in [0, {cos_sin_cache.shape[0]}) (the rows of cos_sin_cache), got values in "
             f"[{positions.min().item()}, {positions.max().item()}]")


ROPE_STYLES = ("neox", "interleaved", "interleaved_to_halves")


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor, is_neox: bool, to_halves: bool = False) -> Tensor:
    """The rotation of x's last dim by (cos_i, sin_i) (broadcast against x's pairs), in fp32 or wider,
    rounded once to x's dtype: the reference math of every mla:: op that applies RoPE. `to_halves`
    (interleaved pairs only) puts the rotated evens first and the rotated odds after them."""
    compute = torch.promote_types(x.dtype, torch.float32)
    cos, sin = cos.to(compute), sin.to(compute)
    if is_neox:
        a, b = x.to(compute).chunk(2, dim=-1)
    else:
        a, b = x[..., 0::2].to(compute), x[..., 1::2].to(compute)
    first, second = a * cos - b * sin, b * cos + a * sin
    if is_neox or to_halves:
        return torch.cat([first, second], dim=-1).to(x.dtype)
    return torch.stack([first, second], dim=-1).flatten(-2).to(x.dtype)


def rotate(x: Tensor, positions: Tensor, head_size: int, cos_sin_cache: Tensor, is_neox: bool) -> Tensor:
    """One tensor's rotation (the op's reference math); the result has x's shape and dtype."""
    positions = positions.reshape(token_shape(x.shape, positions.shape))
    heads = _heads("x", x, positions, head_size, tuple(positions.shape))
    shaped = x.reshape(*positions.shape, heads, head_size)
    rotary_dim = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions.long()].unsqueeze(-2).chunk(2, dim=-1)
    rotated = rotate_pairs(shaped[..., :rotary_dim], cos, sin, is_neox)
    return torch.cat([rotated, shaped[..., rotary_dim:]], dim=-1).reshape(x.shape)


@torch.library.custom_op("mla::rotary_embedding", mutates_args=())
def rotary_embedding(
    positions: Tensor, query: Tensor, key: Tensor, head_size: int, cos_sin_cache: Tensor, is_neox: bool
) -> tuple[Tensor, Tensor]:
    check_args(positions, query, key, head_size, cos_sin_cache)
    check_positions(positions, cos_sin_cache)
    return (
        rotate(query, positions, head_size, cos_sin_cache, is_neox),
        rotate(key, positions, head_size, cos_sin_cache, is_neox),
    )


@rotary_embedding.register_fake
def _(positions, query, key, head_size, cos_sin_cache, is_neox):
    check_args(positions, query, key, head_size, cos_sin_cache)
    return torch.empty_like(query, memory_format=torch.contiguous_format), torch.empty_like(
        key, memory_format=torch.contiguous_format
    )


def reference_fp64(positions, x, head_size, cos_sin_cache, is_neox) -> Tensor:
    """An independent fp64 rotation, one head element at a time from the definition, for tests."""
    positions = positions.reshape(token_shape(x.shape, positions.shape))
    heads = x.shape[-1] // head_size if x.dim() == positions.dim() + 1 else x.shape[-2]
    flat = x.reshape(-1, heads, head_size).double()
    pos = positions.reshape(-1).tolist()
    rotary_dim = cos_sin_cache.shape[1]
    half = rotary_dim // 2
    out = flat.clone()
    for t, p in enumerate(pos):
        for i in range(half):
            c, s = float(cos_sin_cache[p, i]), float(cos_sin_cache[p, half + i])
            ia, ib = (i, i + half) if is_neox else (2 * i, 2 * i + 1)
            a, b = flat[t, :, ia], flat[t, :, ib]
            out[t, :, ia], out[t, :, ib] = a * c - b * s, b * c + a * s
    return out.reshape(x.shape)


# --- mla::apply_rope -------------------------------------------------------------------------------


def _fail_apply(message: str) -> None:
    raise ValueError(f"mla::apply_rope: {message}")


def check_apply_args(x, cos, sin, style) -> None:
    check_cpu_tensors(_fail_apply, dict(x=x, cos=cos, sin=sin))
    if x.dtype not in SUPPORTED_DTYPES:
        _fail_apply(f"x has dtype {x.dtype}; supported: bfloat16, float16, float32")
    if style not in ROPE_STYLES:
        _fail_apply(f"style must be one of {ROPE_STYLES}, got {style!r}")
    if not cos.is_floating_point() or cos.dtype != sin.dtype or cos.shape != sin.shape:
        _fail_apply(f"cos and sin must be floating tensors of one dtype and shape, got {cos.dtype}{list(cos.shape)} "
                    f"and {sin.dtype}{list(sin.shape)}")
    if x.dim() < 1 or cos.dim() < 1 or cos.dim() > x.dim():
        _fail_apply(f"cos [..., rotary_dim / 2] must not have more dims than x [..., head_size], got "
                    f"{list(cos.shape)} and {list(x.shape)}")
    half = cos.shape[-1]
    if half == 0 or 2 * half > x.shape[-1]:
        _fail_apply(f"rotary_dim = 2 * cos.shape[-1] = {2 * half} must be in [2, x.shape[-1]={x.shape[-1]}]")
    lead, cos_lead = x.shape[:-1], cos.shape[:-1]
    for i in range(1, len(cos_lead) + 1):
        if cos_lead[-i] not in (1, lead[-i]):
            _fail_apply(f"cos {list(cos.shape)} does not broadcast against x's rows {list(lead)}")


@torch.library.custom_op("mla::apply_rope", mutates_args=())
def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, style: str) -> Tensor:
    check_apply_args(x, cos, sin, style)
    rotary_dim = 2 * cos.shape[-1]
    rotated = rotate_pairs(x[..., :rotary_dim], cos, sin, style == "neox", style == "interleaved_to_halves")
    return torch.cat([rotated, x[..., rotary_dim:]], dim=-1).contiguous()


@apply_rope.register_fake
def _(x, cos, sin, style):
    check_apply_args(x, cos, sin, style)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def apply_rope_fp64(x, cos, sin, style) -> Tensor:
    """An independent fp64 rotation, pair by pair from the definition, for tests."""
    half = cos.shape[-1]
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1]).double()
    c = cos.double().expand(*lead, half).reshape(-1, half)
    s = sin.double().expand(*lead, half).reshape(-1, half)
    out = flat.clone()
    for i in range(half):
        ia, ib = (i, i + half) if style == "neox" else (2 * i, 2 * i + 1)
        oa, ob = (ia, ib) if style != "interleaved_to_halves" else (i, i + half)
        a, b = flat[:, ia], flat[:, ib]
        out[:, oa], out[:, ob] = a * c[:, i] - b * s[:, i], b * c[:, i] + a * s[:, i]
    return out.reshape(x.shape)
