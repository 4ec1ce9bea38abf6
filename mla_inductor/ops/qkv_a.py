"""mla::qkv_a_proj: the two A-projections of an MLA layer and the RMSNorms of their latents.

    q    = x @ q_weight.T   (+ q_bias),  then RMSNorm(q_norm_weight) if given     [..., Nq]
    kv   = x @ kv_weight.T  (+ kv_bias)                                            [..., L + R]
    c_kv = RMSNorm(kv[..., :L]; kv_norm_weight)                                    [..., L]
    k_pe = kv[..., L:]  (not normed)                                               [..., R]

L = kv_norm_weight.numel(). q_weight is q_a_proj (q_lora_rank rows) or, for models without a q
LoRA, q_proj with no norm. eps is a float, or a 0-d tensor where `dynamic=True` lifted a module's
float attribute into a graph input (`q_eps_tensor` / `kv_eps_tensor` then take precedence).
With `k_cos` and `k_sin` ([..., R / 2] per row, x's leading dims) k_pe leaves rotated, in one of
mla::apply_rope's styles (`k_rope_style`; by default DeepSeek's interleaved pairs (k_pe[2i],
k_pe[2i+1]): the cache row's rope part, as SGLang's `qkv_proj_with_rope` writes it).

Quantized weights (ops/weight_quant.py): q_weight and kv_weight int8 or float8_e4m3fn alike, with
`q_weight_scale` / `kv_weight_scale` per channel or per `weight_block_size` block, and
`activation_quant="int8"` for SGLang's W8A8 (x quantized once per token, shared by both weights).
The projections are then computed in fp32 on the dequantized weights and rounded once, after the norm.

The eager implementation computes what the matched model code computes (GEMMs in the input dtype
with fp32 accumulation, norms in fp32 with the weight and one rounding, as `F.rms_norm`; transformers'
DeepseekV3RMSNorm rounds before the weight multiplies, which differs by at most one rounding), so a
rewrite changes no semantics; the C++ template is at least as accurate (it normalises the fp32
accumulators and rounds each output once).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .checks import check_cpu_tensors
from .rope import ROPE_STYLES, rotate_pairs
from .weight_quant import check_quantized_weight, is_quantized, linear_fp32

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _fail(message: str) -> None:
    raise ValueError(f"mla::qkv_a_proj: {message}")


def check_args(x, q_weight, kv_weight, q_norm_weight, kv_norm_weight, q_bias, kv_bias, q_eps, kv_eps,
               k_cos=None, k_sin=None, k_rope_style="interleaved", q_weight_scale=None, kv_weight_scale=None,
               weight_block_size=None, activation_quant="none") -> None:
    """Every precondition of the op, with a message naming the argument."""
    tensors = {"x": x, "q_weight": q_weight, "kv_weight": kv_weight, "kv_norm_weight": kv_norm_weight}
    tensors.update({k: v for k, v in (("q_norm_weight", q_norm_weight), ("q_bias", q_bias), ("kv_bias", kv_bias)) if v is not None})
    check_cpu_tensors(_fail, tensors)
    for name, t in tensors.items():
        if t.dtype != x.dtype and name not in ("q_weight", "kv_weight"):
            _fail(f"{name} has dtype {t.dtype}, expected x's dtype {x.dtype}")
    for name, w, scale in (("q_weight", q_weight, q_weight_scale), ("kv_weight", kv_weight, kv_weight_scale)):
        check_quantized_weight(_fail, name, w, f"{name}_scale", scale, weight_block_size, activation_quant, x.dtype)
    if kv_weight.dtype != q_weight.dtype:
        _fail(f"kv_weight has dtype {kv_weight.dtype}, expected q_weight's dtype {q_weight.dtype} (quantized alike)")
    if x.dtype not in SUPPORTED_DTYPES:
        _fail(f"x has dtype {x.dtype}; supported: bfloat16, float16, float32")
    if x.dim() < 1:
        _fail("x must have at least one dimension (the hidden size)")
    hidden = x.shape[-1]
    for name in ("q_weight", "kv_weight"):
        w = tensors[name]
        if w.dim() != 2 or w.shape[1] != hidden:
            _fail(f"{name} must be [N, {hidden}] to match x [..., {hidden}], got {list(w.shape)}")
    if kv_norm_weight.dim() != 1 or not 0 < kv_norm_weight.shape[0] < kv_weight.shape[0]:
        _fail(
            f"kv_norm_weight must be [kv_lora_rank] with 0 < kv_lora_rank < kv_weight.shape[0]="
            f"{kv_weight.shape[0]}, got {list(kv_norm_weight.shape)}"
        )
    if q_norm_weight is not None and tuple(q_norm_weight.shape) != (q_weight.shape[0],):
        _fail(f"q_norm_weight must be [{q_weight.shape[0]}], got {list(q_norm_weight.shape)}")
    if q_bias is not None and tuple(q_bias.shape) != (q_weight.shape[0],):
        _fail(f"q_bias must be [{q_weight.shape[0]}], got {list(q_bias.shape)}")
    if kv_bias is not None and tuple(kv_bias.shape) != (kv_weight.shape[0],):
        _fail(f"kv_bias must be [{kv_weight.shape[0]}], got {list(kv_bias.shape)}")
    for name, eps in (("q_eps", q_eps), ("kv_eps", kv_eps)):
        if isinstance(eps, Tensor):
            if eps.dim() != 0 or not eps.is_floating_point():
                _fail(f"{name} tensor must be a 0-d floating tensor, got {eps.dtype}{list(eps.shape)}")
        elif not eps > 0:
            _fail(f"{name} must be > 0, got {eps}")
    if k_rope_style not in ROPE_STYLES:
        _fail(f"k_rope_style must be one of {ROPE_STYLES}, got {k_rope_style!r}")
    if (k_cos is None) != (k_sin is None):
        _fail("k_cos and k_sin come together: pass both to rotate k_pe, or neither")
    if k_cos is not None:
        rope = kv_weight.shape[0] - kv_norm_weight.shape[0]
        expected = [*x.shape[:-1], rope // 2]
        for name, t in (("k_cos", k_cos), ("k_sin", k_sin)):
            if not isinstance(t, Tensor) or not t.is_floating_point() or list(t.shape) != expected or t.device.type != "cpu":
                _fail(f"{name} must be a floating CPU tensor {expected} (x's rows by rope / 2 = {rope} / 2), got "
                      f"{getattr(t, 'dtype', type(t).__name__)}{list(getattr(t, 'shape', []))}")
        if k_sin.dtype != k_cos.dtype:
            _fail(f"k_sin has dtype {k_sin.dtype}, expected k_cos's dtype {k_cos.dtype}")
        if rope % 2:
            _fail(f"rotating k_pe needs an even rope width, got {rope}")


def _rms_norm(x: Tensor, weight: Tensor, eps) -> Tensor:
    """In fp32 with the weight, one rounding (as `F.rms_norm`)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


