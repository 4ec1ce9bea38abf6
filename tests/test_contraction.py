"""patterns/contraction.py: layout chains replayed symbolically, and bmm/mm read as einsums over origins."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from mla_inductor.patterns.contraction import Contraction, Layout, Unsupported


def _bmm(graph_module):
    (node,) = [n for n in graph_module.graph.nodes if n.target in (torch.ops.aten.bmm.default, torch.ops.aten.mm.default)]
    return node


def _factors(dims) -> list:
    """(label, size, stride) of each factor, per dim."""
    return [[(f.label, f.size, f.stride) for f in dim] for dim in dims]


def test_reshape_splits_and_merges_factors():
    layout = Layout.identity([6, 4])
    split = layout.reshape([2, 3, 4])
    assert _factors(split.dims) == [[(0, 2, 3)], [(0, 3, 1)], [(1, 4, 1)]]
    assert _factors(split.permute([0, 2, 1]).reshape([8, 3]).dims) == [[(0, 2, 3), (1, 4, 1)], [(0, 3, 1)]]
    with pytest.raises(Unsupported):
        layout.reshape([4, 6])  # 6 x 4 -> 4 x 6 would split 6 at 4


def test_slices_offset_their_origin_dim_and_expand_broadcasts():
    layout = Layout.identity([4, 10]).reshape([4, 2, 5]).slice(2, 3, 2).select(1, 1)  # columns 3 and 4
    assert _factors(layout.dims) == [[(0, 4, 1)], [(1, 2, 1)]]
    assert layout.offsets == {1: 5 + 3}  # head 1 of width 5, columns from 3
    assert _factors(Layout.identity([3, 1, 7]).expand([3, 4, 7]).dims)[1] == [(None, 4, 0)]


def test_repeat_tiles_a_dim_with_the_copies_outermost():
    """`k.repeat(1, 3, 1, 1)`: head h of the result is head h % 2 of k (not repeat_kv's h // 3)."""
    layout = Layout.identity([4, 2, 5, 8]).repeat([1, 3, 1, 1])
    assert _factors(layout.dims)[1] == [(None, 3, 0), (1, 2, 1)]
    assert _factors(Layout.identity([5, 8]).repeat([2, 1, 1]).dims) == [[(None, 2, 0)], [(0, 5, 1)], [(1, 8, 1)]]
    gm = make_fx(lambda k: k.repeat(1, 3, 1, 1).reshape(24, 5, 8) @ torch.ones(8, 1))(torch.randn(4, 2, 5, 8))
    assert any(n.target is torch.ops.aten.repeat.default for n in gm.graph.nodes)
    c = Contraction.of(_bmm(gm))
    assert c.a.origin.name.startswith("k")
    assert [(f.label, f.size) for f in c.a.layout.dims[0]] == [(0, 4), (None, 3), (1, 2), (2, 5)]  # matmul: an mm


def test_einsum_absorption_reads_as_axes_over_the_weight_view():
    """DeepSeek's `einsum("bshd,hdc->bshc", q_nope, wkv_b.view(H, -1, L)[:, :nope])`."""
    heads, nope, v, latent = 3, 4, 5, 6

    def absorb(q_nope, wkv_b):
        w = wkv_b.view(heads, -1, latent)
        return torch.einsum("bshd,hdc->bshc", q_nope, w[:, :nope])

    gm = make_fx(absorb)(torch.randn(2, 1, heads, nope), torch.randn(heads * (nope + v), latent))
    c = Contraction.of(_bmm(gm))
    weight = c.b if c.b.origin.name.startswith("wkv_b") else c.a
    assert weight.origin.name.startswith("wkv_b")
    factors = sorted((f.label, f.size, f.stride) for f in weight.layout.factors())
    assert factors == sorted([(0, nope, 1), (0, heads, nope + v), (1, latent, 1)])
    assert weight.layout.offsets.get(0, 0) == 0
    contracted = [a for a in c.axes if a[0] == "k"]
    assert [c.axes[a][2] for a in contracted] == [nope]
    shared = [a for a in c.axes if a[0] == "batch"]
    assert [c.axes[a][2] for a in shared] == [heads]


def test_a_cache_broadcast_over_heads_is_a_batch_axis_with_no_origin():
    def scores(q, cache):
        return q.unsqueeze(2) @ cache.unsqueeze(1).transpose(-1, -2)  # [B, H, 1, D] @ [B, 1, D, T]

    gm = make_fx(scores)(torch.randn(2, 3, 8), torch.randn(2, 5, 8))
    c = Contraction.of(_bmm(gm))
    cache = c.b
    assert cache.origin.name.startswith("cache")
    batch = [c.axes[a] for a in c.axes if a[0] == "batch"]
    assert [(fb.label, size) for _, fb, size in batch if fb.label is None] == [(None, 3)]  # the heads


def _symbolic_size(hint: int) -> torch.SymInt:
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    return env.create_symintnode(env.create_symbol(hint, ConstantSource("rows")), hint=hint)


def test_dynamic_sizes_are_decided_for_every_value_of_the_symbols():
    """A symbolic cache length: merged, split back and sliced without a guard; what holds only for some
    values (s split at 3) is unsupported, not assumed."""
    s = _symbolic_size(6)
    layout = Layout.identity([2, s, 8])
    merged = layout.reshape([2 * s, 8])
    assert [f.label for f in merged.dims[0]] == [0, 1]
    back = merged.reshape([2, s, 4, 2])
    assert _factors(back.dims)[2:] == [[(2, 4, 2)], [(2, 2, 1)]]
    rows = back.slice(1, 0, s - 1)
    assert rows.dims[1][0].size == s - 1 and rows.offsets == {1: 0}
    with pytest.raises(Unsupported):
        layout.reshape([2, 3, s // 3, 8])
    assert not s.node.shape_env.guards  # every decision was static
