"""A serving-style DeepSeek MLA model, written as plain PyTorch.

This is how serving engines hold and run MLA (token-flattened activations, the fused
q_a/kv_a weight, a paged latent KV cache, absorbed decode), without any hand-written kernel:
the graphs our patterns must find. Layers are attention-only (input RMSNorm, MLA, residual):
MLP and MoE are not what this project fuses, and leaving them out keeps every measured byte
on the attention path.

Cache layout: one tensor per layer, [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim];
row j of request b lives at kv_cache[block_tables[b, j // block_size], j % block_size]. A block
size of 1 is the per-token index layout of SGLang's token pool.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..quantization import DEFAULT_BLOCK_SIZE, BlockFp8Linear, W8A8Linear, quantize_fp8_, quantize_w8a8_
from .configs import MLAConfig, yarn_mscale

QUANT = (None, "fp8", "w8a8")


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """To fp32 for bf16/fp16/fp32, but never down: fp64 models serve as exact references."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = _upcast(x)
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope_inv_freq(config: MLAConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of the rotary embedding and the cos/sin scale (YaRN where configured)."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    yarn = config.yarn
    if not yarn:
        return 1.0 / pos_freqs, 1.0
    factor, original = yarn["factor"], yarn["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(yarn["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(yarn["beta_slow"])), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    extrapolate = 1.0 - ramp  # high-frequency dims keep their frequency, low ones are interpolated
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    attention_factor = yarn_mscale(factor, yarn["mscale"]) / yarn_mscale(factor, yarn["mscale_all_dim"])
    return inv_freq, attention_factor


def cos_sin_cache(config: MLAConfig, max_positions: int) -> torch.Tensor:
    """[max_positions, rope_dim] = cos ‖ sin of each position (the serving engines' layout)."""
    inv_freq, scale = rope_inv_freq(config)
    freqs = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J style rotation of pairs (x[2i], x[2i+1]) by frequency i; DeepSeek's rope."""
    x1, x2 = _upcast(x[..., 0::2]), _upcast(x[..., 1::2])
    out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.flatten(-2).to(x.dtype)


def paged_latent_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
) -> torch.Tensor:
    """Absorbed MLA decode: every query head attends over latent rows K_j = c_j ‖ k_pe_j, V_j = c_j.

    q [B, H, kv_lora_rank + rope], cache [num_blocks, block_size, kv_lora_rank + rope] -> [B, H, kv_lora_rank].
    """
    kv = kv_cache[block_tables].flatten(1, 2)  # [B, max_blocks * block_size, D]
    c, k_pe = kv[..., :kv_lora_rank], kv[..., kv_lora_rank:]
    q_lat, q_pe = q[..., :kv_lora_rank], q[..., kv_lora_rank:]
    scores = torch.bmm(q_lat, c.transpose(1, 2)) + torch.bmm(q_pe, k_pe.transpose(1, 2))
    scores = _upcast(scores) * scale
    valid = torch.arange(kv.shape[1], device=q.device)[None, :] < seq_lens[:, None]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(c.dtype)
    return torch.bmm(probs, c)


