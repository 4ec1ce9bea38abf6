"""The `mla_inductor` torch.compile backend: Inductor's compile_fx with MLAPass installed.

Found through the `torch_dynamo_backends` entry point, so `torch.compile(m, backend="mla_inductor")`
works without importing this package first.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any, Mapping, Optional

import torch
from torch._inductor import config as inductor_config
from torch._inductor import list_mode_options
from torch._inductor.compile_fx import compile_fx
from torch._inductor.custom_graph_pass import get_custom_graph_passes

from . import config as mla_config
from . import isa
from .passes import MLAPass

# Inductor config key -> the MLAPass stage it runs.
_PASS_SLOTS = {"pre_grad_custom_pass": "pre_grad", "joint_custom_post_pass": "joint",
               "post_grad_custom_post_pass": "post_grad"}


def split_options(options: Optional[Mapping[str, Any]]) -> tuple[dict[str, Any], mla_config.Config]:
    """Separate this project's `mla_inductor.*` keys from Inductor's own."""
    inductor_options, own = {}, {}
    for key, value in (options or {}).items():
        if key.startswith(mla_config.OPTION_PREFIX):
            own[key[len(mla_config.OPTION_PREFIX) :]] = value
        else:
            inductor_options[key] = value
    return inductor_options, mla_config.Config.from_options(own)


def install_passes(patches: dict[str, Any], config: mla_config.Config) -> dict[str, Any]:
    """Append MLAPass to whatever custom passes the user (or the global config) installed."""
    for key, stage in _PASS_SLOTS.items():
        existing = patches.get(key, getattr(inductor_config, key))
        theirs = [p for p in get_custom_graph_passes(existing) if not isinstance(p, MLAPass)]
        patches[key] = [*theirs, MLAPass(stage, config)]
    return patches


def inductor_options(**own: Any) -> dict[str, Any]:
    """The `options=` dict that gives the stock `inductor` backend the same passes.

    `own` takes this project's keys without prefix, e.g. `inductor_options(fusions={"rope": False})`.
    """
    return install_passes({}, mla_config.Config.from_options(own))


def _concat_linear_is_slow_here(gm: torch.fx.GraphModule, example_inputs) -> bool:
    """Whether the graph holds bf16 tensors where concat-linear is slow (`isa.concat_linear_is_slow`).
    Our own fusions read the weights they fuse themselves; the option only matters to the GEMMs they
    leave to Inductor. The weights are graph inputs or, where Dynamo kept the module's attributes, the
    graph's own parameters."""
    tensors = itertools.chain(example_inputs, gm.parameters(), gm.buffers())
    return any(isinstance(t, torch.Tensor) and isa.concat_linear_is_slow(t.dtype) for t in tensors)


def trace_inference_mode_as_no_grad(gm: torch.fx.GraphModule) -> bool:
    """Turn the `inference_mode` region Dynamo records (`_enter_inference_mode` / `_exit_inference_mode`
    nodes, from a `@torch.inference_mode()` forward as DeepSeek's reference code has) into a no-grad
    region. Traced in inference mode, a slice of a buffer made outside it fails in AOTAutograd
    ("Cannot set version_counter for inference tensor", a known torch 2.13 bug, stock alike); the
    compiled code computes the same values either way, only its outputs are not inference tensors.
    Returns whether the graph had such a region."""
    enter = torch.autograd.grad_mode._enter_inference_mode
    exit_ = torch.autograd.grad_mode._exit_inference_mode
    found = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (enter, exit_):
            continue
        found = True
        # Dynamo guards on grad mode, so the mode it traced under is the mode every call of this graph
        # starts in: the one to restore at the region's end.
        enabled = not (node.target is enter and node.args[0]) and torch.is_grad_enabled()
        with gm.graph.inserting_before(node):
            replacement = gm.graph.call_function(torch._C._set_grad_enabled, (enabled,))
        node.replace_all_uses_with(replacement)
        gm.graph.erase_node(node)
    if found:
        gm.recompile()
    return found


def mla_inductor_backend(gm: torch.fx.GraphModule, example_inputs, *, mode: Optional[str] = None, options=None):
    own_options, config = split_options(options)
    trace_inference_mode_as_no_grad(gm)
    patches = dict(list_mode_options(mode)) if mode and mode != "default" else {}
    patches.update(own_options)
    if patches.get("freezing") and not inductor_config.freezing:
        # Dynamo decides at trace time whether parameters may become constants; by the time a
        # backend sees options the graph is traced, and compile_fx would silently not freeze.
        warnings.warn(
            "options={'freezing': True} reaches a backend after tracing and has no effect; "
            "set torch._inductor.config.freezing = True (or use config.patch) around the first call",
            stacklevel=2,
        )
    concat = patches.get("cpp.enable_concat_linear", inductor_config.cpp.enable_concat_linear)
    if concat and _concat_linear_is_slow_here(gm, example_inputs):
        patches["cpp.enable_concat_linear"] = False
    install_passes(patches, config)
    previous = mla_config.set_active(config)
    try:
        return compile_fx(gm, example_inputs, config_patches=patches)
    finally:
        mla_config.set_active(previous)
