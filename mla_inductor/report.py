"""The speedup report: `python -m mla_inductor.report` (or `make report`).

For each case (model x phase x batch x context) it builds the model once, compiles it under each
variant, and times all variants in one process, interleaved:

- eager;
- stock: `torch.compile` with default options;
- stock-frozen: stock with `freezing=True` and `cpp.enable_concat_linear=True` (Inductor's own
  q_a/kv_a concat; without it for bf16 where oneDNN has no native bf16: `benchmarking.frozen_options`);
  "stock at its best" is the faster of stock and stock-frozen, measured;
- mla_inductor: `backend="mla_inductor"` with the same freezing options, so that the ratio to
  stock-frozen isolates this project's passes.

Models: the serving-style DeepSeek (models/mla.py); transformers DeepSeek as released ("hf": DeepseekV2 at
V2-Lite's shape with its MoE, 64 routed experts of 1408, 2 shared, top-6, the first layer dense, three
MoE layers after it) and with dense MLPs ("hf-dense", DeepseekV3); transformers Llama. A decode step's
bytes count the routed experts its tokens select, not the others.
Every case reports the fraction of its roofline: the larger of (weights + the KV cache read) over the
copy bandwidth and FLOPs over the best oneDNN GEMM throughput this CPU has for the dtype (bf16 where
oneDNN has it natively, else fp32: `isa.roof_gemm_dtype`), both measured in this run. Decode is mostly
memory-bound; at batch 8 over a long cache the 22-head latent attention can make the FLOPs the bound.
`--quant int8` quantizes the transformers models' Linears with torchao's `Int8WeightOnlyConfig`
(per-channel int8 weights) before every variant: stock then runs Inductor's `_weight_int8pack_mm`,
ours fuses what it fuses in bf16 over the int8 weights (patterns/quantized_linear.py).
`--quant w8a8` quantizes Linears (but the LM head) to int8 with activations quantized per token:
torchao's `Int8DynamicActivationInt8WeightConfig` for the transformers models, SGLang's W8A8 spelled
in PyTorch for the serving model (quantization.W8A8Linear); stock runs `_int_mm` between a quantize
and a dequantize kernel, ours quantizes x inside the fused projections.
`--quant fp8` gives the DeepSeek models' Linears (but the LM head) DeepSeek-V3's fp8 format, 128 x 128
blocks dequantized in the forward (quantization.BlockFp8Linear): stock-frozen folds them into bf16
constants, ours reads the fused projections' fp8 weights in their kernels.

Results go to stdout and to reports/<name>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import pathlib
import sys
from typing import Callable, Optional

import torch

from . import benchmarking, isa
from .record import fusion_counts, reset_counts
from .models import build_model, get_config, make_block_tables, weight_bytes
from .models.configs import MLAConfig
from .quantization import BlockFp8Linear, quantize_fp8_

VARIANTS = ("eager", "stock", "stock-frozen", "mla_inductor")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MIN_DECODE_WEIGHT_BYTES = 160 << 20  # comfortably beyond 128 MiB, four times the 32 MiB L3
BLOCK_SIZE = 16
DEEPSEEK_MODELS = ("serving", "hf", "hf-dense")
MOE_LAYERS = 3  # MoE layers of the "hf" model (V2-Lite's layout) after its dense first layer
# Seconds of timing per case, past which a case takes fewer calls per round (and three rounds): a bf16
# prefill case runs seconds per call where oneDNN has no native bf16.
TIMING_BUDGET_S = 120.0


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """A Llama-3-8B-shaped transformers LlamaForCausalLM (GQA: 32 query heads, 8 key/value heads of 128)
    for the gqa_qkv fusion; each layer holds 436 MiB of bf16 weights, MLP included. `family` "qwen3"
    makes it a Qwen3ForCausalLM (a norm per q and k head); "llama2" is Llama-2-7B's multi-head shape."""

    name: str = "llama-3-8b"
    family: str = "llama"
    hidden_size: int = 4096
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 14336
    num_layers: int = 2
    vocab_size: int = 8192


