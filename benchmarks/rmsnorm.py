"""rmsnorm: why there is no template. Stock torch.compile's kernel for transformers' RMSNorm, alone and
after the residual add, against an allocating copy of the same tensor (the least a kernel that returns
a new tensor can cost) and against the copy bandwidth, in the same interleaved rounds.

Each shape runs over enough distinct tensors (128 MiB) that they come from memory. Prints medians per
call; asserts nothing.

    python benchmarks/rmsnorm.py [--shapes 1024x2048 512x7168] [--rounds 11]
"""

import argparse

import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from mla_inductor import benchmarking


def norm_only(hidden, residual, norm):
    return norm(hidden)


def add_and_norm(hidden, residual, norm):
    residual = hidden + residual
    return norm(residual), residual


def bench(rows, width, rounds):
    norm = LlamaRMSNorm(width, eps=1e-6).to(torch.bfloat16)
    tensor_bytes = rows * width * 2
    count = max(1, (128 << 20) // (2 * tensor_bytes))
    hiddens = [torch.randn(rows, width, dtype=torch.bfloat16) for _ in range(count)]
    residuals = [torch.randn(rows, width, dtype=torch.bfloat16) for _ in range(count)]
    fns = {}
    for fn in (norm_only, add_and_norm):
        compiled = torch.compile(fn, dynamic=False)
        fns[fn.__name__] = lambda c=compiled: [c(h, r, norm) for h, r in zip(hiddens, residuals)]
    fns["allocating copy"] = lambda: [h.clone() for h in hiddens]
    copy, copy_bytes = benchmarking.copy_probe()
    with torch.no_grad():
        t = benchmarking.interleaved_medians({**fns, "copy": copy}, rounds=rounds, calls=3)
    bandwidth = copy_bytes / t["copy"]
    tensors_moved = {"norm_only": 2, "add_and_norm": 4, "allocating copy": 2}  # read + written
    for name, moved in tensors_moved.items():
        ms = t[name] / count * 1e3
        roofline = moved * tensor_bytes / bandwidth * 1e3
        print(f"| {rows} x {width} | {name} | {ms:.3f} | {roofline / ms:.0%} | {bandwidth / 1e9:.1f} |", flush=True)
    torch._dynamo.reset()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["1024x2048", "512x7168"])
    p.add_argument("--rounds", type=int, default=11)
    args = p.parse_args()
    benchmarking.fresh_compiles()
    print("| bf16 rows x width | kernel | ms per call | % of copy roofline | copy GB/s in the rounds |")
    print("|---|---|---|---|---|")
    for shape in args.shapes:
        rows, width = (int(n) for n in shape.split("x"))
        bench(rows, width, args.rounds)


if __name__ == "__main__":
    main()
