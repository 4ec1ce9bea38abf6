"""mla_prefill: attention of many query rows whose q/k and v head sizes differ (MLA's prefill: 192 and 128)
into `mla::prefill_attention`.

ATen's CPU flash attention needs one head size for q, k and v, so SDPA sends MLA's prefill to its math
path: the whole [B, heads, Tq, Tk] score tensor in memory (4 GiB a layer at 8192 tokens), ATen's bmm, and
Inductor's kernels over the scores. Spellings found in real graphs:
- `F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)`: transformers' `sdpa` attention
  (every MLA family it ships: DeepSeek V2 / V3, and the families built on their attention), serving code's
  torch-native backends. Under torch.compile transformers always passes a materialised mask (bool, [B, 1,
  Tq, Tk], causal and padding), never `is_causal`; the op reads each query row's admitted range from it.
  The call is rewritten in Dynamo's graph (the pre-grad stage), where it is still one node: once AOT
  has decomposed it, the math path is a dozen nodes whose shape depends on the strides of k and v.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..ops.mla_prefill import check_args
from ..record import record_decision

FUSION = "mla_prefill"
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def _value(arg):
    """A node's example value (Dynamo's graph), or the literal itself."""
    return arg.meta.get("example_value") if isinstance(arg, torch.fx.Node) else arg


def _sdpa_arguments(node: torch.fx.Node) -> dict:
    bound = dict(zip(_SDPA_ARGS, node.args))
    return {**_SDPA_DEFAULTS, **bound, **node.kwargs}


def is_candidate(kw: dict) -> bool:
    """Whether the SDPA call takes the math path for differing head sizes over many query rows (others,
    ATen's flash attention serves, or a decode fusion)."""
    query, value = _value(kw["query"]), _value(kw["value"])
    return (isinstance(query, torch.Tensor) and isinstance(value, torch.Tensor) and query.dim() == value.dim() == 4
            and query.device.type == "cpu" and not statically_known_true(query.shape[-1] == value.shape[-1])
            and not statically_known_true(query.shape[2] == 1))


def _decline_reason(kw: dict) -> Optional[str]:
    """Why the candidate SDPA call with arguments `kw` is not rewritten (None: it is)."""
    query, key, value, mask = (_value(kw[name]) for name in ("query", "key", "value", "attn_mask"))
    if query.dtype != torch.bfloat16:
        return f"the attention is {query.dtype}; the template serves bf16"
    if not isinstance(key, torch.Tensor) or key.dim() != 4:
        return "key is not [batch, heads, rows, head_dim]"
    if kw["dropout_p"] != 0.0:
        return f"dropout_p is {kw['dropout_p']}"
    if not isinstance(kw["scale"], (float, int, type(None))) or not isinstance(kw["is_causal"], bool):
        return "the scale or the causal flag is not a constant"
    if kw["is_causal"] and (mask is not None or not statically_known_true(query.shape[2] == key.shape[2])):
        # SDPA's is_causal aligns the first rows; the op's, the last: they agree where Tq == Tk
        return "is_causal with a mask, or with fewer query rows than key rows (top-left aligned)"
    if query.shape[1] != key.shape[1] and not kw["enable_gqa"]:
        return "query and key heads differ without enable_gqa"
    if mask is not None and not isinstance(mask, torch.Tensor):
        return "the mask has no example value"
    try:
        check_args(query, key, value, mask, kw["is_causal"])
    except ValueError as error:
        return str(error).removeprefix("mla::prefill_attention: ")
    return None


def rewrite_sdpa(graph: torch.fx.Graph, stage: str) -> int:
    """Every SDPA call of Dynamo's graph that takes SDPA's math path for differing head sizes, as
    mla::prefill_attention; returns how many."""
    fired = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not F.scaled_dot_product_attention:
            continue
        kw = _sdpa_arguments(node)
        if not is_candidate(kw):
            continue
        reason = _decline_reason(kw)
        record_decision(FUSION, [node], stage, reason)
        if reason is not None:
            continue
        args = (kw["query"], kw["key"], kw["value"], kw["attn_mask"], kw["is_causal"], kw["scale"])
        with graph.inserting_before(node):
            fused = graph.call_function(torch.ops.mla.prefill_attention.default, args)
        fused.meta.update(node.meta)
        with _value(kw["query"]).fake_mode:  # Dynamo's, which made every example value of this graph
            fused.meta["example_value"] = torch.ops.mla.prefill_attention.default(*(_value(a) for a in args))
        node.replace_all_uses_with(fused)
        graph.erase_node(node)
        fired += 1
    return fired
