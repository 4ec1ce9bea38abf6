"""DeepSeek-V2-Lite as released, at depth: transformers' DeepseekV2ForCausalLM with its MoE (64 routed experts
of 1408, 2 shared, top-6; the first layer dense), its 102400-token vocabulary, random bf16 weights, a
StaticCache, one decode step at batch 1 (and --batch more): the tokens per second a user compares with
other CPU engines, against stock torch.compile and the memory's roofline.

The released model has 27 layers, 31 GB of bf16 weights: more than this machine's 24 GiB. By default
this builds the first 12 (13.6 GB), stated in the output; `--layers` takes another depth. Both compiles
are unfrozen: freezing would fold or pack a second copy of the experts, which does not fit either.
The roofline is the bytes one step reads (every weight but the embedding and the unselected routed
experts, plus the cache rows) at the copy bandwidth timed in the same interleaved rounds. Asserts nothing.

    python benchmarks/v2_lite_depth.py [--layers 12] [--batch 1] [--context 1024] [--rounds 5]
"""

import argparse

import torch
import transformers

from mla_inductor import benchmarking, record
from mla_inductor.models import get_config, weight_bytes
from mla_inductor.models.hf import hf_config
from mla_inductor.models.mla import init_weights_
from mla_inductor.report import Case, fill_static_cache, selected_expert_bytes


def build(layers: int) -> torch.nn.Module:
    """The model built in bf16 from the start: built in fp32 and converted, 12 layers would need 27 GB."""
    config = get_config("deepseek-v2-lite", num_layers=layers)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = transformers.DeepseekV2ForCausalLM(hf_config(config, "v2", moe=True))
    finally:
        torch.set_default_dtype(previous)
    return init_weights_(model, seed=0).eval()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    benchmarking.fresh_compiles()

    model = build(args.layers)
    case = Case("hf", "decode", args.batch, args.context)
    step, reset, kv_bytes, ids = fill_static_cache(model, case, torch.Generator().manual_seed(0))
    experts = [name for name, m in model.named_modules() if hasattr(m, "gate_up_proj")]
    reset()
    nbytes = weight_bytes(model, exclude=("model.embed_tokens", *experts))
    nbytes += selected_expert_bytes(model, lambda: step(ids)) + kv_bytes
    print(f"{benchmarking.machine_line()}; DeepSeek-V2-Lite, {args.layers} of its 27 layers, bf16, vocabulary "
          f"102400, StaticCache {args.context} rows, batch {args.batch}; a step reads {nbytes / 1e9:.2f} GB")

    fns = {}
    for name, compiled in (("stock", torch.compile(step, dynamic=False)),
                           ("mla_inductor", torch.compile(step, backend="mla_inductor", dynamic=False))):
        record.reset_counts()
        with torch.no_grad():
            reset()
            compiled(ids)
        print(f"{name}: fusions {({k: v for k, v in record.fusion_counts().items() if v})}", flush=True)
        fns[name] = lambda compiled=compiled: (reset(), compiled(ids))
    fns["copy"], copy_bytes = benchmarking.copy_probe()
    with torch.no_grad():
        t = benchmarking.interleaved_medians(fns, rounds=args.rounds, calls=3)
    bandwidth = copy_bytes / t.pop("copy")
    roofline = nbytes / bandwidth
    print(f"copy bandwidth in the rounds {bandwidth / 1e9:.1f} GB/s; roofline {roofline * 1e3:.1f} ms "
          f"({args.batch / roofline:.1f} tokens/s)")
    print("| variant | ms a step | tokens/s | % of the roofline |")
    print("|---|---|---|---|")
    for name, seconds in t.items():
        print(f"| {name} | {seconds * 1e3:.1f} | {args.batch / seconds:.1f} | {roofline / seconds:.0%} |")


if __name__ == "__main__":
    main()
