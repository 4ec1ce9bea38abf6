"""The Mixture-of-Experts ops, with the contracts and argument order of SGLang's CPU kernels:

    mla::fused_experts(hidden_states [M, K], w1 [E, 2N, K], w2 [E, K, N], topk_weights [M, topk],
                       topk_ids [M, topk], inplace, use_int8_w8a8, use_fp8_w8a16, w1_scale, w2_scale,
                       block_size, a1_scale, a2_scale, w1_bias, w2_bias, alpha, limit, is_vnni) -> [M, K]
        y[m] = sum_j topk_weights[m, j] * expert(topk_ids[m, j], x[m]), where expert e is DeepSeek's gated
        MLP: gate, up = x . w1[e]^T (gate rows first, then up: transformers' gate_up_proj), down =
        (silu(gate) * up) . w2[e]^T. An id outside [0, E) selects no expert here (an expert-parallel
        plan's sentinel for an expert on another rank): its slot adds nothing.
    mla::shared_expert(hidden_states [M, K], w1 [2N, K], w2 [K, N], fused_experts_out [M, K],
                       routed_scaling_factor, inplace, use_int8_w8a8, use_fp8_w8a16, w1_scale, w2_scale,
                       block_size, a1_scale, a2_scale, is_vnni) -> [M, K]
        the shared experts' MLP plus fused_experts_out * routed_scaling_factor, in one pass.
    mla::topk_softmax(hidden_states, gating_output [M, E], topk, renormalize) -> (weights fp32, ids int32)
    mla::grouped_topk(hidden_states, gating_output, topk, renormalize, num_expert_group, topk_group,
                      num_fused_shared_experts, routed_scaling_factor, num_token_non_padded)
    mla::biased_grouped_topk(hidden_states, gating_output, correction_bias, topk, renormalize,
                             num_expert_group, topk_group, num_fused_shared_experts,
                             routed_scaling_factor, num_token_non_padded)
        the routers: softmax top-k (DeepSeek-V2, Qwen-MoE, Mixtral), group-limited softmax top-k
        (DeepSeek-V2's group_limited_greedy) and DeepSeek-V3's noaux_tc (sigmoid scores, the correction
        bias for the choice only, groups ranked by the sum of their two best).

Numerics of the experts (the templates' and the references' alike): every product sums in fp32; gate and
up are rounded to x's dtype as the GEMM that makes them would store them, silu(gate) * up is computed in
fp32 from those and rounded once; the down projections, times their routing weight, sum in fp32 across a
token's experts and round once. Weights: x's dtype; int8 per output channel with W8A8 (SGLang's per-token
quantization of x and of the gated activations, use_int8_w8a8); float8_e4m3fn in 128 x 128 blocks
(DeepSeek's checkpoints, use_fp8_w8a16, block_size [bN, bK]). `is_vnni` (weights prepacked by SGLang's
convert_weight_packed) is refused: give the weights as the model holds them; under freezing the lowering
packs them itself. `inplace` is refused too: the ops are functional, assign their result.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .checks import check_cpu_tensors
from .weight_quant import linear_fp32, scale_grid

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ID_DTYPES = (torch.int32, torch.int64)


def _failer(op: str) -> Callable[[str], None]:
    def fail(message: str) -> None:
        raise ValueError(f"mla::{op}: {message}")

    return fail


def _weight_format(use_int8_w8a8: bool, use_fp8_w8a16: bool, dtype: torch.dtype) -> tuple[torch.dtype, str]:
    """The weights' dtype and the activations' quantization the flags name (checked exclusive before)."""
    if use_int8_w8a8:
        return torch.int8, "int8"
    if use_fp8_w8a16:
        return torch.float8_e4m3fn, "none"
    return dtype, "none"


def _check_scale(fail, name: str, scale: Optional[Tensor], lead: list[int], weight_shape: Sequence[int],
                 block_size: Optional[Sequence[int]], quantized: bool) -> None:
    """The fp32 scale of quantized [*lead, N, K] weights: per channel [*lead, N] or [*lead, N, 1], or per
    block [*lead, ceil(N / bN), ceil(K / bK)] (weight_quant.scale_grid)."""
    if not quantized:
        if scale is not None:
            fail(f"{name} is for int8 (use_int8_w8a8) or fp8 (use_fp8_w8a16) weights; the weights are not")
        return
    if scale is None:
        fail(f"{name} is required with quantized weights")
    check_cpu_tensors(fail, {name: scale})
    if scale.dtype != torch.float32:
        fail(f"{name} must be float32, got {scale.dtype}")
    grid = lead + list(scale_grid(weight_shape, block_size))
    accepted = [grid] if block_size is not None else [grid, grid[:-1]]
    if list(scale.shape) not in accepted:
        fail(f"{name} must be {accepted[-1]}, got {list(scale.shape)}")


def _check_mlp_weights(fail, x: Tensor, w1: Tensor, w2: Tensor, lead: list[int], use_int8_w8a8: bool,
                       use_fp8_w8a16: bool, w1_scale, w2_scale, block_size, a1_scale, a2_scale,
                       is_vnni: bool) -> None:
    """w1 [*lead, 2N, K] and w2 [*lead, K, N] in the format the flags name, with their scales."""
    check_cpu_tensors(fail, dict(hidden_states=x, w1=w1, w2=w2))
    if x.dtype not in ACTIVATION_DTYPES:
        fail(f"hidden_states has dtype {x.dtype}; supported: bfloat16, float16, float32")
    if x.dim() != 2:
        fail(f"hidden_states must be [tokens, hidden], got {list(x.shape)}")
    if is_vnni:
        fail("is_vnni=True (weights prepacked by SGLang's convert_weight_packed) is not read; pass the weights "
             "as the model holds them (under freezing the lowering packs them)")
    if use_int8_w8a8 and use_fp8_w8a16:
        fail("use_int8_w8a8 and use_fp8_w8a16 are exclusive")
    weight_dtype, _ = _weight_format(use_int8_w8a8, use_fp8_w8a16, x.dtype)
    k = x.shape[1]
    nd = len(lead) + 2
    if w1.dtype != weight_dtype or w1.dim() != nd or list(w1.shape[:-2]) != lead or w1.shape[-1] != k \
            or w1.shape[-2] % 2:
        fail(f"w1 must be {weight_dtype}{lead + ['2N', k]} (gate rows, then up rows), got {w1.dtype}{list(w1.shape)}")
    n = w1.shape[-2] // 2
    if w2.dtype != weight_dtype or list(w2.shape) != lead + [k, n]:
        fail(f"w2 must be {weight_dtype}{lead + [k, n]}, got {w2.dtype}{list(w2.shape)}")
    if use_fp8_w8a16 and (block_size is None or len(block_size) != 2 or any(b <= 0 for b in block_size)):
        fail(f"block_size must be [block_n, block_k] with use_fp8_w8a16, got {block_size}")
    if not use_fp8_w8a16 and block_size is not None:
        fail("block_size is for fp8 block-scaled weights (use_fp8_w8a16)")
    quantized = use_int8_w8a8 or use_fp8_w8a16
    _check_scale(fail, "w1_scale", w1_scale, lead, (2 * n, k), block_size, quantized)
    _check_scale(fail, "w2_scale", w2_scale, lead, (k, n), block_size, quantized)
    for name, scale in (("a1_scale", a1_scale), ("a2_scale", a2_scale)):
        if scale is not None:
            fail(f"{name}: static activation scales are not supported (W8A8 quantizes each token)")


def _expert_scale(scale: Optional[Tensor], index, block_size) -> Optional[Tensor]:
    """An expert's per-channel ([N]) or block ([rows, cols]) scale, as linear_fp32 takes it."""
    if scale is None:
        return None
    s = scale if index is None else scale[index]
    return s.reshape(-1) if block_size is None else s


