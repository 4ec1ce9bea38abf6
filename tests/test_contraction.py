"""patterns/contraction.py: layout chains replayed symbolically, and bmm/mm read as einsums over origins."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from mla_inductor.patterns.contraction import Contraction, Factor, Layout, Unsupported


def _bmm(graph_module):
    (node,) = [n for n in graph_module.graph.nodes if n.target in (torch.ops.aten.bmm.default, torch.ops.aten.mm.default)]
    return node


def test_reshape_splits_and_merges_factors():
    layout = Layout.identity([6, 4])
    split = layout.reshape([2, 3, 4])
    assert split.dims == [[Factor(0, 2, 3)], [Factor(0, 3, 1)], [Factor(1, 4, 1)]]
    assert split.permute([0, 2, 1]).reshape([8, 3]).dims == [[Factor(0, 2, 3), Factor(1, 4, 1)], [Factor(0, 3, 1)]]
    with pytest.raises(Unsupported):
        layout.reshape([4, 6])  # 6 x 4 -> 4 x 6 would split 6 at 4


def test_slices_offset_their_origin_dim_and_expand_broadcasts():
    layout = Layout.identity([4, 10]).reshape([4, 2, 5]).slice(2, 3, 5).select(1, 1)
    assert layout.dims == [[Factor(0, 4, 1)], [Factor(1, 2, 1)]]
    assert layout.offsets == {1: 5 + 3}  # head 1 of width 5, columns from 3
    assert Layout.identity([3, 1, 7]).expand([3, 4, 7]).dims[1] == [Factor(None, 4, 0)]


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
