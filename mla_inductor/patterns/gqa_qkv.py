"""gqa_qkv: the attention input of MHA / GQA models into `mla::gqa_qkv`.

transformers' LlamaDecoderLayer / Qwen2DecoderLayer / Qwen3DecoderLayer / GemmaDecoderLayer /
Gemma2DecoderLayer / Gemma3DecoderLayer, from the residual stream to the rotated heads: the residual
add of the previous block (`hidden = residual + mlp_out`, from the second layer on), the input RMSNorm
(Gemma's: times 1 + weight in fp32), the q / k / v projections (Qwen2 with bias) viewed as heads, the
RMSNorm of each q and k head (q_norm, k_norm: Qwen3's, Gemma-3's), and rotate_half RoPE of q and k.
Phi-3's one fused `qkv_proj` (and serving code's split of a fused projection) is Llama's form over a
weight cut into q, k and v rows (`llama_fused`).
The rope fusion has by then made both rotations `mla::apply_rope(.., "neox")` (it proves the halves
of cos/sin equal), so the search functions are written after it: the pass runs its patterns for
another round. The KV-cache writes stay as the model writes them (StaticCache's
`index_copy_` / `index_put`), reading k and v from the op's output.
"""

from __future__ import annotations

import itertools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch._inductor.pattern_matcher import Match

from ..lowerings.segment_gemm import template_wins
from ..record import NotACandidate
from .quantized_linear import decline_reason, int8_weight_only, on_amx_tiles, row_split_reason
from .registry import node_value, register_fusion, size_hint

FUSION = "gqa_qkv"
_EPS_WORKAROUND = {"eps": 3.25e-6}  # a distinct magic value: the literal becomes the argument
# The same for where a fused q/k/v weight is cut. An int literal of the graph that equals it (also in the
# re-trace at the match's real sizes) would bind as q_rows too and fail the match: 1171 heads of 8 rows, a
# size no model has (the worst a collision could do is leave a layer unfused).
_Q_ROWS_WORKAROUND = {"q_rows": 8 * 1171}


def rms_norm(x, weight, eps):
    """LlamaRMSNorm / Qwen2RMSNorm (the cast pair vanishes from fp32 graphs)."""
    xf = x.to(torch.float32)
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def gemma_rms_norm(x, weight, eps):
    """GemmaRMSNorm / Gemma2RMSNorm: scaled by 1 + weight in fp32, rounded once."""
    output = x.float()
    output = output * torch.rsqrt(output.pow(2).mean(-1, keepdim=True) + eps)
    return (output * (1.0 + weight.float())).type_as(x)


def _heads(h, weight, bias, d_head):
    return F.linear(h, weight, bias).view(h.shape[0], h.shape[1], -1, d_head).transpose(1, 2)


def _rotate(t, cos, sin):
    """What the rope fusion made of `t * cos + rotate_half(t) * sin` (cos/sin [B, 1, S, d])."""
    half = cos.shape[-1] // 2
    return torch.ops.mla.apply_rope(t, cos[..., :half], sin[..., :half], "neox")


def _normed_heads(h, weight, norm_weight, d_head, eps):
    """Qwen3: `q_norm(q_proj(h).view(hidden_shape)).transpose(1, 2)`, each head normalised."""
    return rms_norm(F.linear(h, weight).view(h.shape[0], h.shape[1], -1, d_head), norm_weight, eps).transpose(1, 2)