def gated_mlp(x: Tensor, w1: Tensor, w2: Tensor, w1_scale, w2_scale, block_size, activation_quant: str,
              w1_bias: Optional[Tensor] = None, w2_bias: Optional[Tensor] = None) -> Tensor:
    """DeepSeek's gated MLP of x's rows in fp32 (the module doc's numerics): gate and up rounded to x's
    dtype, silu(gate) * up in fp32 rounded once, the down projection's sums unrounded."""
    block = list(block_size) if block_size is not None else None
    gate_up = linear_fp32(x, w1, w1_scale, block, activation_quant)
    if w1_bias is not None:
        gate_up = gate_up + w1_bias.float()
    gate, up = gate_up.to(x.dtype).float().chunk(2, dim=-1)
    hidden = (F.silu(gate) * up).to(x.dtype)
    down = linear_fp32(hidden, w2, w2_scale, block, activation_quant)
    return down if w2_bias is None else down + w2_bias.float()


def check_fused_experts(x, w1, w2, topk_weights, topk_ids, inplace, use_int8_w8a8, use_fp8_w8a16, w1_scale,
                        w2_scale, block_size, a1_scale, a2_scale, w1_bias, w2_bias, alpha, limit, is_vnni) -> None:
    fail = _failer("fused_experts")
    if inplace:
        fail("inplace=True is not supported: the op is functional, assign its result")
    if w1.dim() != 3:
        fail(f"w1 must be [experts, 2N, hidden], got {list(w1.shape)}")
    e = w1.shape[0]
    _check_mlp_weights(fail, x, w1, w2, [e], use_int8_w8a8, use_fp8_w8a16, w1_scale, w2_scale, block_size,
                       a1_scale, a2_scale, is_vnni)
    check_cpu_tensors(fail, dict(topk_weights=topk_weights, topk_ids=topk_ids))
    m = x.shape[0]
    if topk_ids.dtype not in ID_DTYPES or topk_ids.dim() != 2 or topk_ids.shape[0] != m:
        fail(f"topk_ids must be int32 or int64 [{m}, topk], got {topk_ids.dtype}{list(topk_ids.shape)}")
    if not topk_weights.is_floating_point() or list(topk_weights.shape) != list(topk_ids.shape):
        fail(f"topk_weights must be floating [{m}, {topk_ids.shape[1]}] like topk_ids, got "
             f"{topk_weights.dtype}{list(topk_weights.shape)}")
    n = w1.shape[1] // 2
    for name, bias, width in (("w1_bias", w1_bias, 2 * n), ("w2_bias", w2_bias, x.shape[1])):
        if bias is not None:
            check_cpu_tensors(fail, {name: bias})
            if list(bias.shape) != [e, width] or not bias.is_floating_point():
                fail(f"{name} must be floating [{e}, {width}], got {bias.dtype}{list(bias.shape)}")
    if alpha is not None or limit is not None:
        fail("alpha and limit (gpt-oss's clamped SwiGLU) are not supported")


