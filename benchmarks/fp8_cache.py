"""Decode attention over an fp8 KV cache against the same step over a bf16 cache, B=1, 4096 rows.

An fp8 cache holds half the bytes, which is all a decode step over a long context must read; the
kernels widen it in registers, or convert it to bf16 for AMX tiles (docs/mla_decode.md). Two steps,
each over a stack of layers whose caches, in fp8, exceed twice this CPU's last-level cache (by
default; at least 8 and 16 layers):
- gqa: `mla::gqa_decode_attention` at the Llama-3-8B shape (32 query over 8 key/value heads of 128;
  16 MiB of bf16 K and V a layer at 4096 rows);
- latent: `mla::latent_decode_attention` at 22 heads (deepseek-v3-tp22; `--heads 16` is tp8),
  latent rows of 512 + 64, blocks of 16 (4.5 MiB of bf16 cache a layer), returning the latent output
  as SGLang's and vLLM's MLA decode kernels do. `--w-vc` adds the W_vc de-absorption: its 2.75 MiB a
  layer are read whatever the cache's format, so they count in the bytes read and cap what an fp8 cache
  can gain (1.45x at 4096 rows).
Each step is one compiled graph over all its layers, as a model's decode step is: compiled per layer,
every layer paid torch.compile's per-call overhead, about 0.1 ms on the AMX Xeon, the same in every
variant (the gqa step over e5m2 measured 1.39x that way, 1.44x as one graph; docs/mla_decode.md). Each
step is compiled by mla_inductor with a bf16 cache, an e4m3fn cache with one scale per token (SGLang's)
and an e5m2 cache without scales, timed in the same interleaved rounds as the copy bandwidth and the
GEMM throughput of the roofline: max(bytes read / copy bandwidth, FLOPs / the GEMM the kernel's products
run as: bf16 where it is native, except for an fp8 cache, which is multiplied in fp32 unless the kernels
convert it to bf16 (fp8_products_in_bf16). The bf16 cache's roofline over an fp8 cache's
is the most halving the bytes can gain here: 2 where both steps are bound by the read, less where the
products' side is the larger (the latent step's 47.9 kFLOP a row against a CPU's GEMM over its copy
bandwidth). Each step is also timed over a few layers whose caches the last-level cache holds, read
again: its cost with the memory out of the way. The bf16 step's time a layer from memory over that is
the "ceiling": the most an fp8 cache can gain on this CPU unless its arithmetic gets cheaper, however
well the kernel overlaps it with the read (for the bf16 row, what the bf16 step loses to the memory).
Prints medians; asserts nothing.

    python benchmarks/fp8_cache.py [--part gqa latent] [--context 4096] [--heads 22] [--w-vc]
"""

import argparse

import torch

from mla_inductor import benchmarking, isa
from mla_inductor.models import make_block_tables

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def quantized(x, dtype, scale_dims):
    """x in `dtype` and its fp32 scales (absmax over scale_dims / the format's largest value; e5m2 and
    bf16: none)."""
    if dtype != E4M3:
        return x.to(dtype), None
    scale = x.float().abs().amax(scale_dims, keepdim=True) / torch.finfo(dtype).max
    return (x.float() / scale).to(dtype), scale


