"""The README's promises: short, its commands and names real, its supported-models table the one
`python -m mla_inductor.supported` prints (whose rows of MLA families test_mla_families checks)."""

import pathlib
import re

import torch

import mla_inductor
from mla_inductor import config, supported

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_is_short():
    assert len(README.splitlines()) <= 200


def test_supported_models_table_is_the_generated_one():
    assert supported.markdown() in README


def test_make_targets_and_variables_exist():
    makefile = (ROOT / "Makefile").read_text()
    for target in re.findall(r"^make (\w+)", README, flags=re.M):
        assert re.search(rf"^{target}:", makefile, flags=re.M), target
    for variable in re.findall(r"make \w+ (\w+)=", README):
        assert f"$({variable})" in makefile, variable


def test_named_fusions_ops_and_pages_exist():
    listed = re.search(r"names: (.*?)\),", README, flags=re.S).group(1)
    assert re.findall(r"`(\w+)`", listed) == list(config.FUSIONS)
    for op in re.findall(r"torch\.ops\.mla\.(\w+)", README) + re.findall(r"`(\w+)`", README.split(
            "The ops are callable directly")[1].split("##")[0]):
        assert hasattr(torch.ops.mla, op), op
    for page in re.findall(r"(docs/[\w/.]+\.md)", README):
        assert (ROOT / page).exists(), page
    for name in ("explain", "fusion_counts", "reset_counts", "inductor_options"):
        assert callable(getattr(mla_inductor, name))
