"""The benchmark tools that build C++ of their own still build and run: the attend_split harness against
the current template headers, and the instruction-rate register loops."""

import importlib.util
import pathlib

import pytest

from mla_inductor import isa
from mla_inductor.lowerings.template import TEMPLATE_DIR

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("part, cache", [("gqa", "e4m3"), ("latent", "bf16")])
def test_attend_split_harness_builds_and_times_a_task(tmp_path, part, cache):
    attend_split = load("attend_split")
    binary = attend_split.build(tmp_path / "harness", TEMPLATE_DIR, part, cache, march="native")
    assert attend_split.run(binary, rows=512, caches=2, threads=2, calls=2) > 0


def test_instruction_rates_time_every_probe_the_target_has(tmp_path):
    instruction_rates = load("instruction_rates")
    rows = instruction_rates.run(instruction_rates.build(tmp_path / "rates", "native"), rounds=1)
    names = [name for name, *_ in rows]
    assert "fma ymm (fp32)" in names
    if isa.at_least("avx512_bf16", isa.host_isa()):
        assert "vdpbf16ps zmm" in names
    if isa.host_isa() == "amx":
        assert "score step: 3 loads, 2 tdpbf16ps" in names
    assert all(median > 0 and least > 0 for _, median, least, _ in rows)
