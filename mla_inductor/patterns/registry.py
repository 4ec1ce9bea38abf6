"""What the fusion modules share: the pattern pass of each MLAPass stage, `register_fusion`, and
helpers for checks.

`register_fusion` traces a search function once per stage (joint graphs keep `aten.view`, post-grad
graphs have `aten.reshape`) and wraps its check so that every accepted or rejected candidate is
counted and explained (record.py).
"""

from __future__ import annotations

import copy
import functools
import operator
from typing import Any, Callable, Optional, Sequence

import torch
from torch._inductor.fx_passes.post_grad import view_to_reshape
from torch._inductor.pattern_matcher import Match, PatternMatcherPass, fwd_only, gen_pattern, register_replacement

from .. import config as mla_config
from ..record import checked, record_decision
from . import contraction
from .contraction import node_value  # noqa: F401  (the pattern modules import it from here)

STAGES = ("joint", "post_grad")
_PASSES = {stage: PatternMatcherPass(pass_name=f"mla_inductor_{stage}") for stage in STAGES}


def pattern_pass(stage: str) -> PatternMatcherPass:
    return _PASSES[stage]


def size_hint(size) -> int:
    """A size's value, or the example value of a dynamic size (a SymInt)."""
    return size.node.hint if isinstance(size, torch.SymInt) and size.node.has_hint() else int(size)