def gqa_step(args, dtype, in_cache=False):
    heads, kv_heads, head_dim = 32, 8, 128
    fp8_layer_bytes = 2 * args.context * kv_heads * head_dim
    layers = (layers_in_the_cache(fp8_layer_bytes) if in_cache else
              args.gqa_layers or benchmarking.layers_past_the_cache(fp8_layer_bytes, 8, times=2))
    q = torch.randn(1, heads, 1, head_dim).bfloat16()
    layers_kv = []
    for _ in range(layers):
        # per token over its heads, as SGLang quantizes its [tokens, kv_heads, d] pool: scales [1, 1, T, 1]
        k, k_scale = quantized(torch.randn(1, args.context, kv_heads, head_dim), dtype, (-2, -1))
        v, v_scale = quantized(torch.randn(1, args.context, kv_heads, head_dim), dtype, (-2, -1))
        scales = [None if s is None else s.transpose(1, 2) for s in (k_scale, v_scale)]
        layers_kv.append((k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), *scales))
    def step(q, layers_kv):
        return [torch.ops.mla.gqa_decode_attention(q, k, v, k_scale=ks, v_scale=vs) for k, v, ks, vs in layers_kv]

    fn = torch.compile(benchmarking.fresh_function(step), backend="mla_inductor", dynamic=False)
    cache_bytes = sum(k.nbytes + v.nbytes for k, v, *_ in layers_kv)
    flops = layers * heads * args.context * 2 * 2 * head_dim
    return (lambda: fn(q, layers_kv)), cache_bytes, flops, layers, heads // kv_heads


def latent_step(args, dtype, in_cache=False):
    heads, lora, rope, v_head_dim, block_size = args.heads, 512, 64, 128, 16
    fp8_layer_bytes = args.context * (lora + rope)
    layers = (layers_in_the_cache(fp8_layer_bytes) if in_cache else
              args.latent_layers or benchmarking.layers_past_the_cache(fp8_layer_bytes, 16, times=2))
    block_tables, num_blocks = make_block_tables(1, args.context, block_size, seed=0)
    q = torch.randn(1, heads, lora + rope).bfloat16()
    caches = [quantized(torch.randn(num_blocks, block_size, lora + rope), dtype, (-1,)) for _ in range(layers)]
    w_vcs = [(torch.randn(heads, v_head_dim, lora) * lora**-0.5).bfloat16() if args.w_vc else None
             for _ in range(layers)]
    seq_lens = torch.tensor([args.context])
    def step(q, caches, w_vcs):
        return [torch.ops.mla.latent_decode_attention(q, c, block_tables, seq_lens, lora, 0.1, w_vc=w, kv_scale=s)
                for (c, s), w in zip(caches, w_vcs)]

    fn = torch.compile(benchmarking.fresh_function(step), backend="mla_inductor", dynamic=False)
    row_bytes = (lora + rope) * caches[0][0].element_size()
    bytes_read = layers * args.context * row_bytes
    flops = layers * heads * args.context * 2 * (lora + rope + lora)
    if args.w_vc:
        bytes_read += sum(w.nbytes for w in w_vcs)
        flops += layers * heads * 2 * v_head_dim * lora
    return (lambda: fn(q, caches, w_vcs)), bytes_read, flops, layers, heads