TINY_LLAMA = LlamaShape(name="tiny-llama", hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                        intermediate_size=512, vocab_size=512)
QWEN3 = LlamaShape(name="qwen3-8b", family="qwen3", intermediate_size=12288)  # Qwen3-8B's attention shape
# Llama-2-7B: multi-head attention (gqa_decode's groups of one), 32 heads over 32 key/value heads
LLAMA2 = LlamaShape(name="llama-2-7b", family="llama2", num_kv_heads=32, intermediate_size=11008)


@dataclasses.dataclass(frozen=True)
class Case:
    model: str  # "serving", "hf" (transformers DeepseekV2, MoE), "hf-dense" (DeepseekV3, dense MLPs), "llama",
    # "llama2" or "qwen3" (transformers')
    phase: str  # "decode" or "prefill"
    batch: int
    context: int  # decode: cached tokens incl. the new one; prefill: prompt tokens
    quant: str = "none"  # "int8": the Linears' weights quantized by torchao (hf and llama)

    @property
    def label(self) -> str:
        what = f"ctx {self.context}" if self.phase == "decode" else f"{self.context} tok"
        quant = "" if self.quant == "none" else f" {self.quant}"
        return f"{self.model}{quant} {self.phase} B={self.batch} {what}"


@dataclasses.dataclass
class Workload:
    """A model with inputs for one case: `run()` is one call; `reset()` restores mutated state."""

    module: torch.nn.Module
    fn: Callable  # fn(*args) -> logits; the thing compiled
    args: tuple
    reset: Callable[[], None]
    weight_bytes: int
    kv_bytes: int
    flops: float


def _layers_for(weights_per_layer: int) -> int:
    """Enough layers for decode to stream its weights from memory: past MIN_DECODE_WEIGHT_BYTES, and past
    this CPU's last-level cache (the AMX Xeon's 300 MiB held the 160 MiB stacks)."""
    at_least = max(2, math.ceil(MIN_DECODE_WEIGHT_BYTES / weights_per_layer))
    return benchmarking.layers_past_the_cache(weights_per_layer, at_least)


def _attention_flops(config: MLAConfig, batch: int, new_tokens: int, context: int, absorbed: bool) -> float:
    h = config.num_heads
    if absorbed:  # q·K over latent rows (L + R) and P·V over L, per head
        return 2.0 * batch * new_tokens * h * context * (config.latent_dim + config.kv_lora_rank)
    return 2.0 * batch * new_tokens * h * context * (config.qk_head_dim + config.v_head_dim)


def _matmul_weight_elements(module: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, (torch.nn.Linear, BlockFp8Linear)))


def serving_workload(config: MLAConfig, case: Case, dtype: torch.dtype, seed: int = 0) -> Workload:
    model = build_model(config, dtype=dtype, seed=seed, quant=SERVING_QUANT[case.quant])
    gen = torch.Generator().manual_seed(seed)
    b, ctx = case.batch, case.context
    block_tables, num_blocks = make_block_tables(b, ctx, BLOCK_SIZE, seed=seed)
    caches = model.allocate_kv_cache(num_blocks, BLOCK_SIZE)
    for cache in caches:  # written memory, with the scale of normed latents
        cache.normal_(generator=gen)
    seq_lens = torch.full((b,), ctx, dtype=torch.int64)
    kv_bytes = sum(b * ctx * c.shape[-1] * c.element_size() for c in caches)
    linear = _matmul_weight_elements(model)
    if case.phase == "decode":
        ids = torch.randint(0, config.vocab_size, (b,), generator=gen)
        flops = 2.0 * b * linear + config.num_layers * _attention_flops(config, b, 1, ctx, absorbed=True)
        fn, args = model.forward_decode, (ids, caches, block_tables, seq_lens)
    else:
        ids = torch.randint(0, config.vocab_size, (b, ctx), generator=gen)
        # kv_b_proj decompresses all ctx rows; causal attention does half the square
        flops = 2.0 * b * ctx * linear + config.num_layers * _attention_flops(config, b, ctx, ctx, False) / 2
        fn, args = model.forward_prefill, (ids, caches, block_tables, seq_lens)
    return Workload(model, fn, args, lambda: None, weight_bytes(model), kv_bytes, flops)


