"""One decode-attention task (`attend_split`, latent_attention.h) in ns per cache row: the C++ of the
gqa_decode and mla_decode templates without Inductor, Python or the op around it.

Where an op-level benchmark (fp8_cache.py, gqa_decode.py, mla_decode.py) says how fast a step is,
this says what a row costs each kernel, cache in L2 / L3 (one cache, used again) and from memory
(caches taken in turn, twice the last-level cache in all), on one thread and on two (eight tasks,
one per key/value head, as the op runs them). Shapes: gqa, a group of 4 query heads of 128 over its
key/value head (Llama-3-8B); latent, 22 heads over rows of 576 with values their first 512 columns
(deepseek-v3-tp22); tasks of 4096 rows (--rows). Caches bf16, e4m3fn and e5m2, query bf16.

Each variant is one binary (benchmarks/attend_split.cpp, built with g++ -O3 for --march, default this
CPU, with the templates' headers); the binaries run in turn, round after round, and the table holds
the medians of their per-round medians. `--templates DIR ...` builds every variant from each directory
of headers (an A/B of two versions of latent_attention.h / widen.h). Asserts nothing.

    python benchmarks/attend_split.py [--part gqa latent] [--cache bf16 e4m3 e5m2] [--threads 1 2]
                                      [--march native] [--templates DIR ...] [--rows 4096] [--rounds 5]
"""

import argparse
import math
import pathlib
import statistics
import subprocess
import tempfile

from torch._inductor import config as inductor_config

from mla_inductor import benchmarking, isa
from mla_inductor.lowerings.mla_decode import ATTENTION_HEADERS
from mla_inductor.lowerings.template import TEMPLATE_DIR

HERE = pathlib.Path(__file__).resolve().parent
CACHES = {"bf16": ("c10::BFloat16", 2), "e4m3": ("c10::Float8_e4m3fn", 1), "e5m2": ("c10::Float8_e5m2", 1)}
# heads, key width, value width, values in a cache of their own
PARTS = {"gqa": (4, 128, 128, True), "latent": (22, 576, 512, False)}


def row_bytes(part: str, cache: str) -> int:
    _, key, value, own_values = PARTS[part]
    return (key + (value if own_values else 0)) * CACHES[cache][1]


def build(out: pathlib.Path, templates: pathlib.Path, part: str, cache: str, march: str) -> pathlib.Path:
    heads, key, value, own_values = PARTS[part]
    with inductor_config.patch({"cpp.march": march}):
        capability = "AVX512" if isa.at_least("avx512f", isa.target_isa()) else "AVX2"
    flags = ["-O3", f"-march={march}", "-fopenmp", f"-DCPU_CAPABILITY_{capability}", "-DQUERY_T=c10::BFloat16",
             f"-DCACHE_T={CACHES[cache][0]}", f"-DHEADS={heads}", f"-DKEY_DIM={key}", f"-DVALUE_DIM={value}",
             f"-DOWN_VALUES={int(own_values)}"]
    return benchmarking.build_harness(HERE / "attend_split.cpp", out, ATTENTION_HEADERS, flags,
                                      libs=("c10", "torch_cpu"), templates=templates)


def run(binary: pathlib.Path, rows: int, caches: int, threads: int, calls: int) -> float:
    done = subprocess.run([str(binary), str(rows), str(caches), str(calls), str(threads)], check=True,
                          capture_output=True, text=True)
    return float(done.stdout)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", nargs="+", default=list(PARTS), choices=list(PARTS))
    p.add_argument("--cache", nargs="+", default=list(CACHES), choices=list(CACHES))
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2], choices=[1, 2])
    p.add_argument("--march", default="native", help="the target to compile for (gcc -march)")
    p.add_argument("--templates", nargs="+", type=pathlib.Path, default=[TEMPLATE_DIR],
                   help="directories of template headers, one variant each")
    p.add_argument("--rows", type=int, default=4096,
                   help="rows a task (the op splits a request: at B=1 and 4096 rows, eight tasks of 512)")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        binaries = {}
        for v, templates in enumerate(args.templates):
            for part in args.part:
                for cache in args.cache:
                    binaries[v, part, cache] = build(pathlib.Path(tmp) / f"{v}_{part}_{cache}", templates, part,
                                                     cache, args.march)
        cases = []  # (variant, part, cache, residency, threads, caches, calls)
        for (v, part, cache), binary in binaries.items():
            # caches enough for twice the last-level cache in fp8 (as fp8_cache.py's stacks)
            past = math.ceil(2 * benchmarking.last_level_cache_bytes() / (args.rows * row_bytes(part, "e4m3")))
            for threads in args.threads:
                tasks = 1 if threads == 1 else 8
                l2_calls = (200 if part == "gqa" else 50) * 4096 // args.rows
                cases.append((v, part, cache, "L2 / L3", threads, tasks, l2_calls))
                cases.append((v, part, cache, "memory", threads, max(past, tasks), max(past // tasks, 20)))
        times = {case: [] for case in cases}
        for _ in range(args.rounds):
            for case in cases:
                v, part, cache, _, threads, caches, calls = case
                times[case].append(run(binaries[v, part, cache], args.rows, caches, threads, calls))
    print(f"\n## attend_split, tasks of {args.rows} rows, bf16 query, -march={args.march}; "
          f"{benchmarking.machine_line()}")
    print("| variant | part | cache | residency | threads | ns a row | GB/s of cache read a thread |")
    print("|---|---|---|---|---|---|---|")
    for case, values in times.items():
        v, part, cache, residency, threads, *_ = case
        ns = statistics.median(values)
        print(f"| {args.templates[v].name} | {part} | {cache} | {residency} | "
              f"{threads} | {ns:.1f} | {row_bytes(part, cache) / ns:.1f} |", flush=True)


if __name__ == "__main__":
    main()