@torch.library.custom_op("mla::fused_experts", mutates_args=())
def fused_experts(hidden_states: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                  inplace: bool = False, use_int8_w8a8: bool = False, use_fp8_w8a16: bool = False,
                  w1_scale: Optional[Tensor] = None, w2_scale: Optional[Tensor] = None,
                  block_size: Optional[list[int]] = None, a1_scale: Optional[Tensor] = None,
                  a2_scale: Optional[Tensor] = None, w1_bias: Optional[Tensor] = None,
                  w2_bias: Optional[Tensor] = None, alpha: Optional[float] = None, limit: Optional[float] = None,
                  is_vnni: bool = False) -> Tensor:
    check_fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, inplace, use_int8_w8a8, use_fp8_w8a16,
                        w1_scale, w2_scale, block_size, a1_scale, a2_scale, w1_bias, w2_bias, alpha, limit, is_vnni)
    _, activation_quant = _weight_format(use_int8_w8a8, use_fp8_w8a16, hidden_states.dtype)
    num_experts, topk = w1.shape[0], topk_ids.shape[1]
    out = torch.zeros(hidden_states.shape, dtype=torch.float32)
    ids = topk_ids.reshape(-1).long()
    weights = topk_weights.reshape(-1).float()
    # each selected expert once, over all of its tokens (the slots sorted by expert)
    for expert in torch.unique(ids[(ids >= 0) & (ids < num_experts)]).tolist():
        slots = torch.nonzero(ids == expert).squeeze(1)
        tokens = slots // topk
        down = gated_mlp(hidden_states[tokens], w1[expert], w2[expert], _expert_scale(w1_scale, expert, block_size),
                         _expert_scale(w2_scale, expert, block_size), block_size, activation_quant,
                         None if w1_bias is None else w1_bias[expert], None if w2_bias is None else w2_bias[expert])
        out.index_add_(0, tokens, down * weights[slots, None])
    return out.to(hidden_states.dtype)


@fused_experts.register_fake
def _(hidden_states, w1, w2, topk_weights, topk_ids, inplace=False, use_int8_w8a8=False, use_fp8_w8a16=False,
      w1_scale=None, w2_scale=None, block_size=None, a1_scale=None, a2_scale=None, w1_bias=None, w2_bias=None,
      alpha=None, limit=None, is_vnni=False):
    check_fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, inplace, use_int8_w8a8, use_fp8_w8a16,
                        w1_scale, w2_scale, block_size, a1_scale, a2_scale, w1_bias, w2_bias, alpha, limit, is_vnni)
    return torch.empty_like(hidden_states)


