"""What the anchored attention fusions (mla_decode, gqa_decode) share: the anchor, a softmax over the last
dim, and its logits read as (a sum of score contractions) x scale (+ masks), whatever the model code
spelled around them (docs/spellings.md).

`read_logits` walks from the softmax's input back to the contractions through casts, scalar and 0-d
tensor scales, a softcap and the masks (an additive bias, `masked_fill` or `where` with -inf); a fusion
then reads each contraction's axes by role (contraction.py) and builds its op's mask with
`mask_argument`. A walk that reaches something else raises `contraction.Unsupported` (not attention
scores: no candidate) or `Decline` (scores the op cannot express: a reason explain() reports).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Callable, Optional

import torch

from . import contraction
from .contraction import Decline, Emitter, role_through, same


def node_is(node, *targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def scalar(arg) -> Optional[float]:
    return float(arg) if isinstance(arg, (int, float)) and not isinstance(arg, bool) else None


def logits_of_softmax(div: torch.fx.Node) -> Optional[torch.fx.Node]:
    """Y for div = exp(Y - amax(Y)) / sum(exp(...)) over the last dim, also in the form Inductor's joint
    pass leaves when it folds a scale into the softmax (`where(all_inf, scaled, Y - amax(Y))`)."""
    aten = torch.ops.aten
    exp, total = div.args
    if not (node_is(exp, aten.exp.default) and node_is(total, aten.sum.dim_IntList) and total.args[0] is exp):
        return None
    rank = exp.meta["val"].dim()
    if [d % rank for d in total.args[1]] != [rank - 1]:
        return None
    shifted = exp.args[0]
    if node_is(shifted, aten.where.self):
        shifted = shifted.args[2]
    if not node_is(shifted, aten.sub.Tensor) or not node_is(shifted.args[1], aten.amax.default):
        return None
    logits = shifted.args[0]
    return logits if shifted.args[1].args[0] is logits else None


def scores_beside_sinks(logits: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The scores where the softmax's input joins them with attention sinks (gpt-oss, HunYuan:
    `cat([scores, sinks], -1)`, a learned per-head logit in the softmax's denominator only, whose column
    is dropped after; maybe less its row max first), else None. The decode ops have no sinks yet: the
    fusions decline these, with that reason, once they know the scores are theirs."""
    aten = torch.ops.aten
    if node_is(logits, aten.sub.Tensor):  # x - max(x): the softmax's own shift, written out
        shift = logits.args[1]
        if node_is(shift, operator.getitem):
            shift = shift.args[0]
        if node_is(shift, aten.amax.default, aten.max.dim) and shift.args[0] is logits.args[0]:
            logits = logits.args[0]
    if not node_is(logits, aten.cat.default):
        return None
    parts, dim = logits.args[0], logits.args[1] if len(logits.args) > 1 else 0
    if dim % logits.meta["val"].dim() != logits.meta["val"].dim() - 1 or len(parts) != 2:
        return None
    try:
        read_logits(parts[0])
    except (contraction.Unsupported, Decline):
        return None
    return parts[0]


SINKS = "attention sinks (a learned per-head logit in the softmax's denominator) are not supported yet"


@dataclasses.dataclass
class Logits:
    terms: list  # nodes: the results of score contractions, summed
    scale: float  # on the sum of the terms
    bias: Optional[torch.fx.Node]  # an additive mask
    bias_scale: float  # the scale applied to the bias after it was added (a mask added before scaling)
    scale_tensors: list  # (0-d tensor node, divides): a scale the graph holds as a tensor, on the whole sum
    bias_scaled_by_tensors: bool  # whether the bias was added before those
    softcap: float  # cap * tanh(scaled scores / cap) before the mask; 0: none
    admit: Optional[object]  # a bool mask node, true where a row counts, or ("not", node)


