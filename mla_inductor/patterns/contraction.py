"""Contractions as einsums over the tensors they read: the semantic view of a `bmm` / `mm` that the
anchored fusions match on, whatever layout ops the model code (or einsum's own decomposition) put
around it.

Model code spells one contraction in many ways: `torch.einsum` decomposes into unsqueeze / permute /
reshape chains around a `bmm`; `matmul` and `@` broadcast and fold batch dims; a weight is transposed
as a view or as a copy; a cache is sliced, gathered, expanded over heads. All of these are layout
ops: they change which element sits where, not any value. `Layout` replays such a chain
symbolically: every dim of the result is a list of *factors* (outer to inner), each naming the dim
of the origin tensor it indexes (`label`), its extent and its stride in that dim; `offsets` hold
where slices and selects start. A factor with label None is a broadcast (an expand). So the
operands of a bmm become (origin tensor, one factor list per bmm dim), and the bmm itself an
einsum over origin dims: `Contraction`.

The fusions then decide by roles (which origin dim is contracted, shared, broadcast), never by the
text of the chain, and build their op's arguments from the origin tensors (views, no copies) or
from the operands (whatever the original graph already computed).

Sizes may be dynamic (SymInts: a decode loop's growing cache length, a served batch). Every decision
about them is one that holds for all values of the symbols (`same`, `quotient`: statically known,
so the replay never adds a guard), and a size an emitted op needs is read from the graph node that
holds it (`Emitter`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from typing import Callable, Hashable, Optional, Sequence, Union

import torch
from torch.fx import Node
from torch._guards import detect_fake_mode
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils import _pytree as pytree

aten, prims = torch.ops.aten, torch.ops.prims


Size = Union[int, torch.SymInt]


@dataclasses.dataclass(frozen=True, eq=False)  # keyed by identity: a dynamic size is not hashable
class Factor:
    label: Optional[Hashable]  # the origin dim (or axis) this factor indexes; None: broadcast
    size: Size
    stride: Size  # in units of the origin dim's index

    def matches(self, other: "Factor") -> bool:
        return self.label == other.label and same(self.size, other.size) and same(self.stride, other.stride)


def same_dims(a: list[list[Factor]], b: list[list[Factor]]) -> bool:
    """Two layouts' dims, factor by factor."""
    return len(a) == len(b) and all(len(x) == len(y) and all(f.matches(g) for f, g in zip(x, y)) for x, y in zip(a, b))


class Unsupported(Exception):
    """A layout op this replay does not model (a fusion then declines, saying why)."""


class Decline(Exception):
    """A candidate that fails a condition of its fusion: the message says which (explain())."""


def same(a, b) -> bool:
    """a == b for every value of the symbols in them (no guard is added)."""
    return statically_known_true(a == b)


def quotient(a: Size, b: Size) -> Optional[Size]:
    """a / b where b divides a for every value of the symbols, else None."""
    if isinstance(a, int) and isinstance(b, int):
        return a // b if a % b == 0 else None
    q = a // b
    return q if same(q * b, a) else None


def shape(node: Node) -> list[Size]:
    return list(node.meta["val"].shape)


# The ops of a graph's inputs: arguments and parameters (placeholders), constants (get_attr).
GRAPH_INPUT_OPS = ("placeholder", "get_attr")


def node_value(arg):
    """An argument's value: the example (fake) tensor or SymInt behind a graph node, or the literal."""
    return arg.meta["val"] if isinstance(arg, Node) else arg


