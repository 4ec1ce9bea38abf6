"""mla_decode: absorbed latent decode attention, the kernel and a transformers decode step.

1. The serving-style graph (paged gather, masked softmax, W_vc bmm; patterns/mla_decode.py) at B=4,
   22 heads (deepseek-v3-tp22), context 4096, bf16, in a stack of layers whose caches exceed the L3:
   stock torch.compile against mla_inductor on the same graph, and the fraction of the roofline, the
   larger of (cache bytes / copy bandwidth) and (QK + PV FLOPs / the best oneDNN GEMM throughput of this
   CPU: bf16 where it is native, else fp32), both timed as variants in the same interleaved rounds.
2. transformers DeepseekV3 at a deepseek-v2-lite-like size (hidden 2048, 16 heads, q LoRA 1536),
   2 layers, StaticCache of 4096 rows with 1024 filled, bf16, B=1: one decode step, eager, stock
   compile (plain and frozen) and mla_inductor (plain and frozen).

Prints medians of interleaved rounds; asserts nothing.

    python benchmarks/mla_decode.py [--part kernel hf] [--layers 4] [--context 4096] [--block-size 16]
"""

import argparse

import torch
import transformers

import mla_inductor
from mla_inductor import benchmarking, isa
from mla_inductor.models import get_config, make_block_tables
from mla_inductor.models.hf import build_hf_model
from mla_inductor.patterns.mla_decode import paged_absorbed_decode


def bench_kernel(args):
    batch, heads, lora, rope, v_head_dim = 4, 22, 512, 64, 128
    dtype = torch.bfloat16
    block_tables, num_blocks = make_block_tables(batch, args.context, args.block_size, seed=0)
    caches = [torch.randn(num_blocks, args.block_size, lora + rope).to(dtype) for _ in range(args.layers)]
    q = torch.randn(batch, heads, lora + rope).to(dtype)
    # Every layer has its own W_vc, as in a model: one shared across layers could stay in the L3.
    w_vcs = [(torch.randn(heads, v_head_dim, lora) * lora**-0.5).to(dtype) for _ in range(args.layers)]
    seq_lens = torch.full((batch,), args.context)
    scale = (128 + 64) ** -0.5

    def step(q, caches, block_tables, seq_lens, w_vcs):
        return [paged_absorbed_decode(q, c, block_tables, seq_lens, w, scale) for c, w in zip(caches, w_vcs)]

    variants = {
        "stock": torch.compile(step, dynamic=False),
        "mla": torch.compile(step, backend="mla_inductor", dynamic=False),
    }
    mla_inductor.reset_counts()
    # The roofline's two denominators are timed as two more variants in the same interleaved rounds:
    # this machine's copy bandwidth and GEMM throughput move by 20-50% from minute to minute.
    copy, copy_bytes = benchmarking.copy_probe()
    gemm, gemm_flops = benchmarking.gemm_probe(dtype)
    gemm_dtype = isa.roof_gemm_name(dtype)
    with torch.no_grad():
        outs = {name: fn(q, caches, block_tables, seq_lens, w_vcs) for name, fn in variants.items()}
        fired = mla_inductor.fusion_counts()["mla_decode"]
        error = max((a.float() - b.float()).abs().max().item() for a, b in zip(outs["mla"], outs["stock"]))
        fns = {name: (lambda fn=fn: fn(q, caches, block_tables, seq_lens, w_vcs)) for name, fn in variants.items()}
        t = benchmarking.interleaved_medians({**fns, "copy": copy, "gemm": gemm}, rounds=args.rounds, calls=3)
    bandwidth, throughput = copy_bytes / t["copy"], gemm_flops / t["gemm"]
    per_layer = {name: t[name] / args.layers for name in variants}
    cache_bytes = batch * args.context * (lora + rope) * caches[0].element_size()
    flops = 2 * batch * heads * args.context * (lora + rope + lora)
    roofline = max(cache_bytes / bandwidth, flops / throughput)
    print(f"\n## kernel: B={batch}, {heads} heads, context {args.context}, block size {args.block_size}, bf16, "
          f"{args.layers} layers x {cache_bytes / 2**20:.1f} MiB of cache; fired {fired}/{args.layers}; "
          f"max |mla - stock| {error:.3g}")
    print(f"in the rounds: copy {bandwidth / 1e9:.1f} GB/s, oneDNN {gemm_dtype} GEMM {throughput / 1e9:.0f} GFLOP/s; "
          f"roofline per layer {roofline * 1e3:.2f} ms = max({cache_bytes / bandwidth * 1e3:.2f} ms cache read, "
          f"{flops / throughput * 1e3:.2f} ms for {flops / 1e9:.2f} GFLOP)")
    # "x stock at the roofline": the most any kernel could gain over stock in these rounds.
    print("| stock ms | mla ms | x stock | x stock at the roofline | % of roofline | GFLOP/s |")
    print("|---|---|---|---|---|---|")
    print(f"| {per_layer['stock'] * 1e3:.2f} | {per_layer['mla'] * 1e3:.2f} | "
          f"{per_layer['stock'] / per_layer['mla']:.1f} | {per_layer['stock'] / roofline:.1f} | "
          f"{roofline / per_layer['mla']:.0%} | {flops / per_layer['mla'] / 1e9:.0f} |", flush=True)
    torch._dynamo.reset()


