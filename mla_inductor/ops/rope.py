"""mla::rotary_embedding: RoPE of query and key heads by positions gathered from a cos/sin cache.

The contract of SGLang's `rotary_embedding_cpu(positions, query, key, head_size, cos_sin_cache,
is_neox)`: `cos_sin_cache` is [max_positions, rotary_dim] = cos ‖ sin, each [rotary_dim / 2]; the first
rotary_dim values of every head are rotated, the rest of the head is passed through:

    is_neox=True  (rotate_half):  pairs (x[i], x[i + rotary_dim / 2])
    is_neox=False (GPT-J, DeepSeek's interleaved rope):  pairs (x[2 i], x[2 i + 1])
    (a, b) -> (a cos_i - b sin_i, b cos_i + a sin_i)

Layouts: a tensor is [*tokens, heads * head_size] or [*tokens, heads, head_size], where `tokens` is
positions' shape: 2-D [T, H*d] and 3-D [T, H, d] with positions [T], 4-D [B, S, H, d] with positions
[B, S]. Query and key may have different head counts. Unlike SGLang, which rotates 2-D inputs in
place, the op is functional: it returns new (query, key), so that it can stand in a traced graph.

The eager implementation is the reference: fp32 arithmetic, one rounding per output element.
"""

from __future__ import annotations

import torch
from torch import Tensor

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _fail(message: str) -> None:
    raise ValueError(f"mla::rotary_embedding: {message}")


def _heads(name: str, t: Tensor, positions: Tensor, head_size: int) -> int:
    """Number of heads of `t`, checking its layout against positions and head_size."""
    tokens = tuple(positions.shape)
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
        f"shape {list(tokens)}, got {list(t.shape)}"
    )


def check_args(positions, query, key, head_size, cos_sin_cache) -> None:
    """Every precondition that does not depend on the values of positions."""
    for name, t in (("positions", positions), ("query", query), ("key", key), ("cos_sin_cache", cos_sin_cache)):
        if not isinstance(t, Tensor):
            _fail(f"{name} must be a Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            _fail(f"{name} must be on the CPU, got {t.device}")
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
    _heads("query", query, positions, head_size)
    _heads("key", key, positions, head_size)


def check_positions(positions: Tensor, cos_sin_cache: Tensor, fail=_fail) -> None:
    """Positions index rows of the cache: out of range is an error, never an out-of-bounds read.
    `fail` raises with the calling op's name."""
    if positions.numel() and (positions.min() < 0 or positions.max() >= cos_sin_cache.shape[0]):
        fail(f"positions must be in [0, {cos_sin_cache.shape[0]}) (the rows of cos_sin_cache), got values in "
             f"[{positions.min().item()}, {positions.max().item()}]")


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor, is_neox: bool) -> Tensor:
    """The rotation of x's last dim by (cos_i, sin_i) (broadcast against x's pairs), in fp32 or wider,
    rounded once to x's dtype: the reference math of every mla:: op that applies RoPE."""
    compute = torch.promote_types(x.dtype, torch.float32)
    cos, sin = cos.to(compute), sin.to(compute)
    if is_neox:
        a, b = x.to(compute).chunk(2, dim=-1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)
    a, b = x[..., 0::2].to(compute), x[..., 1::2].to(compute)
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2).to(x.dtype)


def rotate(x: Tensor, positions: Tensor, head_size: int, cos_sin_cache: Tensor, is_neox: bool) -> Tensor:
    """One tensor's rotation (the op's reference math); the result has x's shape and dtype."""
    heads = _heads("x", x, positions, head_size)
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