@dataclasses.dataclass
class Layout:
    """Where each element of a tensor comes from: per dim, factors over labelled origin dims."""

    dims: list[list[Factor]]
    offsets: dict  # label -> start index in the origin dim

    @classmethod
    def identity(cls, shape: Sequence[int], labels: Optional[Sequence[Hashable]] = None) -> "Layout":
        labels = labels if labels is not None else range(len(shape))
        return cls([[Factor(lab, n, 1)] if not same(n, 1) else [] for lab, n in zip(labels, shape)], {})

    def sizes(self) -> list[Size]:
        return [math.prod(f.size for f in dim) for dim in self.dims]

    def factors(self) -> list[Factor]:
        return [f for dim in self.dims for f in dim]

    def copy(self) -> "Layout":
        return Layout([list(d) for d in self.dims], dict(self.offsets))

    # --- the layout ops ---------------------------------------------------------------------------

    def reshape(self, shape: Sequence[Size]) -> "Layout":
        pending = [f for f in self.factors() if not same(f.size, 1)]
        dims = []
        for size in shape:
            dim, product = [], 1
            while not same(product, size):
                missing = quotient(size, product)
                if not pending or missing is None:
                    raise Unsupported(f"reshape to {list(shape)}")
                f = pending.pop(0)
                if quotient(missing, f.size) is not None:  # f fits in this dim whole
                    dim.append(f)
                    product *= f.size
                    continue
                inner = quotient(f.size, missing)  # split f into outer x inner: the outer part completes this dim
                if inner is None:
                    raise Unsupported(f"reshape to {list(shape)} splits a factor of {f.size}")
                dim.append(Factor(f.label, missing, f.stride * inner))
                pending.insert(0, Factor(f.label, inner, f.stride))
                product = size
            dims.append(dim)
        if pending:
            raise Unsupported(f"reshape to {list(shape)}")
        return Layout(dims, dict(self.offsets))

    def permute(self, order: Sequence[int]) -> "Layout":
        return Layout([self.dims[d] for d in order], dict(self.offsets))

    def unsqueeze(self, dim: int) -> "Layout":
        dims = list(self.dims)
        dims.insert(dim if dim >= 0 else dim + len(dims) + 1, [])
        return Layout(dims, dict(self.offsets))

    def squeeze(self, dims: Sequence[int]) -> "Layout":
        rank = len(self.dims)
        drop = {d % rank for d in dims if same(self.sizes()[d % rank], 1)}
        return Layout([d for i, d in enumerate(self.dims) if i not in drop], dict(self.offsets))

    def expand(self, shape: Sequence[Size]) -> "Layout":
        lead = len(shape) - len(self.dims)
        dims = [[Factor(None, n, 0)] if not same(n, 1) else [] for n in shape[:lead]]
        for dim, size, n in zip(self.dims, self.sizes(), shape[lead:]):
            dims.append(dim if same(size, n) else [Factor(None, n, 0)])
        return Layout(dims, dict(self.offsets))

    def repeat(self, repeats: Sequence[Size]) -> "Layout":
        """`Tensor.repeat`: each dim tiled, the copies outermost (a broadcast factor before the dim's own);
        repeats beyond the rank are new leading dims."""
        lead = len(repeats) - len(self.dims)
        dims = [[Factor(None, n, 0)] if not same(n, 1) else [] for n in repeats[:lead]]
        for dim, n in zip(self.dims, repeats[lead:]):
            dims.append(dim if same(n, 1) else [Factor(None, n, 0), *dim])
        return Layout(dims, dict(self.offsets))

    def slice(self, dim: int, start: Size, length: Size, step: int = 1) -> "Layout":
        """`length` elements of `dim` from `start` (not negative) by `step`."""
        dim %= len(self.dims)
        if same(start, 0) and step == 1 and same(length, self.sizes()[dim]):
            return self.copy()
        factors = [f for f in self.dims[dim] if not same(f.size, 1)]
        if len(factors) != 1:
            raise Unsupported(f"a slice of a dim made of {len(factors)} factors")
        (f,) = factors
        out = self.copy()
        out.dims[dim] = [Factor(f.label, length, f.stride * step)]
        if f.label is not None:
            out.offsets[f.label] = out.offsets.get(f.label, 0) + start * f.stride
        return out

    def select(self, dim: int, index: Size) -> "Layout":
        out = self.slice(dim, index, 1)
        del out.dims[dim % len(self.dims)]
        return out


# --- replaying the ops of a graph -----------------------------------------------------------------

_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_SAME = {aten.clone.default, aten.alias.default, aten.detach.default, aten.contiguous.default,
         prims.convert_element_type.default, aten._to_copy.default, aten.lift_fresh_copy.default}
SPLITS = {aten.split_with_sizes.default, aten.split.Tensor}  # read by their items (is_split_item)
LAYOUT_OPS = _VIEWS | _SAME | {
    aten.permute.default, aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.squeeze.default, aten.expand.default, aten.repeat.default, aten.slice.Tensor,
    aten.select.int,
}


def is_split_item(node: Node) -> bool:
    return (node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[0], Node) and node.args[0].target in SPLITS)


def is_layout_op(node: Node) -> bool:
    return node.op == "call_function" and (node.target in LAYOUT_OPS or is_split_item(node))


