"""The record of what the fusions did: counts for `fusion_counts()`, events for `explain()`.

Every fusion's `extra_check` goes through `checked()`: a check returns None to accept or a sentence
saying which precondition failed. Both kinds are recorded as events with the module path of the
matched nodes; accepted ones are also counted.

The counts live in `counters["inductor"]` under `mla_inductor.<fusion>`, because Inductor replays
what a compile added there when it serves that compile from its FX-graph or AOTAutograd cache
(`CompiledFxGraph.counter_deltas`); a cache hit runs no pass, and counts kept anywhere else would stay
0 although the code served is fused. Only what is added while Inductor compiles the graph
(`codegen_and_compile`, where the post-grad pass runs) is replayed: the pre-grad and joint-graph stages
run before that window (and not at all on an AOTAutograd cache hit), so their fusions are held back and
counted when the post-grad stage of the same compile starts (`begin_stage`). MLAPass installed in an
early slot alone (the backend and `inductor_options()` install all three) therefore counts nothing.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Optional

from torch._dynamo.utils import counters
from torch._inductor.pattern_matcher import Match

from . import config as mla_config

_COUNTER_PREFIX = "mla_inductor."


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
# The stages that run before Inductor's compile window, in their order.
_EARLY_STAGES = ("pre_grad", "joint")
# (stage, fusion) of this compile's early stages, counted when its post-grad stage starts
_held_back: list[tuple[str, str]] = []


def events_since(start: int) -> list[Event]:
    return _events[start:]


def event_count() -> int:
    return len(_events)


def fusion_counts() -> dict[str, int]:
    """How many subgraphs each fusion replaced since the last `reset_counts()`, by public name,
    whether the compiles ran or were served from Inductor's caches."""
    recorded = counters["inductor"]
    return {name: recorded[_COUNTER_PREFIX + name] for name in mla_config.FUSIONS}


def reset_counts() -> None:
    for name in mla_config.FUSIONS:
        counters["inductor"].pop(_COUNTER_PREFIX + name, None)
    _events.clear()
    _held_back.clear()


def begin_stage(stage: str) -> None:
    """Called by MLAPass before it runs a stage of a compile (see the module's docstring). A compile runs
    the pre-grad stage first, then the joint one: what an earlier stage of the same kind left held back
    belongs to a compile whose post-grad stage never ran (a cache hit) and is dropped."""
    if stage in _EARLY_STAGES:
        dropped = _EARLY_STAGES[_EARLY_STAGES.index(stage):]  # this stage and the ones after it
        _held_back[:] = [(s, fusion) for s, fusion in _held_back if s not in dropped]
    else:
        for _, fusion in _held_back:
            counters["inductor"][_COUNTER_PREFIX + fusion] += 1
        _held_back.clear()


def _count(fusion: str, stage: str) -> None:
    if stage in _EARLY_STAGES:
        _held_back.append((stage, fusion))
    else:
        counters["inductor"][_COUNTER_PREFIX + fusion] += 1


def record_fired(fusion: str, where: str, node: str, stage: str) -> None:
    """Count a fusion found by a graph walk rather than by a pattern's check."""
    _events.append(Event(fusion, where, node, stage))
    _count(fusion, stage)


def record_decision(fusion: str, nodes, stage: str, reason: Optional[str]) -> None:
    """Record what a graph walk decided about a candidate (its anchor last in `nodes`): fired
    (reason None, counted) or a near miss and why."""
    nodes = list(nodes)
    if reason is None:
        record_fired(fusion, module_path(nodes), nodes[-1].name, stage)
    else:
        _events.append(Event(fusion, module_path(nodes), nodes[-1].name, stage, reason))


class NotACandidate(str):
    """A check's reason for a match that is no candidate at all: a pattern whose branches are alike (the
    q and k projections) also matches with them bound the other way round. Rejected without a record,
    so that explain() does not list a near miss where the fusion fired."""


def checked(fusion: str, stage: str, check: Callable[[Match], Optional[str]]) -> Callable[[Match], bool]:
    """Turn `check(match) -> reason | None` into an `extra_check` that records and counts."""

    def extra_check(match: Match) -> bool:
        if not mla_config.active().enabled(fusion):
            return False
        reason = check(match)
        if isinstance(reason, NotACandidate):
            return False
        output = match.output_node()
        _events.append(Event(fusion, module_path(match.nodes), output.name, stage, reason))
        if reason is None:
            # The matcher applies the replacement right after a successful extra_check.
            _count(fusion, stage)
            return True
        return False

    return extra_check


def module_path(nodes) -> str:
    """Longest common module path of the nodes, e.g. `model.layers.0.self_attn`."""
    paths = []
    for node in nodes:
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
