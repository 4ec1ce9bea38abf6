"""gqa_decode: grouped-query decode attention at the Llama-3-8B shape (32 query heads over 8 key/value
heads of 128), B=8, 4096 cache rows, bf16, a [B, 1, 1, T] additive mask, in a stack of layers whose K and
V caches (134 MB per layer) exceed the L3.

The three spellings transformers compiles (`repeat_kv` before SDPA when there is a mask, `enable_gqa` when
there is none, and attention written out, attn_implementation="eager": transformers' own
`eager_attention_forward`), eager and compiled by stock torch.compile and by mla_inductor, against eager's packed
form (what transformers runs eagerly), with the copy bandwidth and the best GEMM throughput of this CPU
(`benchmarking.gemm_probe`) timed in the same interleaved rounds. The mask admits three quarters of the
rows (a StaticCache three quarters full): the roofline is the larger of those rows' keys and values at
the copy bandwidth (the bytes any kernel must read) and the FLOPs over them at the GEMM throughput.
Prints medians; asserts nothing.

    python benchmarks/gqa_decode.py [--layers 2] [--batch 8] [--context 4096] [--heads 32] [--kv-heads 8]

--heads 64 or 128 gives groups of 8 or 16 query heads per key/value head (Llama-70B's is 8); AMX CPUs
run groups of 16 on tiles. --kv-heads 32 is multi-head attention (Llama-2-7B, Phi-3-mini: groups of
one), where repeat_kv and enable_gqa leave plain SDPA.
"""

import argparse
import types

import torch
from transformers.models.llama.modeling_llama import eager_attention_forward

import mla_inductor
from mla_inductor import benchmarking, isa
from mla_inductor.ops.gqa_decode import packed_attention  # eager transformers' form (pack_gqa)
# The pattern's search functions are the model code: repeat_kv, enable_gqa.
from mla_inductor.patterns.gqa_decode import grouped, repeated

HEAD_DIM = 128


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--heads", type=int, default=32, help="query heads, a multiple of the key/value heads")
    p.add_argument("--kv-heads", type=int, default=8)
    args = p.parse_args()
    benchmarking.fresh_compiles()
    dtype = torch.bfloat16
    q = torch.randn(args.batch, args.heads, 1, HEAD_DIM).to(dtype)
    caches = [
        (torch.randn(args.batch, args.kv_heads, args.context, HEAD_DIM).to(dtype),
         torch.randn(args.batch, args.kv_heads, args.context, HEAD_DIM).to(dtype))
        for _ in range(args.layers)
    ]
    admitted = args.context * 3 // 4  # a StaticCache three quarters full
    mask = torch.zeros(args.batch, 1, 1, args.context)
    mask[..., admitted:] = float("-inf")
    mask = mask.to(dtype)
    scale = HEAD_DIM**-0.5

    module = types.SimpleNamespace(num_key_value_groups=args.heads // args.kv_heads, training=False)

    def written_out(q, k, v, mask, scale):  # [B, 1, H, d] as transformers' callers take it; [B, H, 1, d] here
        return eager_attention_forward(module, q, k, v, mask, scale)[0].transpose(1, 2)

    def stack(fn):
        return lambda: [fn(q, k, v, mask, scale) for k, v in caches]

    variants = {
        "eager, packed": stack(packed_attention),
        "eager, repeat_kv": stack(repeated),
        "eager, enable_gqa": stack(grouped),
        "eager, written out": stack(written_out),
        "stock, repeat_kv": stack(torch.compile(repeated, dynamic=False)),
        "stock, enable_gqa": stack(torch.compile(grouped, dynamic=False)),
        "stock, written out": stack(torch.compile(written_out, dynamic=False)),
        "mla_inductor, repeat_kv": stack(torch.compile(repeated, backend="mla_inductor", dynamic=False)),
        "mla_inductor, enable_gqa": stack(torch.compile(grouped, backend="mla_inductor", dynamic=False)),
        "mla_inductor, written out": stack(torch.compile(written_out, backend="mla_inductor", dynamic=False)),
    }
    copy, copy_bytes = benchmarking.copy_probe()
    gemm, gemm_flops = benchmarking.gemm_probe(dtype)
    mla_inductor.reset_counts()
    with torch.no_grad():
        expected = variants["eager, packed"]()
        error = max(
            (a.float() - b.float()).abs().max().item()
            for name, fn in variants.items()
            for a, b in zip(fn(), expected)
        )
        fired = mla_inductor.fusion_counts()["gqa_decode"]
        t = benchmarking.interleaved_medians({**variants, "copy": copy, "gemm": gemm}, rounds=args.rounds, calls=2)
    bandwidth, throughput = copy_bytes / t["copy"], gemm_flops / t["gemm"]
    cache_bytes = 2 * args.layers * caches[0][0].numel() * caches[0][0].element_size()
    admitted_bytes = cache_bytes * admitted // args.context
    flops = 2 * args.layers * args.batch * args.heads * admitted * 2 * HEAD_DIM  # q.K and p.V
    roofline = max(admitted_bytes / bandwidth, flops / throughput)
    print(f"\n## B={args.batch}, {args.heads} query over {args.kv_heads} key/value heads of {HEAD_DIM}, {args.context} rows "
          f"({admitted} admitted by the mask), bf16, {args.layers} layers x {cache_bytes / args.layers / 2**20:.0f} MiB "
          f"of K and V; fired {fired}/3; max |variant - eager packed| {error:.3g}; in the rounds copy "
          f"{bandwidth / 1e9:.1f} GB/s and {isa.roof_gemm_name(dtype)} GEMM {throughput / 1e9:.0f} GFLOP/s; "
          f"roofline {roofline * 1e3:.1f} ms = max({admitted_bytes / bandwidth * 1e3:.1f} ms of K and V read, "
          f"{flops / throughput * 1e3:.1f} ms for {flops / 1e9:.2f} GFLOP); {benchmarking.machine_line()}")
    print("| variant | ms | x eager packed | % of roofline |")
    print("|---|---|---|---|")
    for name in variants:
        print(f"| {name} | {t[name] * 1e3:.1f} | {t['eager, packed'] / t[name]:.2f} | "
              f"{roofline / t[name]:.0%} |")


if __name__ == "__main__":
    main()
