"""Switches of mla_inductor: which fusions run and which kernels lowerings may choose.

Users set them per compile through `options={"mla_inductor.fusions": {"rope": False}}` (backend) or
`mla_inductor.inductor_options(fusions={"rope": False})`. A `Config` is part of the pass uuid, so
changing a switch never serves a cached artefact compiled under another setting.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

# Public fusion names (see docs/DESIGN.md); `fusion_counts()` reports them in this order.
VERSION = "0.1.0"  # the package's version (pyproject.toml), part of MLAPass.uuid

FUSIONS = (
    "qkv_a_proj",
    "rmsnorm",
    "rope",
    "q_b_absorb",
    "mla_decode",
    "qkv_proj_with_rope",
    "gqa_qkv",
    "gqa_decode",
    "linear",
    "moe",
    "mla_prefill",
    "gqa_prefill",
)

OPTION_PREFIX = "mla_inductor."


@dataclasses.dataclass(frozen=True)
class Config:
    # fusion name -> enabled
    fusions: tuple[tuple[str, bool], ...] = tuple((name, True) for name in FUSIONS)
    # Offer our C++ templates to the lowerings. False leaves only the extern reference choice
    # (useful to separate a pattern's effect from a template's).
    cpp_templates: bool = True

    def enabled(self, fusion: str) -> bool:
        return dict(self.fusions)[fusion]

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Config:
        """Build from option keys without the `mla_inductor.` prefix; reject unknown keys and names."""
        fusions = dict(cls().fusions)
        cpp_templates = cls.cpp_templates
        for key, value in options.items():
            if key == "fusions":
                if not isinstance(value, Mapping):
                    raise TypeError(f"mla_inductor.fusions must be a dict name -> bool, got {type(value).__name__}")
                for name, on in value.items():
                    if name not in fusions:
                        raise ValueError(f"mla_inductor.fusions: unknown fusion {name!r}; known: {', '.join(FUSIONS)}")
                    fusions[name] = bool(on)
            elif key == "cpp_templates":
                cpp_templates = bool(value)
            else:
                raise ValueError(
                    f"unknown option {OPTION_PREFIX}{key}; known: {OPTION_PREFIX}fusions, {OPTION_PREFIX}cpp_templates"
                )
        return cls(fusions=tuple(fusions.items()), cpp_templates=cpp_templates)


# The config of the compile in progress. MLAPass sets it while it runs and lowerings read it;
# both happen inside one compile_fx call on one thread.
_active = Config()


def active() -> Config:
    return _active


def set_active(config: Config) -> Config:
    global _active
    previous, _active = _active, config
    return previous
