"""Two versions of the C++ templates compared at the op level, in one process.

Each decode step of benchmarks/fp8_cache.py (latent: mla::latent_decode_attention at 22 heads; gqa:
mla::gqa_decode_attention at the Llama-3-8B shape; B=1) is compiled once from each directory of
templates and timed in the same interleaved rounds, with the copy bandwidth. What a change to a header
is worth in the op: benchmarks/attend_split.py's harness times one task of the kernel alone and can
mislead (docs/mla_decode.md: aligning the scratch gained the harness 15% and the op nothing).

The headers are read when a kernel is generated (`template.template_source`, cached: cleared here
between the versions), and the generated C++ holds their text, so two versions that differ compile to
two kernels. Inductor's FX-graph cache is off, and fp8_cache.py compiles each step through
`benchmarking.fresh_function`, so that Dynamo does not serve the second version from the first's
compile. Prints medians; asserts nothing.

    python benchmarks/template_ab.py BEFORE [AFTER] [--part latent gqa] [--cache bf16 e4m3 e5m2]
                                     [--layers N] [--heads 22] [--rounds 9]

BEFORE and AFTER are directories of templates (AFTER: this checkout's), e.g. an earlier commit's:
    git archive HEAD~1 mla_inductor/lowerings/templates | tar -x -C /tmp/before
    python benchmarks/template_ab.py /tmp/before/mla_inductor/lowerings/templates
"""

import argparse
import pathlib
import types

import torch

import fp8_cache
from mla_inductor import benchmarking
from mla_inductor.lowerings import template

CACHES = {"bf16": torch.bfloat16, "e4m3": fp8_cache.E4M3, "e5m2": fp8_cache.E5M2}
STEPS = {"latent": fp8_cache.latent_step, "gqa": fp8_cache.gqa_step}


def compiled_from(templates: pathlib.Path, make_step, args, dtype):
    """The step, compiled (by its first call) from the headers in `templates`."""
    saved = template.TEMPLATE_DIR
    template.TEMPLATE_DIR = templates
    template.template_source.cache_clear()
    try:
        step, *_ = make_step(args, dtype)
        with torch.no_grad():
            step()
    finally:
        template.TEMPLATE_DIR = saved
        template.template_source.cache_clear()
    return step


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before", type=pathlib.Path)
    p.add_argument("after", type=pathlib.Path, nargs="?", default=template.TEMPLATE_DIR)
    p.add_argument("--part", nargs="+", default=["latent"], choices=list(STEPS))
    p.add_argument("--cache", nargs="+", default=["bf16", "e4m3"], choices=list(CACHES))
    p.add_argument("--layers", type=int, help="layers a step (default: fp8_cache.py's, past the L3)")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--heads", type=int, default=22, help="the latent step's query heads")
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    for side in (args.before, args.after):
        if not (side / "latent_attention.h").is_file():
            p.error(f"{side} holds no templates (latent_attention.h)")
    benchmarking.fresh_compiles()
    step_args = types.SimpleNamespace(context=args.context, heads=args.heads, w_vc=False, latent_layers=args.layers,
                                      gqa_layers=args.layers)
    fns = {}
    for part in args.part:
        for cache in args.cache:
            for side, templates in (("before", args.before), ("after", args.after)):
                fns[f"{part} {cache} {side}"] = compiled_from(templates, STEPS[part], step_args, CACHES[cache])
    copy, copy_bytes = benchmarking.copy_probe()
    with torch.no_grad():
        t = benchmarking.interleaved_medians({**fns, "copy": copy}, rounds=args.rounds, calls=3)
    print(f"\n## {args.before} -> {args.after}; copy {copy_bytes / t['copy'] / 1e9:.1f} GB/s in the rounds; "
          f"{benchmarking.machine_line()}")
    print("| step | cache | before ms | after ms | before / after |")
    print("|---|---|---|---|---|")
    for part in args.part:
        for cache in args.cache:
            before, after = t[f"{part} {cache} before"], t[f"{part} {cache} after"]
            print(f"| {part} | {cache} | {before * 1e3:.2f} | {after * 1e3:.2f} | {before / after:.3f} |", flush=True)


if __name__ == "__main__":
    main()