def routed_experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE layers' experts modules (transformers' stacked gate_up_proj / down_proj)."""
    return [m for m in model.modules() if isinstance(getattr(m, "gate_up_proj", None), torch.nn.Parameter)]


def selected_expert_bytes(model: torch.nn.Module, step: Callable[[], object]) -> int:
    """The bytes of the routed experts one call of `step` selects: each MoE layer's experts chosen by any
    of its tokens, read once (what the fused experts read; stock's grouped_mm reads the same bytes of
    them, and loops over the others without reading them)."""
    chosen = []
    hooks = [experts.register_forward_hook(lambda module, args, out: chosen.append((module, args[1])))
             for experts in routed_experts(model)]
    try:
        with torch.no_grad():
            step()
    finally:
        for hook in hooks:
            hook.remove()
    total = 0
    for experts, top_k_index in chosen:
        per_expert = sum(p[0].numel() * p.element_size() for p in (experts.gate_up_proj, experts.down_proj))
        total += int(top_k_index.unique().numel()) * per_expert
    return total


def hf_workload(config: MLAConfig, case: Case, dtype: torch.dtype, seed: int = 0) -> Workload:
    """transformers' DeepSeek: "hf" with the config's released MoE layout (V2-Lite's: DeepseekV2, 64
    routed experts of 1408, 2 shared, top-6, the first layer dense; `--hf-config deepseek-v3-tp16`: a
    DeepseekV3 rank's share, 256 experts, top-8 in 4 of 8 groups), "hf-dense" the DeepseekV3 model
    with a dense MLP in every layer. Decode's bytes count the routed experts its tokens select."""
    from .models.hf import build_hf_model  # needs transformers, which only the hf cases do

    moe = case.model == "hf"
    # the MoE model is the config's own family (V2 for V2-Lite, V3's grouped routing otherwise)
    model = build_hf_model(config, arch=None if moe else "v3", dtype=dtype, seed=seed, moe=moe)
    model = quantized(model, case.quant)
    gen = torch.Generator().manual_seed(seed)
    b, ctx = case.batch, case.context
    experts = routed_experts(model)
    expert_elements = sum(e.gate_up_proj[0].numel() + e.down_proj[0].numel() for e in experts)
    top_k = config.num_experts_per_tok
    linear = _matmul_weight_elements(model)
    wbytes = weight_bytes(model, exclude=("model.embed_tokens",) + tuple(
        name for name, m in model.named_modules() if m in experts))
    if case.phase == "prefill":
        ids = torch.randint(0, config.vocab_size, (b, ctx), generator=gen)
        flops = 2.0 * b * ctx * (linear + top_k * expert_elements)
        flops += config.num_layers * _attention_flops(config, b, ctx, ctx, False) / 2

        def prefill(input_ids):
            return model(input_ids=input_ids, use_cache=False).logits

        wbytes += selected_expert_bytes(model, lambda: prefill(ids))
        return Workload(model, prefill, (ids,), lambda: None, wbytes, 0, flops)

    decode, reset, kv_bytes, ids = fill_static_cache(model, case, gen)
    reset()
    wbytes += selected_expert_bytes(model, lambda: decode(ids))
    flops = 2.0 * b * (linear + top_k * expert_elements)
    flops += config.num_layers * _attention_flops(config, b, 1, ctx, absorbed=True)
    return Workload(model, decode, (ids,), reset, wbytes, kv_bytes, flops)


# --quant of the serving model: its build_model form (None: it has none)
SERVING_QUANT = {"none": None, "int8": None, "w8a8": "w8a8", "fp8": "fp8"}


def quantized(model: torch.nn.Module, quant: str) -> torch.nn.Module:
    """The model with its Linears' weights quantized as `quant` says ("none": as it is)."""
    # torchao: set_inductor_config=False, the same Inductor options for every variant, as the report sets them
    if quant == "int8":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(model, Int8WeightOnlyConfig(set_inductor_config=False))
    elif quant == "w8a8":  # the LM head stays in the model's dtype, as in SGLang's W8A8 models
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

        quantize_(model, Int8DynamicActivationInt8WeightConfig(set_inductor_config=False),
                  filter_fn=lambda module, name: isinstance(module, torch.nn.Linear) and name != "lm_head")
    elif quant == "fp8":
        quantize_fp8_(model)
    return model


def fill_static_cache(model, case: Case, gen) -> tuple[Callable, Callable[[], None], int, torch.Tensor]:
    """A StaticCache of case.context rows holding noise: the decode step over it, its reset, its bytes
    and the step's input ids."""
    from transformers import StaticCache

    b, ctx = case.batch, case.context
    cache = StaticCache(config=model.config, max_cache_len=ctx)
    ids = torch.randint(0, model.config.vocab_size, (b, 1), generator=gen)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)  # allocates the layers' buffers
    for layer in cache.layers:
        layer.keys.normal_(generator=gen)
        layer.values.normal_(generator=gen)

    def reset() -> None:
        for layer in cache.layers:
            layer.cumulative_length.fill_(ctx - 1)

    def decode(input_ids):
        return model(input_ids=input_ids, past_key_values=cache, use_cache=True).logits

    kv_bytes = sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
                   for layer in cache.layers)
    return decode, reset, kv_bytes, ids


