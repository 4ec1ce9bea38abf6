"""The GEMM building block of the projection templates (qkv_a_proj, q_b_absorb): when it wins over
Inductor's own path, and the compile-time packing of frozen weights for templates/packed_dot.h."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch._inductor import config as inductor_config
from torch._inductor import ir
from torch._inductor.virtualized import V

from .. import isa
from ..ops.weight_quant import QUANTIZED_WEIGHT_DTYPES
from .template import frozen_value, huge_page_empty, realize_input

VNNI_COLS = 32  # kPackedCols of templates/packed_dot.h with AVX-512
AVX2_COLS = 16  # and with AVX2
# Where the template beats what Inductor would emit instead (benchmarks/qkv_a.py, deepseek-v3-tp22
# shape, 2 threads). On an AVX512-BF16 CPU: with freezing, bf16 weights are packed at compile time and
# the template beats oneDNN's prepacked GEMM up to 8 rows (1.1-1.6x; at 16 rows it is 0.77x: each
# k-chunk then waits for memory before the second row tile can reuse it); frozen weights it cannot pack
# (fp32, fp16) run NT tiles, which only tie oneDNN at 8 rows. Without freezing, Inductor calls unpacked
# mm, which the NT template beats up to 64 rows. The patterns consult this so that larger row counts
# keep Inductor's own best path.
MAX_ROWS_PACKED = 8
MAX_ROWS_FROZEN = 4
MAX_ROWS_UNFROZEN = 64
# Where the CPU has AMX, oneDNN runs bf16 GEMMs (and W8A8's _int_mm) on its tiles, and a projection
# whose rows make it compute-bound for our dpbf16 / VNNI tiles goes to oneDNN's: on an AMX Xeon (2
# cores, benchmarks/qkv_a.py, gqa_qkv.py and quantized_projections.py) the template wins at 2 and 4
# rows (1.04-1.96x stock at its best) and loses at 8 (gqa_qkv 0.79-0.86x, bf16 0.79-0.81x, W8A8
# 0.72-0.76x, fp8 0.58-0.64x). Two kinds keep winning at 8 rows and take the limits above: q_b_absorb
# (1.35x: the absorption is what stock cannot fuse) and int8 weight-only weights (1.29-1.33x: stock's
# _weight_int8pack_mm has no AMX kernel).
MAX_ROWS_AMX = 4
# Quantized weights whose template runs on our own AMX tiles (quantized_gemm.h; patterns'
# on_amx_tiles) beat stock at its best (oneDNN's AMX GEMMs over the bf16 weights freezing folds fp8
# into, or _int_mm for W8A8) at 8 and at 16 rows (benchmarks/quantized_projections.py on the AMX Xeon:
# fp8 1.25-1.58x / 1.64x, W8A8 1.04-1.17x / 1.10x, int8 weight-only 2.6-2.9x / 3.3x). 16 rows are one
# tile of x rows; more convert each weight again per 16.
MAX_ROWS_AMX_TILES = 16


# nt_dot.h's tiles: a tile's weight rows must share their K-block scales (kTileCols rows), and a K
# block must hold whole vectors (16 fp32 lanes on AVX-512, 8 on AVX2).
TILE_COLS = 4
WIDEST_VECTOR = 16
# nt_dot.h's integer tiles (W8A8) sum a weight row in int32 lanes that gain up to 2^15 per 16 columns.
MAX_INT8_K = 2**20


def scales_fit_tiles(weight, weight_block_size) -> bool:
    """Whether nt_dot.h's quantized tiles serve a weight's scale blocks (ops/weight_quant.py); a weight
    in the activation dtype always fits."""
    if weight.get_dtype() == torch.int8 and int(weight.get_size()[1]) >= MAX_INT8_K:
        return False
    if weight.get_dtype() not in QUANTIZED_WEIGHT_DTYPES or weight_block_size is None:
        return True
    block_n, block_k = weight_block_size
    if block_k >= int(weight.get_size()[1]):  # one K block: scales multiply the finished sums
        return True
    return block_n % TILE_COLS == 0 and block_k % WIDEST_VECTOR == 0


def widens_to_fp32_bits(weight: torch.Tensor) -> bool:
    """Whether a frozen e4m3fn weight may take widen.h's Float8_e4m3fn_finite, which widens it into fp32's
    bits without the NaN fix: it holds no NaN and, where subnormal FMA operands are slow
    (isa.slow_subnormal_inputs), no subnormal, which that route widens into an fp32 subnormal. One
    weight in 10^4 of a 128 x 128 block-scaled Gaussian weight is subnormal; on the AMX Xeon they made
    the one-row fp8 A-projections 14% slower (31.96 against 27.97 ms through the fp16 route, which then
    measured the same as the fp32-bits route over the weight with its subnormals zeroed: 27.99 ms)."""
    magnitude = weight.view(torch.uint8) & 0x7F
    if (magnitude == 0x7F).any():
        return False
    return not (isa.slow_subnormal_inputs() and ((magnitude > 0) & (magnitude < 0x08)).any())


# The C++ a template over quantized weights adds after nt_dot.h: QuantizedGemm and its AMX tiles.
QUANTIZED_GEMM_HEADERS = ("amx_tiles.h", "quantized_gemm.h")


def amx_tiles_serve(k: int, weight_block_size, weight_only: bool, activation_dtype: torch.dtype) -> bool:
    """Whether quantized_gemm.h's AMX tiles serve a quantized weight of `k` columns (its amx_serves): K in
    whole 64-column chunks up to 2^16 (W8A8's int32 sums stay exact), K blocks of whole chunks over row
    blocks of multiples of 16, and bf16 activations for weight-only int8 / fp8 (the tiles multiply bf16)."""
    if k % 64 or k > 2**16 or (weight_only and activation_dtype != torch.bfloat16):
        return False
    return weight_block_size is None or weight_block_size[1] >= k or (
        weight_block_size[1] % 64 == 0 and weight_block_size[0] % 16 == 0)


def quantized_weights(scale, weight_block_size, activation_quant, *weights) -> Optional[dict]:
    """How a template reads its int8 / fp8 `weights` (a weight with a scale streams as it is, one byte
    an element, never packed), or None for weights in the activation dtype. `finite_e4m3fn`: they are
    frozen e4m3fn weights that `widens_to_fp32_bits`."""
    if scale is None:
        return None

    def finite_e4m3fn(weight) -> bool:
        value = frozen_value(weight) if weight.get_dtype() == torch.float8_e4m3fn else None
        return value is not None and widens_to_fp32_bits(value)

    return dict(weight_block_size=weight_block_size, activation_quant=activation_quant,
                finite_e4m3fn=bool(weights) and all(map(finite_e4m3fn, weights)))


def quantized_options(kernel, quantized: Optional[dict], **weights) -> dict:
    """The Jinja options of quantized weights: `<name>_scales` per weight, what nt_dot.h's WeightScales
    is built from (the C++ type and the scale blocks; per channel, blocks of 1 x K), or None; and
    `quantize_x`, how the template makes x's rows ready for the quantized tiles, once (nt_dot.h's
    quantize_row: W8A8 and FP8 activations quantize them, weight-only widens them), or None."""
    scheme = quantized["activation_quant"] if quantized is not None else None
    options = {"quantize_x": {None: None, "none": "mi::ActivationQuant::kNone",
                              "int8": "mi::ActivationQuant::kSglang",
                              "int8_torchao": "mi::ActivationQuant::kTorchao",
                              "fp8_row": "mi::ActivationQuant::kFp8Row",
                              "fp8_static": "mi::ActivationQuant::kFp8Static"}[scheme]}
    for name, weight in weights.items():
        options[f"{name}_scales"] = None
        if quantized is not None:
            k = int(weight.get_size()[1])
            block_n, block_k = quantized["weight_block_size"] or (1, k)
            # the C++ type the template casts the weight pointers to
            dtype = "mla_inductor::Float8_e4m3fn_finite" if quantized["finite_e4m3fn"] else kernel.dtype(weight)
            options[f"{name}_scales"] = dict(dtype=dtype, block_n=block_n, block_k=min(block_k, k),
                                             ld=-(-k // block_k))
    return options


def can_pack(dtype: torch.dtype) -> bool:
    """Whether frozen weights of `dtype` get packed for packed_dot.h: bf16, and the C++ is compiled for
    AVX2 or AVX-512 (isa.target_isa: this CPU under Inductor's default -march=native); the layout
    follows the target (pack_blocks)."""
    return dtype == torch.bfloat16 and isa.at_least("avx2", isa.target_isa())


def packs_rows(dtype: torch.dtype) -> bool:
    """Whether the templates pack an unfrozen weight of `dtype` as their tiles go, from
    kRowsPackedOnTheFly rows (packed_dot.h's *_from_rows tasks): bf16 where the C++ targets AVX-512
    without AVX512-BF16, where each packed line widened once serves 8 x rows against the NT tiles' one
    widening per FMA (1.44x at 64 rows of Llama-3-8B's MLP on a Cascade Lake Xeon, docs/linear.md). With
    AVX512-BF16 the NT tiles multiply bf16 natively; on AVX2 the same packing tied the NT tiles
    (measured and not kept, docs/linear.md)."""
    return dtype == torch.bfloat16 and isa.target_isa() == "avx512f"


def template_wins(rows: int, dtype: torch.dtype, amx_competes: bool = False, on_amx_tiles: bool = False) -> bool:
    """Whether a projection template over `rows` rows of `dtype` activations beats Inductor's own GEMM;
    `amx_competes`: that GEMM runs on oneDNN's AMX tiles where the CPU has them (MAX_ROWS_AMX);
    `on_amx_tiles`: the template's quantized weights run on ours where the C++ targets AMX
    (MAX_ROWS_AMX_TILES)."""
    if amx_competes and isa.host_isa() == "amx":
        if on_amx_tiles and isa.target_isa() == "amx":
            return rows <= MAX_ROWS_AMX_TILES
        if rows > MAX_ROWS_AMX:
            return False
    if dtype == torch.bfloat16 and not isa.native_bf16_gemm():
        # Without a native bf16 GEMM, Inductor's bf16 mm runs ATen's at ~12 GFLOP/s at every row count,
        # where the templates widen to fp32 FMAs: 33 GFLOP/s (NT tiles) and 47 (packed, frozen) at 16,
        # 64 and 512 rows of the A-projections on an AVX2 EPYC at 64 GFLOP/s fp32 peak. No row limit.
        return True
    if not inductor_config.freezing:
        return rows <= MAX_ROWS_UNFROZEN
    return rows <= (MAX_ROWS_PACKED if can_pack(dtype) else MAX_ROWS_FROZEN)


def pack_vnni_blocks(*weights: torch.Tensor) -> torch.Tensor:
    """[N_i, K] weights as one [blocks, (K + 1) // 2 * 64] tensor of the 32-column VNNI blocks that
    packed_dot.h reads with AVX-512: block[kp][c][e] = W[n0 + c][2 kp + e], each weight's blocks in
    turn, the last block of each zero-padded in columns and an odd K zero-padded to a whole pair."""
    blocks = []
    for w in weights:
        w = w.contiguous()  # a transposed view too (mla::qkv's [H, I] weight is packed as its [I, H] rows)
        n, k = w.shape
        padded = F.pad(w, (0, k % 2, 0, -n % VNNI_COLS))
        pairs = (k + 1) // 2
        blocks.append(padded.view(-1, VNNI_COLS, pairs, 2).transpose(1, 2).reshape(-1, pairs * 2 * VNNI_COLS))
    return _in_huge_pages(blocks)


def pack_column_blocks(*weights: torch.Tensor) -> torch.Tensor:
    """[N_i, K] weights as one [blocks, K * 16] tensor of the 16-column blocks that packed_dot.h reads
    on AVX2: block[k][c] = W[n0 + c][k], each weight's blocks in turn, the last block of each
    zero-padded in columns."""
    blocks = []
    for w in weights:
        n, k = w.shape
        padded = F.pad(w.contiguous(), (0, 0, 0, -n % AVX2_COLS))
        blocks.append(padded.view(-1, AVX2_COLS, k).transpose(1, 2).reshape(-1, k * AVX2_COLS))
    return _in_huge_pages(blocks)


def pack_blocks(*weights: torch.Tensor) -> torch.Tensor:
    """The weights in the packed layout of the target Inductor compiles for."""
    if isa.at_least("avx512f", isa.target_isa()):
        return pack_vnni_blocks(*weights)
    return pack_column_blocks(*weights)


def _in_huge_pages(blocks: list[torch.Tensor]) -> torch.Tensor:
    packed = huge_page_empty((sum(b.shape[0] for b in blocks), blocks[0].shape[1]), blocks[0].dtype)
    return torch.cat(blocks, out=packed)


def frozen_values(dtype: torch.dtype, *weights) -> Optional[list[torch.Tensor]]:
    """Under freezing, the values of the lowering arguments `weights` when all are frozen and
    `can_pack(dtype)`: what the packed path needs. Else None (use the weights as they are)."""
    if not inductor_config.freezing or not can_pack(dtype):
        return None
    values = [frozen_value(w) for w in weights]
    return None if any(v is None for v in values) else values


def packed_constant(*values: torch.Tensor) -> ir.IRNode:
    """[N_i, K] weight values packed into one constant of blocks (each weight's blocks in turn)."""
    return realize_input(V.graph.add_tensor_constant(pack_blocks(*values)))


def packed_weights(dtype: torch.dtype, *weights) -> Optional[ir.IRNode]:
    """`weights` as one packed constant when the packed path applies (frozen_values), else None."""
    values = frozen_values(dtype, *weights)
    return None if values is None else packed_constant(*values)