def check_shared_expert(x, w1, w2, fused_experts_out, routed_scaling_factor, inplace, use_int8_w8a8,
                        use_fp8_w8a16, w1_scale, w2_scale, block_size, a1_scale, a2_scale, is_vnni) -> None:
    fail = _failer("shared_expert")
    if inplace:
        fail("inplace=True is not supported: the op is functional, assign its result")
    _check_mlp_weights(fail, x, w1, w2, [], use_int8_w8a8, use_fp8_w8a16, w1_scale, w2_scale, block_size,
                       a1_scale, a2_scale, is_vnni)
    check_cpu_tensors(fail, dict(fused_experts_out=fused_experts_out))
    if fused_experts_out.shape != x.shape or fused_experts_out.dtype != x.dtype:
        fail(f"fused_experts_out must be {x.dtype}{list(x.shape)} like hidden_states, got "
             f"{fused_experts_out.dtype}{list(fused_experts_out.shape)}")


@torch.library.custom_op("mla::shared_expert", mutates_args=())
def shared_expert(hidden_states: Tensor, w1: Tensor, w2: Tensor, fused_experts_out: Tensor,
                  routed_scaling_factor: float, inplace: bool = False, use_int8_w8a8: bool = False,
                  use_fp8_w8a16: bool = False, w1_scale: Optional[Tensor] = None, w2_scale: Optional[Tensor] = None,
                  block_size: Optional[list[int]] = None, a1_scale: Optional[Tensor] = None,
                  a2_scale: Optional[Tensor] = None, is_vnni: bool = False) -> Tensor:
    check_shared_expert(hidden_states, w1, w2, fused_experts_out, routed_scaling_factor, inplace, use_int8_w8a8,
                        use_fp8_w8a16, w1_scale, w2_scale, block_size, a1_scale, a2_scale, is_vnni)
    _, activation_quant = _weight_format(use_int8_w8a8, use_fp8_w8a16, hidden_states.dtype)
    down = gated_mlp(hidden_states, w1, w2, _expert_scale(w1_scale, None, block_size),
                     _expert_scale(w2_scale, None, block_size), block_size, activation_quant)
    return (down + fused_experts_out.float() * routed_scaling_factor).to(hidden_states.dtype)


@shared_expert.register_fake
def _(hidden_states, w1, w2, fused_experts_out, routed_scaling_factor, inplace=False, use_int8_w8a8=False,
      use_fp8_w8a16=False, w1_scale=None, w2_scale=None, block_size=None, a1_scale=None, a2_scale=None,
      is_vnni=False):
    check_shared_expert(hidden_states, w1, w2, fused_experts_out, routed_scaling_factor, inplace, use_int8_w8a8,
                        use_fp8_w8a16, w1_scale, w2_scale, block_size, a1_scale, a2_scale, is_vnni)
    return torch.empty_like(hidden_states)


# --- routers -------------------------------------------------------------------------------------------


