"""What the quantized tests compare against: an fp64 dequantization and activation quantization
written apart from ops/weight_quant.py. (Weights are quantized for the tests by ops/weight_quant.py's
quantize_weight_*, as SGLang's tests quantize them: absmax / 127 per channel, absmax / 448 per block.)"""

import torch


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


def quantize_rows_int8_torchao_fp64(x):
    """torchao's per-token activation quantization (Int8DynamicActivationInt8WeightConfig), returned
    dequantized: the scale absmax / 127.5 rounded to x's dtype, at least fp32's epsilon; q = round(x /
    scale) in [-128, 127]."""
    absmax = x.abs().amax(-1, keepdim=True).double()
    scale = (absmax / 127.5).to(x.dtype).double().clamp_min(2.0**-23).to(x.dtype).double()
    q = torch.round(x.double() / scale).clamp(-128, 127)
    return q * scale