def llama_workload(shape: LlamaShape, case: Case, dtype: torch.dtype, seed: int = 0) -> Workload:
    import transformers

    config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "llama2": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[shape.family]
    config = config_cls(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim, max_position_embeddings=8192,
        rope_theta=500000.0,
    )
    torch.manual_seed(seed)
    model = quantized(model_cls(config).to(dtype).eval(), case.quant)
    gen = torch.Generator().manual_seed(seed)
    b, ctx = case.batch, case.context
    linear = _matmul_weight_elements(model)
    wbytes = weight_bytes(model, exclude=("model.embed_tokens",))
    q_dim = shape.num_heads * shape.head_dim
    if case.phase == "prefill":
        ids = torch.randint(0, shape.vocab_size, (b, ctx), generator=gen)
        flops = 2.0 * b * ctx * linear + shape.num_layers * 2.0 * b * ctx * ctx * q_dim  # causal: half of 2 GEMMs

        def prefill(input_ids):
            return model(input_ids=input_ids, use_cache=False).logits

        return Workload(model, prefill, (ids,), lambda: None, wbytes, 0, flops)
    decode, reset, kv_bytes, ids = fill_static_cache(model, case, gen)
    flops = 2.0 * b * linear + shape.num_layers * 4.0 * b * ctx * q_dim  # q.K and P.V over the context
    return Workload(model, decode, (ids,), reset, wbytes, kv_bytes, flops)