def _check_router(op: str, hidden_states: Tensor, gating_output: Tensor, topk: int,
                  groups: Optional[tuple[int, int]] = None, num_fused_shared_experts: int = 0,
                  correction_bias: Optional[Tensor] = None) -> None:
    fail = _failer(op)
    check_cpu_tensors(fail, dict(hidden_states=hidden_states, gating_output=gating_output))
    if gating_output.dim() != 2 or not gating_output.is_floating_point():
        fail(f"gating_output must be floating [tokens, experts], got {gating_output.dtype}{list(gating_output.shape)}")
    m, e = gating_output.shape
    if hidden_states.shape[0] != m:
        fail(f"hidden_states has {hidden_states.shape[0]} tokens, gating_output {m}")
    if not 0 < topk <= e:
        fail(f"topk must be in [1, {e}] (the experts), got {topk}")
    if num_fused_shared_experts:
        fail("num_fused_shared_experts must be 0: shared experts run as their own MLP (mla::shared_expert)")
    if groups is not None:
        num_expert_group, topk_group = groups
        if num_expert_group <= 0 or e % num_expert_group:
            fail(f"num_expert_group must divide the {e} experts, got {num_expert_group}")
        if not 0 < topk_group <= num_expert_group:
            fail(f"topk_group must be in [1, {num_expert_group}] (num_expert_group), got {topk_group}")
        if topk > topk_group * (e // num_expert_group):
            fail(f"topk {topk} exceeds the {topk_group * (e // num_expert_group)} experts of {topk_group} groups")
    if correction_bias is not None:
        check_cpu_tensors(fail, dict(correction_bias=correction_bias))
        if list(correction_bias.shape) != [e] or not correction_bias.is_floating_point():
            fail(f"correction_bias must be floating [{e}], got {correction_bias.dtype}{list(correction_bias.shape)}")


def _routed(weights: Tensor, ids: Tensor, renormalize: bool) -> tuple[Tensor, Tensor]:
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.float(), ids.to(torch.int32)


def _fake_routing(gating_output: Tensor, topk: int) -> tuple[Tensor, Tensor]:
    m = gating_output.shape[0]
    return (gating_output.new_empty(m, topk, dtype=torch.float32),
            gating_output.new_empty(m, topk, dtype=torch.int32))


@torch.library.custom_op("mla::topk_softmax", mutates_args=())
def topk_softmax(hidden_states: Tensor, gating_output: Tensor, topk: int, renormalize: bool
                 ) -> tuple[Tensor, Tensor]:
    _check_router("topk_softmax", hidden_states, gating_output, topk)
    weights, ids = torch.topk(gating_output.float().softmax(-1), topk, dim=-1)
    return _routed(weights, ids, renormalize)


@topk_softmax.register_fake
def _(hidden_states, gating_output, topk, renormalize):
    _check_router("topk_softmax", hidden_states, gating_output, topk)
    return _fake_routing(gating_output, topk)


def _group_mask(group_scores: Tensor, topk_group: int, per_group: int) -> Tensor:
    """True for the experts (per_group a group) of each token's topk_group best groups."""
    m, groups = group_scores.shape
    chosen = torch.topk(group_scores, topk_group, dim=-1).indices
    mask = torch.zeros(m, groups, dtype=torch.bool).scatter_(1, chosen, True)
    return mask.repeat_interleave(per_group, dim=1)


@torch.library.custom_op("mla::grouped_topk", mutates_args=())
def grouped_topk(hidden_states: Tensor, gating_output: Tensor, topk: int, renormalize: bool,
                 num_expert_group: int, topk_group: int, num_fused_shared_experts: int = 0,
                 routed_scaling_factor: Optional[float] = None, num_token_non_padded: Optional[Tensor] = None
                 ) -> tuple[Tensor, Tensor]:
    """Group-limited softmax top-k: the groups ranked by their best expert. routed_scaling_factor, as
    SGLang's, only weighs a fused shared expert, which this op never appends (num_fused_shared_experts
    is 0); num_token_non_padded is accepted and, as on SGLang's CPU, not read."""
    _check_router("grouped_topk", hidden_states, gating_output, topk, (num_expert_group, topk_group),
                  num_fused_shared_experts)
    scores = gating_output.float().softmax(-1)
    m, e = scores.shape
    per_group = e // num_expert_group
    group_scores = scores.view(m, num_expert_group, per_group).amax(-1)
    masked = scores.masked_fill(~_group_mask(group_scores, topk_group, per_group), 0.0)
    weights, ids = torch.topk(masked, topk, dim=-1)
    return _routed(weights, ids, renormalize)


@grouped_topk.register_fake
def _(hidden_states, gating_output, topk, renormalize, num_expert_group, topk_group, num_fused_shared_experts=0,
      routed_scaling_factor=None, num_token_non_padded=None):
    _check_router("grouped_topk", hidden_states, gating_output, topk, (num_expert_group, topk_group),
                  num_fused_shared_experts)
    return _fake_routing(gating_output, topk)


@torch.library.custom_op("mla::biased_grouped_topk", mutates_args=())
def biased_grouped_topk(hidden_states: Tensor, gating_output: Tensor, correction_bias: Tensor, topk: int,
                        renormalize: bool, num_expert_group: int, topk_group: int, num_fused_shared_experts: int = 0,
                        routed_scaling_factor: Optional[float] = None,
                        num_token_non_padded: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3's noaux_tc: sigmoid scores; the choice on scores + correction_bias, groups ranked by
    the sum of their two best; the weights are the unbiased scores of the chosen experts."""
    _check_router("biased_grouped_topk", hidden_states, gating_output, topk, (num_expert_group, topk_group),
                  num_fused_shared_experts, correction_bias)
    scores = gating_output.float().sigmoid()
    choice = scores + correction_bias.float()
    m, e = scores.shape
    per_group = e // num_expert_group
    group_scores = choice.view(m, num_expert_group, per_group).topk(min(2, per_group), dim=-1).values.sum(-1)
    masked = choice.masked_fill(~_group_mask(group_scores, topk_group, per_group), float("-inf"))
    ids = torch.topk(masked, topk, dim=-1).indices
    return _routed(scores.gather(1, ids), ids, renormalize)


@biased_grouped_topk.register_fake
def _(hidden_states, gating_output, correction_bias, topk, renormalize, num_expert_group, topk_group,
      num_fused_shared_experts=0, routed_scaling_factor=None, num_token_non_padded=None):
    _check_router("biased_grouped_topk", hidden_states, gating_output, topk, (num_expert_group, topk_group),
                  num_fused_shared_experts, correction_bias)
    return _fake_routing(gating_output, topk)
