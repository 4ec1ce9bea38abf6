"""Inductor lowerings of the mla:: ops: a C++ template choice beside the extern reference, one module per op.

Everything here touches Inductor internals (lowering registry, IR, CppTemplate); keep that surface
in this package. `torch._inductor.lowering` must be imported before `codegen.cpp_template`
(a circular import otherwise).
"""

from __future__ import annotations

import functools
import pathlib

import torch._inductor.lowering  # noqa: F401  (first: see above)

TEMPLATE_DIR = pathlib.Path(__file__).resolve().parent / "templates"


@functools.cache
def template_source(name: str) -> str:
    """Text of a file in templates/: a Jinja kernel template or a shared C++ header."""
    return (TEMPLATE_DIR / name).read_text()


from . import mla_decode, qkv_a  # noqa: E402,F401
