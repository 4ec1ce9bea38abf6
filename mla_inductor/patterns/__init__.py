"""Fusion patterns: one module per fusion, each with search functions written as eager code.

`register_fusion` traces a search function once per MLAPass stage (joint graphs keep `aten.view`,
post-grad graphs have `aten.reshape`) and wraps its check so that every accepted or rejected
candidate is counted and explained.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Callable, Optional, Sequence

import torch
from torch._inductor.fx_passes.post_grad import view_to_reshape
from torch._inductor.pattern_matcher import Match, fwd_only, gen_pattern, init_once_fakemode, register_replacement

from ..explain import checked
from ..passes import STAGES, pattern_pass

# Fusion modules in this package, registered in this order (larger fusions first where they overlap).
FUSION_MODULES: tuple[str, ...] = ("qkv_a",)


def trace_for_stage(stage: str) -> Callable:
    if stage == "joint":
        return fwd_only

    def fwd_only_reshape(*args: Any, **kwargs: Any) -> torch.fx.GraphModule:
        gm = fwd_only(*args, **kwargs)
        view_to_reshape(gm)
        return gm

    return fwd_only_reshape


def register_fusion(
    fusion: str,
    search_fn: Callable,
    replace_fn: Callable,
    example_inputs: Sequence[Any],
    check: Callable[[Match], Optional[str]],
    stages: Sequence[str] = STAGES,
    size_agnostic: bool = False,
    **kwargs: Any,
) -> None:
    """Register `search_fn -> replace_fn` in the given MLAPass stages; `check` returns a rejection reason or None.

    `size_agnostic` skips the strict re-trace with the match's real shapes (needed where dynamic
    sizes appear in mixed spellings); `check` must then verify the literals itself.
    """
    for stage in stages:
        if size_agnostic:
            kwargs["search_fn_pattern"] = gen_pattern(
                search_fn, list(example_inputs), trace_for_stage(stage), kwargs.get("scalar_workaround")
            )
        register_replacement(
            search_fn,
            replace_fn,
            list(example_inputs),
            trace_for_stage(stage),
            pattern_pass(stage),
            extra_check=checked(fusion, stage, check),
            **kwargs,
        )


@functools.cache
@init_once_fakemode
def register_all() -> None:
    for name in FUSION_MODULES:
        importlib.import_module(f"{__name__}.{name}").register()
