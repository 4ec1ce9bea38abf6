"""MLA prefill attention (q/k heads of 192, v heads of 128: SDPA's math path) against mla::prefill_attention.

Three tables, each measured in one process, interleaved, medians:
- attention: the attention alone as transformers calls it (`F.scaled_dot_product_attention` with its
  materialised bool causal mask), DeepSeek-V2-Lite's 16 heads, at each --tokens: eager, stock
  torch.compile and mla_inductor, in GFLOP/s on the FLOPs causal attention needs (half the square) and
  as a fraction of oneDNN's best GEMM rate timed in the same rounds;
- gqa: the same for Llama-3-8B's heads (32 over 8 key/value heads of 128, repeated by transformers'
  repeat_kv), where stock runs ATen's flash attention (gqa_prefill);
- memory: the peak resident memory a compiled prefill of one V2-Lite layer adds above its weights and
  inputs at the largest --tokens, stock and ours (each in a process of its own);
- model: transformers' DeepseekV2 at V2-Lite's shape with its MoE (the first layer dense, then MoE
  layers: --layers in all), prefill of --model-tokens, time to first token of every variant.
Asserts nothing.

    python benchmarks/mla_prefill.py [--part attention memory model] [--tokens 2048 8192] [--model-tokens 2048 4096]
"""

import argparse
import concurrent.futures
import multiprocessing

import torch
import torch.nn.functional as F

from mla_inductor import benchmarking, record
from mla_inductor.models.hf import build_hf_model
from mla_inductor.patterns.gqa_decode import repeat_kv  # as transformers spells it

HEADS, QK_HEAD_DIM, V_HEAD_DIM = 16, 192, 128  # DeepSeek-V2-Lite
# (heads, key/value heads, q/k head size, v head size) of each attention table
SHAPES = {"attention": (HEADS, HEADS, QK_HEAD_DIM, V_HEAD_DIM), "gqa": (32, 8, 128, 128)}


def attention(q, k, v, mask):
    n_rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), attn_mask=mask,
                                          scale=q.shape[-1] ** -0.5)


def attention_table(tokens_list: list[int], rounds: int, shape: tuple[int, int, int, int]) -> None:
    heads, kv_heads, d, dv = shape
    print(f"{heads} query heads over {kv_heads} key/value heads, q/k {d} wide, v {dv}")
    gemm, gemm_flops = benchmarking.gemm_probe()
    print("| tokens | eager ms | stock ms | mla ms | x stock | mla GFLOP/s | mla % of GEMM | stock % of GEMM "
          "| oneDNN GEMM GFLOP/s | fired |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for tokens in tokens_list:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, heads, tokens, d, generator=g).bfloat16()
        k = torch.randn(1, kv_heads, tokens, d, generator=g).bfloat16()
        v = torch.randn(1, tokens, kv_heads, dv, generator=g).bfloat16().transpose(1, 2)
        mask = torch.ones(tokens, tokens, dtype=torch.bool).tril()[None, None]
        record.reset_counts()
        torch._dynamo.reset()
        stock = torch.compile(attention)
        ours = torch.compile(attention, backend="mla_inductor")
        with torch.no_grad():
            stock(q, k, v, mask)
            ours(q, k, v, mask)
            counts = record.fusion_counts()
            fired = counts["mla_prefill"] + counts["gqa_prefill"]
            fns = {"eager": lambda: attention(q, k, v, mask), "stock": lambda: stock(q, k, v, mask),
                   "mla": lambda: ours(q, k, v, mask), "gemm": gemm}
            t = benchmarking.interleaved_medians(fns, rounds=rounds, calls=1, budget_s=300)
        rate = gemm_flops / t["gemm"]
        flops = heads * tokens * tokens * (d + dv)  # causal: half of the scores and of P.V, x2
        print(f"| {tokens} | {t['eager'] * 1e3:.0f} | {t['stock'] * 1e3:.0f} | {t['mla'] * 1e3:.1f} "
              f"| {t['stock'] / t['mla']:.2f} | {flops / t['mla'] / 1e9:.0f} | {flops / t['mla'] / rate:.0%} "
              f"| {flops / t['stock'] / rate:.0%} | {rate / 1e9:.0f} | {fired} |", flush=True)


def _resident_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _layer_peak(backend: str, tokens: int) -> int:
    """Bytes the peak resident memory of a compiled prefill of one V2-Lite layer (dense MLP) rises above
    the weights, the inputs and a first (compiling) call."""
    model = build_hf_model("deepseek-v2-lite", num_hidden_layers=1, vocab_size=1024)
    ids = torch.randint(0, 1024, (1, tokens), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        compiled(input_ids=ids, use_cache=False)
        base = _resident_bytes("VmRSS")
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # the peak (VmHWM) restarts from the present
        compiled(input_ids=ids, use_cache=False)
    return _resident_bytes("VmHWM") - base


def memory_table(tokens: int) -> None:
    context = multiprocessing.get_context("spawn")
    print(f"| {tokens} tokens, one V2-Lite layer | peak above weights and inputs, GiB |")
    print("|---|---|")
    for backend in ("inductor", "mla_inductor"):
        with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
            peak = pool.submit(_layer_peak, backend, tokens).result()
        print(f"| {'stock' if backend == 'inductor' else 'mla'} | {peak / 2**30:.2f} |", flush=True)


def model_table(tokens_list: list[int], layers: int, rounds: int) -> None:
    model = build_hf_model("deepseek-v2-lite", moe=True, num_hidden_layers=layers, vocab_size=8192)
    print(f"transformers DeepseekV2, V2-Lite's shape with its MoE, {layers} layers (first dense), vocabulary 8192")
    print("| tokens | " + " | ".join(f"{v} s" for v in benchmarking.VARIANTS) + " | x stock best | fired |")
    print("|---|" + "---|" * (len(benchmarking.VARIANTS) + 2))
    for tokens in tokens_list:
        ids = torch.randint(0, 8192, (1, tokens), generator=torch.Generator().manual_seed(0))
        record.reset_counts()
        torch._dynamo.reset()
        fns = benchmarking.compiled_variants(_Prefill(model), (ids,))
        counts = record.fusion_counts()
        with torch.no_grad():
            t = benchmarking.interleaved_medians(fns, rounds=rounds, calls=1, budget_s=600)
        stock, ours = min(t["stock"], t["stock frozen"]), min(t["mla"], t["mla frozen"])
        fired = ", ".join(f"{name} {n}" for name, n in counts.items() if n)
        print(f"| {tokens} | " + " | ".join(f"{t[v]:.2f}" for v in benchmarking.VARIANTS)
              + f" | {stock / ours:.2f} | {fired} |", flush=True)


class _Prefill(torch.nn.Module):
    """The model's prefill logits (no cache) as a module of one input, for compiled_variants."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", nargs="+", choices=("attention", "gqa", "memory", "model"),
                   default=["attention", "gqa", "memory", "model"])
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--model-tokens", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    benchmarking.fresh_compiles()
    print(benchmarking.machine_line())
    for part in ("attention", "gqa"):
        if part in args.part:
            attention_table(args.tokens, args.rounds, SHAPES[part])
    if "memory" in args.part:
        memory_table(max(args.tokens))
    if "model" in args.part:
        model_table(args.model_tokens, args.layers, args.rounds)


if __name__ == "__main__":
    main()