class MLAAttention(nn.Module):
    def __init__(self, config: MLAConfig) -> None:
        super().__init__()
        self.config = config
        h, H = config.hidden_size, config.num_heads
        L, R = config.kv_lora_rank, config.qk_rope_head_dim
        self.num_heads = H
        if config.q_lora_rank is not None:
            # One GEMM for both A-projections, as vLLM and SGLang hold it.
            self.fused_qkv_a_proj_with_mqa = nn.Linear(h, config.q_lora_rank + L + R, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, H * config.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(h, H * config.qk_head_dim, bias=False)
            self.kv_a_proj_with_mqa = nn.Linear(h, L + R, bias=False)
        self.kv_a_layernorm = RMSNorm(L, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(L, H * (config.qk_nope_head_dim + config.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * config.v_head_dim, h, bias=False)
        self.scale = config.softmax_scale

    def _kv_b_weight(self) -> torch.Tensor:
        """kv_b_proj's weight [H, qk_nope + v_head_dim, kv_lora_rank] in the model's dtype (an fp8 one
        dequantized, as DeepSeek's absorbed decode does every step)."""
        c = self.config
        w = dense_weight(self.kv_b_proj, self.kv_a_layernorm.weight.dtype)
        return w.view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)

    @property
    def w_kc(self) -> torch.Tensor:
        """[H, kv_lora_rank, qk_nope]: absorbs q_nope into latent space (Linear-style, out x in)."""
        return self._kv_b_weight()[:, : self.config.qk_nope_head_dim].transpose(1, 2)

    @property
    def w_vc(self) -> torch.Tensor:
        """[H, v_head_dim, kv_lora_rank]: de-absorbs the latent attention output (Linear-style)."""
        return self._kv_b_weight()[:, self.config.qk_nope_head_dim :]

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, hidden] -> q_nope [T, H, nope], roped q_pe [T, H, rope], cache rows c_kv ‖ roped k_pe [T, L + R]."""
        c = self.config
        L, R = c.kv_lora_rank, c.qk_rope_head_dim
        if c.q_lora_rank is not None:
            q_a, latent = self.fused_qkv_a_proj_with_mqa(x).split([c.q_lora_rank, L + R], dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        else:
            q = self.q_proj(x)
            latent = self.kv_a_proj_with_mqa(x)
        c_kv, k_pe = latent.split([L, R], dim=-1)
        q_nope, q_pe = q.view(-1, self.num_heads, c.qk_head_dim).split([c.qk_nope_head_dim, R], dim=-1)
        q_pe = apply_rope_interleaved(q_pe, cos[:, None, :], sin[:, None, :])
        k_input = torch.cat([self.kv_a_layernorm(c_kv), apply_rope_interleaved(k_pe, cos, sin)], dim=-1)
        return q_nope, q_pe, k_input

    def forward_decode(self, x, cos, sin, kv_cache, slots, block_tables, seq_lens) -> torch.Tensor:
        c = self.config
        L = c.kv_lora_rank
        q_nope, q_pe, k_input = self._project(x, cos, sin)
        kv_cache.view(-1, k_input.shape[-1])[slots] = k_input
        q_input = x.new_empty(x.shape[0], self.num_heads, L + c.qk_rope_head_dim)
        q_input[..., :L] = torch.bmm(q_nope.transpose(0, 1), self.w_kc.transpose(1, 2)).transpose(0, 1)
        q_input[..., L:] = q_pe
        o_latent = paged_latent_attention(q_input, kv_cache, block_tables, seq_lens, L, self.scale)
        o = torch.bmm(o_latent.transpose(0, 1), self.w_vc.transpose(1, 2))  # [H, B, v_head_dim]
        return self.o_proj(o.transpose(0, 1).reshape(x.shape[0], -1))

    def forward_prefill(self, x, cos, sin, kv_cache, slots, block_tables, positions) -> torch.Tensor:
        """Non-absorbed attention of S new tokens per request over their whole context in the cache."""
        c = self.config
        B, S = positions.shape
        L, R, H = c.kv_lora_rank, c.qk_rope_head_dim, self.num_heads
        q_nope, q_pe, k_input = self._project(x, cos, sin)
        kv_cache.view(-1, k_input.shape[-1])[slots] = k_input
        kv = kv_cache[block_tables].flatten(1, 2)  # [B, T, L + R]
        T = kv.shape[1]
        k_nope, v = self.kv_b_proj(kv[..., :L]).view(B, T, H, -1).split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k_pe = kv[..., L:].unsqueeze(2).expand(B, T, H, R)
        key = torch.cat([k_nope, k_pe], dim=-1).transpose(1, 2)  # [B, H, T, qk_head_dim]
        query = torch.cat([q_nope, q_pe], dim=-1).view(B, S, H, -1).transpose(1, 2)
        visible = torch.arange(T, device=x.device)[None, None, :] <= positions[:, :, None]  # causal
        o = F.scaled_dot_product_attention(
            query, key, v.transpose(1, 2), attn_mask=visible[:, None], scale=self.scale
        )
        return self.o_proj(o.transpose(1, 2).reshape(B * S, H * c.v_head_dim))


class MLADecoderLayer(nn.Module):
    def __init__(self, config: MLAConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAAttention(config)


class MLAModel(nn.Module):
    """Embedding, a stack of MLA decoder layers, final norm and LM head."""

    def __init__(self, config: MLAConfig, max_positions: int = 8192) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MLADecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("cos_sin_cache", cos_sin_cache(config, max_positions), persistent=False)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        cos, sin = self.cos_sin_cache[positions.flatten()].chunk(2, dim=-1)
        return cos.to(dtype), sin.to(dtype)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        dtype = self.embed_tokens.weight.dtype
        return [torch.zeros(num_blocks, block_size, self.config.latent_dim, dtype=dtype) for _ in self.layers]

    def forward_decode(
        self,
        input_ids: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """One new token per request. seq_lens counts it; it is written at position seq_lens - 1.

        input_ids [B] -> logits [B, vocab].
        """
        block_size = kv_caches[0].shape[1]
        positions = seq_lens - 1
        slots = block_tables.gather(1, (positions // block_size)[:, None]).squeeze(1) * block_size
        slots = slots + positions % block_size
        h = self.embed_tokens(input_ids)
        cos, sin = self._cos_sin(positions, h.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            attn_in = layer.input_layernorm(h)
            h = h + layer.self_attn.forward_decode(attn_in, cos, sin, kv_cache, slots, block_tables, seq_lens)
        return self.lm_head(self.norm(h))

    def forward_prefill(
        self,
        input_ids: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """S new tokens per request after seq_lens - S cached ones (0 for a fresh prompt).

        input_ids [B, S] -> logits [B, S, vocab]; fills the cache rows of the new tokens.
        """
        B, S = input_ids.shape
        block_size = kv_caches[0].shape[1]
        positions = seq_lens[:, None] - S + torch.arange(S, device=input_ids.device)[None, :]
        slots = block_tables.gather(1, positions // block_size) * block_size + positions % block_size
        h = self.embed_tokens(input_ids.flatten())
        cos, sin = self._cos_sin(positions, h.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            attn_in = layer.input_layernorm(h)
            h = h + layer.self_attn.forward_prefill(
                attn_in, cos, sin, kv_cache, slots.flatten(), block_tables, positions
            )
        return self.lm_head(self.norm(h)).view(B, S, -1)


def init_weights_(model: nn.Module, seed: int) -> nn.Module:
    """Random weights with realistic scales: activations stay O(1) through every projection."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, module.in_features**-0.5, generator=generator)
                if module.bias is not None:
                    module.bias.normal_(0.0, 0.02, generator=generator)
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, 1.0, generator=generator)
            elif type(module).__name__.endswith("RMSNorm"):  # ours and transformers'
                # Not ones: a ones weight would hide a dropped multiply.
                module.weight.normal_(1.0, 0.1, generator=generator)
            elif type(module).__name__.endswith("TopkRouter"):  # transformers' MoE router [E, hidden]
                # Not zeros (its default): every token would pick the same experts, by their index.
                module.weight.normal_(0.0, module.weight.shape[1] ** -0.5, generator=generator)
            for name in ("gate_up_proj", "down_proj"):  # transformers' stacked experts [E, out, in]
                weight = getattr(module, name, None)
                if isinstance(weight, nn.Parameter) and weight.dim() == 3:
                    weight.normal_(0.0, weight.shape[2] ** -0.5, generator=generator)
    return model