@torch.library.custom_op("mla::qkv_a_proj", mutates_args=())
def qkv_a_proj(
    x: Tensor,
    q_weight: Tensor,
    kv_weight: Tensor,
    q_norm_weight: Optional[Tensor],
    kv_norm_weight: Tensor,
    q_eps: float,
    kv_eps: float,
    q_bias: Optional[Tensor] = None,
    kv_bias: Optional[Tensor] = None,
    q_eps_tensor: Optional[Tensor] = None,
    kv_eps_tensor: Optional[Tensor] = None,
    k_cos: Optional[Tensor] = None,
    k_sin: Optional[Tensor] = None,
    k_rope_style: str = "interleaved",
    q_weight_scale: Optional[Tensor] = None,
    kv_weight_scale: Optional[Tensor] = None,
    weight_block_size: Optional[list[int]] = None,
    activation_quant: str = "none",
) -> tuple[Tensor, Tensor, Tensor]:
    q_eps_value = q_eps_tensor if q_eps_tensor is not None else q_eps
    kv_eps_value = kv_eps_tensor if kv_eps_tensor is not None else kv_eps
    check_args(x, q_weight, kv_weight, q_norm_weight, kv_norm_weight, q_bias, kv_bias, q_eps_value, kv_eps_value,
               k_cos, k_sin, k_rope_style, q_weight_scale, kv_weight_scale, weight_block_size, activation_quant)
    L = kv_norm_weight.shape[0]
    if is_quantized(q_weight):
        # fp32 projections, rounded once with the norms below
        q, kv = (linear_fp32(x, w, scale, weight_block_size, activation_quant) + (0 if b is None else b.float())
                 for w, scale, b in ((q_weight, q_weight_scale, q_bias), (kv_weight, kv_weight_scale, kv_bias)))
    else:
        q = torch.nn.functional.linear(x, q_weight, q_bias)
        kv = torch.nn.functional.linear(x, kv_weight, kv_bias)
    if q_norm_weight is not None:
        q = _rms_norm(q, q_norm_weight, q_eps_value)
    c_kv = _rms_norm(kv[..., :L], kv_norm_weight, kv_eps_value)
    k_pe = kv[..., L:]
    if k_cos is not None:
        k_pe = rotate_pairs(k_pe, k_cos, k_sin, k_rope_style == "neox", k_rope_style == "interleaved_to_halves")
    return tuple(t.to(x.dtype).contiguous() for t in (q, c_kv, k_pe))


@qkv_a_proj.register_fake
def _(x, q_weight, kv_weight, q_norm_weight, kv_norm_weight, q_eps, kv_eps, q_bias=None, kv_bias=None,
      q_eps_tensor=None, kv_eps_tensor=None, k_cos=None, k_sin=None, k_rope_style="interleaved", q_weight_scale=None,
      kv_weight_scale=None, weight_block_size=None, activation_quant="none"):
    # Same checks while tracing: bad input fails at compile time with the same message.
    check_args(x, q_weight, kv_weight, q_norm_weight, kv_norm_weight, q_bias, kv_bias,
               q_eps_tensor if q_eps_tensor is not None else q_eps,
               kv_eps_tensor if kv_eps_tensor is not None else kv_eps, k_cos, k_sin, k_rope_style,
               q_weight_scale, kv_weight_scale, weight_block_size, activation_quant)
    lead = x.shape[:-1]
    L = kv_norm_weight.shape[0]
    return (
        x.new_empty(*lead, q_weight.shape[0]),
        x.new_empty(*lead, L),
        x.new_empty(*lead, kv_weight.shape[0] - L),
    )


def reference_fp64(x, q_weight, kv_weight, q_norm_weight, kv_norm_weight, q_eps, kv_eps, q_bias=None, kv_bias=None):
    """An independent fp64 computation of the op's math, for tests."""
    d = torch.float64

    def norm(t, w, eps):
        return w.to(d) * t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + float(eps))

    q = x.to(d) @ q_weight.to(d).T + (q_bias.to(d) if q_bias is not None else 0)
    kv = x.to(d) @ kv_weight.to(d).T + (kv_bias.to(d) if kv_bias is not None else 0)
    L = kv_norm_weight.shape[0]
    if q_norm_weight is not None:
        q = norm(q, q_norm_weight, q_eps)
    return q, norm(kv[..., :L], kv_norm_weight, kv_eps), kv[..., L:]
