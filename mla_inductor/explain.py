"""`explain()`: compile a function, run it once, and say which fusions fired where and why each
rejected candidate was turned down (the record the patterns write while the pass runs: record.py).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from . import config as mla_config
from . import record
from .backend import mla_inductor_backend
from .record import Event


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
    start = record.event_count()
    compile_kwargs.setdefault("backend", _FreshBackend(mla_inductor_backend))
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(
        enable_autograd_cache=False
    ):
        compiled = torch.compile(fn, **compile_kwargs)
        with torch.no_grad():
            compiled(*example_inputs)
    events = record.events_since(start)
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
