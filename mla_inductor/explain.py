"""What fired, where, and why a candidate was turned down.

Every fusion's `extra_check` goes through `checked()`: a check returns None to accept or a sentence
saying which precondition failed. Accepted matches count towards `fusion_counts()`; both kinds are
recorded with the module path of the matched nodes, so `explain()` can answer the question pattern
matchers usually leave open: why did nothing fire?
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Optional

import torch
from torch._dynamo.utils import counters
from torch._inductor.pattern_matcher import Match

from . import config as mla_config

COUNTER_KEY = "mla_inductor"


@dataclasses.dataclass(frozen=True)
class Event:
    fusion: str
    where: str  # module path of the matched nodes ("" when the graph carries none)
    node: str  # name of the match's output node in its graph
    stage: str
    reason: Optional[str] = None  # None: fired

    @property
    def fired(self) -> bool:
        return self.reason is None


_events: list[Event] = []


def fusion_counts() -> dict[str, int]:
    """How many subgraphs each fusion replaced since the last `reset_counts()`, by public name."""
    recorded = counters[COUNTER_KEY]
    return {name: recorded[name] for name in mla_config.FUSIONS}


def reset_counts() -> None:
    counters[COUNTER_KEY].clear()
    _events.clear()


def _module_path(match: Match) -> str:
    """Longest common module path of the matched nodes, e.g. `model.layers.0.self_attn`."""
    paths = []
    for node in match.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            raw = list(stack.values())[-1][0]
            paths.append(_normalize_module_path(raw).split("."))
    if not paths:
        return ""
    common = paths[0]
    for path in paths[1:]:
        n = 0
        while n < min(len(common), len(path)) and common[n] == path[n]:
            n += 1
        common = common[:n]
    return ".".join(common)


def _normalize_module_path(raw: str) -> str:
    # Dynamo spells paths as source expressions: L['self'].model.layers[0]._modules['q_a_proj']
    path = re.sub(r"^[LG]\['[^']*'\]\.?", "", raw)
    path = re.sub(r"\._modules\['([^']*)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']*)'\]", r".\1", path)
    return path.strip(".")


def record_fired(fusion: str, where: str, node: str, stage: str) -> None:
    """Count a fusion found by a graph walk rather than by a pattern's check."""
    _events.append(Event(fusion, where, node, stage))
    counters[COUNTER_KEY][fusion] += 1


def checked(fusion: str, stage: str, check: Callable[[Match], Optional[str]]) -> Callable[[Match], bool]:
    """Turn `check(match) -> reason | None` into an `extra_check` that records and counts."""

    def extra_check(match: Match) -> bool:
        if not mla_config.active().enabled(fusion):
            return False
        reason = check(match)
        output = match.output_node()
        _events.append(Event(fusion, _module_path(match), output.name, stage, reason))
        if reason is None:
            # The matcher applies the replacement right after a successful extra_check.
            counters[COUNTER_KEY][fusion] += 1
            return True
        return False

    return extra_check


@dataclasses.dataclass
class Explanation:
    fired: list[Event]
    rejected: list[Event]

    def counts(self) -> dict[str, int]:
        out = {name: 0 for name in mla_config.FUSIONS}
        for event in self.fired:
            out[event.fusion] += 1
        return out

    def __str__(self) -> str:
        lines = [f"mla_inductor: {len(self.fired)} fusion(s) fired, {len(self.rejected)} candidate(s) rejected"]
        for event in self.fired:
            lines.append(f"  fired     {event.fusion:<20} {event.where or '<graph>'}  [{event.stage}]")
        for event in self.rejected:
            lines.append(f"  rejected  {event.fusion:<20} {event.where or '<graph>'}  [{event.stage}]: {event.reason}")
        return "\n".join(lines)


def explain(fn: Callable, *example_inputs, verbose: bool = True, **compile_kwargs) -> Explanation:
    """Compile `fn` with the mla_inductor backend, run it once, and report which fusions fired where
    and which candidates were rejected and why.

    Caches are off for this compile: a cached artefact would skip the pass and explain nothing.
    """
    from .backend import mla_inductor_backend

    start = len(_events)
    compile_kwargs.setdefault("backend", _FreshBackend(mla_inductor_backend))
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(
        enable_autograd_cache=False
    ):
        compiled = torch.compile(fn, **compile_kwargs)
        with torch.no_grad():
            compiled(*example_inputs)
    events = _events[start:]
    fired = [e for e in events if e.fired]
    # Several spellings of one fusion may see the same candidate; one that fired answers for all.
    fired_nodes = {(e.fusion, e.stage, e.node) for e in fired}
    rejected = []
    for e in events:
        if not e.fired and (e.fusion, e.stage, e.node) not in fired_nodes and e not in rejected:
            rejected.append(e)
    result = Explanation(fired, rejected)
    if verbose:
        print(result)
    return result


class _FreshBackend:
    """A backend object of its own, so Dynamo does not reuse code compiled for another backend."""

    def __init__(self, backend: Callable) -> None:
        self._backend = backend

    def __call__(self, gm, example_inputs, **kwargs):
        return self._backend(gm, example_inputs, **kwargs)