def layout_input(node: Node) -> Node:
    return node.args[0].args[0] if is_split_item(node) else node.args[0]


def _start(layout: Layout, dim: int, start) -> Size:
    """A slice's or select's start as an index from the front (Python's negative indices, clamped)."""
    start = 0 if start is None else node_value(start)
    if isinstance(start, int) and start < 0:
        return max(0, start + layout.sizes()[dim % len(layout.dims)])
    return start


def apply(layout: Layout, node: Node) -> Layout:
    """The layout of `node`'s output, given the layout of its tensor input."""
    t, args = node.target, node.args
    if is_split_item(node):
        split, index = node.args
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        start = sum(s.shape[dim] for s in split.meta["val"][:index])
        return layout.slice(dim, start, shape(node)[dim])
    if t in _VIEWS:
        return layout.reshape(shape(node))
    if t in _SAME:
        return layout.copy()
    if t is aten.permute.default:
        return layout.permute([d % len(layout.dims) for d in args[1]])
    if t is aten.transpose.int or t is aten.t.default:
        d0, d1 = (args[1], args[2]) if t is aten.transpose.int else (0, 1)
        order = list(range(len(layout.dims)))
        order[d0 % len(order)], order[d1 % len(order)] = order[d1 % len(order)], order[d0 % len(order)]
        return layout.permute(order)
    if t is aten.unsqueeze.default:
        return layout.unsqueeze(args[1])
    if t is aten.squeeze.default:
        return layout.squeeze(range(len(layout.dims)))
    if t is aten.squeeze.dim:
        return layout.squeeze([args[1]])
    if t is aten.squeeze.dims:
        return layout.squeeze(args[1])
    if t is aten.expand.default:
        return layout.expand(shape(node))
    if t is aten.repeat.default:
        return layout.repeat(args[1])
    if t is aten.slice.Tensor:
        dim, start, _, step = (list(args[1:]) + [0, None, None, 1][len(args) - 1:])[:4]
        return layout.slice(dim, _start(layout, dim, start), shape(node)[dim % len(layout.dims)], step)
    if t is aten.select.int:
        return layout.select(args[1], _start(layout, args[1], args[2]))
    raise Unsupported(str(t))


@dataclasses.dataclass
class Operand:
    """A tensor read through a chain of layout ops: its origin (the first node that is not a layout op)
    and where each of its elements sits in the origin (labels are the origin's dims)."""

    node: Node  # the operand itself
    origin: Node
    layout: Layout
    chain: list[Node]  # the layout ops, origin side first
    casts: list[torch.dtype]  # dtype conversions on the way


def trace_back(node: Node) -> Operand:
    chain = []
    origin = node
    while is_layout_op(origin):
        chain.append(origin)
        origin = layout_input(origin)
    chain.reverse()
    layout = Layout.identity(shape(origin))
    casts = []
    for op in chain:
        layout = apply(layout, op)
        if op.target in (prims.convert_element_type.default, aten._to_copy.default):
            casts.append(op.meta["val"].dtype)
    return Operand(node, origin, layout, chain, casts)


def trace_forward(node: Node, layout: Layout) -> tuple[Node, Layout, list[Node]]:
    """Follow `node`'s only user while it is a layout op: the tensor the value reaches and its layout."""
    chain = []
    while len(node.users) == 1:
        (user,) = node.users
        if not is_layout_op(user) or layout_input(user) is not node:
            break
        layout = apply(layout, user)
        chain.append(user)
        node = user
    return node, layout, chain


