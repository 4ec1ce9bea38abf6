"""qkv_a_proj: the two A-projections of an MLA layer that read the same hidden states, and the
RMSNorms of their latents, into one `mla::qkv_a_proj`.

Spellings found in real graphs, each written below as the model code it matches:
- transformers DeepseekV3/V2: `q_a_proj` and `kv_a_proj_with_mqa` as two Linears over the same x
  (with `attention_bias`, as addmm), or `q_proj` with no norm where q_lora_rank is None;
- vLLM / SGLang: one Linear over the concatenated weight (`fused_qkv_a_proj_with_mqa`), then split;
- DeepSeek's reference code (`inference/model.py`): two Linears, norms by `F.rms_norm`.
Each form is registered with both norms (transformers' rounds to the dtype before the weight
multiplies, torch's after; the op's template rounds once, as torch's), for 2-D [tokens, hidden] and
3-D [batch, seq, hidden] x, for bf16/fp16 (the norm casts to fp32 and back) and fp32 (no casts), and
transformers' norm with eps as a literal or as a 0-d tensor (what `dynamic=True` makes of a module's
float attribute).
"""

from __future__ import annotations

import itertools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch._inductor.pattern_matcher import Match

from ..lowerings.segment_gemm import template_wins
from ..ops.qkv_a import check_args
from .quantized_linear import decline_reason, int8_weight_only, on_amx_tiles, row_split_reason
from .registry import node_value, register_fusion, size_hint

FUSION = "qkv_a_proj"
# Distinct magic eps values: each literal in a traced pattern becomes the argument it stands for.
# Exact in fp32: F.rms_norm's decomposition rounds eps to fp32 before it reaches the graph, and the
# traced literal must be the magic value to be recognised.
_EPS_WORKAROUND = {"q_eps": 2.0**-18, "kv_eps": 2.0**-17}


def rms_norm(x, weight, eps):
    """transformers' DeepseekV3RMSNorm (the cast pair vanishes from fp32 graphs)."""
    xf = x.to(torch.float32)
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _split_latent(kv, kv_norm_weight):
    kv_lora_rank = kv_norm_weight.shape[0]
    return kv.split([kv_lora_rank, kv.shape[-1] - kv_lora_rank], dim=-1)


# --- search functions: the model code ------------------------------------------------------------