def compile_variant(variant: str, workload: Workload) -> tuple[Callable[[], object], dict[str, int]]:
    """Compile and warm one variant; returns a zero-argument call and the fusion counts it produced."""
    fn, args = workload.fn, workload.args
    # The frozen variants also pass the options explicitly: the global flag is what makes Dynamo
    # trace for freezing, and distinct options keep Dynamo from reusing the code compiled for
    # "stock" (backends that compare equal share cache entries).
    frozen_options = benchmarking.frozen_options(next(workload.module.parameters()).dtype)
    if variant == "eager":
        compiled = fn
    elif variant == "stock":
        compiled = torch.compile(fn, dynamic=False)
    elif variant == "stock-frozen":
        compiled = torch.compile(fn, dynamic=False, options=frozen_options)
    elif variant == "mla_inductor":
        compiled = torch.compile(fn, backend="mla_inductor", dynamic=False, options=frozen_options)
    else:
        raise ValueError(f"unknown variant {variant!r}")
    reset_counts()
    frozen = variant in ("stock-frozen", "mla_inductor")
    with torch.no_grad(), (benchmarking.inference_freezing(frozen_options["cpp.enable_concat_linear"]) if frozen
                           else contextlib.nullcontext()):
        workload.reset()
        compiled(*args)  # traces and compiles here; freezing must be on while tracing
    counts = {k: v for k, v in fusion_counts().items() if v} if variant == "mla_inductor" else {}

    def call() -> object:
        workload.reset()
        with torch.no_grad():
            return compiled(*args)

    return call, counts


class _NoProgress:
    def set_postfix_str(self, text: str) -> None:
        pass

    def update(self, n: int) -> None:
        pass


def _run_case_quietly(*arguments) -> dict:
    benchmarking.fresh_compiles()
    return run_case(*arguments, _NoProgress())


def run_case_in_own_process(*arguments) -> dict:
    """run_case in a fresh process: whatever its compiles keep alive goes with it. In one process the
    MoE model's cases ran the machine out of memory by the third (about 10 GB each: its 3.4 GB of
    experts, stock's frozen copy, ours packed; Dynamo's and Inductor's caches kept part of each case's
    after torch._dynamo.reset())."""
    import concurrent.futures
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(_run_case_quietly, *arguments).result()


def run_case(
    case: Case, config: MLAConfig, dtype: torch.dtype, variants, rounds: int, calls: int, bandwidth: float,
    gemm: float, progress,
) -> dict:
    builders = {"serving": serving_workload, "hf": hf_workload, "hf-dense": hf_workload, "llama": llama_workload,
                "llama2": llama_workload, "qwen3": llama_workload}
    build = builders[case.model]
    workload = build(config, case, dtype)
    fns, counts = {}, {}
    for variant in variants:
        progress.set_postfix_str(f"{case.label}: compile {variant}")
        fns[variant], c = compile_variant(variant, workload)
        counts.update(c)
        progress.update(1)
    progress.set_postfix_str(f"{case.label}: timing")
    # A copy timed in the same rounds: the bandwidth the variants had. The machine's moves by a third from
    # minute to minute, and a probe taken once before the cases put decode steps at 150% of a roofline.
    copy, copy_bytes = benchmarking.copy_probe()
    times = benchmarking.interleaved_medians(fns | {"copy": copy}, rounds=rounds, calls=calls,
                                             budget_s=TIMING_BUDGET_S)
    bandwidth = max(bandwidth, copy_bytes / times.pop("copy"))
    progress.update(1)
    del fns
    torch._dynamo.reset()

    memory_time = (workload.weight_bytes + workload.kv_bytes) / bandwidth
    compute_time = workload.flops / gemm
    roofline = max(memory_time, compute_time)
    stock_best = min(t for v, t in times.items() if v.startswith("stock"))
    result = {
        "case": dataclasses.asdict(case),
        "label": case.label,
        "config": config.name,
        "layers": config.num_layers,
        "weight_bytes": workload.weight_bytes,
        "kv_bytes": workload.kv_bytes,
        "flops": workload.flops,
        "roofline_s": roofline,
        "roofline_bound": "memory" if memory_time >= compute_time else "compute",
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "times_s": times,
        "roofline_fraction": {v: roofline / t for v, t in times.items()},
        "fusion_counts": counts,
    }
    # what a user compares: decode tokens per second (a token per request a step), prefill time to first token
    if case.phase == "decode":
        result["tokens_per_s"] = {v: case.batch / t for v, t in times.items()}
    else:
        result["time_to_first_token_s"] = dict(times)
    if "mla_inductor" in times:
        ours = times["mla_inductor"]
        result["speedup"] = {
            "vs_eager": times.get("eager", math.nan) / ours,
            "vs_stock": times.get("stock", math.nan) / ours,
            "vs_stock_best": stock_best / ours,
        }
    del workload
    return result


