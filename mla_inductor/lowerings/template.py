"""What the lowerings share: FusedOpTemplate (a CppTemplate over templates/), template inputs, frozen
weights and the huge-page buffers they are packed into.

`torch._inductor.lowering` must be imported before `codegen.cpp_template` (a circular import inside
torch otherwise).
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import pathlib
import weakref

import torch._inductor.lowering  # noqa: F401  (first: see above)

from typing import Optional

import sympy
import torch
from torch._inductor import ir
from torch._inductor.codegen.cpp import get_export_declaration
from torch._inductor.codegen.cpp_template import CppTemplate
from torch._inductor.select_algorithm import autotune_select_algorithm
from torch._inductor.utils import parallel_num_threads
from torch._inductor.virtualized import V

from .. import config as mla_config

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
            return _contiguous_copy(t)
    return ir.ExternKernel.require_stride1(t)  # a flexible layout becomes contiguous: dense in the last dim


_contiguous_copies: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def _contiguous_copy(view: ir.IRNode) -> ir.IRNode:
    """One contiguous copy per graph of a strided view that templates read (the SGLang-layout W_kc
    transposed, say), however many templates read it. Two copies of one view land in one horizontally
    fused loop, and there torch 2.13's CPU codegen repeats its 32 x 32 bf16 `transpose_mxn` into the
    same tile, which GCC 12 at -O3 miscompiles for AVX-512: garbage in about half the elements
    (tests/test_qkv_proj_with_rope.py's two chains sharing a W_kc found it; -O1 is right)."""
    key = (view.get_name(), tuple(view.get_size()), tuple(view.get_stride()), view.get_layout().offset)
    copies = _contiguous_copies.setdefault(V.graph, {})
    if key not in copies or view.get_name() in V.graph.mutated_buffers:  # a mutated view is copied anew
        copies[key] = ir.ExternKernel.require_contiguous(view)
    return copies[key]


def row_scale_strides(kernel, scale: ir.IRNode, rows_dims: int) -> tuple[list, list]:
    """The strides by which an fp8 cache's row scales are read for the cache's first `rows_dims` dims
    (the scale broadcasts against the cache, right-aligned, with size 1 in the last dim: ops/checks.py),
    0 where the scale is broadcast; and the index of its first element."""
    size = scale.get_size()
    lead = rows_dims + 1 - len(size)  # cache dims the scale does not have
    strides = []
    for dim in range(rows_dims):
        own = dim - lead
        broadcast = own < 0 or V.graph.sizevars.statically_known_equals(size[own], 1)
        strides.append(0 if broadcast else kernel.stride(scale, own))
    return strides, [0] * len(size)


def templates_serve(t) -> bool:
    """Whether our C++ templates may lower an op on `t`: switched on (Config.cpp_templates) and on the CPU."""
    return mla_config.active().cpp_templates and t.get_device().type == "cpu"


def static_sizes(*nodes) -> bool:
    """Whether every size of `nodes` is a number: weights (parameters) are static in every graph the
    fusions rewrite, and the templates take their sizes as constants."""
    return all(isinstance(s, (int, sympy.Integer)) for node in nodes for s in node.get_size())


def guard_ints(sizes: dict) -> Optional[dict]:
    """Sizes that shape a kernel's tiles and loops (heads, row widths) as ints. Under dynamic=True they
    are symbols: specialize on them with a guard (a model's heads do not change between steps). None
    if that is impossible (unbacked sizes): the extern reference serves then."""
    try:
        return {name: V.graph.sizevars.guard_int(size) for name, size in sizes.items()}
    except Exception:  # noqa: BLE001 -- unbacked or unhinted
        return None


def cpp_rope_style(style: str) -> str:
    """An mla::apply_rope style ("neox", "interleaved", "interleaved_to_halves") as rope.h's enum."""
    return "mla_inductor::RopeStyle::k" + "".join(word.title() for word in style.split("_"))


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
    Jinja template branches on them), the kernel's arguments are the present ones, in this order.

    A subclass names its Jinja file (`template_file`) and the kernel's output (`output`), and gives
    the shared C++ headers it pastes in front (`headers`) and the sizes, strides and constants the
    Jinja file reads (`options`)."""

    template_file: str
    output: str = "Y"

    def __init__(self, name: str, inputs: dict, layout: ir.Layout) -> None:
        self.present_inputs = {k: v for k, v in inputs.items() if v is not None}
        super().__init__(name, list(self.present_inputs.values()), layout, parallel_num_threads())
        self.inputs = inputs

    def headers(self) -> tuple[str, ...]:
        raise NotImplementedError

    def options(self, kernel) -> dict:
        raise NotImplementedError

    def render(self, kernel, template_buffer_node=None, flag_template_buffer_has_other_users=None,
               epilogue_nodes=None, **kwargs) -> str:
        assert not epilogue_nodes, "epilogue fusion is off for our templates (see select)"
        out = template_buffer_node if template_buffer_node is not None else self.output_node
        # Declare the kernel's arguments before anything names a size: sizes named earlier would get
        # symbols the signature does not declare (docs/inductor_notes.md).
        signature = kernel.def_kernel(inputs=self.present_inputs, outputs={self.output: out})
        return self._template_from_string(template_source(self.template_file)).render(
            template=self,
            kernel=kernel,
            signature=signature,
            num_threads=self.num_threads,
            export_declaration=get_export_declaration(),
            micro_kernels="\n".join(template_source(h) for h in self.headers()),
            **{self.output: out},
            **self.inputs,
            **self.options(kernel),
        )

    def select(self) -> ir.TensorBox:
        """The template as the lowering's one choice: its output buffer. Epilogue fusion stays off:
        our kernels write their outputs in a phase after a barrier, or as segments that consumers read
        as views, where a fused pointwise consumer would need a store_output per segment."""
        choices = []
        self.maybe_append_choice(choices)
        out, _ = autotune_select_algorithm(self.name, choices, self.input_nodes, self.layout)
        out.data.data.allow_epilogue_fusion = False
        return out
