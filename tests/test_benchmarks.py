"""The benchmark tools that build C++ of their own from the templates' headers still build and run
against the current headers (benchmarks/attend_split.py)."""

import importlib.util
import pathlib

import pytest

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