def to_markdown(report: dict) -> str:
    variants = report["variants"]
    head = ["case", "layers"] + [f"{v} ms" for v in variants]
    head += ["x eager", "x stock", "x stock best", "tok/s or TTFT (ours; stock best)", "roofline (ours)",
             "roofline (stock best)", "bound", "copy GB/s", "fusions"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["results"]:
        t = r["times_s"]
        s = r.get("speedup", {})
        best = min((v for v in t if v.startswith("stock")), key=lambda v: t[v], default=None)
        frac = r["roofline_fraction"]
        row = [r["label"], str(r["layers"])] + [f"{t[v] * 1e3:.2f}" for v in variants]
        row += [f"{s.get(k, math.nan):.2f}" for k in ("vs_eager", "vs_stock", "vs_stock_best")]
        ours, stock = t.get("mla_inductor", math.nan), t[best] if best else math.nan
        if "tokens_per_s" in r:
            batch = r["case"]["batch"]
            row.append(f"{batch / ours:.1f} tok/s; {batch / stock:.1f}")
        else:
            row.append(f"TTFT {ours * 1e3:.0f} ms; {stock * 1e3:.0f}")
        row += [f"{frac.get('mla_inductor', math.nan):.0%}", f"{frac[best]:.0%}" if best else "-", r["roofline_bound"]]
        row.append(f"{r['copy_bandwidth_GBps']:.1f}")
        row.append(", ".join(f"{k}={v}" for k, v in r["fusion_counts"].items()) or "none")
        lines.append("| " + " | ".join(row) + " |")
    m = report["machine"]
    lines.append("")
    lines.append(
        f"Measured in this run: copy bandwidth {m['copy_bandwidth_GBps']:.1f} GB/s (read stream "
        f"{m['read_bandwidth_GBps']:.1f} GB/s), oneDNN {m['gemm_dtype']} GEMM "
        f"{m['gemm_GFLOPs']:.0f} GFLOP/s; {m['threads']} threads; torch {m['torch']}; {m['cpu']}, ISA {m['isa']}. "
        f"stock-frozen: {', '.join(f'{k}={v}' for k, v in report['stock_frozen_options'].items())}. "
        "Roofline: the larger of "
        "(weights + KV cache read) / copy bandwidth (bound: memory) and FLOPs / GEMM throughput (bound: compute); "
        "the copy bandwidth of a case is the larger of this probe and a copy timed in the case's rounds. "
        "Times are medians of interleaved rounds."
    )
    return "\n".join(lines) + "\n"


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in report["results"] if "speedup" in r]
    labels = [r["label"] for r in results]
    keys = (("vs_eager", "vs eager"), ("vs_stock", "vs stock compile"), ("vs_stock_best", "vs stock at its best"))
    fig, (ax, roof) = plt.subplots(1, 2, figsize=(2 * max(6, 1.4 * len(labels)), 4))
    width = 0.8 / len(keys)
    for i, (key, name) in enumerate(keys):
        ax.bar([x + i * width for x in range(len(labels))], [r["speedup"][key] for r in results], width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width for x in range(len(labels))], labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("speedup of mla_inductor (x)")
    ax.set_title(f"mla_inductor speedup ({report['dtype']}, median of interleaved rounds)")
    ax.legend(fontsize=8)

    def stock_best(r):
        return max((f for v, f in r["roofline_fraction"].items() if v.startswith("stock")), default=math.nan)

    width = 0.4
    for i, (name, fraction) in enumerate((("mla_inductor", lambda r: r["roofline_fraction"]["mla_inductor"]),
                                          ("stock at its best", stock_best))):
        roof.bar([x + i * width for x in range(len(labels))], [fraction(r) for r in results], width, label=name)
    roof.axhline(1.0, color="black", linewidth=0.8)
    roof.set_xticks([x + width / 2 for x in range(len(labels))], labels, rotation=30, ha="right", fontsize=8)
    roof.set_ylabel("fraction of the roofline")
    roof.set_title(f"{report['machine']['cpu']}, ISA {report['machine']['isa']}", fontsize=9)
    roof.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mla_inductor.report", description=__doc__.splitlines()[0])
    # all: the DeepSeek models and Llama; Qwen3 (gqa_qkv with head norms) and Llama-2 (multi-head) when named
    # hf: transformers' DeepSeek-V2 with its released MoE layout; hf-dense: DeepseekV3 with dense MLPs
    p.add_argument("--model", nargs="+", choices=("serving", "hf", "hf-dense", "llama", "llama2", "qwen3", "all"),
                   default=["all"])
    p.add_argument("--phase", choices=("decode", "prefill", "all"), default="all")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decode batch sizes")
    p.add_argument("--context", type=int, nargs="+", default=[1024, 4096], help="decode context lengths")
    p.add_argument("--prefill-tokens", type=int, nargs="+", default=[2048, 8192],
                   help="prompt lengths of the DeepSeek models' prefill; the Llama-family models take the first")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--quant", choices=("none", "int8", "w8a8", "fp8"), default="none",
                   help="int8: torchao's int8 weight-only Linears (transformers models only); "
                        "w8a8: int8 weights and per-token int8 activations (torchao's, SGLang's in the serving model); "
                        "fp8: DeepSeek-V3's 128 x 128 block fp8 Linears (DeepSeek models only)")
    p.add_argument("--serving-config", default="deepseek-v3-tp22")
    p.add_argument("--hf-config", default="deepseek-v2-lite")
    p.add_argument("--layers", type=int, default=None,
                   help="default: enough to exceed 160 MiB of weights and the last-level cache")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary (the released 100k+ would dwarf attention)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--out", default="reports")
    p.add_argument("--name", default=None, help="file name stem (default: speedup, or quick with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny models, one shape each: about a minute")
    return p.parse_args(argv)