def read_logits(node: torch.fx.Node) -> Logits:
    """The logits as scale x (sum of contraction results) + bias, masked: what the op computes."""
    aten, prims = torch.ops.aten, torch.ops.prims
    out = Logits(terms=[], scale=1.0, bias=None, bias_scale=1.0, scale_tensors=[], bias_scaled_by_tensors=False,
                  softcap=0.0, admit=None)

    def is_neg_inf(arg) -> bool:
        if node_is(arg, aten.full.default):
            arg = arg.args[1]
        elif node_is(arg, aten.scalar_tensor.default):
            arg = arg.args[0]
        return isinstance(arg, float) and arg == float("-inf")

    def admit(mask) -> None:
        if out.admit is not None:
            raise Decline("two boolean masks")
        out.admit = mask

    def visit(n, above: float, split: bool = False, capped: bool = False) -> float:
        """The scale within n's subtree; `above` is the scale applied to n on its way to the softmax;
        `split` once n is one of two added score terms, `capped` once it is under a softcap."""
        if node_is(n, prims.convert_element_type.default, aten.clone.default, aten.alias.default):
            return visit(n.args[0], above, split, capped)  # same elements, same layout
        if (cap := softcap_of(n)) is not None:  # cap * tanh(scores / cap), on the whole scaled sum
            if out.softcap or split or above != 1.0 or out.scale_tensors:
                raise Decline("a softcap the op cannot express (twice, on one term, or scaled after)")
            out.softcap = cap
            return visit(n.args[0].args[0].args[0], 1.0, split, capped=True)
        if node_is(n, aten.mul.Tensor, aten.div.Tensor) and scalar(n.args[1]) is not None:
            s = scalar(n.args[1]) if n.target is aten.mul.Tensor else 1.0 / scalar(n.args[1])
            return s * visit(n.args[0], above * s, split, capped)
        if node_is(n, aten.mul.Tensor, aten.div.Tensor) and is_scalar_tensor(n.args[1]):
            # torch.compile(dynamic=True) passes a module's float (the softmax scale) as a 0-d tensor
            if split or capped:
                raise Decline("a tensor scale on one of the score terms or under a softcap")
            out.scale_tensors.append((n.args[1], n.target is aten.div.Tensor))
            return visit(n.args[0], above, split)
        masking = node_is(n, aten.where.self, aten.masked_fill.Scalar, aten.add.Tensor) and not (
            node_is(n, aten.add.Tensor) and all(is_score_sum(a) for a in n.args[:2]))
        if masking and capped:  # tanh(-inf) is -1: a mask under the cap does not exclude the row
            raise Decline("a mask under the softcap")
        if node_is(n, aten.where.self) and (is_neg_inf(n.args[1]) or is_neg_inf(n.args[2])):
            keep_first = is_neg_inf(n.args[2])
            admit(n.args[0] if keep_first else ("not", n.args[0]))
            return visit(n.args[1] if keep_first else n.args[2], above)
        if node_is(n, aten.masked_fill.Scalar) and is_neg_inf(n.args[2]):
            admit(("not", n.args[1]))
            return visit(n.args[0], above)
        if node_is(n, aten.add.Tensor) and all(isinstance(a, torch.fx.Node) for a in n.args[:2]):
            sides = [a for a in n.args[:2] if not is_score_sum(a)]
            if len(sides) == 1:  # scores + mask
                if out.bias is not None:
                    raise Decline("two additive masks")
                out.bias, out.bias_scale, out.bias_scaled_by_tensors = sides[0], above, bool(out.scale_tensors)
                return visit(n.args[0] if sides[0] is n.args[1] else n.args[1], above, split)
            if sides:
                raise Decline(f"{n.name} adds two tensors neither of which is a contraction")
            first, second = visit(n.args[0], above, True, capped), visit(n.args[1], above, True, capped)
            if not math.isclose(first, second, rel_tol=1e-6):
                raise Decline("the score contractions are scaled differently")
            return first
        origin = contraction.trace_back(n).origin
        if not node_is(origin, aten.bmm.default, aten.mm.default):  # not attention scores: no candidate
            raise contraction.Unsupported(f"the softmax input reaches {n.name} ({n.target}), not a contraction")
        out.terms.append(n)
        return 1.0

    out.scale = visit(node, 1.0)
    if out.scale <= 0:
        raise Decline(f"the scores are scaled by {out.scale}, not a positive scale")
    return out


def softcap_of(n) -> Optional[float]:
    """cap where n is `cap * tanh(x / cap)` (or `x * (1 / cap)`), Gemma-2's logit softcap."""
    aten = torch.ops.aten
    if not (node_is(n, aten.mul.Tensor) and scalar(n.args[1]) and node_is(n.args[0], aten.tanh.default)):
        return None
    cap, inner = scalar(n.args[1]), n.args[0].args[0]
    if not (node_is(inner, aten.mul.Tensor, aten.div.Tensor) and scalar(inner.args[1])):
        return None
    inverse = scalar(inner.args[1]) if inner.target is aten.div.Tensor else 1.0 / scalar(inner.args[1])
    return cap if cap > 0 and math.isclose(inverse, cap, rel_tol=1e-6) else None


def is_scalar_tensor(arg) -> bool:
    value = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dim() == 0


def scale_by_tensors(emit: Emitter, x: torch.fx.Node, logits: Logits) -> torch.fx.Node:
    """x times the scales the graph holds as tensors."""
    for scale, divides in logits.scale_tensors:
        x = emit(torch.ops.aten.div.Tensor if divides else torch.ops.aten.mul.Tensor, x, scale)
    return x


def is_score_sum(n) -> bool:
    """Whether n is (a scaled sum of) contraction results, through layout ops and casts."""
    aten, prims = torch.ops.aten, torch.ops.prims
    def scaled(n) -> bool:
        return node_is(n, aten.mul.Tensor, aten.div.Tensor) and (
            scalar(n.args[1]) is not None or is_scalar_tensor(n.args[1]))

    while node_is(n, prims.convert_element_type.default, aten.tanh.default) or scaled(n):
        n = n.args[0]
    if node_is(n, aten.add.Tensor):
        return all(isinstance(a, torch.fx.Node) and is_score_sum(a) for a in n.args[:2])
    try:
        return node_is(contraction.trace_back(n).origin, aten.bmm.default, aten.mm.default)
    except contraction.Unsupported:
        return False


