"""qkv_a_proj with quantized weights at the deepseek-v3-tp22 shape (hidden 7168 -> 1536 + 576), in a
stack of layers whose weights exceed the L3, against our bf16 template and stock Inductor on the same
quantized weights.

Formats (ops/weight_quant.py): bf16; int8 weight-only with per-channel scales (torchao's
Int8WeightOnlyConfig); SGLang's W8A8 (int8 weights, activations quantized per token, absmax / 127);
torchao's W8A8 (Int8DynamicActivationInt8WeightConfig's per-token scheme, absmax / 127.5); fp8 e4m3
with 128 x 128 block scales (DeepSeek-V3's checkpoints, SGLang's W8A16).

"mla" calls mla::qkv_a_proj with the weights as they are; "stock" compiles the same math spelled as
plain PyTorch, the way each format reaches Inductor (torchao's dequantize-and-mm for int8, a per-token
quantize and torch._int_mm for either W8A8, the block dequantization for fp8), with and without freezing
("stock best" is the faster). All variants of a row count, and a large copy, run in the same
interleaved rounds. Asserts nothing.

    python benchmarks/quantized_projections.py [--rows 1 8] [--layers N]
"""

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from mla_inductor import benchmarking
from mla_inductor.ops.weight_quant import (dequantize_weight, quantize_rows, quantize_weight_fp8_blocks,
                                           quantize_weight_int8)

HIDDEN, Q_ROWS, KV_ROWS, LATENT = 7168, 1536, 576, 512
BLOCK = [128, 128]
FORMATS = ("bf16", "int8", "w8a8", "w8a8-torchao", "fp8")
# activation_quant of each format's mla::qkv_a_proj call
ACTIVATION_QUANT = {"w8a8": "int8", "w8a8-torchao": "int8_torchao"}


def quantize(w: torch.Tensor, fmt: str):
    """(weight, scale) of a bf16 [N, K] weight in `fmt`: per-channel absmax / 127 for int8, per
    128 x 128 block absmax / 448 for fp8."""
    if fmt == "bf16":
        return w, None
    return quantize_weight_fp8_blocks(w, BLOCK) if fmt == "fp8" else quantize_weight_int8(w)


class Layer(nn.Module):
    def __init__(self, fmt: str, fused_op: bool, generator: torch.Generator):
        super().__init__()
        self.fmt, self.fused_op = fmt, fused_op
        for name, rows in (("q", Q_ROWS), ("kv", KV_ROWS)):
            w = (torch.randn(rows, HIDDEN, generator=generator) / HIDDEN**0.5).to(torch.bfloat16)
            weight, scale = quantize(w, fmt)
            self.register_buffer(f"{name}_weight", weight)
            self.register_buffer(f"{name}_scale", scale)
        self.q_norm = nn.Parameter(torch.ones(Q_ROWS, dtype=torch.bfloat16))
        self.kv_norm = nn.Parameter(torch.ones(LATENT, dtype=torch.bfloat16))

    def project(self, x, w, scale):
        if self.fmt == "bf16":
            return F.linear(x, w)
        if self.fmt == "int8":
            return torch.mm(x, w.t().to(torch.bfloat16)) * scale.to(torch.bfloat16).view(-1)
        if self.fmt in ACTIVATION_QUANT:
            q, x_scale = quantize_rows(x, ACTIVATION_QUANT[self.fmt])
            return (torch._int_mm(q, w.t()).float() * x_scale * scale.view(-1)).to(torch.bfloat16)
        return F.linear(x, dequantize_weight(w, scale, BLOCK).to(torch.bfloat16))  # block dequantization, in the graph

    def forward(self, x):
        if self.fused_op:
            quant = {} if self.fmt == "bf16" else dict(
                q_weight_scale=self.q_scale, kv_weight_scale=self.kv_scale,
                weight_block_size=BLOCK if self.fmt == "fp8" else None,
                activation_quant=ACTIVATION_QUANT.get(self.fmt, "none"))
            return torch.ops.mla.qkv_a_proj(x, self.q_weight, self.kv_weight, self.q_norm, self.kv_norm, 1e-6, 1e-6,
                                            **quant)
        q = F.rms_norm(self.project(x, self.q_weight, self.q_scale), (Q_ROWS,), self.q_norm, 1e-6)
        kv = self.project(x, self.kv_weight, self.kv_scale)
        return q, F.rms_norm(kv[:, :LATENT], (LATENT,), self.kv_norm, 1e-6), kv[:, LATENT:]