def build_cases(args: argparse.Namespace) -> list[Case]:
    every = ("serving", "hf", "llama") if "all" in args.model else ()
    models = tuple(dict.fromkeys(every + tuple(m for m in args.model if m != "all")))
    if args.quant != "none":
        # no such form
        unquantized = {"int8": ("serving",), "w8a8": (), "fp8": ("llama", "llama2", "qwen3")}[args.quant]
        for model in unquantized:
            if model in args.model:
                raise SystemExit(f"--quant {args.quant}: the {model} model has no such form")
        models = tuple(m for m in models if m not in unquantized)
    phases = ("decode", "prefill") if args.phase == "all" else (args.phase,)
    cases = []
    for model in models:
        for phase in phases:
            if phase == "decode":
                cases += [Case(model, phase, b, c, args.quant) for b in args.batch for c in args.context]
            else:
                # MLA's prefill attention is where long prompts cost: the DeepSeek models take every length
                tokens = args.prefill_tokens if model in DEEPSEEK_MODELS else args.prefill_tokens[:1]
                cases += [Case(model, phase, 1, t, args.quant) for t in tokens]
    return cases


def model_config(args: argparse.Namespace, model: str, dtype: torch.dtype) -> MLAConfig | LlamaShape:
    if model in ("llama", "llama2", "qwen3"):  # two layers hold 872 MiB already
        if args.quick:
            shape = TINY_LLAMA if model != "llama2" else dataclasses.replace(TINY_LLAMA, num_kv_heads=TINY_LLAMA.num_heads)
        else:
            full = {"llama": LlamaShape(), "llama2": LLAMA2, "qwen3": QWEN3}[model]
            shape = dataclasses.replace(full, vocab_size=args.vocab)
        return dataclasses.replace(shape, num_layers=args.layers or 2, family=model)
    if args.quick:
        return get_config("tiny")
    config = get_config(args.serving_config if model == "serving" else args.hf_config, vocab_size=args.vocab)
    if args.layers:
        return config.replace(num_layers=args.layers)
    if model == "hf":
        # the dense first layers and MOE_LAYERS MoE layers: each reads 138 MB of selected and shared
        # experts at one token (V2-Lite), past any L3 here, and holds 1.1 GiB
        return config.replace(num_layers=config.first_k_dense_replace + MOE_LAYERS)
    one_layer = config.replace(num_layers=1, vocab_size=1)
    per_layer = (
        weight_bytes(build_model(one_layer, dtype=dtype, quant=SERVING_QUANT[args.quant]))
        if model == "serving" else _hf_layer_bytes(one_layer, 8 if args.quant != "none" else torch.finfo(dtype).bits)
    )
    return config.replace(num_layers=_layers_for(per_layer))