@dataclasses.dataclass
class Contraction:
    """out[batch, m, n] = sum_k a[batch, m, k] * b[batch, k, n] (a bmm, or an mm with no batch), its
    operands traced to their origins. Axes: ("batch", i), ("m", i), ("n", i), ("k", i): the factors of
    each bmm dim, which `a_factor` / `b_factor` map to the operands' origin dims."""

    node: Node
    a: Operand
    b: Operand
    axes: dict  # axis -> (a's Factor or None, b's Factor or None, size)

    @classmethod
    def of(cls, node: Node) -> "Contraction":
        if node.target not in (aten.bmm.default, aten.mm.default):
            raise Unsupported(f"{node.target} is not a contraction")
        a, b = trace_back(node.args[0]), trace_back(node.args[1])
        batched = node.target is aten.bmm.default
        a_dims, b_dims = a.layout.dims, b.layout.dims
        a_batch, a_m, a_k = (a_dims if batched else [[], *a_dims])
        b_batch, b_k, b_n = (b_dims if batched else [[], *b_dims])
        axes = {}
        for kind, fa, fb in (("batch", a_batch, b_batch), ("k", a_k, b_k)):
            fa, fb = _align(fa, fb)
            for i, (x, y) in enumerate(zip(fa, fb)):
                axes[(kind, i)] = (x, y, x.size)
        for i, f in enumerate(x for x in a_m if not same(x.size, 1)):
            axes[("m", i)] = (f, None, f.size)
        for i, f in enumerate(x for x in b_n if not same(x.size, 1)):
            axes[("n", i)] = (None, f, f.size)
        return cls(node, a, b, axes)

    def output_layout(self) -> Layout:
        """The bmm's output with each dim's factors labelled by axis."""
        batched = self.node.target is aten.bmm.default
        groups = [[ax for ax in self.axes if ax[0] == kind] for kind in ("batch", "m", "n")]
        dims = [[Factor(ax, self.axes[ax][2], 1) for ax in group] for group in groups]
        return Layout(dims if batched else dims[1:], {})

    def result(self) -> tuple[Node, Layout, list[Node]]:
        """Where the contraction's value goes: the last of its single-user layout ops."""
        return trace_forward(self.node, self.output_layout())


def _align(fa: list[Factor], fb: list[Factor]) -> tuple[list[Factor], list[Factor]]:
    """Refine two factor lists of one dim (equal total size) to factors of equal sizes, pairwise."""
    fa, fb = [f for f in fa if not same(f.size, 1)], [f for f in fb if not same(f.size, 1)]
    out_a, out_b = [], []
    while fa and fb:
        x, y = fa.pop(0), fb.pop(0)
        if same(x.size, y.size):
            out_a.append(x), out_b.append(y)
        elif (r := quotient(x.size, y.size)) is not None:
            out_a.append(Factor(x.label, y.size, x.stride * r)), out_b.append(y)
            fa.insert(0, Factor(x.label, r, x.stride))
        elif (r := quotient(y.size, x.size)) is not None:
            out_a.append(x), out_b.append(Factor(y.label, x.size, y.stride * r))
            fb.insert(0, Factor(y.label, r, y.stride))
        else:
            raise Unsupported("operand dims that do not factor alike")
    if fa or fb:
        raise Unsupported("operand dims of different sizes")
    return out_a, out_b


# --- building a fused op's arguments from the roles of axes ----------------------------------------


def dim_roles(layout: Layout, role_of: Callable[[Factor], str]) -> list[list[tuple[str, int, int]]]:
    """Per dim of a tensor: (role, size, stride in the dim) of each factor, outer to inner."""
    out = []
    for dim in layout.dims:
        entries, stride = [], 1
        for f in reversed(dim):
            entries.append((role_of(f), f.size, stride))
            stride *= f.size
        out.append(entries[::-1])
    return out


def axis_roles(layout: Layout, role_of_axis: dict) -> list[list[tuple[str, int, int]]]:
    """`dim_roles` of a contraction's output (or of a tensor traced from it), whose factors are axes."""
    return dim_roles(layout, lambda f: role_of_axis[f.label])


def role_through(factor: Factor, roles: list) -> str:
    """The role of a factor of an operand read from a tensor whose dims carry `roles` (`dim_roles`)."""
    for role, size, stride in roles[factor.label]:
        if same(size, factor.size) and same(stride, factor.stride):
            return role
    raise Decline("a contraction operand merges two roles of the tensor it reads")