def bench_hf(args):
    config = get_config("deepseek-v2-lite", num_layers=2, q_lora_rank=1536, vocab_size=8192, intermediate_size=5632)
    model = build_hf_model(config, arch="v3", dtype=torch.bfloat16)
    filled, max_len = 1024, args.context
    prompt = torch.randint(0, config.vocab_size, (1, filled), generator=torch.Generator().manual_seed(0))
    token = torch.tensor([[7]])
    position = torch.tensor([[filled]])

    def new_cache():
        cache = transformers.StaticCache(config=model.config, max_cache_len=max_len)
        with torch.no_grad():
            model(input_ids=prompt, past_key_values=cache, use_cache=True)
        return cache

    def step(token, cache, position):
        return model(input_ids=token, past_key_values=cache, position_ids=position, use_cache=True).logits

    frozen = benchmarking.frozen_options(torch.bfloat16)
    variants = {
        "eager": (step, False),
        "stock": (torch.compile(step), False),
        "stock frozen": (torch.compile(step, options=frozen), True),
        "mla": (torch.compile(step, backend="mla_inductor"), False),
        "mla frozen": (torch.compile(step, backend="mla_inductor", options=frozen), True),
    }
    caches = {name: new_cache() for name in variants}

    def call(name):
        for layer in caches[name].layers:  # every call decodes the same position
            layer.cumulative_length.fill_(filled)
        return variants[name][0](token, caches[name], position)

    mla_inductor.reset_counts()
    with torch.no_grad():
        logits = {}
        for name, (_, freeze) in variants.items():
            with benchmarking.inference_freezing(frozen["cpp.enable_concat_linear"]) if freeze else torch.no_grad():
                logits[name] = call(name)
        fired = mla_inductor.fusion_counts()["mla_decode"]
        t = benchmarking.interleaved_medians({name: (lambda name=name: call(name)) for name in variants},
                                             rounds=args.rounds, calls=3)
    best_stock = min(t["stock"], t["stock frozen"])
    best_mla = min(t["mla"], t["mla frozen"])
    same = bool((logits["mla"].argmax(-1) == logits["eager"].argmax(-1)).all())
    print(f"\n## transformers DeepseekV3, hidden 2048, 16 heads, 2 layers, StaticCache {max_len} with {filled} "
          f"filled, bf16, B=1: fired {fired} (layers x compiles); next token as eager: {same}")
    print("| eager ms | stock ms | stock frozen ms | mla ms | mla frozen ms | x stock best |")
    print("|---|---|---|---|---|---|")
    print("| " + " | ".join(f"{t[k] * 1e3:.1f}" for k in variants) + f" | {best_stock / best_mla:.1f} |", flush=True)
    torch._dynamo.reset()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", nargs="+", default=["kernel", "hf"], choices=["kernel", "hf"])
    p.add_argument("--layers", type=int, default=4, help="4 x 18 MiB of cache at context 4096")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    benchmarking.fresh_compiles()
    print(benchmarking.machine_line())
    if "kernel" in args.part:
        bench_kernel(args)
    if "hf" in args.part:
        bench_hf(args)


if __name__ == "__main__":
    main()
