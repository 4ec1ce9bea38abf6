"""DeepSeek-V2-Lite's MoE blocks as transformers builds them (64 routed experts of 1408, 2 shared, top-6,
softmax routing, its default `grouped_mm` experts), a stack of blocks whose weights exceed the last-level
cache many times, so that decode streams the selected experts from memory.

Each row count is one table row: medians of interleaved rounds of eager, stock torch.compile (frozen and
not; "stock best" is the faster) and mla_inductor (frozen and not), and the roofline of the same rounds:
the larger of the bytes a call must read (the union of the experts its tokens select, per block, the
shared experts and the router) at the copy bandwidth timed among the variants, and the FLOPs of the
selected experts at oneDNN's best GEMM rate. Asserts nothing.

    python benchmarks/moe.py [--rows 1 8 32] [--blocks N] [--rounds N] [--experts eager|grouped_mm|batched_mm]
"""

import argparse

import torch
import transformers
from torch import nn
from transformers.models.deepseek_v2 import modeling_deepseek_v2

from mla_inductor import benchmarking, record, report
from mla_inductor.models import weight_bytes

HIDDEN, EXPERT_WIDTH, EXPERTS, SHARED, TOP_K = 2048, 1408, 64, 2, 6


def v2_lite_moe_config(experts_implementation: str) -> transformers.DeepseekV2Config:
    config = transformers.DeepseekV2Config(
        hidden_size=HIDDEN, moe_intermediate_size=EXPERT_WIDTH, n_routed_experts=EXPERTS, n_shared_experts=SHARED,
        num_experts_per_tok=TOP_K, topk_method="greedy", routed_scaling_factor=1.0, num_hidden_layers=1,
        first_k_dense_replace=0, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512)
    config._experts_implementation = experts_implementation
    return config


class Blocks(nn.Module):
    """MoE blocks with their residuals: h = h + moe(h)."""

    def __init__(self, config, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(modeling_deepseek_v2.DeepseekV2Moe(config) for _ in range(blocks))

    def forward(self, h):
        for block in self.blocks:
            h = h + block(h)
        return h


def bytes_and_flops(model: Blocks, h: torch.Tensor) -> tuple[int, int]:
    """What one call must read (each block's selected experts once, its shared experts, its router) and
    the FLOPs of its experts, following the routing of this input."""
    experts = [name for name, m in model.named_modules() if m in report.routed_experts(model)]
    nbytes = weight_bytes(model, exclude=experts) + report.selected_expert_bytes(model, lambda: model(h))
    flops = len(model.blocks) * h.shape[0] * h.shape[1] * (TOP_K + SHARED) * 2 * 3 * HIDDEN * EXPERT_WIDTH
    return nbytes, flops


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    block_bytes = (EXPERTS + SHARED) * 3 * HIDDEN * EXPERT_WIDTH * 2
    p.add_argument("--blocks", type=int, default=3, help=f"MoE blocks of {block_bytes / 2**30:.2f} GiB of bf16 weights")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--experts", default="grouped_mm", choices=["grouped_mm", "eager", "batched_mm"])
    args = p.parse_args()
    benchmarking.fresh_compiles()

    torch.manual_seed(0)
    model = Blocks(v2_lite_moe_config(args.experts), args.blocks)
    for param in model.parameters():
        nn.init.normal_(param, std=0.02)
    model = model.to(torch.bfloat16).eval()
    gemm = benchmarking.gemm_throughput()
    copy, copy_bytes = benchmarking.copy_probe()
    print(f"{benchmarking.machine_line()}; {args.blocks} blocks, experts '{args.experts}'; oneDNN "
          f"{benchmarking.isa.roof_gemm_name()} GEMM {gemm / 1e9:.0f} GFLOP/s")
    print("| rows | eager ms | stock ms | stock frozen ms | mla ms | mla frozen ms | x stock best | MB read "
          "| copy GB/s in the rounds | mla % of roofline | stock best % of roofline | mla GB/s | moe fired |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for rows in args.rows:
        h = (torch.randn(1, rows, HIDDEN) * 0.5).to(torch.bfloat16)
        nbytes, flops = bytes_and_flops(model, h)
        record.reset_counts()
        fns = benchmarking.compiled_variants(model, (h,))
        fired = record.fusion_counts()["moe"]
        fns["copy"] = copy
        with torch.no_grad():
            t = benchmarking.interleaved_medians(fns, rounds=args.rounds, calls=3)
        bandwidth = copy_bytes / t["copy"]
        roofline = max(nbytes / bandwidth, flops / gemm)
        stock, mla = min(t["stock"], t["stock frozen"]), min(t["mla"], t["mla frozen"])
        print(f"| {rows} | " + " | ".join(f"{t[k] * 1e3:.2f}" for k in benchmarking.VARIANTS)
              + f" | {stock / mla:.2f} | {nbytes / 1e6:.0f} | {bandwidth / 1e9:.1f} | {roofline / mla:.0%} "
              f"| {roofline / stock:.0%} | {nbytes / mla / 1e9:.1f} | {fired} |", flush=True)
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