class Stack(nn.Module):
    def __init__(self, layers: int, fmt: str, fused_op: bool):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.layers = nn.ModuleList(Layer(fmt, fused_op, g) for _ in range(layers))

    def forward(self, x):
        return [layer(x) for layer in self.layers]


def main():
    p = benchmarking.projection_arg_parser(__doc__.splitlines()[0], 15 << 20, 6, "15 MiB of int8 / fp8 weights")
    p.set_defaults(rows=[1, 8])
    args = p.parse_args()
    benchmarking.fresh_compiles()
    frozen = {fmt: benchmarking.frozen_options() for fmt in FORMATS}
    # torch 2.13's concat-linear folds the layers' int8 weight-only mm's (six, by default) into one and
    # splits it wrongly (a [1, 1152] slice meets the q norm of 1536: an error at compile), so stock runs
    # those frozen without it; it is off already where bf16 GEMMs are not native (isa.concat_linear_is_slow)
    frozen["int8"]["cpp.enable_concat_linear"] = False
    models = {(fmt, fused): Stack(args.layers, fmt, fused).eval() for fmt in FORMATS for fused in (False, True)}
    weight_bytes = {fmt: sum(b.numel() * b.element_size() for n, b in models[fmt, True].named_buffers()
                             if n.endswith("weight")) for fmt in FORMATS}
    copy, copy_bytes = benchmarking.copy_probe()
    print(f"{benchmarking.machine_line()}; weights per format: "
          + ", ".join(f"{fmt} {weight_bytes[fmt] / 2**20:.0f} MiB" for fmt in FORMATS))
    print("| rows | format | stock ms | stock frozen ms | mla ms | mla frozen ms | x stock best | x mla bf16 "
          "| weights GB/s | % of copy bw |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rows in args.rows:
        x = torch.randn(rows, HIDDEN).to(torch.bfloat16)
        fns = {}
        for (fmt, fused), model in models.items():
            for freeze in (False, True):
                options = frozen[fmt]
                compiled = torch.compile(model, dynamic=False, options=options if freeze else None)
                with torch.no_grad(), (benchmarking.inference_freezing(options["cpp.enable_concat_linear"]) if freeze
                                       else contextlib.nullcontext()):
                    compiled(x)
                fns[fmt, fused, freeze] = lambda compiled=compiled: compiled(x)
        fns["copy"] = copy
        with torch.no_grad():
            t = benchmarking.interleaved_medians(fns, rounds=args.rounds, calls=5)
        copy_bw = copy_bytes / t["copy"]
        mla_bf16 = min(t["bf16", True, False], t["bf16", True, True])
        for fmt in FORMATS:
            stock = min(t[fmt, False, False], t[fmt, False, True])
            mla = min(t[fmt, True, False], t[fmt, True, True])
            cells = [t[fmt, fused, freeze] * 1e3 for fused in (False, True) for freeze in (False, True)]
            print(f"| {rows} | {fmt} | " + " | ".join(f"{c:.2f}" for c in cells)
                  + f" | {stock / mla:.2f} | {mla_bf16 / mla:.2f} | {weight_bytes[fmt] / mla / 1e9:.1f}"
                  f" | {weight_bytes[fmt] / mla / copy_bw:.0%} |", flush=True)
        print(f"copy in the rounds: {copy_bw / 1e9:.1f} GB/s")
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