def score_contraction(term: torch.fx.Node) -> tuple[contraction.Contraction, contraction.Layout, bool]:
    """The contraction behind a term of the logits, its output's layout at the term (through the layout
    ops between), and whether the queries are its first operand (the softmax runs over the other's free
    dim). Unsupported where the scores are used elsewhere too, or the softmax's dim is not one operand's."""
    scores = contraction.Contraction.of(contraction.trace_back(term).origin)
    at, layout = scores.node, scores.output_layout()
    while at is not term:
        if len(at.users) != 1:
            raise contraction.Unsupported(f"{scores.node.name}'s result is used before the softmax")
        (at,) = at.users
        layout = contraction.apply(layout, at)
    last = layout.dims[-1]
    if not last or len({f.label[0] for f in last}) != 1 or last[0].label[0] not in ("m", "n"):
        raise contraction.Unsupported("the softmax does not run over one operand's free dim")
    return scores, layout, last[0].label[0] == "n"


def next_contraction(node: torch.fx.Node) -> Optional[tuple[contraction.Contraction, bool]]:
    """The contraction that reads `node` (through layout ops) and whether node is its first operand."""
    end, _, _ = contraction.trace_forward(node, contraction.Layout.identity(contraction.shape(node)))
    users = list(end.users)
    if len(users) != 1 or not node_is(users[0], torch.ops.aten.bmm.default, torch.ops.aten.mm.default):
        return None
    c = contraction.Contraction.of(users[0])
    if c.a.origin is node:
        return c, True
    if c.b.origin is node:
        return c, False
    return None


def roles_of_contraction(c: contraction.Contraction, from_a: bool, source_roles: list, free_other: str,
                          broadcast_other: str) -> dict:
    """Axis roles of a contraction whose operand (a if from_a) reads a tensor with `source_roles`:
    contracted axes keep that tensor's role; the other operand's free axes are `free_other`."""
    roles = {}
    for axis, (fa, fb, _) in c.axes.items():
        mine, other = (fa, fb) if from_a else (fb, fa)
        if mine is not None:
            if mine.label is None:
                roles[axis] = broadcast_other
            else:
                roles[axis] = role_through(mine, source_roles)
        else:
            roles[axis] = free_other
    return roles


def mask_argument(emit: Emitter, logits: Logits, view: Callable[[torch.fx.Node], torch.fx.Node]
                  ) -> Optional[torch.fx.Node]:
    """The logits' masks as one mask (bool, True where a row counts, or an additive float bias), each laid
    out by `view` as the op takes it (as_rows_mask: decode's [batch or 1, rows])."""
    aten = torch.ops.aten
    bias = view(logits.bias) if logits.bias is not None else None
    if bias is not None and logits.bias_scale != 1.0:  # added before a scale: scaled with the scores
        bias = emit(aten.mul.Tensor, bias, logits.bias_scale)
    if bias is not None and logits.bias_scaled_by_tensors:
        bias = scale_by_tensors(emit, bias, logits)
    admit = None
    if logits.admit is not None:
        negate = isinstance(logits.admit, tuple)
        admit = view(logits.admit[1] if negate else logits.admit)
        if negate:
            admit = emit(aten.logical_not.default, admit)
    if bias is None or admit is None:
        return admit if bias is None else bias
    return emit(aten.where.self, admit, bias, emit(aten.full.default, [], float("-inf"), dtype=bias.meta["val"].dtype,
                                                   device=bias.meta["val"].device, pin_memory=False))


def as_rows_mask(emit: Emitter, scores_roles: list, mask: torch.fx.Node, batch: int, rows: int) -> torch.fx.Node:
    """A mask broadcast over the scores as [batch or 1, rows], if it is one per request and row."""
    aten = torch.ops.aten
    shape = contraction.shape(mask)
    roles = scores_roles[len(scores_roles) - len(shape):]
    kept = []
    for size, entries in zip(shape, roles):
        if same(size, 1):
            continue
        names = list(dict.fromkeys(r for r, s, _ in entries if not same(s, 1)))
        if names not in (["request"], ["rows"]):
            raise Decline("the mask differs between heads or query rows")
        kept.append(names[0])
    if kept not in ([], ["rows"], ["request", "rows"]):
        raise Decline("the mask is not per request and row")
    return emit(aten.reshape.default, mask, [batch if "request" in kept else 1, rows])


def softmax_divisions(graph: torch.fx.Graph) -> list:
    """The anchors: every division, of which logits_of_softmax picks the softmaxes."""
    return [n for n in graph.nodes if node_is(n, torch.ops.aten.div.Tensor)]