def _hf_layer_bytes(config: MLAConfig, bits: int) -> int:
    c = config
    q = c.hidden_size * c.num_heads * c.qk_head_dim if c.q_lora_rank is None else (
        c.hidden_size * c.q_lora_rank + c.q_lora_rank * c.num_heads * c.qk_head_dim)
    attn = q + c.hidden_size * c.latent_dim + c.kv_lora_rank * c.num_heads * (c.qk_nope_head_dim + c.v_head_dim)
    attn += c.num_heads * c.v_head_dim * c.hidden_size
    mlp = 3 * c.hidden_size * c.intermediate_size
    return (attn + mlp) * bits // 8


def main(argv: Optional[list[str]] = None) -> dict:
    from tqdm import tqdm

    args = parse_args(argv)
    if args.quick:
        args.batch, args.context, args.prefill_tokens, args.rounds = [1], [64], [32], 3
    dtype = DTYPES[args.dtype]
    cases = build_cases(args)
    benchmarking.fresh_compiles()

    bandwidth = benchmarking.copy_bandwidth()
    read = benchmarking.read_bandwidth()
    gemm = benchmarking.gemm_throughput(dtype)
    configs = {m: model_config(args, m, dtype) for m in {c.model for c in cases}}
    results = []
    with tqdm(total=len(cases) * (len(args.variants) + 1), desc="mla_inductor report", file=sys.stderr) as bar:
        for case in cases:
            arguments = (case, configs[case.model], dtype, args.variants, args.rounds, 5, bandwidth, gemm)
            if args.quick:
                results.append(run_case(*arguments, bar))
            else:
                bar.set_postfix_str(f"{case.label}: in a process of its own")
                results.append(run_case_in_own_process(*arguments))
                bar.update(len(args.variants) + 1)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dtype": args.dtype,
        "quant": args.quant,
        "variants": list(args.variants),
        "stock_frozen_options": benchmarking.frozen_options(dtype),
        "configs": {m: dataclasses.asdict(c) for m, c in configs.items()},
        "machine": {
            "copy_bandwidth_GBps": bandwidth / 1e9,
            "read_bandwidth_GBps": read / 1e9,
            "gemm_GFLOPs": gemm / 1e9,
            "gemm_dtype": isa.roof_gemm_name(dtype),
            "isa": isa.host_isa(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "cpu": isa.cpu_model(),
        },
        "results": results,
    }
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.name or ("quick" if args.quick else "speedup")
    (out / f"{name}.json").write_text(json.dumps(report, indent=2))
    markdown = to_markdown(report)
    (out / f"{name}.md").write_text(markdown)
    plot(report, out / f"{name}.png")
    print(markdown)
    print(f"wrote {out / name}.json, .md, .png")
    return report


if __name__ == "__main__":
    main()