def torch_rms_norm(x, weight, eps):
    """torch's own RMSNorm (`F.rms_norm`, `torch.nn.RMSNorm`; DeepSeek's reference code): the weight
    multiplies in fp32 and the result rounds once."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def search_functions(norm):
    """The model code of each form, with the norm spelled by `norm`."""

    def q_lora(x, q_weight, kv_weight, q_norm_weight, kv_norm_weight, q_eps, kv_eps):
        q = norm(F.linear(x, q_weight), q_norm_weight, q_eps)
        c_kv, k_pe = _split_latent(F.linear(x, kv_weight), kv_norm_weight)
        return q, norm(c_kv, kv_norm_weight, kv_eps), k_pe

    def q_lora_bias(x, q_weight, q_bias, kv_weight, kv_bias, q_norm_weight, kv_norm_weight, q_eps, kv_eps):
        q = norm(F.linear(x, q_weight, q_bias), q_norm_weight, q_eps)
        c_kv, k_pe = _split_latent(F.linear(x, kv_weight, kv_bias), kv_norm_weight)
        return q, norm(c_kv, kv_norm_weight, kv_eps), k_pe

    def no_q_lora(x, q_weight, kv_weight, kv_norm_weight, kv_eps):
        c_kv, k_pe = _split_latent(F.linear(x, kv_weight), kv_norm_weight)
        return F.linear(x, q_weight), norm(c_kv, kv_norm_weight, kv_eps), k_pe

    def no_q_lora_bias(x, q_weight, q_bias, kv_weight, kv_bias, kv_norm_weight, kv_eps):
        c_kv, k_pe = _split_latent(F.linear(x, kv_weight, kv_bias), kv_norm_weight)
        return F.linear(x, q_weight, q_bias), norm(c_kv, kv_norm_weight, kv_eps), k_pe

    def fused_q_lora(x, weight, q_norm_weight, kv_norm_weight, q_eps, kv_eps):
        q_lora_rank = q_norm_weight.shape[0]
        q, kv = F.linear(x, weight).split([q_lora_rank, weight.shape[0] - q_lora_rank], dim=-1)
        c_kv, k_pe = _split_latent(kv, kv_norm_weight)
        return norm(q, q_norm_weight, q_eps), norm(c_kv, kv_norm_weight, kv_eps), k_pe

    return (
        (q_lora, q_lora_replacement),
        (q_lora_bias, q_lora_bias_replacement),
        (no_q_lora, no_q_lora_replacement),
        (no_q_lora_bias, no_q_lora_bias_replacement),
        (fused_q_lora, fused_q_lora_replacement),
    )


# --- replacements ---------------------------------------------------------------------------------


def _fused_op(x, q_weight, kv_weight, q_norm_weight, kv_norm_weight, q_eps, kv_eps, q_bias=None, kv_bias=None):
    # A tensor eps travels in its own argument; the float ones are then unused.
    q_eps_tensor = q_eps if isinstance(q_eps, torch.Tensor) else None
    kv_eps_tensor = kv_eps if isinstance(kv_eps, torch.Tensor) else None
    return torch.ops.mla.qkv_a_proj(
        x,
        q_weight,
        kv_weight,
        q_norm_weight,
        kv_norm_weight,
        1.0 if q_eps_tensor is not None else q_eps,
        1.0 if kv_eps_tensor is not None else kv_eps,
        q_bias,
        kv_bias,
        q_eps_tensor,
        kv_eps_tensor,
    )


def q_lora_replacement(x, q_weight, kv_weight, q_norm_weight, kv_norm_weight, q_eps, kv_eps):
    return _fused_op(x, q_weight, kv_weight, q_norm_weight, kv_norm_weight, q_eps, kv_eps)


def q_lora_bias_replacement(x, q_weight, q_bias, kv_weight, kv_bias, q_norm_weight, kv_norm_weight, q_eps, kv_eps):
    return _fused_op(x, q_weight, kv_weight, q_norm_weight, kv_norm_weight, q_eps, kv_eps, q_bias, kv_bias)


def no_q_lora_replacement(x, q_weight, kv_weight, kv_norm_weight, kv_eps):
    return _fused_op(x, q_weight, kv_weight, None, kv_norm_weight, kv_eps, kv_eps)


def no_q_lora_bias_replacement(x, q_weight, q_bias, kv_weight, kv_bias, kv_norm_weight, kv_eps):
    return _fused_op(x, q_weight, kv_weight, None, kv_norm_weight, kv_eps, kv_eps, q_bias, kv_bias)


def fused_q_lora_replacement(x, weight, q_norm_weight, kv_norm_weight, q_eps, kv_eps):
    q_lora_rank = q_norm_weight.shape[0]
    q_weight, kv_weight = weight[:q_lora_rank], weight[q_lora_rank:]  # row slices: views, no copy
    return _fused_op(x, q_weight, kv_weight, q_norm_weight, kv_norm_weight, q_eps, kv_eps)


# --- preconditions --------------------------------------------------------------------------------


def _literal_mismatch(match: Match, x, kw) -> Optional[str]:
    """The literals a size-agnostic pattern does not compare: exponents, dims, split sizes, casts.

    3-D patterns are matched without the strict re-trace (a dynamic sequence length appears both
    as a SymInt input and as sym_size() there, which a re-trace cannot reproduce), so what the
    re-trace would have compared is checked here, for every match alike.
    """
    aten, prims = torch.ops.aten, torch.ops.prims
    q_rows = kw["q_weight"].shape[0]
    splits = {(kw["kv_norm_weight"].shape[0], kw["kv_weight"].shape[0] - kw["kv_norm_weight"].shape[0])}
    if "weight" in kw:
        splits.add((q_rows, kw["weight"].shape[0] - q_rows))
    last = x.dim() - 1
    for node in match.nodes:
        out = node.meta.get("val")
        if node.target == aten.pow.Tensor_Scalar and node.args[1] != 2:
            return f"{node.name} raises to the power {node.args[1]}, not 2"
        if node.target == aten.mean.dim and (list(node.args[1]) not in ([-1], [last]) or node.args[2:3] != (True,)):
            return f"{node.name} is not a mean over the last dim with keepdim"
        if node.target == aten.permute.default and list(node.args[1]) != [1, 0]:
            return f"{node.name} is not a weight transpose"
        if node.target == aten.split_with_sizes.default and (
            tuple(node.args[1]) not in splits or node.args[2:3] not in ((-1,), (last,), ())
        ):
            return f"{node.name} splits {list(node.args[1])}, expected one of {sorted(splits)}"
        if node.target == prims.convert_element_type.default and node.args[1] not in (torch.float32, x.dtype):
            return f"{node.name} casts to {node.args[1]}, expected float32 or {x.dtype}"
        if node.target in (aten.view.default, aten.reshape.default):
            source = node.args[0].meta["val"]
            if source.shape == out.shape:
                continue  # a view to the shape it has (a module's reshape to x's leading dims, when x is 2-D)
            if source.dim() == x.dim() and out.dim() == 2 and out.shape[-1] != x.shape[-1]:
                return f"{node.name} flattens x to {list(out.shape)}"
            if source.dim() == 2 and tuple(out.shape[:-1]) != tuple(x.shape[:-1]):
                return f"{node.name} unflattens to {list(out.shape)}, not x's leading dims {list(x.shape[:-1])}"
    return None


def check(match: Match) -> Optional[str]:
    """None if the op can take the match, else the failing precondition."""
    kw = {name: node_value(arg) for name, arg in match.kwargs.items()}
    if "weight" in kw:
        q_rows = kw["q_norm_weight"].shape[0]
        kw["q_weight"], kw["kv_weight"] = kw["weight"][:q_rows], kw["weight"][q_rows:]
    x = kw["x"]
    split = "weight" in match.kwargs and row_split_reason(match.kwargs["weight"], kw["q_norm_weight"].shape[0])
    if split:
        return split
    quantized = decline_reason({name: match.kwargs[name] for name in ("q_weight", "kv_weight") if name in match.kwargs})
    if quantized:
        return quantized
    if not x.is_floating_point() or x.dim() not in (2, 3):
        return f"x is {x.dtype}{list(x.shape)}, expected a 2-D or 3-D floating tensor"
    mismatch = _literal_mismatch(match, x, kw)
    if mismatch:
        return mismatch
    rows = math.prod(size_hint(s) for s in x.shape[:-1])
    weights = {name: match.kwargs[name] for name in ("q_weight", "kv_weight", "weight") if name in match.kwargs}
    if not template_wins(rows, x.dtype, amx_competes=not int8_weight_only(weights),
                         on_amx_tiles=on_amx_tiles(weights, x.dtype)):
        return f"{rows} rows: the GEMM is compute-bound there and Inductor's own path (oneDNN) is faster"
    kv_eps = kw["kv_eps"]
    try:
        check_args(
            x, kw["q_weight"], kw["kv_weight"], kw.get("q_norm_weight"), kw["kv_norm_weight"],
            kw.get("q_bias"), kw.get("kv_bias"), kw.get("q_eps", kv_eps), kv_eps,
        )
    except ValueError as error:
        return str(error).removeprefix("mla::qkv_a_proj: ")
    return None


# --- registration ---------------------------------------------------------------------------------

def _arg_names(fn) -> tuple[str, ...]:
    return fn.__code__.co_varnames[: fn.__code__.co_argcount]


def _example_inputs(search_fn, x_dims: int, dtype: torch.dtype, tensor_eps: bool) -> list:
    """Small inputs with all sizes distinct, so that no view or split traces as a no-op."""
    hidden, q_rows, kv_lora_rank, rope = 24, 10, 12, 6
    sizes = {
        "x": (5, hidden) if x_dims == 2 else (2, 3, hidden),
        "q_weight": (q_rows, hidden),
        "q_bias": (q_rows,),
        "kv_weight": (kv_lora_rank + rope, hidden),
        "kv_bias": (kv_lora_rank + rope,),
        "q_norm_weight": (q_rows,),
        "kv_norm_weight": (kv_lora_rank,),
        "weight": (q_rows + kv_lora_rank + rope, hidden),
    }
    args = []
    for name in _arg_names(search_fn):
        if name.endswith("eps"):
            args.append(torch.tensor(1e-6, dtype=torch.float64) if tensor_eps else _EPS_WORKAROUND[name])
        else:
            args.append(torch.empty(sizes[name], dtype=dtype))
    return args


def register() -> None:
    forms = [(form, False) for form in search_functions(rms_norm)]
    forms += [(form, True) for form in search_functions(torch_rms_norm)]
    for ((search_fn, replace_fn), torch_norm), x_dims, dtype, tensor_eps in itertools.product(
        forms, (2, 3), (torch.bfloat16, torch.float32), (False, True)
    ):
        if x_dims == 3 and tensor_eps:
            continue  # size-agnostic: eps binds as an argument either way, the float pattern serves both
        if torch_norm and tensor_eps:
            continue  # F.rms_norm takes eps as a float only
        register_fusion(
            FUSION,
            search_fn,
            replace_fn,
            _example_inputs(search_fn, x_dims, dtype, tensor_eps),
            check,
            scalar_workaround={} if tensor_eps else _EPS_WORKAROUND,
            size_agnostic=x_dims == 3,
            # Two projections, two weights: without this one GEMM could serve as both (q = kv).
            exclusive_arg_names=("q_weight", "kv_weight") if "q_weight" in _arg_names(search_fn) else (),
        )