def dense_weight(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A Linear's weight as its GEMM reads it: a quantized one dequantized to `dtype` (W8A8's kv_b_proj
    as SGLang's loader turns it into bf16 W_kc / W_vc)."""
    if isinstance(linear, BlockFp8Linear):
        return linear.dequantized_weight(dtype)
    if isinstance(linear, W8A8Linear):
        return (linear.weight.float() * linear.weight_scale).to(dtype)
    return linear.weight


def build_model(
    config: MLAConfig,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    max_positions: int = 8192,
    quant: Optional[str] = None,
    block_size: Sequence[int] = DEFAULT_BLOCK_SIZE,
) -> MLAModel:
    """quant="fp8": the attention Linears as a DeepSeek-V3 fp8 checkpoint holds them (e4m3 weights with
    fp32 scales per `block_size` block, dequantized in the forward: quantization.BlockFp8Linear);
    quant="w8a8": as SGLang's W8A8 (int8 weights per channel, activations quantized per token:
    quantization.W8A8Linear). The embedding and the LM head stay in `dtype`, as in those checkpoints."""
    if quant not in QUANT:
        raise ValueError(f"quant must be one of {QUANT}, got {quant!r}")
    model = MLAModel(config, max_positions=max_positions)
    init_weights_(model, seed)
    model = model.to(dtype).eval()
    if quant == "fp8":
        quantize_fp8_(model, block_size)
    elif quant == "w8a8":
        quantize_w8a8_(model)
    return model


def make_block_tables(
    batch: int, context: int, block_size: int, seed: int = 0, spare_blocks: int = 0
) -> tuple[torch.Tensor, int]:
    """Block tables [batch, ceil(context / block_size)] over a shuffled pool, and the pool size.

    Blocks are handed out in random order, as a serving engine's allocator does after some churn,
    so that a kernel cannot rely on a request's rows being contiguous.
    """
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq + spare_blocks
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    return order[: batch * blocks_per_seq].view(batch, blocks_per_seq).to(torch.int64), num_blocks


def stored_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds; a tensor subclass (torchao's quantized weights, which report the dtype
    they compute in) by the tensors it wraps."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return sum(stored_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def weight_bytes(model: nn.Module, exclude: Optional[Sequence[str]] = ("embed_tokens",)) -> int:
    """Bytes of the weights a decode step streams (the embedding is gathered, not streamed)."""
    return sum(
        stored_bytes(p)
        for name, p in model.named_parameters()
        if not any(name.startswith(e) for e in exclude or ())
    )
