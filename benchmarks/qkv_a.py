"""qkv_a_proj at the deepseek-v3-tp22 shape (hidden 7168 -> 1536 + 576): a stack of layers whose
A-projection weights exceed 128 MiB, so that decode streams them from memory.

Prints medians of interleaved rounds for eager, stock torch.compile, stock frozen with
concat-linear ("stock at its best" is the faster of the two), and mla_inductor (frozen and not),
with the fraction of the roofline: the larger of the weight bytes at the copy bandwidth (timed as
one more variant in the same interleaved rounds, so that it saw the same machine) and the FLOPs at
oneDNN's bf16 GEMM throughput. Asserts nothing.

    python benchmarks/qkv_a.py [--rows 1 8 512] [--layers 6] [--template-max-rows N]
"""

import argparse

import torch
from torch import nn

import mla_inductor
from mla_inductor import benchmarking
from mla_inductor.lowerings import segment_gemm
from mla_inductor.models.mla import RMSNorm, init_weights_


class APprojections(nn.Module):
    """The A-projections of one MLA layer as serving code holds them (one fused weight)."""

    def __init__(self, hidden=7168, q_lora_rank=1536, kv_lora_rank=512, rope=64):
        super().__init__()
        self.sizes = (q_lora_rank, kv_lora_rank + rope)
        self.kv_lora_rank = kv_lora_rank
        self.fused_qkv_a_proj_with_mqa = nn.Linear(hidden, sum(self.sizes), bias=False)
        self.q_a_layernorm = RMSNorm(q_lora_rank, 1e-6)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, 1e-6)

    def forward(self, x):
        q, latent = self.fused_qkv_a_proj_with_mqa(x).split(self.sizes, dim=-1)
        c_kv, k_pe = latent.split([self.kv_lora_rank, latent.shape[-1] - self.kv_lora_rank], dim=-1)
        return self.q_a_layernorm(q), self.kv_a_layernorm(c_kv), k_pe


class Stack(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(APprojections() for _ in range(layers))

    def forward(self, x):
        return [layer(x) for layer in self.layers]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 512])
    p.add_argument("--layers", type=int, default=6, help="6 x 30 MiB of bf16 weights = 182 MiB")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--template-max-rows", type=int, default=None, help="fire the fusion up to this many rows")
    args = p.parse_args()
    if args.template_max_rows is not None:  # to measure the template where the cost model declines it
        segment_gemm.MAX_ROWS_PACKED = segment_gemm.MAX_ROWS_FROZEN = args.template_max_rows
        segment_gemm.MAX_ROWS_UNFROZEN = args.template_max_rows
    torch._dynamo.config.recompile_limit = 64
    torch._inductor.config.fx_graph_cache = False

    model = init_weights_(Stack(args.layers), seed=0).to(torch.bfloat16).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    flop_per_row = 2 * sum(l.fused_qkv_a_proj_with_mqa.weight.numel() for l in model.layers)
    bandwidth = benchmarking.copy_bandwidth()
    read = benchmarking.read_bandwidth()
    gemm = benchmarking.gemm_throughput()
    print(f"weights {weight_bytes / 2**20:.0f} MiB in {args.layers} layers; copy bandwidth {bandwidth / 1e9:.1f} GB/s; "
          f"read bandwidth {read / 1e9:.1f} GB/s; oneDNN bf16 GEMM {gemm / 1e9:.0f} GFLOP/s; "
          f"threads {torch.get_num_threads()}")
    frozen = {"freezing": True, "cpp.enable_concat_linear": True}
    copy_probe = benchmarking.copy_probe()
    print("| rows | eager ms | stock ms | stock frozen ms | mla ms | mla frozen ms | x stock best "
          "| copy GB/s in the rounds | roofline: copy bw | roofline: read bw | weights GB/s | fired |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for rows in args.rows:
        x = torch.randn(rows, 7168).to(torch.bfloat16)
        variants = {
            "eager": (model, None, False),
            "stock": (torch.compile(model, dynamic=False), None, False),
            "stock frozen": (torch.compile(model, dynamic=False, options=frozen), None, True),
            "mla": (torch.compile(model, backend="mla_inductor", dynamic=False), None, False),
            "mla frozen": (torch.compile(model, backend="mla_inductor", dynamic=False, options=frozen), None, True),
        }
        fns = {}
        mla_inductor.reset_counts()
        for name, (fn, _, freeze) in variants.items():
            with torch.no_grad(), (benchmarking.inference_freezing() if freeze else torch.no_grad()):
                fn(x)
            fns[name] = lambda fn=fn: fn(x)
        fired = mla_inductor.fusion_counts()["qkv_a_proj"]
        fns["copy"], copy_bytes = copy_probe
        with torch.no_grad():
            t = benchmarking.interleaved_medians(fns, rounds=args.rounds, calls=5)
        copy_in_rounds = copy_bytes / t["copy"]
        best_stock = min(t["stock"], t["stock frozen"])
        best_mla = min(t["mla"], t["mla frozen"])
        compute = rows * flop_per_row / gemm
        roofline_copy = max(weight_bytes / copy_in_rounds, compute)
        roofline_read = max(weight_bytes / read, compute)
        print(f"| {rows} | " + " | ".join(f"{t[k] * 1e3:.2f}" for k in variants)
              + f" | {best_stock / best_mla:.2f} | {copy_in_rounds / 1e9:.1f} | {roofline_copy / best_mla:.0%}"
              f" | {roofline_read / best_mla:.0%} | {weight_bytes / best_mla / 1e9:.1f} | {fired} |", flush=True)
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
