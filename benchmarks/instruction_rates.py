"""What this CPU's vector and AMX instructions cost, in ns each, from register loops
(benchmarks/instruction_rates.cpp): the rates the decode kernels' choice of product rests on.

- fp32 FMAs against `vdpbf16ps`: an fp8 cache on an AVX512-BF16 CPU without AMX is converted to bf16 for
  the dpbf16 tiles (latent_attention.h, converts_fp8_to_bf16) because Zen 4 runs a dpbf16 at the rate
  of an FMA, with twice its multiply-adds; on the AMX Xeon one takes four FMAs' time. "multiply-adds a
  ns" compares them.
- AMX: `tdpbf16ps` for the tile shapes the latent kernel configures (rows x columns of the accumulator;
  over values like a cache's, a product takes the same time whatever its shape on the AMX Xeon), tile
  loads from L1, and the latent score step (an A and two B tiles loaded per two products), which takes
  the products' time where the loads overlap them. The AMX Xeon's slow mode shows here: the products
  take twice as long, the FMAs do not.

Every probe runs once a round, in turn; the table holds medians (and minima) over the rounds. Machines
that change speed under a run (the AMX Xeon's two modes) show it as a gap between the two. Asserts
nothing.

    python benchmarks/instruction_rates.py [--march native] [--rounds 31]
"""

import argparse
import pathlib
import subprocess
import tempfile

from mla_inductor import benchmarking

HERE = pathlib.Path(__file__).resolve().parent


def build(out: pathlib.Path, march: str) -> pathlib.Path:
    # widen.h and amx_tiles.h: the AMX probes configure tiles and ask for them as the kernels do
    return benchmarking.build_harness(HERE / "instruction_rates.cpp", out, ("widen.h", "amx_tiles.h"),
                                      ["-O2", f"-march={march}"])


def run(binary: pathlib.Path, rounds: int) -> list[tuple[str, float, float, float]]:
    """(probe, median ns, min ns, multiply-adds) an instruction or step."""
    done = subprocess.run([str(binary), str(rounds)], check=True, capture_output=True, text=True)
    rows = []
    for line in done.stdout.splitlines():
        name, median, least, multiply_adds = line.split("\t")
        rows.append((name, float(median), float(least), float(multiply_adds)))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--march", default="native", help="the target to compile for (gcc -march)")
    p.add_argument("--rounds", type=int, default=31)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(build(pathlib.Path(tmp) / "instruction_rates", args.march), args.rounds)
    print(f"\n## instruction rates, -march={args.march}, one thread; {benchmarking.machine_line()}")
    print("| instruction | ns (median) | ns (min) | multiply-adds a ns (median) |")
    print("|---|---|---|---|")
    for name, median, least, multiply_adds in rows:
        rate = f"{multiply_adds / median:.0f}" if multiply_adds else ""
        print(f"| {name} | {median:.3f} | {least:.3f} | {rate} |")


if __name__ == "__main__":
    main()