class Emitter:
    """Appends aten calls before `before`, each with its example value (the graph's fake mode), so that
    later passes (and the next round of patterns) see them as they see traced nodes, and the module
    path of `like`. A dynamic size among the arguments is read from the graph (`size_node`)."""

    def __init__(self, graph: torch.fx.Graph, before: Node, like: Optional[Node] = None):
        self.graph, self.before = graph, before
        self.fake_mode = detect_fake_mode(pytree.tree_leaves((like or before).meta["val"]))
        self.module_stack = (like or before).meta.get("nn_module_stack", {})  # where explain() says it fired
        self.size_nodes = {}

    def __call__(self, target, *args, **kwargs) -> Node:
        args, kwargs = torch.fx.node.map_aggregate((args, kwargs), self.size_arg)
        with self.graph.inserting_before(self.before):
            node = self.graph.call_function(target, args, kwargs)
        fake = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*fake[0], **fake[1])
        node.meta["nn_module_stack"] = self.module_stack
        return node

    def cast(self, node: Node, dtype: torch.dtype) -> Node:
        """node in `dtype` (itself when it already is)."""
        return node if node.meta["val"].dtype == dtype else self(prims.convert_element_type.default, node, dtype)

    def size_arg(self, size: Size):
        """`size` as an argument of an emitted op: an int as it is, a dynamic size as `size_node`."""
        return self.size_node(size) if isinstance(size, torch.SymInt) else size

    def size_node(self, size: torch.SymInt):
        """A node ahead of `before` whose value is `size`: a symbolic int the graph computes, else a
        `sym_size` of a tensor that has it as a dim."""
        expr = size.node.expr
        if expr.is_number:
            return int(expr)
        if expr not in self.size_nodes:
            self.size_nodes[expr] = self._find_size(expr)
        return self.size_nodes[expr]

    def _find_size(self, expr) -> Node:
        earlier = list(itertools.takewhile(lambda n: n is not self.before, self.graph.nodes))
        for node in earlier:
            val = node.meta.get("val")
            if isinstance(val, torch.SymInt) and val.node.expr == expr:
                return node
        for node in earlier:
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                for dim, size in enumerate(val.shape):
                    if isinstance(size, torch.SymInt) and size.node.expr == expr:
                        return self(aten.sym_size.int, node, dim)
        raise Decline(f"no node of the graph holds the dynamic size {expr}")


def operand_in_role_order(emit: Emitter, c: Contraction, of_a: bool, roles: dict, order: Sequence[str],
                          sizes: dict) -> Node:
    """A bmm operand (a if of_a) as a tensor of dims `order` (of `sizes`; a role no axis has is a dim
    of 1), its axes named by `roles`. An axis of another role along which this operand is broadcast
    (an expand the graph materialised, e.g. matmul's over a weight) is read at its first index."""
    groups = ("batch", "m", "k") if of_a else ("batch", "k", "n")
    axes = [ax for g in groups[0 if c.node.target is aten.bmm.default else 1:] for ax in c.axes if ax[0] == g]
    broadcast = [a for a in axes if roles[a] not in order and c.axes[a][0 if of_a else 1].label is None]
    return _in_role_order(emit, c.node.args[0 if of_a else 1], axes, roles, order, sizes, broadcast)


def _in_role_order(emit: Emitter, node: Node, axes: list, roles: dict, order: Sequence[str],
                   sizes: dict, broadcast: Sequence) -> Node:
    """node, whose dims flattened are `axes` (outer to inner, each of one role), as a tensor of dims `order`."""
    if any(roles[a] not in order and a not in broadcast for a in axes):
        raise Decline(f"an operand has a dim that is none of {', '.join(order)}")
    flat = emit(aten.reshape.default, node, [sizes[roles[a]] for a in axes])
    for dim in reversed(range(len(axes))):
        if axes[dim] in broadcast:
            flat = emit(aten.select.int, flat, dim, 0)
    axes = [a for a in axes if a not in broadcast]
    if len({roles[a] for a in axes}) != len(axes):
        raise Decline("a role spans two factors of an operand")
    present = [roles[a] for a in axes]
    flat = emit(aten.permute.default, flat, [present.index(r) for r in order if r in present])
    return emit(aten.reshape.default, flat, [sizes[r] for r in order])


def from_role_order(emit: Emitter, node: Node, order: Sequence[str], sizes: dict,
                     result: Node, result_roles: list) -> Node:
    """The op's output `node` (dims `order`) laid out as the `result` it replaces, whose dims carry
    `result_roles`, in its dtype."""
    sequence = [role for dim in result_roles for role, _, _ in dim]
    present = [r for r in order if sizes[r] != 1]
    if sorted(sequence) != sorted(present):
        raise Decline("the result does not hold one request x head x column per element")
    flat = emit(aten.reshape.default, node, [sizes[r] for r in present])
    flat = emit(aten.permute.default, flat, [present.index(r) for r in sequence])
    return emit.cast(emit(aten.reshape.default, flat, shape(result)), result.meta["val"].dtype)