def _fused_heads(h, qkv_weight, q_rows, d_head):
    """Phi-3's qkv_proj (serving code's QKVParallelLinear): one GEMM cut into q, k and v, however the model
    cuts it (slices, one split in three), in the canonical form (registry.canonical_gemm_splits)."""
    q, kv = F.linear(h, qkv_weight).split([q_rows, qkv_weight.shape[0] - q_rows], dim=-1)
    k, v = kv.split([kv.shape[-1] // 2] * 2, dim=-1)
    return (t.view(h.shape[0], h.shape[1], -1, d_head).transpose(1, 2) for t in (q, k, v))


def _attention_input(h, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, cos, sin):
    d_head = cos.shape[-1]
    q = _rotate(_heads(h, q_weight, q_bias, d_head), cos, sin)
    k = _rotate(_heads(h, k_weight, k_bias, d_head), cos, sin)
    return q, k, _heads(h, v_weight, v_bias, d_head)


# --- search functions: the model code ------------------------------------------------------------


def llama(x, norm_weight, q_weight, k_weight, v_weight, cos, sin, eps):
    return _attention_input(rms_norm(x, norm_weight, eps), q_weight, k_weight, v_weight, None, None, None, cos, sin)


def llama_residual(residual, mlp_out, norm_weight, q_weight, k_weight, v_weight, cos, sin, eps):
    x = residual + mlp_out
    return *llama(x, norm_weight, q_weight, k_weight, v_weight, cos, sin, eps), x


def llama_fused(x, norm_weight, qkv_weight, cos, sin, eps, q_rows):
    """Phi-3: Llama's attention input from one fused q/k/v weight."""
    q, k, v = _fused_heads(rms_norm(x, norm_weight, eps), qkv_weight, q_rows, cos.shape[-1])
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v


def llama_fused_residual(residual, mlp_out, norm_weight, qkv_weight, cos, sin, eps, q_rows):
    x = residual + mlp_out
    return *llama_fused(x, norm_weight, qkv_weight, cos, sin, eps, q_rows), x


def qwen2(x, norm_weight, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, cos, sin, eps):
    h = rms_norm(x, norm_weight, eps)
    return _attention_input(h, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, cos, sin)


def qwen2_residual(residual, mlp_out, norm_weight, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, cos, sin, eps):
    x = residual + mlp_out
    return *qwen2(x, norm_weight, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, cos, sin, eps), x


def gemma(x, norm_weight, q_weight, k_weight, v_weight, cos, sin, eps):
    """Gemma, Gemma-2: Llama's attention input after Gemma's RMSNorm."""
    h = gemma_rms_norm(x, norm_weight, eps)
    return _attention_input(h, q_weight, k_weight, v_weight, None, None, None, cos, sin)


def gemma_residual(residual, mlp_out, norm_weight, q_weight, k_weight, v_weight, cos, sin, eps):
    """Gemma-2 adds its post-feedforward-normed MLP output: `mlp_out` is that norm's."""
    x = residual + mlp_out
    return *gemma(x, norm_weight, q_weight, k_weight, v_weight, cos, sin, eps), x


def qwen3(x, norm_weight, q_weight, k_weight, v_weight, q_norm_weight, k_norm_weight, cos, sin, eps):
    """One eps for the three norms, as Qwen3's config gives them (rms_norm_eps)."""
    h, d_head = rms_norm(x, norm_weight, eps), cos.shape[-1]
    q = _rotate(_normed_heads(h, q_weight, q_norm_weight, d_head, eps), cos, sin)
    k = _rotate(_normed_heads(h, k_weight, k_norm_weight, d_head, eps), cos, sin)
    return q, k, _heads(h, v_weight, None, d_head)


def qwen3_residual(residual, mlp_out, norm_weight, q_weight, k_weight, v_weight, q_norm_weight, k_norm_weight, cos,
                   sin, eps):
    x = residual + mlp_out
    return *qwen3(x, norm_weight, q_weight, k_weight, v_weight, q_norm_weight, k_norm_weight, cos, sin, eps), x


def gemma3(x, norm_weight, q_weight, k_weight, v_weight, q_norm_weight, k_norm_weight, cos, sin, eps):
    """Gemma-3: head norms as Qwen3's, but after the transpose, and every norm Gemma's."""
    h, d_head = gemma_rms_norm(x, norm_weight, eps), cos.shape[-1]
    q = _rotate(gemma_rms_norm(_heads(h, q_weight, None, d_head), q_norm_weight, eps), cos, sin)
    k = _rotate(gemma_rms_norm(_heads(h, k_weight, None, d_head), k_norm_weight, eps), cos, sin)
    return q, k, _heads(h, v_weight, None, d_head)


def gemma3_residual(residual, mlp_out, norm_weight, q_weight, k_weight, v_weight, q_norm_weight, k_norm_weight, cos,
                    sin, eps):
    x = residual + mlp_out
    return *gemma3(x, norm_weight, q_weight, k_weight, v_weight, q_norm_weight, k_norm_weight, cos, sin, eps), x


# --- replacements ---------------------------------------------------------------------------------


def _fused(x, mlp_out, norm_weight, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, cos, sin, eps,
           q_norm_weight=None, k_norm_weight=None, norm_type="rms_norm"):
    """mla::gqa_qkv for the model's pieces; Gemma's norms (`norm_type`) are its head norms' type too."""
    batch, seq, d_head = x.shape[0], x.shape[1], cos.shape[-1]
    num_q_heads, num_kv_heads = q_weight.shape[0] // d_head, k_weight.shape[0] // d_head
    cos, sin = (t.expand(batch, 1, seq, d_head)[:, 0] for t in (cos, sin))
    # eps is a graph input under dynamic=True (check: then without head norms, whose eps the template takes)
    eps_tensor = eps if isinstance(eps, torch.Tensor) else None
    eps = 1.0 if eps_tensor is not None else eps
    out, residual = torch.ops.mla.gqa_qkv(
        x, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, "NBSd", mlp_out is not None, mlp_out,
        norm_type, norm_weight, eps, True, cos, sin, d_head, num_q_heads, num_kv_heads, q_norm_weight, k_norm_weight,
        eps, norm_type, eps_tensor,
    )
    # [heads, B, S, d] -> q, k, v as [B, heads, S, d] views, as the model's transposes give them
    q = out[:num_q_heads].transpose(0, 1)
    k = out[num_q_heads : num_q_heads + num_kv_heads].transpose(0, 1)
    v = out[num_q_heads + num_kv_heads :].transpose(0, 1)
    return q, k, v, residual


def llama_replacement(x, norm_weight, q_weight, k_weight, v_weight, cos, sin, eps):
    return _fused(x, None, norm_weight, q_weight, k_weight, v_weight, None, None, None, cos, sin, eps)[:3]


def llama_residual_replacement(residual, mlp_out, norm_weight, q_weight, k_weight, v_weight, cos, sin, eps):
    return _fused(residual, mlp_out, norm_weight, q_weight, k_weight, v_weight, None, None, None, cos, sin, eps)


def _cut(qkv_weight, q_rows):
    """The q, k and v rows of a fused weight: views, no copy (a quantized weight's scales are cut alike
    where the op's operands are read, quantized_linear)."""
    kv_rows = (qkv_weight.shape[0] - q_rows) // 2
    return qkv_weight[:q_rows], qkv_weight[q_rows : q_rows + kv_rows], qkv_weight[q_rows + kv_rows :]


def llama_fused_replacement(x, norm_weight, qkv_weight, cos, sin, eps, q_rows):
    return _fused(x, None, norm_weight, *_cut(qkv_weight, q_rows), None, None, None, cos, sin, eps)[:3]


def llama_fused_residual_replacement(residual, mlp_out, norm_weight, qkv_weight, cos, sin, eps, q_rows):
    return _fused(residual, mlp_out, norm_weight, *_cut(qkv_weight, q_rows), None, None, None, cos, sin, eps)


def qwen2_replacement(x, norm_weight, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, cos, sin, eps):
    return _fused(x, None, norm_weight, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, cos, sin, eps)[:3]


def qwen2_residual_replacement(residual, mlp_out, norm_weight, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias,
                               cos, sin, eps):
    return _fused(residual, mlp_out, norm_weight, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, cos, sin, eps)


def gemma_replacement(x, norm_weight, q_weight, k_weight, v_weight, cos, sin, eps):
    return _fused(x, None, norm_weight, q_weight, k_weight, v_weight, None, None, None, cos, sin, eps,
                  norm_type="gemma_rms_norm")[:3]


def gemma_residual_replacement(residual, mlp_out, norm_weight, q_weight, k_weight, v_weight, cos, sin, eps):
    return _fused(residual, mlp_out, norm_weight, q_weight, k_weight, v_weight, None, None, None, cos, sin, eps,
                  norm_type="gemma_rms_norm")


def qwen3_replacement(x, norm_weight, q_weight, k_weight, v_weight, q_norm_weight, k_norm_weight, cos, sin, eps):
    return _fused(x, None, norm_weight, q_weight, k_weight, v_weight, None, None, None, cos, sin, eps, q_norm_weight,
                  k_norm_weight)[:3]


def qwen3_residual_replacement(residual, mlp_out, norm_weight, q_weight, k_weight, v_weight, q_norm_weight,
                               k_norm_weight, cos, sin, eps):
    return _fused(residual, mlp_out, norm_weight, q_weight, k_weight, v_weight, None, None, None, cos, sin, eps,
                  q_norm_weight, k_norm_weight)


def gemma3_replacement(x, norm_weight, q_weight, k_weight, v_weight, q_norm_weight, k_norm_weight, cos, sin, eps):
    return _fused(x, None, norm_weight, q_weight, k_weight, v_weight, None, None, None, cos, sin, eps, q_norm_weight,
                  k_norm_weight, norm_type="gemma_rms_norm")[:3]


def gemma3_residual_replacement(residual, mlp_out, norm_weight, q_weight, k_weight, v_weight, q_norm_weight,
                                k_norm_weight, cos, sin, eps):
    return _fused(residual, mlp_out, norm_weight, q_weight, k_weight, v_weight, None, None, None, cos, sin, eps,
                  q_norm_weight, k_norm_weight, norm_type="gemma_rms_norm")


# --- preconditions --------------------------------------------------------------------------------


def check(match: Match) -> Optional[str]:
    kw = {name: node_value(arg) for name, arg in match.kwargs.items()}
    x = kw.get("x", kw.get("residual"))
    if "qkv_weight" in kw:
        q_rows = kw["q_rows"]
        kw["q_weight"], kw["k_weight"], _ = _cut(kw["qkv_weight"], q_rows)
        weights = {"qkv_weight": match.kwargs["qkv_weight"]}
        for boundary in (q_rows, q_rows + kw["k_weight"].shape[0]):
            split = row_split_reason(match.kwargs["qkv_weight"], boundary)
            if split:
                return split
    else:
        weights = {name: match.kwargs[name] for name in ("q_weight", "k_weight", "v_weight")}
    if isinstance(kw["eps"], torch.Tensor) and "q_norm_weight" in kw:
        return "eps is a tensor (torch.compile(dynamic=True)): the head norms' eps must be a float"
    cos, q_weight, k_weight = kw["cos"], kw["q_weight"], kw["k_weight"]
    if q_weight.shape[0] < k_weight.shape[0]:  # fewer query than key heads: the k branch bound as q
        return NotACandidate("the q and k projections bound the other way round")
    quantized = decline_reason(weights, per_channel_only=True)
    if quantized:
        return quantized
    if x.dim() != 3 or cos.dim() != 4 or cos.shape[1] != 1:
        return f"x {list(x.shape)} / cos {list(cos.shape)} are not [B, S, H] / [B, 1, S, d_head]"
    d_head = cos.shape[-1]
    if q_weight.shape[0] % d_head or k_weight.shape[0] % d_head:
        return f"q/k rows {q_weight.shape[0]}/{k_weight.shape[0]} are not whole heads of {d_head}"
    if (q_weight.shape[0] // d_head) % (k_weight.shape[0] // d_head):
        return "query heads are not a multiple of the key/value heads"
    rows = math.prod(size_hint(s) for s in x.shape[:-1])
    if not template_wins(rows, x.dtype, amx_competes=not int8_weight_only(weights),
                         on_amx_tiles=on_amx_tiles(weights, x.dtype)):
        return f"{rows} rows: the GEMM is compute-bound there and Inductor's own path (oneDNN) is faster"
    return None


# --- registration ---------------------------------------------------------------------------------

_FORMS = (  # the residual forms first: where both match, they fuse more
    (llama_residual, llama_residual_replacement),
    (qwen2_residual, qwen2_residual_replacement),
    (qwen3_residual, qwen3_residual_replacement),
    (gemma_residual, gemma_residual_replacement),
    (gemma3_residual, gemma3_residual_replacement),
    (llama_fused_residual, llama_fused_residual_replacement),
    (llama, llama_replacement),
    (qwen2, qwen2_replacement),
    (qwen3, qwen3_replacement),
    (gemma, gemma_replacement),
    (gemma3, gemma3_replacement),
    (llama_fused, llama_fused_replacement),
)


def _arg_names(search_fn) -> tuple[str, ...]:
    return search_fn.__code__.co_varnames[: search_fn.__code__.co_argcount]


def _example_inputs(search_fn, dtype: torch.dtype) -> list:
    """All sizes distinct: batch 2, seq 3, hidden 40, 4 q heads and 2 kv heads of 8; a fused weight's q
    rows are `_Q_ROWS_WORKAROUND`'s."""
    batch, seq, hidden, d_head, q_rows, kv_rows = 2, 3, 40, 8, 32, 16
    sizes = {
        "x": (batch, seq, hidden), "residual": (batch, seq, hidden), "mlp_out": (batch, seq, hidden),
        "norm_weight": (hidden,), "q_weight": (q_rows, hidden), "k_weight": (kv_rows, hidden),
        "v_weight": (kv_rows, hidden), "q_bias": (q_rows,), "k_bias": (kv_rows,), "v_bias": (kv_rows,),
        "qkv_weight": (_Q_ROWS_WORKAROUND["q_rows"] + 2 * kv_rows, hidden),
        "cos": (batch, 1, seq, d_head), "sin": (batch, 1, seq, d_head),
        "q_norm_weight": (d_head,), "k_norm_weight": (d_head,),
    }
    scalars = _EPS_WORKAROUND | _Q_ROWS_WORKAROUND
    return [scalars[name] if name in scalars else torch.empty(sizes[name], dtype=dtype)
            for name in _arg_names(search_fn)]


def register() -> None:
    for (search_fn, replace_fn), dtype in itertools.product(_FORMS, (torch.bfloat16, torch.float32)):
        fused = "q_rows" in _arg_names(search_fn)
        register_fusion(
            FUSION, search_fn, replace_fn, _example_inputs(search_fn, dtype), check,
            scalar_workaround=_EPS_WORKAROUND | _Q_ROWS_WORKAROUND if fused else _EPS_WORKAROUND,
            exclusive_arg_names=() if fused else ("q_weight", "k_weight", "v_weight"),
        )
