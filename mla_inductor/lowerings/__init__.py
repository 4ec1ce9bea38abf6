"""Inductor lowerings of the mla:: ops: a C++ template choice beside the extern reference, one module per op.

Everything here touches Inductor internals (lowering registry, IR, CppTemplate); keep that surface
in this package. `torch._inductor.lowering` must be imported before `codegen.cpp_template`
(a circular import otherwise).
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import pathlib

import torch._inductor.lowering  # noqa: F401  (first: see above)

from typing import Optional

import torch
from torch._inductor import ir
from torch._inductor.codegen.cpp import get_export_declaration
from torch._inductor.codegen.cpp_template import CppTemplate
from torch._inductor.utils import parallel_num_threads
from torch._inductor.virtualized import V

TEMPLATE_DIR = pathlib.Path(__file__).resolve().parent / "templates"


@functools.cache
def template_source(name: str) -> str:
    """Text of a file in templates/: a Jinja kernel template or a shared C++ header."""
    return (TEMPLATE_DIR / name).read_text()


def realize_input(t, contiguous: bool = False) -> Optional[ir.IRNode]:
    """A lowering argument as a template input: a buffer, dense in its last dim (or wholly contiguous).

    Not `ExternKernel.require_stride1`: that accepts a stride of 1 in *any* dim, so a transposed view
    (W_kc^T, say) would reach a kernel that reads rows along the last dim."""
    if t is None:
        return None
    t = ir.ExternKernel.realize_input(t)
    if contiguous:
        return ir.ExternKernel.require_contiguous(t)
    if ir.is_storage_and_layout(t) and not isinstance(t.get_layout(), ir.FlexibleLayout):
        size, stride = t.get_size(), t.get_stride()
        sizevars = V.graph.sizevars
        if size and not (sizevars.statically_known_equals(stride[-1], 1) or sizevars.statically_known_equals(size[-1], 1)):
            return ir.ExternKernel.require_contiguous(t)
    return ir.ExternKernel.require_stride1(t)  # a flexible layout becomes contiguous: dense in the last dim


def frozen_value(t) -> Optional[torch.Tensor]:
    """The value of a lowering argument that freezing made a graph constant (seen through a view, such
    as the row slice a fused weight is split by), or None when it is a runtime input."""
    t = ir.ExternKernel.realize_input(t)
    storage, layout = (t.data, t.layout) if isinstance(t, ir.ReinterpretView) else (t, None)
    name = storage.get_name() if isinstance(storage, (ir.StorageBox, ir.Buffer)) else None
    if name not in V.graph.constants:
        return None
    value = V.graph.constants[name]
    return value if layout is None else value.as_strided(layout.size, layout.stride, layout.offset)


HUGE_PAGE = 2 << 20


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in memory the kernel is asked to back with 2 MiB pages (transparent huge
    pages under `madvise`, the common setting). A template that streams a packed weight crosses no
    4 KiB page boundary then, where the L2 stream prefetcher stops and must retrain: 26 -> 29-40 GB/s
    streaming the qkv_a weights at 8 rows (docs/qkv_a.md). Private anonymous memory: a shared
    mapping would not be eligible. Where the kernel declines, the pages are ordinary ones."""
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = -ctypes.addressof(ctypes.c_char.from_buffer(buffer)) % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
    # frombuffer keeps `buffer` alive for as long as the tensor lives
    return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(shape)


class FusedOpTemplate(CppTemplate):
    """A C++ template over named inputs, some of them absent: absent ones stay in `inputs` as None (the
    Jinja template branches on them), the kernel's arguments are the present ones, in this order."""

    def __init__(self, name: str, inputs: dict, layout: ir.Layout) -> None:
        self.present_inputs = {k: v for k, v in inputs.items() if v is not None}
        super().__init__(name, list(self.present_inputs.values()), layout, parallel_num_threads())
        self.inputs = inputs

    def render_source(self, template_file: str, headers: tuple[str, ...], **options) -> str:
        """Render `template_file` with the shared C++ `headers` pasted in front as `micro_kernels`.
        The caller must have run `kernel.def_kernel` before naming any size (see docs/inductor_notes.md)."""
        return self._template_from_string(template_source(template_file)).render(
            template=self,
            num_threads=self.num_threads,
            export_declaration=get_export_declaration(),
            micro_kernels="\n".join(template_source(h) for h in headers),
            **self.inputs,
            **options,
        )


from . import mla_decode, q_b_absorb, qkv_a, rope  # noqa: E402,F401