def layers_in_the_cache(fp8_layer_bytes):
    """Layers whose fp8 caches fill at most a quarter of the last-level cache, one to eight, for the step
    timed with its caches read again from there: what its kernels' per-row work costs with the memory out
    of the way (a time a layer, so eight where they fit: one layer pays all of torch.compile's per-call
    work, about 0.1 ms)."""
    return max(1, min(8, benchmarking.last_level_cache_bytes() // (4 * fp8_layer_bytes)))


def fp8_products_in_bf16(heads_per_row):
    """Whether the kernels multiply an fp8 cache's rows in bf16 here (latent_attention.h): on AMX tiles from
    16 heads a row; on AVX512-BF16 CPUs without AMX converted for the dpbf16 tiles, from 5 heads a row
    (converts_fp8_to_bf16) and, with VBMI, below (reads_fp8_as_bf16). Elsewhere the FMA tiles widen them."""
    if isa.host_isa() == "amx":
        return heads_per_row >= 16
    if isa.host_isa() == "avx512_bf16":
        return heads_per_row > 4 or "avx512vbmi" in isa.cpu_flags()
    return False


def bench(name, make_step, args):
    dtypes = {"bf16": torch.bfloat16, "e4m3, per-token scales": E4M3, "e5m2": E5M2}
    steps = {label: make_step(args, dtype) for label, dtype in dtypes.items()}
    in_cache = {label: make_step(args, dtype, in_cache=True) for label, dtype in dtypes.items()}
    layers, heads_per_row = steps["bf16"][3:]
    cached_layers = in_cache["bf16"][3]
    copy, copy_bytes = benchmarking.copy_probe()
    gemm_bf16, gemm_bf16_flops = benchmarking.gemm_probe(torch.bfloat16)
    gemm_fp32, gemm_fp32_flops = benchmarking.gemm_probe(torch.float32)
    fns = {label: step for label, (step, *_) in steps.items()}
    fns.update({f"{label}, in cache": step for label, (step, *_) in in_cache.items()})
    with torch.no_grad():
        for fn in fns.values():
            fn()  # compile
        t = benchmarking.interleaved_medians(
            {**fns, "copy": copy, "gemm bf16": gemm_bf16, "gemm fp32": gemm_fp32}, rounds=args.rounds, calls=3)
    bandwidth = copy_bytes / t["copy"]
    roof = {"bf16": gemm_bf16_flops / t["gemm bf16"], "fp32": gemm_fp32_flops / t["gemm fp32"]}
    fp8_roof = "bf16" if fp8_products_in_bf16(heads_per_row) else "fp32"
    print(f"\n## {name}, {layers} layers, context {args.context}, B=1; in the rounds copy {bandwidth / 1e9:.1f} GB/s, "
          f"GEMM {isa.roof_gemm_name(torch.bfloat16)} {roof['bf16'] / 1e9:.0f} GFLOP/s (bf16 cache's roof), "
          f"float32 {roof['fp32'] / 1e9:.0f} GFLOP/s; fp8 caches' roof: {fp8_roof}; {benchmarking.machine_line()}")
    print(f"(x bf16 at the roofline: the bf16 cache's roofline over this one's, the most halving the bytes can "
          f"gain on this CPU: below 2 where the products' side of the roofline is the larger; in cache: the step "
          f"over {cached_layers} layers, its caches read again from the last-level cache; ceiling: the bf16 "
          f"step's time a layer over that, the most the fp8 step's arithmetic allows)")
    print("| cache | MiB read | ms | x bf16 cache | roofline ms | % of roofline | x bf16 at the roofline | "
          "ms a layer in cache | ceiling |")
    print("|---|---|---|---|---|---|---|---|---|")
    rooflines = {label: max(bytes_read / bandwidth, flops / (roof["bf16"] if label == "bf16" else roof[fp8_roof]))
                 for label, (_, bytes_read, flops, *_) in steps.items()}
    bf16_per_layer = t["bf16"] / layers
    for label, (_, bytes_read, *_) in steps.items():
        roofline = rooflines[label]
        cached = t[f"{label}, in cache"] / cached_layers
        print(f"| {label} | {bytes_read / 2**20:.0f} | {t[label] * 1e3:.2f} | {t['bf16'] / t[label]:.2f} | "
              f"{roofline * 1e3:.2f} | {roofline / t[label]:.0%} | {rooflines['bf16'] / roofline:.2f} | "
              f"{cached * 1e3:.3f} | {bf16_per_layer / cached:.2f} |", flush=True)
    torch._dynamo.reset()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", nargs="+", default=["gqa", "latent"], choices=["gqa", "latent"])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--gqa-layers", type=int, help="16 MiB of bf16 K and V each at 4096 rows (default: past the L3)")
    p.add_argument("--latent-layers", type=int, help="4.5 MiB of bf16 cache each at 4096 rows (default: past the L3)")
    p.add_argument("--heads", type=int, default=22, help="the latent step's query heads (128 over a TP rank)")
    p.add_argument("--w-vc", action="store_true", help="the latent step de-absorbs its output with W_vc")
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    benchmarking.fresh_compiles()
    if "gqa" in args.part:
        bench("gqa: 32 query over 8 key/value heads of 128", gqa_step, args)
    if "latent" in args.part:
        w_vc = ", W_vc" if args.w_vc else ""
        bench(f"latent: {args.heads} heads, rows of 512 + 64, blocks of 16{w_vc}", latent_step, args)


if __name__ == "__main__":
    main()