def upcast(x):
    """x in fp32 (or wider): how model code widens bf16 activations before softmax or RoPE."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _scalar_tensor_to_full(gm: torch.fx.GraphModule) -> None:
    """`scalar_tensor(v)` -> `full([], v)`: the joint graph's constant folding has already done this to
    the graphs we match (a masked_fill's fill value, for one), the plain trace of a pattern has not."""
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.target is aten.scalar_tensor.default:
            with gm.graph.inserting_before(node):
                full = gm.graph.call_function(
                    aten.full.default,
                    ([], node.args[0]),
                    {
                        "dtype": node.kwargs.get("dtype"),
                        "layout": torch.strided,
                        "device": node.kwargs.get("device"),
                        "pin_memory": False,
                    },
                )
            full.meta.update(node.meta)
            node.replace_all_uses_with(full)
            gm.graph.erase_node(node)
    gm.recompile()


def _functional_decompositions(gm: torch.fx.GraphModule) -> None:
    """`aten.add_(t, eps)` -> `aten.add(t, eps)` where nothing else reads t: some decompositions
    (F.rms_norm's) update a fresh temporary in place, which the graphs we match hold functionalized."""
    for node in list(gm.graph.nodes):
        target = node.target
        if not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable:
            continue
        name = target.overloadpacket.__name__
        functional = getattr(getattr(torch.ops.aten, name[:-1], None), target._overloadname, None)
        if name.endswith("_") and functional is not None and len(node.args[0].users) == 1:
            node.target = functional


def trace_for_stage(stage: str, first: Optional[dict] = None) -> Callable:
    """How a search function becomes a pattern graph for `stage`.

    `first`, while it holds "open", shares the trace of one registration's example inputs between its
    stages: the first stage traces, the others copy that graph (the two stages' patterns differ only in
    post_grad's reshapes for views, which need no trace). Tracing is most of what registering the
    fusions costs, and every process pays it before its first compile. The traces at match time (the
    strict re-trace with a match's shapes) come after registration, with `first` closed."""

    def trace(fn: Callable, *args: Any, **kwargs: Any) -> torch.fx.GraphModule:
        if first is not None and "graph" in first:
            gm = copy.deepcopy(first["graph"])
        else:
            gm = fwd_only(fn, *args, **kwargs)
            _functional_decompositions(gm)
            canonical_gemm_splits(gm.graph)
            _scalar_tensor_to_full(gm)
            if first is not None and "open" in first:
                # the joint stage only reads its graph; post_grad's gets its reshapes below
                first["graph"] = gm if stage == "joint" else copy.deepcopy(gm)
        if stage == "post_grad":
            view_to_reshape(gm)
            gm.recompile()
        return gm

    return trace


def register_fusion(
    fusion: str,
    search_fn: Callable,
    replace_fn: Callable,
    example_inputs: Sequence[Any],
    check: Callable[[Match], Optional[str]],
    stages: Sequence[str] = STAGES,
    size_agnostic: bool = False,
    functionalize: bool = False,
    **kwargs: Any,
) -> None:
    """Register `search_fn -> replace_fn` in the given MLAPass stages; `check` returns a rejection reason or None.

    `functionalize`: a search function that writes in place (`key[..., :n].copy_(k)`) must be traced
    functionalized, as the matched graphs are; a plain trace keeps the in-place op and loses the data
    dependency through it. (Only the search function: the replacement may call ops that mutate.)

    `size_agnostic` skips the strict re-trace with the match's real shapes (needed where dynamic
    sizes appear in mixed spellings); `check` must then verify the literals itself.
    """
    if functionalize:
        search_fn = functools.wraps(search_fn)(torch.func.functionalize(search_fn))
    first = {"open": True}
    for stage in stages:
        trace = trace_for_stage(stage, first)
        if size_agnostic:
            # exclusive_arg_names only takes effect where the pattern is generated: pass it here too
            kwargs["search_fn_pattern"] = gen_pattern(
                search_fn, list(example_inputs), trace, kwargs.get("scalar_workaround"),
                kwargs.get("exclusive_arg_names", ()),
            )
        register_replacement(
            search_fn,
            replace_fn,
            list(example_inputs),
            trace,
            pattern_pass(stage),
            extra_check=checked(fusion, stage, check),
            **kwargs,
        )
    first.clear()



# Fusions found by walking the graph from anchors (patterns/contraction.py) rather than by a traced
# pattern: anchors(graph) lists the candidates' anchor nodes; rewrite(graph, anchor) replaces what the
# anchor stands for and returns True, returns False where the anchor is no candidate at all, and
# raises contraction.Decline (or Unsupported) with the reason where a candidate falls short.
_ANCHORED: list[tuple[str, Callable, Callable]] = []


def register_anchored_rewrite(fusion: str, anchors: Callable[[torch.fx.Graph], list],
                              rewrite: Callable[[torch.fx.Graph, torch.fx.Node], bool]) -> None:
    if (fusion, anchors, rewrite) not in _ANCHORED:
        _ANCHORED.append((fusion, anchors, rewrite))


def apply_anchored_rewrites(graph: torch.fx.Graph, stage: str) -> bool:
    """Every registered anchored rewrite over the graph, each decision recorded (explain())."""
    fired = 0
    for fusion, anchors, rewrite in _ANCHORED:
        if not mla_config.active().enabled(fusion):
            continue
        for anchor in anchors(graph):
            if not anchor.users:
                continue  # left behind by an earlier rewrite of this walk
            try:
                if not rewrite(graph, anchor):
                    continue
            except (contraction.Decline, contraction.Unsupported) as why:
                record_decision(fusion, [anchor], stage, str(why))
            else:
                record_decision(fusion, [anchor], stage, None)
                fired += 1
    if fired:
        graph.eliminate_dead_code()  # the replaced chains, before the next round walks them again
    return fired > 0


def canonical_gemm_splits(graph: torch.fx.Graph) -> int:
    """Cut the last dim of every GEMM output (or a view of it that keeps that dim) the one way the
    patterns are written: right-nested splits in two, `split([a, rest])` then `split([b, rest])`...

    Model code cuts a fused projection's output by one split into three, by nested splits, or by
    slicing; all three are the same pieces. Only GEMM outputs are touched: slices of head-split views
    (RoPE's halves) are spelled as the patterns expect already. Returns how many cuts were rewritten."""
    aten = torch.ops.aten
    rewritten = 0
    for node in list(graph.nodes):
        gemm = node
        while gemm.op == "call_function" and gemm.target in (aten.view.default, aten.reshape.default):
            gemm = gemm.args[0]
        if node.op != "call_function" or gemm.target not in (aten.mm.default, aten.addmm.default):
            continue
        width = node.meta["val"].shape[-1]
        if width != gemm.meta["val"].shape[-1] or not isinstance(width, int):
            continue
        last = node.meta["val"].dim() - 1
        pieces = []  # (start, end, the node that holds the piece)
        for user in node.users:
            if user.target is aten.slice.Tensor and user.args[1] in (-1, last) and (user.args[4:] or (1,))[0] == 1:
                start, end = user.args[2], min(user.args[3], width)
                pieces.append((start, end, user))
            elif user.target is aten.split_with_sizes.default and user.args[2:] in ((-1,), (last,)) \
                    and len(user.args[1]) > 2:
                start = 0
                for index, size in enumerate(user.args[1]):
                    getters = [g for g in user.users if g.target is operator.getitem and g.args[1] == index]
                    pieces += [(start, start + size, g) for g in getters]
                    start += size
            else:
                break
        else:
            pieces.sort(key=lambda p: p[0])
            bounds = sorted({(s, e) for s, e, _ in pieces})
            if len(bounds) < 2 or bounds[0][0] != 0 or bounds[-1][1] != width or any(
                    a[1] != b[0] for a, b in zip(bounds, bounds[1:])):
                continue
            _nested_split(graph, node, bounds, pieces)
            rewritten += 1
    if rewritten:
        graph.eliminate_dead_code()
    return rewritten


def _nested_split(graph, node, bounds, pieces) -> None:
    """The pieces of `node`'s last dim at `bounds`, cut as right-nested splits in two on dim -1."""
    aten = torch.ops.aten
    fake_mode = node.meta["val"].fake_mode
    rest = node
    piece_of = {}
    anchor = node
    for i, (start, end) in enumerate(bounds):
        if i == len(bounds) - 1:
            piece_of[(start, end)] = rest
            break
        with graph.inserting_after(anchor):
            split = graph.call_function(aten.split_with_sizes.default, (rest, [end - start, bounds[-1][1] - end], -1))
        with fake_mode:
            split.meta["val"] = aten.split_with_sizes.default(rest.meta["val"], [end - start, bounds[-1][1] - end], -1)
        outs = []
        for k in (0, 1):
            with graph.inserting_after(split if k == 0 else outs[0]):
                getter = graph.call_function(operator.getitem, (split, k))
            getter.meta["val"] = split.meta["val"][k]
            outs.append(getter)
        piece_of[(start, end)] = outs[0]
        rest, anchor = outs[1], outs[1]
    for start, end, old in pieces:
        old.replace_all_uses_with(piece_of[(start, end)])
