"""MLAPass: the one custom graph pass that applies every registered fusion.

It is installed three times per compile:
- as `pre_grad_custom_pass`, on Dynamo's graph before AOT decomposes it: rewrites that need a call whole
  (an SDPA call, patterns/mla_prefill.py);
- as `joint_custom_post_pass`: under `freezing=True` this is the last stage that still holds `aten.mm`
  (freezing later packs weights into `mkldnn._linear_pointwise`); views there are `aten.view`;
- as `post_grad_custom_post_pass`: without freezing; views there are `aten.reshape`.
Each stage has its own PatternMatcherPass because patterns are traced differently for each.
SourceKey, a pass that does nothing, keys Inductor's FX-graph cache on the package's sources for every
compile of the process, the stock backend's included.
Quantized Linears are given one canonical form first and their spelling back after the fusions
(patterns/quantized_linear.py). The bf16 and fp16 Linears left after all of that become mla::linear
where the CPU emulates their GEMMs (patterns/linear.py).
"""

from __future__ import annotations

import hashlib
import pathlib

import torch
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.pattern_matcher import stable_topological_sort

from . import config as mla_config
from . import record
from .patterns import (STAGES, count_whole_chains, linear, merge_into_qkv_a_proj, mla_prefill, pattern_pass,
                       quantized_linear, register_all)
from .patterns.registry import apply_anchored_rewrites, canonical_gemm_splits

_MAX_ROUNDS = 3
PRE_GRAD = "pre_grad"
_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
_SOURCE_SUFFIXES = {".py", ".cpp", ".h", ".hpp", ".j2", ".jinja"}


def source_hash() -> str:
    """Hash of every source file of the package: Python, C++ and templates.

    Inductor's FX-graph cache keys on torch's own sources and on pass uuids, never on third-party
    lowerings or templates; a uuid that missed a template file would serve stale C++ silently.
    Computed on every call (a few dozen small files) so that an edit is seen without a restart.
    """
    hasher = hashlib.sha256()
    for path in sorted(_PACKAGE_DIR.rglob("*")):
        if path.suffix in _SOURCE_SUFFIXES and "__pycache__" not in path.parts:
            hasher.update(str(path.relative_to(_PACKAGE_DIR)).encode())
            hasher.update(path.read_bytes())
    return hasher.hexdigest()


class SourceKey(CustomGraphPass):
    """A pass that does nothing, whose uuid is source_hash(). The lowerings also serve graphs that call
    mla:: ops under the stock `inductor` backend, where MLAPass is not installed, and Inductor's FX-graph
    cache keys on pass uuids but never on registered lowerings: such a graph compiled before a template
    changed was served its old C++ (a benchmark ran a kernel compiled hours earlier from older headers).
    Installed at import in a slot the backend leaves free (key_fx_cache_on_sources)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        return None

    def uuid(self) -> str:
        return f"mla_inductor-sources-{source_hash()}"


def key_fx_cache_on_sources() -> None:
    """Make every FX-graph cache key of this process depend on the package's sources: SourceKey as
    Inductor's post_grad_custom_pre_pass, unless the user has set that slot (then theirs stands)."""
    if inductor_config.post_grad_custom_pre_pass is None:
        inductor_config.post_grad_custom_pre_pass = SourceKey()


class MLAPass(CustomGraphPass):
    def __init__(self, stage: str, config: mla_config.Config | None = None) -> None:
        if stage not in (PRE_GRAD, *STAGES):
            raise ValueError(f"stage must be one of {(PRE_GRAD, *STAGES)}, got {stage!r}")
        self.stage = stage
        self.config = config or mla_config.Config()

    def __call__(self, graph: torch.fx.Graph) -> None:
        record.begin_stage(self.stage)
        # Left set after the pass: the lowerings of this compile run later and read it. Every
        # compile that could lower our ops runs this pass first, or hits the cache and lowers nothing.
        mla_config.set_active(self.config)
        if self.stage == PRE_GRAD:
            if mla_prefill.rewrite_sdpa(graph, self.stage, self.config.enabled):
                graph.owning_module.recompile()
            return
        register_all()
        quantized = quantized_linear.canonicalize(graph) > 0
        changed = canonical_gemm_splits(graph) > 0 or quantized
        # Another round when one fused: a replacement can complete another fusion's pattern (mla_decode's
        # absorbed query is q_b_absorb's). Bounded: every round replaces subgraphs by fewer ops.
        for _ in range(_MAX_ROUNDS):
            matched = pattern_pass(self.stage).apply(graph)
            if matched:
                # A multi-output replacement may stand before one of its inputs (see below), and the
                # anchored rewrites' dead-code elimination lints the graph's order.
                stable_topological_sort(graph)
            rewritten = apply_anchored_rewrites(graph, self.stage)
            if not (matched or rewritten):
                break
            changed = True
        if self.config.enabled("rope") and self.config.enabled("qkv_a_proj"):
            merged = merge_into_qkv_a_proj(graph)
            if merged and self.config.enabled("qkv_proj_with_rope"):
                count_whole_chains(merged, self.stage)
            changed = changed or bool(merged)
        if quantized:
            quantized_linear.fold(graph)
            quantized_linear.restore(graph)
        changed = quantized_linear.int_mm_rows_with_a_row_stride(graph) > 0 or changed
        if self.config.enabled(linear.FUSION):  # last: it takes only what no other fusion took
            changed = linear.rewrite_linears(graph, self.stage) > 0 or changed
        if changed:
            # A multi-output replacement is inserted before the earliest output of its match, which
            # may precede an input defined between the outputs (a lifted eps' cast, say).
            stable_topological_sort(graph)
            graph.eliminate_dead_code()

    def uuid(self) -> str:
        return f"mla_inductor-{mla_config.VERSION}-{self.stage}-{source_hash()}-{self.config!r}"

    def __repr__(self) -> str:
        return f"MLAPass({self.stage!r})"
