"""Weights quantized as the anchors' tests quantize them, and an independent fp64 dequantization."""

import torch
import torch.nn.functional as F


def quantize_int8_per_row(w):
    """SGLang's test: symmetric per output channel, absmax / 127; the scale [N, 1] fp32."""
    scale = w.float().abs().amax(1, keepdim=True).clamp_min(1e-7) / 127
    return torch.round(w.float() / scale).clamp(-127, 127).to(torch.int8), scale


def quantize_fp8_blocks(w, block=(128, 128)):
    """SGLang's test (`convert_weight`): e4m3 per block, scale absmax / 448, partial blocks at the ends."""
    n, k = w.shape
    bn, bk = block
    padded = F.pad(w.float(), (0, -k % bk, 0, -n % bn))
    blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = blocks.abs().amax((1, 3)).clamp_min(1e-12) / 448
    q = (blocks / scale[:, None, :, None]).view_as(padded)[:n, :k]
    return q.to(torch.float8_e4m3fn), scale


def dequantize_fp64(weight, scale, block=None):
    """weight * the scale of each element's block, element by element through index arithmetic."""
    n, k = weight.shape
    rows, cols = torch.arange(n)[:, None], torch.arange(k)[None, :]
    if block is None:
        return weight.double() * scale.double().reshape(n)[rows]
    return weight.double() * scale.double()[rows // block[0], cols // block[1]]


def quantize_rows_int8_fp64(x):
    """SGLang's per-token activation quantization, returned dequantized (q * scale) in fp64."""
    absmax = x.float().abs().amax(-1, keepdim=True).clamp_min(1e-7)
    q = torch.round(x.float() * (127 / absmax))
    return q.double() * (absmax.double() / 127)
